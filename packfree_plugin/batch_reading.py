"""Reading one forward's batch: its :class:`~.boundaries.Boundaries` from the call's bound arguments, and the checks a
packed batch must pass (no filled cache, a 2-D mask or none, -100 labels at every sample's first token). Pure functions
of the arguments: nothing here reads the per-thread stack or a model (:mod:`.model_entry` calls them)."""

from __future__ import annotations

from typing import Any

import torch

from .boundaries import Boundaries
from .classes import inherited_entry
from .keywords import BOUNDARY_KWARGS, CACHE_ARGUMENTS, PACKING_KWARGS
from .signature import tensor_leaves
from .unpacked import has_holes, reads_as_one_sample_per_row

__all__ = ["boundaries_for_call", "cache_holds_tokens", "check_labels", "packing_signs", "tokens_of"]


def tokens_of(arguments: dict[str, Any]) -> Any:
    """The call's ``input_ids``, else its ``inputs_embeds`` (``[B, T, ...]``), else None."""
    tokens = arguments.get("input_ids")
    return tokens if tokens is not None else arguments.get("inputs_embeds")


def cache_holds_tokens(past: Any) -> bool:
    """Whether a cache object already holds state from earlier tokens, read from its layers' real state
    (attention layers: a sequence length; linear-attention layers: their conv/recurrent states)."""
    if past is None:
        return False
    from transformers.cache_utils import Cache, EncoderDecoderCache, LinearAttentionCacheLayerMixin

    if isinstance(past, EncoderDecoderCache):  # a seq2seq decoder: its own self-attention cache is what it continues
        past = past.self_attention_cache
    if isinstance(past, Cache):
        for layer in past.layers:
            if inherited_entry(layer).stores_nothing:
                continue
            if isinstance(layer, LinearAttentionCacheLayerMixin):
                if any(layer.has_previous_state.values()):
                    return True
            elif layer.get_seq_length() > 0:
                return True
        return False
    if isinstance(past, (list, tuple)):  # legacy tuples, RWKV's state list
        return any(t.numel() > 0 for t in tensor_leaves(past))
    seq_length = getattr(past, "get_seq_length", None)
    if callable(seq_length):
        return seq_length() > 0
    return True  # an unknown cache type: assume it holds tokens, so a packed batch is refused, never mixed


def packing_signs(arguments: dict[str, Any]) -> list[str]:
    """What in a call says its rows are packed: boundary kwargs, or 2-D ``position_ids`` that restart at 0 after
    a row's first token (read before the boundaries, where they cannot be built: a filled cache, a 4-D mask)."""
    signs = [name for name in PACKING_KWARGS if arguments.get(name) is not None]
    position_ids = arguments.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and position_ids.ndim == 2 and bool((position_ids[:, 1:] == 0).any()):
        signs.append("position_ids restarting at 0")
    return signs


def boundaries_for_call(arguments: dict[str, Any], *, causal_labels: bool = True) -> Boundaries | None:
    """Boundaries for one forward's bound ``arguments`` (``**kwargs`` merged in), or None when decoding.
    ``causal_labels``: ``labels`` are the row's own tokens shifted inside the loss (a causal LM), so a packed row's
    must be -100 at every sample's first token; a seq2seq model's labels are its decoder's targets instead."""
    tokens = tokens_of(arguments)
    if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
        return None
    batch_size, seq_len = tokens.shape[0], tokens.shape[1]
    if batch_size == 0 or seq_len == 0:
        return None  # no tokens, nothing to keep apart: the model runs as stock
    past = next((arguments[name] for name in CACHE_ARGUMENTS if arguments.get(name) is not None), None)
    if cache_holds_tokens(past):
        given = packing_signs(arguments)
        if given:
            raise ValueError(
                f"a packed batch ({', '.join(given)}) was passed together with a cache that already holds tokens; "
                "packed rows cannot continue a cached sequence"
            )
        return None
    attention_mask = arguments.get("attention_mask")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim != 2:
        packing = packing_signs(arguments)
        if packing:
            raise ValueError(
                f"a {attention_mask.ndim}-D attention_mask was passed with a packed batch ({', '.join(packing)}); "
                "packfree reads boundaries from a 2-D padding mask or none. Drop the mask (the packed boundaries "
                "already keep samples apart) or pass the [B, T] padding mask"
            )
        return None  # an unpacked call with a prepared mask of the caller's own: transformers uses it as is
    if reads_as_one_sample_per_row(arguments):
        if has_holes(attention_mask):
            return None  # one sample per row with zeros inside it: stock's own mask, in attention and every mixer
        arguments = {**arguments, "position_ids": None}  # ids that never restart only number positions, as in stock
    boundaries = Boundaries.from_model_inputs(
        batch_size=batch_size,
        seq_len=seq_len,
        device=tokens.device,
        **{name: arguments.get(name) for name in BOUNDARY_KWARGS},
        position_ids=arguments.get("position_ids"),
        attention_mask=attention_mask,
    )
    if boundaries.is_packed and past is not None:
        raise ValueError(
            "a cache object was passed with a packed batch; a cache built from a packed row would mix samples. "
            "Call the model without `cache`/`past_key_values` for packed rows"
        )
    if boundaries.is_packed and causal_labels:
        check_labels(arguments.get("labels"), boundaries)
    return boundaries


def check_labels(labels: Any, boundaries: Boundaries) -> None:
    """The label contract of a packed row: ``labels [B, T]`` hold -100 at every sample's first token, because the
    loss predicts token t from token t-1, which for a sample's first token is the previous sample's last."""
    if not isinstance(labels, torch.Tensor) or labels.ndim != 2 or tuple(labels.shape) != (boundaries.batch_size,
                                                                                           boundaries.seq_len):
        return
    starts = [start for start, pad in zip(boundaries.offsets[:-1], boundaries.padding)
              if not pad and start % boundaries.seq_len]
    if not starts:
        return
    at_starts = labels.reshape(-1)[torch.tensor(starts, device=labels.device)].tolist()
    crossing = [start for start, label in zip(starts, at_starts) if label != -100]
    if crossing:
        token = crossing[0]
        raise ValueError(
            f"labels at the first token of a packed sample (row {token // boundaries.seq_len}, token "
            f"{token % boundaries.seq_len}) are {at_starts[starts.index(token)]}, not -100: the loss would train the "
            "previous sample's last token to predict this sample's first. Set -100 there, as "
            "DataCollatorWithFlattening and TRL's padding-free collator do"
        )

