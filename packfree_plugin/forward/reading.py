"""Reading one forward's batch: its :class:`~.boundaries.Boundaries` from the call's bound arguments, and the checks a
batch must pass (every per-token input shaped like the tokens, checked before any is read; for a packed batch: no
filled cache, a 2-D mask or none, no loss target that crosses into the next sample). Pure functions of the arguments:
nothing here reads the per-thread stack or a model (:mod:`.hook` calls them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..boundaries import Boundaries, fits_rows, host_of, id_starts, read_to_host, shape_disagreement
from ..classes import inherited_entry
from .keywords import BOUNDARY_KWARGS, CACHE_ARGUMENTS, CU_SEQ_LENS_KWARGS, PACKING_KWARGS, PER_TOKEN_BOUNDARY_KWARGS
from .signature import tensor_leaves
from .unpacked import has_holes, reads_as_one_sample_per_row

__all__ = ["boundaries_for_call", "cache_holds_tokens", "check_labels", "check_shapes", "crossing_target",
           "packing_signs", "tokens_of"]

IGNORE_INDEX = -100
"""The label of a token that trains nothing (transformers' loss functions' ``ignore_index``)."""


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


def boundaries_for_call(arguments: dict[str, Any], *, causal_labels: bool = True, reads_position_ids: bool = True,
                        also_read: Sequence[torch.Tensor] = ()) -> Boundaries | None:
    """Boundaries for one forward's bound ``arguments`` (``**kwargs`` merged in), or None when decoding.
    ``causal_labels``: ``labels`` are the row's own tokens shifted inside the loss (a causal LM), so a packed row's
    must be -100 at every sample's first token (``shift_labels``: at every sample's last token); a seq2seq model's
    labels are its decoder's targets instead. ``reads_position_ids``: the model's forward takes ``position_ids``
    (Mamba's and RWKV's ignore them, so ids that cannot describe the batch and pack nothing are dropped, as stock
    ignores them). ``also_read``: tensors copied to the host in the same read as the boundary inputs (an MRoPE model's
    token types and grids, :func:`.rope_ids.rope_reads`)."""
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
    arguments = check_shapes(arguments, batch_size, seq_len, reads_position_ids=reads_position_ids)
    attention_mask = arguments.get("attention_mask")
    _read_batch_to_host(arguments, causal_labels=causal_labels, also_read=also_read)
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
        check_labels(arguments, boundaries)
    return boundaries


def _read_batch_to_host(arguments: dict[str, Any], *, causal_labels: bool, also_read: Sequence[torch.Tensor]) -> None:
    """The forward's one device-to-host read: every boundary input the batch carries (a 2-D ``attention_mask``
    included) and, beside them, the targets :func:`check_labels` reads, copied together (:func:`read_to_host`), so
    building the boundaries and checking the targets reads nothing more; ``also_read`` go in the same copy. A batch
    without boundary inputs reads nothing: it cannot be packed, so its targets need no check."""
    mask = arguments.get("attention_mask")
    sources = [arguments.get(name) for name in (*BOUNDARY_KWARGS, "position_ids")]
    sources.append(mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None)
    if any(isinstance(source, torch.Tensor) for source in sources):
        targets = [arguments.get("shift_labels"), arguments.get("labels")] if causal_labels else []
        targets = [t for t in targets if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        read_to_host([*sources, *targets, *also_read])


def check_shapes(arguments: dict[str, Any], batch_size: int, seq_len: int, *,
                 reads_position_ids: bool = True) -> dict[str, Any]:
    """Refuse, before any is read, a per-token input whose shape disagrees with the tokens' ``[B, T]``: a 2-D
    ``attention_mask``, ``position_ids`` (``[B, T]``, ``[1, T]``, MRoPE ``[R, B, T]``), ``seq_idx``, 1-D
    ``cu_seq_lens_q/k``, ``shift_labels``. Returns ``arguments``, without ``position_ids`` where the model ignores
    them (not ``reads_position_ids``) and ids of another shape start no sample: stock runs those, ignoring them."""
    position_ids = arguments.get("position_ids")
    if isinstance(position_ids, torch.Tensor) and not fits_rows(position_ids, batch_size, seq_len):
        if not reads_position_ids and not _ids_start_samples(position_ids):
            arguments = {**arguments, "position_ids": None}
        else:
            raise ValueError(shape_disagreement("position_ids", position_ids, batch_size, seq_len,
                                                expected="[B, T], [1, T] or [R, B, T] (MRoPE)"))
    for name in ("attention_mask", *PER_TOKEN_BOUNDARY_KWARGS, "shift_labels"):
        value = arguments.get(name)
        if name == "attention_mask" and (not isinstance(value, torch.Tensor) or value.ndim != 2):
            continue  # a prepared 1-D, 3-D or 4-D mask of the caller's own: refused with packed rows, stock's else
        if value is not None and (not isinstance(value, torch.Tensor) or tuple(value.shape) != (batch_size, seq_len)):
            raise ValueError(shape_disagreement(name, value, batch_size, seq_len))
    for name in CU_SEQ_LENS_KWARGS:
        value = arguments.get(name)
        if value is not None and (not isinstance(value, torch.Tensor) or value.ndim != 1):
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{name} has shape {shape}; it must be 1-D [N + 1]: the offsets of the N samples over the "
                             f"flattened B * T = {batch_size * seq_len} tokens (a collator's per-row offsets "
                             "[B, N + 1] concatenated into one running sum)")
    return arguments


def _ids_start_samples(position_ids: torch.Tensor) -> bool:
    """Whether ids of any shape start a sample inside one of their rows (the last axis) by the one rule."""
    if position_ids.numel() == 0:
        return False
    rows = position_ids.detach().to("cpu", torch.float64).reshape(-1, position_ids.shape[-1] if position_ids.ndim else 1)
    return bool(id_starts(rows.numpy(), planes=False)[:, 1:].any())


def check_labels(arguments: dict[str, Any], boundaries: Boundaries) -> None:
    """The target contract of a packed causal row: no token may learn to predict the next sample's first token.
    The loss predicts token t from token t-1, so ``labels [B, T]`` hold -100 at every sample's first token; when
    ``shift_labels [B, T]`` are given, the loss reads them instead (as transformers' loss does), and they hold -100
    at the token before every sample's first (the previous sample's last). Also refuses ``labels`` of another
    shape than the tokens'."""
    shift_labels = arguments.get("shift_labels")
    if isinstance(shift_labels, torch.Tensor):
        crossing = crossing_target(shift_labels, boundaries, shifted=True)
        name, fix = "shift_labels", ("shift the labels inside each sample (labels -100 at each sample's first token, "
                                     "then shift_labels = labels[:, 1:] padded with -100), as DeepSpeed's "
                                     "UlyssesSPDataLoaderAdapter does with DataCollatorWithFlattening's labels")
    else:
        labels = arguments.get("labels")
        if not isinstance(labels, torch.Tensor) or labels.ndim != 2 or labels.shape[-1] == 1 or \
                labels.is_floating_point():
            return  # not per-token labels (a classification head's [n] or [n, 1], multi-label targets)
        if tuple(labels.shape) != (boundaries.batch_size, boundaries.seq_len):
            raise ValueError(shape_disagreement("labels", labels, boundaries.batch_size, boundaries.seq_len))
        crossing = crossing_target(labels, boundaries, shifted=False)
        name, fix = "labels", "set -100 there, as DataCollatorWithFlattening and TRL's padding-free collator do"
    if crossing is not None:
        row, token, value = crossing
        at = f"the first token of a packed sample (row {row}, token {token})" if name == "labels" else \
            f"the last token before a packed sample (row {row}, token {token}; the sample starts at token {token + 1})"
        raise ValueError(
            f"{name} at {at} are {value}, not -100: the loss would train the previous sample's last token to predict "
            f"this sample's first, across the boundary between them. To fix it, {fix}"
        )


def crossing_target(targets: torch.Tensor, boundaries: Boundaries, *, shifted: bool,
                    first_token: int = 0) -> tuple[int, int, int] | None:
    """The first target in ``targets [B, L]`` that crosses a sample boundary of ``boundaries`` (a ``[B, T]`` row; the
    targets cover its tokens ``first_token .. first_token + L - 1``, a sequence-parallel shard's): ``labels``
    (``shifted=False``) not -100 at a sample's first token, ``shift_labels`` (``shifted=True``) not -100 at the token
    before it. ``(row, token in the row, value)``, or None. Samples that start a row cross nothing."""
    seq_len, width = boundaries.seq_len, targets.shape[-1]
    positions = [start - shifted for start, pad in zip(boundaries.offsets[:-1], boundaries.padding)
                 if not pad and start % seq_len and first_token <= (start - shifted) % seq_len < first_token + width]
    if not positions:
        return None
    rows = [p // seq_len for p in positions]
    columns = [p % seq_len - first_token for p in positions]
    values = host_of(targets).reshape(boundaries.batch_size, width)[rows, columns].tolist()
    crossing = next((index for index, value in enumerate(values) if value != IGNORE_INDEX), None)
    if crossing is None:
        return None
    position = positions[crossing]
    return position // seq_len, position % seq_len, values[crossing]

