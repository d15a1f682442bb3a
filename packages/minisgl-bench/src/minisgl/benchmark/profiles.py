"""Named benchmark profiles; every workload is fully determined by the profile and its seed.

`get_profile("many-short", {"num_requests": "64"})` returns a `Profile` with overrides applied
(values are coerced to the field's type); `build_workload(profile, vocab_size)` returns the
requests (token prompts, output lengths, arrival times) - the same list for the same seed.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Profile:
    name: str
    description: str = ""
    seed: int = 42
    num_requests: int = 16
    input_len_min: int = 64
    input_len_max: int = 256
    output_len: int = 64
    output_len_min: int = 0  # > 0: output lengths uniform in [output_len_min, output_len]
    ignore_eos: bool = True
    # shared prefixes ("system prompts"): 0 = none
    num_prefixes: int = 0
    prefix_len: int = 0
    # arrivals: "all" (everything at t=0), "poisson" (request_rate per s), "burst" (bursts of
    # burst_size every burst_interval_s; the requests not in a burst arrive Poisson)
    arrival: str = "all"
    request_rate: float = 0.0
    burst_size: int = 0
    num_bursts: int = 0
    burst_interval_s: float = 1.0
    # online: max in-flight requests (0 = no limit) and whether prompts are chat messages
    concurrency: int = 0
    chat: bool = False
    # engine and baseline knobs
    max_running_requests: int = 256
    max_extend_tokens: int = 4096
    hf_batch_size: int = 64
    warmup_requests: int = 2
    token_id_min: int = 100
    token_id_max: int = 20000

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in [
        Profile(
            "seed-offline",
            "16 requests, random token prompts of 64-256, 64 output tokens, ignore_eos",
            num_requests=16,
            input_len_min=64,
            input_len_max=256,
            output_len=64,
        ),
        Profile(
            "single",
            "one request, 32-token prompt, 128 output tokens (single-stream decode speed)",
            num_requests=1,
            input_len_min=32,
            input_len_max=32,
            output_len=128,
            warmup_requests=1,
        ),
        Profile(
            "seed-online",
            "8 concurrent streaming chat requests, 64-256 token prompts, 64 output tokens",
            num_requests=8,
            concurrency=8,
            input_len_min=64,
            input_len_max=256,
            output_len=64,
            chat=True,
        ),
        Profile(
            "many-short",
            "512 requests, 16-64 token prompts, 16 output tokens (CPU scheduling bound)",
            num_requests=512,
            input_len_min=16,
            input_len_max=64,
            output_len=16,
            concurrency=64,
        ),
        Profile(
            "shared-prefix",
            "256 requests sharing 8 long system prompts (512 tokens) + 16-64 token suffixes",
            num_requests=256,
            num_prefixes=8,
            prefix_len=512,
            input_len_min=16,
            input_len_max=64,
            output_len=16,
            concurrency=64,
        ),
        Profile(
            "burst",
            "256 requests: 4 bursts of 32 every 2 s, the rest Poisson at 16 req/s",
            num_requests=256,
            input_len_min=32,
            input_len_max=128,
            output_len=32,
            arrival="burst",
            request_rate=16.0,
            burst_size=32,
            num_bursts=4,
            burst_interval_s=2.0,
        ),
        Profile(
            "burst-256",
            "256 concurrent streams: 256 requests in one burst at t=0, 32-128 token prompts, "
            "64 output tokens (admission + decode at batch 256)",
            num_requests=256,
            input_len_min=32,
            input_len_max=128,
            output_len=64,
            arrival="burst",
            burst_size=256,
            num_bursts=1,
            concurrency=256,
            max_running_requests=256,
        ),
        Profile(
            "nano-vllm",
            "nano-vllm's bench.py: 256 requests, input and output lengths uniform in 100-1024, "
            "all at t=0 (GPU throughput)",
            seed=0,
            num_requests=256,
            input_len_min=100,
            input_len_max=1024,
            output_len_min=100,
            output_len=1024,
            max_running_requests=256,
            max_extend_tokens=16384,
        ),
        Profile(
            "decode-heavy",
            "256 concurrent requests, 16 token prompts, 256 output tokens",
            num_requests=256,
            input_len_min=16,
            input_len_max=16,
            output_len=256,
            concurrency=256,
        ),
    ]
}


def _coerce(raw: Any, target: Any, key: str) -> Any:
    if not isinstance(raw, str):
        return raw
    if target is bool:
        low = raw.strip().lower()
        if low in {"1", "true", "yes", "on"}:
            return True
        if low in {"0", "false", "no", "off"}:
            return False
        raise ValueError(f"--set {key}={raw}: expected a boolean")
    try:
        return target(raw)
    except ValueError:
        raise ValueError(f"--set {key}={raw}: expected {target.__name__}") from None


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def apply_overrides(profile: Profile, overrides: Mapping[str, Any]) -> Profile:
    """Return `profile` with fields replaced; unknown keys raise ValueError naming the valid ones."""
    fields = {f.name: f for f in dataclasses.fields(Profile)}
    changes: dict[str, Any] = {}
    for key, raw in overrides.items():
        if key not in fields or key == "name":
            valid = ", ".join(k for k in fields if k != "name")
            raise ValueError(f"unknown profile parameter {key!r}; valid: {valid}")
        target = _TYPES[str(fields[key].type)]
        changes[key] = _coerce(raw, target, key)
    new = dataclasses.replace(profile, **changes)
    validate(new)
    return new


def validate(p: Profile) -> None:
    if p.num_requests <= 0:
        raise ValueError("num_requests must be > 0")
    if not 1 <= p.input_len_min <= p.input_len_max:
        raise ValueError("need 1 <= input_len_min <= input_len_max")
    if p.output_len <= 0:
        raise ValueError("output_len must be > 0")
    if not 0 <= p.output_len_min <= p.output_len:
        raise ValueError("need 0 <= output_len_min <= output_len")
    if p.arrival not in {"all", "poisson", "burst"}:
        raise ValueError("arrival must be all, poisson or burst")
    if p.arrival == "poisson" and p.request_rate <= 0:
        raise ValueError("arrival=poisson needs request_rate > 0")
    if p.num_prefixes < 0 or (p.num_prefixes and p.prefix_len <= 0):
        raise ValueError("num_prefixes needs prefix_len > 0")


def parse_sets(items: list[str] | None) -> dict[str, str]:
    """`["num_requests=64", "seed=1"]` -> dict; raises ValueError on a malformed item."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def get_profile(name: str, overrides: Mapping[str, Any] | None = None) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose from {', '.join(PROFILES)}")
    return apply_overrides(PROFILES[name], overrides or {})


@dataclass
class WorkItem:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    prefix_id: int = -1
    meta: dict[str, Any] = field(default_factory=dict)


def _arrivals(p: Profile, rng: random.Random) -> list[float]:
    n = p.num_requests
    if p.arrival == "all":
        return [0.0] * n
    if p.arrival == "poisson":
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(p.request_rate)
            out.append(t)
        return out
    in_bursts = min(n, p.burst_size * p.num_bursts)
    times = [(i // max(p.burst_size, 1)) * p.burst_interval_s for i in range(in_bursts)]
    rate = p.request_rate if p.request_rate > 0 else 1.0
    t = 0.0
    for _ in range(n - in_bursts):
        t += rng.expovariate(rate)
        times.append(t)
    return sorted(times)


def build_workload(p: Profile, vocab_size: int) -> list[WorkItem]:
    """The requests of `p`: identical for identical (profile, vocab_size)."""
    rng = random.Random(p.seed)
    lo = max(0, min(p.token_id_min, vocab_size // 4))
    hi = max(lo + 1, min(p.token_id_max, vocab_size - 1))

    def tokens(n: int) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(n)]

    prefixes = [tokens(p.prefix_len) for _ in range(p.num_prefixes)]
    arrivals = _arrivals(p, rng)
    items = []
    for i in range(p.num_requests):
        n_in = rng.randint(p.input_len_min, p.input_len_max)
        prefix_id = rng.randrange(p.num_prefixes) if p.num_prefixes else -1
        prompt = (prefixes[prefix_id] if prefix_id >= 0 else []) + tokens(n_in)
        n_out = rng.randint(p.output_len_min, p.output_len) if p.output_len_min else p.output_len
        items.append(WorkItem(i, prompt, n_out, arrivals[i], prefix_id))
    return items


def warmup_workload(p: Profile, vocab_size: int) -> list[WorkItem]:
    """A few short requests (own seed) run before timing; never sharing prefixes with the run."""
    w = dataclasses.replace(
        p,
        seed=p.seed + 1_000_003,
        num_requests=max(p.warmup_requests, 1),
        num_prefixes=0,
        input_len_min=min(p.input_len_min, 32),
        input_len_max=min(p.input_len_max, 32),
        output_len=min(p.output_len, 4),
        output_len_min=0,
        arrival="all",
    )
    return build_workload(w, vocab_size)
