"""The scheduler + engine process: owns an `LLM` and steps its `Runtime`.

Each turn: take every queued message (new requests, aborts, stop-string finishes), run one
`Runtime.step()` if there is work (with overlap scheduling: submit the next step, commit the
oldest; an abort or finish of a request in a step in flight frees its pages at that step's
commit), send the sampled tokens to the detokenizer that owns each request
(uid % num_tokenizer), and now and then a stats snapshot to the API server.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from minisgl import ipc
from minisgl.distributed.errors import RankFailed
from minisgl.message.schema import (
    AbortReq,
    AddReq,
    Admitted,
    Codec,
    FinishReq,
    Ready,
    Reject,
    Shutdown,
    Stats,
    TokenOut,
    wire_logprob,
)
from minisgl.message.warmup import INFO_KEY, WarmUpReport
from minisgl.server.replicas import placed
from minisgl.utils import trace

if TYPE_CHECKING:  # the launcher imports this module: torch loads in the worker only
    from minisgl.llm import LLM
    from minisgl.runtime import Runtime

STATS_BUSY_S = 0.1
STATS_IDLE_S = 1.0
# the KV integrity check (O(pool): ~5 ms of numpy at 115k pages, more with a full prefix cache)
# runs once the engine has had no work this long, never at the idle edge, where the next
# request (a client's next turn, a benchmark's burst after its warm-up) would wait behind it
QUIET_CHECK_S = 0.2


SPEC_COUNTERS = ("verify_rows", "drafted_tokens", "accepted_tokens")


def cpu_backend_stats() -> dict[str, Any] | None:
    """The CPU backend path counters, if that module exists in this build."""
    try:
        from minisgl.scheduler import cpu_backend
    except ImportError:
        return None
    fn = getattr(cpu_backend, "stats", None)
    if fn is None:
        return None
    try:
        return fn()
    except Exception as e:  # counters must never take the server down
        return {"error": repr(e)}


class EngineLoop:
    replica = 0  # which data-parallel replica this engine is (`--dp`)

    def __init__(self, runtime: Runtime, codec: Codec, to_tok: list, to_frontend) -> None:
        self.rt = runtime
        self.sched = runtime.scheduler
        self.codec = codec
        self.to_tok = to_tok
        self.to_frontend = to_frontend
        self.vocab = runtime.engine.model_config.vocab_size
        self.last_stats = 0.0
        self.was_busy = False
        self.idle_since = time.monotonic()
        self.integrity_ok = 1
        self.integrity_pending = True  # work since the last check: the next quiet period checks
        self.admitted: list[int] = []  # uids added since the last `Admitted` message

    def send_tok(self, uid: int, msg) -> None:
        self.to_tok[uid % len(self.to_tok)].send(self.codec.encode(msg))

    def reject(
        self,
        uid: int,
        message: str,
        status: int = 400,
        code: str = "invalid_request",
        param: str | None = None,
    ) -> None:
        self.send_tok(uid, Reject(uid, message, status, code, param))

    # ------------------------------------------------------------------ messages
    def handle(self, msg) -> bool:
        """Returns False on Shutdown."""
        if isinstance(msg, AddReq):
            self.add(msg)
        elif isinstance(msg, AbortReq):
            self.rt.abort(msg.uid)
        elif isinstance(msg, FinishReq):
            self.rt.finish(msg.uid, msg.reason)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def add(self, msg: AddReq) -> None:
        """Validate and queue a request (a choice of an n > 1 request waits in the runtime for
        its leader's prefill); its error code follows from the exception's type."""
        from minisgl.sampling_fields import ParamError, check_vocab, vocab_error
        from minisgl.scheduler.request import ContextLengthError, RequestError

        ids = np.asarray(msg.input_ids, dtype=np.int32)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab):
            bad = int(ids[(ids < 0) | (ids >= self.vocab)][0])
            self.reject(msg.uid, vocab_error(bad, self.vocab), param="prompt")
            return
        try:  # the offline API's check (`LLM.generate`), the same message
            check_vocab((t for t, _ in msg.params.logit_bias or ()), self.vocab, "logit_bias")
        except ParamError as e:
            self.reject(msg.uid, str(e), param=e.param)
            return
        try:
            params = msg.params.to_sampling_params()
            self.rt.add(ids, params, rid=msg.uid, leader=msg.params.prefix_leader or None)
            trace.mark("eng.add", msg.uid)
            self.admitted.append(msg.uid)
        except ContextLengthError as e:
            self.reject(msg.uid, str(e), 400, "context_length_exceeded", "prompt")
        except (RequestError, TypeError, ValueError) as e:  # an empty prompt names it
            self.reject(msg.uid, str(e), 400, "invalid_request", None if len(ids) else "prompt")

    def flush_admitted(self) -> None:
        if self.admitted:
            uids = np.asarray(self.admitted, dtype=np.int64)
            self.admitted = []
            replicas = np.full(len(uids), self.replica, dtype=np.int32)  # which engine took them
            self.to_frontend.send(self.codec.encode(Admitted(uids, replicas)))

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        ipc.fault_step_delay()
        t0 = time.perf_counter()
        try:
            batch = self.rt.step()
        except Exception as e:
            traceback.print_exc()
            for rid in self.rt.fail_all():  # every request aborted, steps in flight dropped
                self.reject(rid, f"engine error: {e}", 500, "internal_error")
            if isinstance(e, RankFailed):  # no later step can run: the worker (server) ends
                raise
            return
        for rid, err in batch.errors.items():  # failed alone; the others go on
            self.reject(rid, err, 500, "internal_error")
        if not batch.outputs:
            return
        if trace.enabled():
            rids = [o.rid for o in batch.outputs]
            trace.mark("eng.step", rids, t0)
            trace.mark("eng.out", rids)
        n = len(self.to_tok)
        groups: list[list[int]] = [[] for _ in range(n)]
        for k, o in enumerate(batch.outputs):
            groups[o.rid % n].append(k)
        any_lp = any(lp is not None for lp in batch.logprobs)
        for i, g in enumerate(groups):
            if g:
                outs = [batch.outputs[k] for k in g]
                msg = TokenOut(
                    np.fromiter((o.rid for o in outs), dtype=np.int64, count=len(g)),
                    np.fromiter((o.token_id for o in outs), dtype=np.int32, count=len(g)),
                    [o.finish_reason for o in outs],
                    [wire_logprob(batch.logprobs[k]) for k in g] if any_lp else [],
                )
                self.to_tok[i].send(self.codec.encode(msg))

    def run(self, inbox: zmq.Socket, alive: Callable[[], bool]) -> None:
        """Until Shutdown (or the launcher is gone): each turn takes every queued message,
        runs one step if there is work, and sends the stats that are due."""
        running = True
        while running and alive():
            busy = self.rt.has_work()  # requests, or steps in flight (overlap scheduling)
            frames = ipc.drain(inbox, 0 if busy else 100)
            for f in frames:
                if not self.handle(self.codec.decode(f)):
                    running = False
            self.flush_admitted()
            if running and self.rt.has_work():
                self.step()
            self.maybe_send_stats()

    # ------------------------------------------------------------------ stats
    def maybe_send_stats(self, force: bool = False) -> None:
        """Stats every `STATS_BUSY_S` while busy, at the idle edge, every `STATS_IDLE_S` idle;
        the integrity check once idle for `QUIET_CHECK_S` after work (its result sent then)."""
        now = time.monotonic()
        busy = self.rt.has_work()
        idle_edge = self.was_busy and not busy
        if busy:
            self.integrity_pending = True
        elif self.was_busy:
            self.idle_since = now
        self.was_busy = busy
        check = not busy and self.integrity_pending and now - self.idle_since >= QUIET_CHECK_S
        period = STATS_BUSY_S if busy else STATS_IDLE_S
        if not (force or idle_edge or check or now - self.last_stats >= period):
            return
        self.last_stats = now
        if check:
            try:
                self.sched.check_integrity()
                self.integrity_ok = 1
            except AssertionError:
                traceback.print_exc()
                self.integrity_ok = 0
            self.integrity_pending = False
        self.to_frontend.send(self.codec.encode(Stats(self.snapshot())))

    def snapshot(self) -> dict[str, Any]:
        s = self.sched
        kv = dict(s.kv_usage())
        st = s.stats
        page = s.page_size
        data: dict[str, Any] = {
            **kv,
            "page_size": page,
            "used_pages": kv["total_pages"] - kv["free_pages"],
            "cached_pages": kv["cached_tokens"] // page,
            "steps": st.steps,
            "generated_tokens": st.generated_tokens,
            "prompt_tokens": st.prompt_tokens,
            "cached_prompt_tokens": st.cached_prompt_tokens,
            "prefix_hit_rate": st.prefix_hit_rate,
            "integrity_ok": self.integrity_ok,
            "integrity_pending": int(self.integrity_pending),
            "replica": self.replica,
        }
        spec = getattr(s, "speculative_stats", None)  # a `SpecScheduler`'s
        if spec is not None:  # counters: summed over replicas, rates computed from the sums
            counts = spec()
            for key in SPEC_COUNTERS:
                data[f"spec_{key}"] = counts[key]
        cpu = cpu_backend_stats()
        if cpu is not None:
            data["cpu_backend"] = cpu
        return data


def run_engine_worker(
    model_path: str,
    llm_kwargs: dict,
    ipc_dir: str,
    typed: bool,
    num_tokenizer: int,
    replica: int = 0,
    dp: int = 1,
) -> None:
    name = ipc.scheduler_name(replica)
    proc = ipc.WorkerProcess(ipc_dir, ipc.FRONTEND)
    codec = Codec(typed)

    def build() -> tuple[zmq.Socket, list[zmq.Socket], LLM, WarmUpReport]:
        inbox = ipc.pull(proc.ctx, ipc_dir, name)
        to_tok = [ipc.push(proc.ctx, ipc_dir, ipc.tokenizer_name(i)) for i in range(num_tokenizer)]
        from minisgl.llm import LLM

        llm = LLM(model_path, **placed(llm_kwargs, replica, dp))
        return inbox, to_tok, llm, llm.runtime.ensure_warm()  # warm before Ready: /health waits

    started = proc.start(build, lambda err: codec.encode(Ready(name, os.getpid(), error=err)))
    if started is None:
        return
    inbox, to_tok, llm, warmup = started
    info = engine_info(llm, warmup)
    loop = EngineLoop(llm.runtime, codec, to_tok, proc.report)
    loop.replica = replica
    proc.ready(
        lambda frozen: codec.encode(Ready(name, os.getpid(), info=info | {"gc_frozen": frozen}))
    )
    loop.maybe_send_stats(force=True)
    proc.serve(lambda: loop.run(inbox, proc.alive), llm.close)


def engine_info(llm: LLM, warmup: WarmUpReport) -> dict[str, Any]:
    """What the engine worker's `Ready` tells the API server about its engine."""
    eng = llm.engine
    return {
        "max_seq_len": int(eng.max_seq_len),
        "vocab_size": int(eng.model_config.vocab_size),
        "num_pages": int(eng.num_pages),
        "page_size": int(llm.config.page_size),
        "device": str(eng.device),
        "dtype": str(eng.dtype).replace("torch.", ""),
        "architecture": eng.model_config.architecture,
        INFO_KEY: warmup.info(),
    }
