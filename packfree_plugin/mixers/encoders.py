"""Encoders whose attention packfree's attention function cannot serve, one adapter per family (see :mod:`.registry`);
each class names its family in its entry (:data:`packfree_plugin.classes.CLASSES`).

These BERT-era encoders add the mask to their scores in code of their own (``scores + attention_mask``), build
position information from the row's shape inside the encoder (MPNet's relative-position bias, RoFormer's rotary
table, DeBERTa's relative positions), or mix tokens in ways no mask can confine (FNet's Fourier transform over
the sequence, ConvBERT's span convolutions, Nyströmformer's landmarks, MRA's blocks). Each is covered at the
level of its encoder, the module that receives the embedded row: the encoder runs on groups of samples of one
length under its stock attention (the generic tier with ``attention``), so every sample sees exactly the rows it
would see alone, and its row-shaped tables are built per sample. The ``ForCausalLM`` variants of some of them
turn the same encoder causal with ``config.is_decoder``; then samples are right-padded into groups under a causal
mask, as for any causal layer. Their embeddings and heads act per token and run on the packed row.

Classes whose entry is refused at load (BigBird's block-sparse attention, Funnel, Perceiver, Longformer) cannot be made
exact per sample; loading a model that holds one with packfree raises.
"""

from __future__ import annotations

from torch import nn

from .registry import MixerAdapter, register_adapter

__all__ = ["is_decoder"]


def is_decoder(layer: nn.Module) -> bool:
    """Whether a BERT-era encoder runs causally: its config's ``is_decoder`` (its ``ForCausalLM`` heads set it)."""
    return bool(layer.config.is_decoder)


# ------------------------------------------------------------------ encoders given the model's 4-D mask
DECODER_CAPABLE_ENCODERS = register_adapter(MixerAdapter(
    "bert_era_encoder", attention="eager", causal=is_decoder,
    notes="scores + mask in their own attention code; RoFormer's rotary table is built from the row's shape",
))
ENCODERS = register_adapter(MixerAdapter(
    "encoder", attention="eager", causal=False,
    notes="scores + mask in their own attention code; MPNet's relative-position bias is built from the row's "
          "shape; Nyströmformer's landmarks pool the sequence; ConvBERT's span convolutions and FNet's Fourier "
          "transform run along it; SqueezeBERT's grouped convolutions have kernel size 1 (per token: not mixers, "
          "but covered with its encoder)",
))
LUKE_ENCODER = register_adapter(MixerAdapter(
    "luke_encoder", hidden_arg="word_hidden_states", attention="eager", causal=False,
    notes="words only: entity hidden states attend with every word of the row and are refused with a packed row",
))
LAYOUTLM_ATTENTION = register_adapter(MixerAdapter(
    "layoutlm_attention", output_index=0, attention="sdpa", causal=False,
    notes="its model builds the additive padding mask itself, outside transformers' mask interface",
))
# ------------------------------------------------------------------ encoders given the 2-D padding mask
PADDING_MASK_ENCODERS = register_adapter(MixerAdapter(
    "padding_mask_encoder", token_args=("attention_mask",), attention="eager", causal=False,
    notes="DeBERTa's relative attention over positions built from the row's shape; YOSO's hashed attention; "
          "MRA's block-wise attention; each takes the [B, T] padding mask, which it gets per sample",
))
