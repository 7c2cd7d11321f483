"""One declarative entry per family of sequence mixers (see :mod:`.registry`)."""

from __future__ import annotations

from .registry import MixerAdapter, register_adapter

NOT_MIXERS: frozenset[str] = frozenset()
"""Classes that match the mixer heuristics but mix nothing along the sequence (e.g. a vision patch conv)."""

GATED_DELTA = register_adapter(MixerAdapter("gated_delta", ("Qwen3NextGatedDeltaNet",)))
MAMBA2 = register_adapter(MixerAdapter("mamba2", ("Mamba2Mixer",)))
SHORT_CONV = register_adapter(MixerAdapter("short_conv", ("Lfm2ShortConv",)))
