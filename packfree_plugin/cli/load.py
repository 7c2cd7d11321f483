"""How busy the machine was while something was timed, so that a ratio measured on a loaded machine says so."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LOADED_PER_CORE", "LoadWatch"]

LOADED_PER_CORE = 0.75
"""1-minute load average per CPU core above which a run's timings are no figures: the other processes' work (and
this run's threads waiting for a core) is in them as much as the work being timed."""


@dataclass
class LoadWatch:
    """The 1-minute load average per CPU core, sampled on entering and on leaving a ``with`` block (or by
    :meth:`sample`); :attr:`per_core` is the largest sample. The timed run's own threads count in it."""

    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    read: Callable[[], tuple[float, float, float]] = os.getloadavg
    samples: list[float] = field(default_factory=list)

    def sample(self) -> float:
        """Read the load now, per core; keep and return it."""
        self.samples.append(self.read()[0] / self.cores)
        return self.samples[-1]

    def __enter__(self) -> LoadWatch:
        self.sample()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sample()

    @property
    def per_core(self) -> float:
        """The largest load per core sampled."""
        return max(self.samples)

    @property
    def too_loaded(self) -> bool:
        """Whether the machine was too loaded for the timings to be figures (:data:`LOADED_PER_CORE`)."""
        return self.per_core > LOADED_PER_CORE

    def describe(self) -> str:
        """One phrase: the load per core, its samples and the core count."""
        samples = ", ".join(f"{value:.2f}" for value in self.samples)
        return (f"machine load {self.per_core:.2f} per core (1-minute average over {self.cores} cores, largest of "
                f"{samples} sampled at start and end, this run's threads included)")

    def as_dict(self) -> dict[str, object]:
        """What a JSON record keeps: cores, samples, the largest, and whether it is too loaded."""
        return {"cores": self.cores, "samples": self.samples, "per_core": self.per_core,
                "too_loaded": self.too_loaded, "threshold_per_core": LOADED_PER_CORE}
