"""`--cardgate-timeout S`: a test phase that runs longer than S seconds fails.

The alarm raises `PhaseTimeout`, a `BaseException` (an `except Exception` in the test does not
see it); a test that catches it anyway still fails: the phase re-raises once it returns.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any


class PhaseTimeout(BaseException):
    """A test phase ran longer than `--cardgate-timeout` (or the card's `Timeout:`)."""


@contextlib.contextmanager
def alarm(seconds: float | None, what: str) -> Iterator[None]:
    if not seconds or not hasattr(signal, "setitimer"):
        yield
        return
    message = f"timeout: {what} ran longer than {seconds:g}s"
    expired: list[bool] = []

    def expire(signum: int, frame: Any) -> None:
        expired.append(True)
        raise PhaseTimeout(message)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    if expired:  # the phase swallowed the timeout and returned
        raise PhaseTimeout(message + " (the test caught the timeout and went on)")
