"""Peak resident memory of one part of a benchmark's process (Linux): reset the high-water mark, run, read it.

``ru_maxrss`` only ever grows, so a step whose peak stays under what loading the models reached reads as 0 extra
MiB; ``/proc/self/clear_refs`` resets the mark (``VmHWM``) to the current resident size."""

from __future__ import annotations

import re


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as status:
        return int(re.search(rf"{field}:\s+(\d+)", status.read()).group(1)) / 1024


def peak_mib() -> float:
    """This process's peak resident memory since the last :func:`reset_peak` (``VmHWM``), MiB."""
    return _status_mib("VmHWM")


def current_mib() -> float:
    """This process's resident memory now (``VmRSS``), MiB."""
    return _status_mib("VmRSS")


def reset_peak() -> None:
    """Reset the peak to the current resident size (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
