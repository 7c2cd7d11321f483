"""What packfree derives from a boundary tensor, built once per tensor: :func:`memo`; and the host copy of its values,
read once: :func:`host_of`.

Every layer of a forward passes the same ``seq_idx`` / ``cu_seqlens`` tensor, so masks, index maps and value checks
derived from it are built for the first layer and kept on the tensor itself (freed with it). An in-place write to
the tensor bumps its version, which makes every value kept on it stale. An inference tensor (``torch.inference_mode``)
has no version counter: what is kept on it holds until the next batch is read (:func:`read_to_host`), except the host
values of the boundaries' own device forms (:func:`keep_host`), which nothing writes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import numpy
import torch
from torch import Tensor

__all__ = ["host_of", "keep_host", "memo", "read_to_host"]

_ATTR = "_packfree_memo"
_HOST = "_packfree_host"
Value = TypeVar("Value")
_batches_read = [0]
"""How many times :func:`read_to_host` ran: the stamp of what is kept on an inference tensor."""


def _stamp(tensor: Tensor, *, own: bool = False) -> tuple:
    """What must stay unchanged for a value kept on ``tensor`` to hold: its version; for an inference tensor, the
    batch read (``own``: a form the boundaries built, which nothing writes, holds for good)."""
    if not tensor.is_inference():
        return ("version", tensor._version)
    return ("own",) if own else ("batch", _batches_read[0])


def memo(tensor: Tensor, name: str, key: Hashable, build: Callable[[], Value]) -> Value:
    """``build()``, kept on ``tensor`` under ``name`` while ``key`` and the tensor's version stay what they were.

    One value per name: a call with another ``key`` (a new chunk size, dtype or length) builds and keeps its own in
    place of the old. A ``build`` that raises keeps nothing.
    """
    kept = tensor.__dict__.setdefault(_ATTR, {})
    stamp = (key, _stamp(tensor))
    entry = kept.get(name)
    if entry is None or entry[0] != stamp:
        entry = (stamp, build())
        kept[name] = entry
    return entry[1]


def keep_host(tensor: Tensor, values: numpy.ndarray) -> Tensor:
    """Leave ``values`` (``tensor``'s own, already on the host: the boundaries built them there) on ``tensor`` for
    :func:`host_of`, read-only; returns ``tensor``."""
    return _keep(tensor, values, own=True)


def _keep(tensor: Tensor, values: numpy.ndarray, *, own: bool) -> Tensor:
    values.flags.writeable = False
    tensor.__dict__[_HOST] = (_stamp(tensor, own=own), values)
    return tensor


def host_of(tensor: Tensor) -> numpy.ndarray:
    """``tensor``'s values as a read-only host array of its shape: the copy left on it (:func:`keep_host`,
    :func:`read_to_host`), else read now (one device-to-host copy) and kept."""
    kept = _kept(tensor)
    if kept is None:
        kept = tensor.detach().to("cpu").numpy()
        _keep(tensor, kept, own=False)
    return kept


def _kept(tensor: Tensor) -> numpy.ndarray | None:
    kept = tensor.__dict__.get(_HOST)
    return kept[1] if kept is not None and kept[0] in (("own",), _stamp(tensor)) else None


def read_to_host(tensors: Iterable[Tensor | None]) -> None:
    """Give every tensor of ``tensors`` its host copy (:func:`host_of`) in one device-to-host copy per device: the
    integer and bool tensors are read together, as one int64 buffer (a floating tensor is read on its own)."""
    _batches_read[0] += 1
    pending: dict[int, Tensor] = {}
    for tensor in tensors:
        if isinstance(tensor, Tensor) and _kept(tensor) is None and id(tensor) not in pending:
            pending[id(tensor)] = tensor
    by_device: dict[torch.device, list[Tensor]] = {}
    for tensor in pending.values():
        if tensor.is_floating_point() or tensor.is_complex():
            host_of(tensor)
        else:
            by_device.setdefault(tensor.device, []).append(tensor)
    for group in by_device.values():
        if len(group) == 1:
            host_of(group[0])
            continue
        buffer = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in group]).to("cpu").numpy()
        for tensor, values in zip(group, numpy.split(buffer, numpy.cumsum([t.numel() for t in group])[:-1])):
            dtype = numpy.dtype(str(tensor.dtype).removeprefix("torch."))
            _keep(tensor, values.astype(dtype).reshape(tuple(tensor.shape)), own=False)
