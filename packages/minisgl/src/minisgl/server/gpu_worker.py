"""A Python GPU worker of the `rust_service` backend: it owns the model, the KV tensors and
sampling, and nothing else. The Rust service schedules; each `Step` it sends is a flat plan
(`scheduler.plan.PLAN_SEGMENTS`) plus the requests first seen in it; the worker runs the
forward, samples one token per sample row and returns them in a `StepResult`.

What sampling needs of a request (its params, key, prompt and the tokens sampled so far) lives
here, keyed by request id. A plan input of -1 is a decode token the service does not know yet
(it sent this step before the previous one came back): it is the last token sampled in that
row's page-table slot.
Steps run strictly in the order they arrive. No scheduling logic and no PyO3 module here.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import zmq

from minisgl.core import SamplingParams
from minisgl.message.schema import (
    Codec,
    HelloAck,
    SchemaError,
    Shutdown,
    Step,
    StepReq,
    StepResult,
    WorkerHello,
    wire_logprob,
)
from minisgl.server import ipc


@dataclass(eq=False)
class WorkerReq:
    """A request's sampling state (the sampler's `SampleRow`)."""

    rid: int
    input_ids: np.ndarray
    params: SamplingParams
    generator: int
    output_ids: list[int] = field(default_factory=list)


class StepRunner:
    """Runs steps on an `Engine`; holds the per-request sampling state."""

    def __init__(self, engine, eos_token_ids: frozenset[int]) -> None:
        self.engine = engine
        self.eos = eos_token_ids
        self.reqs: dict[int, WorkerReq] = {}
        self.last = np.zeros(0, np.int32)  # page-table slot -> the last token sampled there

    def admit(self, new: list) -> None:
        from minisgl.sampler import request_key

        for packed in new:
            r = StepReq.unpack(packed)
            params = r.params.to_sampling_params()
            self.reqs[r.rid] = WorkerReq(
                r.rid, np.asarray(r.input_ids, np.int32), params, request_key(params.seed)
            )

    def resolve_inputs(self, plan) -> None:
        """Replace each -1 input by the last token sampled for that row's slot (the service
        never hands a slot to another request while a step that holds it is unconfirmed)."""
        from minisgl.scheduler.plan import unknown_inputs

        unknown, slots = unknown_inputs(plan)
        if len(unknown):
            plan.input_ids[unknown] = self.last[slots]

    def remember(self, plan, tokens: np.ndarray) -> None:
        slots = plan.slots[plan.sample_rows]
        if len(slots) and int(slots.max()) >= len(self.last):
            grown = np.zeros(int(slots.max()) + 1, np.int32)
            grown[: len(self.last)] = self.last
            self.last = grown
        self.last[slots] = tokens

    def run(self, step: Step) -> StepResult:
        from minisgl.scheduler.plan import FlatStep, PlanLayout

        for rid in step.release.tolist():
            self.reqs.pop(rid, None)
        self.admit(step.new)
        data = np.array(step.plan, dtype=np.int32)  # writable: -1 inputs are filled in
        plan = FlatStep(bool(step.is_prefill), PlanLayout(*step.sizes), data).plan()
        self.resolve_inputs(plan)
        ipc.fault_step_delay()
        rows = [self.reqs[int(step.rids[r])] for r in plan.sample_rows.tolist()]
        res = self.engine.sample_step(plan, rows, self.eos)
        for req, tok in zip(rows, res.tokens, strict=True):
            req.output_ids.append(tok)
        tokens = np.asarray(res.tokens, dtype=np.int32)
        self.remember(plan, tokens)
        errors = res.errors if any(res.errors) else []
        lps = [wire_logprob(lp) for lp in res.logprobs] if any(res.logprobs) else []
        return StepResult(step.step, tokens, errors, lps)


def engine_info(engine) -> dict:
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


def run_gpu_worker(
    index: int, model_path: str, llm_kwargs: dict, ipc_dir: str, typed: bool
) -> None:
    name = ipc.worker_name(index)
    alive = ipc.setup_worker_process()
    ctx = zmq.Context()
    codec = Codec(typed)
    to_service = ipc.push(ctx, ipc_dir, ipc.STEPS)
    try:
        inbox = ipc.pull(ctx, ipc_dir, name)
        from minisgl.config import EngineConfig
        from minisgl.engine.sim import make_engine

        engine = make_engine(EngineConfig(model_path=model_path, **llm_kwargs))
    except ipc.WorkerExit:
        ctx.destroy(linger=0)
        return
    except Exception as e:
        traceback.print_exc()
        error = f"{type(e).__name__}: {e}"
        to_service.send(codec.encode(WorkerHello(index, os.getpid(), error=error)))
        time.sleep(0.5)
        ctx.destroy(linger=0)
        raise SystemExit(1) from None
    to_service.send(codec.encode(WorkerHello(index, os.getpid(), engine_info(engine))))
    runner: StepRunner | None = None
    try:
        while alive():
            for frame in ipc.drain(inbox, 100):
                try:
                    msg = codec.decode(frame)
                except (SchemaError, ValueError, TypeError) as e:
                    ipc.worker_log(name, f"rejected a malformed message: {e}")
                    continue
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, HelloAck):
                    runner = StepRunner(engine, frozenset(int(t) for t in msg.eos_token_ids))
                elif isinstance(msg, Step) and runner is not None:
                    result = run_step(runner, msg)
                    to_service.send(codec.encode(result))
                    if engine_lost(engine):  # a tensor-parallel rank died: no later step runs
                        ipc.worker_log(name, result.fatal or "engine lost")
                        time.sleep(0.2)  # the result reaches the service first
                        raise SystemExit(1)
                else:
                    ipc.worker_log(name, f"rejected an unexpected {type(msg).__name__}")
    except ipc.WorkerExit:
        pass
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
        ctx.destroy(linger=0)


def engine_lost(engine: object) -> bool:
    """The engine cannot run another step (a tensor-parallel rank failed)."""
    leader = getattr(engine, "leader", None)
    return leader is not None and leader.failed is not None


def run_step(runner: StepRunner, step: Step) -> StepResult:
    """One step; a failed forward is reported (every row's request fails), never raised."""
    try:
        return runner.run(step)
    except Exception as e:
        traceback.print_exc()
        return StepResult(step.step, np.zeros(0, np.int32), fatal=f"engine error: {e!r}")
