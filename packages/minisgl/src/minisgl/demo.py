"""Quick start demo: `python -m minisgl.demo` generates with the embedded model and prints tok/s."""

from __future__ import annotations

import argparse
import time


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-path", default=None, help="HF model directory (default: embedded)")
    ap.add_argument("--prompt", default="What is the capital of France?")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="requests in the throughput batch")
    args = ap.parse_args(argv)

    from minisgl import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model_path, max_seq_len_override=2048)
    print(
        f"model: {llm.config.model_path}  (loaded in {time.perf_counter() - t0:.1f}s, "
        f"device={llm.engine.device}, dtype={llm.engine.dtype})"
    )
    chat = [{"role": "user", "content": args.prompt}]
    out = llm.generate([chat], SamplingParams(max_tokens=args.max_tokens))[0]
    run = llm.last_run
    print(f"\n>>> {args.prompt}\n{out['text']}\n")
    print(
        f"[{len(out['token_ids'])} tokens, finish_reason={out['finish_reason']}, "
        f"{run['output_tokens'] / run['elapsed_s']:.1f} tok/s single request]"
    )
    prompts = [
        [{"role": "user", "content": f"Write a short poem about the number {i}."}]
        for i in range(args.batch)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params)
    run = llm.last_run
    print(
        f"[batch of {args.batch}: {run['output_tokens']} tokens in {run['elapsed_s']:.2f}s = "
        f"{run['output_tokens'] / run['elapsed_s']:.1f} tok/s]"
    )
    llm.scheduler.check_integrity()


if __name__ == "__main__":
    main()
