from __future__ import annotations

import pytest
from cardgate_repo import Repo


@pytest.fixture
def repo(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Repo:
    monkeypatch.setenv("CARDGATE_GPU", "0")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    return Repo(pytester)
