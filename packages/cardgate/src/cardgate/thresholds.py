"""Benchmark gates: one YAML format, one evaluator (used by `cardgate` and the bench harness).

Public API::

    gates = load_gates("worklog/gates/P0-003.yaml")        # or parse_gates(dict, source=...)
    results = evaluate(gates, {"rust_ops": 9.1e6, "py_ops": 8.0e5}, hardware="cpu")
    ok = all(r.passed for r in results if r.applicable)

Format (``worklog/gates/*.yaml``)::

    version: 1
    gates:
      - metric: radix_insert_ops_per_s     # required: the metric name
        hardware: cpu:amd-epyc             # optional (default "any"): "cpu", "cpu:<kind>", "any",
                                           #   or a glob on the GPU name, e.g. "*H100*"
        min: 1.0e5                         # optional: value >= min
        max: 5.0e9                         # optional: value <= max
        relative:                          # optional: compare with another metric
          baseline: py_radix_insert_ops_per_s   # default: the same metric name
          factor: 10                       # required: the ratio to the baseline
          direction: higher                # "higher" (default): value >= factor * baseline
                                           # "lower": value <= factor * baseline
          noise_floor: 0.02                # optional relative tolerance in [0, 1):
                                           #   higher: value >= factor * baseline * (1 - nf)
                                           #   lower:  value <= factor * baseline * (1 + nf)
        note: free text shown next to the result
        items: [rust-path-at-least-10x-the-python-reference]   # optional: the card items
                                           #   (keys or texts) whose stated number this
                                           #   rule compares
    record_only: [parity_mismatches]       # optional, top level: metrics a bench records for
                                           #   the report that no rule compares (any other
                                           #   metric without an applicable rule holds the card)

The file is read as YAML 1.2 (core schema): `0750` is 750, `0o750` octal, `0x1F` hex, `1e5` a
float, `true`/`false` the only booleans; YAML 1.1 forms (`1:30`, `1_000`, `yes`, `0b101`) are
strings, so a bound given that way is a format error. Every format error names the file and,
where it has one, the line (`worklog/gates/P0-003.yaml:5: ...`); a file that is not UTF-8, a
mapping key that is not a scalar and a syntax error are format errors, never tracebacks.

A rule applies when its ``hardware`` matches the hardware string given to `evaluate`: ``"cpu"``
on machines without a CUDA device, else the GPU name (``torch.cuda.get_device_name()`` or
the kernel driver's ``/proc/driver/nvidia``; never a program on ``PATH``). ``any`` (or no key) matches everything; ``cpu`` every CPU machine;
``cpu:<kind>`` (a glob: ``cpu:amd-epyc``, ``cpu:intel-amx``) the CPU kinds it names
(`hardware.cpu_kind`: the kernels differ by kind, so a CPU speed gate names its kind); any other
value is a case-insensitive `fnmatch` pattern on the GPU name, which must match one of
`KNOWN_GPU_NAMES` (so `*H1OO*`, letter O, is a lint error, not a rule that silently never
applies; a new device gets its name added there). All matching rules are checked.

The relative baseline is looked up first among the metrics of the same run, then in the optional
``baseline`` mapping given to `evaluate` (e.g. the metrics of a recorded baseline run).

Each check yields one `GateResult`: ``status`` is ``pass``, ``fail``, ``missing`` (the metric or
its baseline was not recorded) or ``n/a`` (the hardware does not match). ``margin`` is the signed
headroom (value - threshold for lower bounds, threshold - value for upper bounds, so negative
means failed) and ``margin_pct`` the same relative to the threshold.
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from cardgate.hardware import CPU_KINDS

Status = Literal["pass", "fail", "missing", "n/a"]
_RULE_KEYS = frozenset({"metric", "hardware", "min", "max", "relative", "note", "items"})
_TOP_KEYS = frozenset({"version", "gates", "record_only"})
# `torch.cuda.get_device_name()` / driver names a GPU pattern must match one of
KNOWN_GPU_NAMES = (
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL",
    "NVIDIA H200",
    "NVIDIA H200 NVL",
    "NVIDIA H20",
    "NVIDIA GH200 480GB",
    "NVIDIA B200",
    "NVIDIA GB200",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA A100-PCIE-40GB",
    "NVIDIA A100 80GB PCIe",
    "NVIDIA A10G",
    "NVIDIA A10",
    "NVIDIA L4",
    "NVIDIA L40",
    "NVIDIA L40S",
    "Tesla T4",
    "Tesla V100-SXM2-16GB",
    "Tesla V100-SXM2-32GB",
    "NVIDIA GeForce RTX 3090",
    "NVIDIA GeForce RTX 4090",
    "NVIDIA GeForce RTX 5090",
    "NVIDIA RTX A6000",
    "NVIDIA RTX 6000 Ada Generation",
    "AMD Instinct MI250X",
    "AMD Instinct MI300X",
    "AMD Instinct MI325X",
)
_RELATIVE_KEYS = frozenset({"baseline", "factor", "direction", "noise_floor"})


class GateFormatError(ValueError):
    """A gates file that does not follow the format; the message names the file and rule
    (and `line`, 1-based, where the problem has one; 0 otherwise)."""

    def __init__(self, message: str, line: int = 0) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True)
class Relative:
    factor: float
    baseline: str | None = None
    direction: Literal["higher", "lower"] = "higher"
    noise_floor: float = 0.0


@dataclass(frozen=True)
class Gate:
    metric: str
    hardware: str = "any"
    min: float | None = None
    max: float | None = None
    relative: Relative | None = None
    note: str = ""
    source: str = ""
    items: tuple[str, ...] = ()

    def matches(self, hardware: str) -> bool:
        return hardware_matches(self.hardware, hardware)


@dataclass
class GateSet:
    gates: list[Gate] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    record_only: frozenset[str] = frozenset()

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.gates)

    def __len__(self) -> int:
        return len(self.gates)

    def extend(self, other: GateSet) -> GateSet:
        return GateSet(
            [*self.gates, *other.gates],
            [*self.sources, *other.sources],
            self.record_only | other.record_only,
        )

    def unchecked(self, metrics: list[str] | set[str], hardware: str) -> list[str]:
        """The metrics no rule for `hardware` names (as its metric or relative baseline) and
        the file does not list under `record_only`: numbers nobody compares."""
        named = set(self.record_only)
        for gate in self.gates:
            if gate.matches(hardware):
                named.add(gate.metric)
                if gate.relative is not None:
                    named.add(gate.relative.baseline or gate.metric)
        return sorted(set(metrics) - named)


@dataclass(frozen=True)
class GateResult:
    metric: str
    check: Literal["min", "max", "relative"]
    status: Status
    threshold: float | None
    value: float | None
    margin: float | None
    margin_pct: float | None
    hardware: str
    message: str
    source: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def applicable(self) -> bool:
        return self.status != "n/a"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def hardware_matches(pattern: str, hardware: str) -> bool:
    """`any` matches all; `cpu` every CPU machine ("cpu" or "cpu:<kind>"); `cpu:<glob>` the CPU
    kinds it matches (`cpu:amd-epyc`, `cpu:intel-amx`); anything else is a GPU-name glob
    (case-insensitive)."""
    pattern, hardware = pattern.strip().lower(), hardware.strip().lower()
    if pattern in {"any", "*", ""}:
        return True
    on_cpu = hardware == "cpu" or hardware.startswith("cpu:")
    if pattern == "cpu":
        return on_cpu
    if pattern.startswith("cpu:"):
        return hardware.startswith("cpu:") and fnmatch.fnmatchcase(hardware[4:], pattern[4:])
    return not on_cpu and fnmatch.fnmatchcase(hardware, pattern)


def can_match(pattern: str) -> bool:
    """False for a hardware pattern no machine can have: a `cpu:` glob that matches no CPU kind
    (`hardware.CPU_KINDS`), or a GPU pattern that matches no name of `KNOWN_GPU_NAMES`
    (`h100` never equals `NVIDIA H100 80GB HBM3`; write `*H100*`; `*H1OO*` is a typo)."""
    pattern = pattern.strip().lower()
    if pattern in {"any", "*", "", "cpu"}:
        return True
    if pattern.startswith("cpu:"):
        return any(fnmatch.fnmatchcase(kind, pattern[4:]) for kind in CPU_KINDS)
    return any(fnmatch.fnmatchcase(name.lower(), pattern) for name in KNOWN_GPU_NAMES)


def never_matching(gates: GateSet) -> list[str]:
    """A message per rule whose hardware pattern can never match (a lint error)."""
    return [
        f"{gate.source}: hardware {gate.hardware!r} can never match (CPU kinds: cpu:"
        + ", cpu:".join(CPU_KINDS)
        + "; a GPU rule needs a glob such as '*H100*' or a full device name that matches one "
        "of thresholds.KNOWN_GPU_NAMES: add a new device's name there)"
        for gate in gates
        if not can_match(gate.hardware)
    ]


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.safe_load` per YAML 1.2 (core schema numbers and booleans) that refuses a mapping
    with the same key twice (YAML keeps the last) or a key that is not a scalar."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode):
                raise GateFormatError(
                    f"a mapping key must be a plain name, not a {key_node.id}", line
                )
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise GateFormatError(
                    f"duplicate key {key!r} (line {line}; first at line {seen[key]})", line
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml_int(loader: yaml.SafeLoader, node: yaml.Node) -> int:
    text = str(loader.construct_scalar(node))  # type: ignore[arg-type]
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text, 10)  # `0750` is 750 (YAML 1.2), never octal 488 (YAML 1.1)


_CORE_TAGS = {"tag:yaml.org,2002:" + t for t in ("bool", "int", "float")}
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _CORE_TAGS]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),
    list("-+0123456789"),
)
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _yaml_int)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GateFormatError(f"{what}: expected a number (YAML 1.2), got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise GateFormatError(f"{what}: expected a finite number, got {value!r}")
    return number


def _parse_relative(raw: Any, where: str) -> Relative:
    if not isinstance(raw, Mapping):
        raise GateFormatError(f"{where}: 'relative' must be a mapping")
    unknown = set(raw) - _RELATIVE_KEYS
    if unknown:
        raise GateFormatError(f"{where}: unknown keys in 'relative': {sorted(unknown)}")
    if "factor" not in raw:
        raise GateFormatError(f"{where}: 'relative' needs 'factor'")
    direction = raw.get("direction", "higher")
    if direction not in ("higher", "lower"):
        raise GateFormatError(f"{where}: direction must be 'higher' or 'lower'")
    noise = _number(raw.get("noise_floor", 0.0), f"{where}: noise_floor")
    if not 0.0 <= noise < 1.0:
        raise GateFormatError(f"{where}: noise_floor must be in [0, 1)")
    baseline = raw.get("baseline")
    if baseline is not None and not isinstance(baseline, str):
        raise GateFormatError(f"{where}: baseline must be a metric name")
    return Relative(
        factor=_number(raw["factor"], f"{where}: factor"),
        baseline=baseline,
        direction=direction,
        noise_floor=noise,
    )


def parse_gates(data: Any, source: str = "<gates>") -> GateSet:
    """Validate a loaded YAML document; raises `GateFormatError` naming the file and rule."""
    if data is None:
        return GateSet([], [source])
    if not isinstance(data, Mapping):
        raise GateFormatError(f"{source}: expected a mapping with 'version' and 'gates'")
    version = data.get("version", 1)
    if version != 1:
        raise GateFormatError(f"{source}: unsupported version {version!r} (expected 1)")
    unknown_top = set(data) - _TOP_KEYS
    if unknown_top:
        raise GateFormatError(f"{source}: unknown top-level keys {sorted(unknown_top)}")
    record_only = data.get("record_only") or []
    if not isinstance(record_only, list) or not all(isinstance(m, str) and m for m in record_only):
        raise GateFormatError(f"{source}: 'record_only' must be a list of metric names")
    rules = data.get("gates") or []
    if not isinstance(rules, list):
        raise GateFormatError(f"{source}: 'gates' must be a list")
    gates: list[Gate] = []
    for index, raw in enumerate(rules):
        where = f"{source}: gates[{index}]"
        if not isinstance(raw, Mapping):
            raise GateFormatError(f"{where}: expected a mapping")
        unknown = set(raw) - _RULE_KEYS
        if unknown:
            raise GateFormatError(f"{where}: unknown keys {sorted(unknown)}")
        metric = raw.get("metric")
        if not isinstance(metric, str) or not metric:
            raise GateFormatError(f"{where}: 'metric' must be a non-empty string")
        hardware = raw.get("hardware", "any")
        if not isinstance(hardware, str):
            raise GateFormatError(f"{where}: 'hardware' must be a string")
        gate = Gate(
            metric=metric,
            hardware=hardware,
            min=_number(raw["min"], f"{where}: min") if "min" in raw else None,
            max=_number(raw["max"], f"{where}: max") if "max" in raw else None,
            relative=_parse_relative(raw["relative"], where) if "relative" in raw else None,
            note=str(raw.get("note", "")),
            source=f"{source}#{index}",
            items=_items(raw.get("items", ()), where),
        )
        if gate.min is None and gate.max is None and gate.relative is None:
            raise GateFormatError(f"{where}: needs at least one of min, max, relative")
        gates.append(gate)
    return GateSet(gates, [source], frozenset(record_only))


def _items(raw: Any, where: str) -> tuple[str, ...]:
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list | tuple) or not all(isinstance(i, str) and i for i in items):
        raise GateFormatError(f"{where}: 'items' must be an item key or a list of them")
    return tuple(items)


def load_gates(*paths: Path | str, root: Path | None = None) -> GateSet:
    """Load and merge gates files (YAML). Raises `GateFormatError` or `OSError`. With `root`,
    each rule's `source` names its file relative to it (evidence holds no absolute path)."""
    merged = GateSet()
    for path in paths:
        name = str(path)
        if root is not None and Path(path).is_absolute():
            with contextlib.suppress(ValueError):  # outside the root: named as given
                name = Path(path).resolve().relative_to(root.resolve()).as_posix()
        raw = Path(path).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = raw[: exc.start].count(b"\n") + 1
            raise GateFormatError(
                f"{name}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x}): save the file as UTF-8",
                line,
            ) from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else 0
            problem = exc.problem or exc.context or "syntax error"
            raise GateFormatError(f"{name}:{line}: invalid YAML: {problem}", line) from None
        except yaml.YAMLError as exc:
            raise GateFormatError(f"{name}: invalid YAML: {exc}") from None
        except GateFormatError as exc:
            raise GateFormatError(f"{name}:{exc.line}: {exc}", exc.line) from None
        merged = merged.extend(parse_gates(data, name))
    return merged


def _result(
    gate: Gate,
    check: Literal["min", "max", "relative"],
    value: float | None,
    threshold: float | None,
    lower_bound: bool,
    hardware: str,
    message: str = "",
) -> GateResult:
    if value is None or threshold is None:
        return GateResult(
            gate.metric,
            check,
            "missing",
            threshold,
            value,
            None,
            None,
            hardware,
            message,
            gate.source,
        )
    margin = value - threshold if lower_bound else threshold - value
    margin_pct = margin / abs(threshold) * 100.0 if threshold != 0 else None
    status: Status = "pass" if margin >= 0 else "fail"
    op = ">=" if lower_bound else "<="
    verdict = "ok" if status == "pass" else f"missed by {abs(margin):.6g}"
    text = f"{gate.metric}={value:.6g} {op} {threshold:.6g} ({verdict})"
    if message:
        text = f"{text}; {message}"
    if gate.note:
        text = f"{text} [{gate.note}]"
    return GateResult(
        gate.metric,
        check,
        status,
        threshold,
        value,
        margin,
        margin_pct,
        hardware,
        text,
        gate.source,
    )


def evaluate(
    gates: GateSet | list[Gate],
    metrics: Mapping[str, float],
    hardware: str,
    baseline: Mapping[str, float] | None = None,
) -> list[GateResult]:
    """Check every rule against `metrics`; one `GateResult` per (rule, check)."""
    results: list[GateResult] = []
    baseline = baseline or {}
    for gate in gates:
        if not gate.matches(hardware):
            for check in _checks(gate):
                results.append(
                    GateResult(
                        gate.metric,
                        check,
                        "n/a",
                        None,
                        None,
                        None,
                        None,
                        hardware,
                        f"rule for hardware {gate.hardware!r}, not {hardware!r}",
                        gate.source,
                    )
                )
            continue
        value = metrics.get(gate.metric)
        missing = f"metric {gate.metric!r} was not recorded" if value is None else ""
        if gate.min is not None:
            results.append(_result(gate, "min", value, gate.min, True, hardware, missing))
        if gate.max is not None:
            results.append(_result(gate, "max", value, gate.max, False, hardware, missing))
        if gate.relative is not None:
            results.append(_relative(gate, gate.relative, value, metrics, baseline, hardware))
    return results


def _checks(gate: Gate) -> list[Literal["min", "max", "relative"]]:
    checks: list[Literal["min", "max", "relative"]] = []
    if gate.min is not None:
        checks.append("min")
    if gate.max is not None:
        checks.append("max")
    if gate.relative is not None:
        checks.append("relative")
    return checks


def _relative(
    gate: Gate,
    rel: Relative,
    value: float | None,
    metrics: Mapping[str, float],
    baseline: Mapping[str, float],
    hardware: str,
) -> GateResult:
    name = rel.baseline or gate.metric
    if rel.baseline is not None and name in metrics:
        base = metrics.get(name)
    else:
        base = baseline.get(name)
    if value is None or base is None:
        what = gate.metric if value is None else f"baseline {name!r}"
        return _result(gate, "relative", value, None, True, hardware, f"{what} was not recorded")
    higher = rel.direction == "higher"
    tolerance = (1.0 - rel.noise_floor) if higher else (1.0 + rel.noise_floor)
    threshold = rel.factor * base * tolerance
    detail = f"{rel.factor:g} x {name}={base:.6g}"
    if rel.noise_floor:
        detail += f" with noise floor {rel.noise_floor:g}"
    return _result(gate, "relative", value, threshold, higher, hardware, detail)


def summarize(results: list[GateResult]) -> Status:
    """The worst applicable status: fail > missing > pass (n/a when nothing applies)."""
    statuses = {r.status for r in results if r.applicable}
    for status in ("fail", "missing", "pass"):
        if status in statuses:
            return status  # type: ignore[return-value]
    return "n/a"
