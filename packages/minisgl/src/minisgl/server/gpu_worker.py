"""A Python GPU worker of the `rust_service` backend: it owns the model, the KV tensors and
sampling, and nothing else. The Rust service schedules; each `Step` it sends runs through the
`Runtime` (the same step code as the offline API on the service), and the sampled tokens go
back in a `StepResult`. Steps go to the device as they arrive (`ServicePipeline`): the device
runs step k+1 while this process sends step k's result, and a finished step wakes the loop
through a pipe polled with the inbox. No scheduling logic and no PyO3 module here.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import zmq

from minisgl import ipc
from minisgl.message.schema import (
    Codec,
    HelloAck,
    SchemaError,
    Shutdown,
    Step,
    StepResult,
    WorkerHello,
)
from minisgl.message.warmup import INFO_KEY

if TYPE_CHECKING:  # the launcher imports this module: torch loads in the worker only
    from minisgl.runtime import Runtime
    from minisgl.runtime.service_steps import ServicePipeline


def run_gpu_worker(
    index: int, model_path: str, llm_kwargs: dict, ipc_dir: str, typed: bool, dp: int = 1
) -> None:
    name = ipc.worker_name(index)
    proc = ipc.WorkerProcess(ipc_dir, ipc.STEPS)
    codec = Codec(typed)

    def build() -> tuple[zmq.Socket, Runtime, dict]:
        inbox = ipc.pull(proc.ctx, ipc_dir, name)
        from minisgl.config import EngineConfig
        from minisgl.engine.sim import make_engine
        from minisgl.runtime import Runtime
        from minisgl.runtime.service_plane import engine_info
        from minisgl.server.replicas import placed

        kwargs = placed(llm_kwargs, index, dp)  # this replica's devices
        engine = make_engine(EngineConfig(model_path=model_path, **kwargs))
        # warmed up on the worker's own scheduler before the service hears of this worker
        runtime = Runtime.build(engine, backend="python", overlap=False, warm_up=True)
        return inbox, runtime, {**engine_info(engine), INFO_KEY: runtime.ensure_warm().info()}

    started = proc.start(
        build, lambda err: codec.encode(WorkerHello(index, os.getpid(), error=err))
    )
    if started is None:
        return
    inbox, runtime, info = started
    proc.ready(lambda frozen: codec.encode(WorkerHello(index, os.getpid(), info)))
    pipe = runtime.service_pipeline()

    def close() -> None:
        pipe.close()
        runtime.close()

    proc.serve(lambda: serve(proc, name, codec, inbox, runtime, pipe), close)


def serve(
    proc: ipc.WorkerProcess,
    name: str,
    codec: Codec,
    inbox: zmq.Socket,
    runtime: Runtime,
    pipe: ServicePipeline,
) -> None:
    """Until Shutdown (or the launcher is gone): steps from the service go to the device as
    they arrive (after its `HelloAck`); each step read back goes to the service at once."""
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    poller.register(pipe.fileno(), zmq.POLLIN)
    acked = False

    def send(results: list[StepResult]) -> None:
        for result in results:
            proc.report.send(codec.encode(result))
            if engine_lost(runtime.engine):  # a tensor-parallel rank died: no later step runs
                ipc.worker_log(name, result.fatal or "engine lost")
                time.sleep(0.2)  # the result reaches the service first
                raise SystemExit(1)

    while proc.alive():
        events = dict(poller.poll(100))
        frames = ipc.drain(inbox, 0) if inbox in events else []
        for frame in frames:
            try:
                msg = codec.decode(frame)
            except (SchemaError, ValueError, TypeError) as e:
                ipc.worker_log(name, f"rejected a malformed message: {e}")
                continue
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, HelloAck):
                runtime.serve_service(int(t) for t in msg.eos_token_ids)
                acked = True
            elif isinstance(msg, Step) and acked:
                ipc.fault_step_delay()
                send(pipe.submit(msg))  # the steps it had to wait for
            else:
                ipc.worker_log(name, f"rejected an unexpected {type(msg).__name__}")
        if pipe.fileno() in events:  # a step was read back
            send(pipe.ready())


def engine_lost(engine: object) -> bool:
    """The engine cannot run another step (a tensor-parallel rank failed)."""
    leader = getattr(engine, "leader", None)
    return leader is not None and leader.failed is not None


def run_step(runtime: Runtime, step: Step) -> StepResult:
    """One step; a failed forward is reported (every row's request fails), never raised."""
    ipc.fault_step_delay()
    return runtime.execute(step)
