"""The ranks of a tensor-parallel engine: rank 0 (the `Leader`, in the process that schedules)
starts ranks 1..N-1 (`python -m minisgl.distributed.follower`, one process each) and sends
them every step plan; each `Follower` runs the same forward, so the collectives meet.

Control messages go over a private socket pair per follower (a `multiprocessing` connection:
it polls, so rank 0 never waits on a dead rank); the tensors of a step (the model's
collectives, the in-flight inputs of overlap scheduling) go over torch.distributed. A follower
exits when rank 0's process goes away; rank 0 names a dead rank in every later call.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from minisgl.config import EngineConfig
from minisgl.distributed.comm import Comm
from minisgl.distributed.errors import RankFailed
from minisgl.distributed.layout import TPInfo, dist_backend
from minisgl.step.plan import StepPlan
from minisgl.step.staging import InputFill
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

TIMEOUT_S = float(os.environ.get("MINISGL_TP_TIMEOUT_S", "600"))  # start-up and collectives
STOP_S = 10.0


@dataclass(frozen=True)
class Boot:
    """What rank `rank` needs to join: its engine config and where the group meets."""

    config: EngineConfig
    rank: int
    size: int
    store_port: int
    parent_pid: int


@dataclass(frozen=True)
class Step:
    """One step for the followers: the plan, and how many in-flight inputs follow it over
    torch.distributed (positions, then tokens)."""

    plan: StepPlan
    num_fill: int


def rank_config(config: EngineConfig, rank: int, device_type: str) -> EngineConfig:
    """Rank `rank`'s engine config: its own CUDA device; on a CPU, an equal share of the cores
    unless the caller set a thread budget."""
    if device_type == "cuda":
        return replace(config, device=f"cuda:{rank}")
    if config.threads is None:
        return replace(config, threads=max(1, (os.cpu_count() or 1) // config.tp_size))
    return config


def _store(port: int, size: int, is_master: bool) -> dist.TCPStore:
    """The group's rendezvous: rank 0 serves it (port 0: any free port), the others join."""
    return dist.TCPStore("127.0.0.1", port, size, is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip


def _join(info: TPInfo, device_type: str, store: dist.TCPStore) -> None:
    dist.init_process_group(dist_backend(device_type), store=store, rank=info.rank,
                            world_size=info.size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))  # fmt: skip


class Leader:
    """Rank 0: starts the other ranks, agrees with them, sends them every step."""

    def __init__(
        self, config: EngineConfig, device_type: str, procs: list[subprocess.Popen],
        conns: list[Connection],
    ) -> None:  # fmt: skip
        self.info = TPInfo(0, config.tp_size)
        self.device_type = device_type
        self.procs, self.conns = procs, conns
        self.comm: Comm | None = None  # once the model's vocabulary is known (`attach`)
        self.failed: str | None = None
        self.store: dist.TCPStore | None = None

    @classmethod
    def start(cls, config: EngineConfig, device_type: str) -> Leader:
        """Start ranks 1..tp-1 and join the process group with them (an error of a rank's
        start-up is raised here, naming the rank)."""
        master = _store(0, config.tp_size, is_master=True)
        procs, conns = [], []
        leader = cls(config, device_type, procs, conns)
        leader.store = master  # kept alive: the group's rendezvous lives in it
        try:
            for rank in range(1, config.tp_size):
                mine, theirs = socket.socketpair()
                cmd = [sys.executable, "-m", "minisgl.distributed.follower", str(theirs.fileno())]
                procs.append(subprocess.Popen(cmd, pass_fds=(theirs.fileno(),)))
                theirs.close()
                conn = Connection(mine.detach())
                conns.append(conn)
                boot = Boot(rank_config(config, rank, device_type), rank, config.tp_size,
                            master.port, os.getpid())  # fmt: skip
                conn.send(boot)
            for rank in range(1, config.tp_size):
                leader._expect(rank, "joining")
            with leader.guard("joining the process group"):
                _join(leader.info, device_type, master)
        except BaseException:
            leader.close()
            raise
        logger.info("tensor parallel: %d ranks (%s), ranks 1..%d in pids %s", config.tp_size,
                    dist_backend(device_type), config.tp_size - 1, leader.follower_pids())  # fmt: skip
        return leader

    def attach(self, vocab_size: int) -> Comm:
        self.comm = Comm(self.info, vocab_size)
        return self.comm

    def follower_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------ control messages
    def _expect(self, rank: int, what: str) -> object:
        """The next message of `rank`, waiting while it lives; its error, if it sent one."""
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + TIMEOUT_S
        while not conn.poll(0.05):
            if proc.poll() is not None:
                self._fail(rank, f"exited with code {proc.returncode} while {what}")
            if time.monotonic() > deadline:
                self._fail(rank, f"sent nothing for {TIMEOUT_S:.0f}s while {what}")
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            self._fail(rank, f"closed its connection while {what}")
        if isinstance(msg, tuple) and msg and msg[0] == "error":
            self._fail(rank, f"failed while {what}: {msg[1]}")
        return msg

    def _fail(self, rank: int, why: str) -> None:
        self.failed = f"tensor-parallel rank {rank} {why}"
        raise RankFailed(self.failed)

    def agree_min(self, value: int, what: str) -> int:
        """The smallest `value` over the ranks (each computes its own: e.g. KV pages)."""
        values = [value] + [int(self._expect(r, what)) for r in range(1, self.info.size)]
        agreed = min(values)
        for conn in self.conns:
            conn.send(agreed)
        return agreed

    def check(self) -> None:
        """Raise `RankFailed` once a rank is gone (every call after, too)."""
        if self.failed is not None:
            raise RankFailed(self.failed)
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                self._fail(rank, f"exited with code {proc.returncode}")

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Turn an error of a collective into `RankFailed` naming the rank that caused it."""
        try:
            yield
        except RankFailed:
            raise
        except Exception as e:
            deadline = time.monotonic() + 2.0  # a rank's exit may lag the broken collective
            while time.monotonic() < deadline:
                for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
                    if conn.poll(0):
                        with contextlib.suppress(EOFError, OSError):
                            msg = conn.recv()
                            if isinstance(msg, tuple) and msg and msg[0] == "error":
                                self._fail(rank, f"failed while {what}: {msg[1]}")
                    if proc.poll() is not None:
                        self._fail(rank, f"exited with code {proc.returncode} while {what}")
                time.sleep(0.05)
            self.failed = f"tensor-parallel rank 0 lost the group while {what}: {e}"
            raise RankFailed(self.failed) from e

    # ------------------------------------------------------------------ steps
    def send_step(self, plan: StepPlan, fill: InputFill | None) -> None:
        """Every follower gets the plan (and the in-flight inputs) before rank 0 runs it."""
        self.check()
        data = pickle.dumps(Step(plan, 0 if fill is None else int(fill.positions.numel())),
                            protocol=pickle.HIGHEST_PROTOCOL)  # fmt: skip
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(rank, "closed its connection")
        if fill is not None and self.comm is not None:
            with self.guard("receiving a step"):
                self.comm.broadcast(fill.positions.contiguous())
                self.comm.broadcast(fill.tokens.to(torch.int64).contiguous())

    def close(self) -> None:
        """Stop the followers (a clean stop, then a kill after `STOP_S`) and leave the group."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + STOP_S
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


class Follower:
    """Rank r > 0: the engine's link to rank 0."""

    def __init__(self, boot: Boot, conn: Connection, device_type: str) -> None:
        self.info = TPInfo(boot.rank, boot.size)
        self.conn = conn
        self.device_type = device_type
        self.comm: Comm | None = None
        _join(self.info, device_type, _store(boot.store_port, boot.size, is_master=False))

    def attach(self, vocab_size: int) -> Comm:
        self.comm = Comm(self.info, vocab_size)
        return self.comm

    def agree_min(self, value: int, what: str) -> int:
        self.conn.send(value)
        return int(self.conn.recv())

    def recv_step(self, device: torch.device) -> tuple[StepPlan, InputFill | None] | None:
        """The next step (None: stop)."""
        step: Step | None = pickle.loads(self.conn.recv_bytes())
        if step is None:
            return None
        fill = None
        if step.num_fill and self.comm is not None:
            positions = torch.empty(step.num_fill, dtype=torch.int64, device=device)
            tokens = torch.empty(step.num_fill, dtype=torch.int64, device=device)
            fill = InputFill(self.comm.broadcast(positions), self.comm.broadcast(tokens))
        return step.plan, fill

    def report(self, error: str) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("error", error))


def watch_parent(parent_pid: int) -> None:
    """Exit this process once `parent_pid` is gone (rank 0 killed: no orphan rank)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, name="minisgl-tp-parent", daemon=True).start()
