"""A tensor-parallel rank > 0: `python -m minisgl.engine.follower FD`, started by rank 0
(`ranks.Leader.start`) with FD the rank's end of its control socket; `follow_torchrun` runs a
rank that torchrun started (`minisgl.distributed.launch`)."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl.distributed.launch import TorchrunEnv
    from minisgl.distributed.ranks import Boot, Follower


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    from minisgl.distributed.ranks import Follower, watch_parent

    boot: Boot = conn.recv()
    watch_parent(boot.parent_pid)
    return serve(conn, boot, Follower.spawned)


def serve(conn: Connection, boot: Boot, link: Callable[[Boot, Connection, str], Follower]) -> int:
    """Run rank 0's steps until it stops us: 0; rank 0 gone: 3; an error (reported): 1."""
    follower = None
    try:
        from minisgl.engine.engine import Engine
        from minisgl.engine.memory import resolve_device
        from minisgl.utils.threads import set_threads

        if boot.config.threads is not None:
            set_threads(boot.config.threads)
        conn.send(("hello", os.getpid()))
        follower = link(boot, conn, resolve_device(boot.config.device).type)
        Engine(boot.config, tp=follower).follow()
    except (EOFError, ConnectionError):
        print(f"[minisgl tp rank {boot.rank} pid={os.getpid()}] rank 0 went away: exiting",
              file=sys.stderr, flush=True)  # fmt: skip
        return 3
    except BaseException as e:
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        traceback.print_exc()
        if follower is not None:
            follower.report(text)
        else:
            with contextlib.suppress(OSError):
                conn.send(("error", text))
        return 1
    return 0


def follow_torchrun(env: TorchrunEnv, device_type: str) -> int:
    """A torchrun rank > 0: join the group, connect to rank 0, run its steps on the config it
    sends (on CUDA, on this node's device LOCAL_RANK); the exit code of `serve`."""
    import torch.distributed as dist

    from minisgl.distributed.ranks import Follower, join_follower, join_torchrun

    owns = join_torchrun(env, device_type)
    conn = None
    try:
        conn = join_follower(env)
        boot: Boot = conn.recv()
        if device_type == "cuda":
            config = replace(boot.config, device=f"cuda:{env.local_rank}")
            boot = replace(boot, config=config)
        return serve(conn, boot, Follower)
    except (EOFError, ConnectionError):
        return 3
    finally:  # leave the group before rank 0 does: it waits for this connection to close
        if owns and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if conn is not None:
            conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
