"""Decode steps replayed from captured graphs (`--cuda-graph-max-bs`, 0 disables).

A decode step of `b` requests runs on the smallest bucket `B >= b` of 1, 2, 4, 8, 16, 24, ...,
max_bs. Every bucket reads the same fixed device buffers (`GraphInputs`, sized for max_bs:
views of one flat int32 buffer). Before a replay the host lays the step out in a pinned copy
of that buffer, the `B - b` padding rows included, and one non-blocking copy carries it to the
device: nothing else is launched before the replay. Padding rows point at the engine's spare
KV slot: one location past the pages the scheduler allocates, so a padding row writes its K/V
there, attends to it alone, and never touches a real request's KV. The graph computes the
logits of all `B` rows and their greedy argmax with the bad-row flags as one int64 [2, B]
tensor; sampling that needs per-request host parameters runs outside, on the logits.

Two implementations behind `GraphRunner`:
- `CudaGraphRunner`: `torch.cuda.CUDAGraph` per bucket, captured largest first into one memory
  pool (exercised by the `gpu` tests only);
- `ReplayGraphRunner`: the CPU stand-in. "Capture" fixes the input and output buffers per
  bucket; "replay" runs the same forward over those buffers, with random garbage in the
  padding rows, under `SyncGuard` (any device -> host read raises). What it proves holds for
  the CUDA runner because both share everything but the last call (`_replay`).

With tensor parallelism every rank builds the same runner (`GraphSpec`, checked equal on every
rank before any capture) and captures its buckets in the same order, so the collectives of the
captured forward meet (on CUDA: torch's NCCL all-reduces and all-gather inside the graphs); for
each step rank 0 replays, the other ranks replay the same bucket with the same plan
(`Engine.follow`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from minisgl.attention.base import GraphInputs
from minisgl.config import GRAPH_RUNNERS
from minisgl.engine.sync_guard import SyncGuard
from minisgl.sampler import greedy_packed
from minisgl.step.plan import StepPlan
from minisgl.step.staging import CopyTurns, InputFill
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

    logits: torch.Tensor  # [b, vocab], the model's dtype
    packed: torch.Tensor  # [2, b] int64: the greedy argmax, then 1 where the logits are bad

    @property
    def tokens(self) -> torch.Tensor:
        return self.packed[0]

    @property
    def bad(self) -> torch.Tensor:
        return self.packed[1]


@dataclass(frozen=True)
class InputLayout:
    """Offsets of the `GraphInputs` fields in their flat int32 buffer (kv_indices last: a
    step copies the prefix it uses)."""

    max_bs: int
    kv_cap: int

    @property
    def size(self) -> int:
        return 5 * self.max_bs + 1 + self.kv_cap

    def offsets(self) -> tuple[int, int, int, int, int, int]:
        """input_ids, positions, out_loc, seq_lens, kv_indptr, kv_indices."""
        m = self.max_bs
        return 0, m, 2 * m, 3 * m, 4 * m, 5 * m + 1


@dataclass(frozen=True)
class GraphSpec:
    """The graphs a rank captures: runner kind (`none`: no graphs), buckets and the sequence
    capacity its buffers hold (what `can_run` accepts). The ranks of a tensor-parallel group
    must agree on it: every bucket's capture and replay runs the collectives."""

    kind: str
    buckets: tuple[int, ...]
    max_seq_len: int


class GraphRunner(Protocol):
    buckets: tuple[int, ...]
    replays: int
    bucket_replays: Mapping[int, int]

    def can_run(self, plan: StepPlan) -> bool: ...

    def run(self, plan: StepPlan, fill: InputFill | None = None) -> GraphOutput: ...


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

        # every row starts as padding: one token at the spare slot
        self.layout = InputLayout(max_bs, max_bs * max_seq_len + max_bs)
        init = np.zeros(self.layout.size, dtype=np.int32)
        ids, pos, out, seq, indptr, kv = self.layout.offsets()
        init[out:seq] = spare_loc
        init[seq:indptr] = 1
        init[indptr:kv] = np.arange(max_bs + 1)
        init[kv:] = spare_loc
        self._flat = torch.from_numpy(init).to(device)
        self.inputs = GraphInputs(
            input_ids=self._flat[ids:pos],
            positions=self._flat[pos:out],
            out_loc=self._flat[out:seq],
            seq_lens=self._flat[seq:indptr],
            kv_indptr=self._flat[indptr:kv],
            kv_indices=self._flat[kv:],
            max_seq_len=max_seq_len,
        )
        # the host's copies, filled in turn (`CopyTurns`, as `PlanStager` does)
        self._turns = CopyTurns(device)
        self._host = [torch.from_numpy(init.copy()) for _ in range(2)]
        if self._turns.pinned:
            self._host = [h.pin_memory() for h in self._host]
        self._host_np = [h.numpy() for h in self._host]
        self._pad_steps = np.arange(1, max_bs + 1, dtype=np.int32)
        self._rows = torch.arange(max_bs, dtype=torch.int64, device=device)
        fused = getattr(model, "fused_ops", None)  # the model's Triton ops: the fused argmax
        self._argmax = fused.argmax_rows if fused is not None else None
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.replays = 0
        self.bucket_replays: Counter[int] = Counter()  # replays per bucket

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

    def run(self, plan: StepPlan, fill: InputFill | None = None) -> GraphOutput:
        """Replay the bucket of a decode step `can_run` accepted. `fill`: inputs still on the
        device (overlap scheduling), written into the graph's input ids after the copy."""
        b = plan.batch_size
        bucket = bucket_for(self.buckets, b)
        assert bucket is not None, "run() a plan can_run() refused"
        self._stage(plan, b, bucket)
        if fill is not None:
            self.inputs.input_ids[fill.positions] = fill.tokens.to(torch.int32)
        self._garbage(b, bucket)
        self.backend.before_replay()
        self._replay(bucket)
        self.replays += 1
        self.bucket_replays[bucket] += 1
        logits, packed = self.outputs[bucket]
        return GraphOutput(logits[:b], packed[:, :b])

    def _stage(self, plan: StepPlan, b: int, bucket: int) -> None:
        """The step's rows and its `bucket - b` padding rows (token 0 at position 0, written
        to the spare slot) laid out on the host, then one copy of the used prefix to the
        device. The padding ids are set every step: an earlier step may have left a -1 there
        (an input in flight, which only the device-side fill replaced)."""
        i = self._turns.next()
        h = self._host_np[i]
        ids, pos, out, seq, indptr, kv = self.layout.offsets()
        n_kv, pad = int(plan.kv_indptr[-1]), bucket - b
        h[ids : ids + b] = plan.input_ids
        h[ids + b : ids + bucket] = 0
        h[pos : pos + b] = plan.positions
        h[pos + b : pos + bucket] = 0
        h[out : out + b] = plan.out_loc
        h[out + b : out + bucket] = self.spare_loc
        h[seq : seq + b] = plan.seq_lens
        h[seq + b : seq + bucket] = 1
        h[indptr : indptr + b + 1] = plan.kv_indptr
        np.add(self._pad_steps[:pad], n_kv, out=h[indptr + b + 1 : indptr + bucket + 1])
        h[kv : kv + n_kv] = plan.kv_indices
        h[kv + n_kv : kv + n_kv + pad] = self.spare_loc
        n = kv + n_kv + pad
        self._flat[:n].copy_(self._host[i][:n], non_blocking=True)
        self._turns.copied(i)

    def _garbage(self, b: int, bucket: int) -> None:
        """What the padding rows' ids and positions hold: the staged zeros. The stand-in
        overrides this with fresh random values (any in-range garbage must do)."""

    # ------------------------------------------------------------------ device side
    @torch.inference_mode()
    def _forward(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured computation of one bucket: attention metadata, model, greedy argmax
        with the bad-row flags (int64 [2, bucket])."""
        inp = self.inputs
        meta: Any = self.backend.graph_prepare(inp, bucket)
        logits = self.model(inp.input_ids[:bucket], inp.positions[:bucket],
                            self._rows[:bucket], self.backend, meta)  # fmt: skip
        return logits, greedy_packed(logits, self._argmax)

    def _replay(self, bucket: int) -> None:
        raise NotImplementedError


class ReplayGraphRunner(_BucketRunner):
    """The CPU stand-in: fixed buffers per bucket, the same forward run eagerly over them,
    random garbage in the padding rows, every replay under `SyncGuard`."""

    def __init__(self, *args, seed: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        for bucket in reversed(self.buckets):  # "capture": fix each bucket's output buffers
            logits, packed = self._forward(bucket)
            self.outputs[bucket] = (logits.clone(), packed.clone())

    def _garbage(self, b: int, bucket: int) -> None:
        inp, n = self.inputs, bucket - b
        gen = self._gen
        inp.input_ids[b:bucket].copy_(torch.randint(0, self.vocab, (n,), generator=gen,
                                                    device=self.device))  # fmt: skip
        inp.positions[b:bucket].copy_(torch.randint(0, self.max_seq_len, (n,), generator=gen,
                                                    device=self.device))  # fmt: skip

    def _replay(self, bucket: int) -> None:
        with SyncGuard():
            logits, packed = self._forward(bucket)
            out = self.outputs[bucket]
            out[0].copy_(logits)
            out[1].copy_(packed)


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
