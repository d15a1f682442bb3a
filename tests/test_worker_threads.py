"""The repository conftest's thread budget for pytest-xdist workers (`worker_threads`)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def env(monkeypatch):
    for name in ("MINISGL_TEST_THREADS", "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    return monkeypatch


def test_outside_xdist_or_with_one_worker_nothing_changes(env):
    assert root_conftest().worker_threads() is None
    env.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
    assert root_conftest().worker_threads() is None


@pytest.mark.parametrize(("workers", "threads"), [(2, 8), (3, 5), (16, 1), (32, 1)])
def test_workers_share_the_cores_at_least_one_each(env, workers, threads):
    env.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    assert root_conftest().worker_threads() == threads


def test_the_variable_overrides_the_share(env):
    env.setenv("PYTEST_XDIST_WORKER_COUNT", "16")
    env.setenv("MINISGL_TEST_THREADS", "4")
    assert root_conftest().worker_threads() == 4
    env.setenv("MINISGL_TEST_THREADS", "0")
    assert root_conftest().worker_threads() == 1
