"""`DraftModel`: the `draft` speculative algorithm's source, a draft model sharing the target's
tokenizer (issue 62 item 1).

It runs in the target's process on an engine and `Runtime` of its own (the python control
plane, serial loop; the target's engine options but the model, one rank): each step it is
asked for k_i tokens after each drafting request's tokens so far and answers with its greedy
continuation, all requests of the step in one batch. Its prefix cache makes that cheap: a
request's accepted drafts are a prefix of what the draft computed for it last step, so a call
prefills only the tokens it has not seen (the target's own token, or every draft when all held)
and decodes k_i - 1 more; rejected drafts are never matched again and age out of its cache
like any other entry. Drafting requests are greedy and ignore EOS; a request the draft model
cannot hold (past its context) gets no drafts.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from minisgl.core import SamplingParams
from minisgl.runtime.runtime import Runtime
from minisgl.speculative import SpecConfig
from minisgl.utils.log import get_logger

logger = get_logger(__name__)

_NONE = np.zeros(0, dtype=np.int32)


class DraftModel:
    """The `draft` draft source (`speculative.DraftSource`)."""

    name = "draft"
    exact = True  # k tokens when asked for k, each a forward of the draft model

    def __init__(self, runtime: Runtime, vocab_size: int) -> None:
        self.runtime = runtime
        self.vocab_size = vocab_size

    @classmethod
    def load(cls, config: SpecConfig, target: Any, warm_up: bool = False) -> DraftModel:
        """The draft model of `config` beside the `target` engine: checked to share its
        tokenizer (a ValueError otherwise), given the target's KV capacity in tokens."""
        from minisgl.engine.sim import make_engine

        path = config.draft_model_path
        if path is None or not Path(path).exists():
            raise ValueError(f"the draft model path {path!r} does not exist")
        engine = make_engine(replace(target.config, model_path=path, quantization="auto",
                                     num_pages=target.num_pages, tp_size=1))  # fmt: skip
        try:
            check_compatible(engine, target)
            runtime = Runtime.build(engine, backend="python", overlap=False, warm_up=warm_up)
        except BaseException:
            close = getattr(engine, "close", None)
            if close is not None:
                close()
            raise
        logger.info("speculative draft model %s (%s)", Path(path).name, type(engine).__name__)
        return cls(runtime, engine.model_config.vocab_size)

    def propose_many(self, tokens: Sequence[np.ndarray], ks: Sequence[int]) -> list[np.ndarray]:
        rt = self.runtime
        limit = rt.engine.max_seq_len
        rids: dict[int, int] = {}  # draft request id -> its row
        for i, (ids, k) in enumerate(zip(tokens, ks, strict=True)):
            if k > 0 and len(ids) + k <= limit:
                params = SamplingParams(temperature=0.0, max_tokens=int(k), ignore_eos=True)
                rids[rt.add(np.asarray(ids, dtype=np.int32), params)] = i
        out: list[list[int]] = [[] for _ in tokens]
        while rt.has_work():
            batch = rt.step()
            for o in batch.outputs:
                out[rids[o.rid]].append(o.token_id)
            for rid in batch.errors:  # a row that failed alone drafts nothing
                out[rids[rid]] = []
        return [np.asarray(o, dtype=np.int32) if o else _NONE for o in out]

    def close(self) -> None:
        self.runtime.close()


def check_compatible(draft: Any, target: Any) -> None:
    """A ValueError unless every token the draft engine can emit is one of the target's with
    the same meaning: a vocabulary no larger, the same tokenizer where both folders have a
    `tokenizer.json` (a padded vocabulary may differ in size between models of one family)."""
    dv, tv = draft.model_config.vocab_size, target.model_config.vocab_size
    if dv > tv:
        raise ValueError(
            f"the draft model's vocabulary ({dv} tokens) is larger than the target's ({tv}): "
            "a draft model must share the target's tokenizer"
        )
    mine, theirs = _vocab(draft.config.model_path), _vocab(target.config.model_path)
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(
            "the draft model's tokenizer differs from the target's (tokenizer.json): a draft "
            "model must share the target's tokenizer"
        )


def _vocab(folder: str) -> dict[str, int] | None:
    """The token -> id map of a folder's `tokenizer.json` (its model's vocabulary and added
    tokens), None without one."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = dict((data.get("model") or {}).get("vocab") or {})
    for added in data.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
    return vocab
