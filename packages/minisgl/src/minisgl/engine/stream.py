"""Device streams: where overlap scheduling runs a step's forward and sampling.

A `DeviceStream` takes a job (forward + sample of one step, returning a `PendingSample`
whose tokens are still on the device) and returns a `StepHandle` at once; `handle.result()`
waits for the step's one device-to-host copy (or raises what the job raised: `submit` never
does, so a step the scheduler planned is always one the caller can commit). Jobs run in submission order: a step reads
the tokens the previous step left on the device.

- `CudaStream`: the job's kernels are queued on a side CUDA stream, the host copy is
  non-blocking into pinned memory, an event marks it; `result` waits for the event.
- `InlineStream`: the job runs at once in the caller's thread (a CPU device: the CPU is the
  device).
  The simulated device (`engine/sim.py`) runs here too: its steps are asynchronous by
  themselves (their device time on the device's own timeline), as a CUDA launch is.
- `ThreadStream`: the job runs on one worker thread (torch's CPU kernels release the GIL, so
  the caller schedules the next step meanwhile); `delay_s` sleeps before each job, so a test
  sees ordering bugs a fast device hides.

`make_stream(spec, device)`: `spec` is `auto` (a CUDA device: `cuda`; else `inline`), `inline`,
`thread` or `slow:<ms>` (a `ThreadStream` with that delay); `MINISGL_DEVICE_STREAM` when not
given.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from minisgl.sampler import SampleResult

ENV_STREAM = "MINISGL_DEVICE_STREAM"
STREAMS = ("auto", "inline", "thread", "cuda", "slow:<ms>")


class PendingSample(Protocol):
    """A step's samples on the device (`sampler.DeviceSample`, `sim.HostSample`)."""

    tokens: torch.Tensor

    def start_copy(self) -> None: ...
    def result(self) -> SampleResult: ...


class StepHandle(Protocol):
    def result(self) -> SampleResult: ...


Job = Callable[[], PendingSample]


class DeviceStream(Protocol):
    name: str

    def submit(self, job: Job) -> StepHandle: ...
    def close(self) -> None: ...


class _Done:
    def __init__(self, sample: PendingSample) -> None:
        self.sample = sample

    def result(self) -> SampleResult:
        return self.sample.result()


class _Failed:
    """A job that raised: its handle raises it (the step stays a step: it is committed)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def result(self) -> SampleResult:
        raise self.exc


class InlineStream:
    name = "inline"

    def submit(self, job: Job) -> StepHandle:
        try:
            return _Done(job())
        except Exception as e:
            return _Failed(e)

    def close(self) -> None:
        pass


class _FutureHandle:
    def __init__(self, fut: Future[SampleResult]) -> None:
        self.fut = fut

    def result(self) -> SampleResult:
        return self.fut.result()


class ThreadStream:
    """One worker thread runs the jobs in order (`delay_s` first: a slow device)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.name = f"slow:{delay_s * 1e3:g}" if delay_s else "thread"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="minisgl-device")

    def _run(self, job: Job) -> SampleResult:
        if self.delay_s:
            time.sleep(self.delay_s)
        with torch.inference_mode():
            return job().result()

    def submit(self, job: Job) -> StepHandle:
        return _FutureHandle(self._pool.submit(self._run, job))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _CudaHandle:
    def __init__(self, sample: PendingSample, event: torch.cuda.Event) -> None:
        self.sample = sample
        self.event = event

    def result(self) -> SampleResult:
        self.event.synchronize()
        return self.sample.result()


class CudaStream:
    """The job's kernels on a side stream; the host waits only for the step's event."""

    name = "cuda"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, job: Job) -> StepHandle:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                sample = job()
                sample.start_copy()
                event = torch.cuda.Event()
                event.record(self.stream)
        except Exception as e:
            return _Failed(e)
        return _CudaHandle(sample, event)

    def close(self) -> None:
        self.stream.synchronize()


def make_stream(spec: str | None, device: torch.device) -> DeviceStream:
    spec = (spec or os.environ.get(ENV_STREAM) or "auto").strip().lower()
    if spec == "auto":
        spec = "cuda" if device.type == "cuda" else "inline"
    if spec == "inline":
        return InlineStream()
    if spec == "thread":
        return ThreadStream()
    if spec == "cuda":
        if device.type != "cuda":
            raise ValueError(
                f"device stream 'cuda' needs a CUDA device, the engine runs on {device}"
            )
        return CudaStream(device)
    if spec.startswith("slow:"):
        try:
            ms = float(spec[5:])
        except ValueError:
            ms = -1.0
        if ms >= 0:
            return ThreadStream(ms / 1e3)
    raise ValueError(f"device stream {spec!r}: expected one of {', '.join(STREAMS)}")
