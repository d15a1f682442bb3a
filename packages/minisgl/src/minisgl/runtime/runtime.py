"""`Runtime`: the one request/step object every loop drives. It owns the engine, the device
step and a control plane: the scheduler in this process (`LocalPlane`) or the Rust service
(`ServicePlane`). The offline `LLM`, the python engine worker and the rust_service GPU worker
(`execute`: the steps a service sends) all step through it.

    rt = Runtime.build(make_engine(EngineConfig(...)), extra_eos, overlap=True)
    rid = rt.add(ids, params)            # a choice of an n > 1 request: leader=rid of choice 0
    while rt.has_work(): batch = rt.step()
    rt.close()
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams
from minisgl.engine.stream import DeviceStream, make_stream
from minisgl.message.schema import Step, StepResult
from minisgl.runtime.device_step import DeviceStep
from minisgl.runtime.local import LocalPlane
from minisgl.runtime.loop import StepBatch, StepLoop, overlap_disabled, pipelined
from minisgl.runtime.plane import ControlPlane
from minisgl.runtime.service_steps import ServiceSteps
from minisgl.sampler import request_key
from minisgl.scheduler import cpu_backend
from minisgl.scheduler.backend import SchedulerBackend, SchedulerConfig
from minisgl.scheduler.factory import make_scheduler
from minisgl.scheduler.request import StepOutput
from minisgl.utils.log import get_logger

logger = get_logger(__name__)


def _ramp(n: int, vocab: int, start: int = 0) -> list[int]:
    """A prompt of n token ids counting up from start + 1 (mod vocab): the warm-up prompts."""
    return [(start + j) % vocab for j in range(1, n + 1)]


class Runtime:
    def __init__(
        self,
        engine: Any,
        eos_token_ids: frozenset[int],
        sched: SchedulerBackend,
        depth: int,
        stream: DeviceStream | None,
    ) -> None:
        self.engine = engine
        self.eos_token_ids = eos_token_ids
        self.device = DeviceStep(engine, eos_token_ids, engine.config.max_running_requests)
        self.scheduler = sched
        self.loop = StepLoop(sched, self.device, stream, depth)
        self.local = LocalPlane(sched, self.loop, engine.max_seq_len)
        self.plane: ControlPlane = self.local
        self.steps = ServiceSteps(self.device)  # the steps a Rust service sends
        self._rids = itertools.count(1)  # 0 is "no leader" on the wire

    @classmethod
    def build(
        cls,
        engine: Any,
        extra_eos: Iterable[int] = (),
        *,
        backend: str | None = None,
        overlap: bool | None = None,
        device_stream: str | DeviceStream | None = None,
    ) -> Runtime:
        """On an engine (`engine.sim.make_engine`; closed with the runtime): the scheduler
        `backend` (default `MINISGL_CPU_BACKEND`, else python; `rust_service` starts the
        service) and the loop: overlap depth 1 when `overlap` (default: on unless
        `MINISGL_DISABLE_OVERLAP_SCHEDULING=1`) and the backend has a pipelined mode, else 0.
        The graphs of a compiled engine are warmed up here."""
        name = cpu_backend.requested_backend(backend)
        config: EngineConfig = engine.config
        eos = frozenset({*engine.model_config.eos_token_ids, *extra_eos})
        sched = make_scheduler(
            SchedulerConfig(
                num_pages=engine.num_pages,
                page_size=config.page_size,
                max_seq_len=engine.max_seq_len,
                max_running_requests=config.max_running_requests,
                max_extend_tokens=config.max_extend_tokens,
                cache_type=config.cache_type,
                eos_token_ids=tuple(eos),
            ),
            "python" if name == cpu_backend.SERVICE else name,
        )
        if overlap is None:
            overlap = not overlap_disabled()
        depth, stream = 0, None
        if overlap and pipelined(sched):
            depth = 1
            stream = device_stream
            if stream is None or isinstance(stream, str):
                simulated = getattr(engine, "simulated", False)
                stream = make_stream(stream, engine.device, simulated)
            logger.info("overlap scheduling on (%s device stream)", stream.name)
        elif overlap and name != cpu_backend.SERVICE:
            logger.info("overlap scheduling off: backend %s has no pipelined mode", sched.backend)
        rt = cls(engine, eos, sched, depth, stream)
        try:
            if getattr(engine, "compiled", None) is not None:
                rt.warm_up()
            if name == cpu_backend.SERVICE:
                rt.use_service(config, depth=1 if overlap else 0)
        except BaseException:
            rt.close()
            raise
        return rt

    def use_service(self, config: EngineConfig, depth: int) -> None:
        """Hand scheduling to a Rust service started now, this process its worker."""
        from minisgl.runtime.service_plane import ServicePlane
        from minisgl.server.service import ServiceLimits

        limits = ServiceLimits(
            config.page_size, config.max_running_requests, config.max_extend_tokens,
            config.cache_type,
        )  # fmt: skip
        self.steps = ServiceSteps(self.device, keep_released=True)
        self.plane = ServicePlane(
            config.model_path, limits, self.steps, self.execute, self.engine, depth
        )

    # ------------------------------------------------------------------ requests
    @property
    def depth(self) -> int:
        """Steps the device runs ahead of the commits (0: the serial loop)."""
        return self.loop.depth

    @property
    def service_pid(self) -> int | None:
        return getattr(self.plane, "service_pid", None)

    def add(
        self,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        rid: int | None = None,
        leader: int | None = None,
        generator: Any = None,
    ) -> int:
        """Queue a request (a RequestError when it can never be served); returns its id.
        `leader`: the id of the request whose prompt this one shares (n > 1): it waits for
        that prefill. `generator`: its sampling key (default: from its seed)."""
        rid = next(self._rids) if rid is None else rid
        key = request_key(params.seed) if generator is None else generator
        self.plane.add(rid, input_ids, params, key, leader)
        return rid

    def abort(self, rid: int) -> None:
        self.plane.abort(rid)

    def finish(self, rid: int, reason: str) -> None:
        self.plane.finish(rid, reason)

    def has_work(self) -> bool:
        """Requests waiting or running, or steps in flight."""
        return self.plane.has_work()

    def step(self) -> StepBatch:
        """One step of the control plane: the tokens it committed; a row that failed alone is
        aborted (its id in `errors`), the others go on."""
        return self.plane.step()

    def drain(self) -> list[StepOutput]:
        """Commit every step in flight (their requests' pages come back)."""
        return [o for b in self.plane.drain() for o in b.outputs]

    def fail_all(self) -> list[int]:
        """Abort every live request (the device failed); steps in flight are committed, their
        tokens dropped, so every page comes back. Returns the ids aborted."""
        return self.plane.fail_all()

    def close(self) -> None:
        if self.plane is not self.local:
            self.plane.close()
        self.local.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ worker
    def serve_service(self, eos_token_ids: Iterable[int]) -> None:
        """Run the steps of a Rust service (the server's GPU worker), whose stop tokens
        (`HelloAck`: the model's and the tokenizer's) `min_tokens` masks."""
        self.device.eos = frozenset(eos_token_ids)

    def execute(self, step: Step) -> StepResult:
        """Run a step a Rust service scheduled (the GPU worker's one job)."""
        return self.steps.run(step)

    # ------------------------------------------------------------------ warm-up
    def run(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
        """Run requests to the end on the local scheduler, their tokens dropped."""
        for ids in prompts:
            self.local.add(next(self._rids), ids, params, request_key(params.seed), None)
        while self.local.has_work():
            self.local.step()

    def warm_up(self) -> None:
        """Compile the graphs before the first request (a compile mid-serving stalls every
        running request, for a minute or more on a CPU): `CompiledPrefill`'s pieces by a
        prefill of each of its lengths (dynamic in the token count: every later length of the
        class runs on them), then `CompiledDecode`'s graphs by a decode of each of its batch
        sizes (batch 1 is specialised; a quantized model's row classes), through the backend's
        decode modes (the CPU kernel's paged steps; SDPA's workspace rebuilt and appended to)."""
        t0 = time.perf_counter()
        engine, config = self.engine, self.engine.config
        vocab = engine.model_config.vocab_size
        longest = engine.max_seq_len - 8
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        if engine.compiled_prefill is not None:  # prefills alone: no decode step
            first = 0  # each prompt its own first token: no prefix hit shrinks a later step
            for n in engine.compiled_prefill.compile_lengths(config.max_extend_tokens):
                # one step of n tokens: prompts of at most `longest`
                sizes = [min(longest, n - i) for i in range(0, n, longest)]
                starts = range(first, first + len(sizes))
                self.run([_ramp(m, vocab, start=i) for i, m in zip(starts, sizes)], one)
                first += len(sizes)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for bs in engine.compiled.compile_batches(config.max_running_requests):
            self.run([_ramp(8, vocab, start=i) for i in range(bs)], params)
        logger.info("graphs compiled in %.1f s", time.perf_counter() - t0)
