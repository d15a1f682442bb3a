"""HF transformers as the reference implementation: greedy `generate`, one prompt at a time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def load_hf_model(
    model_path: str | Path, dtype: str = "float32", device: str = "cpu", dummy: bool = False
):
    """The HF model of a folder; `dummy`: HF's own random init from config.json (a speed
    baseline: its weights are not minisgl's dummy weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dummy:
        cfg = AutoConfig.from_pretrained(str(model_path))
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = None  # compare fixed-length continuations
    return model.to(device).eval()


def hf_greedy(model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    import torch

    out = []
    device = next(model.parameters()).device
    for ids in prompts:
        x = torch.tensor([list(ids)], device=device)
        with torch.inference_mode():
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(y[0, len(ids) :].tolist())
    return out
