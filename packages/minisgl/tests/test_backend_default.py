"""`auto` is the default attention backend of every entry point (issue 36): triton and CUDA
graphs on a CUDA device, torch_native on a CPU, the choice and its reason in the log.

The CUDA side is checked without a GPU: `torch.cuda.is_available` is patched, and the values
the engine would take from it (device, backend, graph runner) are asserted."""

from __future__ import annotations

import inspect

import torch

from minisgl import LLM
from minisgl.attention import resolve_backend
from minisgl.attention.torch_native import TorchNativeBackend
from minisgl.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.engine.graph_runner import DEFAULT_MAX_BS, resolve_runner
from minisgl.engine.memory import resolve_device
from minisgl.server.args import ServerArgs, parse_args


def test_every_entry_point_defaults_to_auto():
    assert EngineConfig(model_path="m").attention_backend == "auto"
    assert inspect.signature(LLM).parameters["attention_backend"].default == "auto"
    assert ServerArgs().attention_backend == "auto"
    assert parse_args(["--model-path", "m"]).attention_backend == "auto"
    named = parse_args(["--model-path", "m", "--attention-backend", "torch_native"])
    assert named.llm_kwargs()["attention_backend"] == "torch_native"


def test_default_on_cpu_is_torch_native_and_logged(tiny_model_dir, caplog):
    with caplog.at_level("INFO", logger="minisgl"):
        engine = Engine(EngineConfig(model_path=str(tiny_model_dir("llama")), device="cpu",
                                     num_pages=64))  # fmt: skip
    assert isinstance(engine.backend, TorchNativeBackend)
    assert engine.attention_backend == "torch_native"
    assert engine.graphs is None  # no decode graphs on a CPU unless asked for
    assert "attention backend auto -> torch_native (device is cpu" in caplog.text


def test_default_on_a_cuda_device_is_triton_with_graphs(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = EngineConfig(model_path="m")
    device = resolve_device(cfg.device)
    assert device == torch.device("cuda")
    with caplog.at_level("INFO", logger="minisgl.attention"):
        assert resolve_backend(cfg.attention_backend, device) == "triton"
    assert "attention backend auto -> triton (CUDA device and triton imports)" in caplog.text
    assert resolve_runner(cfg.graph_runner, device, cfg.cuda_graph_max_bs) == (
        "cuda",
        DEFAULT_MAX_BS,
    )


def test_a_named_backend_is_logged_as_asked(tiny_model_dir, caplog):
    with caplog.at_level("INFO", logger="minisgl"):
        engine = Engine(EngineConfig(model_path=str(tiny_model_dir("llama")), device="cpu",
                                     num_pages=64, attention_backend="torch_native"))  # fmt: skip
    assert engine.attention_backend == "torch_native"
    assert "attention backend torch_native (asked for by name)" in caplog.text
