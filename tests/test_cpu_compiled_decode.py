"""Decode steps through `torch.compile` on the CPU, and one thread budget (card P2-002).

Compiled steps are checked against HF (fp32, token for token) and against the eager engine
(bf16 and int4: logits closeness and greedy agreement); the speed gate compares single-stream
int4 decode of the embedded model with llama.cpp on the GGUF it ships, same run
(`worklog/gates/P2-002.yaml`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.testing.hf_reference import hf_greedy, load_hf_model
from minisgl.testing.plans import GreedyRow, PlannedBatch
from minisgl.testing.scenarios import assert_kv_clean, cpu_attention, random_prompts
from minisgl.testing.tiny_models import write_tiny_model

SMALL = dict(num_pages=2048, max_seq_len_override=128)


def require_options() -> None:
    """The options this card adds, on the engine's config and the offline API."""
    import dataclasses
    import inspect

    from minisgl.config import EngineConfig

    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    params = inspect.signature(LLM.__init__).parameters
    for name in ("enable_torch_compile", "threads"):
        assert name in fields, f"EngineConfig has no {name!r}"
        assert name in params, f"LLM(...) takes no {name!r}"


@pytest.fixture
def restore_threads():
    import torch

    n, env = torch.get_num_threads(), os.environ.get("RAYON_NUM_THREADS")
    yield
    torch.set_num_threads(n)
    if env is None:
        os.environ.pop("RAYON_NUM_THREADS", None)
    else:
        os.environ["RAYON_NUM_THREADS"] = env


@pytest.mark.card("P2-002", "compiled-decode-is-token-identical-to-hf-in-fp32")
@pytest.mark.card("P2-002", "failing-tests-compiled-decode-parity-the-thread-budget-the-speed-gate")
@pytest.mark.card("P2-002", "decode-steps-run-through-the-compiled-forward-when-enabled")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_decode_matches_hf_fp32(arch, tmp_path):
    require_options()
    path = write_tiny_model(arch, tmp_path / arch, seed=1)
    llm = LLM(path, dtype="float32", enable_torch_compile=True, **SMALL)
    # the decode graphs are compiled before the first request: a compile in the middle of
    # serving would stall every running request for a minute on a CPU
    graphs = _compiled_graphs()
    assert graphs > 0
    prompts = random_prompts(5, 3, 40, seed=2)
    # different lengths: the batch shrinks as requests finish (batch sizes 5 .. 1)
    params = [SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True) for i in range(5)]
    out = llm.generate(prompts, params)
    assert _compiled_graphs() == graphs, "serving compiled a new decode graph"
    got = [o["token_ids"] for o in out]
    want = hf_greedy(load_hf_model(path), prompts, 24)
    assert got == [w[: len(g)] for w, g in zip(want, got, strict=True)]
    assert llm.engine.compiled is not None and llm.engine.compiled.steps >= 20
    assert_kv_clean(llm)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _decode_logits(path, compile_: bool, dtype: str, quantization: str, steps: int,
                   tokens: list[list[int]] | None = None):  # fmt: skip
    """Logits of `steps` decode steps over the same batch, one [bs, vocab] tensor per step,
    and the tokens fed after the prefill and each step: the engine's own argmax, or `tokens`
    (another engine's, so a near-tie in bf16 cannot send the two down different texts)."""
    from minisgl.config import EngineConfig
    from minisgl.engine.engine import Engine

    engine = Engine(EngineConfig(model_path=str(path), dtype=dtype, quantization=quantization,
                                 enable_torch_compile=compile_, **SMALL))  # fmt: skip
    batch = PlannedBatch.for_engine(engine, [5, 17, 9, 30, 2], per_request=64, seed=3)
    rows = [GreedyRow()] * 5
    fed = [engine.sample_step(batch.plan(True), rows, frozenset()).tokens]
    batch.push(tokens[0] if tokens else fed[0])
    out = []
    for step in range(steps):
        logits = engine.forward(batch.plan(False))
        out.append(logits)
        fed.append(logits.argmax(-1).tolist())
        batch.push(tokens[step + 1] if tokens else fed[-1])
    return engine, out, fed


@pytest.mark.card("P2-002", "compiled-decode-agrees-with-eager-decode-in-bf16-and-int4")
@pytest.mark.card("P2-002", "decode-steps-run-through-the-compiled-forward-when-enabled")
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_compiled_decode_agrees_with_eager(quantization, tmp_path, monkeypatch):
    import torch

    # eager through the torch modules, as the compiled graphs: the C decode step's own int8
    # activations are its tests' (on the x86-avx2 kind, where int4 graphs de-quantize in fp32,
    # they put 2 of 1920 logits 5.5% of the range from the graphs')
    monkeypatch.setenv("MINISGL_CPU_DECODE", "modules")
    path = write_tiny_model("llama", tmp_path / "m", seed=0)
    _, eager, fed = _decode_logits(path, False, "bfloat16", quantization, 6)
    engine, comp, _ = _decode_logits(path, True, "bfloat16", quantization, 6, tokens=fed)
    assert engine.compiled is not None and engine.compiled.steps == 6
    agree = total = 0
    for e, c in zip(eager, comp, strict=True):
        scale = float(e.abs().max())
        torch.testing.assert_close(c, e, atol=0.05 * scale, rtol=0.0)
        agree += int((c.argmax(-1) == e.argmax(-1)).sum())
        total += e.shape[0]
    print(f"bf16/{quantization} compiled vs eager greedy agreement: {agree}/{total}")
    assert agree >= 0.9 * total


@pytest.mark.card(
    "P2-002", "compiled-decode-serves-prefix-hits-aborts-and-mixed-batch-sizes-with-kv-returned"
)
@pytest.mark.card("P2-002", "the-eager-path-is-unchanged-when-compile-is-off")
def test_compiled_decode_scenario_equals_eager(tmp_path):
    path = write_tiny_model("llama", tmp_path / "m", seed=5)
    shared = random_prompts(1, 30, 30, seed=6)[0]
    prompts = [shared + p for p in random_prompts(6, 1, 12, seed=7)]  # prefix hits
    params = [SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True) for i in range(6)]

    def run(compile_: bool) -> tuple[list[list[int]], LLM]:
        llm = LLM(path, dtype="float32", enable_torch_compile=compile_, **SMALL)
        first = llm.generate(prompts[:2], params[:2])
        sched = llm.scheduler
        rids = [sched.add_request(p, sp) for p, sp in zip(prompts[2:], params[2:], strict=True)]
        got: dict[int, list[int]] = {r: [] for r in rids}
        aborted = False
        while llm.has_work():
            for o in llm.step():
                got[o.rid].append(o.token_id)
            if not aborted and len(got[rids[-1]]) >= 3:
                assert sched.abort(rids[-1])  # aborted with decode steps in flight
                aborted = True
        assert_kv_clean(llm)
        return [o["token_ids"] for o in first] + [got[r] for r in rids], llm

    want, _ = run(False)
    got, llm = run(True)
    assert got == want
    assert llm.engine.compiled is not None and llm.engine.compiled.steps > 0
    assert llm.scheduler.stats.cached_prompt_tokens >= 4 * 30  # the shared prefix was hit


def test_a_long_decode_compiles_nothing_and_each_graph_has_its_own_cache(tmp_path):
    """Requests that decode 150 tokens run on the graphs compiled at start: no compile
    mid-serving. The C kernel reads the pool in place: one graph per batch kind (1, more) and
    no workspace. (When it kept a workspace, decoding past its capacity read a full workspace
    as a contiguous view and compiled a fifth graph; through SDPA, which slices the workspace
    to the longest request, that compile still happens: SDPA decode is the no-compiler
    fallback, where torch.compile cannot run either.) Each step kind has a dynamo cache of its
    own holding one graph, so a step checks one set of guards (with one shared cache, the
    guards of the other graphs were checked first)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    path = write_tiny_model("llama", tmp_path / "m", seed=2)
    llm = LLM(path, dtype="float32", enable_torch_compile=True, num_pages=2048,
              max_seq_len_override=512)  # fmt: skip
    assert llm.engine.backend.native
    graphs = _compiled_graphs()
    prompts = random_prompts(2, 4, 6, seed=3)
    params = SamplingParams(max_tokens=150, ignore_eos=True)  # past GROW (128) positions
    single = llm.generate(prompts[:1], params)[0]["token_ids"]
    pair = [o["token_ids"] for o in llm.generate(prompts, params)]
    assert _compiled_graphs() == graphs, "serving compiled a new decode graph"
    ws = llm.engine.backend.workspace
    compiled = llm.engine.compiled
    assert compiled is not None
    sizes = {
        key: len(_debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__))
        for key, fn in compiled.graphs.items()
    }
    assert ws.rebuilds == ws.appends == 0 and ws.k is None
    assert sizes == {(1, "paged"): 1, (2, "paged"): 1}
    want = hf_greedy(load_hf_model(path), prompts, 150)
    assert [single, *pair[1:]] == want and pair[0] == single
    assert_kv_clean(llm)


def test_no_decode_graph_guards_module_state(tmp_path):
    """Every decode graph skips the guards on the model's modules (the weights never change
    after load; checking them cost ~0.7 ms a step on the embedded model), not only the first
    one compiled: `torch.compile` pops `guard_filter_fn` out of the options dict it is given,
    so a shared dict left the later graphs with ~150 module guards per layer."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    def code_parts(manager) -> list[str]:
        parts = [p for g in manager.get_leaf_guards() for p in g.verbose_code_parts()]
        return parts + [p for c in manager.get_child_managers() for p in code_parts(c)]

    path = write_tiny_model("llama", tmp_path / "m", seed=7)
    llm = LLM(path, dtype="float32", enable_torch_compile=True, **SMALL)
    compiled = llm.engine.compiled
    # batch 1 and more x paged (the C kernel), or x workspace rebuild / append (SDPA)
    expected = 2 if llm.engine.backend.native else 4
    assert compiled is not None and len(compiled.graphs) == expected
    for key, fn in compiled.graphs.items():
        (entry,) = _debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__)
        parts = code_parts(entry.guard_manager.root)
        on_modules = [p for p in parts if "_modules[" in p or "_parameters" in p]
        assert parts and not on_modules, f"graph {key} guards module state: {on_modules[:2]}"


@pytest.mark.parametrize("attention", ["native", "sdpa"])
def test_compiled_decode_writes_only_the_new_kv(attention, tmp_path):
    """A compiled decode step writes the new token's K / V into the pool (and, through SDPA,
    into the decode workspace) in place. Written through a layer's view
    (`ws.k[layer][rows, :, pos] = k`), the graph was functionalized into a select_scatter /
    slice_scatter of the whole [layers, bs, KVH, cap, D] tensor: every layer of every step
    copied its whole block (~75 us a layer, a fifth of the embedded model's single-stream int4
    step). The graphs after inductor's post-grad passes hold no scatter, and the tokens stay
    HF's. The C kernel reads the pool in place: its steps write nothing else."""
    import collections

    import torch._inductor.config as inductor_config

    ops: list[collections.Counter[str]] = []

    def record(graph) -> None:
        ops.append(collections.Counter(str(n.target) for n in graph.nodes))

    path = write_tiny_model("llama", tmp_path / "m", seed=5)
    # config.patch, not monkeypatch: monkeypatch's undo deletes the option from inductor's
    # config module, breaking every later compile in the process
    with inductor_config.patch(post_grad_custom_post_pass=record), cpu_attention(attention):
        llm = LLM(path, dtype="float32", enable_torch_compile=True, **SMALL)
    # the start compiles the decode graphs (batch 1 and more x rebuild / append through SDPA,
    # x paged through the kernel) and the prefill pieces (which write nothing: prefill
    # attention runs eager)
    graphs, writes = (4, 2 * 2 * 2) if attention == "sdpa" else (2, 2 * 2)
    decode = [c for c in ops if c["aten.index_put.default"]]
    assert len(decode) == graphs and len(ops) == graphs + 2, "the start compiles every graph"
    for counted in decode:
        scatters = {op: n for op, n in counted.items() if "scatter" in op}
        assert not scatters, f"a decode graph copies the workspace: {scatters}"
        # 2 layers x (pool, and the workspace for SDPA) x K, V
        assert counted["aten.index_put.default"] == writes
    prompts = random_prompts(2, 4, 8, seed=6)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = [o["token_ids"] for o in llm.generate(prompts, params)]
    assert got == hf_greedy(load_hf_model(path), prompts, 12)
    assert_kv_clean(llm)


def test_steps_over_the_workspace_budget_run_eager(tmp_path, monkeypatch):
    """A decode batch too large for the workspace gathers its KV every step: a graph the start
    did not compile (a 56 s stall at batch 128 on the embedded model) and a GEMM-bound step
    that compile does not speed up, so it runs eager, with the same tokens."""
    monkeypatch.setenv("MINISGL_DECODE_WORKSPACE_MB", "0")
    path = write_tiny_model("llama", tmp_path / "m", seed=3)
    prompts = random_prompts(3, 3, 20, seed=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o["token_ids"] for o in LLM(path, dtype="float32", **SMALL).generate(prompts, params)]
    with cpu_attention("sdpa"):  # the workspace is SDPA's (the C kernel reads the pool)
        llm = LLM(path, dtype="float32", enable_torch_compile=True, **SMALL)
    graphs = _compiled_graphs()  # the start compiled the prefill pieces, no decode graph
    assert [o["token_ids"] for o in llm.generate(prompts, params)] == want
    assert llm.engine.compiled is not None and llm.engine.compiled.steps == 0
    assert not llm.engine.compiled.graphs and _compiled_graphs() == graphs
    assert_kv_clean(llm)


@pytest.mark.card("P2-002", "thread-budget-set-by-llm-and-by-the-server-flag")
@pytest.mark.card("P2-002", "failing-tests-compiled-decode-parity-the-thread-budget-the-speed-gate")
def test_thread_budget(tmp_path, restore_threads):
    import torch

    from minisgl.config import EngineConfig
    from minisgl.server.args import parse_args

    require_options()
    path = write_tiny_model("llama", tmp_path / "m", seed=0)
    torch.set_num_threads(2)
    LLM(path, threads=1, **SMALL)
    assert torch.get_num_threads() == 1
    assert os.environ["RAYON_NUM_THREADS"] == "1"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"

    args = parse_args(["--model-path", str(path), "--threads", "1", "--enable-torch-compile"])
    kwargs = args.llm_kwargs()
    assert kwargs["threads"] == 1 and kwargs["enable_torch_compile"] is True
    cfg = EngineConfig(model_path=str(path), **args.engine_kwargs())  # the rust_service worker's
    assert cfg.threads == 1 and cfg.enable_torch_compile
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(model_path=str(path), threads=0)


@pytest.mark.gate_only
@pytest.mark.bench
@pytest.mark.requires(
    "llama_cpp", "`nox -s card -- P2-002` builds llama-cpp-python (or: nox -s llamacpp)"
)
@pytest.mark.card(
    "P2-002",
    "single-stream-int4-decode-at-least-llama-cpp-on-the-embedded-gguf-same-machine-same-run",
)
def test_single_stream_vs_llamacpp(metric, tmp_path):
    """`cpu_speed` single profile: minisgl int4 with compiled decode beside llama.cpp (the
    `llamacpp` extra: `nox -s llamacpp`), 2 threads, median of 3 repeats."""
    from minisgl.testing.cpu_speed import run_single_vs_llamacpp

    single = run_single_vs_llamacpp(tmp_path, "int4-compiled")["results"]["single"]
    mini = single["minisgl-int4-compiled"]["output_tok_s"]
    lcpp = single["llamacpp"]["output_tok_s"]
    print(f"single stream: minisgl int4 compiled {mini:.1f} tok/s, llama.cpp {lcpp:.1f}, "
          f"{mini / lcpp:.2f}x")  # fmt: skip
    metric("single_stream_tok_s_minisgl_int4_compiled", mini, unit="tok/s")
    metric("single_stream_tok_s_llamacpp", lcpp, unit="tok/s")


@pytest.mark.card("P2-002", "the-eager-path-is-unchanged-when-compile-is-off")
def test_compiled_decode_is_off_by_default(tmp_path):
    path = write_tiny_model("llama", tmp_path / "m", seed=0)
    llm = LLM(path, **SMALL)
    assert llm.engine.compiled is None
    assert Path(path).is_dir()
