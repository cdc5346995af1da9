"""PNG plots of a benchmark. Figures are drawn on an explicit Agg canvas, never through pyplot, so nothing
here depends on (or changes) a process-wide backend or needs a display.

matplotlib is the optional extra `plot`: it is imported when a figure is drawn, never with this module, so a slim
install benchmarks (and serves) without it, and the benchmark faces ask `can_plot` before they draw."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cobali.engine.plan import ChunkKind, TickRecord
from cobali.harness.configs import BenchRun
from cobali.harness.latency import final_stats, latency_samples, request_timing
from cobali.harness.report import gaps_ms

if TYPE_CHECKING:
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

COLOURS = {ChunkKind.PREFILL: ("tab:orange", "peru"), ChunkKind.DECODE: ("tab:blue", "steelblue")}
MISSING = ("no plots: matplotlib is not installed; install the extra that draws them: pip install 'cobali[plot]' "
           "(in a checkout: pip install '.[plot]')")


def can_plot(command: str) -> bool:
    """Whether plots can be drawn here; if not, says so on stderr (before a run that may take minutes, so that
    it can be stopped) with the extra to install. The JSON files are written either way."""
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print(f"{command}: {MISSING}", file=sys.stderr)
    return False


def _null_formatter() -> NullFormatter:
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _figure(n_axes: int = 1, width: float = 7.0, height: float = 4.0) -> tuple[Figure, list]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * n_axes if n_axes > 1 else width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, n_axes, squeeze=False)[0]
    return fig, list(axes)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def throughput_bars(path: Path, summaries: Sequence[dict]) -> Path:
    fig, (ax,) = _figure(width=max(5.0, 1.2 * len(summaries) + 2))
    names = [s["config"] for s in summaries]
    bars = ax.bar(names, [s["output_tok_s"] for s in summaries], color="tab:blue")
    labels = [f"×{s['speedup']:.2f}" if s.get("speedup") is not None else "" for s in summaries]
    ax.bar_label(bars, labels=labels, padding=2)
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput (label: speedup vs first config)")
    ax.margins(y=0.12)  # room for the labels above the tallest bar
    ax.tick_params(axis="x", labelrotation=30 if len(names) > 4 else 0)
    return _save(fig, path)


def latency_cdfs(path: Path, samples: Mapping[str, Mapping[str, Sequence[float]]],
                 metrics: Sequence[str] = ("ttft", "itl")) -> Path:
    """One empirical CDF per config for each metric; log x because configs differ by orders of magnitude."""
    fig, axes = _figure(len(metrics), width=5.5)
    for ax, metric in zip(axes, metrics, strict=True):
        for name, by_metric in samples.items():
            values = np.sort([v for v in by_metric.get(metric, ()) if v > 0])
            if values.size:
                fraction = np.arange(values.size + 1) / values.size
                ax.step(np.concatenate([values[:1], values]), fraction, where="post", label=name)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(_null_formatter())  # minor labels on a log axis overlap
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return _save(fig, path)


def _slot_runs(ticks: Sequence[TickRecord]) -> dict[int, list[tuple[int, int, int, ChunkKind]]]:
    """Per slot: (first tick, n ticks, request, kind) for each run of consecutive ticks it did the same."""
    runs: dict[int, list[list]] = {}
    for i, tick in enumerate(ticks):
        for c in tick.plan.chunks:
            slot_runs = runs.setdefault(c.slot, [])
            last = slot_runs[-1] if slot_runs else None
            if last and last[0] + last[1] == i and last[2] == c.request_id and last[3] is c.kind:
                last[1] += 1
            else:
                slot_runs.append([i, 1, c.request_id, c.kind])
    return {slot: [tuple(r) for r in rs] for slot, rs in runs.items()}


def slot_timeline(path: Path, name: str, ticks: Sequence[TickRecord]) -> Path:
    """Gantt of slots over ticks. Grey: a request holds the slot but got no rows that tick (waiting for
    token budget); shades alternate between requests so neighbours on one slot stay distinguishable."""
    runs = _slot_runs(ticks)
    admitted = {rid: i for i, t in enumerate(ticks) for rid in t.plan.admitted}
    fig, (ax,) = _figure(width=10, height=max(3.0, 0.35 * len(runs) + 1.5))
    for slot, slot_runs in runs.items():
        # One collection per colour and slot: thousands of ticks stay a handful of artists.
        bars: dict[str, list[tuple[int, int]]] = {"lightgrey": []}
        for request_id, grouped in itertools.groupby(slot_runs, key=lambda r: r[2]):
            group = list(grouped)
            # A cohort member may be admitted ticks before its first prefill rows fit in the batch.
            start = min(admitted.get(request_id, group[0][0]), group[0][0])
            bars["lightgrey"].append((start, group[-1][0] + group[-1][1] - start))
        for start, n, request_id, kind in slot_runs:
            bars.setdefault(COLOURS[kind][request_id % 2], []).append((start, n))
        for colour, xranges in bars.items():
            ax.broken_barh(xranges, (slot - 0.4, 0.8), facecolors=colour)
    for kind, (colour, _) in COLOURS.items():
        ax.bar(0, 0, color=colour, label=kind.value)
    ax.bar(0, 0, color="lightgrey", label="held, idle")
    ax.set_xlabel("tick")
    ax.set_ylabel("slot")
    ax.set_yticks(sorted(runs))
    ax.set_title(f"{name}: slot occupancy")
    fig.legend(loc="outside lower center", ncols=3, fontsize="small")
    return _save(fig, path)


def tokens_per_tick(path: Path, name: str, ticks: Sequence[TickRecord]) -> Path:
    fig, (ax,) = _figure(width=9)
    if ticks:
        # One point per tick start plus the last tick's end, so the last tick gets its width too.
        x = np.array([t.start for t in ticks] + [ticks[-1].end]) - ticks[0].start
        plans = [t.plan for t in ticks] + [ticks[-1].plan]
        decode = np.array([p.n_decode for p in plans])
        prefill = decode + np.array([p.n_prefill_tokens for p in plans])
        ax.fill_between(x, 0, decode, step="post", color=COLOURS[ChunkKind.DECODE][0], label="decode rows")
        ax.fill_between(x, decode, prefill, step="post", color=COLOURS[ChunkKind.PREFILL][0],
                        label="prefill rows")
        ax.legend(loc="upper right", fontsize="small")
    ax.set_xlabel("time since first tick (s)")
    ax.set_ylabel("tokens in the batch")
    ax.set_title(f"{name}: tokens per tick")
    return _save(fig, path)


def gap_histogram(path: Path, gaps: Mapping[str, Sequence[float]]) -> Path:
    """Host gap between forwards, log-spaced bins shared by every config."""
    fig, (ax,) = _figure()
    positive = [g for values in gaps.values() for g in values if g > 0]
    if positive:
        bins = np.geomspace(min(positive), max(positive) * 1.0001, 50)
        for name, values in gaps.items():
            ax.hist([g for g in values if g > 0], bins=bins, histtype="step", label=name)
        ax.set_xscale("log")
        ax.legend(fontsize="small")
    ax.set_xlabel("gap between llama_decode calls (ms)")
    ax.set_ylabel("ticks")
    return _save(fig, path)


def sweep_plots(out: Path, summaries: Sequence[dict]) -> list[Path]:
    """Per swept knob: throughput and TTFT/ITL p99 against it, one line per setting of the other knobs."""
    knobs = list(summaries[0]["engine"]["knobs"]) if summaries else []
    paths = []
    for knob in knobs:
        fig, axes = _figure(3, width=4.5)
        groups: dict[tuple, list[dict]] = {}
        for s in summaries:
            others = tuple((k, v) for k, v in s["engine"]["knobs"].items() if k != knob)
            groups.setdefault(others, []).append(s)
        for others, group in groups.items():
            group.sort(key=lambda s: s["engine"]["knobs"][knob])
            x = [s["engine"]["knobs"][knob] for s in group]
            label = ", ".join(f"{k}={v}" for k, v in others) or None
            for ax, key in zip(axes, ("output_tok_s", "ttft_p99_ms", "itl_p99_ms"), strict=True):
                ax.plot(x, [s.get(key) for s in group], marker="o", label=label)
        values = sorted({s["engine"]["knobs"][knob] for s in summaries})
        for ax, title in zip(axes, ("output tok/s", "TTFT p99 (ms)", "ITL p99 (ms)"), strict=True):
            # Knob values are usually powers of two: a log2 axis spaces them evenly.
            ax.set_xscale("log", base=2)
            ax.set_xticks(values, [str(v) for v in values])
            ax.xaxis.set_minor_formatter(_null_formatter())
            ax.set_xlabel(knob)
            ax.set_title(title)
            ax.grid(alpha=0.3)
        if len(groups) > 1:
            axes[0].legend(fontsize="small")
        paths.append(_save(fig, out / f"sweep_{knob}.png"))
    return paths


def write_offline_plots(out: Path, runs: Sequence[BenchRun], summaries: Sequence[dict]) -> list[Path]:
    samples = {r.config.name: latency_samples(request_timing(final_stats(o)) for o in r.result.outputs) for r in runs}
    gaps = {r.config.name: gaps_ms(r.result.ticks, r.result.idle_after) for r in runs}
    paths = [throughput_bars(out / "throughput.png", summaries),
             latency_cdfs(out / "latency_cdf.png", samples),
             gap_histogram(out / "gap_hist.png", gaps)]
    for run in runs:
        name, ticks = run.config.name, run.result.ticks
        paths.append(slot_timeline(out / f"timeline_{name}.png", name, ticks))
        paths.append(tokens_per_tick(out / f"tokens_{name}.png", name, ticks))
    if any(r.config.knobs for r in runs):
        paths += sweep_plots(out, summaries)
    return paths


def metric_vs_rate(path: Path, metric: str, label: str, series: Mapping[str, Sequence[dict]]) -> Path:
    """One metric of a rate sweep against the request rate, a line per server."""
    fig, (ax,) = _figure(width=6.0)
    for name, rows in series.items():
        points = sorted((r["rate"], r[metric]) for r in rows if r.get(metric) is not None)
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", label=name)
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel(label)
    ax.set_title(f"{label} vs request rate")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
