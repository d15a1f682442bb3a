"""The Rust service's prompt encoding: `FastBpe` against `tokenizers`' encode, on a profile's prompts.

    python -m minisgl.benchmark.service_text [--model-path DIR] [--profile burst-256] \
        [--repeats 5] --out F.json [--plot F.png]

The profile's chat requests (the online benchmark's workload) are rendered by the service's own
chat template, then encoded by both encoders inside the service binary (`minisgl-cpu-service
text`, op `encode_bench`): cold (both piece caches cleared: a fresh server's first burst) and
warm (the same texts again), the encoders alternating first each repeat. Prints and records the
medians, the ratios and whether the ids were identical.
"""

from __future__ import annotations

import argparse
from typing import Any

from minisgl.benchmark.common import git_commit, machine_info, median, now_iso, write_json
from minisgl.benchmark.profiles import PROFILES, build_workload, get_profile
from minisgl.testing.text_cli import TextCli


def rendered_prompts(model_dir: str, profile_name: str) -> list[list[dict]]:
    """The profile's chat messages, as the online client sends them."""
    from transformers import AutoTokenizer

    from minisgl.benchmark.online import messages_for

    profile = get_profile(profile_name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    items = build_workload(profile, len(tok))
    return [messages_for(it, profile, tok) for it in items]


def answer(reply: dict[str, Any]) -> dict[str, Any]:
    if "error" in reply:
        raise RuntimeError(f"the service's text CLI: {reply['error']}")
    return reply


def summarize(bench: dict[str, Any]) -> dict[str, Any]:
    """Medians (ms), microseconds a token and the tokenizers / fast ratios of `encode_bench`."""
    out: dict[str, Any] = {}
    tokens = bench["tokens"]
    for phase in ("cold", "warm"):
        ms = {arm: median(s) * 1e3 for arm, s in bench[f"{phase}_s"].items()}
        out[phase] = {
            "ms": ms,
            "us_per_token": {arm: v * 1e3 / tokens for arm, v in ms.items()},
            "speedup": ms["tokenizers"] / ms["fast"] if ms["fast"] else None,
        }
    return out


def plot(path: str, summary: dict[str, Any], title: str) -> None:
    """Microseconds a token of each encoder, cold and warm, with the speedups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    phases = list(summary)
    for k, arm in enumerate(("tokenizers", "fast")):
        xs = [i + (k - 0.5) * 0.38 for i in range(len(phases))]
        ys = [summary[p]["us_per_token"][arm] for p in phases]
        ax.bar(xs, ys, width=0.38, label="tokenizers encode" if arm == "tokenizers" else "FastBpe")
    for i, p in enumerate(phases):
        top = max(summary[p]["us_per_token"].values())
        ax.text(i, top * 1.02, f"{summary[p]['speedup']:.2f}x", ha="center")
    ax.set_xticks(range(len(phases)), [f"{p} caches" for p in phases])
    ax.set_ylabel("us a prompt token (median)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", help="model dir (default: embedded)")
    ap.add_argument("--profile", default="burst-256", choices=sorted(PROFILES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True, help="result JSON path")
    ap.add_argument("--plot", help="PNG of the medians")
    args = ap.parse_args(argv)
    from minisgl.cpu_service import service_binary

    model_dir = args.model_path
    if model_dir is None:
        from minisgl.default_model import default_model_path

        model_dir = str(default_model_path())
    messages = rendered_prompts(model_dir, args.profile)
    cli = TextCli(service_binary(), model_dir)
    try:
        texts = [answer(cli.ask(op="chat", messages=m))["text"] for m in messages]
        bench = answer(cli.ask(op="encode_bench", texts=texts, repeats=args.repeats))
    finally:
        cli.close()
    summary = summarize(bench)
    write_json(args.out, {
        "kind": "service_text", "created": now_iso(), "git": git_commit(),
        "machine": machine_info(), "profile": args.profile, "repeats": args.repeats,
        "texts": bench["texts"], "tokens": bench["tokens"], "identical": bench["identical"],
        "fast_encoding": bench["fast_encoding"], "raw_s": {k: bench[k] for k in ("cold_s", "warm_s")},
        "summary": summary,
    })  # fmt: skip
    if args.plot:
        title = f"Rust service prompt encoding, {args.profile} ({bench['tokens']} tokens)"
        plot(args.plot, summary, title)
    print(f"{args.profile}: {bench['texts']} prompts, {bench['tokens']} tokens, "
          f"ids identical: {bench['identical']}, fast path: {bench['fast_encoding']}")  # fmt: skip
    for phase, s in summary.items():
        us = s["us_per_token"]
        print(f"{phase:<5} tokenizers {us['tokenizers']:.3f} us/token  FastBpe {us['fast']:.3f} "
              f"us/token  speedup {s['speedup']:.2f}x")  # fmt: skip
    return 0 if bench["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
