"""Attention layers that add ``attention_mask`` to their scores themselves, given the dense mask they can read.

Eager-only attention layers of a few seq2seq families (XGLM, TrOCR, MVP, BigBird-Pegasus' encoder: a
:attr:`~packfree_plugin.classes.ClassEntry.dense_mask` quirk) never call transformers' attention interface, so they
cannot take packfree's boundaries as their mask. On a packed row they get the block-diagonal additive mask of the
packed samples (O(T^2) per row, as stock's own), or, where the layer attends outside any mask (block-sparse
attention), a ``ValueError``. Decoder layers whose self-attention does not declare ``is_causal`` (a
``causal_self_attention`` quirk: stock relies on the causal mask, which packfree's boundaries replace) get it marked.
"""

from __future__ import annotations

import torch
from torch import nn

from ..boundaries import Boundaries, Seq2SeqBoundaries
from ..classes import entry_of
from ..forward.context import boundaries_here
from ..mixers.generic import additive_mask
from ..forward.instance import install, own_forward, own_parameters, uninstall
from .whole_row import packed_row_refusal

__all__ = ["dense_additive_mask", "dense_cross_mask", "install_dense_mask", "mark_causal", "uninstall_dense_mask",
           "unmark_causal"]

_TAG = "dense_mask_"
"""Keeps these instance forwards apart from the other adapters' (:mod:`packfree_plugin.forward.instance`)."""
_STOCK_IS_CAUSAL = "_packfree_stock_is_causal"


@torch.compiler.disable  # built from the host offsets of each packing
def dense_additive_mask(boundaries: Boundaries, *, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, T, T]`` additive mask of ``boundaries``: 0 where a query may attend (same segment; and not a later
    key when ``causal``), the dtype's minimum elsewhere, as transformers' eager masks. O(T^2) per row."""
    segment = boundaries.seq_idx
    allowed = segment[:, :, None] == segment[:, None, :]
    if causal:
        allowed = allowed & torch.ones_like(allowed[0], dtype=torch.bool).tril()
    return additive_mask(allowed, dtype)[:, None]


@torch.compiler.disable  # built from the host offsets of each packing
def dense_cross_mask(pairing: Seq2SeqBoundaries, dtype: torch.dtype) -> torch.Tensor:
    """``[B, 1, Td, Te]`` additive mask: 0 where a decoder token's own encoder sample is, the dtype's minimum elsewhere
    (a padding query sees nothing). O(Td x Te) per row: for models that add the mask to their scores themselves."""
    decoder, encoder = pairing.decoder, pairing.encoder
    reads = torch.full((decoder.batch_size * decoder.seq_len,), -1, dtype=torch.long)
    source = torch.full((encoder.batch_size * encoder.seq_len,), -2, dtype=torch.long)
    for index, (decoder_start, decoder_length, encoder_start, encoder_length) in enumerate(pairing.pairs):
        reads[decoder_start:decoder_start + decoder_length] = index
        source[encoder_start:encoder_start + encoder_length] = index
    allowed = reads.view(decoder.batch_size, decoder.seq_len, 1) == source.view(encoder.batch_size, 1, encoder.seq_len)
    return additive_mask(allowed, dtype)[:, None].to(decoder.device)


def _dense_mask_forward(module: nn.Module, *args, **kwargs):
    """Such a layer's forward with the mask it expects: packfree's boundaries (training, scoring, prefill) as the
    block-diagonal additive mask of their segments; transformers' boolean ``sdpa`` mask (decoding) as additive."""
    dense_mask = entry_of(type(module)).dense_mask
    parameters = own_parameters(module, tag=_TAG)
    arguments = parameters.bind(args, kwargs)
    hidden = arguments["hidden_states"]
    encoder = arguments.get(dense_mask.cross_input) if dense_mask.cross_input else None
    mask_name = "encoder_attention_mask" if encoder is not None and "encoder_attention_mask" in parameters.names \
        else "attention_mask"
    mask = arguments.get(mask_name)
    enclosing = boundaries_here(rows=hidden, packed=True)
    packed = enclosing is not None
    refusal = packed_row_refusal(module) if packed else None
    if refusal is not None:
        raise ValueError(f"packfree cannot run {type(module).__name__} on a packed row: {refusal.reason}. Pass one "
                         "sample per row for this model, or shorter packed rows")
    if mask is None and packed:
        # these models pass no mask where a lone sample needs none (an encoder without padding, cross-attention
        # without an encoder mask): on a packed row the boundaries are the mask
        if encoder is not None and encoder.shape[1] != hidden.shape[1]:
            raise ValueError(
                f"{type(module).__name__}: cross-attention from a packed row of {hidden.shape[1]} tokens to encoder "
                f"states of {encoder.shape[1]}; packfree cannot tell which encoder sample each decoder sample reads. "
                "Pass one sample per row for this model"
            )
        mask = enclosing
    if isinstance(mask, Seq2SeqBoundaries):
        arguments[mask_name] = dense_cross_mask(mask, hidden.dtype)
    elif isinstance(mask, Boundaries):
        causal = bool(getattr(module, "is_decoder", False)) and encoder is None
        arguments[mask_name] = dense_additive_mask(mask, causal=causal, dtype=hidden.dtype)
    elif isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        arguments[mask_name] = additive_mask(mask, hidden.dtype)
    extra = arguments.pop(parameters.var_keyword, {}) if parameters.var_keyword else {}
    return own_forward(module, tag=_TAG)(**arguments, **extra)



def install_dense_mask(module: nn.Module) -> None:
    """Give ``module`` (a layer with a ``dense_mask`` quirk) the mask it can read (idempotent)."""
    install(module, _dense_mask_forward, tag=_TAG)


def uninstall_dense_mask(module: nn.Module) -> None:
    uninstall(module, _dense_mask_forward, tag=_TAG)


def mark_causal(layer: nn.Module, attribute: str) -> None:
    """Mark the self-attention at ``layer.<attribute>`` causal, keeping what it declared (idempotent)."""
    attention = layer.get_submodule(attribute)
    if _STOCK_IS_CAUSAL not in attention.__dict__:
        attention.__dict__[_STOCK_IS_CAUSAL] = attention.__dict__.get("is_causal")
    attention.is_causal = True


def unmark_causal(module: nn.Module) -> None:
    """Undo :func:`mark_causal` on ``module`` (the attention itself); nothing where it was not marked."""
    if _STOCK_IS_CAUSAL in module.__dict__:
        stock = module.__dict__.pop(_STOCK_IS_CAUSAL)
        if stock is None:
            del module.__dict__["is_causal"]
        else:
            module.is_causal = stock
