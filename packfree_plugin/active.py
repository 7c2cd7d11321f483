"""What is in effect on this thread: the forward's :class:`Boundaries` and the native mixer call in progress.

Each is a per-thread stack that code pushes onto before calling into a model part and pops after, so
nested models, several threads (``nn.DataParallel`` replicas) and re-entrant calls each see their own.
A stack on a ``threading.local`` rather than a ``ContextVar``: Dynamo traces reads and pushes of the
former and breaks the graph on the latter, and these reads happen in every layer.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from .boundaries import Boundaries

__all__ = ["ThreadStack", "active_boundaries"]

T = TypeVar("T")


class _PerThread(threading.local):
    def __init__(self) -> None:
        self.items: list = []


class ThreadStack(Generic[T]):
    """A stack of values private to each thread; ``top()`` is None when empty."""

    def __init__(self) -> None:
        self._local = _PerThread()

    def top(self) -> T | None:
        items = self._local.items
        return items[-1] if items else None

    def below_top(self) -> T | None:
        """The entry under the top (None when there is none)."""
        items = self._local.items
        return items[-2] if len(items) > 1 else None

    def push(self, value: T | None) -> None:
        self._local.items.append(value)

    def replace_top(self, value: T | None) -> None:
        self._local.items[-1] = value

    def pop(self) -> None:
        self._local.items.pop()


active_boundaries: ThreadStack[Boundaries] = ThreadStack()
"""Boundaries of the forward in progress: pushed by the model hook for the whole forward (the mask
function reads them), and by the decoder-layer hook around each layer (the mixers inside read them)."""
