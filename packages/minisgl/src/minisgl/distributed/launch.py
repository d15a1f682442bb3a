"""torchrun launches: the tensor-parallel ranks started by `torchrun` instead of by rank 0.

`torchrun --nproc-per-node N script.py` (a script calling `LLM(path, tp_size=N)`) and
`torchrun --nproc-per-node N -m minisgl --tp N ...` run the same code in N processes. The
runtime sees torchrun's variables (`torchrun_env`), checks that WORLD_SIZE is the engine's
ranks (`check_world`), and joins torchrun's process group (env://, or the group the script
already initialised) instead of starting ranks itself:

- rank 0 schedules and returns the outputs (`ranks.Leader.join`);
- a rank > 0 runs rank 0's steps inside `LLM(...)` (or `python -m minisgl`) until rank 0
  ends, then its process exits (`SystemExit`: 0 when rank 0 closed the engine or exited, 3
  when it vanished, 1 on an error): code after `LLM(...)` runs on rank 0 only.

This module imports no torch: the server's launcher reads it before any worker starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class TorchrunEnv:
    """Where this process sits in a torchrun launch."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def single_node(self) -> bool:
        return self.local_world_size == self.world_size


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """torchrun's variables (`os.environ` by default); None outside a torchrun launch."""
    env = os.environ if environ is None else environ
    if not all(key in env for key in VARS):
        return None
    try:
        world = int(env["WORLD_SIZE"])
        return TorchrunEnv(
            rank=int(env["RANK"]),
            world_size=world,
            local_rank=int(env["LOCAL_RANK"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
        )
    except ValueError as e:
        raise ValueError(f"torchrun's variables are not numbers: {e}") from None


def check_world(env: TorchrunEnv, *, tp: int, dp: int = 1) -> None:
    """ValueError unless torchrun started exactly the engine's ranks (tp x dp) for one replica:
    raised on every rank, before any weight loads."""
    if dp > 1:
        raise ValueError(
            f"--dp {dp} under torchrun: a torchrun launch runs one replica of --tp ranks; run "
            f"`python -m minisgl --dp {dp} --tp {tp}` without torchrun (it starts every rank)"
        )
    if env.world_size != tp * dp:
        raise ValueError(
            f"torchrun started WORLD_SIZE={env.world_size} processes but the engine runs "
            f"--tp {tp} x --dp {dp} = {tp * dp} ranks (tp_size={tp}): start torchrun with "
            f"--nproc-per-node {tp * dp} (one process per rank) or pass tp_size={env.world_size}"
        )
