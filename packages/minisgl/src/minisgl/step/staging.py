"""Step inputs on the device without syncs: one host memcpy + one non-blocking H2D copy.

`PlanStager.stage(plan)` gathers the plan's segments (the int32 fields of `step/plan.py`)
into a pinned host buffer with one `np.concatenate`, then copies that buffer to the device with
one non-blocking copy; the segments are views of the device buffer (`DevicePlan`), each
starting 16-byte aligned: Triton keys a kernel's compiled variant on each pointer's 16-byte
alignment, so offsets that followed the step's sizes compiled new variants mid-serving. Two
host/device buffer pairs alternate: step N+1 fills its host buffer while step N's copy may still
be reading the other one (before reusing a buffer, the stager waits for the copy that read it
two steps ago, which has long finished). On the CPU the buffers are plain memory and the copy
a memcpy: the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.step.plan import PLAN_FIELDS, StepPlan

_MIN_CAPACITY = 1 << 14
ALIGN = 4  # int32 elements: every staged segment starts at a multiple of 16 bytes
_PADS = tuple(np.zeros(n, dtype=np.int32) for n in range(ALIGN))


def aligned_parts(plan: StepPlan) -> tuple[list[np.ndarray], list[tuple[int, int]], int]:
    """The arrays to concatenate into a staging buffer (each field, then zeros up to the next
    multiple of `ALIGN`), each field's `(offset, length)` there, and the buffer's length."""
    parts: list[np.ndarray] = []
    segments: list[tuple[int, int]] = []
    off = 0
    for f in PLAN_FIELDS:
        a = getattr(plan, f)
        n = int(a.shape[0])
        pad = -n % ALIGN
        parts += (a, _PADS[pad])
        segments.append((off, n))
        off += n + pad
    return parts, segments, off


@dataclass(frozen=True)
class InputFill:
    """Inputs the host does not know yet (overlap scheduling: decode inputs of a step still in
    flight): `input_ids[positions] = tokens`, both on the device."""

    positions: torch.Tensor  # int64 indices into the step's input_ids
    tokens: torch.Tensor  # int64, one per position


@dataclass(frozen=True)
class DevicePlan:
    """The segments of one staged plan: int32 device views, named as the `StepPlan` fields."""

    slots: torch.Tensor
    extend_lens: torch.Tensor
    seq_lens: torch.Tensor
    kv_indptr: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_loc: torch.Tensor
    kv_indices: torch.Tensor
    logits_indices: torch.Tensor
    sample_rows: torch.Tensor


class CopyTurns:
    """Two host buffers filled in turn, each read by a non-blocking copy (pinned on CUDA): a
    step fills one while the other's copy may still run; before a buffer is filled again the
    copy that read it two steps ago is waited for (it has long finished)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._i = 0
        self._copied: list[torch.cuda.Event | None] = [None, None]

    def next(self) -> int:
        """The buffer to fill now, once no copy reads it any more."""
        i = self._i = 1 - self._i
        done = self._copied[i]
        if done is not None and not done.query():
            done.synchronize()
        return i

    def copied(self, i: int) -> None:
        """Buffer i's copy is queued on the current stream."""
        if self.pinned:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._copied[i] = event

    def forget(self) -> None:
        """No copy reads either buffer (after a stream synchronize)."""
        self._copied = [None, None]


class PlanStager:
    def __init__(self, device: torch.device, capacity: int = _MIN_CAPACITY) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.turns = CopyTurns(device)
        self._alloc(capacity)
        self.copies = 0  # H2D copies issued (one per staged plan)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self._host = [
            torch.empty(capacity, dtype=torch.int32, pin_memory=self.pinned) for _ in range(2)
        ]
        self._host_np = [h.numpy() for h in self._host]
        self._dev = [torch.empty(capacity, dtype=torch.int32, device=self.device) for _ in range(2)]
        self.turns.forget()

    def stage(self, plan: StepPlan) -> DevicePlan:
        parts, segments, n = aligned_parts(plan)
        if n > self.capacity:
            if self.pinned:
                torch.cuda.current_stream(self.device).synchronize()  # in-flight copies
            self._alloc(max(n, 2 * self.capacity))
        i = self.turns.next()
        np.concatenate(parts, out=self._host_np[i][:n], casting="same_kind")
        dev = self._dev[i]
        dev[:n].copy_(self._host[i][:n], non_blocking=True)
        self.copies += 1
        self.turns.copied(i)
        return DevicePlan(*(dev[off : off + length] for off, length in segments))
