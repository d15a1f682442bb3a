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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from minisgl.config import EngineConfig
from minisgl.core import SamplingParams
from minisgl.engine.stream import DeviceStream, make_stream
from minisgl.message.schema import Step, StepResult
from minisgl.message.warmup import WarmUpReport
from minisgl.runtime.device_step import DeviceStep
from minisgl.runtime.local import LocalPlane
from minisgl.runtime.loop import StepBatch, StepLoop, overlap_disabled, pipelined
from minisgl.runtime.plane import ControlPlane
from minisgl.runtime.service_steps import ServicePipeline, ServiceSteps
from minisgl.sampler import request_key
from minisgl.scheduler import cpu_backend
from minisgl.scheduler.backend import SchedulerBackend, SchedulerConfig
from minisgl.scheduler.factory import make_scheduler
from minisgl.scheduler.request import StepOutput
from minisgl.speculative import DRAFT_MODEL, SpecConfig
from minisgl.utils.log import get_logger

if TYPE_CHECKING:
    import torch

logger = get_logger(__name__)

WARM_PREFILLS = (1, 7, 64, 512)  # prompt lengths a "shapes" warm-up prefills (capped)
WARM_DECODE_BATCHES = (1, 3, 8)  # batch sizes it decodes (capped): the specialised 1, odd, wider


def warms_up_by_default(engine: Any) -> bool:
    """Whether the offline API warms `engine` up before its first request: on a CUDA device,
    where the first step of each shape compiles Triton kernels (0.2-0.9 s each on an H200,
    every running request waiting); a server's engine always warms up."""
    return engine.device.type == "cuda"


_ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)  # a prefill alone
_DECODE = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)  # 2 decodes
_SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=3, ignore_eos=True)


def _check_speculation(backend: str) -> None:
    """Speculative decode steps are planned by the python control plane (this milestone): a
    ValueError for any other backend."""
    if backend != "python":
        raise ValueError(
            f"speculative decoding runs on the python control plane; cpu_backend={backend!r} "
            "cannot plan draft rows yet"
        )


def _draft_model(speculative: SpecConfig | None, engine: Any, warm_up: bool) -> Any:
    """The draft model of the `draft` algorithm (`runtime/draft_model.py`), else None."""
    if speculative is None or speculative.algorithm != DRAFT_MODEL:
        return None
    from minisgl.runtime.draft_model import DraftModel

    return DraftModel.load(speculative, engine, warm_up=warm_up)


def _overlap(
    overlap: bool,
    sched: SchedulerBackend,
    name: str,
    device_stream: str | DeviceStream | None,
    device: torch.device,
) -> tuple[int, DeviceStream | None]:
    """The loop's overlap depth and device stream: 1 and the stream (made here unless given)
    when `overlap` is asked and the scheduler has a pipelined mode, else 0 and None."""
    if overlap and pipelined(sched):
        stream = device_stream
        if stream is None or isinstance(stream, str):
            stream = make_stream(stream, device)
        logger.info("overlap scheduling on (%s device stream)", stream.name)
        return 1, stream
    if overlap and name != cpu_backend.SERVICE:
        logger.info("overlap scheduling off: backend %s has no pipelined mode", sched.backend)
    return 0, None


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
        remake: Callable[[], SchedulerBackend] | None = None,
        draft: Any = None,
    ) -> None:
        """`remake`: a new scheduler of `sched`'s config (the one serving after a warm-up).
        `draft`: a draft model the schedulers share (closed with this runtime)."""
        self.engine = engine
        self.draft = draft
        self.eos_token_ids = eos_token_ids
        self.device = DeviceStep(engine, eos_token_ids, engine.config.max_running_requests)
        self.scheduler = sched
        self.loop = StepLoop(sched, self.device, stream, depth)
        self.local = LocalPlane(sched, self.loop, engine.max_seq_len)
        self.plane: ControlPlane = self.local
        self.steps = ServiceSteps(self.device)  # the steps a Rust service sends
        self._rids = itertools.count(1)  # 0 is "no leader" on the wire
        self._remake = remake
        self.warmup: WarmUpReport | None = None  # what `warm_up` ran

    @classmethod
    def build(
        cls,
        engine: Any,
        extra_eos: Iterable[int] = (),
        *,
        backend: str | None = None,
        overlap: bool | None = None,
        device_stream: str | DeviceStream | None = None,
        warm_up: bool = False,
        speculative: SpecConfig | None = None,
        priority_aging_steps: int | None = None,
    ) -> Runtime:
        """On an engine (`engine.sim.make_engine`; closed with the runtime): the scheduler
        `backend` (default `MINISGL_CPU_BACKEND`, else python; `rust_service` starts the
        service) and the loop: overlap depth 1 when `overlap` (default: on unless
        `MINISGL_DISABLE_OVERLAP_SCHEDULING=1`) and the backend has a pipelined mode, else 0.
        `warm_up` (a server's engine; a compiled engine's graphs always): `warm_up()` here.
        `priority_aging_steps`: priority scheduling (`SamplingParams.priority`, one level
        gained every that many steps; None: FIFO). `speculative`: speculative decode steps
        (`speculative.scheduler`: the python backend, either loop; else a ValueError)."""
        name = cpu_backend.requested_backend(backend)
        if speculative is not None:
            _check_speculation(name)
        config: EngineConfig = engine.config
        eos = frozenset({*engine.model_config.eos_token_ids, *extra_eos})
        sched_config = SchedulerConfig(
            num_pages=engine.num_pages,
            page_size=config.page_size,
            max_seq_len=engine.max_seq_len,
            max_running_requests=config.max_running_requests,
            max_extend_tokens=config.max_extend_tokens,
            cache_type=config.cache_type,
            eos_token_ids=tuple(eos),
            priority_aging_steps=priority_aging_steps,
            cache_outputs=not config.deterministic,  # its decode K / V: not the prefill path's
        )
        sched_name = "python" if name == cpu_backend.SERVICE else name
        draft = _draft_model(speculative, engine, warm_up)

        def remake() -> SchedulerBackend:
            if speculative is not None:
                from minisgl.speculative.scheduler import SpecScheduler

                return SpecScheduler.of(sched_config, speculative, draft)
            return make_scheduler(sched_config, sched_name)

        sched = remake()
        if overlap is None:
            overlap = not overlap_disabled()
        depth, stream = _overlap(overlap, sched, name, device_stream, engine.device)
        rt = cls(engine, eos, sched, depth, stream, remake, draft)
        try:
            if warm_up or getattr(engine, "compiled", None) is not None:
                rt.warm_up()
            if name == cpu_backend.SERVICE:
                rt.use_service(config, 1 if overlap else 0, priority_aging_steps)
        except BaseException:
            rt.close()
            raise
        return rt

    def speculative_stats(self) -> dict[str, float | int | str] | None:
        """Speculative decoding's counters (acceptance rate, mean accepted length...), None
        without speculation."""
        stats = getattr(self.scheduler, "speculative_stats", None)
        return stats() if stats is not None else None

    def use_service(
        self, config: EngineConfig, depth: int, priority_aging_steps: int | None = None
    ) -> None:
        """Hand scheduling to a Rust service started now, this process its worker (with the
        scheduling policy `build` gave the python scheduler)."""
        from minisgl.cpu_service import ServiceLimits
        from minisgl.runtime.service_plane import ServicePlane

        limits = ServiceLimits(
            config.page_size, config.max_running_requests, config.max_extend_tokens,
            config.cache_type, cache_outputs=not config.deterministic,
            priority_aging_steps=priority_aging_steps,
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
        if self.draft is not None:
            self.draft.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ worker
    def serve_service(self, eos_token_ids: Iterable[int]) -> None:
        """Run the steps of a Rust service (the server's GPU worker), whose stop tokens
        (`HelloAck`: the model's and the tokenizer's) `min_tokens` masks."""
        self.device.eos = frozenset(eos_token_ids)

    def service_pipeline(self, depth: int = 2) -> ServicePipeline:
        """The service's steps on this engine's device stream (a CUDA side stream; inline on a
        CPU and on the simulated device, which is asynchronous itself), the next one submitted
        while the device runs the last (the server's GPU worker)."""
        stream = make_stream(None, self.device.device)
        return ServicePipeline(self.steps, stream, depth)

    def execute(self, step: Step) -> StepResult:
        """Run a step a Rust service scheduled (the GPU worker's one job)."""
        return self.steps.run(step)

    # ------------------------------------------------------------------ warm-up
    def run(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> None:
        """Run requests (added together: one batch) to the end on the local scheduler, their
        tokens dropped; `params`: one for all, or one per prompt."""
        each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        for ids, p in zip(prompts, each, strict=True):
            self.local.add(next(self._rids), ids, p, request_key(p.seed), None)
        while self.local.has_work():
            self.local.step()

    def ensure_warm(self) -> WarmUpReport:
        """`warm_up()` unless it ran (a server's engine: before it reports ready)."""
        return self.warmup if self.warmup is not None else self.warm_up()

    def warm_up(self) -> WarmUpReport:
        """Run every shape the first requests would otherwise pay for (JIT, autotuning, graph
        compiles: a compile mid-serving stalls every running request, for a minute or more on
        a CPU) through this runtime's own step loop, then start on a fresh scheduler: every KV
        page free, the counters at zero. A compiled engine ("graphs"): `CompiledPrefill`'s
        pieces by a prefill of each of its lengths (dynamic in the token count: every later
        length of the class runs on them), `CompiledDecode`'s graphs by a decode of each of its
        batch sizes (batch 1 is specialised; a quantized model's row classes), through the
        backend's decode modes (the CPU kernel's paged steps; SDPA's workspace rebuilt and
        appended to). Any other engine ("shapes"): `WARM_PREFILLS` and `WARM_DECODE_BATCHES`
        within its limits. Both: a prefill on a cached prefix, sampled rows beside greedy."""
        t0 = time.perf_counter()
        engine = self.engine
        compiled = getattr(engine, "compiled", None)
        lengths, batches = self._warm_prefill_lengths(), self._warm_decode_batches()
        vocab = engine.model_config.vocab_size
        first = self._warm_prefills(lengths, vocab)  # each prompt its own first token
        first = self._warm_prefix_extend(vocab, first)
        requests = first + self._warm_decodes(batches, vocab, first)
        steps, leaked = self.scheduler.stats.steps, self._leaked_pages()
        self._fresh_scheduler()
        self.warmup = WarmUpReport(
            "graphs" if compiled is not None else "shapes",
            tuple(lengths), True, tuple(batches), requests, steps, leaked,
            time.perf_counter() - t0,
        )  # fmt: skip
        logger.info(self.warmup.summary())
        return self.warmup

    def _warm_longest(self) -> int:
        """The longest warm-up prompt: within the sequence limit and a quarter of the pool."""
        engine = self.engine
        pool = engine.num_pages * engine.config.page_size
        return max(1, min(engine.max_seq_len - 8, pool // 4))

    def _warm_prefill_lengths(self) -> list[int]:
        engine, config = self.engine, self.engine.config
        if getattr(engine, "compiled_prefill", None) is not None:
            return list(engine.compiled_prefill.compile_lengths(config.max_extend_tokens))
        cap = min(config.max_extend_tokens, self._warm_longest())
        return sorted({min(n, cap) for n in WARM_PREFILLS})

    def _warm_decode_batches(self) -> list[int]:
        engine, config = self.engine, self.engine.config
        if getattr(engine, "compiled", None) is not None:
            return list(engine.compiled.compile_batches(config.max_running_requests))
        return sorted({min(n, config.max_running_requests) for n in WARM_DECODE_BATCHES})

    def _warm_prefills(self, lengths: Sequence[int], vocab: int) -> int:
        """One step of n tokens for each n (prompts of at most the longest, one sampled token
        each: no decode); returns the prompts run."""
        longest, first = self._warm_longest(), 0
        for n in lengths:
            sizes = [min(longest, n - i) for i in range(0, n, longest)]
            self.run([_ramp(m, vocab, start=first + i) for i, m in enumerate(sizes)], _ONE)
            first += len(sizes)
        return first

    def _warm_prefix_extend(self, vocab: int, first: int) -> int:
        """A prompt, then it and 8 more tokens: a prefill on its cached full pages."""
        page = self.engine.config.page_size
        n = max(1, min(self._warm_longest() - 8, max(32, 2 * page)))
        base = _ramp(n, vocab, start=first)
        self.run([base], _ONE)
        self.run([base + _ramp(8, vocab, start=first + n)], _ONE)
        return first + 2

    def _warm_decodes(self, batches: Sequence[int], vocab: int, first: int) -> int:
        """Decodes of each batch size, every other row sampled; returns the requests run."""
        done = 0
        for bs in batches:
            params = [_DECODE if i % 2 == 0 else replace(_SAMPLED, seed=i) for i in range(bs)]
            self.run([_ramp(8, vocab, start=first + done + i) for i in range(bs)], params)
            done += bs
        return done

    def _leaked_pages(self) -> int:
        """KV pages neither free nor the prefix cache's (the scheduler's integrity check)."""
        kv = self.scheduler.kv_usage()
        cached = -(-kv["cached_tokens"] // self.scheduler.page_size)
        try:
            self.scheduler.check_integrity()
        except AssertionError:
            logger.exception("warm-up: the KV integrity check failed")
            return max(1, kv["total_pages"] - kv["free_pages"] - cached)
        return max(0, kv["total_pages"] - kv["free_pages"] - cached)

    def _fresh_scheduler(self) -> None:
        """A new scheduler of the same config in place of the warm-up's (nothing in flight)."""
        if self._remake is None or self.local.has_work():
            raise RuntimeError("a fresh scheduler needs its factory and an idle runtime")
        sched = self._remake()
        self.scheduler = self.loop.sched = self.local.sched = sched
