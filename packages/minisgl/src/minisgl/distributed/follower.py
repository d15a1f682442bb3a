"""A tensor-parallel rank > 0: `python -m minisgl.distributed.follower FD`, started by rank 0
(`ranks.Leader.start`) with FD the rank's end of its control socket."""

from __future__ import annotations

import os
import sys
import traceback
from multiprocessing.connection import Connection


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[1]))
    from minisgl.distributed.ranks import Boot, Follower, watch_parent

    boot: Boot = conn.recv()
    watch_parent(boot.parent_pid)
    link = None
    try:
        from minisgl.engine.engine import Engine
        from minisgl.engine.memory import resolve_device
        from minisgl.utils.threads import set_threads

        if boot.config.threads is not None:
            set_threads(boot.config.threads)
        conn.send(("hello", os.getpid()))
        link = Follower(boot, conn, resolve_device(boot.config.device).type)
        Engine(boot.config, tp=link).follow()
    except (EOFError, ConnectionError):
        return 3  # rank 0 went away: nothing to report to
    except BaseException as e:
        text = "".join(traceback.format_exception_only(type(e), e)).strip()
        traceback.print_exc()
        if link is not None:
            link.report(text)
        else:
            conn.send(("error", text))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
