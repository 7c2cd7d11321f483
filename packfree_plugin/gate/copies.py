"""The copies of a config the gate proves on, best first (:func:`proof_configs`): the tiny copy
(:func:`packfree_plugin.gate.shrink.shrink_config`), the tiny copy with each layer kind twice (weights tied across
layers of a kind), then :func:`cut_config`: the user's config cut in depth and with every width divided by one
power of two (:func:`cut_factors`), for configs whose tiny copy cannot be built."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .config_keys import CHUNK_KEYS, HIDDEN_KEYS, TOPK_KEYS, WINDOW_KEYS, is_sub_config, is_width
from .config_values import rebuilt, refit, serialized
from .layer_kinds import cut_depth
from .shrink import TINY_HIDDEN, TINY_VOCAB, WINDOW, shrink_config

__all__ = ["cut_config", "cut_factors", "proof_configs"]

def _widths(values: dict[str, Any]) -> list[int]:
    """Every width of a config dict and of its sub-configs."""
    own = [v for k, v in values.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0 and is_width(k)]
    return own + [w for v in values.values() if is_sub_config(v) for w in _widths(v)]


def _cut_values(values: dict[str, Any], factor: int) -> None:
    """Cut one config dict in place: every width divided by ``factor`` (ratios between widths, head counts and
    per-layer lists kept), each layer kind kept twice, a tiny vocabulary, windows and chunks of
    :data:`packfree_plugin.gate.shrink.WINDOW`."""
    for value in values.values():
        if is_sub_config(value):
            _cut_values(value, factor)
    cut_depth(values, repeats=2)
    for name, value in list(values.items()):
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if is_width(name) and value % factor == 0:
            values[name] = value // factor
        elif (name in WINDOW_KEYS or name in CHUNK_KEYS or name in TOPK_KEYS) and value > WINDOW:
            values[name] = WINDOW
        elif name == "vocab_size" and value > TINY_VOCAB:
            values[name] = TINY_VOCAB
    refit(values, TINY_VOCAB)


def cut_factors(config) -> list[int]:
    """The width factors of :func:`cut_config` for ``config``, largest first: the powers of two from the largest
    that divides every width (the hidden size staying at least 64) down to 1 (widths as they are)."""
    values = serialized(config)
    widths = _widths(values)
    hidden = next((values[k] for k in HIDDEN_KEYS if isinstance(values.get(k), int)), None)
    factor = 1
    while widths and all(w % (factor * 2) == 0 for w in widths) and (hidden or 0) // (factor * 2) >= TINY_HIDDEN:
        factor *= 2
    return [factor >> shift for shift in range(factor.bit_length())]


def cut_config(config, factor: int):
    """A copy of ``config`` cut in depth (each layer kind twice) and in width (every width divided by ``factor``):
    for configs whose tiny copy (:func:`packfree_plugin.gate.shrink.shrink_config`) cannot be built."""
    values = serialized(config)
    _cut_values(values, factor)
    return rebuilt(config, values)


def proof_configs(config) -> list[tuple[str, Callable[[], Any]]]:
    """``(description, make_config)`` of the configs to prove ``config``'s model on, best first: its tiny copy,
    the tiny copy with each layer kind twice, then :func:`cut_config` at each of :func:`cut_factors`."""
    return [("a tiny copy", lambda: shrink_config(config)),
            ("a tiny copy with each layer kind twice", lambda: shrink_config(config, repeats=2)),
            *[(f"a copy cut in depth and in width by {factor}", lambda factor=factor: cut_config(config, factor))
              for factor in cut_factors(config)]]
