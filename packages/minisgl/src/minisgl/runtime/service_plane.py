"""The control plane in the Rust service (`minisgl-cpu-service`, the server's `rust_service`
backend), started as a subprocess of this one, with this process as its one worker: the
offline API on the Rust scheduler, no PyO3.

This process plays both of the service's peers over ZMQ ipc sockets in a private dir: the API
server (`TokenizeReq` with token ids, `AbortReq`; back: `Admitted`, `DetokOut`, `Reject`,
`Stats`) and GPU worker 0 (`WorkerHello`, `StepResult`; back: `HelloAck`, `Step`). Steps run
through `Runtime.execute`, as in the server's GPU worker; a `DetokOut` row says how many of a
request's sampled tokens are confirmed, read from its `ServiceSteps`. The service exits with
`close()`, at interpreter exit, or by itself once this process is gone (`--parent-pid`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from minisgl import ipc
from minisgl.core import SamplingParams
from minisgl.cpu_service import ServiceLimits, ServiceProcess, service_command
from minisgl.message.schema import (
    AbortReq,
    Codec,
    DetokOut,
    HelloAck,
    Ready,
    Reject,
    Shutdown,
    Stats,
    Step,
    StepResult,
    TokenizeReq,
    WireParams,
    WorkerHello,
)
from minisgl.runtime.loop import EMPTY, StepBatch
from minisgl.runtime.service_steps import ServiceSteps
from minisgl.sampler import TokenLogprob
from minisgl.sampling_fields import SAMPLING_WIRE_FIELDS
from minisgl.scheduler.request import StepOutput, validate_request

READY_TIMEOUT_S = 120.0
POLL_MS = 50


def engine_info(engine: Any) -> dict[str, Any]:
    """What a worker's `WorkerHello` tells the service of its engine."""
    cfg = engine.model_config
    return {
        "max_seq_len": int(engine.max_seq_len),
        "vocab_size": int(cfg.vocab_size),
        "num_pages": int(engine.num_pages),
        "page_size": int(engine.config.page_size),
        "eos_token_ids": sorted(int(t) for t in cfg.eos_token_ids),
        "device": str(engine.device),
        "dtype": str(engine.dtype).replace("torch.", ""),
        "architecture": cfg.architecture,
    }


def wire_params(p: SamplingParams, leader: int | None) -> WireParams:
    """`p` as it travels: every field of the table's wire layout (`SAMPLING_WIRE_FIELDS`)."""
    fmt = None
    if p.response_format is not None:
        rf: Any = p.response_format
        raw: dict[str, Any] = {"type": rf.kind}
        if rf.kind == "json_schema":
            raw["json_schema"] = {"schema": json.loads(rf.schema), "strict": True}
        fmt = json.dumps(raw)
    kw = {name: getattr(p, name) for name in SAMPLING_WIRE_FIELDS}
    kw.update(
        stop=list(p.stop_strings),
        stop_token_ids=list(p.stop_token_ids) if p.stop_token_ids else None,
        logit_bias=[[t, b] for t, b in p.logit_bias] or None,
        response_format=fmt,
        prefix_leader=leader or 0,
    )
    return WireParams(**kw)


def _stop_service(proc: ServiceProcess, ipc_dir: str, ctx: zmq.Context, to_service: Any) -> None:
    """Shutdown, then SIGKILL after 2 s; the ipc dir removed. Idempotent, safe at exit."""
    if proc.is_alive():
        with contextlib.suppress(zmq.ZMQError):
            to_service.send(Codec(True).encode(Shutdown("offline runtime closed")))
        proc.join(2.0)
        proc.kill()
        proc.join(2.0)
    ctx.destroy(linger=0)
    shutil.rmtree(ipc_dir, ignore_errors=True)


class ServicePlane:
    def __init__(
        self,
        model_path: str,
        limits: ServiceLimits,
        steps: ServiceSteps,
        execute: Callable[[Step], StepResult],
        engine: Any,
        depth: int,
    ) -> None:
        self.steps = steps
        self.execute = execute  # `Runtime.execute`: what the server's GPU worker runs
        self.engine = engine
        self.codec = Codec(True)
        self.live: dict[int, int] = {}  # rid -> its tokens confirmed so far
        self.stats: dict[str, Any] = {}  # the service's last `Stats` snapshot
        self.ipc_dir = ipc.make_ipc_dir(os.environ.get("MINISGL_IPC_ROOT"))
        self.ctx = zmq.Context()
        self.inbox = ipc.pull(self.ctx, self.ipc_dir, ipc.FRONTEND)
        self.work = ipc.pull(self.ctx, self.ipc_dir, ipc.worker_name(0))
        self.to_service = ipc.push(self.ctx, self.ipc_dir, ipc.SERVICE)
        self.to_steps = ipc.push(self.ctx, self.ipc_dir, ipc.STEPS)
        self.poller = zmq.Poller()
        for sock in (self.work, self.inbox):
            self.poller.register(sock, zmq.POLLIN)
        cmd = service_command(limits, model_path, self.ipc_dir, num_workers=1, depth=depth + 1)
        self.proc = ServiceProcess(cmd)
        self.proc.start()
        self._finalizer = weakref.finalize(
            self, _stop_service, self.proc, self.ipc_dir, self.ctx, self.to_service
        )
        try:
            self._handshake()
        except BaseException:
            self.close()
            raise

    @property
    def service_pid(self) -> int | None:
        return self.proc.pid

    def service_cpu_s(self) -> float:
        """CPU seconds the service process has used so far (0 where /proc is missing)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _handshake(self) -> None:
        hello = WorkerHello(0, os.getpid(), engine_info(self.engine))
        self.to_steps.send(self.codec.encode(hello))
        deadline = time.monotonic() + READY_TIMEOUT_S
        acked = ready = False
        while not (acked and ready):
            self._check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError("the Rust service did not report ready")
            for frame in ipc.drain(self.work, POLL_MS):
                msg = self.codec.decode(frame)
                if isinstance(msg, HelloAck):  # the stop tokens `min_tokens` masks, as served
                    self.steps.device.eos = frozenset(int(t) for t in msg.eos_token_ids)
                    acked = True
            for frame in ipc.drain(self.inbox, 0):
                msg = self.codec.decode(frame)
                if isinstance(msg, Ready):
                    if msg.error:
                        raise RuntimeError(f"the Rust service failed to start: {msg.error}")
                    ready = True

    def _check_alive(self) -> None:
        if not self.proc.is_alive():
            raise RuntimeError(f"the Rust service exited with code {self.proc.exitcode}")

    # ------------------------------------------------------------------ requests
    def add(
        self,
        rid: int,
        input_ids: Sequence[int] | np.ndarray,
        params: SamplingParams,
        generator: Any,
        leader: int | None,
    ) -> None:
        eng = self.engine
        ids, _ = validate_request(
            input_ids, params, eng.max_seq_len, eng.num_pages, eng.config.page_size
        )
        msg = TokenizeReq(rid, "ids", ids.tolist(), wire_params(params, leader))
        self.to_service.send(self.codec.encode(msg))
        self.live[rid] = 0

    def abort(self, rid: int) -> None:
        if self.live.pop(rid, None) is not None:
            self.to_service.send(self.codec.encode(AbortReq(rid)))
            self.steps.released.pop(rid, None)

    def finish(self, rid: int, reason: str) -> None:
        """The service finishes on stop strings itself (it has them): nothing to send."""

    def has_work(self) -> bool:
        return bool(self.live)

    # ------------------------------------------------------------------ steps
    def step(self) -> StepBatch:
        """Run the steps that came, until some tokens are confirmed (or nothing is live)."""
        outs: list[StepOutput] = []
        lps: list[TokenLogprob | None] = []
        errors: dict[int, str] = {}
        while self.live and not outs and not errors:
            self._check_alive()
            ready = dict(self.poller.poll(POLL_MS))
            for frame in ipc.drain(self.work, 0) if self.work in ready else ():
                msg = self.codec.decode(frame)
                if isinstance(msg, Step):
                    self.to_steps.send(self.codec.encode(self.execute(msg)))
            for frame in ipc.drain(self.inbox, 0) if self.inbox in ready else ():
                msg = self.codec.decode(frame)
                if isinstance(msg, DetokOut):
                    self._confirm(msg, outs, lps)
                elif isinstance(msg, Stats):
                    self.stats = msg.data
                elif isinstance(msg, Reject) and self.live.pop(msg.uid, None) is not None:
                    errors[msg.uid] = msg.message
                    self.steps.released.pop(msg.uid, None)
        if not outs and not errors:
            return EMPTY
        return StepBatch(outs, lps, errors)

    def _confirm(
        self, msg: DetokOut, outs: list[StepOutput], lps: list[TokenLogprob | None]
    ) -> None:
        for uid, count, finished in zip(msg.uids, msg.counts, msg.finished, strict=True):
            done = self.live.get(uid)
            req = self.steps.get(uid)
            if done is None or req is None:
                continue
            new = req.output_ids[done : done + count]
            new_lps = req.logprobs[done : done + count] if req.logprobs else []
            self.live[uid] = done + count
            for k, tok in enumerate(new):
                last = k == len(new) - 1
                outs.append(StepOutput(uid, tok, finished if last else None))
                lps.append(new_lps[k] if k < len(new_lps) else None)
            if finished is not None:
                del self.live[uid]
                self.steps.released.pop(uid, None)

    def fresh_stats(self, timeout_s: float = 1.5) -> dict[str, Any]:
        """The next `Stats` snapshot the service sends (idle: within a second)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for frame in ipc.drain(self.inbox, POLL_MS):
                msg = self.codec.decode(frame)
                if isinstance(msg, Stats):
                    self.stats = msg.data
                    return self.stats
        return self.stats

    def drain(self, fail: bool = False) -> list[StepBatch]:
        return []

    def fail_all(self) -> list[int]:
        rids = list(self.live)
        for rid in rids:
            self.abort(rid)
        return rids

    def close(self) -> None:
        self._finalizer()
