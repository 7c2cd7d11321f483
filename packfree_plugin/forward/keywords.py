"""The names packfree reads and registers, defined once: its attention implementation's name, the boundary keywords a
packed batch passes, and the arguments under which a call carries a cache. Every layer imports them from here
(nothing below it)."""

from __future__ import annotations

__all__ = ["ATTN_IMPLEMENTATION", "BOUNDARY_KWARGS", "CACHE_ARGUMENTS", "CU_SEQ_LENS_KWARGS", "LOSS_WEIGHT_KWARGS",
           "MAX_LENGTH_KWARGS", "PACKFREE_KWARGS", "PACKING_KWARGS", "PER_TOKEN_BOUNDARY_KWARGS"]

ATTN_IMPLEMENTATION = "packfree"
"""The name packfree registers with transformers: ``from_pretrained(..., attn_implementation="packfree")``."""

CU_SEQ_LENS_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")
"""The boundary keywords in offset form: 1-D ``[N + 1]`` running sums over the flattened ``B * T`` tokens."""

MAX_LENGTH_KWARGS = ("max_length_q", "max_length_k")
"""The longest sample of each offset form (ints), sent beside :data:`CU_SEQ_LENS_KWARGS`."""

PER_TOKEN_BOUNDARY_KWARGS = ("seq_idx",)
"""The boundary keywords shaped like the tokens, ``[B, T]``: every token's sample."""

BOUNDARY_KWARGS = (*CU_SEQ_LENS_KWARGS, *MAX_LENGTH_KWARGS, *PER_TOKEN_BOUNDARY_KWARGS)
"""The boundary keywords of a packed batch, as transformers' ``DataCollatorWithFlattening`` and packfree's collators
send them (``position_ids`` aside: every model takes those, packed or not); the keyword parameters of
:meth:`.boundaries.Boundaries.from_model_inputs`."""

PACKING_KWARGS = (*CU_SEQ_LENS_KWARGS, *PER_TOKEN_BOUNDARY_KWARGS)
"""The :data:`BOUNDARY_KWARGS` whose presence alone says a call's rows are packed (``max_length_q/k`` only come with
``cu_seq_lens``; ``position_ids`` say so only where they restart inside a row: :mod:`.unpacked`)."""

PACKFREE_KWARGS = (*BOUNDARY_KWARGS, "packfree_boundaries")
"""Every keyword through which boundaries reach a call: the batch's, and the :class:`~.boundaries.Boundaries` a
model forwards to its layers through ``**kwargs``. A layer's own forward, run by packfree, gets none of them."""

CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params", "state", "layer_past")
"""Arguments under which a model or a layer is passed a cache: ``past_key_values`` (attention), ``cache_params``
(Mamba-style mixers), ``cache``, ``state`` (RWKV), ``layer_past`` (older attention layers). Read in this order: the
first one given is the call's cache."""

LOSS_WEIGHT_KWARGS = ("token_weights", "sample_weights")
"""The loss-weight fields a batch may carry (``[B, T]`` floats in the layout of the targets the loss reads):
packfree's model entry takes them out of the call (the model's own forward never sees them) and leaves them, with the
batch's boundaries, for :mod:`packfree_plugin.loss` (:mod:`.loss_inputs`)."""
