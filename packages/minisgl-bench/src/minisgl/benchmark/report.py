"""Console output (rich progress bars and summary tables) and matplotlib plots of a run."""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from minisgl.benchmark.profiles import WorkItem

MAX_SAMPLES = 5000


def latency_samples(
    items: Sequence[WorkItem], token_times: Sequence[Sequence[float]]
) -> dict[str, list[float]]:
    """TTFT / ITL / e2e samples in ms (ITL thinned deterministically to MAX_SAMPLES)."""
    ttft, e2e, itl = [], [], []
    for item, times in zip(items, token_times, strict=True):
        if times:
            ttft.append(round((times[0] - item.arrival_s) * 1e3, 3))
            e2e.append(round((times[-1] - item.arrival_s) * 1e3, 3))
            itl.extend(round((b - a) * 1e3, 3) for a, b in itertools.pairwise(times))
    if len(itl) > MAX_SAMPLES:
        step = len(itl) / MAX_SAMPLES
        itl = [itl[int(k * step)] for k in range(MAX_SAMPLES)]
    return {"ttft_ms": ttft, "itl_ms": itl, "e2e_ms": e2e}


class Progress:
    """`with Progress(enabled) as p: advance = p.task("minisgl", 16); advance(1)`."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._progress = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    def task(self, description: str, total: int):
        if self._progress is None:
            print(f"[bench] {description}: {total} requests", file=sys.stderr, flush=True)
            return lambda n: None
        task_id = self._progress.add_task(description, total=total)
        return lambda n: self._progress.advance(task_id, n)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


SUMMARY_ROWS = [
    ("output tok/s", "output_tok_s"),
    ("total tok/s", "total_tok_s"),
    ("request/s", "request_s"),
    ("duration s", "duration_s"),
    ("TTFT ms p50/p99", ("ttft_ms", "p50", "p99")),
    ("TPOT ms p50/p99", ("tpot_ms", "p50", "p99")),
    ("ITL ms p50/p99", ("itl_ms", "p50", "p99")),
    ("e2e ms p50/p99", ("e2e_ms", "p50", "p99")),
    ("sched step CPU ms p50/p95/p99", ("sched_step_cpu_ms", "p50", "p95", "p99")),
    ("peak KV usage", "peak_kv_usage"),
    ("prefix hit rate", "prefix_hit_rate"),
    ("client/engine CPU %", ("cpu", "client_cpu_pct")),
    ("server CPU %", ("cpu", "server_cpu_pct")),
    ("control-plane CPU s/token", ("cpu", "cp_cpu_s_per_token")),
    ("server CPU s/token", ("cpu", "server_cpu_s_per_token")),
]


def _cell(metrics: dict[str, Any], spec: Any) -> str:
    if isinstance(spec, str):
        return _fmt(metrics.get(spec))
    sub = metrics.get(spec[0]) or {}
    return (
        " / ".join(_fmt(sub.get(k)) for k in spec[1:]) if len(spec) > 2 else _fmt(sub.get(spec[1]))
    )


def print_summary(
    title: str, columns: dict[str, dict[str, Any]], ratios: dict[str, dict[str, float]] | None
) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=False)
    table = Table(title=title)
    table.add_column("metric")
    for name in columns:
        table.add_column(name, justify="right")
    for label, spec in SUMMARY_ROWS:
        cells = [_cell(m, spec) for m in columns.values()]
        if all(c in ("-", "- / -", "- / - / -") for c in cells):
            continue
        table.add_row(label, *cells)
    console.print(table)
    for name, ratio in (ratios or {}).items():
        rt = Table(title=name)
        rt.add_column("metric")
        rt.add_column("ratio", justify="right")
        for key, value in ratio.items():
            rt.add_row(key, _fmt(value))
        console.print(rt)


def plot(path: str, title: str, runs: dict[str, dict[str, Any]]) -> None:
    """runs: {label: {"metrics": {...}, "samples": {ttft_ms, itl_ms, e2e_ms}}} -> PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, key in zip(axes.flat[:3], ("ttft_ms", "itl_ms", "e2e_ms"), strict=True):
        for label, run in runs.items():
            xs = sorted(run.get("samples", {}).get(key) or [])
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=label)
        ax.set_title(f"{key} (CDF)")
        ax.set_xlabel("ms")
        ax.set_xscale("symlog")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes.flat[3]
    labels = list(runs)
    values = [runs[k]["metrics"].get("output_tok_s") or 0.0 for k in labels]
    bars = ax.bar(labels, values, color=[f"C{i}" for i in range(len(labels))])
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(
            f"{value:.1f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax.set_title("output tok/s (median of repeats)")
    ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    import logging

    previous = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        yield
    finally:
        logging.getLogger("transformers").setLevel(previous)
