"""The one boundary object: where each packed sample starts and ends.

A batch of ``B`` rows of ``T`` tokens is viewed as one flattened stream of ``B * T`` tokens, tiled by
contiguous *segments* that never cross a row. A segment is either a sample or a padding span (tokens
whose ``attention_mask`` is 0); padding spans are kept as segments of their own, so every token belongs
to exactly one segment and no sample ever sees a padding token or another sample.

``Boundaries`` is built once per forward (by :mod:`packfree_plugin.forward.reading`, from the model entry)
from whichever the batch carries, in this order:

1. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (+ ``max_length_q`` / ``max_length_k``), as sent by
   ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``;
2. ``seq_idx`` ``[B, T]``: the sample index of every token;
3. ``position_ids`` ``[B, T]``: **a sample starts at a row's first kept token and at every kept token whose
   id continues neither the previous kept token's id by 1 nor its position** (``id - previous id`` is neither
   1 nor the distance between the two tokens; tokens are kept where ``attention_mask`` is 1, all without one),
   so ids may run on across padding as ``arange`` or ``(cumsum(mask) - 1) * mask`` number them, and ids that
   restart or jump start a sample (:func:`id_starts`; TRL's padding-free collator sends only these ids).
   3-D multimodal (MRoPE) ids ``[R, B, T]``: with ``R == 4`` the first plane holds text positions and the
   rule above applies to it; otherwise a sample starts where all ``R`` components are 0 (vision tokens repeat
   and jump in some components, so the +1 rule would split inside an image);
4. a 2-D ``attention_mask`` ``[B, T]`` (ordinary padded batch): each row is one sample, its zeros are
   padding. A row whose ones are not contiguous is refused: packfree would have to guess its samples.

When a packed source (1-3) and an ``attention_mask`` are both given, each segment must be entirely
kept (1) or entirely padding (0); anything else contradicts the packing and raises ``ValueError``.

Host-side offsets are read once (one device-to-host copy of the source, :func:`host_of`: the batch
reader copies every boundary input and the labels in one go, :func:`read_to_host`); the device forms
(``cu_seqlens`` int32 ``[N+1]``, ``seq_idx`` int32 ``[B, T]``) are derived from them lazily and cached, each with
its host copy left on it, so any number of layers (and the ops' host-side paths) can ask for any form without
another device sync.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import numpy
import torch

__all__ = ["Boundaries", "Seq2SeqBoundaries", "close_batch", "host_of", "id_starts", "keep_host", "kept_form", "memo", "read_to_host"]

_Form = TypeVar("_Form")


def _require_integer(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {tensor.dtype}; pass {name}.long()")


def _require_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the inputs are on {device}; move it to {device}")


_MEMO_ATTR = "_packfree_memo"
_HOST_ATTR = "_packfree_host"
_open_batch: list[object | None] = [None]
"""The batch the model entry read (:func:`read_to_host`) and whose forward runs, until :func:`close_batch`: the stamp
of what is kept on the inference tensors it read. Only stored to at close, never read there, so a compiled forward
that closes its batch guards on nothing."""


def _stamp(tensor: torch.Tensor, *, own: bool = False) -> tuple:
    """What must stay unchanged for a value kept on ``tensor`` to hold: its version. An inference tensor has no
    version counter: a form the boundaries built (``own``), which nothing writes, holds for good; one the model entry
    read holds while its forward runs (:func:`read_to_host` to :func:`close_batch`); any other (an op called
    directly, a tensor read after its forward) holds for no later call, since an in-place write cannot be seen."""
    if not tensor.is_inference():
        return ("version", tensor._version)
    if own:
        return ("own",)
    batch = ("batch", _open_batch[0])
    kept = tensor.__dict__.get(_HOST_ATTR)
    return batch if batch[1] is not None and kept is not None and kept[0] == batch else ("unseen", object())


def close_batch() -> None:
    """End the batch the model entry read: what was kept on its inference tensors holds no longer (the caller may
    refill them in place before the next forward or a direct op call)."""
    _open_batch[0] = None


def memo(holder: Boundaries | torch.Tensor, name: Hashable, key: Hashable, build: Callable[[], _Form]) -> _Form:
    """``build()``, kept on ``holder`` under ``name`` while ``key`` stays what it was: the one cache of what packfree
    derives from boundaries, built once per forward rather than once per layer.

    ``holder`` is a :class:`Boundaries` (its device forms, the portable attention's sample groups), or a boundary
    tensor every layer of a forward passes (``seq_idx`` / ``cu_seqlens`` given to an op directly; the value is
    freed with it, and an in-place write, which bumps the tensor's version, makes it stale; on an inference tensor,
    which has no version, it holds only inside the forward whose entry read that tensor: :func:`_stamp`). One value
    per name: a call with another ``key`` (a new chunk size, dtype or length) builds and keeps its own in place of
    the old. A ``build`` that raises keeps nothing."""
    # a value built under inference_mode is an inference tensor, which autograd refuses to save: never reuse one
    # outside that mode (a model evaluated under inference_mode, then trained on the same position_ids)
    inference = torch.is_inference_mode_enabled()
    if isinstance(holder, Boundaries):
        store, stamp = holder._device_forms, (key, inference)
    else:
        store, stamp = holder.__dict__.setdefault(_MEMO_ATTR, {}), (key, inference, _stamp(holder))
    entry = store.get(name)
    if entry is None or entry[0] != stamp:
        entry = store[name] = (stamp, build())
    return entry[1]


def kept_form(holder: Boundaries, name: Hashable) -> Any:
    """What :func:`memo` keeps on ``holder`` under ``name``, or None."""
    entry = holder._device_forms.get(name)
    return None if entry is None else entry[1]


def keep_host(tensor: torch.Tensor, values: numpy.ndarray) -> torch.Tensor:
    """Leave ``values`` (``tensor``'s own, already on the host: the boundaries built them there) on ``tensor`` for
    :func:`host_of`, read-only; returns ``tensor``."""
    return _keep(tensor, values, own=True)


def _keep(tensor: torch.Tensor, values: numpy.ndarray, *, own: bool, batch: bool = False) -> torch.Tensor:
    """Leave ``values`` on ``tensor``; ``batch``: the model entry read it for the batch now open."""
    values.flags.writeable = False
    stamp = ("batch", _open_batch[0]) if batch and tensor.is_inference() else _stamp(tensor, own=own)
    tensor.__dict__[_HOST_ATTR] = (stamp, values)
    return tensor


def host_of(tensor: torch.Tensor) -> numpy.ndarray:
    """``tensor``'s values as a read-only host array of its shape: the copy left on it (:func:`keep_host`,
    :func:`read_to_host`), else read now (one device-to-host copy) and kept."""
    kept = _kept_host(tensor)
    if kept is None:
        kept = tensor.detach().to("cpu").numpy()
        _keep(tensor, kept, own=False)
    return kept


def _kept_host(tensor: torch.Tensor) -> numpy.ndarray | None:
    kept = tensor.__dict__.get(_HOST_ATTR)
    return kept[1] if kept is not None and kept[0] in (("own",), _stamp(tensor)) else None


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
            _keep(tensor, tensor.detach().to("cpu").numpy(), own=False, batch=True)
        else:
            by_device.setdefault(tensor.device, []).append(tensor)
    for group in by_device.values():
        if len(group) == 1:
            _keep(group[0], group[0].detach().to("cpu").numpy(), own=False, batch=True)
            continue
        buffer = torch.cat([t.detach().reshape(-1).to(torch.int64) for t in group]).to("cpu").numpy()
        for tensor, values in zip(group, numpy.split(buffer, numpy.cumsum([t.numel() for t in group])[:-1])):
            dtype = numpy.dtype(str(tensor.dtype).removeprefix("torch."))
            _keep(tensor, values.astype(dtype).reshape(tuple(tensor.shape)), own=False, batch=True)


class Boundaries:
    """Segments tiling a ``[B, T]`` batch; see the module docstring for how they are read.

    Attributes:
        batch_size: ``B``.
        seq_len: ``T``, tokens per row.
        offsets: host tuple of ``N + 1`` segment offsets over the flattened ``B * T`` tokens
            (``offsets[0] == 0``, strictly increasing, ``offsets[-1] == B * T``, every row start
            ``k * T`` is an offset).
        padding: host tuple of ``N`` flags, True where the segment is a padding span.
        device: device of the data the segments describe.
    """

    __slots__ = ("batch_size", "seq_len", "offsets", "padding", "device", "lengths", "max_seqlen", "is_packed",
                 "has_padding", "host_offsets", "host_padding", "_rows", "_device_forms", "sequence_shard",
                 "callers_position_ids")

    def __init__(
        self,
        offsets: Sequence[int],
        *,
        batch_size: int,
        seq_len: int,
        device: torch.device | str,
        padding: Sequence[bool] | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> None:
        """Validate host ``offsets`` (see class docstring). ``cu_seqlens``: optional device copy to reuse."""
        offsets = tuple(map(int, offsets))
        total = batch_size * seq_len
        if len(offsets) < 2 or offsets[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0 and hold at least 2 entries, got {list(offsets[:8])}; "
                             "pass the running sum of the sample lengths with a leading 0, e.g. [0, 5, 12]")
        if offsets[-1] != total:
            raise ValueError(
                f"cu_seqlens must end at the number of tokens {total} (B={batch_size} x T={seq_len}), got "
                f"{offsets[-1]} in {_shown(offsets)}: sample lengths do not sum to the rows. cu_seqlens count over "
                f"the flattened B * T tokens, padding included{_layout_hint(offsets, batch_size, seq_len)}"
            )
        lengths = tuple(b - a for a, b in zip(offsets, offsets[1:]))
        if min(lengths) <= 0:
            i = next(i for i, length in enumerate(lengths, 1) if length <= 0)
            if offsets[i] < offsets[i - 1]:
                raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets[i - 1]} then {offsets[i]} at index "
                                 f"{i} of {_shown(offsets)}; pass the running sum of the sample lengths")
            raise ValueError(
                f"cu_seqlens {_shown(offsets)} hold a zero-length sample at index {i - 1} (offset {offsets[i]} "
                "repeated): a sample of no tokens has no place in a packed row. Drop empty samples before packing "
                f"(or drop the repeated offset: {_shown(sorted(set(offsets)))})"
            )
        missing_row_starts = sorted(set(range(0, total, seq_len)).difference(offsets)) if batch_size > 1 else ()
        if missing_row_starts:
            raise ValueError(
                f"a segment of cu_seqlens {_shown(offsets)} crosses a row boundary: rows start at multiples of "
                f"T={seq_len}, and cu_seqlens lack {missing_row_starts[:4]}. End every row's last sample (or its "
                f"padding span) at the row's end{_layout_hint(offsets, batch_size, seq_len)}"
            )
        padding = tuple(bool(p) for p in padding) if padding is not None else (False,) * (len(offsets) - 1)
        if len(padding) != len(offsets) - 1:
            raise ValueError(f"padding holds {len(padding)} flags for {len(offsets) - 1} segments")
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.offsets = offsets
        self.padding = padding
        self.device = torch.device(device)
        self.lengths: tuple[int, ...] = lengths
        """Host tuple of ``N`` segment lengths."""
        self.max_seqlen: int = max(self.lengths)
        """Longest segment, as a host int (what varlen kernels call ``max_seqlen``)."""
        samples_per_row = [0] * batch_size
        for start, pad in zip(offsets, padding):
            samples_per_row[start // seq_len] += not pad
        self.is_packed: bool = max(samples_per_row) > 1
        """True when some row holds more than one sample (padding spans do not count)."""
        self.has_padding: bool = any(padding)
        self.host_offsets = torch.from_numpy(numpy.array(offsets, dtype=numpy.int64))
        """``[N+1]`` int64 on the CPU: the offsets as a tensor (what compiled graphs receive; built here, outside
        any graph, so that a graph takes it as data)."""
        self.host_padding = torch.from_numpy(numpy.array(padding, dtype=bool))
        """``[N]`` bool on the CPU: the padding flags as a tensor."""
        self._rows = torch.empty(batch_size, seq_len, 0)  # holds no data: its shape is what compiled code compares
        # Device forms and what consumers derive from them, built on first use and kept by memo() (a plain dict,
        # not functools.cached_property, whose lock torch.compile cannot trace).
        self._device_forms: dict[Hashable, tuple[Hashable, Any]] = {}
        # the parallel.shard.SequenceShard these describe a shard of, if any: a plain attribute, not a memo entry
        # (compiled graphs guard on it, and memo dicts grow with every packing)
        self.sequence_shard: Any = None
        self.callers_position_ids: torch.Tensor | None = None
        """The ``position_ids`` the caller passed with the batch these describe (set by the model hook; None: none
        passed), which models that number positions themselves honour (:mod:`packfree_plugin.quirks.positions`)."""
        if cu_seqlens is not None:
            form = cu_seqlens.to(dtype=torch.int32)
            memo(self, "cu_seqlens", None, lambda: form if form is cu_seqlens else keep_host(
                form, numpy.array(offsets, dtype=numpy.int32)))

    def describes(self, batch_size: int, seq_len: int) -> bool:
        """Whether these segments tile a ``[batch_size, seq_len]`` batch. Compiled code calls this with symbolic
        sizes: it compares them with the shape of a data-free ``[B, T, 0]`` tensor, not with the ints, so a
        graph does not specialise on one row length."""
        return tuple(self._rows.shape[:2]) == (batch_size, seq_len)

    def __getitem__(self, index: Any) -> Boundaries:
        """Model code that indexes the mask it is handed as ``[B, 1, Tq, Tk]`` (Gemma 4's KV-shared layers keep the last
        ``logits_to_keep`` queries: ``mask[:, :, slice(-keep, None), :]``) gets these boundaries back when the index
        keeps every token (``slice(0, None)``, as in training). A real cut of a packed row raises: its queries would
        leave the samples the boundaries describe. (Unpacked batches of such models get stock's mask tensors:
        :func:`packfree_plugin.forward.unpacked.slices_its_mask`.)"""
        parts = index if isinstance(index, tuple) else (index,)
        if all(part is Ellipsis or (isinstance(part, slice) and part.start in (None, 0) and part.stop is None
                                    and part.step in (None, 1)) for part in parts):
            return self
        raise ValueError(
            f"the model cuts packfree's attention mask (the packed boundaries) with [{', '.join(map(repr, parts))}] "
            "(e.g. Gemma 4's KV-shared layers with logits_to_keep > 0), which would take queries out of their packed "
            "samples. Call a packed row with logits_to_keep=0 (the default), or pass one sample per row"
        )

    @property
    def num_segments(self) -> int:
        """``N``: samples and padding spans."""
        return len(self.offsets) - 1

    # ------------------------------------------------------------------------------- device forms
    def _per_token(self, values: numpy.ndarray) -> torch.Tensor:
        """Host ``[N]`` per-segment values -> ``[B, T]`` per-token values on :attr:`device` (numpy on the host: a
        quarter of torch's per-call cost, and every layer of a short row waits for these)."""
        per_token = numpy.repeat(values, self.lengths).reshape(self.batch_size, self.seq_len)
        return keep_host(torch.from_numpy(per_token).to(self.device), per_token)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[N+1]`` int32 on :attr:`device`: segment offsets over the flattened ``B * T`` tokens."""
        def build() -> torch.Tensor:
            host = numpy.array(self.offsets, dtype=numpy.int32)
            return keep_host(torch.from_numpy(host).to(self.device), host)

        return memo(self, "cu_seqlens", None, build)

    @property
    def seq_idx(self) -> torch.Tensor:
        """``[B, T]`` int32 on :attr:`device`: index of the segment of every token (non-decreasing)."""
        return memo(self, "seq_idx", None,
                    lambda: self._per_token(numpy.arange(self.num_segments, dtype=numpy.int32)))

    @property
    def position_ids(self) -> torch.Tensor:
        """``[B, T]`` int64 on :attr:`device`: position of every token inside its segment."""
        def build() -> torch.Tensor:
            starts = numpy.repeat(numpy.array(self.offsets[:-1], dtype=numpy.int64), self.lengths)
            positions = (numpy.arange(self.batch_size * self.seq_len, dtype=numpy.int64) - starts).reshape(
                self.batch_size, self.seq_len)
            return keep_host(torch.from_numpy(positions).to(self.device), positions)

        return memo(self, "position_ids", None, build)

    @property
    def padding_tokens(self) -> torch.Tensor:
        """``[B, T]`` bool on :attr:`device`: True on tokens of padding segments."""
        return memo(self, "padding_tokens", None, lambda: self._per_token(numpy.array(self.padding, dtype=bool)))

    def __repr__(self) -> str:
        return (
            f"Boundaries(B={self.batch_size}, T={self.seq_len}, segments={self.num_segments}, "
            f"padding_spans={sum(self.padding)}, max_seqlen={self.max_seqlen}, device={self.device})"
        )

    # ------------------------------------------------------------------------------ constructors
    @classmethod
    def from_cu_seqlens(
        cls,
        cu_seqlens: torch.Tensor,
        *,
        batch_size: int,
        seq_len: int,
        device: torch.device | str | None = None,
        max_seqlen: int | torch.Tensor | None = None,
    ) -> Boundaries:
        """From ``cu_seqlens [N+1]`` over the flattened ``B * T`` tokens (the collator's ``cu_seq_lens_q``)."""
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1:
            shape = tuple(cu_seqlens.shape) if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__
            raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1], got {shape}")
        _require_integer("cu_seqlens", cu_seqlens)
        device = torch.device(device) if device is not None else cu_seqlens.device
        _require_device("cu_seqlens", cu_seqlens, device)
        boundaries = cls(
            host_of(cu_seqlens).tolist(), batch_size=batch_size, seq_len=seq_len, device=device, cu_seqlens=cu_seqlens
        )
        longest = boundaries.max_seqlen
        if max_seqlen is not None and _as_int(max_seqlen) < longest:  # an upper bound, as flash-attn reads it
            raise ValueError(
                f"max_length {_as_int(max_seqlen)} contradicts cu_seqlens, whose longest segment is {longest}; "
                f"pass max_length_q = max_length_k = {longest}, or leave them out"
            )
        return boundaries

    @classmethod
    def from_starts(cls, starts: torch.Tensor | numpy.ndarray, *, device: torch.device | str) -> Boundaries:
        """From a bool ``[B, T]`` tensor or host array that is True at the first token of every segment."""
        batch_size, seq_len = starts.shape
        starts = numpy.array(host_of(starts) if isinstance(starts, torch.Tensor) else starts, dtype=bool)
        starts[:, 0] = True
        offsets = numpy.flatnonzero(starts).tolist() + [batch_size * seq_len]
        return cls(offsets, batch_size=batch_size, seq_len=seq_len, device=device)

    @classmethod
    def from_seq_idx(cls, seq_idx: torch.Tensor, *, device: torch.device | str | None = None) -> Boundaries:
        """From ``seq_idx [B, T]``: a segment starts wherever the index changes. Must be non-decreasing per row."""
        if seq_idx.ndim != 2:
            raise ValueError(f"seq_idx must be [B, T], got shape {tuple(seq_idx.shape)}")
        _require_integer("seq_idx", seq_idx)
        device = torch.device(device) if device is not None else seq_idx.device
        _require_device("seq_idx", seq_idx, device)
        host = host_of(seq_idx).astype(numpy.int64)
        step = host[:, 1:] - host[:, :-1]
        if (step < 0).any():
            row, col = numpy.argwhere(step < 0)[0].tolist()
            raise ValueError(
                f"seq_idx must be non-decreasing along each row; row {row} goes from "
                f"{host[row, col]} to {host[row, col + 1]} at token {col + 1}. Number each row's "
                "samples in order (0, 0, 1, 1, 1, 2, ...)"
            )
        starts = numpy.zeros(host.shape, dtype=bool)
        starts[:, 1:] = step != 0
        return cls.from_starts(starts, device=device)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, *, device: torch.device | str | None = None,
                          attention_mask: torch.Tensor | None = None) -> Boundaries:
        """From ``position_ids [B, T]`` (or MRoPE ``[R, B, T]``) by the rule in the module docstring.

        With a 2-D ``attention_mask`` (1 = token, 0 = padding), padding tokens form spans of their own and the
        rule runs over each row's kept tokens: a kept token right after padding whose id continues the kept token
        before it (by 1, as ``(cumsum(mask) - 1) * mask`` ids do, or by the distance, as ``arange`` ids do) would
        make one sample with a hole in it, which packfree cannot run exactly, and raises."""
        if not position_ids.is_floating_point():  # float ids are read by the same rule, as stock reads them
            _require_integer("position_ids", position_ids)
        device = torch.device(device) if device is not None else position_ids.device
        _require_device("position_ids", position_ids, device)
        host = host_of(position_ids).astype(numpy.float64 if position_ids.is_floating_point() else numpy.int64)
        if host.ndim == 3 and host.shape[0] == 4:
            host = host[0]
        if host.ndim not in (2, 3):
            raise ValueError(f"position_ids must be [B, T] or [R, B, T], got shape {tuple(position_ids.shape)}")
        if attention_mask is None:  # every token kept: one vectorised pass on the host
            starts = id_starts(host, planes=host.ndim == 3)
            starts[:, 0] = True
            batch_size, seq_len = starts.shape
            offsets = starts.ravel().nonzero()[0].tolist() + [batch_size * seq_len]
            return cls(offsets, batch_size=batch_size, seq_len=seq_len, device=device)
        kept = _host_padding_mask(attention_mask)
        starts = numpy.zeros(host.shape[-2:], dtype=bool)
        for row in range(starts.shape[0]):
            tokens = numpy.flatnonzero(kept[row])
            row_starts = id_starts(host[..., row, tokens], planes=host.ndim == 3, tokens=tokens)
            after_gap = numpy.zeros_like(row_starts)
            after_gap[1:] = tokens[1:] > tokens[:-1] + 1
            holes = numpy.flatnonzero(after_gap & ~row_starts)
            if len(holes):
                token, before = int(tokens[holes[0]]), int(tokens[holes[0] - 1])
                raise ValueError(
                    f"attention_mask has padding inside a sample (row {row}, tokens {before + 1}..{token - 1}): the "
                    f"position_ids continue across it ({_id_at(host, row, before)} at token {before}, "
                    f"{_id_at(host, row, token)} at token {token}). packfree cannot leave a hole in a packed sample; "
                    "drop the padding tokens from the row, or restart the position ids at 0 after it if a new "
                    "sample starts there"
                )
            starts[row, tokens] = row_starts
        starts[:, 1:] |= kept[:, 1:] != kept[:, :-1]  # padding spans are segments of their own
        return cls.from_starts(starts, device=device)._with_padding(kept)

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor, *, device: torch.device | str | None = None) -> Boundaries:
        """From a 2-D padding mask ``[B, T]`` (1 = token, 0 = padding): one sample per row."""
        host = _host_padding_mask(attention_mask)
        device = torch.device(device) if device is not None else attention_mask.device
        starts = numpy.zeros_like(host)
        starts[:, 1:] = host[:, 1:] != host[:, :-1]
        runs_of_ones = (starts & host).sum(axis=1) + host[:, 0]
        bad_rows = numpy.flatnonzero(runs_of_ones > 1).tolist()
        if bad_rows:
            raise ValueError(
                f"attention_mask row {bad_rows[0]} has a gap (a 0 between 1s): packfree reads a 2-D attention_mask "
                "as one padded sample per row; pass position_ids, seq_idx or cu_seq_lens_q to describe packed samples"
            )
        boundaries = cls.from_starts(starts, device=device)
        return boundaries._with_padding(host)

    @classmethod
    def from_model_inputs(
        cls,
        *,
        batch_size: int,
        seq_len: int,
        device: torch.device | str,
        cu_seq_lens_q: torch.Tensor | None = None,
        cu_seq_lens_k: torch.Tensor | None = None,
        max_length_q: int | torch.Tensor | None = None,
        max_length_k: int | torch.Tensor | None = None,
        seq_idx: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> Boundaries:
        """Build from whatever a forward call carries, in the documented order of precedence."""
        device = torch.device(device)
        if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
            if cu_seq_lens_q is None or cu_seq_lens_k is None:
                given = "cu_seq_lens_q" if cu_seq_lens_q is not None else "cu_seq_lens_k"
                raise ValueError(f"only {given} was passed; pass the same tensor as both cu_seq_lens_q and "
                                 "cu_seq_lens_k (packfree packs self-attention rows)")
            _require_device("cu_seq_lens_q", cu_seq_lens_q, device)
            _require_device("cu_seq_lens_k", cu_seq_lens_k, device)
            if cu_seq_lens_k is not cu_seq_lens_q and not numpy.array_equal(host_of(cu_seq_lens_q),
                                                                            host_of(cu_seq_lens_k)):
                raise ValueError(
                    f"cu_seq_lens_k {_shown(host_of(cu_seq_lens_k).tolist())} differs from cu_seq_lens_q "
                    f"{_shown(host_of(cu_seq_lens_q).tolist())}: a packed batch for self-attention has the same "
                    "boundaries for queries and keys; pass the same tensor as both"
                )
            if max_length_q is not None and max_length_k is not None and \
                    _as_int(max_length_q) != _as_int(max_length_k):
                raise ValueError(f"max_length_q={_as_int(max_length_q)} differs from "
                                 f"max_length_k={_as_int(max_length_k)}; "
                                 "pass the longest sample's length as both")
            boundaries = cls.from_cu_seqlens(
                cu_seq_lens_q, batch_size=batch_size, seq_len=seq_len, device=device, max_seqlen=max_length_q
            )
        elif seq_idx is not None:
            if tuple(seq_idx.shape) != (batch_size, seq_len):
                raise ValueError(shape_disagreement("seq_idx", seq_idx, batch_size, seq_len))
            boundaries = cls.from_seq_idx(seq_idx, device=device)
        elif position_ids is not None:
            if attention_mask is not None:
                _check_mask_shape(attention_mask, batch_size, seq_len)
            return cls.from_position_ids(_rows_of(position_ids, batch_size, seq_len), device=device,
                                         attention_mask=attention_mask)
        elif attention_mask is not None:
            _check_mask_shape(attention_mask, batch_size, seq_len)
            return cls.from_attention_mask(attention_mask, device=device)
        else:
            return cls(range(0, batch_size * seq_len + 1, seq_len), batch_size=batch_size, seq_len=seq_len, device=device)
        host_mask = None
        if attention_mask is not None:
            _check_mask_shape(attention_mask, batch_size, seq_len)
            host_mask = _host_padding_mask(attention_mask)
        if position_ids is not None and (cu_seq_lens_q is not None or seq_idx is not None):
            boundaries._check_position_ids_agree(_rows_of(position_ids, batch_size, seq_len), host_mask)
        return boundaries if host_mask is None else boundaries._with_padding(host_mask)

    # ---------------------------------------------------------------------------------- helpers
    def _check_position_ids_agree(self, position_ids: torch.Tensor, host_mask: numpy.ndarray | None) -> None:
        """``cu_seq_lens`` / ``seq_idx`` win over ``position_ids``, which may continue across a boundary they give;
        but a sample start that the ``position_ids`` show (a restart, on a kept token) must be one of theirs."""
        implied = Boundaries.from_position_ids(position_ids, device=self.device).offsets
        kept = host_mask.reshape(-1) if host_mask is not None else None
        given = set(self.offsets)
        extra = [o for o in implied[:-1] if o not in given and (kept is None or bool(kept[o]))]
        if extra:
            token = extra[0]
            raise ValueError(
                f"position_ids contradict the packed boundaries: they start a new sample at token {token % self.seq_len}"
                f" of row {token // self.seq_len}, where cu_seq_lens / seq_idx continue one; pass boundaries and "
                "position_ids built from the same packing"
            )

    def _with_padding(self, host_mask: numpy.ndarray) -> Boundaries:
        """Mark segments whose tokens are all 0 in host bool ``host_mask [B, T]`` as padding; refuse mixed segments."""
        kept_per_segment = numpy.add.reduceat(host_mask.reshape(-1).astype(numpy.int64), self.offsets[:-1]).tolist()
        for index, (kept, length) in enumerate(zip(kept_per_segment, self.lengths)):
            if 0 < kept < length:
                start = self.offsets[index]
                raise ValueError(
                    f"attention_mask contradicts the packed boundaries: segment {index} (tokens {start}..{start + length - 1}"
                    f" of the flattened batch) is partly masked ({kept} of {length} tokens kept); a packed sample "
                    "must be entirely kept or entirely padding. Make each padding span a segment of its own in "
                    "cu_seq_lens / seq_idx, or drop the attention_mask"
                )
        return Boundaries(
            self.offsets,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            device=self.device,
            padding=[kept == 0 for kept in kept_per_segment],
            cu_seqlens=kept_form(self, "cu_seqlens"),
        )


def id_starts(ids: numpy.ndarray, *, planes: bool, tokens: numpy.ndarray | None = None) -> numpy.ndarray:
    """The one rule for where a sample starts by its position ids (docs/input-contract.md), along the last axis of
    host ids ``[..., L]`` of a row's kept tokens, at token indices ``tokens [L]`` (None: ``0..L-1``, every token
    kept): at the first token, and at every token whose id continues the previous token's neither by 1 nor by the
    distance between them (ids that run on across padding, as ``arange`` numbers a padded row, continue). With
    ``planes`` the first axis holds MRoPE planes without a text plane and a sample starts where every plane is 0
    (that axis is dropped). Bool ``[..., L]``. (numpy: a quarter of torch's per-call overhead.)"""
    if planes:
        return (ids == 0).all(axis=0)
    starts = numpy.empty(ids.shape, dtype=bool)
    starts[..., :1] = True
    step = ids[..., 1:] - ids[..., :-1]
    numpy.not_equal(step, 1, out=starts[..., 1:])
    if tokens is not None:
        starts[..., 1:] &= step != numpy.diff(tokens)
    return starts


def _shown(offsets: Sequence[int]) -> str:
    """Offsets for a message: the first 12 of them."""
    offsets = list(offsets)
    return str(offsets) if len(offsets) <= 12 else f"[{', '.join(map(str, offsets[:12]))}, ...]"


def _layout_hint(offsets: Sequence[int], batch_size: int, seq_len: int) -> str:
    """The ``cu_seqlens`` a ``[batch_size, seq_len]`` batch expects, for a message: rows start at multiples of
    ``seq_len`` and each row's padding is a segment of its own; with the lengths of ``offsets`` laid out row after
    row (a cumsum that skipped each row's padding), the offsets that layout gives, when it fits."""
    rows: list[list[int]] = [[]]
    for length in (b - a for a, b in zip(offsets, offsets[1:])):
        if length <= 0 or length > seq_len:
            rows = []
            break
        if sum(rows[-1]) + length > seq_len:
            rows.append([])
        rows[-1].append(length)
    if len(rows) != batch_size:
        return (f": each row's padding is a segment of its own, and rows start at multiples of T={seq_len}"
                if batch_size > 1 else f": a padding tail is a segment of its own, ending at T={seq_len}")
    expected = [0]
    for row in rows:
        for length in row + ([seq_len - sum(row)] if sum(row) < seq_len else []):
            expected.append(expected[-1] + length)
    return (f": for these samples laid out row by row, each row's padding a segment of its own (marked 0 in "
            f"attention_mask), pass cu_seq_lens_q = cu_seq_lens_k = {_shown(expected)}")


def _id_at(ids: numpy.ndarray, row: int, token: int) -> str:
    """The id of ``token`` in ``row`` of host ids ``[B, T]`` or ``[R, B, T]`` (every plane), for a message."""
    value = ids[..., row, token]
    return str(value.tolist())


def _rows_of(position_ids: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    """``position_ids`` ``[B, T]`` (or ``[R, B, T]``), a batch of 1 broadcast to ``B``; other shapes raise."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim not in (2, 3) or \
            position_ids.shape[-1] != seq_len or position_ids.shape[-2] not in (1, batch_size):
        raise ValueError(shape_disagreement("position_ids", position_ids, batch_size, seq_len,
                                            expected="[B, T], [1, T] or [R, B, T] (MRoPE)"))
    if position_ids.shape[-2] == batch_size:
        return position_ids
    return position_ids.expand(*position_ids.shape[:-2], batch_size, seq_len)


def _check_mask_shape(attention_mask: torch.Tensor, batch_size: int, seq_len: int) -> None:
    if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch_size, seq_len):
        raise ValueError(shape_disagreement("attention_mask", attention_mask, batch_size, seq_len,
                                            expected="a 2-D padding mask [B, T]"))


def shape_disagreement(name: str, value: Any, batch_size: int, seq_len: int, *, expected: str = "[B, T]") -> str:
    """The message for a per-token input ``name`` whose shape disagrees with the tokens' ``[batch_size, seq_len]``:
    both shapes, the likely cause and the fix."""
    shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    cause = ""
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[-1] != seq_len:
        cause = (f" Its last dimension holds {value.shape[-1]} tokens, the rows {seq_len}: padded (or truncated) "
                 "apart from input_ids, e.g. a collator's pad_to_multiple_of applied to some fields only.")
    elif isinstance(value, torch.Tensor) and value.ndim == 1:
        cause = f" A 1-D tensor gives no rows; pass it as [1, {seq_len}] or [{batch_size}, {seq_len}]."
    return (f"{name} has shape {shape} but the tokens (input_ids or inputs_embeds) are [B={batch_size}, T={seq_len}]"
            f"; {name} must be {expected}.{cause} Build every per-token field of the batch with the same padding")


def _as_int(value: int | torch.Tensor) -> int:
    """An int given as an int or a one-element tensor (``max_length_q`` / ``_k``), read through its host copy."""
    return int(host_of(value).reshape(-1)[0]) if isinstance(value, torch.Tensor) else int(value)


def _host_padding_mask(attention_mask: torch.Tensor) -> numpy.ndarray:
    """``[B, T]`` mask of 0/1 (any dtype) -> host bool array; other values raise."""
    if attention_mask.ndim != 2:
        raise ValueError(f"attention_mask must be 2-D [B, T], got shape {tuple(attention_mask.shape)}")
    host = host_of(attention_mask)
    if host.dtype != bool:
        bad = ~((host == 0) | (host == 1))
        if bad.any():
            value = host[bad][0].item()
            raise ValueError(
                f"attention_mask must hold only 0 and 1, found {value}; describe packed samples with position_ids, "
                "seq_idx or cu_seq_lens_q"
            )
        host = host == 1
    return host


class Seq2SeqBoundaries:
    """The two sides of a packed seq2seq forward: the encoder's rows ``[B, Te]`` and the decoder's ``[B, Td]``, each
    tiled by its own :class:`Boundaries`, and which encoder sample each decoder sample reads. Row ``i``'s ``k``-th
    decoder sample reads row ``i``'s ``k``-th encoder sample (padding spans do not count on either side).

    Built once per forward by the model entry (:mod:`.forward.encoder_decoder`), which attaches it to both sides
    (:meth:`of` reads it back): the decoder runs on ``decoder``, and its cross-attention receives this object as its
    mask, the way self-attention receives a :class:`Boundaries`.

    Attributes:
        encoder, decoder: the two sides' boundaries (same ``B``).
        pairs: host tuple of ``(decoder_start, decoder_length, encoder_start, encoder_length)``, one per decoder
            sample, offsets over the flattened ``B * Td`` and ``B * Te`` tokens.
    """

    __slots__ = ("encoder", "decoder", "pairs")
    _FORM = "seq2seq"

    def __init__(self, encoder: Boundaries, decoder: Boundaries) -> None:
        """Pair the samples of ``encoder`` and ``decoder`` row by row; a row whose sides hold different numbers of
        samples raises ``ValueError``."""
        if encoder.batch_size != decoder.batch_size:
            raise ValueError(f"the encoder has {encoder.batch_size} rows but the decoder {decoder.batch_size}")
        encoder_rows, decoder_rows = _samples_by_row(encoder), _samples_by_row(decoder)
        pairs = []
        for row, (sources, targets) in enumerate(zip(encoder_rows, decoder_rows)):
            if len(sources) != len(targets):
                raise ValueError(
                    f"row {row} packs {len(sources)} encoder samples but {len(targets)} decoder samples; a packed "
                    "seq2seq row pairs its k-th encoder sample with its k-th decoder sample. Pack the same samples on "
                    "both sides (decoder_position_ids restarting at 0 where each target starts, padding marked by "
                    "decoder_attention_mask)"
                )
            pairs += [(*target, *source) for source, target in zip(sources, targets)]
        self.encoder = encoder
        self.decoder = decoder
        self.pairs: tuple[tuple[int, int, int, int], ...] = tuple(pairs)

    def attach(self) -> Seq2SeqBoundaries:
        """Make :meth:`of` find this pairing from either side's boundaries; returns self."""
        for side in (self.encoder, self.decoder):
            memo(side, self._FORM, None, lambda: self)
        return self

    @classmethod
    def of(cls, boundaries: Boundaries | None) -> Seq2SeqBoundaries | None:
        """The pairing ``boundaries`` belong to (as encoder or decoder), None when they belong to none."""
        return None if boundaries is None else kept_form(boundaries, cls._FORM)

    def __repr__(self) -> str:
        return f"Seq2SeqBoundaries(encoder={self.encoder!r}, decoder={self.decoder!r})"


def _samples_by_row(boundaries: Boundaries) -> list[list[tuple[int, int]]]:
    """``(start, length)`` of every sample (padding spans left out), row by row."""
    rows: list[list[tuple[int, int]]] = [[] for _ in range(boundaries.batch_size)]
    for start, length, pad in zip(boundaries.offsets, boundaries.lengths, boundaries.padding):
        if not pad:
            rows[start // boundaries.seq_len].append((start, length))
    return rows
