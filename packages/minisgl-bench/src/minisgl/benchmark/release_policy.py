"""The release gate's policy: thresholds per signal, optionally scoped by model / backend / device.

Format (YAML, `worklog/gates/release.cpu.yaml` documents every key with the CPU values)::

    version: 1
    evidence:
      min_matched_requests: 8     # requests present on both sides (per segment), else hold
      min_match_fraction: 0.95    # matched / requests, on each side, else hold
      min_compared_fraction: 0.95 # successful pairs whose outputs could be compared, else hold
    outputs:
      max_mismatch_fraction: 0.0  # mismatched / compared requests above it: rollback
      ignore_divergence_after: null  # int: a mismatch whose first divergence is at or after
                                  #   this position (tokens, or characters for text) is
                                  #   tolerated (reported, not counted)
      match_any_baseline_repeat: true  # a candidate output equal to any baseline repeat's
                                  #   matches (false: only the first successful repeat)
    errors:
      max_error_rate_delta: 0.0   # candidate error rate - baseline's above it: rollback
    latency:
      quantile: 0.95              # the quantile compared (0 < q <= 1)
      min_repeats: 3              # with this many runs on each side: the quantile and the
      confidence: 0.95            #   median judged over runs paired by repeat, Student-t lower
                                  #   bound (release_stats.py); fewer: one point ratio (noise
                                  #   not separated from regression)
      e2e:  {max_ratio: 1.10, slack_s: 0.0}   # candidate / baseline above max_ratio AND
      ttft: {max_ratio: 1.10, slack_s: 0.0}   #   candidate - baseline above slack_s: hold;
      tpot: {max_ratio: 1.10, slack_s: 0.0}   #   max_ratio null: not checked. tpot: decode
      itl:  {max_ratio: 1.10, slack_s: 0.0}   #   s/token per request; itl: pooled gaps
    kv_pressure:
      peak: {max_ratio: 1.10}     # peak kv_pages_in_use, candidate / baseline: hold above
      p95:  {max_ratio: 1.10}     # its p95
      required: false             # true: no KV data on a side is a hold, else not checked
    scopes:                       # optional overrides; every matching scope applies in order
      - match: {model: "*", backend: rust_service, device: "*H100*"}   # globs; device as
        outputs: {max_mismatch_fraction: 0.02, ignore_divergence_after: 32}  # in the gates:
        latency: {ttft: {max_ratio: 1.3}}              # "cpu", "any" or a GPU-name glob

Scopes match the candidate's segment (backend x device; `model` must match every model in
it). A bad key, type or value raises `PolicyError("P.yaml:7: ...")` with the YAML line.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cardgate.thresholds import hardware_matches


class PolicyError(ValueError):
    """A policy file that does not follow the format; the message names the file and line."""


@dataclass(frozen=True)
class Thresholds:
    min_matched_requests: int = 8
    min_match_fraction: float = 0.95
    min_compared_fraction: float = 0.95
    max_mismatch_fraction: float = 0.0
    ignore_divergence_after: int | None = None
    match_any_baseline_repeat: bool = True
    max_error_rate_delta: float = 0.0
    latency_quantile: float = 0.95
    latency_min_repeats: int = 3  # per side, for the judgement over runs (else one point ratio)
    latency_confidence: float = 0.95
    e2e_max_ratio: float | None = 1.10
    e2e_slack_s: float = 0.0
    ttft_max_ratio: float | None = 1.10
    ttft_slack_s: float = 0.0
    tpot_max_ratio: float | None = 1.10
    tpot_slack_s: float = 0.0
    itl_max_ratio: float | None = 1.10
    itl_slack_s: float = 0.0
    kv_peak_max_ratio: float | None = 1.10
    kv_p95_max_ratio: float | None = 1.10
    kv_required: bool = False


@dataclass(frozen=True)
class Scope:
    name: str
    line: int
    model: str = "*"
    backend: str = "*"
    device: str = "any"
    overrides: dict[str, Any] = field(default_factory=dict)

    def matches(self, backend: str, device: str, models: Iterable[str]) -> bool:
        return (
            fnmatch.fnmatchcase(backend.lower(), self.backend.lower())
            and hardware_matches(self.device, device)
            and all(fnmatch.fnmatchcase(m.lower(), self.model.lower()) for m in models)
        )


@dataclass(frozen=True)
class Policy:
    base: Thresholds = field(default_factory=Thresholds)
    scopes: tuple[Scope, ...] = ()
    source: str = "<built-in defaults>"

    def for_segment(
        self, backend: str, device: str, models: Iterable[str]
    ) -> tuple[Thresholds, list[str]]:
        """The thresholds for a candidate segment and the names of the scopes applied."""
        models = list(models)
        th, applied = self.base, []
        for scope in self.scopes:
            if scope.matches(backend, device, models):
                th = dataclasses.replace(th, **scope.overrides)
                applied.append(scope.name)
        return th, applied


# ----------------------------------------------------------------------------- validation
Check = Callable[[Any], str | None]  # an error message, or None when the value is fine


def _fraction(v: Any) -> str | None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and 0.0 <= v <= 1.0
    return None if ok else f"expected a number in [0, 1], got {v!r}"


def _count(v: Any) -> str | None:
    ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
    return None if ok else f"expected a non-negative integer, got {v!r}"


def _opt_count(v: Any) -> str | None:
    return None if v is None else _count(v)


def _seconds(v: Any) -> str | None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
    return None if ok else f"expected a non-negative number (seconds), got {v!r}"


def _ratio(v: Any) -> str | None:
    if v is None:
        return None
    ok = isinstance(v, int | float) and not isinstance(v, bool) and v > 0
    return None if ok else f"expected a positive number or null, got {v!r}"


def _quantile(v: Any) -> str | None:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and 0.0 < v <= 1.0
    return None if ok else f"expected a number in (0, 1], got {v!r}"


def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else f"expected true or false, got {v!r}"


# YAML path -> (Thresholds field, check)
SCHEMA: dict[tuple[str, ...], tuple[str, Check]] = {
    ("evidence", "min_matched_requests"): ("min_matched_requests", _count),
    ("evidence", "min_match_fraction"): ("min_match_fraction", _fraction),
    ("evidence", "min_compared_fraction"): ("min_compared_fraction", _fraction),
    ("outputs", "max_mismatch_fraction"): ("max_mismatch_fraction", _fraction),
    ("outputs", "ignore_divergence_after"): ("ignore_divergence_after", _opt_count),
    ("outputs", "match_any_baseline_repeat"): ("match_any_baseline_repeat", _bool),
    ("errors", "max_error_rate_delta"): ("max_error_rate_delta", _fraction),
    ("latency", "quantile"): ("latency_quantile", _quantile),
    ("latency", "min_repeats"): ("latency_min_repeats", _count),
    ("latency", "confidence"): ("latency_confidence", _fraction),
    ("kv_pressure", "peak", "max_ratio"): ("kv_peak_max_ratio", _ratio),
    ("kv_pressure", "p95", "max_ratio"): ("kv_p95_max_ratio", _ratio),
    ("kv_pressure", "required"): ("kv_required", _bool),
}
for _metric in ("e2e", "ttft", "tpot", "itl"):
    SCHEMA[("latency", _metric, "max_ratio")] = (f"{_metric}_max_ratio", _ratio)
    SCHEMA[("latency", _metric, "slack_s")] = (f"{_metric}_slack_s", _seconds)
SECTIONS = {path[0] for path in SCHEMA}
MATCH_KEYS = ("model", "backend", "device")


class _Reader:
    """Walks composed YAML nodes, keeping every value's line for error messages."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._loader = yaml.SafeLoader("")

    def fail(self, node: yaml.Node, message: str) -> PolicyError:
        return PolicyError(f"{self.where}:{node.start_mark.line + 1}: {message}")

    def mapping(self, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, f"{what} must be a mapping")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node)
            if not isinstance(key, str):
                raise self.fail(key_node, f"{what}: keys must be strings, got {key!r}")
            if key in out:
                first = out[key][0].start_mark.line + 1
                raise self.fail(key_node, f"{what}: duplicate key {key!r} (first on line {first})")
            out[key] = (key_node, value_node)
        return out

    def scalar(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, "expected a single value")
        return self._loader.construct_object(node, deep=True)

    def thresholds(self, node: yaml.Node, path: tuple[str, ...], out: dict[str, Any]) -> None:
        """Collect the threshold values under `node` (a section at `path`) into `out`."""
        what = ".".join(path)
        for key, (key_node, value_node) in self.mapping(node, what).items():
            sub = (*path, key)
            if sub in SCHEMA:
                name, check = SCHEMA[sub]
                value = self.scalar(value_node)
                problem = check(value)
                if problem:
                    raise self.fail(value_node, f"{'.'.join(sub)}: {problem}")
                out[name] = value
            elif any(p[: len(sub)] == sub for p in SCHEMA):
                self.thresholds(value_node, sub, out)
            else:
                valid = sorted({p[len(path)] for p in SCHEMA if p[: len(path)] == path})
                raise self.fail(key_node, f"unknown key {'.'.join(sub)!r} (valid: {valid})")

    def scope(self, node: yaml.Node, index: int) -> Scope:
        what = f"scopes[{index}]"
        items = self.mapping(node, what)
        if "match" not in items:
            raise self.fail(node, f"{what}: needs 'match' (model / backend / device globs)")
        match: dict[str, str] = {}
        for key, (key_node, value_node) in self.mapping(items["match"][1], what).items():
            value = self.scalar(value_node)
            if key not in MATCH_KEYS:
                raise self.fail(key_node, f"{what}.match: unknown key {key!r} (valid: model, "
                                "backend, device)")  # fmt: skip
            if not isinstance(value, str) or not value:
                raise self.fail(value_node, f"{what}.match.{key}: expected a glob string")
            match[key] = value
        name = f"scopes[{index}]"
        overrides: dict[str, Any] = {}
        for key, (key_node, value_node) in items.items():
            if key == "match":
                continue
            if key == "name":
                value = self.scalar(value_node)
                if not isinstance(value, str):
                    raise self.fail(value_node, f"{what}.name: expected a string")
                name = value
            elif key in SECTIONS:
                self.thresholds(value_node, (key,), overrides)
            else:
                raise self.fail(key_node, f"{what}: unknown key {key!r} (valid: name, match, "
                                f"{', '.join(sorted(SECTIONS))})")  # fmt: skip
        return Scope(name, node.start_mark.line + 1, overrides=overrides, **match)


def parse_policy(text: str, where: str = "<policy>") -> Policy:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else 1
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(f"{where}:{line}: invalid YAML: {problem}") from None
    if root is None:
        return Policy(source=where)
    reader = _Reader(where)
    items = reader.mapping(root, "the policy")
    base: dict[str, Any] = {}
    scopes: list[Scope] = []
    for key, (key_node, value_node) in items.items():
        if key == "version":
            if reader.scalar(value_node) != 1:
                raise reader.fail(value_node, "unsupported version (expected 1)")
        elif key in SECTIONS:
            reader.thresholds(value_node, (key,), base)
        elif key == "scopes":
            if not isinstance(value_node, yaml.SequenceNode):
                raise reader.fail(value_node, "scopes must be a list")
            scopes = [reader.scope(n, i) for i, n in enumerate(value_node.value)]
        else:
            valid = ", ".join(["version", *sorted(SECTIONS), "scopes"])
            raise reader.fail(key_node, f"unknown top-level key {key!r} (valid: {valid})")
    return Policy(Thresholds(**base), tuple(scopes), where)


def load_policy(path: str | Path | None) -> Policy:
    """The policy in `path` (None: the built-in defaults). PolicyError on a bad file."""
    if path is None:
        return Policy()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{path}: cannot read: {exc}") from None
    return parse_policy(text, str(path))
