"""Fixtures: one shared real server per xdist worker, and the offline reference LLM."""

from __future__ import annotations

import pytest

from minisgl.testing.server import running_server


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """One shared server per xdist worker (tiny llama, 16 running + 48 queued)."""
    with running_server(
        tiny_model_dir("llama"), log_dir=tmp_path_factory.mktemp("server-log")
    ) as s:
        yield s


@pytest.fixture(scope="session")
def llm_ref(tiny_model_dir):
    """The offline LLM on the same model and limits (the reference for text parity)."""
    from minisgl import LLM

    return LLM(tiny_model_dir("llama"), num_pages=4096, max_seq_len_override=256)
