from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.testing.tiny_models import ARCHITECTURES, write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> callable:
    """tiny_model_dir("llama") -> path of a tiny random llama (written once per session)."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), seed=0)
        return made[arch]

    return get


@pytest.fixture(params=ARCHITECTURES)
def arch(request) -> str:
    return request.param
