"""What packfree keeps about the tensors it reads: their host copies and the values derived from them.

Values derived from a batch live on its :class:`~packfree_plugin.boundaries.Boundaries` (:func:`memo` with a
``Boundaries`` holder: they die with the forward). A tensor itself (a ``seq_idx`` / ``cu_seqlens`` given to an op
directly, a boundary input the model entry read, a form the boundaries built) gets nothing written into it: what
packfree keeps about it sits in a store of packfree's own, keyed by the tensor's identity and holding it weakly, so
the entry is freed with the tensor, and each value is kept under a stamp (:func:`_stamp`) that an in-place write
changes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import weakref
from functools import partial

import numpy
import torch

if TYPE_CHECKING:
    from .tiling import Boundaries

__all__ = ["close_batch", "host_of", "keep_host", "kept_form", "memo", "read_to_host"]

_Form = TypeVar("_Form")


class _Kept:
    """What the store holds for one tensor: ``tensor``, a weak reference to it (whose callback drops the entry),
    ``host``, ``(stamp, values)`` of its host copy (or None), and ``derived``, ``name -> (stamp, value)`` of what
    :func:`memo` built from it."""

    __slots__ = ("tensor", "host", "derived")

    def __init__(self, tensor: weakref.ref) -> None:
        self.tensor = tensor
        self.host: tuple[tuple, numpy.ndarray] | None = None
        self.derived: dict[Hashable, tuple[Hashable, Any]] = {}


_kept: dict[int, _Kept] = {}
"""``id(tensor)`` -> :class:`_Kept`: keyed by the tensor's identity, holding it weakly, and dropped when it is freed
(a plain dict: a lookup costs a fraction of ``torch.utils.weak.WeakIdKeyDictionary``'s, and every layer makes
several). No value kept here may hold its own tensor, or the pair would never be freed."""


def _drop(store: dict[int, _Kept], key: int, ref: weakref.ref) -> None:
    """Drop from ``store`` the entry of the freed tensor ``ref`` referred to (not a later tensor's that took its id;
    ``store`` is passed in: a tensor freed at interpreter exit may outlive the module's globals)."""
    kept = store.get(key)
    if kept is not None and kept.tensor is ref:
        del store[key]


def _kept_for(tensor: torch.Tensor) -> _Kept | None:
    """The store's entry for ``tensor``, or None."""
    kept = _kept.get(id(tensor))
    return kept if kept is not None and kept.tensor() is tensor else None


_open_batch: list[object | None] = [None]
"""The batch the model entry read (:func:`read_to_host`) and whose forward runs, until :func:`close_batch`: the stamp
of what is kept about the inference tensors it read. Only stored to at close, never read there, so a compiled
forward that closes its batch guards on nothing."""


def _kept_of(tensor: torch.Tensor) -> _Kept:
    """The store's entry for ``tensor``, made empty on first use."""
    kept = _kept_for(tensor)
    if kept is None:
        key = id(tensor)
        kept = _kept[key] = _Kept(weakref.ref(tensor, partial(_drop, _kept, key)))
    return kept


def _stamp(tensor: torch.Tensor, *, own: bool = False) -> tuple:
    """What must stay unchanged for a value kept about ``tensor`` to hold: its version. An inference tensor has no
    version counter: a form the boundaries built (``own``, or one whose host copy they kept: :func:`keep_host`),
    which nothing writes, holds for good; one the model entry
    read holds while its forward runs (:func:`read_to_host` to :func:`close_batch`); any other (an op called
    directly, a tensor read after its forward) holds for no later call, since an in-place write cannot be seen."""
    if not tensor.is_inference():
        return ("version", tensor._version)
    kept = _kept_for(tensor)
    host_stamp = None if kept is None or kept.host is None else kept.host[0]
    if own or host_stamp == ("own",):
        return ("own",)
    batch = ("batch", _open_batch[0])
    return batch if batch[1] is not None and host_stamp == batch else ("unseen", object())


def close_batch() -> None:
    """End the batch the model entry read: what was kept about its inference tensors holds no longer (the caller may
    refill them in place before the next forward or a direct op call)."""
    _open_batch[0] = None


def memo(holder: Boundaries | torch.Tensor, name: Hashable, key: Hashable, build: Callable[[], _Form]) -> _Form:
    """``build()``, kept for ``holder`` under ``name`` while ``key`` stays what it was: the one cache of what packfree
    derives from boundaries, built once per forward rather than once per layer.

    ``holder`` is a :class:`~packfree_plugin.boundaries.Boundaries` (its device forms, the portable attention's
    sample groups: kept on the object), or a boundary tensor every layer of a forward passes (``seq_idx`` /
    ``cu_seqlens`` given to an op directly: kept in packfree's store, freed with the tensor; an in-place write, which
    bumps the tensor's version, makes it stale; on an inference tensor, which has no version, it holds only inside
    the forward whose entry read that tensor: :func:`_stamp`). One value per name: a call with another ``key`` (a new
    chunk size, dtype or length) builds and keeps its own in place of the old. A ``build`` that raises keeps nothing.
    The value must not hold ``holder`` when that is a tensor (the store's entry would never be freed)."""
    # a value built under inference_mode is an inference tensor, which autograd refuses to save: never reuse one
    # outside that mode (a model evaluated under inference_mode, then trained on the same position_ids)
    inference = torch.is_inference_mode_enabled()
    if isinstance(holder, torch.Tensor):
        store, stamp = _kept_of(holder).derived, (key, inference, _stamp(holder))
    else:
        store, stamp = holder._device_forms, (key, inference)
    entry = store.get(name)
    if entry is None or entry[0] != stamp:
        entry = store[name] = (stamp, build())
    return entry[1]


def kept_form(holder: Boundaries, name: Hashable) -> Any:
    """What :func:`memo` keeps on ``holder`` under ``name``, or None."""
    entry = holder._device_forms.get(name)
    return None if entry is None else entry[1]


def keep_host(tensor: torch.Tensor, values: numpy.ndarray) -> torch.Tensor:
    """Keep ``values`` (``tensor``'s own, already on the host: the boundaries built them there) as ``tensor``'s host
    copy for :func:`host_of`, read-only; returns ``tensor``."""
    return _keep(tensor, values, own=True)


def _keep(tensor: torch.Tensor, values: numpy.ndarray, *, own: bool, batch: bool = False) -> torch.Tensor:
    """Keep ``values`` as ``tensor``'s host copy; ``batch``: the model entry read it for the batch now open."""
    values.flags.writeable = False
    stamp = ("batch", _open_batch[0]) if batch and tensor.is_inference() else _stamp(tensor, own=own)
    _kept_of(tensor).host = (stamp, values)
    return tensor


def host_of(tensor: torch.Tensor) -> numpy.ndarray:
    """``tensor``'s values as a read-only host array of its shape: the copy kept for it (:func:`keep_host`,
    :func:`read_to_host`), else read now (one device-to-host copy) and kept."""
    kept = _kept_host(tensor)
    if kept is None:
        kept = _to_host(tensor)
        _keep(tensor, kept, own=False)
    return kept


def _to_host(tensor: torch.Tensor) -> numpy.ndarray:
    """``tensor``'s values on the host, of its shape; a floating dtype numpy lacks (bfloat16, the float8 formats) as
    float32, which holds each of its values exactly."""
    host = tensor.detach().to("cpu")
    if host.is_floating_point() and host.dtype not in (torch.float16, torch.float32, torch.float64):
        host = host.to(torch.float32)
    return host.numpy()


def _kept_host(tensor: torch.Tensor) -> numpy.ndarray | None:
    kept = _kept_for(tensor)
    host = None if kept is None else kept.host
    return host[1] if host is not None and host[0] in (("own",), _stamp(tensor)) else None


def read_to_host(tensors: Iterable[torch.Tensor | None]) -> None:
    """Give every tensor of ``tensors`` its host copy (:func:`host_of`) in one device-to-host copy per device: the
    integer and bool tensors are read together, as one int64 buffer (a floating tensor is read on its own)."""
    _open_batch[0] = object()
    pending: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and _kept_host(tensor) is None and id(tensor) not in pending:
            pending[id(tensor)] = tensor
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in pending.values():
        if tensor.is_floating_point() or tensor.is_complex():
            _keep(tensor, _to_host(tensor), own=False, batch=True)
        else:
            by_device.setdefault(tensor.device, []).append(tensor)
    for group in by_device.values():
        if len(group) == 1:
            _keep(group[0], _to_host(group[0]), own=False, batch=True)
            continue
        buffer = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in group]).to("cpu").numpy()
        for tensor, values in zip(group, numpy.split(buffer, numpy.cumsum([t.numel() for t in group])[:-1])):
            dtype = numpy.dtype(str(tensor.dtype).removeprefix("torch."))
            _keep(tensor, values.astype(dtype).reshape(tuple(tensor.shape)), own=False, batch=True)
