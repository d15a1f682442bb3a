"""Command-line flags of `python -m minisgl` (the earlier project's names)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import asdict, dataclass, field

from minisgl.core import PRIORITY_RANGE
from minisgl.cpu_service import ServiceLimits
from minisgl.scheduler.policy import AGING_STEPS, POLICIES


@dataclass
class ServerArgs:
    model_path: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 1919
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 1
    num_pages: int | None = None
    memory_ratio: float | None = None
    cache_type: str = "radix"
    attention_backend: str = "auto"
    max_running_requests: int = 256
    max_queued_requests: int | None = None  # default: 4 x max_running_requests
    max_prefill_length: int = 4096
    max_seq_len_override: int | None = None
    cuda_graph_max_bs: int | None = None
    dummy_weights: bool = False
    num_tokenizer: int = 1
    transport: str = "typed"
    startup_timeout: float = 300.0
    shutdown_timeout: float = 5.0
    max_request_bytes: int = 4 * 1024 * 1024
    log_level: str = "warning"
    sim_device: str | None = None  # "BASE_MS,TOKEN_MS": no model, see engine/sim.py
    cpu_backend: str = "python"  # MINISGL_CPU_BACKEND (not a flag): python | rust_service
    enable_torch_compile: bool = False
    deterministic: bool = False  # batch-invariant CPU kernels (EngineConfig.deterministic)
    speculative_algorithm: str | None = None  # ngram (minisgl.speculative), None: off
    speculative_num_draft_tokens: int | None = None  # k (default 4 with an algorithm)
    speculative_max_step_rows: int | None = None  # a verify step's rows (default 8)
    speculative_draft_model_path: str | None = None  # the draft algorithm's model
    threads: int | None = None
    tp_size: int = 1
    dp_size: int = 1
    dp_routing: str | None = None  # rust_service: prefix (default) | round_robin
    http: str = "auto"
    loop: str = "auto"
    # issue 63: --api-key (or MINISGL_API_KEY; never shown), the --chat-template's text,
    # --scheduling-policy (priority: the request field `priority`)
    api_key: str | None = field(default=None, repr=False)
    chat_template: str | None = None
    scheduling_policy: str = "fcfs"
    reasoning_parser: str | None = None  # issue 63: `<think>` text as reasoning_content

    @property
    def queue_limit(self) -> int:
        """Requests the server holds at once (running + queued); past it: 429."""
        queued = self.max_queued_requests
        if queued is None:
            queued = 4 * self.max_running_requests
        return self.max_running_requests + queued

    def llm_kwargs(self) -> dict:
        return dict(
            dtype=self.dtype,
            device=self.device,
            page_size=self.page_size,
            num_pages=self.num_pages,
            memory_ratio=self.memory_ratio,
            cache_type=self.cache_type,
            attention_backend=self.attention_backend,
            max_running_requests=self.max_running_requests,
            max_extend_tokens=self.max_prefill_length,
            max_seq_len_override=self.max_seq_len_override,
            cuda_graph_max_bs=self.cuda_graph_max_bs,
            dummy_weights=self.dummy_weights,
            sim_device=self.sim_device,
            enable_torch_compile=self.enable_torch_compile,
            deterministic=self.deterministic,
            speculative_algorithm=self.speculative_algorithm,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            speculative_max_step_rows=self.speculative_max_step_rows,
            speculative_draft_model_path=self.speculative_draft_model_path,
            threads=self.threads,
            tp_size=self.tp_size,
        )

    def engine_kwargs(self) -> dict:
        """`llm_kwargs` less what only `LLM` takes (the speculative options: the step loop's,
        not the engine's): the `EngineConfig` of a rust_service GPU worker or a TP follower."""
        return {k: v for k, v in self.llm_kwargs().items() if k not in LLM_ONLY}

    def service_limits(self) -> ServiceLimits:
        """The scheduler limits the Rust service is started with (rust_service)."""
        from minisgl.scheduler.policy import priority_aging_steps

        return ServiceLimits(self.page_size, self.max_running_requests, self.max_prefill_length,
                             self.cache_type, self.dp_routing,
                             cache_outputs=not self.deterministic,
                             priority_aging_steps=priority_aging_steps(self.scheduling_policy))  # fmt: skip

    def to_dict(self) -> dict:
        return asdict(self)


API_KEY_ENV = "MINISGL_API_KEY"
LLM_ONLY = (
    "speculative_algorithm",
    "speculative_num_draft_tokens",
    "speculative_max_step_rows",
    "speculative_draft_model_path",
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` names each option's default, unless its help says it already or there is none
    to show (None: decided at start-up, as the help says; a flag: off)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, False):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="minisgl OpenAI-compatible server",
        formatter_class=HelpFormatter,
    )
    for add in (
        add_model_args,
        add_engine_args,
        add_batch_args,
        add_speculative_args,
        add_parallel_args,
        add_process_args,
        add_request_args,
    ):
        add(p)
    return p


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, the name it is served under, and the address."""
    p.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        default=None,
        help="HF model directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model's id in /v1/models and every response (default: the model folder's "
        "name, the embedded model's own name; never a path)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP server listens on")
    p.add_argument("--port", type=int, default=1919, help="port the HTTP server listens on")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine: dtype, device, KV cache, attention."""
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="compute dtype; auto: picked by device and model",
    )
    p.add_argument(
        "--device", default="auto", help="auto (CUDA when available, else cpu), cpu, cuda"
    )
    p.add_argument("--page-size", type=int, default=1, help="KV cache page size in tokens")
    p.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="KV cache pages (default: sized by --memory-ratio)",
    )
    p.add_argument(
        "--memory-ratio",
        type=float,
        default=None,
        help="share of free GPU memory (default 0.8) or available RAM (default 0.25, at most "
        "4 GiB) the KV cache takes",
    )
    p.add_argument("--cache-type", default="radix", choices=["radix", "naive"], help="prefix cache")
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (default): triton on CUDA when triton imports, else torch_native; "
        "torch_native; triton (CUDA)",
    )


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """What a step holds, CUDA graphs, weights and kernels."""
    p.add_argument(
        "--max-running-requests", type=int, default=256, help="requests decoded together"
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests waiting beyond --max-running-requests (default 4x); then 429",
    )
    p.add_argument(
        "--max-prefill-length",
        "--max-extend-tokens",
        dest="max_prefill_length",
        type=int,
        default=4096,
        help="prefill tokens per step (longer prompts are chunked)",
    )
    p.add_argument(
        "--max-seq-len-override",
        type=int,
        default=None,
        help="cap on the context length (default: the model's)",
    )
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest decode batch replayed from a CUDA graph (0: no graphs; default: 256)",
    )
    p.add_argument(
        "--dummy-weights",
        action="store_true",
        help="random weights of config.json's shapes (benchmarks without a checkpoint)",
    )
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="decode steps through torch.compile (the first steps compile: a minute or more "
        "on a CPU)",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant kernels (CPU, bfloat16): a request gives the same tokens for "
        "the same seed whatever else is batched, chunked or cached beside it (docs/server.md)",
    )


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (docs/speculative.md)."""
    p.add_argument(
        "--speculative-algorithm",
        default=None,
        metavar="ngram|draft",
        help="speculative decoding: ngram drafts copied from the prompt and output, or draft "
        "(standalone) from a draft model (python backend; docs/speculative.md); default: off",
    )
    p.add_argument(
        "--speculative-draft-model-path",
        default=None,
        metavar="PATH",
        help="the draft model of --speculative-algorithm draft (an HF folder or a GGUF file "
        "sharing the model's tokenizer)",
    )
    p.add_argument(
        "--speculative-num-draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="the most draft tokens a request verifies a step (default 4)",
    )
    p.add_argument(
        "--speculative-max-step-rows",
        type=int,
        default=None,
        metavar="N",
        help="the most rows a verify step holds: drafts fill what the running requests leave, "
        "first for the requests that accept most (default 8)",
    )


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Threads, tensor- and data-parallel replicas."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch and tokenizer threads of the engine process (default: torch's own)",
    )
    p.add_argument(
        "--tp",
        "--tp-size",
        dest="tp_size",
        type=int,
        default=1,
        help="tensor-parallel ranks: one process each, gloo on CPU, NCCL on CUDA (replica r's "
        "rank i on cuda:{r*tp + i}); started by the server, or by torchrun (torchrun "
        "--nproc-per-node N -m minisgl --tp N: rank 0 serves, the others follow it)",
    )
    p.add_argument(
        "--dp",
        "--dp-size",
        dest="dp_size",
        type=int,
        default=1,
        help="data-parallel replicas: N engines (each of --tp ranks) behind one control plane; "
        "--threads is per replica (unless given: an equal share of the cores); on CUDA replica r "
        "runs on cuda:{r*tp}..cuda:{r*tp + tp - 1}, and dp x tp above the visible GPUs is "
        "refused before any weight loads",
    )
    p.add_argument(
        "--dp-routing",
        default=None,
        choices=["prefix", "round_robin"],
        help="rust_service: the replica of a request: longest cached prefix, then load "
        "(prefix, the default) or round_robin; the python backend routes round-robin",
    )


def add_process_args(p: argparse.ArgumentParser) -> None:
    """The worker processes, their transport and timeouts, and the HTTP stack."""
    p.add_argument(
        "--num-tokenizer", type=int, default=1, help="tokenizer / detokenizer worker processes"
    )
    p.add_argument(
        "--transport",
        default="typed",
        choices=["typed", "generic"],
        help="inter-process message encoding (generic = dataclass->dict, for comparison)",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds the workers get to load the model and warm up",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=5.0,
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 * 1024 * 1024,
        help="largest accepted request body (default 4 MiB); larger ones get 413",
    )
    p.add_argument("--log-level", default="warning", help="uvicorn's log level (debug: tracebacks)")
    p.add_argument(
        "--http",
        default="auto",
        choices=["auto", "httptools", "h11"],
        help="HTTP protocol implementation (uvicorn's): auto = httptools when installed",
    )
    p.add_argument(
        "--loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="event loop of the API server: auto = uvloop when installed",
    )
    p.add_argument(
        "--sim-device",
        nargs="?",
        const="default",
        default=None,
        metavar="BASE_MS[,TOKEN_MS]",
        help="run no model: each step sleeps BASE_MS + TOKEN_MS per token (default 0.5,0.002) "
        "and returns deterministic tokens (benchmarks of the CPU control plane)",
    )


def add_request_args(p: argparse.ArgumentParser) -> None:
    """What requests may do: the API key, chat template, scheduling, reasoning."""
    p.add_argument(
        "--api-key",
        default=None,
        help="every /v1 route needs 'Authorization: Bearer KEY' (else 401; /health and "
        "/metrics stay open); default: the MINISGL_API_KEY environment variable, else none",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) used instead of the model's",
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=POLICIES,
        help="fcfs: first come, first served; priority: requests' 'priority' field orders the "
        f"waiting queue (lower first, in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], one level "
        f"gained every {AGING_STEPS} steps waited)",
    )
    from minisgl.reasoning.formats import REASONING_FORMATS

    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_FORMATS),
        help="split a reasoning model's <think>...</think> text into reasoning_content (tool "
        "calls and response_format then apply to the content after it); default: none",
    )
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """The server's arguments, checked: every error found, in one usage error (exit 2)."""
    from minisgl.scheduler.cpu_backend import requested_backend

    ns = build_parser().parse_args(argv)
    args = ServerArgs(**vars(ns), cpu_backend=requested_backend())
    errors = []
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    elif not args.api_key.strip():
        errors.append("--api-key must not be empty")
    errors += backend_errors(args) + limit_errors(args) + feature_errors(args)
    if errors:
        build_parser().error("; ".join(errors))
    if args.chat_template is not None:  # a start-up error: one line, exit 2 (launch.startup_error)
        from minisgl.tokenizer.chat_template import resolve_chat_template

        try:
            args.chat_template = resolve_chat_template(args.chat_template)
        except ValueError as e:
            build_parser().exit(2, f"minisgl: error: {e}\n")
    return args


def backend_errors(args: ServerArgs) -> list[str]:
    """MINISGL_CPU_BACKEND: a known one."""
    from minisgl.scheduler.cpu_backend import BACKENDS, SERVICE

    errors = []
    if args.cpu_backend not in (*BACKENDS, SERVICE):
        errors.append(
            f"MINISGL_CPU_BACKEND={args.cpu_backend!r}: expected one of "
            + ", ".join((*BACKENDS, SERVICE))
        )
    return errors


def limit_errors(args: ServerArgs) -> list[str]:
    """Counts, sizes and the parallel layout in range; the HTTP stack's packages installed."""
    from minisgl.distributed.launch import check_world, torchrun_env
    from minisgl.scheduler.cpu_backend import SERVICE

    errors = []
    if args.num_tokenizer < 1:
        errors.append("--num-tokenizer must be >= 1")
    if args.max_running_requests < 1:
        errors.append("--max-running-requests must be >= 1")
    if args.threads is not None and args.threads < 1:
        errors.append("--threads must be >= 1")
    if args.tp_size < 1:
        errors.append("--tp must be >= 1")
    if args.dp_size < 1:
        errors.append("--dp must be >= 1")
    try:
        env = torchrun_env()
        if env is not None:
            check_world(env, tp=args.tp_size, dp=args.dp_size)
    except ValueError as e:
        errors.append(str(e))
    if args.dp_routing == "prefix" and args.cpu_backend != SERVICE:
        errors.append(
            "--dp-routing prefix needs MINISGL_CPU_BACKEND=rust_service (the python "
            "backend routes round-robin)"
        )
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        errors.append("--max-queued-requests must be >= 0")
    if args.max_request_bytes < 1:
        errors.append("--max-request-bytes must be >= 1")
    if not 0 <= args.port < 65536:
        errors.append("--port must be in [0, 65535]")
    for flag, name in (("--http", args.http), ("--loop", args.loop)):
        if name not in ("auto", "h11", "asyncio") and importlib.util.find_spec(name) is None:
            errors.append(f"{flag} {name}: the {name} package is not installed")
    return errors


def feature_errors(args: ServerArgs) -> list[str]:
    """Speculative decoding's and the simulated device's settings."""
    from minisgl.speculative import SpecConfig

    errors = []
    try:
        spec = SpecConfig.parse(
            args.speculative_algorithm,
            args.speculative_num_draft_tokens,
            args.speculative_max_step_rows,
            args.speculative_draft_model_path,
        )
    except ValueError as e:
        spec = None
        errors.append(str(e))
    if spec is not None and args.cpu_backend != "python":
        errors.append(
            f"--speculative-algorithm needs the python backend (MINISGL_CPU_BACKEND="
            f"{args.cpu_backend} cannot plan draft rows yet)"
        )
    if args.sim_device is not None:
        from minisgl.config import SimDevice

        try:
            SimDevice.parse(args.sim_device)
        except ValueError as e:
            errors.append(str(e))
    return errors
