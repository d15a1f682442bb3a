"""CPU microbenchmark: the Python reference vs the Rust hot path, in one process.

    python -m minisgl.benchmark.micro --out micro.json [--repeats 3] [--quick]
    python -m minisgl.benchmark.micro --launches --out launches.json

`--launches` (no extension needed): kernel launches of one decode layer per architecture,
through the fused Triton ops and through the torch ops, counted on the CPU
(`testing/launches.py`: ATen ops that run a kernel plus Triton launches, the fused ops in
Triton's interpreter), against issue 36's budget.

Workloads (issue 4):
- radix insert / match (hit, partial) / evict on 10,000 token sequences of length 64-512
  built from shared prefixes (20 system prompts -> 200 conversation prefixes -> random
  suffixes), page sizes 1 and 16. Rust is timed per call (one crossing per sequence, the
  `PrefixCache` adapter) and batched (one crossing for all sequences).
- admission of 10,000 requests under a prefill budget of 8192 tokens with eviction active
  (a KV pool far smaller than the workload), no model: schedule + commit until drained.
- full scheduler CPU time per decode step at batch 1, 64 and 256 (no model): schedule +
  commit, Python<->Rust crossing included, plus the `LLM.step` glue (per-row params lists).

Medians over repeats; the table prints the Python/Rust ratio of each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from minisgl.core import SamplingParams
from minisgl.kvcache import RadixCache


def make_workload(n: int, seed: int = 0, vocab: int = 32000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, vocab, size=rng.integers(32, 96)) for _ in range(20)]
    convs = [
        np.concatenate([systems[i % 20], rng.integers(3, vocab, size=rng.integers(16, 160))])
        for i in range(200)
    ]
    out = []
    for _ in range(n):
        conv = convs[rng.integers(0, 200)]
        total = int(rng.integers(64, 513))
        if total <= len(conv):
            total = len(conv) + int(rng.integers(1, 64))
        total = min(total, 512)
        seq = np.concatenate([conv, rng.integers(3, vocab, size=max(total - len(conv), 0))])
        out.append(seq[:total].astype(np.int32))
    return out


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# ---------------------------------------------------------------------- radix
EVICT_CHUNKS = 20  # radix evict: the whole cache in this many calls


@dataclass(frozen=True)
class RadixInputs:
    """A radix workload at one page size: the sequences, the same cut to whole pages with
    their KV locations, half-matching variants, and the flat arrays + offsets of the batched
    calls."""

    seqs: list[np.ndarray]
    aligned: list[np.ndarray]
    locs: list[np.ndarray]
    partial: list[np.ndarray]
    flat_t: np.ndarray
    flat_l: np.ndarray
    offs: np.ndarray
    flat_p: np.ndarray
    offs_p: np.ndarray


def _offsets(seqs: list[np.ndarray]) -> np.ndarray:
    """The batched calls' offsets of `seqs` concatenated: [0, len0, len0 + len1, ...]."""
    offs = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum([len(s) for s in seqs], out=offs[1:])
    return offs


def _radix_inputs(seqs: list[np.ndarray], ps: int) -> RadixInputs:
    """The `RadixInputs` of `seqs` at page size `ps` (the partial suffixes from seed 1)."""
    aligned = [s[: len(s) // ps * ps] for s in seqs]
    rng = np.random.default_rng(1)
    partial = [
        np.concatenate([s[: len(s) // 2], rng.integers(3, 32000, size=len(s) - len(s) // 2)])
        .astype(np.int32)
        for s in seqs
    ]  # fmt: skip
    locs, off = [], 0
    for s in aligned:
        locs.append(np.arange(off, off + len(s), dtype=np.int32))
        off += len(s)
    return RadixInputs(
        seqs=seqs,
        aligned=aligned,
        locs=locs,
        partial=partial,
        flat_t=np.concatenate(aligned),
        flat_l=np.concatenate(locs),
        offs=_offsets(aligned),
        flat_p=np.concatenate(partial),
        offs_p=_offsets(partial),
    )


def _time_radix(w: RadixInputs, ps: int, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Seconds of every radix op (insert, match_hit, match_partial, evict) by implementation
    (python, rust per call, rust_batch), one entry a repeat."""
    from minisgl.testing.rust_hotpath import RustRadixCache

    res: dict[str, dict[str, list[float]]] = {}

    def rec(op: str, impl: str, secs: float) -> None:
        res.setdefault(op, {}).setdefault(impl, []).append(secs)

    for _ in range(repeats):
        for impl in ("python", "rust", "rust_batch"):
            c = RadixCache(ps) if impl == "python" else RustRadixCache(ps)
            if impl == "rust_batch":
                rec("insert", impl, _time(lambda c=c: c.insert_batch(w.flat_t, w.offs, w.flat_l)))
                rec("match_hit", impl, _time(lambda c=c: c.match_batch(w.flat_t, w.offs)))
                rec("match_partial", impl, _time(lambda c=c: c.match_batch(w.flat_p, w.offs_p)))
            else:
                rec("insert", impl, _time(lambda c=c: [c.insert(s, v) for s, v in zip(w.aligned, w.locs)]))  # fmt: skip
                rec("match_hit", impl, _time(lambda c=c: [c.match_prefix(s) for s in w.seqs]))
                rec("match_partial", impl, _time(lambda c=c: [c.match_prefix(s) for s in w.partial]))  # fmt: skip
            chunk = -(-c.evictable_size // EVICT_CHUNKS)
            rec(
                "evict", impl, _time(lambda c=c, k=chunk: [c.evict(k) for _ in range(EVICT_CHUNKS)])
            )
            assert c.evictable_size == 0
    return res


def _radix_row(op: str, by: dict[str, list[float]], n_seqs: int, ps: int) -> dict:
    """The table row of one radix op: each implementation's median seconds and the ratios."""
    py = _median(by["python"])
    rs = _median(by["rust"])
    row = {
        "workload": f"radix_{op}",
        "page_size": ps,
        "n": n_seqs if op != "evict" else EVICT_CHUNKS,
        "unit": "s per 10k sequences" if op != "evict" else f"s per {EVICT_CHUNKS} evicts",
        "python_s": py,
        "rust_s": rs,
        "ratio": py / rs,
    }
    if "rust_batch" in by:
        rb = _median(by["rust_batch"])
        row |= {"rust_batch_s": rb, "ratio_batch": py / rb}
    row["python_ops_per_s"] = n_seqs / py if op != "evict" else None
    return row


def bench_radix(seqs: list[np.ndarray], page_size: int, repeats: int) -> list[dict]:
    """One row per radix op (`_radix_row`) over `seqs` at `page_size`, medians of `repeats`."""
    res = _time_radix(_radix_inputs(seqs, page_size), page_size, repeats)
    return [_radix_row(op, by, len(seqs), page_size) for op, by in res.items()]


# ---------------------------------------------------------------------- scheduler
def _scheduler(backend: str, **kw):
    from minisgl.benchmark.backends import check_cpu_backend
    from minisgl.scheduler.backend import SchedulerConfig

    check_cpu_backend(backend)  # registers the in-process Rust arm
    from minisgl.scheduler.factory import make_scheduler

    return make_scheduler(SchedulerConfig(**kw), backend)


def bench_admission(seqs: list[np.ndarray], page_size: int, repeats: int) -> dict:
    kw = dict(num_pages=32768 // page_size, page_size=page_size, max_seq_len=1024,
              max_running_requests=256, max_extend_tokens=8192, cache_type="radix",
              eos_token_ids=[0])  # fmt: skip
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {"python": [], "rust_hotpath": []}
    info: dict[str, dict] = {}
    for _ in range(repeats):
        for backend in times:
            s = _scheduler(backend, **kw)
            for q in seqs:
                s.add_request(q, params)
            steps = 0
            t0 = time.perf_counter()
            while True:
                planned = s.schedule()
                if planned is None:
                    break
                plan, reqs = planned
                s.commit(reqs, plan, [1] * len(plan.sample_rows))
                steps += 1
            times[backend].append(time.perf_counter() - t0)
            s.check_integrity()
            info[backend] = {"steps": steps, "hit_rate": round(s.stats.prefix_hit_rate, 4),
                             "cached_tokens_end": s.kv_usage()["cached_tokens"]}  # fmt: skip
    assert info["python"] == info["rust_hotpath"], info
    py, rs = _median(times["python"]), _median(times["rust_hotpath"])
    return {"workload": "admission_10k", "page_size": page_size, "n": len(seqs),
            "unit": "s for all requests", "python_s": py, "rust_s": rs, "ratio": py / rs,
            **info["python"], "pool_tokens": 32768}  # fmt: skip


def bench_decode(seqs: list[np.ndarray], batch: int, page_size: int, repeats: int,
                 steps: int = 50) -> dict:  # fmt: skip
    kw = dict(num_pages=(batch * 1024) // page_size + 64, page_size=page_size,
              max_seq_len=1024, max_running_requests=max(batch, 1),
              max_extend_tokens=8192, cache_type="radix", eos_token_ids=[0])  # fmt: skip
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    out: dict[str, dict[str, list[float]]] = {}
    for _ in range(repeats):
        for backend in ("python", "rust_hotpath"):
            s = _scheduler(backend, **kw)
            for q in seqs[:batch]:
                s.add_request(q[:256], params)
            while True:  # prefill everything
                plan, reqs = s.schedule()
                s.commit(reqs, plan, [1] * len(plan.sample_rows))
                if not plan.is_prefill:
                    break
            sched_t, glue_t = [], []
            for i in range(steps):
                t0 = time.perf_counter()
                plan, reqs = s.schedule()
                tokens = [7 + i] * len(plan.sample_rows)
                outs = s.commit(reqs, plan, tokens)
                t1 = time.perf_counter()
                rows = plan.sample_rows.tolist()  # the LLM.step glue around sample()
                _params = [reqs[r].params for r in rows]
                _gens = [reqs[r].generator for r in rows]
                for _o in outs:
                    pass
                t2 = time.perf_counter()
                sched_t.append(t1 - t0)
                glue_t.append(t2 - t0)
            d = out.setdefault(backend, {"sched": [], "glue": []})
            d["sched"].append(_median(sched_t))
            d["glue"].append(_median(glue_t))
    py, rs = _median(out["python"]["sched"]), _median(out["rust_hotpath"]["sched"])
    pyg, rsg = _median(out["python"]["glue"]), _median(out["rust_hotpath"]["glue"])
    return {"workload": f"decode_step_bs{batch}", "page_size": page_size, "n": steps,
            "unit": "s per step (schedule+commit)", "python_s": py, "rust_s": rs,
            "ratio": py / rs, "python_with_llm_glue_s": pyg, "rust_with_llm_glue_s": rsg,
            "ratio_with_llm_glue": pyg / rsg, "context_len": "256 prompt + decode"}  # fmt: skip


def bench_launches(out: str) -> int:
    """Launches a decode layer, fused and through the torch ops, for each architecture."""
    import tempfile

    import torch

    if not torch.cuda.is_available():  # the fused ops run on a CPU in the interpreter only
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from minisgl.testing.launches import LAYER_BUDGET, decode_layer_launches

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, budget in LAYER_BUDGET.items():
            fused, ops = (decode_layer_launches(arch, f, tmp) for f in (True, False))
            rows.append({"arch": arch, "fused": fused.per_layer, "torch_ops": ops.per_layer,
                         "budget": budget, "within_budget": fused.per_layer <= budget,
                         "fused_by_kernel": fused.by_kernel})  # fmt: skip
    with open(out, "w") as f:
        json.dump({"tool": "micro.launches", "device": "cuda" if torch.cuda.is_available()
                   else "cpu", "results": rows}, f, indent=2)  # fmt: skip
    print(f"{'arch':<10}{'fused':>7}{'torch ops':>11}{'budget':>8}")
    for r in rows:
        print(f"{r['arch']:<10}{r['fused']:>7}{r['torch_ops']:>11}{r['budget']:>8}")
    return 0 if all(r["within_budget"] for r in rows) else 1


def _fmt(x: float) -> str:
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e6:.1f} us"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON results file")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1,000 sequences, 1 repeat (smoke)")
    ap.add_argument("--launches", action="store_true",
                    help="kernel launches of a decode layer per architecture instead")  # fmt: skip
    args = ap.parse_args(argv)
    if args.launches:
        return bench_launches(args.out)
    from minisgl.testing.rust_hotpath import extension

    minisgl_cpu = extension()  # the comparison needs the extension

    n = 1000 if args.quick else 10_000
    repeats = 1 if args.quick else args.repeats
    seqs = make_workload(n)
    rows: list[dict] = []
    for ps in (1, 16):
        rows += bench_radix(seqs, ps, repeats)
        print(f"radix page_size={ps} done", file=sys.stderr, flush=True)
    rows.append(bench_admission(seqs, 16, repeats))
    print("admission done", file=sys.stderr, flush=True)
    for bs in (1, 64, 256):
        rows.append(bench_decode(seqs, bs, 16, repeats))
    print("decode done", file=sys.stderr, flush=True)
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "processor": platform.processor()},
        "minisgl_cpu": minisgl_cpu.__version__,
        "repeats": repeats,
        "num_sequences": n,
        "results": rows,
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'workload':<22}{'ps':>4}{'python':>12}{'rust':>12}{'ratio':>9}"
          f"{'rust batch':>13}{'ratio':>9}")  # fmt: skip
    for r in rows:
        extra = ""
        if "rust_batch_s" in r:
            extra = f"{_fmt(r['rust_batch_s']):>13}{r['ratio_batch']:>8.1f}x"
        print(f"{r['workload']:<22}{r['page_size']:>4}{_fmt(r['python_s']):>12}"
              f"{_fmt(r['rust_s']):>12}{r['ratio']:>8.1f}x{extra}")  # fmt: skip
        if "ratio_with_llm_glue" in r:
            print(f"{'  + LLM.step glue':<26}{_fmt(r['python_with_llm_glue_s']):>12}"
                  f"{_fmt(r['rust_with_llm_glue_s']):>12}{r['ratio_with_llm_glue']:>8.1f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
