"""Seq2seq decoder inputs made per sample.

Models that make their decoder inputs by shifting ``labels`` (or, BART's denoising default, ``input_ids``) right
(:attr:`~packfree_plugin.classes.ClassEntry.shifted_decoder_input`) would shift a packed row as one sequence, so
every sample but the first would start from the previous sample's last token. On a packed row without
``decoder_input_ids`` packfree passes the model's own shift applied to each sample: a step of the model's entry
(:func:`packfree_plugin.forward.hook.add_step`), run after the entry has pushed this forward's boundaries.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn

from ..boundaries import Boundaries, Seq2SeqBoundaries
from ..classes import entry_of
from ..forward.context import boundaries_here
from ..forward.signature import class_forward_parameters

__all__ = ["decoder_inputs_step"]


def _shift_per_sample(shift: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, boundaries: Boundaries,
                      pad_token_id: int) -> torch.Tensor:
    """``input_ids [B, T]`` -> ``[B, T]``: ``shift`` applied to each sample on its own. The packed row's shift is
    right everywhere but at each sample's first token, which gets column 0 of ``shift`` run on the samples
    right-padded with ``pad_token_id`` (what ``shift`` ignores when it looks for a sample's last token)."""
    shifted = shift(input_ids).reshape(-1).clone()
    samples = [(start, length) for start, length, pad in
               zip(boundaries.offsets, boundaries.lengths, boundaries.padding) if not pad]
    total = boundaries.batch_size * boundaries.seq_len
    index = torch.full((len(samples), max(length for _, length in samples)), total, dtype=torch.long)
    for row, (start, length) in enumerate(samples):
        index[row, :length] = torch.arange(start, start + length)
    flat = torch.cat([input_ids.reshape(-1), input_ids.new_full((1,), pad_token_id)])
    firsts = shift(flat[index.to(flat.device)])[:, 0]
    shifted[torch.tensor([start for start, _ in samples], device=shifted.device)] = firsts
    return shifted.view_as(input_ids)


@torch.compiler.disable  # reads the packing on the host: a graph break, not a recompile per packing
def decoder_inputs_step(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """On a packed row without decoder inputs, pass the per-sample shift of the argument the model would shift
    (its quirk's ``shifted_decoder_input``) as ``decoder_input_ids`` (a step of the model's entry, run after it has
    pushed this forward's boundaries). ``labels`` are cut by the decoder's own boundaries where the batch has them
    (``decoder_position_ids``), else by the encoder's."""
    source_name = entry_of(type(module)).shifted_decoder_input
    parameters = class_forward_parameters(type(module))
    arguments = parameters.bind((module, *args), kwargs)
    source = arguments.get(source_name)
    if (not isinstance(source, torch.Tensor) or source.ndim != 2
            or any(arguments.get(name) is not None for name in ("decoder_input_ids", "decoder_inputs_embeds"))):
        return None
    pairing = Seq2SeqBoundaries.of(boundaries_here())
    if pairing is not None and source_name == "labels":  # labels are the decoder's rows, cut by its own boundaries
        decoder = pairing.decoder
        boundaries = decoder if decoder.is_packed and decoder.describes(*source.shape) else None
    else:
        boundaries = boundaries_here(rows=source, packed=True)
    if boundaries is None:
        return None
    decoder_input_ids = _shift_per_sample(_model_shift(module), source, boundaries, module.config.pad_token_id)
    index = parameters.names.index("decoder_input_ids") - 1  # without self
    if index < len(args):
        args = (*args[:index], decoder_input_ids, *args[index + 1:])
    else:
        kwargs = {**kwargs, "decoder_input_ids": decoder_input_ids}
    return args, kwargs


def _model_shift(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``ids [B, T] -> [B, T]``: the shift right ``module``'s forward applies to make its decoder inputs."""
    shift = getattr(sys.modules[type(module).__module__], "shift_tokens_right", None)
    if shift is None:  # the T5 family: a method reading its config
        return module._shift_right
    config = module.config
    options = {"decoder_start_token_id": config.decoder_start_token_id} if _takes_start_token(shift) else {}
    return functools.partial(shift, pad_token_id=config.pad_token_id, **options)


@functools.cache
def _takes_start_token(shift: Callable) -> bool:
    """Whether a modeling module's ``shift_tokens_right`` takes ``decoder_start_token_id`` (read once per module)."""
    return "decoder_start_token_id" in inspect.signature(shift).parameters
