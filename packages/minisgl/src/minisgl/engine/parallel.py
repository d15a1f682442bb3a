"""The engine of a tensor-parallel group, as `make_engine` builds it: the settings checked
before anything loads, then either rank 0 starting ranks 1.. itself (`Leader.start`) or, under
torchrun, this process's rank joining the group torchrun started (`minisgl.distributed.launch`:
rank 0 returns the engine, a rank > 0 follows rank 0 and exits)."""

from __future__ import annotations

from dataclasses import replace

import torch

from minisgl.config import EngineConfig, ModelConfig
from minisgl.distributed.launch import TorchrunEnv, check_world, torchrun_env
from minisgl.engine.engine import Engine
from minisgl.engine.memory import resolve_device, resolve_quantization
from minisgl.utils.threads import set_threads

FOLLOWER = "minisgl.engine.follower"  # a rank > 0 that rank 0 starts: `python -m FOLLOWER FD`


def launched_by_torchrun(config: EngineConfig) -> TorchrunEnv | None:
    """torchrun's variables, checked against `config.tp_size` (ValueError before anything
    loads); None outside torchrun."""
    env = torchrun_env()
    if env is not None:
        check_world(env, tp=config.tp_size)
    return env


def tensor_parallel_engine(config: EngineConfig, env: TorchrunEnv | None) -> Engine:
    """Rank 0's engine; under torchrun on a rank > 0: its steps, then `SystemExit`."""
    import torch.distributed as dist

    from minisgl.distributed import check_tp
    from minisgl.distributed.ranks import Leader, rank_config

    device = resolve_device(config.device)
    if env is not None and device.index is not None:
        raise ValueError(f"tp_size={config.tp_size} under torchrun: each rank runs on "
                         f"cuda:LOCAL_RANK; give device 'cuda' or 'auto', not "
                         f"{config.device!r}")  # fmt: skip
    quantization = config.quantization
    if config.dummy_weights and quantization == "auto":
        quantization = "none"  # as `Engine` decides it
    if config.sim_device is None:
        quantization = resolve_quantization(quantization, config.model_path, device)
    count = torch.cuda.device_count() if device.type == "cuda" else 0
    check_tp(
        ModelConfig.from_dir(config.model_path),
        config,
        device.type,
        device_count=count if env is None else None,
        backend_available=lambda name: dist.is_available() and dist.is_backend_available(name),
        quantization=quantization,
    )
    if env is not None and device.type == "cuda" and env.local_rank >= count:
        raise ValueError(f"torchrun LOCAL_RANK={env.local_rank} needs cuda:{env.local_rank}, "
                         f"{count} CUDA devices visible")  # fmt: skip
    if env is not None and env.rank > 0:
        from minisgl.engine.follower import follow_torchrun

        raise SystemExit(follow_torchrun(env, device.type))
    if env is not None and device.type == "cuda":
        config = replace(config, device=f"cuda:{env.local_rank}")
    config = rank_config(config, 0, device.type)
    if config.threads is not None:
        set_threads(config.threads)
    leader = (
        Leader.start(config, device.type, FOLLOWER)
        if env is None
        else Leader.join(config, device.type, env)
    )
    try:
        return Engine(config, tp=leader)
    except BaseException:
        leader.close()
        raise
