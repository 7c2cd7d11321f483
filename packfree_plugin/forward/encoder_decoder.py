"""The two sides of a packed encoder-decoder forward: the decoder's boundaries, read from ``decoder_position_ids``
and paired with the encoder's (:class:`~.boundaries.Seq2SeqBoundaries`), and the decoder call that runs on them
(called from :mod:`.hook`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .reading import tokens_of
from ..boundaries import Boundaries, Seq2SeqBoundaries
from .context import fits
from .keywords import BOUNDARY_KWARGS

__all__ = ["DECODER_POSITION_IDS", "paired_decoder", "pair_seq2seq"]


DECODER_POSITION_IDS = "decoder_position_ids"
"""The decoder's boundary input of a packed seq2seq batch: ``[B, Td]`` ids restarting at 0 where each decoder sample
starts (read by the position-ids rule of :mod:`.boundaries`); packfree pops it from the call."""
_DECODER_TOKENS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def pair_seq2seq(module: nn.Module, arguments: dict[str, Any], encoder: Boundaries | None,
                 decoder_position_ids: torch.Tensor | None) -> None:
    """An encoder-decoder forward: build the decoder's boundaries from ``decoder_position_ids`` (and
    ``decoder_attention_mask``) and pair them with the ``encoder``'s (:class:`Seq2SeqBoundaries`, attached to both).
    Without ``decoder_position_ids`` a packed encoder row needs decoder rows laid out like it (the decoder then
    runs on the encoder's boundaries); decoder rows of another length raise."""
    tokens = next((arguments[name] for name in _DECODER_TOKENS
                   if isinstance(arguments.get(name), torch.Tensor) and arguments[name].ndim >= 2), None)
    name = type(module).__name__
    if decoder_position_ids is None:
        if encoder is not None and encoder.is_packed and tokens is not None and not fits(encoder, tokens):
            raise ValueError(
                f"{name} got packed encoder rows {[encoder.batch_size, encoder.seq_len]} and decoder rows "
                f"{list(tokens.shape[:2])} of another length without decoder_position_ids; packfree cannot tell where "
                "each decoder sample starts. Pass decoder_position_ids restarting at 0 in every decoder sample "
                "(packfree_plugin.packing.Seq2SeqPackedCollator builds them)"
            )
        return
    if tokens is None or encoder is None:
        missing = "decoder inputs or labels" if tokens is None else "encoder rows"
        raise ValueError(
            f"{name} got decoder_position_ids without {missing} to describe"
            " (a packed seq2seq batch passes input_ids and decoder_input_ids or labels, and no cache)"
        )
    decoder = Boundaries.from_model_inputs(batch_size=tokens.shape[0], seq_len=tokens.shape[1], device=tokens.device,
                                           position_ids=decoder_position_ids,
                                           attention_mask=arguments.get("decoder_attention_mask"))
    Seq2SeqBoundaries(encoder, decoder).attach()


def paired_decoder(outer: Boundaries | None, arguments: dict[str, Any], kwargs: dict) -> Boundaries | None:
    """The decoder's own boundaries when this call is the decoder of a seq2seq forward whose sides are paired
    (else None); the encoder's boundary keywords its parent forwarded through ``**kwargs`` give way to them."""
    pairing = Seq2SeqBoundaries.of(outer)
    if pairing is None or arguments.get("encoder_hidden_states") is None or \
            not fits(pairing.decoder, tokens_of(arguments)):
        return None
    for name in BOUNDARY_KWARGS:
        kwargs.pop(name, None)
    if "position_ids" in kwargs:
        kwargs["position_ids"] = pairing.decoder.position_ids
    return pairing.decoder

