"""Dense eager attention: slow, obviously right, every feature packfree supports.

Used on its own for short blocks and masked (cached / decoding) calls, and as the naive reference the
faster paths are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["AttentionOptions", "eager_attention", "visible_keys"]


@dataclass(frozen=True)
class AttentionOptions:
    """What one attention call asks for, independent of the backend.

    ``window``: the ``sliding_window`` ``W`` transformers passes to its attention functions, in flash-attention's
    convention (``window_size = (W - 1, 0)`` causal, ``(W - 1, W - 1)`` bidirectional): causal, key ``j`` is
    visible from query ``i`` iff ``i - W < j <= i``; bidirectional, iff ``|i - j| < W``. (Bidirectional models
    whose masks allow ``|i - j| <= w`` pass ``W = w + 1``: ModernBERT's ``config.sliding_window + 1``; the
    interface converts the few that pass ``w``.) ``softcap``: logits become ``softcap * tanh(logits / softcap)``.
    ``sinks``: one learned logit per query head (gpt-oss) that joins the softmax and carries no value.
    ``dropout``: probability applied to the attention weights.
    ``chunk``: chunked attention (Llama 4): each sample is cut into chunks of ``chunk`` tokens from its first
    token, and a query attends (causally) only inside its own chunk.
    """

    scale: float
    causal: bool
    window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    dropout: float = 0.0
    chunk: int | None = None

    @property
    def needs_eager(self) -> bool:
        """True when the logits must be touched (softcap, sinks), which fused kernels here cannot do."""
        return self.softcap is not None or self.sinks is not None


def visible_keys(
    q_len: int, k_len: int, *, causal: bool, window: int | None, device: torch.device, q_offset: int | None = None
) -> torch.Tensor | None:
    """Bool ``[q_len, k_len]``: which keys each query sees, or None when all are visible.

    Queries are aligned to the end of the keys (query ``i`` sits at key position ``q_offset + i``,
    ``q_offset = k_len - q_len`` by default), as when decoding from a cache.
    """
    if not causal and window is None:
        return None
    q_offset = k_len - q_len if q_offset is None else q_offset
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + q_offset
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    if causal:
        visible = k_pos <= q_pos
        if window is not None:
            visible = visible & (k_pos > q_pos - window)
    else:
        visible = (k_pos - q_pos).abs() < window
    return visible


def eager_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    options: AttentionOptions,
    *,
    mask: torch.Tensor | None = None,
    q_offset: int | None = None,
    training: bool = False,
) -> torch.Tensor:
    """Attention of ``query [..., H, Lq, D]`` over ``key/value [..., Hkv, Lk, D]`` -> ``[..., H, Lq, Dv]``.

    ``mask``: optional extra mask broadcastable to ``[..., H, Lq, Lk]`` (bool: True = visible, float:
    additive), applied on top of the causal/window pattern of ``options``. ``Hkv`` must divide ``H``
    (grouped-query attention: query head ``h`` reads key head ``h // (H // Hkv)``). The softmax runs in at
    least float32.
    """
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if heads != kv_heads:
        key = key.repeat_interleave(heads // kv_heads, dim=-3)
        value = value.repeat_interleave(heads // kv_heads, dim=-3)
    logits = torch.matmul(query, key.transpose(-1, -2)) * options.scale
    if options.softcap is not None:
        logits = torch.tanh(logits / options.softcap) * options.softcap
    softmax_dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(softmax_dtype)
    pattern = visible_keys(
        query.shape[-2], key.shape[-2], causal=options.causal, window=options.window, device=query.device,
        q_offset=q_offset,
    )
    if pattern is not None:
        logits = logits.masked_fill(~pattern, float("-inf"))
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
    if options.sinks is not None:
        sinks = options.sinks.to(softmax_dtype).view(heads, 1, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sinks], dim=-1)
    # A query that sees no key at all (possible only under an explicit mask, e.g. a padding query) gets a
    # zero output and zero gradients instead of NaN.
    blind = torch.isneginf(logits).all(dim=-1, keepdim=True)
    weights = torch.softmax(logits.masked_fill(blind, 0.0), dim=-1).masked_fill(blind, 0.0)
    if options.sinks is not None:
        weights = weights[..., :-1]
    weights = F.dropout(weights, p=options.dropout, training=training and options.dropout > 0)
    return torch.matmul(weights.to(value.dtype), value)
