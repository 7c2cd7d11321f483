"""The ``"packfree"`` mask function, as registered with transformers, and the patterns it can hand on.

transformers calls the mask function once per forward with the pattern its model wants (``mask_function``: causal,
sliding window, chunked, an overlay of the model's own). While this forward's boundaries are in effect and packfree's
attention computes that pattern itself, the mask is the :class:`~packfree_plugin.boundaries.Boundaries` object (no
N x N tensor); a pattern it cannot compute is refused, or, for an overlay that reads tokens by relative distance only,
served as stock's dense mask cut to each sample. Decoding from a cache gets stock's ``sdpa`` mask.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from transformers.masking_utils import and_masks, sdpa_mask

from ..boundaries import Boundaries, Seq2SeqBoundaries, TwoWayBlocks, is_per_sample_mask, mark_per_sample
from ..classes import inherited_entry, switched_on
from ..forward.context import boundaries_here
from ..forward.unpacked import slices_its_mask
from .two_way import placed_blocks

__all__ = ["is_per_sample_mask", "packfree_attention_mask"]

_ROW_FREE_MASKS = ("and_masks.", "or_masks.", "causal_mask_function", "bidirectional_mask_function",
                   "sliding_window_overlay.", "sliding_window_causal_mask_function.",
                   "sliding_window_bidirectional_overlay.", "sliding_window_bidirectional_mask_function.",
                   "blockwise_overlay.", "padding_mask_function.", "packed_sequence_mask_function.",
                   "remap_positions_for_packed_sequence.", "add_offsets_to_mask_function.",
                   "_bidirectional_window_overlay.")
"""Qualified names of transformers' mask functions (and Gemma3's window overlay) that read tokens by relative
distance or per-token ids only, so stock's mask for a packed row, cut to each sample, equals each sample's own."""


@cache
def _pattern_codes() -> dict:
    """Code object of each of transformers' mask-function building blocks -> how packfree serves it: ``None`` (the
    boundaries, or the layer's own arguments, give the same pattern) or the closure variable holding the
    function(s) it wraps."""
    from transformers import masking_utils as masks

    probe = masks.causal_mask_function
    codes = {probe.__code__: None, masks.bidirectional_mask_function.__code__: None,
             masks.and_masks(probe).__code__: "mask_functions",
             # the layer passes its sliding_window to the attention function; chunked layers say so in their config
             masks.sliding_window_overlay(1).__code__: None,
             masks.chunked_overlay(1, torch.zeros(1, dtype=torch.long)).__code__: None,
             masks.padding_mask_function(torch.ones(1, 1, dtype=torch.bool)).__code__: None,  # padding spans
             masks.packed_sequence_mask_function(torch.zeros(1, 1, dtype=torch.long)).__code__: None}  # the samples
    for name, wrapped in (("sliding_window_bidirectional_overlay", None), ("remap_positions_for_packed_sequence",
                          "mask_function"), ("add_offsets_to_mask_function", "mask_function")):
        factory = getattr(masks, name, None)  # not in every supported release
        if factory is not None:
            built = factory(1) if wrapped is None else factory(probe, *((torch.zeros(1, 1, dtype=torch.long),)
                                                                         if name.startswith("remap") else (0, 0)))
            codes[built.__code__] = wrapped
    return codes


def _cells(function: Callable) -> dict[str, object]:
    """The closure variables of ``function`` by name."""
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in function.__closure__)))


@cache
def _or_code() -> object:
    from transformers import masking_utils as masks

    return masks.or_masks(masks.causal_mask_function).__code__


def _check_pattern(mask_function: Callable) -> None:
    """Raise unless ``mask_function`` is built only from patterns packfree computes (causal, bidirectional, sliding
    window, chunked, padding, packed samples, combined with ``and_masks``): anything else (``or_masks``, block
    overlays, a custom function) would be dropped silently when the mask is replaced by the boundaries."""
    code = getattr(mask_function, "__code__", None)
    codes = _pattern_codes()
    if code is _or_code():
        # transformers' blockwise overlay (bidirectional image tokens) with no block at all (text only) adds nothing
        inner = _cells(mask_function)["mask_functions"]
        others = [function for function in inner if not _adds_no_block(function)]
        if len(others) == 1:
            return _check_pattern(others[0])
    if code not in codes:
        raise ValueError(
            f"the attention mask of this model is built with {getattr(mask_function, '__qualname__', mask_function)!r}, "
            "a pattern packfree's attention does not compute; it will not drop it silently. Use "
            "attn_implementation='sdpa' for this model, or pass one sample per row"
        )
    if codes[code] is None:
        return
    inner = _cells(mask_function)[codes[code]]
    for function in inner if isinstance(inner, (tuple, list)) else (inner,):
        _check_pattern(function)


def _wants_tensor_mask(config: object) -> bool:
    """Whether the model of ``config`` works on its attention mask as a tensor before its layers (a ``tensor_mask``
    quirk: MPT casts it to bool; Falcon folds its ALiBi bias into it), where the boundaries object would crash. It then
    gets the dense mask of the packed samples (transformers' eager form, O(T^2) as on stock); its attention layers run
    per sample (:mod:`..mixers.families`) and build their own."""
    return switched_on(inherited_entry(config).tensor_mask, config)


def _packed_dense_mask(boundaries: Boundaries, mask_function: Callable | None, dtype: torch.dtype) -> torch.Tensor:
    """transformers' eager mask ``[B, 1, T, T]`` (0 where visible, the dtype's minimum elsewhere) of ``mask_function``
    restricted to each segment of ``boundaries``, for models whose code needs the mask as a tensor."""
    from transformers.masking_utils import and_masks, causal_mask_function, eager_mask, packed_sequence_mask_function

    return eager_mask(
        batch_size=boundaries.batch_size, q_length=boundaries.seq_len, kv_length=boundaries.seq_len,
        mask_function=and_masks(mask_function or causal_mask_function, packed_sequence_mask_function(boundaries.seq_idx)),
        dtype=dtype, device=boundaries.seq_idx.device,
    )


def packfree_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    use_vmap: bool = False,
    **kwargs,
) -> Boundaries | TwoWayBlocks | torch.Tensor | None:
    """transformers' mask-function contract. Returns this forward's boundaries when there are any, for a
    ``mask_function`` whose pattern packfree's attention computes (:func:`_check_pattern`). A mask with an overlay of
    the model's own (``use_vmap``: or/and mask functions; or an ``or_masks`` union such as Gemma3's bidirectional
    image blocks) is, on a packed row, the :class:`~packfree_plugin.boundaries.TwoWayBlocks` where it is the causal
    mask widened by two-way blocks (:func:`~packfree_plugin.attention.two_way.placed_blocks`); any other is stock's
    ``sdpa_mask`` cut to each sample (dense, O(T^2)), refused where transformers renumbered positions under the
    overlay. While compiling (closures cannot be traced, so only a union
    at the top is seen) every overlay is refused. A call whose 2-D mask is not the boundaries' padding (a seq2seq
    cross-attention given the encoder's mask) gets stock's mask. A packed seq2seq decoder's cross-attention gets
    the pairing of its samples with the encoder's (:func:`_cross_attention_mask`)."""
    pairing = _cross_attention_mask(boundaries_here(), batch_size, q_length, kv_length, mask_function)
    if pairing is not None:
        return pairing
    boundaries = boundaries_here(rows=(batch_size, q_length)) if q_length == kv_length else None
    if boundaries is not None and _marks_their_padding(boundaries, attention_mask) \
            and (boundaries.is_packed or not slices_its_mask(kwargs.get("config"))):
        compiling = torch.compiler.is_compiling()
        if not (use_vmap or _widens(mask_function, look_inside=not compiling)):
            if mask_function is not None and not compiling:
                # compiled forwards skip the check: their model passed it eagerly, in the sweep or the proof at load
                _check_pattern(mask_function)
            if _wants_tensor_mask(kwargs.get("config")):
                return _packed_dense_mask(boundaries, mask_function, kwargs.get("dtype", torch.float32))
            return boundaries
        if compiling:
            model_type = getattr(kwargs.get("config"), "model_type", "this model")
            raise ValueError(
                f"{model_type!r} overlays a pattern of its own on the causal mask (or_mask_function / "
                "and_mask_function / block_sequence_ids, e.g. Gemma3's bidirectional image tokens), which packfree "
                "cannot see whole while compiling. Run it without torch.compile, or use attn_implementation='sdpa'"
            )
        if boundaries.is_packed:
            blocks = placed_blocks(boundaries, mask_function)
            if blocks is not None and not _wants_tensor_mask(kwargs.get("config")):
                return blocks  # causal with two-way blocks, laid out per sample
            # else stock's dense mask, cut to each sample
            model_type = getattr(kwargs.get("config"), "model_type", "this model")
            unknown = sorted({name for name in _qualnames(mask_function) if not name.startswith(_ROW_FREE_MASKS)})
            if unknown:
                raise ValueError(
                    f"{model_type!r} overlays a pattern of its own on the causal mask ({', '.join(unknown)}) that may "
                    "depend on a token's place in the row (e.g. Llama 4's attention chunks), so packfree cannot cut "
                    "it to each packed sample. Pass one sample per row, or use attn_implementation='sdpa'"
                )
            if _renumbers_overlay(mask_function):
                overlays = ", ".join(sorted(set(_qualnames(mask_function))))
                raise ValueError(
                    f"{model_type!r} overlays a pattern of its own on the causal mask ({overlays}) that packfree "
                    "cannot lay out per sample (it is not the causal mask widened by two-way blocks, each one run of "
                    "its sample), and transformers renumbered the packed row's positions per sample before applying "
                    "it (packed position_ids without an attention_mask), so the pattern reads the wrong tokens. Pass "
                    "attention_mask (ones, [B, T]) with the packed row, as "
                    "packfree_plugin.packing.VisionPackedCollator does"
                )
            segments = boundaries.seq_idx

            def same_sample(batch_idx, head_idx, q_idx, kv_idx):
                return segments[batch_idx, q_idx] == segments[batch_idx, kv_idx]

            mask_function = and_masks(mask_function, same_sample)
            kwargs["allow_is_causal_skip"] = False
            mask = sdpa_mask(
                batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, use_vmap=use_vmap,
                **kwargs,
            )
            return mark_per_sample(mask)
    if slices_its_mask(kwargs.get("config")):
        # a tensor for the model to cut even where stock sdpa would skip it as causal (a cut mask is no longer causal
        # from the top left: stock leaves its cut out when a mask is None, packfree's implementation name does not)
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, use_vmap=use_vmap, **kwargs,
    )


def _marks_their_padding(boundaries: Boundaries, attention_mask: torch.Tensor | None) -> bool:
    """Whether a mask call's 2-D ``attention_mask`` (True/1 = a key to attend) hides exactly the boundaries'
    padding. It does for self-attention; a seq2seq decoder's cross-attention of the same length is given the
    encoder's mask instead, and then stock's mask is the right one (the decoder's boundaries are not the encoder's)."""
    if attention_mask is None or attention_mask.ndim != 2 or torch.compiler.is_compiling():
        return True
    return torch.equal(attention_mask.bool(), ~boundaries.padding_tokens.to(attention_mask.device))


def _widens(mask_function: Callable | None, *, look_inside: bool) -> bool:
    """Whether transformers' ``or_masks`` composed ``mask_function`` with something that widens causal attention,
    such as ``block_sequence_ids`` (which transformers passes without ``use_vmap``). Inside its closures (not
    traceable by torch.compile, so only with ``look_inside``) a block overlay without any block (all ids -1, as
    Gemma 4 builds for text) adds nothing; without ``look_inside`` any union at the top counts."""
    if getattr(mask_function, "__name__", "") != "or_mask":  # or_masks' inner function (Dynamo hides __qualname__)
        return look_inside and any(_widens(part, look_inside=True) for part in _closure_functions(mask_function))
    if not look_inside:
        return True
    base, *added = _closure_functions(mask_function)
    return _widens(base, look_inside=True) or not all(map(_adds_no_block, added))


def _qualnames(mask_function: Callable | None) -> list[str]:
    """Qualified names of ``mask_function`` and of every function in its closures."""
    names = [getattr(mask_function, "__qualname__", repr(mask_function))]
    for part in _closure_functions(mask_function):
        names += _qualnames(part)
    return names


def _renumbers_overlay(mask_function: Callable | None) -> bool:
    """Whether transformers' ``remap_positions_for_packed_sequence`` (packed position_ids without an attention mask)
    wraps a widening overlay inside ``mask_function``: that overlay then indexes its ids by in-sample positions."""
    if getattr(mask_function, "__qualname__", "").startswith("remap_positions_for_packed_sequence."):
        return any(_widens(part, look_inside=True) for part in _closure_functions(mask_function))
    return any(_renumbers_overlay(part) for part in _closure_functions(mask_function))


def _closure_functions(function: Callable | None) -> list[Callable]:
    """The functions a mask function closes over (``or_masks``/``and_masks`` hold theirs in a tuple), in order."""
    found: list[Callable] = []
    for cell in getattr(function, "__closure__", None) or ():
        contents = cell.cell_contents
        found += [item for item in (contents if isinstance(contents, tuple) else (contents,)) if callable(item)]
    return found


def _adds_no_block(function: Callable) -> bool:
    """Whether ``function`` is transformers' ``blockwise_overlay`` over ids that are all -1 (no block at all)."""
    if not getattr(function, "__qualname__", "").startswith("blockwise_overlay."):
        return False
    ids = [cell.cell_contents for cell in function.__closure__ or () if isinstance(cell.cell_contents, torch.Tensor)]
    return len(ids) == 1 and bool((ids[0] < 0).all())


# ------------------------------------------------------------------------------------------ packed seq2seq


def _cross_attention_mask(boundaries: Boundaries | None, batch_size: int, q_length: int, kv_length: int,
                          mask_function: Callable | None) -> Seq2SeqBoundaries | None:
    """The mask of a paired seq2seq decoder's cross-attention (a bidirectional mask asked for while the decoder's
    boundaries are in effect, from its rows to the encoder's): the :class:`Seq2SeqBoundaries` themselves (layers that
    add the mask to their scores themselves, MVP's, turn it into its dense form: ``quirks.dense_masks``). None
    otherwise."""
    pairing = Seq2SeqBoundaries.of(boundaries)
    if pairing is None or boundaries is not pairing.decoder or getattr(mask_function, "__name__", "") != \
            "bidirectional_mask_function" or not pairing.encoder.describes(batch_size, kv_length) \
            or not pairing.decoder.describes(batch_size, q_length):
        return None
    return pairing
