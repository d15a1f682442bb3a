"""Decode steps replayed from captured graphs (`--cuda-graph-max-bs`, 0 disables).

A decode step of `b` requests runs on the smallest bucket `B >= b` of 1, 2, 4, 8, 16, 24, ...,
max_bs. Every bucket reads the same fixed device buffers (`GraphInputs`, sized for max_bs);
before a replay the step's staged arrays are copied into them (device -> device) and the
`B - b` padding rows are pointed at the engine's spare KV slot: one location past the pages
the scheduler allocates, so a padding row writes its K/V there, attends to it alone, and
never touches a real request's KV. The graph computes the logits of all `B` rows and their
greedy argmax; sampling that needs per-request host parameters runs outside, on the logits.

Two implementations behind `GraphRunner`:
- `CudaGraphRunner`: `torch.cuda.CUDAGraph` per bucket, captured largest first into one memory
  pool (exercised by the `gpu` tests only);
- `ReplayGraphRunner`: the CPU stand-in. "Capture" fixes the input and output buffers per
  bucket; "replay" runs the same forward over those buffers, with random garbage in the
  padding rows, under `SyncGuard` (any device -> host read raises). What it proves holds for
  the CUDA runner because both share everything but the last call (`_replay`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from minisgl.attention.base import GraphInputs
from minisgl.config import GRAPH_RUNNERS
from minisgl.engine.sync_guard import SyncGuard
from minisgl.sampler import greedy_device
from minisgl.step.plan import StepPlan
from minisgl.step.staging import DevicePlan
from minisgl.utils.log import get_logger

if TYPE_CHECKING:
    from minisgl.attention.base import AttentionBackend

logger = get_logger(__name__)

DEFAULT_MAX_BS = 256


def graph_buckets(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 8 up to `max_bs` (itself included); () for 0."""
    if max_bs < 0:
        raise ValueError(f"cuda_graph_max_bs must be >= 0, got {max_bs}")
    small = [b for b in (1, 2, 4, 8) if b <= max_bs]
    out = small + list(range(16, max_bs + 1, 8))
    if max_bs and out[-1] != max_bs:
        out.append(max_bs)
    return tuple(out)


def bucket_for(buckets: tuple[int, ...], bs: int) -> int | None:
    """The smallest bucket holding `bs` rows (None: larger than every bucket)."""
    return next((b for b in buckets if b >= bs), None)


@dataclass(frozen=True)
class GraphOutput:
    """A replayed step's outputs for its `b` real rows (views of the bucket's fixed buffers,
    valid until the next replay)."""

    logits: torch.Tensor  # [b, vocab] float32
    tokens: torch.Tensor  # [b] int64 greedy argmax
    bad: torch.Tensor  # [b] bool non-finite logits


class GraphRunner(Protocol):
    buckets: tuple[int, ...]

    def can_run(self, plan: StepPlan) -> bool: ...

    def run(self, plan: StepPlan, staged: DevicePlan) -> GraphOutput: ...


class _BucketRunner:
    """Buffers, bucket choice, padding and the captured forward, shared by both runners."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        spare_loc: int,
        max_bs: int,
        max_seq_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.backend, self.spare_loc = model, backend, spare_loc
        self.buckets = graph_buckets(max_bs)
        self.max_bs, self.max_seq_len, self.device = max_bs, max_seq_len, device
        self.vocab = int(model.config.vocab_size)

        def i32(n: int, fill: int = 0) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int32, device=device)

        # every row starts as padding: one token at the spare slot
        kv_cap = max_bs * max_seq_len + max_bs
        self.inputs = GraphInputs(
            input_ids=i32(max_bs),
            positions=i32(max_bs),
            out_loc=i32(max_bs, spare_loc),
            seq_lens=i32(max_bs, 1),
            kv_indptr=torch.arange(max_bs + 1, dtype=torch.int32, device=device),
            kv_indices=i32(kv_cap, spare_loc),
            max_seq_len=max_seq_len,
        )
        self._rows = torch.arange(max_bs, dtype=torch.int64, device=device)
        self._steps = torch.arange(1, max_bs + 1, dtype=torch.int32, device=device)
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.replays = 0

    # ------------------------------------------------------------------ host side
    def can_run(self, plan: StepPlan) -> bool:
        """A decode step (one token and one sample per request) that fits a bucket."""
        b = plan.batch_size
        return (
            not plan.is_prefill
            and plan.num_tokens == b
            and 0 < b <= self.max_bs
            and plan.sample_rows.shape[0] == b
            and int(plan.kv_indices.shape[0]) + self.max_bs <= self.inputs.kv_indices.shape[0]
            and np.array_equal(plan.logits_indices, np.arange(b))
        )

    def run(self, plan: StepPlan, staged: DevicePlan) -> GraphOutput:
        b = plan.batch_size
        bucket = bucket_for(self.buckets, b)
        assert bucket is not None and self.can_run(plan), "run() a plan can_run() refused"
        self._fill(b, bucket, int(plan.kv_indices.shape[0]), staged)
        self.backend.before_replay()
        self._replay(bucket)
        self.replays += 1
        logits, tokens, bad = self.outputs[bucket]
        return GraphOutput(logits[:b], tokens[:b], bad[:b])

    def _fill(self, b: int, bucket: int, n_kv: int, staged: DevicePlan) -> None:
        """The step's rows into the fixed buffers, then the padding rows `b..bucket` as one
        token each at the spare slot (device copies; host values are plain ints)."""
        inp = self.inputs
        inp.input_ids[:b].copy_(staged.input_ids)
        inp.positions[:b].copy_(staged.positions)
        inp.out_loc[:b].copy_(staged.out_loc)
        inp.seq_lens[:b].copy_(staged.seq_lens)
        inp.kv_indptr[: b + 1].copy_(staged.kv_indptr)
        inp.kv_indices[:n_kv].copy_(staged.kv_indices)
        pad = bucket - b
        if pad:
            inp.out_loc[b:bucket].fill_(self.spare_loc)
            inp.seq_lens[b:bucket].fill_(1)
            torch.add(self._steps[:pad], n_kv, out=inp.kv_indptr[b + 1 : bucket + 1])
            inp.kv_indices[n_kv : n_kv + pad].fill_(self.spare_loc)
            self._garbage(b, bucket)

    def _garbage(self, b: int, bucket: int) -> None:
        """What the padding rows' ids and positions hold: whatever an earlier step left there
        (always in range). The stand-in overrides this with fresh random values."""

    # ------------------------------------------------------------------ device side
    @torch.inference_mode()
    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The captured computation of one bucket: attention metadata, model, greedy argmax."""
        inp = self.inputs
        meta: Any = self.backend.graph_prepare(inp, bucket)
        logits = self.model(inp.input_ids[:bucket], inp.positions[:bucket],
                            self._rows[:bucket], self.backend, meta)  # fmt: skip
        tokens, bad = greedy_device(logits)
        return logits, tokens, bad

    def _replay(self, bucket: int) -> None:
        raise NotImplementedError


class ReplayGraphRunner(_BucketRunner):
    """The CPU stand-in: fixed buffers per bucket, the same forward run eagerly over them,
    random garbage in the padding rows, every replay under `SyncGuard`."""

    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        for bucket in reversed(self.buckets):  # "capture": fix each bucket's output buffers
            logits, tokens, bad = self._forward(bucket)
            self.outputs[bucket] = (logits.clone(), tokens.clone(), bad.clone())

    def _garbage(self, b: int, bucket: int) -> None:
        inp, n = self.inputs, bucket - b
        gen = self._gen
        inp.input_ids[b:bucket].copy_(torch.randint(0, self.vocab, (n,), generator=gen,
                                                    device=self.device))  # fmt: skip
        inp.positions[b:bucket].copy_(torch.randint(0, self.max_seq_len, (n,), generator=gen,
                                                    device=self.device))  # fmt: skip

    def _replay(self, bucket: int) -> None:
        with SyncGuard():
            logits, tokens, bad = self._forward(bucket)
            out = self.outputs[bucket]
            out[0].copy_(logits)
            out[1].copy_(tokens)
            out[2].copy_(bad)


class CudaGraphRunner(_BucketRunner):
    """One `torch.cuda.CUDAGraph` per bucket, captured largest first into one memory pool."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        stream = torch.cuda.Stream(self.device)
        pool = None
        torch.cuda.synchronize(self.device)
        for bucket in reversed(self.buckets):
            with torch.cuda.stream(stream):
                self._forward(bucket)  # warm-up: lazy inits and autotuning outside the graph
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bucket] = self._forward(bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured %d decode graphs (batch sizes %s)", len(self.graphs), self.buckets)

    def _replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()


def resolve_runner(kind: str, device: torch.device, max_bs: int | None) -> tuple[str, int]:
    """(`cuda` / `replay` / `none`, max batch size): `auto` captures CUDA graphs on a CUDA
    device unless max_bs is 0; the stand-in runs only when asked for."""
    if kind not in GRAPH_RUNNERS:
        raise ValueError(f"graph_runner must be one of {GRAPH_RUNNERS}, got {kind!r}")
    bs = DEFAULT_MAX_BS if max_bs is None else max_bs
    if kind == "auto":
        kind = "cuda" if device.type == "cuda" else "none"
    if kind == "cuda" and device.type != "cuda":
        raise ValueError(f"graph_runner='cuda' needs a CUDA device, got {device}")
    if bs == 0:
        kind = "none"
    return kind, bs


def make_graph_runner(
    kind: str,
    model: torch.nn.Module,
    backend: AttentionBackend,
    spare_loc: int,
    max_bs: int,
    max_seq_len: int,
    device: torch.device,
) -> GraphRunner | None:
    if kind == "none":
        return None
    cls = CudaGraphRunner if kind == "cuda" else ReplayGraphRunner
    return cls(model, backend, spare_loc, max_bs, max_seq_len, device)
