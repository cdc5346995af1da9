"""Memory the engine may use, and the KV context that fits in it: read from the OS, without llama.cpp (the
backend adds what llama.cpp's devices report)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# What --fit leaves free beyond the weights, the KV and the compute buffers: the larger of this and a tenth of
# the free memory (llama-server's --fit keeps 1 GiB per device; a small machine cannot spare that much).
FIT_MARGIN_BYTES = 512 * 2**20
# llama.cpp pads a sequence's cells to 256; a slot smaller than this is no context for a chat.
CELL_GRANULARITY = 256

_GPU_MARKERS = ("/dev/nvidia0", "/dev/kfd", "/dev/dxg")  # NVIDIA, AMD ROCm, WSL's GPU


def host_available() -> int | None:
    """Bytes this process may still allocate: MemAvailable plus free swap, under its cgroup's limit where it
    has one; None where the OS does not say (not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        available = (int(fields["MemAvailable"].split()[0]) + int(fields.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return min(available, _cgroup_room() or available)


def _cgroup_room() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(0, int(limit) - used)


def gpu_present() -> str | None:
    """What shows a GPU on this machine (a device node, or nvidia-smi on PATH), or None."""
    for marker in _GPU_MARKERS:
        if os.path.exists(marker):
            return marker
    return "nvidia-smi on PATH" if shutil.which("nvidia-smi") else None


def fit_margin(free: int) -> int:
    return max(FIT_MARGIN_BYTES, free // 10)


def fit_cells(free: int, reserved: int, cell_bytes: int, wanted: int, n_streams: int) -> int:
    """KV cells that fit in `free` bytes beside `reserved` ones (weights, compute buffers) and a margin, at most
    `wanted`; when it is cut, to a whole number of CELL_GRANULARITY cells per stream (n_streams: the slots, or 1
    for a unified KV). 0 when not even one granule per stream fits."""
    budget = free - reserved - fit_margin(free)
    room = max(0, budget) // cell_bytes // n_streams // CELL_GRANULARITY * CELL_GRANULARITY
    return wanted if room * n_streams >= wanted else room * n_streams


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
