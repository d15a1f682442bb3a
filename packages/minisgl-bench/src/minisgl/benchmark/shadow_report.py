"""Summarize a CPU-backend shadow report (JSON lines written under MINISGL_CPU_BACKEND_SHADOW=1).

    python -m minisgl.benchmark.shadow_report --input F [--top 20] [--allow-missing] [--json]

Prints the number of divergences by decision kind (and field), then the first `--top`
examples. A missing input file is an error (exit 2) unless `--allow-missing`, in which case
it counts as a report with no divergences. Exit status 0 either way when the file is read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def summarize(lines: list[dict], top: int) -> dict:
    kinds = Counter(r.get("kind", "?") for r in lines)
    fields = Counter(f"{r.get('kind', '?')}.{r['field']}" for r in lines if "field" in r)
    backends = Counter(f"{r.get('primary_backend')}->{r.get('shadow_backend')}" for r in lines)
    return {
        "total": len(lines),
        "by_kind": dict(kinds.most_common()),
        "by_field": dict(fields.most_common()),
        "backends": dict(backends),
        "fallbacks": sum(1 for r in lines if r.get("fallback")),
        "examples": lines[:top],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Summarize a CPU backend shadow report")
    ap.add_argument("--input", required=True, help="JSONL report file")
    ap.add_argument("--top", type=int, default=20, help="examples to print")
    ap.add_argument("--allow-missing", action="store_true",
                    help="a missing file means no divergences")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    path = Path(args.input)
    if not path.exists():
        if not args.allow_missing:
            print(f"shadow report {path} does not exist", file=sys.stderr)
            return 2
        lines: list[dict] = []
    else:
        lines = []
        for i, raw in enumerate(path.read_text().splitlines(), 1):
            if not raw.strip():
                continue
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError as e:
                print(f"{path}:{i}: not JSON ({e})", file=sys.stderr)
                return 2
    s = summarize(lines, args.top)
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return 0
    print(f"shadow report {path}: {s['total']} divergences"
          + (" (file missing)" if not path.exists() else ""))  # fmt: skip
    for kind, n in s["by_kind"].items():
        print(f"  {kind:<16}{n:>8}")
    for field, n in s["by_field"].items():
        print(f"    {field:<24}{n:>8}")
    if s["fallbacks"]:
        print(f"  fallbacks to python: {s['fallbacks']}")
    for r in s["examples"]:
        print("  - " + json.dumps(r, default=str)[:400])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
