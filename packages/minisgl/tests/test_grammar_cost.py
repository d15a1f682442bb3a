"""Issue 38: what constrained decoding costs the rows that are not constrained. A batch without
a constrained row does no mask work at all; in a mixed batch only the constrained rows are
masked (no [batch, vocab] tensor is made), each request's matcher is built once and consumes
each of its tokens once, and the engine starts a step's masks before its forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minisgl import SamplingParams
from minisgl.config import ModelConfig
from minisgl.sampler import sample
from minisgl.scheduler.backend import SampleView
from minisgl.structured import GrammarBank

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4096}},  # never complete
    "required": ["text"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "note", "schema": SCHEMA}}
FREE = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BOUND = SamplingParams(temperature=0.0, max_tokens=8, response_format=FORMAT)


class Shapes(TorchDispatchMode):
    """The shape of every tensor an aten op returns while active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


@pytest.fixture(scope="module")
def bank_model(tiny_model_dir):
    path = tiny_model_dir("llama")
    return path, ModelConfig.from_dir(path).vocab_size


def _rows(params: list[SamplingParams]) -> list[SampleView]:
    ids = np.arange(1, 5, dtype=np.int32)
    return [SampleView(rid, p, 7, ids, ()) for rid, p in enumerate(params, start=1)]


def _advance(rows: list[SampleView], tokens: list[int]) -> list[SampleView]:
    return [
        SampleView(r.rid, r.params, r.generator, r.input_ids, (*r.output_ids, t))
        for r, t in zip(rows, tokens, strict=True)
    ]


def test_a_batch_without_constrained_rows_does_no_mask_work(bank_model):
    path, vocab = bank_model
    bank = GrammarBank(path, vocab)
    rows = _rows([FREE] * 4)
    logits = torch.randn(4, vocab, dtype=torch.bfloat16)
    for _ in range(3):
        res = sample(logits, rows, grammars=bank)
        rows = _advance(rows, res.tokens)
    stats = bank.stats()
    assert (stats.masks, stats.rows, stats.matchers, stats.tokens) == (0, 0, 0, 0)


def test_a_mixed_batch_touches_only_its_constrained_rows(bank_model):
    path, vocab = bank_model
    bank = GrammarBank(path, vocab)
    rows = _rows([BOUND, FREE, BOUND, FREE, FREE, BOUND])
    cons = [0, 2, 5]
    gen = torch.Generator().manual_seed(0)
    steps = 4
    for step in range(steps):
        logits = torch.randn(len(rows), vocab, generator=gen).to(torch.bfloat16)
        with Shapes() as seen:
            res = sample(logits, rows, grammars=bank)
        whole = [f for f, shape in seen.shapes if shape == (len(rows), vocab)]
        assert not whole, f"step {step}: ops over the whole batch's logits: {whole}"
        free = [i for i in range(len(rows)) if i not in cons]
        assert [res.tokens[i] for i in free] == logits[free].float().argmax(-1).tolist()
        assert all(e is None for e in res.errors)
        rows = _advance(rows, res.tokens)
    stats = bank.stats()
    assert stats.masks == steps  # one mask batch a step
    assert stats.rows == steps * len(cons)  # of the constrained rows only
    assert stats.matchers == len(cons)  # one matcher a request, built once
    assert stats.tokens == (steps - 1) * len(cons)  # each token consumed once


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir):
    from minisgl import LLM

    return LLM(tiny_model_dir("llama"), num_pages=2048, max_seq_len_override=256)


def test_generate_builds_one_matcher_a_request_and_masks_before_the_forward(tiny_llm):
    engine = tiny_llm.engine
    before = engine.grammars.stats()
    tiny_llm.generate([[1, 2, 3, 4]] * 4, FREE)
    assert engine.grammars.stats() == before  # nothing constrained: nothing done

    in_flight: list[bool] = []
    forward = engine._forward

    def watched(plan, staged):
        in_flight.append(engine.grammars.busy)
        return forward(plan, staged)

    engine._forward = watched
    try:
        params = [BOUND, FREE] * 3
        outs = tiny_llm.generate([[1, 2, 3, 4 + i] for i in range(6)], params)
    finally:
        del engine._forward
    stats = engine.grammars.stats()
    constrained_tokens = sum(len(o["token_ids"]) for o in outs[::2])
    assert stats.matchers - before.matchers == 3
    assert stats.tokens - before.tokens <= constrained_tokens  # none consumed twice
    assert all(o["error"] is None for o in outs)
    assert in_flight and all(in_flight), in_flight  # every step's masks started first
