"""A gate run ends even when pytest never does.

A test that fails with a ZMQ context still open hung the test process at its exit (the
context's finaliser waits for its sockets): a card without `Timeout:` had no limit at all, and
its gate ran until it was killed by hand (13 minutes, P1-016's red phase). Without `Timeout:`
the whole pytest run now has a default limit (`--run-limit`, 3600 s), and a run past it fails
the gate with its reason."""

from __future__ import annotations

from cardgate_repo import FAIL, Repo, ready

HANGS_AT_EXIT = """\
import atexit
import time

import pytest

atexit.register(time.sleep, 120)


@pytest.mark.card("T-001", "child-one")
def test_one():
    assert True
"""


def test_a_run_that_never_ends_fails_at_its_limit(repo: Repo) -> None:
    ready(repo)
    repo.write("tests/test_demo.py", HANGS_AT_EXIT)
    repo.commit("a test process that hangs at its exit")
    result = repo.gate("--run-limit", "4")
    out = result.stdout.str()
    assert result.ret == FAIL, out
    assert "exceeded" in out and "4" in out, out


def test_without_a_card_timeout_the_run_has_the_default_limit() -> None:
    from cardgate.run import DEFAULT_RUN_LIMIT_S, run_limit

    assert DEFAULT_RUN_LIMIT_S == 3600
    assert run_limit(None, None, 5) == DEFAULT_RUN_LIMIT_S
    assert run_limit(7.0, None, 5) == 7.0  # asked for
    assert run_limit(None, 2.0, 5) == 2.0 * 3 * 10 + 120  # from the card's per-test Timeout:
    assert run_limit(None, 2.0, 40) == 2.0 * 3 * 40 + 120
