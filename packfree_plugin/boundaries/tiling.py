"""The one boundary object: :class:`Boundaries`, the segments tiling a ``[B, T]`` batch, its offsets validated once,
and its device forms (``cu_seqlens``, ``seq_idx``, ``position_ids``, ``padding_tokens``) built on first use and kept
on it for the rest of the forward. How a batch's inputs become one: :mod:`.sources`."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy
import torch

from .forms import position_ids_of, seq_idx_of
from .messages import layout_hint, shown
from .sources import BoundarySources
from .store import host_of, keep_host, memo

__all__ = ["Boundaries"]


class Boundaries(BoundarySources):
    """Segments tiling a ``[B, T]`` batch; see :mod:`packfree_plugin.boundaries` for how they are read.

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
        """Validate host ``offsets`` (see class docstring). ``cu_seqlens``: optional device copy to reuse (int32: the
        form itself; another dtype is built again from the offsets)."""
        offsets = tuple(map(int, offsets))
        total = batch_size * seq_len
        if len(offsets) < 2 or offsets[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0 and hold at least 2 entries, got {list(offsets[:8])}; "
                             "pass the running sum of the sample lengths with a leading 0, e.g. [0, 5, 12]")
        if offsets[-1] != total:
            raise ValueError(
                f"cu_seqlens must end at the number of tokens {total} (B={batch_size} x T={seq_len}), got "
                f"{offsets[-1]} in {shown(offsets)}: sample lengths do not sum to the rows. cu_seqlens count over "
                f"the flattened B * T tokens, padding included{layout_hint(offsets, batch_size, seq_len)}"
            )
        lengths = tuple(b - a for a, b in zip(offsets, offsets[1:]))
        if min(lengths) <= 0:
            i = next(i for i, length in enumerate(lengths, 1) if length <= 0)
            if offsets[i] < offsets[i - 1]:
                raise ValueError(f"cu_seqlens must be non-decreasing, got {offsets[i - 1]} then {offsets[i]} at index "
                                 f"{i} of {shown(offsets)}; pass the running sum of the sample lengths")
            raise ValueError(
                f"cu_seqlens {shown(offsets)} hold a zero-length sample at index {i - 1} (offset {offsets[i]} "
                "repeated): a sample of no tokens has no place in a packed row. Drop empty samples before packing "
                f"(or drop the repeated offset: {shown(sorted(set(offsets)))})"
            )
        missing_row_starts = sorted(set(range(0, total, seq_len)).difference(offsets)) if batch_size > 1 else ()
        if missing_row_starts:
            raise ValueError(
                f"a segment of cu_seqlens {shown(offsets)} crosses a row boundary: rows start at multiples of "
                f"T={seq_len}, and cu_seqlens lack {missing_row_starts[:4]}. End every row's last sample (or its "
                f"padding span) at the row's end{layout_hint(offsets, batch_size, seq_len)}"
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
        if cu_seqlens is not None and cu_seqlens.dtype == torch.int32:
            memo(self, "cu_seqlens", None, lambda: cu_seqlens)

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
    def _per_token(self, build: Callable[..., torch.Tensor], dtype: type) -> torch.Tensor:
        """``[B, T]`` of ``dtype`` on :attr:`device`: the per-token form ``build`` (:mod:`.forms`) makes of the host
        offsets, written into a host array packfree owns (nothing is read back), which is kept as its host copy."""
        host = numpy.empty((self.batch_size, self.seq_len), dtype=dtype)
        build(self.host_offsets, self.batch_size * self.seq_len, out=torch.from_numpy(host).view(-1))
        return keep_host(torch.from_numpy(host).to(self.device), host)

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
        return memo(self, "seq_idx", None, lambda: self._per_token(seq_idx_of, numpy.int32))

    @property
    def position_ids(self) -> torch.Tensor:
        """``[B, T]`` int64 on :attr:`device`: position of every token inside its segment."""
        return memo(self, "position_ids", None, lambda: self._per_token(position_ids_of, numpy.int64))

    @property
    def padding_tokens(self) -> torch.Tensor:
        """``[B, T]`` bool on :attr:`device`: True on tokens of padding segments."""
        def build() -> torch.Tensor:
            per_token = numpy.array(self.padding, dtype=bool)[host_of(self.seq_idx)]
            return keep_host(torch.from_numpy(per_token).to(self.device), per_token)

        return memo(self, "padding_tokens", None, build)

    def __repr__(self) -> str:
        return (
            f"Boundaries(B={self.batch_size}, T={self.seq_len}, segments={self.num_segments}, "
            f"padding_spans={sum(self.padding)}, max_seqlen={self.max_seqlen}, device={self.device})"
        )
