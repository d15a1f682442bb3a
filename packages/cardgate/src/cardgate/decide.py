"""Gate stage 3: from the run's typed results to item verdicts, checks and one decision."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from cardgate.card import Card, Item
from cardgate.claims import uncompared_metric_checks
from cardgate.hardware import hardware_key
from cardgate.outcome import Check, GateOutcome, ItemVerdict, Phase, RedFailure, Verdict, worst
from cardgate.preflight import Preflight
from cardgate.provenance import collection_checks, inventory_checks, provenance_checks
from cardgate.run import Metric, RunResult, StaticTest, TestPhase
from cardgate.thresholds import GateResult, evaluate
from cardgate.verify import RedEvidence, red_evidence


@dataclass(frozen=True)
class NodeResult:
    """One test, all phases combined."""

    nodeid: str
    status: Verdict
    reason: str
    ran: bool
    failed_by_assertion: bool


def node_results(run: RunResult, timeout: float | None = None) -> dict[str, NodeResult]:
    """Every phase counts: a test id that ran twice fails if either run failed, a phase
    that raised fails even when its report says `passed` (a plugin rewrote it), and a phase
    that took longer than `timeout` fails whatever pytest said (its alarm was cancelled)."""
    by_node: dict[str, list[TestPhase]] = {}
    for p in run.phases:
        by_node.setdefault(p.nodeid, []).append(p)
    out: dict[str, NodeResult] = {}
    for nodeid, recs in by_node.items():
        slow = [p for p in recs if timeout and p.outcome == "passed" and p.duration > timeout]
        if slow:
            s = slow[0]
            reason = (
                f"{nodeid} {s.when}: ran {s.duration:.1f} s, longer than the card's Timeout: "
                f"{timeout:g} s (measured after the run: the test's alarm did not stop it)"
            )
            out[nodeid] = NodeResult(nodeid, Verdict.FAIL, reason, True, False)
            continue
        failed = [p for p in recs if p.outcome == "failed" or _contradicts(p)]
        skipped = [p for p in recs if p.outcome == "skipped"]
        calls = [p for p in recs if p.when == "call"]
        assertion = any(
            p.when == "call" and (p.failure or "").startswith("assertion") for p in failed
        )
        runs = f" (ran {len(calls)} times)" if len(calls) > 1 else ""
        if failed:
            f = failed[0]
            why = failure_line(f.message)
            if _contradicts(f):
                why = f"the report says passed but the test raised ({f.failure}): {why}"
            reason = f"{nodeid} {f.when}{runs}: {why}"
            out[nodeid] = NodeResult(nodeid, Verdict.FAIL, reason, True, assertion)
        elif skipped:
            s = skipped[0]
            what = "xfail" if s.wasxfail else "skipped"
            out[nodeid] = NodeResult(
                nodeid, Verdict.HOLD, f"{nodeid} {what}: {s.message.strip()}", True, False
            )
        elif any(c.wasxfail for c in calls):
            out[nodeid] = NodeResult(nodeid, Verdict.HOLD, f"{nodeid} xpassed", True, False)
        elif calls and all(c.outcome == "passed" for c in calls):
            out[nodeid] = NodeResult(nodeid, Verdict.PASS, nodeid, True, False)
        else:
            out[nodeid] = NodeResult(nodeid, Verdict.HOLD, f"{nodeid}: no result", False, False)
    return out


def failure_line(message: str | None) -> str:
    """A failure's message in one line (300 characters at most): its first line (the exception
    and its message) and, for a rewritten assertion, the `assert` line after it, not pytest's
    "+ where" explanations of the parts."""
    lines = [ln.strip() for ln in (message or "").strip().splitlines() if ln.strip()]
    if not lines:
        return "failed"
    head = lines[0]
    asserted = next((ln for ln in lines[1:2] if ln.startswith("assert ")), None)
    return (head if asserted is None else f"{head} | {asserted}")[:300]


def _contradicts(phase: TestPhase) -> bool:
    return phase.outcome == "passed" and phase.failure is not None


def _base(nodeid: str) -> str:
    """A node id without its parameters (`f.py::test_x[1]` -> `f.py::test_x`)."""
    head, sep, last = nodeid.rpartition("::")
    return head + sep + last.split("[", 1)[0]


def unrun_static_tests(run: RunResult, nodes: dict[str, NodeResult]) -> list[StaticTest]:
    """Bound test functions of the static scan that no test which ran is: a test ran as one
    when it is defined in the same file within the function's lines (decorators included; a
    later `def` of the same name is defined elsewhere), or, where the report has no line, when
    its node id names it."""
    lines: dict[str, list[int]] = {}
    unplaced: set[str] = set()
    for p in run.phases:
        node = nodes.get(p.nodeid)
        if node is None or not node.ran:
            continue
        if p.path is not None and p.line is not None:
            lines.setdefault(p.path, []).append(p.line)
        else:
            unplaced.add(_base(p.nodeid))
    return [
        t
        for t in run.static_tests
        if not any(t.first <= line <= t.last for line in lines.get(t.path, ()))
        and t.nodeid not in unplaced
    ]


def uncollected_bindings(
    card: Card, verdicts: list[ItemVerdict], run: RunResult, nodes: dict[str, NodeResult]
) -> list[ItemVerdict]:
    """An item bound (by the static scan of the commit) in a file the run did not collect
    fails: its test was hidden by an --ignore, a collect_ignore or a path outside testpaths.
    So does an item with a statically bound test function that did not run (shadowed by a
    later `def` of the same name, deselected by a conftest hook, left out by an ini's
    `python_functions`...): it holds instead when the caller narrowed the run (`-k`)."""
    collected = {n.split("::", 1)[0] for nodes_ in run.bound.values() for n in nodes_}
    missing: dict[str, list[str]] = {}
    for path, key in run.static_bindings:
        if path not in collected:
            missing.setdefault(key, []).append(path)
    unrun: dict[str, list[StaticTest]] = {}
    for test in unrun_static_tests(run, nodes):
        if test.path in collected:  # a file never collected is named once, above
            unrun.setdefault(test.key, []).append(test)
    status = Verdict.HOLD if run.narrowed else Verdict.FAIL
    out = []
    for v in verdicts:
        if v.key in missing:
            v = replace(
                v,
                status=Verdict.FAIL,
                reason=v.reason + f"; bound in {', '.join(missing[v.key])} (static scan) "
                "but not collected",
            )
        if v.key in unrun:
            tests = unrun[v.key]
            shown = ", ".join(f"{t.nodeid} (line {t.first})" for t in tests[:3])
            more = f" (+{len(tests) - 3} more)" if len(tests) > 3 else ""
            v = replace(
                v,
                status=worst([v.status, status]),
                reason=v.reason + f"; bound test {shown}{more} (static scan of the commit) did "
                "not run: shadowed by a later definition of the same name, deselected or not "
                "collected",
            )
        out.append(v)
    return _reparent(card, out)


def marker_hint(card: Card, item: Item) -> str:
    return f'@pytest.mark.card("{card.id}", "{item.key}")'


def _leaf(
    card: Card, item: Item, bound: tuple[str, ...], nodes: dict[str, NodeResult], phase: Phase
) -> tuple[Verdict, str] | None:
    if item.manual:
        if item.checked:
            return Verdict.PASS, "manual item, ticked by a person"
        return Verdict.HOLD, "manual item: tick it by hand once done"
    if not bound:
        return None
    missing = [n for n in bound if n not in nodes or not nodes[n].ran]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        return (
            Verdict.HOLD,
            f"bound test did not run (deselected or not collected): {missing[0]}{more}",
        )
    results = [nodes[n] for n in bound]
    failed = [r for r in results if r.status is Verdict.FAIL]
    held = [r for r in results if r.status is Verdict.HOLD]
    if phase is Phase.RED:
        if held:
            return Verdict.HOLD, held[0].reason + " (missing evidence)"
        not_assert = [r for r in failed if not r.failed_by_assertion]
        if not_assert:
            return (
                Verdict.FAIL,
                f"red must fail by assertion in the test, not: {not_assert[0].reason}",
            )
        if failed:
            return (
                Verdict.PASS,
                f"red: {len(failed)}/{len(results)} failing by assertion as expected",
            )
        return (
            Verdict.FAIL,
            f"not red: all {len(results)} bound tests pass before the implementation",
        )
    if failed:
        return Verdict.FAIL, failed[0].reason
    if held:
        return Verdict.HOLD, held[0].reason + " (missing evidence)"
    return Verdict.PASS, f"{len(results)} passed"


def judge_items(
    card: Card, run: RunResult, nodes: dict[str, NodeResult], phase: Phase, only: set[str] | None
) -> list[ItemVerdict]:
    verdicts: dict[str, ItemVerdict] = {}

    def depth(item: Item) -> int:
        return 0 if item.parent is None else 1 + depth(card.items[item.parent])

    def judge(key: str) -> ItemVerdict:
        item = card.items[key]
        bound = run.bound.get(key, ())
        own = _leaf(card, item, bound, nodes, phase)
        statuses: list[Verdict] = []
        reasons: list[str] = []
        hint = ""
        if own is not None:
            statuses.append(own[0])
            reasons.append(own[1])
        children = [judge(c) for c in item.children if only is None or c in only]
        for child in children:
            verdicts[child.key] = child
        if children:
            bad = [c for c in children if c.status is not Verdict.PASS]
            statuses.append(worst([c.status for c in children]))
            reasons.append(
                f"{len(children) - len(bad)}/{len(children)} children satisfied"
                + (f" ({bad[0].key}: {bad[0].status.value})" if bad else "")
            )
        if not statuses:
            statuses, reasons = [Verdict.HOLD], ["unbound: no test is bound to this item"]
            hint = marker_hint(card, item)
        return ItemVerdict(
            key=key,
            text=item.text,
            status=worst(statuses),
            reason="; ".join(reasons),
            depth=depth(item),
            phase=item.phase,
            manual=item.manual,
            tests=tuple(sorted(bound)),
            hint=hint,
        )

    for key, item in card.items.items():
        if item.parent is None and (only is None or key in only):
            verdicts[key] = judge(key)
    return [verdicts[k] for k in card.items if k in verdicts]


def _reparent(card: Card, verdicts: list[ItemVerdict]) -> list[ItemVerdict]:
    """Parents take the worst of themselves and their children again (after later rules)."""
    by_key = {v.key: v for v in verdicts}
    for v in reversed(verdicts):
        item = card.items[v.key]
        kids = [by_key[c] for c in item.children if c in by_key]
        if kids:
            status = worst([v.status, *(k.status for k in kids)])
            if status is not v.status:
                bad = next(k for k in kids if k.status is status)
                by_key[v.key] = replace(
                    v, status=status, reason=v.reason + f"; child {bad.key}: {status.value}"
                )
    return [by_key[v.key] for v in verdicts]


def _earlier_reds(verdicts: list[ItemVerdict], reds: RedEvidence) -> list[ItemVerdict]:
    """A red run over a card whose other Red items have a red record at an earlier commit
    already: those are proven (their tests pass by now, as they should), not judged again;
    unless every Red item has one, then all are judged (nothing new to prove red)."""
    if all(v.key in reds.found for v in verdicts):
        return verdicts
    return [
        replace(v, status=Verdict.PASS, reason=f"red record at {reds.found[v.key][-1]} already")
        if v.key in reds.found
        else v
        for v in verdicts
    ]


def apply_red_rule(card: Card, verdicts: list[ItemVerdict], reds: RedEvidence) -> list[ItemVerdict]:
    out = []
    for v in verdicts:
        item = card.items[v.key]
        if item.phase != "red" or item.manual or item.children:
            out.append(v)
        elif v.key in reds.found:
            note = "".join(f"; {n}" for n in reds.notes.get(v.key, ()))
            out.append(replace(v, reason=v.reason + f"; red at {reds.found[v.key][-1]}{note}"))
        elif v.status is Verdict.PASS:
            why = f" ({reds.why_not(v.key)})" if reds.rejected else ""
            out.append(
                replace(
                    v,
                    status=Verdict.HOLD,
                    reason=v.reason + "; no valid red record at an earlier commit"
                    f" (run --phase red first){why}",
                )
            )
        else:
            out.append(v)
    return _reparent(card, out)


def metric_checks(run: RunResult) -> tuple[dict[str, float], list[Metric], list[Check]]:
    """Each metric must be recorded once; a duplicate fails the gate (deterministic)."""
    metrics = [m for p in run.phases for m in p.metrics]
    seen: dict[str, list[Metric]] = {}
    for m in metrics:
        seen.setdefault(m.name, []).append(m)
    checks = [
        Check(
            f"metric {name}",
            Verdict.FAIL,
            f"recorded {len(ms)} times ({', '.join(sorted(m.nodeid for m in ms))}): "
            "a metric must be recorded by exactly one test",
        )
        for name, ms in sorted(seen.items())
        if len(ms) > 1
    ]
    values = {name: ms[0].value for name, ms in seen.items() if len(ms) == 1}
    return values, metrics, checks


def threshold_checks(pre: Preflight, results: list[GateResult]) -> list[Check]:
    checks = []
    for r in results:
        if r.status == "n/a":
            continue
        status = {"pass": Verdict.PASS, "fail": Verdict.FAIL}.get(r.status, Verdict.HOLD)
        checks.append(Check(f"gate {r.metric} {r.check}", status, r.message))
    if len(pre.gates) and not any(r.applicable for r in results):
        checks.append(Check("gates", Verdict.HOLD, "no gate rule matches this hardware"))
    return checks


def attribute_thresholds(
    verdicts: list[ItemVerdict], results: list[GateResult], metrics: list[Metric]
) -> list[ItemVerdict]:
    """A missed threshold fails the items bound to the test that recorded the metric."""
    out = list(verdicts)
    for result in results:
        if result.status != "fail":
            continue
        nodes = {m.nodeid for m in metrics if m.name == result.metric}
        out = [
            replace(v, status=Verdict.FAIL, reason=v.reason + f"; gate: {result.message}")
            if nodes.intersection(v.tests)
            else v
            for v in out
        ]
    return out


def run_checks(run: RunResult) -> list[Check]:
    checks = []
    if run.timed_out:
        limit = f" of {run.limit_s:g} s" if run.limit_s else ""
        checks.append(
            Check("pytest", Verdict.FAIL, f"pytest killed: the run exceeded its time limit{limit}")
        )
    elif run.returncode not in (None, 0, 1, 5):
        checks.append(Check("pytest", Verdict.FAIL, f"pytest exited {run.returncode}"))
    for nodeid, message in run.collection_errors:
        lines = message.strip().splitlines()
        checks.append(
            Check("collection", Verdict.FAIL, f"{nodeid}: {lines[-1] if lines else 'error'}")
        )
    return checks


def hardware_checks(manifest_hw: str, metrics_hw: str) -> list[Check]:
    """The hardware the gate saw (manifest) must be the hardware the tests saw (metrics)."""
    if manifest_hw == metrics_hw:
        return [Check("hardware", Verdict.PASS, f"{metrics_hw} (gate and tests agree)")]
    return [
        Check(
            "hardware",
            Verdict.FAIL,
            f"the tests saw {metrics_hw} but the gate sees {manifest_hw}: a fake torch or driver "
            "in the run? gates are keyed by hardware both agree on",
        )
    ]


def decide(pre: Preflight, run: RunResult, phase: Phase, where: Path | None = None) -> GateOutcome:
    """`where`: the clean room the run read its files from (still on disk)."""
    card = pre.card
    nodes = node_results(run, pre.timeout)
    only = set(pre.red_keys) if phase is Phase.RED else None
    verdicts = judge_items(card, run, nodes, phase, only)
    verdicts = uncollected_bindings(card, verdicts, run, nodes)
    reds = red_evidence(
        pre.root,
        card,
        pre.commit,
        run.bound,
        sources=run.sources(),
        test_sides=run.test_sides(),
        modules=run.inventory.modules,
        allow_changed=pre.allow_changed_tests,
    )
    if phase is Phase.RED:
        verdicts = _earlier_reds(verdicts, reds)
    values, metrics, checks = metric_checks(run)
    checks = [
        *pre.checks,
        *checks,
        *run_checks(run),
        *inventory_checks(run.inventory),
        *collection_checks(run),
        *provenance_checks(pre.root, pre.commit, run, where),
        *(hardware_checks(hardware_key(), run.hardware) if run.command else []),
    ]
    results: list[GateResult] = []
    red_failures: list[RedFailure] = []
    if phase is Phase.GREEN:
        results = evaluate(pre.gates, values, run.hardware)
        checks.extend(threshold_checks(pre, results))
        checks.extend(
            uncompared_metric_checks(
                card, pre.gates, [(m.name, m.nodeid) for m in metrics], run.bound, run.hardware
            )
        )
        verdicts = attribute_thresholds(verdicts, results, metrics)
        verdicts = _reparent(card, verdicts)
        verdicts = apply_red_rule(card, verdicts, reds)
    else:
        for v in verdicts:
            failing = [t for t in v.tests if t in nodes and nodes[t].failed_by_assertion]
            if failing and not card.items[v.key].children:
                red_failures.append(RedFailure(v.key, tuple(failing)))
    verdict = worst([*(v.status for v in verdicts), *(c.status for c in checks)])
    return GateOutcome(
        card_id=card.id,
        phase=phase,
        verdict=verdict,
        items=tuple(verdicts),
        checks=tuple(checks),
        thresholds=tuple(results),
        commit=pre.commit,
        dirty=pre.dirty,
        red_failures=tuple(red_failures),
    )
