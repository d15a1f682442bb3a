"""Where the runtime finds `minisgl-cpu-service`: $MINISGL_CPU_SERVICE_BIN, the interpreter's
scripts dir (where `pip install "minisgl[rust]"` puts it), PATH, $CARGO_TARGET_DIR, then a
checkout's rust/target (release before debug); otherwise an error that says how to install it."""

from __future__ import annotations

from pathlib import Path

import pytest

from minisgl.cpu_service import BINARY, ENV_BINARY, find_service_binary


def executable(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / BINARY
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    """One directory per lookup step, each holding an executable `minisgl-cpu-service`."""
    checkout = tmp_path / "checkout"
    return {
        "env": executable(tmp_path / "explicit"),
        "scripts": executable(tmp_path / "venv" / "bin"),
        "path": executable(tmp_path / "on-path"),
        "cargo_target": executable(tmp_path / "cargo-target" / "release"),
        "release": executable(checkout / "rust" / "target" / "release"),
        "debug": executable(checkout / "rust" / "target" / "debug"),
        "checkout": checkout,
        "source": checkout / "packages" / "minisgl" / "src" / "minisgl" / "server",
    }


def lookup(places: dict[str, Path], *, skip: set[str]) -> Path:
    """`find_service_binary` with the steps in `skip` emptied (their binary removed)."""
    for step in skip:
        places[step].unlink()
    env = {
        "PATH": str(places["path"].parent),
        "CARGO_TARGET_DIR": str(places["cargo_target"].parent.parent),
    }
    if "env" not in skip:
        env[ENV_BINARY] = str(places["env"])
    return find_service_binary(env, places["scripts"].parent, places["source"].parents)


ORDER = ["env", "scripts", "path", "cargo_target", "release", "debug"]


@pytest.mark.parametrize("index", range(len(ORDER)))
def test_each_step_wins_over_every_later_one(places, index):
    assert lookup(places, skip=set(ORDER[:index])) == places[ORDER[index]]


def test_a_file_that_is_not_executable_is_passed_over(places):
    places["scripts"].chmod(0o644)
    assert lookup(places, skip={"env"}) == places["path"]


def test_an_explicit_binary_that_does_not_exist_is_an_error(places, tmp_path):
    env = {ENV_BINARY: str(tmp_path / "nowhere" / BINARY), "PATH": str(places["path"].parent)}
    with pytest.raises(FileNotFoundError) as err:
        find_service_binary(env, places["scripts"].parent, places["source"].parents)
    assert ENV_BINARY in str(err.value)
    assert str(tmp_path / "nowhere" / BINARY) in str(err.value)


def test_nothing_found_says_how_to_install_it(tmp_path):
    scripts = tmp_path / "venv" / "bin"
    scripts.mkdir(parents=True)
    source = tmp_path / "site-packages" / "minisgl" / "server"
    with pytest.raises(FileNotFoundError) as err:
        find_service_binary({"PATH": str(tmp_path / "empty")}, scripts, source.parents)
    message = str(err.value)
    assert 'pip install "minisgl[rust]"' in message
    assert ENV_BINARY in message
    assert str(scripts) in message  # where it looked
    assert "cargo build --release -p minisgl-cpu-service" in message
