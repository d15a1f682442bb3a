"""Markdown pages (and the files they link to) generated from a loaded `Site`.

`generate_site(root)` returns `Generated`: a mapping of docs-relative path -> content (str for
pages, bytes for charts and copied raw files) and the nav entries of the generated sections.
Paths mirror the repository where they copy a file (`worklog/evidence/<ID>/<run>/summary.json`)
so a link on the site names the file it shows.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sitegen import charts, kinds
from sitegen.data import Baseline, CardView, Run, Site
from sitegen.history import chart_groups, workload
from sitegen.site import load_site

BOARD_LANES = ("backlog", "todo", "in-progress", "done")  # left to right
LANE_TITLES = {"backlog": "Backlog", "todo": "To do", "in-progress": "In progress", "done": "Done"}
OUTCOME_ICON = {"pass": "✔", "fail": "✘", "hold": "◐"}  # in every font, unlike emoji
ITEM_ICON = {"pass": "✔", "fail": "✘", "hold": "◐", "checked": "☑", "open": "☐"}

BOARD_PAGE = "board.md"
CARDS_INDEX = "cards/index.md"
EVIDENCE_PAGE = "worklog/evidence.md"
BASELINES_PAGE = "worklog/baselines.md"
HISTORY_PAGE = "worklog/history.md"
RESEARCH_INDEX = "worklog/research/index.md"


@dataclass
class Generated:
    files: dict[str, str | bytes] = field(default_factory=dict)
    # docs path of a section's index page -> the generated pages under it (title, path)
    sections: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


def card_page(card_id: str) -> str:
    return f"cards/{card_id}.md"


def chart_path(metric: str, machine_class: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", f"{metric}-{machine_class}".lower()).strip("-")
    return f"charts/{slug}.png"


def rel(src: str, dst: str) -> str:
    """The relative link from docs page `src` to docs file `dst`."""
    src_dir = Path(src).parent
    parts = len(src_dir.parts) if str(src_dir) != "." else 0
    return "../" * parts + dst


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else ("yes" if value else "no")
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        v = value
        if v != v:  # NaN
            return "nan"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if abs(v) >= 10:
            return f"{v:.1f}"
        return f"{v:.3g}"
    return str(value)


def cell(text: Any) -> str:
    return fmt(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def short(commit: str) -> str:
    return commit[:7] if commit else "-"


def day(utc: str) -> str:
    return utc[:19].replace("T", " ") if utc else "-"


# --- board -----------------------------------------------------------------------------------


def _count_bar(view: CardView) -> str:
    counts = view.counts
    total = max(counts["bound"] + counts["unbound"] + counts["manual"], 1)
    parts = []
    for key in ("bound", "manual", "unbound"):
        if counts[key]:
            width = 100 * counts[key] / total
            parts.append(
                f'<span class="kb-bar-{key}" style="width:{width:.1f}%" '
                f'title="{counts[key]} {key}"></span>'
            )
    return f'<span class="kb-bar">{"".join(parts)}</span>'


def _gate_badge(view: CardView) -> str:
    last = view.last_gate
    if last is None:
        return '<span class="kb-gate kb-gate-none">never gated</span>'
    icon = OUTCOME_ICON.get(last.outcome, "?")
    return (
        f'<span class="kb-gate kb-gate-{html.escape(last.outcome)}">{icon} {last.outcome} '
        f"({last.phase}) · {day(last.utc)[:10]}</span>"
    )


def _verified_badge(view: CardView) -> str:
    if view.verified is None:
        return ""
    if view.verified:
        return '<span class="kb-verified" title="evidence verified">✔ verified</span>'
    flags = html.escape("; ".join(view.flags) or "not verified")
    return f'<span class="kb-flag" title="{flags}">⚠ unverified</span>'


def _board_tile(view: CardView) -> str:
    card = view.card
    deps = ", ".join(f"[{d}](cards/{d}.md)" for d in card.depends_on) or "none"
    counts = view.counts
    classes = ["kb-card", f"kb-lane-{view.lane}"]
    if view.verified is False:
        classes.append("kb-flagged")
    priority = html.escape(card.priority or "-")
    return (
        f'<div class="{" ".join(classes)}" data-card="{card.id}" markdown>\n'
        f'<span class="kb-prio kb-prio-{priority.lower()}">{priority}</span> '
        f"[**{card.id}**](cards/{card.id}.md) {_verified_badge(view)}\n"
        f'<span class="kb-title">{html.escape(card.title)}</span>\n'
        f"{_count_bar(view)}\n"
        f'<span class="kb-counts">{counts["bound"]} bound · {counts["unbound"]} unbound · '
        f"{counts['manual']} manual</span>\n"
        f"{_gate_badge(view)}\n"
        f'<span class="kb-deps">depends on: {deps}</span>\n'
        "</div>\n"
    )


def board_markdown(site: Site) -> str:
    views = {lane: [c for c in site.cards if c.lane == lane] for lane in BOARD_LANES}
    done = views["done"]
    unverified = [c for c in done if c.verified is False]
    out = [
        "---\nhide:\n  - navigation\n  - toc\n---\n",
        "# Board\n",
        '<div class="kb-summary" markdown>\n',
        " · ".join(f"**{len(views[lane])}** {LANE_TITLES[lane].lower()}" for lane in BOARD_LANES),
        f" · **{len(site.runs())}** gate runs recorded",
    ]
    if unverified:
        out.append(
            f' · <span class="kb-flag">⚠ {len(unverified)} done without verified evidence</span>'
        )
    out.append("\n</div>\n")
    out.append(
        "Generated from `kanban/` and `worklog/evidence/` when the site was built. Each card: "
        "priority, the bar of its checklist items (green bound to tests, blue manual, grey "
        "unbound), the last gate run and its dependencies. A done card without verifiable "
        "evidence is flagged ⚠ as the gate flags it.\n"
    )
    if site.errors:
        out.append(f'!!! failure "{len(site.errors)} board lint errors"\n')
        out += [f"    - `{e}`" for e in site.errors]
        out.append("")
    out.append('<div class="kb-board" markdown>\n')
    for lane in BOARD_LANES:
        out.append(f'<div class="kb-column" data-lane="{lane}" markdown>\n')
        out.append(
            f'<div class="kb-lane-title">{LANE_TITLES[lane]} '
            f'<span class="kb-lane-count">{len(views[lane])}</span></div>\n'
        )
        for view in views[lane]:
            out.append(_board_tile(view))
        out.append("</div>\n")
    out.append("</div>\n")
    return "\n".join(out)


def cards_index(site: Site) -> str:
    rows = []
    for view in site.cards:
        last = view.last_gate
        rows.append(
            [
                f"[{view.id}]({view.id}.md)",
                view.card.title,
                view.lane,
                view.card.priority,
                ", ".join(view.card.depends_on) or "-",
                f"{view.counts['bound']} / {view.counts['unbound']} / {view.counts['manual']}",
                f"{OUTCOME_ICON.get(last.outcome, '')} {last.outcome} {day(last.utc)[:10]}"
                if last
                else "-",
                {True: "✔", False: "⚠ " + "; ".join(view.flags), None: "-"}[view.verified],
            ]
        )
    return "# Cards\n\nEvery card of `kanban/`, in lane order.\n\n" + table(
        [
            "Card",
            "Title",
            "Lane",
            "Prio",
            "Depends on",
            "Bound / unbound / manual",
            "Last gate",
            "Verified",
        ],
        rows,
    )


# --- card pages --------------------------------------------------------------------------------


def _run_anchor(run: Run) -> str:
    return "run-" + re.sub(r"[^a-z0-9]+", "-", run.name.lower()).strip("-")


def _item_rows(view: CardView) -> list[list[Any]]:
    from sitegen.data import item_status

    rows = []
    for item in view.card.items.values():
        depth = 0
        parent = item.parent
        while parent is not None:
            depth += 1
            parent = view.card.items[parent].parent
        status = item_status(view, item)
        tests = view.static_tests.get(item.key, [])
        if item.children:
            bound = f"({len(item.children)} sub-items)"
        elif item.manual:
            bound = "manual"
        elif tests:
            bound = "<br>".join(f"`{t}`" for t in tests)
        else:
            bound = "**unbound**"
        where = item.section + (f" · {item.phase}" if item.phase else "")
        indent = "&emsp;" * depth
        rows.append(
            [f"{ITEM_ICON.get(status, '?')} {status}", f"{indent}{item.text}", where, bound]
        )
    return rows


def _run_section(view: CardView, run: Run, page: str) -> str:
    icon = OUTCOME_ICON.get(run.outcome, "?")
    out = [
        f'<div class="gate-run gate-{html.escape(run.outcome)}" id="{_run_anchor(run)}" markdown>\n',
        f"#### {icon} {day(run.utc)} UTC · {run.phase} · {run.outcome}\n",
        f"- commit `{short(run.commit)}` · machine: {run.machine} · GPU: {run.gpu or 'none'}",
        "- raw evidence: "
        + " · ".join(f"[{name}]({rel(page, f'{run.path}/{name}')})" for name in run.files),
        "",
    ]
    failing = [c for c in run.checks if c.get("status") != "pass"]
    if failing:
        out.append(
            table(
                ["Check", "Status", "Reason"],
                [[c.get("name"), c.get("status"), c.get("reason")] for c in failing],
            )
        )
    else:
        out.append(f"All {len(run.checks)} checks passed.\n")
    if run.gates:
        out.append(
            table(
                ["Metric", "Value", "Check", "Threshold", "Margin", "Status"],
                [
                    [
                        f"`{g.metric}`",
                        g.value,
                        g.check,
                        g.threshold,
                        f"{g.margin_pct:+.1f}%" if isinstance(g.margin_pct, int | float) else "-",
                        f"{OUTCOME_ICON.get(g.status, '')} {g.status}",
                    ]
                    for g in run.gates
                ],
            )
        )
    not_passed = [i for i in run.items if i.get("status") != "pass"]
    if not_passed:
        out.append(
            table(
                ["Item", "Status", "Reason"],
                [[i.get("key"), i.get("status"), i.get("reason")] for i in not_passed],
            )
        )
    out.append("</div>\n")
    return "\n".join(out)


def _card_text(view: CardView) -> str:
    lines = view.card.text.splitlines()
    body = []
    dropped_title = False
    for line in lines:
        if not dropped_title and line.startswith("# "):
            dropped_title = True
            continue
        if line.startswith("#"):
            line = "##" + line  # demote: the card's sections sit under "Card text"
        body.append(line)
    return "\n".join(body).strip() + "\n"


def card_markdown(site: Site, view: CardView, charts_for: dict[str, list[str]]) -> str:
    card = view.card
    page = card_page(card.id)
    deps = ", ".join(f"[{d}]({d}.md)" for d in card.depends_on) or "none"
    last = view.last_gate
    out = [
        f"# {card.id}: {card.title}\n",
        f"**Lane** {LANE_TITLES.get(view.lane, view.lane)} · **Priority** {card.priority or '-'} · "
        f"**Depends on** {deps} · **Items** {view.counts['bound']} bound, "
        f"{view.counts['unbound']} unbound, {view.counts['manual']} manual · "
        f"**Source** `{card.path}`\n",
    ]
    if last is not None:
        out.append(
            f"**Last gate** {OUTCOME_ICON.get(last.outcome, '')} {last.outcome} ({last.phase}) "
            f"{day(last.utc)} UTC at `{short(last.commit)}`\n"
        )
    if view.verified:
        out.append('!!! success "Verified"\n    The evidence of this card checks out.\n')
    elif view.verified is False:
        out.append('!!! warning "Not verified"\n')
        out += [f"    - {f}" for f in view.flags]
        out.append("")
    out.append("## Items\n")
    out.append(table(["Status", "Item", "Section", "Bound tests"], _item_rows(view)))
    out.append("## Gate history\n")
    if not view.runs:
        out.append("No gate run recorded yet (`nox -s card -- " + card.id + "`).\n")
    else:
        out.append(
            f"{len(view.runs)} run(s), oldest first: red -> green -> refactor as recorded "
            f"under `worklog/evidence/{card.id}/`.\n"
        )
        out.append('<div class="gate-timeline" markdown>\n')
        out += [_run_section(view, run, page) for run in view.runs]
        out.append("</div>\n")
    metrics = charts_for.get(card.id, [])
    if metrics:
        out.append("## Gated metrics across runs\n")
        out.append('<div class="chart-grid" markdown>\n')
        out += [f"![{path}]({rel(page, path)})\n" for path in sorted(metrics)]
        out.append("</div>\n")
    out.append("## Card text\n")
    out.append(_card_text(view))
    return "\n".join(out)


# --- evidence, baselines, history ----------------------------------------------------------------


def evidence_markdown(site: Site) -> str:
    rows = []
    for run in sorted(site.runs(), key=lambda r: r.utc, reverse=True):
        rows.append(
            [
                f"[{run.card_id}]({rel(EVIDENCE_PAGE, card_page(run.card_id))}#{_run_anchor(run)})",
                day(run.utc),
                run.phase,
                f"{OUTCOME_ICON.get(run.outcome, '')} {run.outcome}",
                f"`{short(run.commit)}`",
                run.machine_class,
                f"[{run.name}]({rel(EVIDENCE_PAGE, run.path + '/summary.json')})",
            ]
        )
    return (
        "# Evidence\n\nEvery gate run recorded under `worklog/evidence/`, newest first.\n\n"
        + table(["Card", "UTC", "Phase", "Outcome", "Commit", "Machine", "Record"], rows)
    )


_OFFLINE_ROWS = (
    ("output tok/s", "output_tok_s", None),
    ("total tok/s", "total_tok_s", None),
    ("requests/s", "request_s", None),
    ("output tok per CPU-s", "output_tok_per_cpu_s", None),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p99 ms", "ttft_ms", "p99"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("ITL p50 ms", "itl_ms", "p50"),
    ("e2e p99 ms", "e2e_ms", "p99"),
    ("sched step CPU p50 ms", "sched_step_cpu_ms", "p50"),
    ("sched step CPU p99 ms", "sched_step_cpu_ms", "p99"),
    ("prefix hit rate", "prefix_hit_rate", None),
    ("peak KV usage", "peak_kv_usage", None),
)


def _metric(metrics: dict[str, Any], key: str, q: str | None) -> Any:
    value = metrics.get(key)
    if q is not None:
        value = value.get(q) if isinstance(value, dict) else None
    return value


def baseline_table(baseline: Baseline) -> str:
    data = baseline.data
    results = data.get("results")
    summary = data.get("summary")
    if isinstance(summary, dict) and isinstance(summary.get("fair_share_ratio"), int | float):
        arms = {k: v for k, v in summary.items() if isinstance(v, dict)}  # benchmark.contention
        return table(
            ["arm", "quiet s", "loaded s", "loaded / quiet", "fair share"],
            [[a, v.get("quiet_s"), v.get("loaded_s"), v.get("loaded_over_quiet"),
              summary["fair_share_ratio"]] for a, v in arms.items()],
        )  # fmt: skip
    engines = {
        str(k): v["metrics"]
        for k, v in (results.items() if isinstance(results, dict) else [])
        if isinstance(v, dict) and isinstance(v.get("metrics"), dict)
    }
    if engines:
        ratio: dict[str, Any] = {}
        ratio_name = ""
        if isinstance(data.get("speedup_vs_hf"), dict):
            ratio, ratio_name = data["speedup_vs_hf"], "minisgl / HF"
        elif isinstance(data.get("ab_ratio"), dict) and data["ab_ratio"]:
            arm, ratio = next(iter(data["ab_ratio"].items()))
            ratio_name = f"{arm} / {next(iter(engines))}"
        header = ["metric", *engines, *([ratio_name] if ratio_name else [])]
        rows = []
        for label, key, q in _OFFLINE_ROWS:
            values = [_metric(m, key, q) for m in engines.values()]
            if all(v is None for v in values):
                continue
            extra = [ratio.get(key if q is None else f"{key}.{q}")] if ratio_name else []
            rows.append([label, *values, *extra])
        out = table(header, rows)
        paired = data.get("speedup_vs_hf_paired") or data.get("ab_ratio_paired")
        if isinstance(paired, dict) and paired:
            value = paired.get("output_tok_s")
            if value is None:
                arm, inner = next(iter(paired.items()))
                value = inner.get("output_tok_s") if isinstance(inner, dict) else None
            out += (
                f"\nPaired ratio of output tok/s (median of per-repeat ratios): **{fmt(value)}x**\n"
            )
        return out
    if isinstance(results, list) and results and all(isinstance(r, dict) for r in results):
        keys = list(dict.fromkeys(k for r in results for k in r))
        return table(keys, [[r.get(k) for k in keys] for r in results])
    if isinstance(results, dict) and results and all(isinstance(r, dict) for r in results.values()):
        rows = []
        for name, r in results.items():
            for side, values in r.items():
                if isinstance(values, dict):
                    rows.append(
                        [name, side, *[values.get(k) for k in ("bytes", "roundtrip_us", "iters")]]
                    )
                else:
                    rows.append([name, side, values, "", ""])
        return table(["message", "side", "bytes", "round trip us", "iters"], rows)
    sets = charts.parity_sets(data)
    if sets is not None:
        sides = data.get("sides") if isinstance(data.get("sides"), dict) else {}
        labels = " vs ".join(
            str(s.get("label", k)) for k, s in sides.items() if isinstance(s, dict)
        )
        rows = [[name, s.get("prompts"), s.get("mismatch_count")] for name, s in sets.items()]
        return (
            f"Sides: {labels or '-'} · parity passed: **{fmt(data.get('parity_passed'))}**\n\n"
            + table(["prompt set", "prompts", "mismatches"], rows)
        )
    scalars = [[k, v] for k, v in data.items() if isinstance(v, int | float | str)]
    return table(["field", "value"], scalars)


def _machine_line(data: dict[str, Any]) -> str:
    machine = data.get("machine")
    if not isinstance(machine, dict):
        return "-"
    gpu = machine.get("gpu")
    gpu_text = gpu.get("name") if isinstance(gpu, dict) else gpu
    cpu = machine.get("cpu") or machine.get("processor") or machine.get("platform") or "?"
    cores = machine.get("cpu_count_logical") or machine.get("cpus")
    load = machine.get("loadavg_start")
    parts = [f"{cpu}" + (f" ({cores} cores)" if cores else ""), f"GPU: {gpu_text or 'none'}"]
    if isinstance(load, list) and load:
        parts.append(f"load {fmt(load[0])} at start")
    return ", ".join(parts)


def baseline_section(baseline: Baseline, plot_path: str | None) -> str:
    data = baseline.data
    git = data.get("git") if isinstance(data.get("git"), dict) else {}
    out = [
        f"## {baseline.name}\n",
        f"**{workload(data)}** · kind `{baseline.kind}` · created {day(str(data.get('created', '')))} · "
        f"commit `{short(str(git.get('commit', '')))}`"
        + (" (dirty tree)" if git.get("dirty") else "")
        + f" · machine: {_machine_line(data)} · [raw JSON]({rel(BASELINES_PAGE, baseline.path)})\n",
    ]
    argv = data.get("argv")
    if isinstance(argv, list) and argv:
        out.append("```\n" + " ".join(str(a) for a in argv) + "\n```\n")
    out.append(baseline_table(baseline))
    gates = data.get("gates")
    if isinstance(gates, dict) and isinstance(gates.get("results"), list):
        out.append(
            f"Gates ({', '.join(gates.get('files', []))}): "
            f"**{'passed' if gates.get('passed') else 'NOT passed'}**\n"
        )
        out.append(
            table(
                ["metric", "check", "value", "threshold", "status"],
                [
                    [
                        f"`{g.get('metric')}`",
                        g.get("check"),
                        g.get("value"),
                        g.get("threshold"),
                        g.get("status"),
                    ]
                    for g in gates["results"]
                    if isinstance(g, dict)
                ],
            )
        )
    if plot_path:
        out.append(f"![{baseline.name}]({rel(BASELINES_PAGE, plot_path)})\n")
    if baseline.notes:
        out.append('??? note "Notes recorded with this baseline"\n')
        out += ["    " + line for line in baseline.notes.splitlines()]
        out.append("")
    return "\n".join(out)


def history_markdown(site: Site, groups: dict[tuple[str, str], list]) -> str:
    out = [
        "# History of headline metrics\n",
        "One chart per metric and machine class (CPU, or the GPU's name), across the commits "
        "the numbers were measured at. Baseline workloads come from every committed version of "
        "`worklog/baselines/*.json` (git history); gated metrics come from every evidence run, "
        "with the gate's threshold dashed. Compare values within one machine class only.\n",
    ]
    classes = sorted({mc for _, mc in groups})
    for machine_class in classes:
        out.append(f"## {machine_class}\n")
        keys = sorted(k for k in groups if k[1] == machine_class)
        for kind, title in (("baseline", "Benchmark workloads"), ("gate", "Gated card metrics")):
            mine = [
                k
                for k in keys
                if any((p.threshold is None) == (kind == "baseline") for p in groups[k])
            ]
            if not mine:
                continue
            out.append(f"### {title}\n")
            for metric, mc in mine:
                points = groups[(metric, mc)]
                commits = len({p.commit for p in points})
                out.append(f"#### `{metric}`\n")
                out.append(
                    f"{len(points)} values at {commits} commit(s): "
                    + ", ".join(sorted({p.series for p in points}))
                    + "\n"
                )
                out.append(f"![{metric} on {mc}]({rel(HISTORY_PAGE, chart_path(metric, mc))})\n")
    return "\n".join(out)


def research_pages(site: Site) -> tuple[dict[str, str], list[tuple[str, str]]]:
    pages: dict[str, str] = {}
    entries: list[tuple[str, str]] = []
    for path in site.research:
        text = path.read_text(encoding="utf-8")
        title = next((ln[2:].strip() for ln in text.splitlines() if ln.startswith("# ")), path.stem)
        target = f"worklog/research/{path.name}"
        pages[target] = text
        entries.append((title, target))
    index = ["# Research notes\n", "Design notes kept in `worklog/research/`.\n"]
    index += [f"- [{title}]({Path(target).name})" for title, target in entries]
    pages[RESEARCH_INDEX] = "\n".join(index) + "\n"
    return pages, entries


def generate(site: Site) -> Generated:
    gen = Generated()
    files = gen.files
    files[BOARD_PAGE] = board_markdown(site)
    files[CARDS_INDEX] = cards_index(site)
    # charts first: card pages embed theirs
    groups = chart_groups(site.history)
    charts_for: dict[str, list[str]] = {}
    for (metric, machine_class), points in groups.items():
        path = chart_path(metric, machine_class)
        files[path] = charts.history_chart(metric, machine_class, points)
        for card_id in {p.series for p in points if p.threshold is not None}:
            charts_for.setdefault(card_id, []).append(path)
    for view in site.cards:
        files[card_page(view.id)] = card_markdown(site, view, charts_for)
        for run in view.runs:
            for name in run.files:
                files[f"{run.path}/{name}"] = (site.root / run.path / name).read_bytes()
    files[EVIDENCE_PAGE] = evidence_markdown(site)
    sections = []
    readme = site.root / "worklog" / "baselines" / "README.md"
    intro = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    for baseline in site.baselines:
        files[baseline.path] = json.dumps(baseline.data, indent=2).encode()
        plot = baseline.plot
        if plot is not None:
            files[plot] = (site.root / plot).read_bytes()
        else:
            drawn = charts.baseline_chart(baseline)
            if drawn is not None:
                plot = f"charts/baseline-{baseline.name}.png"
                files[plot] = drawn
        sections.append(baseline_section(baseline, plot))
    contents = "\n".join(
        f"- [{b.name}](#{b.name.lower()}) · {workload(b.data)}" for b in site.baselines
    )
    files[BASELINES_PAGE] = (
        "# Benchmark baselines\n\n"
        f"Every recorded baseline of `worklog/baselines/` ({len(site.baselines)} files), each "
        "with its table and plot (the recorded PNG, or one drawn at build time). History across "
        f"commits: [History]({Path(HISTORY_PAGE).name}); per CPU kind, its last green commit and "
        f"ratios: [CPU kinds]({Path(kinds.KINDS_PAGE).name}).\n\n"
        + contents
        + "\n\n"
        + (
            '??? abstract "Where we stand (worklog/baselines/README.md)"\n'
            + "\n".join("    " + ln for ln in _demote(intro).splitlines())
            + "\n\n"
            if intro
            else ""
        )
        + "\n".join(sections)
    )
    files[HISTORY_PAGE] = history_markdown(site, groups)
    files.update(kinds.kinds_pages(site.root))
    research, entries = research_pages(site)
    files.update(research)
    gen.sections[CARDS_INDEX] = [(f"{v.id} {v.card.title}", card_page(v.id)) for v in site.cards]
    gen.sections[RESEARCH_INDEX] = entries
    return gen


def _demote(text: str) -> str:
    """Headings as bold lines: the text sits in a collapsed block, out of the page's TOC."""
    return "\n".join(
        (f"**{ln.lstrip('#').strip()}**" if ln.startswith("#") else ln) for ln in text.splitlines()
    )


def generate_site(root: Path | str) -> Generated:
    return generate(load_site(root))
