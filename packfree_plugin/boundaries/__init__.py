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
(``cu_seqlens`` int32 ``[N+1]``, ``seq_idx`` int32 ``[B, T]``) are derived from them lazily (each by its one builder
in :mod:`.forms`) and kept on the boundaries, each with its host copy, so any number of layers (and the ops'
host-side paths) can ask for any form without another device sync. Nothing is written into the caller's tensors:
what packfree keeps about a tensor sits in its own store (:mod:`.store`).

The package, by job: :mod:`.tiling` (the :class:`Boundaries` object: its offsets validated, its device forms),
:mod:`.sources` (its constructors, one per source, and the order of precedence), :mod:`.ids` (the position-id rule
and the per-token shapes), :mod:`.forms` (the builder of each per-token form), :mod:`.store` (host copies and derived
values of tensors), :mod:`.seq2seq` (a seq2seq forward's two sides),
:mod:`.two_way` (blocks attending both ways inside samples), :mod:`.messages` (offsets in refusals).
"""

from .forms import position_ids_of, seq_idx_of
from .ids import fits_rows, id_starts, shape_disagreement
from .seq2seq import Seq2SeqBoundaries
from .store import close_batch, host_of, keep_host, kept_form, memo, read_to_host
from .tiling import Boundaries
from .two_way import TwoWayBlocks, is_per_sample_mask, mark_per_sample

__all__ = ["Boundaries", "Seq2SeqBoundaries", "TwoWayBlocks", "close_batch", "fits_rows", "host_of", "id_starts",
           "is_per_sample_mask", "keep_host", "kept_form", "mark_per_sample", "memo", "position_ids_of", "read_to_host",
           "seq_idx_of", "shape_disagreement"]
