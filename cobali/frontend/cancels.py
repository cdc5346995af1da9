"""A task cancelled by a callback of ours (a timer's, a vanished client's), and told apart from a cancel of anyone
else's (a shutdown's), which must go on up."""

from __future__ import annotations

import asyncio
import sys


def only_our_cancel(task: asyncio.Task) -> bool:
    """After catching the CancelledError of a cancel this code made: withdraws it, and says whether no one
    else's is pending (theirs to handle). Python 3.10 counts no cancels: there, one that lands with ours reads as
    ours, and the task ends at once anyway."""
    if sys.version_info >= (3, 11):
        return task.uncancel() == 0
    return True


class Canceller:
    """Called, cancels the task it was made in, and remembers that it did."""

    def __init__(self) -> None:
        task = asyncio.current_task()
        assert task is not None, "made inside a task"
        self.task = task
        self.fired = False

    def __call__(self) -> None:
        self.fired = True
        self.task.cancel()

    def was_ours(self) -> bool:
        """In the task's `except CancelledError`: whether the cancel was this one's alone (withdrawn, then)."""
        return self.fired and only_our_cancel(self.task)
