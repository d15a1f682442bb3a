"""The release gate: promote, hold or roll back a candidate against a baseline.

    python -m minisgl.benchmark.release_gate --baseline B --candidate C \
        [--policy worklog/gates/release.cpu.yaml] --out R.json \
        [--baseline-format auto|minisgl|vllm|sglang] [--candidate-format ...] \
        [--baseline-device D] [--candidate-device D] [--join auto|request_id|index]

B and C are observation files (`--observations` of the harness, `observations.py`) or result
files of `vllm bench serve --save-result --save-detailed` / SGLang `bench_serving
--output-file --output-details` (`release_adapters.py`; format detected unless given). The
join is by request id, or by index when either side comes from vLLM / SGLang (`auto`).
`--*-device` sets the device of an adapter's observations (those files do not record it).

Segments: the candidate's backend x device, and, when its observations name the replica that
served them (a `--dp N` server), each replica as well (`<backend>@<device> replica k`; the text
and JSON reports show the split).

Decision (`release_signals.py`): runs of different workloads -> mismatch; an output mismatch
or an error-rate increase -> rollback; latency regressions real at the policy's confidence
(bootstrap over >= 3 runs a side, `release_stats.py`; one point ratio with fewer runs),
KV-pressure regressions or too little matched traffic -> hold; a latency ratio the runs cannot
tell from noise -> insufficient; else promote.

Exit status: 0 promote, 1 hold, 2 rollback, 3 bad input (an unreadable or malformed
observations / result file, a bad policy, bad arguments), 4 mismatch (the two runs are of
different workloads: more than half the shared requests differ in prompt or lengths), 5
insufficient (with >= `latency.min_repeats` runs a side, a latency ratio above its threshold
that the runs cannot tell from noise: the detail says how many repeats would). R.json holds the decision, reasons,
every signal, per-segment summaries, triage items, counts, the policy and the inputs' hashes.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from minisgl.benchmark.common import now_iso, write_json
from minisgl.benchmark.observations import ObservationError
from minisgl.benchmark.release_adapters import FORMATS, load
from minisgl.benchmark.release_policy import Policy, PolicyError, load_policy
from minisgl.benchmark.release_signals import Evaluation, evaluate, triage

EXIT = {"promote": 0, "hold": 1, "rollback": 2, "mismatch": 4, "insufficient": 5}
BAD_INPUT = 3
REPORT_VERSION = 1


def sha256_of(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def reasons(ev: Evaluation) -> list[str]:
    failed = sorted((s for s in ev.signals if s.failed), key=lambda s: s.on_fail != "rollback")
    out = [f"{s.on_fail}: {s.name} [{s.segment}]: {s.detail}" for s in failed]
    return out or ["every signal within policy"]


def build_report(
    ev: Evaluation, args: argparse.Namespace, formats: dict[str, str], policy: Policy
) -> dict[str, Any]:
    inputs = {
        side: {
            "path": str(getattr(args, side)),
            "sha256": sha256_of(getattr(args, side)),
            "format": formats[side],
        }
        for side in ("baseline", "candidate")
    }
    policy_info: dict[str, Any] = {
        "source": policy.source,
        "sha256": sha256_of(args.policy) if args.policy else None,
        "base": asdict(policy.base),
        "scopes": [asdict(s) for s in policy.scopes],
    }
    return {
        "version": REPORT_VERSION,
        "kind": "release-gate",
        "created": now_iso(),
        "decision": ev.decision,
        "exit_code": EXIT[ev.decision],
        "reasons": reasons(ev),
        "join": args.join,
        "counts": ev.counts,
        "signals": [s.to_dict() for s in ev.signals],
        "segments": [seg.to_dict() for seg in ev.segments],
        "triage": triage(ev.signals),
        "policy": policy_info,
        "inputs": inputs,
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # usage errors are bad input: 3, not rollback
        self.print_usage(sys.stderr)
        self.exit(BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m minisgl.benchmark.release_gate",
        description="Promote, hold or roll back a candidate against a baseline (docs: "
        "docs/release_gate.md).",
        epilog="exit status: 0 promote, 1 hold, 2 rollback, 3 bad input",
    )
    p.add_argument("--baseline", required=True, type=Path, help="observations or result file")
    p.add_argument("--candidate", required=True, type=Path, help="observations or result file")
    p.add_argument("--policy", type=Path, default=None, help="policy YAML (default: built-in)")
    p.add_argument("--out", type=Path, default=None, help="report JSON")
    choices = ["auto", *FORMATS]
    p.add_argument("--baseline-format", choices=choices, default="auto")
    p.add_argument("--candidate-format", choices=choices, default="auto")
    p.add_argument("--baseline-device", default="unknown", help="device of adapter files")
    p.add_argument("--candidate-device", default="unknown", help="device of adapter files")
    p.add_argument(
        "--join",
        choices=["auto", "request_id", "index"],
        default="auto",
        help="auto: request_id when both sides are minisgl observations, else index",
    )
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        policy = load_policy(args.policy)
        fb, base = load(args.baseline, args.baseline_format, args.baseline_device)
        fc, cand = load(args.candidate, args.candidate_format, args.candidate_device)
        if args.join == "auto":
            args.join = "request_id" if fb == fc == "minisgl" else "index"
        ev = evaluate(base, cand, policy, args.join)
    except (ObservationError, PolicyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT
    report = build_report(ev, args, {"baseline": fb, "candidate": fc}, policy)
    if args.out:
        write_json(args.out, report)
    if not args.quiet:
        print_report(report)
        if args.out:
            print(f"wrote {args.out}")
    return EXIT[ev.decision]


def print_report(report: dict[str, Any]) -> None:
    c = report["counts"]
    print(
        f"release gate: {report['decision'].upper()} "
        f"(matched {c['matched']} request(s); missing {c['missing_in_candidate']} in the "
        f"candidate, {c['missing_in_baseline']} in the baseline; join by {report['join']})"
    )
    for seg in report["segments"]:
        if seg.get("replica") is not None:
            print(f"  segment {seg['name']}: {seg['decision']} "
                  f"({seg['summary']['requests']} request(s))")  # fmt: skip
            continue
        print(f"  segment {seg['name']}: {seg['decision']}")
        split = seg["summary"].get("replicas")
        if split:
            line = ", ".join(f"replica {e['replica']}: {e['requests']} request(s)"
                             for e in split["split"])  # fmt: skip
            left = split["unattributed_observations"]
            if left:
                line += f"; {left} observation(s) name no replica (judged only in the whole)"
            print(f"    split by replica: {line}")
    for item in report["triage"]:
        print(f"  [{item['response']}] {item['signal']} ({item['segment']}): {item['detail']}")
        print(f"      next: {item['next_action']}")


if __name__ == "__main__":
    sys.exit(main())
