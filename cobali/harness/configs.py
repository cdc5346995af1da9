"""Engine configurations to compare, sweep grids, and the workload run through each (harness/driver.py)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from cobali.backends.base import Backend
from cobali.engine.costs import CostProfile
from cobali.engine.engine import Engine
from cobali.engine.engine_config import EngineConfig
from cobali.harness.driver import LoadOptions, RunResult, run_workload
from cobali.harness.workloads import WorkItem

_SPLIT = re.compile(r"cont-split(\d+)")
# --sweep knob -> (BenchConfig field, short label for config names)
SWEEP_KNOBS = {"max-slots": ("max_slots", "slots"), "prefill-chunk-tokens": ("prefill_chunk_tokens", "split")}


@dataclass(frozen=True)
class BenchConfig:
    name: str
    mode: str
    max_slots: int
    prefill_chunk_tokens: int
    knobs: dict[str, int] = field(default_factory=dict, hash=False)  # swept values, for plots
    async_scheduling: bool | None = None  # None: as the command line says

    def engine_config(self, base: EngineConfig) -> EngineConfig:
        """The command line's engine settings (policy, KV admission, ...) with this config's knobs."""
        overlap = base.async_scheduling if self.async_scheduling is None else self.async_scheduling
        return dataclasses.replace(base, mode=self.mode, max_slots=self.max_slots,
                                   prefill_chunk_tokens=self.prefill_chunk_tokens, async_scheduling=overlap)


def parse_config(name: str, max_slots: int, prefill_chunk_tokens: int) -> BenchConfig:
    """seq, static, cont, cont-splitN; any of them ending in -async runs with async scheduling."""
    base = name.removesuffix("-async")
    overlap = True if base != name else None
    if base in ("seq", "static", "cont"):
        return BenchConfig(name, base, max_slots, prefill_chunk_tokens, async_scheduling=overlap)
    match = _SPLIT.fullmatch(base)
    if match and int(match[1]) >= 1:
        return BenchConfig(name, "cont", max_slots, int(match[1]), async_scheduling=overlap)
    raise ValueError(f"unknown config {name!r}: expected seq, static, cont or cont-splitN, optionally ending "
                     "in -async (e.g. cont-split256, cont-split256-async)")


def parse_configs(text: str, max_slots: int, prefill_chunk_tokens: int) -> list[BenchConfig]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--configs {text!r}: no config names")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"--configs {text!r}: {', '.join(duplicates)} given twice")
    return [parse_config(n, max_slots, prefill_chunk_tokens) for n in names]


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """`max-slots=4,8,16` -> ("max-slots", [4, 8, 16])."""
    knob, sep, values = text.partition("=")
    if not sep or knob not in SWEEP_KNOBS:
        knobs = ", ".join(SWEEP_KNOBS)
        raise ValueError(f"--sweep {text!r}: expected KNOB=V1,V2,... with KNOB one of {knobs}")
    try:
        numbers = [int(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep {text!r}: values must be integers") from None
    if not numbers or min(numbers) < 1:
        raise ValueError(f"--sweep {text!r}: values must be positive integers")
    return knob, sorted(set(numbers))


def sweep_configs(sweeps: Sequence[str], max_slots: int, prefill_chunk_tokens: int) -> list[BenchConfig]:
    """The grid over every --sweep knob, in cont mode; knobs not swept keep their flag values."""
    parsed = [parse_sweep(s) for s in sweeps]
    knobs = [k for k, _ in parsed]
    if len(set(knobs)) != len(knobs):
        raise ValueError(f"--sweep: a knob is given twice ({', '.join(knobs)})")
    configs = []
    for values in itertools.product(*(v for _, v in parsed)):
        chosen = dict(zip(knobs, values, strict=True))
        fields = {"max_slots": max_slots, "prefill_chunk_tokens": prefill_chunk_tokens}
        fields.update({SWEEP_KNOBS[k][0]: v for k, v in chosen.items()})
        name = "cont-" + "-".join(f"{SWEEP_KNOBS[k][1]}{v}" for k, v in chosen.items())
        configs.append(BenchConfig(name, "cont", fields["max_slots"], fields["prefill_chunk_tokens"], knobs=chosen))
    return configs


@dataclass
class BenchRun:
    config: BenchConfig
    result: RunResult


def run_configs(backend: Backend, configs: Sequence[BenchConfig], items: Sequence[WorkItem], base: EngineConfig,
                load: LoadOptions, costs: CostProfile | None = None) -> list[BenchRun]:
    """Each config on the same backend, one after the other. Engines are all built first so a bad config
    fails before any run; each one's SlotPool clears a slot's KV when it hands the slot out."""
    engines = [Engine(backend, c.engine_config(base), costs=costs) for c in configs]
    return [BenchRun(config, run_workload(engine, items, load, progress=config.name))
            for config, engine in zip(configs, engines, strict=True)]
