"""How busy the machine was while something was timed, so that a ratio measured on a loaded machine says so.

Two readings. The 1-minute load average (``os.getloadavg()``) at the start and end of the timed block counts this
run's own threads too: a benchmark using both cores of a 2-core machine reads about 1.0 per core on its own. So the
verdict rests on the other reading where the system gives it (Linux's ``/proc/stat``): the CPU time the machine spent
busy during the block minus this process's own (and its waited children's), per core and second of wall time, that
is the work of *other* processes that competed with the timed run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LOADED_PER_CORE", "OTHERS_PER_CORE", "LoadWatch"]

LOADED_PER_CORE = 0.75
"""1-minute load average per CPU core above which a run's timings are no figures, where other processes' work cannot
be measured (no ``/proc/stat``): the run's own threads count in it."""
OTHERS_PER_CORE = 0.25
"""Other processes' CPU use per core during the run above which its timings are no figures: a quarter of every core
(half a core of a 2-core machine) taken from the timed run, which the packed path feels more than the padded one."""


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine spent busy since boot (``/proc/stat``), None where unreadable."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_busy_seconds() -> float:
    """CPU seconds this process and its waited children have used."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


@dataclass
class LoadWatch:
    """The load on entering and leaving a ``with`` block (or at each :meth:`sample`): the 1-minute load average per
    core (:attr:`samples`, :attr:`per_core` the largest), and, over the block, other processes' CPU use per core
    (:attr:`others_per_core`, None where it cannot be measured)."""

    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    read: Callable[[], tuple[float, float, float]] = os.getloadavg
    samples: list[float] = field(default_factory=list)
    busy: Callable[[], float | None] = machine_busy_seconds
    own: Callable[[], float] = own_busy_seconds
    clock: Callable[[], float] = time.perf_counter
    others_per_core: float | None = None
    _start: tuple[float | None, float, float] | None = None

    def sample(self) -> float:
        """Read the load average now, per core; keep and return it."""
        self.samples.append(self.read()[0] / self.cores)
        return self.samples[-1]

    def __enter__(self) -> LoadWatch:
        self.sample()
        self._start = (self.busy(), self.own(), self.clock())
        return self

    def __exit__(self, *exc: object) -> None:
        self.sample()
        busy, own, wall = self._start
        now_busy, seconds = self.busy(), self.clock() - wall
        if busy is not None and now_busy is not None and seconds > 0:
            others = (now_busy - busy) - (self.own() - own)
            self.others_per_core = max(others, 0.0) / (seconds * self.cores)

    @property
    def per_core(self) -> float:
        """The largest load average per core sampled (this run's own threads included)."""
        return max(self.samples)

    @property
    def too_loaded(self) -> bool:
        """Whether the machine was too loaded for the timings to be figures: other processes above
        :data:`OTHERS_PER_CORE` where measured, else the load average above :data:`LOADED_PER_CORE`."""
        if self.others_per_core is not None:
            return self.others_per_core > OTHERS_PER_CORE
        return self.per_core > LOADED_PER_CORE

    def describe(self) -> str:
        """One phrase: other processes' CPU use per core, the load average per core, the core count."""
        samples = ", ".join(f"{value:.2f}" for value in self.samples)
        others = ("" if self.others_per_core is None else
                  f"other processes used {self.others_per_core:.2f} of each core while it ran; ")
        return (f"machine: {others}load average {self.per_core:.2f} per core (1 minute, {self.cores} cores, largest "
                f"of {samples} sampled at start and end, this run's threads included)")

    def as_dict(self) -> dict[str, object]:
        """What a JSON record keeps: cores, samples, the largest, others' use, and whether it is too loaded."""
        return {"cores": self.cores, "samples": self.samples, "per_core": self.per_core,
                "others_per_core": self.others_per_core, "too_loaded": self.too_loaded,
                "threshold_others_per_core": OTHERS_PER_CORE, "threshold_per_core": LOADED_PER_CORE}
