"""Where a batch's :class:`~packfree_plugin.boundaries.Boundaries` come from: one constructor per source a forward may
carry (``cu_seqlens``, ``seq_idx``, ``position_ids``, a 2-D ``attention_mask``), each validating its source, and
:meth:`~BoundarySources.from_model_inputs`, which picks among them in the order of precedence of
:mod:`packfree_plugin.boundaries` and checks the others against the one it picked."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy
import torch

from .ids import id_starts, rows_of, shape_disagreement
from .messages import shown
from .store import host_of, kept_form

if TYPE_CHECKING:
    from .tiling import Boundaries

__all__ = ["BoundarySources"]


class BoundarySources:
    """The constructors of :class:`~packfree_plugin.boundaries.Boundaries` (its base: each builds ``cls``)."""

    __slots__ = ()

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
        """From ``position_ids [B, T]`` (or MRoPE ``[R, B, T]``) by the rule of :func:`.ids.id_starts`.

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
                    f"cu_seq_lens_k {shown(host_of(cu_seq_lens_k).tolist())} differs from cu_seq_lens_q "
                    f"{shown(host_of(cu_seq_lens_q).tolist())}: a packed batch for self-attention has the same "
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
            return cls.from_position_ids(rows_of(position_ids, batch_size, seq_len), device=device,
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
            boundaries._check_position_ids_agree(rows_of(position_ids, batch_size, seq_len), host_mask)
        return boundaries if host_mask is None else boundaries._with_padding(host_mask)

    # ---------------------------------------------------------------------------------- helpers
    def _check_position_ids_agree(self: Boundaries, position_ids: torch.Tensor,
                                  host_mask: numpy.ndarray | None) -> None:
        """``cu_seq_lens`` / ``seq_idx`` win over ``position_ids``, which may continue across a boundary they give;
        but a sample start that the ``position_ids`` show (a restart, on a kept token) must be one of theirs."""
        implied = type(self).from_position_ids(position_ids, device=self.device).offsets
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

    def _with_padding(self: Boundaries, host_mask: numpy.ndarray) -> Boundaries:
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
        return type(self)(
            self.offsets,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            device=self.device,
            padding=[kept == 0 for kept in kept_per_segment],
            cu_seqlens=kept_form(self, "cu_seqlens"),
        )


def _require_integer(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {tensor.dtype}; pass {name}.long()")


def _require_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but the inputs are on {device}; move it to {device}")


def _id_at(ids: numpy.ndarray, row: int, token: int) -> str:
    """The id of ``token`` in ``row`` of host ids ``[B, T]`` or ``[R, B, T]`` (every plane), for a message."""
    value = ids[..., row, token]
    return str(value.tolist())


def _check_mask_shape(attention_mask: torch.Tensor, batch_size: int, seq_len: int) -> None:
    if attention_mask.ndim != 2 or tuple(attention_mask.shape) != (batch_size, seq_len):
        raise ValueError(shape_disagreement("attention_mask", attention_mask, batch_size, seq_len,
                                            expected="a 2-D padding mask [B, T]"))


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
