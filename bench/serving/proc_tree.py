"""A process and its descendants, read from Linux's /proc: what a server that starts others (Ray's GCS, raylet and
workers; many models' servers) holds in memory and spends in CPU."""

from __future__ import annotations

import os

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    """The fields after a process's name (which may hold spaces; it ends at ')'), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def descendants(root: int) -> list[int]:
    """Every process below `root` (not root itself), children before theirs."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, ())
    return found


def tree_rss(root: int) -> dict[int, int]:
    """Resident bytes of every descendant of `root`."""
    rss = {}
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss[pid] = int(f.read().split()[1]) * PAGE
        except OSError:
            continue
    return rss


def tree_cpu_s(root: int) -> float:
    """CPU seconds that `root` and its descendants have used so far (user and system)."""
    used = 0.0
    for pid in [root, *descendants(root)]:
        if (fields := _stat(pid)) is not None:
            used += (int(fields[11]) + int(fields[12])) / TICK
    return used
