"""Load a model directory's tokenizer the quick way: a tokenizer that is exactly its
tokenizer.json goes through `PreTrainedTokenizerFast`, not `AutoTokenizer` (which reads the
model's config through transformers' config classes: ~3 s of imports a process)."""

from __future__ import annotations

import json
import os

# Tokenizer classes that are exactly their tokenizer.json: loaded through
# PreTrainedTokenizerFast directly, skipping the (slow, torch-importing) AutoTokenizer path.
PLAIN_FAST = {"PreTrainedTokenizerFast", "TokenizersBackend", "GPT2Tokenizer", "GPT2TokenizerFast", "Qwen2Tokenizer",
              "Qwen2TokenizerFast"}  # fmt: skip


def load_tokenizer(model_path: str, chat_template: str | None = None):
    """The model's tokenizer; `chat_template` (a checked template text: `chat_template.py`)
    replaces the model's own."""
    tok = _load(model_path)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _load(model_path: str):
    cfg_file = os.path.join(model_path, "tokenizer_config.json")
    if os.path.isfile(os.path.join(model_path, "tokenizer.json")) and os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cls = json.load(f).get("tokenizer_class")
        if cls in PLAIN_FAST:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
