"""Build a model on the target device and fill it from safetensors, one tensor at a time (a
tensor-parallel rank: one slice of each), or with deterministic random weights
(`--dummy-weights`: a folder with only config.json)."""

from __future__ import annotations

import contextlib
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minisgl.config import ModelConfig, ModelLoadError, weight_files
from minisgl.distributed.layout import TPInfo
from minisgl.models import MODEL_REGISTRY
from minisgl.models.llama import STACKED_PARAMS, shard_sizes
from minisgl.models.moe import CheckpointPiece, checkpoint_pieces
from minisgl.utils.log import get_logger

logger = get_logger(__name__)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _to_empty(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)` without `empty_like` on meta tensors, whose reference
    implementation imports sympy (~1 s a process); shared tensors stay shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, t.requires_grad)
            made[id(t)] = new
        return made[id(t)]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None:
                    tensors[name] = empty(t)


DUMMY_SEED = 0
DUMMY_STD = 0.02  # HF's default initializer_range


def _build(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int, tp: TPInfo
):
    """The model (this rank's slice of it) with uninitialised parameters on `device` (RoPE
    tables computed, ties set)."""
    cls = MODEL_REGISTRY[cfg.architecture]
    with _default_dtype(dtype), torch.device("meta"):
        model = cls(cfg, max_positions, tp)
    _to_empty(model, device)
    # the RoPE tables are computed, not loaded: rebuild them on the device
    with _default_dtype(dtype), torch.device(device):
        model.rotary = type(model.rotary)(cfg, max_positions, dtype)
    model.tie_weights()
    return model


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor lands: `rows` of `param` (None: all of it), read as the
    [start, end) slice of the checkpoint tensor along `dim` (None: all of it)."""

    param: torch.nn.Parameter
    rows: tuple[int, int] | None
    dim: int | None = None
    start: int = 0
    end: int = 0
    zero_tail: bool = False  # the rows after `rows` are padding (a vocabulary slice)
    expert: int | None = None  # a stacked expert parameter: `rows` of its matrix `expert`

    def dest(self) -> torch.Tensor:
        """The part of `param` this checkpoint tensor fills."""
        p = self.param if self.expert is None else self.param[self.expert]
        return p if self.rows is None else p[self.rows[0] : self.rows[1]]

    def read(self, f: Any, name: str) -> torch.Tensor:
        """This rank's piece of checkpoint tensor `name` of the open file `f`: only that
        slice is read (safetensors' `get_slice`)."""
        if self.dim is None:
            return f.get_tensor(name)
        piece = f.get_slice(name)
        return piece[self.start : self.end] if self.dim == 0 else piece[:, self.start : self.end]


class DummyCheckpoint:
    """Deterministic random weights as a checkpoint (`--dummy-weights`): norms 1, biases 0,
    every other tensor N(0, initializer_range), drawn on the CPU from a generator seeded by
    (seed, parameter name) over the whole (tp=1) parameter, so a value does not depend on the
    device, the dtype, the depth or the rank; a fused parameter's checkpoint pieces are row
    slices of its one draw."""

    def __init__(self, cfg: ModelConfig, max_positions: int, seed: int = DUMMY_SEED) -> None:
        self.cfg, self.seed = cfg, seed
        self.std = cfg.initializer_range or DUMMY_STD
        with torch.device("meta"):
            whole = MODEL_REGISTRY[cfg.architecture](cfg, max_positions, TPInfo())
        whole.tie_weights()
        self.shapes = {n: tuple(p.shape) for n, p in whole.named_parameters()}  # ties once
        # checkpoint name -> (parameter, its rows, expert: None, or that expert's matrix's rows)
        self.pieces: dict[str, tuple[str, int, int, int | None]] = {}
        for name in self.shapes:
            moe = checkpoint_pieces(cfg, name)
            if moe is not None:
                for piece in moe:
                    self.pieces[piece.name] = (name, *_expert_rows(self.shapes[name], piece))
                continue
            prefix, leaf, kind = _split_name(name)
            shards = [(n, i) for n, (f, i) in STACKED_PARAMS.items() if f == leaf]
            if not shards:
                self.pieces[name] = (name, 0, self.shapes[name][0], None)
            sizes = shard_sizes(cfg, leaf) if shards else []
            for shard, i in shards:
                start = sum(sizes[:i])
                self.pieces[f"{prefix}.{shard}.{kind}"] = (name, start, start + sizes[i], None)
        self._last: tuple[str, torch.Tensor] | None = None  # q, k, v share one draw

    def keys(self) -> list[str]:
        return list(self.pieces)

    def _draw(self, name: str) -> torch.Tensor:
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        shape = self.shapes[name]
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            t = torch.randn(shape, generator=gen, dtype=torch.float32) * self.std
        self._last = (name, t)
        return t

    def get_tensor(self, name: str) -> torch.Tensor:
        whole, start, end, expert = self.pieces[name]
        t = self._draw(whole)
        return (t if expert is None else t[expert])[start:end]

    def get_slice(self, name: str) -> torch.Tensor:
        return self.get_tensor(name)  # a tensor slices like safetensors' slice objects


def load_model(
    model_path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    dummy_weights: bool = False,
    tp: TPInfo | None = None,
    provided: frozenset[str] = frozenset(),
):
    """Build the model (rank `tp.rank`'s slice of it) and fill it from safetensors, reading
    only that slice of each tensor. Checkpoint q/k/v and gate/up projections land in row
    slices of the fused `qkv_proj` / `gate_up_proj`. Targets named in `provided` are not read
    (a quantized load takes them from its packed cache: `quantization/load.py`).
    `dummy_weights`: no checkpoint is read, see `DummyCheckpoint`."""
    tp = tp or TPInfo()
    model = _build(cfg, dtype, device, max_positions, tp)
    targets = _load_targets(model, cfg, tp)
    if dummy_weights:
        _fill(model, targets, [DummyCheckpoint(cfg, max_positions)], set(targets), "dummy")
        logger.info("dummy weights for %s (seed %d)", cfg.architecture, DUMMY_SEED)
        return model.eval()
    from safetensors import safe_open

    model_path = Path(model_path)
    files = weight_files(model_path)
    pending = set(targets) - provided
    with contextlib.ExitStack() as stack:
        opened = [stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                  for f in files]  # fmt: skip
        _fill(model, targets, opened, pending, str(model_path))
    return model.eval()


def _fill(
    model: torch.nn.Module, targets: dict[str, Target], files: list[Any], pending: set[str],
    source: str,
) -> None:  # fmt: skip
    """Copy every pending target from the open checkpoint `files`, then zero the vocabulary's
    padding rows (tensor parallelism); a target no file holds is an error."""
    same: dict[tuple[int, Any, Any], set[str]] = {}  # the names filling one place (tied aliases)
    for n, t in targets.items():
        same.setdefault((id(t.param), t.rows, t.expert), set()).add(n)
    for names in same.values():  # the alias of a name provided elsewhere (packed) is provided
        if not names <= pending:
            pending -= names
    for f in files:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            target = targets.get(name)
            if target is None:
                logger.debug("ignoring checkpoint tensor %s", name)
                continue
            if name not in pending:  # packed, or a tied alias already loaded
                continue
            tensor = target.read(f, name)
            dest = target.dest()
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(tensor)
            pending -= same[(id(target.param), target.rows, target.expert)]
    if pending:
        raise ModelLoadError(f"missing weights in {source!r}: {sorted(pending)[:8]}")
    with torch.no_grad():
        for t in targets.values():
            if t.zero_tail and t.rows is not None:
                t.param[t.rows[1] :].zero_()


def _expert_rows(shape: tuple[int, ...], piece: CheckpointPiece) -> tuple[int, int, int | None]:
    """(rows, expert) of a MoE parameter of `shape` that checkpoint `piece` fills (tp=1)."""
    if piece.expert is None:  # the router
        return 0, shape[0], None
    if piece.shard is None:  # an expert's down projection
        return 0, shape[1], piece.expert
    n = shape[1] // 2  # gate rows, then up rows
    return piece.shard * n, (piece.shard + 1) * n, piece.expert


def _expert_targets(
    param: torch.nn.Parameter, pieces: list[CheckpointPiece], cfg: ModelConfig, tp: TPInfo
) -> dict[str, Target]:
    """A MoE parameter's targets: the router whole; each expert's gate / up rows and down
    columns of this rank's piece of the expert intermediate size."""
    assert cfg.moe is not None
    i0, i1 = tp.split(cfg.moe.intermediate_size)
    n = i1 - i0
    out: dict[str, Target] = {}
    for p in pieces:
        if p.expert is None:
            out[p.name] = Target(param, None)
        elif p.shard is None:
            out[p.name] = Target(param, None, 1, i0, i1, expert=p.expert)
        else:
            rows = (p.shard * n, (p.shard + 1) * n)
            out[p.name] = Target(param, rows, 0, i0, i1, expert=p.expert)
    return out


def _split_name(name: str) -> tuple[str, str, str]:
    """ "a.b.qkv_proj.weight" -> ("a.b", "qkv_proj", "weight")."""
    parts = name.rsplit(".", 2)
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else ("", "", "")


def _load_targets(model: torch.nn.Module, cfg: ModelConfig, tp: TPInfo) -> dict[str, Target]:
    """Checkpoint name -> its `Target` in this rank's model: column-parallel q/k/v and gate/up
    rows, row-parallel o_proj / down_proj columns, vocab-parallel embedding and lm_head rows;
    the rest (norms) whole."""
    d = cfg.head_dim
    q0, q1 = tp.split(cfg.num_heads)
    k0, kn = tp.kv_heads(cfg)
    i0, i1 = tp.split(cfg.intermediate_size)
    v0, _, vreal = tp.vocab(cfg.vocab_size)
    rows = {  # shard -> (checkpoint rows read, their length)
        "q_proj": (q0 * d, (q1 - q0) * d),
        "k_proj": (k0 * d, kn * d),
        "v_proj": (k0 * d, kn * d),
        "gate_proj": (i0, i1 - i0),
        "up_proj": (i0, i1 - i0),
    }
    cols = {"o_proj": (q0 * d, q1 * d), "down_proj": (i0, i1)}
    split = tp.size > 1
    targets: dict[str, Target] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        moe = checkpoint_pieces(cfg, name)
        if moe is not None:
            targets.update(_expert_targets(param, moe, cfg, tp))
            continue
        prefix, leaf, kind = _split_name(name)
        shards = sorted((i, n) for n, (f, i) in STACKED_PARAMS.items() if f == leaf)
        if shards:
            at = 0
            for _, shard in shards:
                start, n = rows[shard]
                targets[f"{prefix}.{shard}.{kind}"] = Target(param, (at, at + n), 0, start,
                                                             start + n)  # fmt: skip
                at += n
        elif split and leaf in cols and kind == "weight":
            targets[name] = Target(param, None, 1, *cols[leaf])
        elif split and name in ("model.embed_tokens.weight", "lm_head.weight"):
            targets[name] = Target(param, (0, vreal), 0, v0, v0 + vreal, zero_tail=True)
        else:
            targets[name] = Target(param, None)
    return targets
