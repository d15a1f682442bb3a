"""The server's HTTP stack: uvloop + httptools by default (what vLLM / SGLang serve with),
h11 / asyncio on request, and the choice shown in /health."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import httpx
import pytest

from minisgl.server.args import parse_args
from minisgl.server.launch import uvicorn_stack

CARD = "P1-014"
RED = "online-overhead-tests-fail-before-the-stack-the-timelines-and-the-lean-client-exist"
GREEN = "online-overhead-tests-pass"


PKG = Path(__file__).resolve().parents[2]


@pytest.mark.card(CARD, "the-server-runs-uvloop-and-httptools-by-default", RED, GREEN)
def test_uvloop_and_httptools_are_plain_dependencies_on_linux():
    deps = tomllib.loads((PKG / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ;]", d)[0].lower(): d for d in deps}
    assert "httptools" in names and "uvloop" in names
    assert "sys_platform != 'win32'" in names["uvloop"]  # uvloop has no Windows build


@pytest.mark.card(CARD, "the-server-runs-uvloop-and-httptools-by-default", RED, GREEN)
def test_flags_choose_the_stack():
    assert parse_args(["--model-path", "m"]).http == "auto"
    assert parse_args(["--model-path", "m"]).loop == "auto"
    assert uvicorn_stack(parse_args(["--model-path", "m"])) == ("uvloop", "httptools")
    args = parse_args(["--model-path", "m", "--http", "h11", "--loop", "asyncio"])
    assert uvicorn_stack(args) == ("asyncio", "h11")
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--http", "gunicorn"])


@pytest.mark.card(CARD, "the-server-runs-uvloop-and-httptools-by-default", RED, GREEN)
def test_health_names_the_stack(server):
    h = httpx.get(server.base_url + "/health", timeout=10).json()
    assert {k: h["http"][k] for k in ("loop", "protocol")} == {
        "loop": "uvloop",
        "protocol": "httptools",
    }


def test_health_reports_the_http_warm_up(server):
    """The first streamed response used to import anyio's asyncio backend and FastAPI's lazy
    modules inside the first requests (70-290 ms stalls, `MINISGL_TRACE_DIR`)."""
    h = httpx.get(server.base_url + "/health", timeout=10).json()
    warm = h["http"].get("warmup")
    assert warm is not None and warm["ms"] > 0
    assert warm["steps"] == ["GET /health", "GET /v1/models", "POST /v1/chat/completions 400",
                             "POST /v1/completions 400", "stream"]  # fmt: skip
