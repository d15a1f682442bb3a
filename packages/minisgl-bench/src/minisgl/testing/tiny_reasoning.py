"""A tiny random Qwen3 that "thinks": the tiny tokenizer with `<think>` and `</think>` added as
single (non-special, as in Qwen3's tokenizer) tokens and a Qwen3-like chat template that opens
`<think>` in the generation prompt, or closes it empty under `enable_thinking=False`, and lists
the tools by name (the tiny tokenizer spends a token on every one or two characters)."""

from __future__ import annotations

from pathlib import Path

from minisgl.testing.tiny_models import write_tiny_model

THINK_TOKENS = ("<think>", "</think>")
THINK_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<tool_call></tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def write_tiny_reasoning_model(path: str | Path, seed: int = 0) -> Path:
    """The tiny qwen3 at `path` with the think tokens and template; returns `path`."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    path = write_tiny_model("qwen3", path, seed=seed, vocab_size=392)  # room for added tokens
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(str(path))
    return path


def think_end_id(path: str | Path) -> int:
    """The token id of `</think>` in the model's tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    return tok.convert_tokens_to_ids(THINK_TOKENS[1])
