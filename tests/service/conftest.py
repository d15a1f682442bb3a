"""Servers for the rust_service tests: started once per module, python and rust_service side by
side on the same tiny model. A server that cannot start is recorded, not raised, so a test
fails by assertion in its body (what a red record needs) and says why."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from minisgl.testing.server import Started, start
from minisgl.testing.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return write_tiny_model("llama", tmp_path_factory.mktemp("svc-tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory) -> Iterator[dict[str, Started]]:
    """python (page 1), rust_service (page 1) and rust_service (page 16, 32-token prefill
    chunks) on the tiny llama, with the server harness's limits."""
    log_dir = tmp_path_factory.mktemp("svc-logs")
    with contextlib.ExitStack() as stack:
        out = {
            "python": stack.enter_context(
                start("python", tiny_llama, log_dir=log_dir, backend="python")
            ),
            "service": stack.enter_context(
                start("service", tiny_llama, log_dir=log_dir, backend="rust_service")
            ),
            "service16": stack.enter_context(
                start(
                    "service16",
                    tiny_llama,
                    "--page-size",
                    "16",
                    "--max-prefill-length",
                    "32",
                    log_dir=log_dir,
                    backend="rust_service",
                )
            ),
        }
        yield out
