"""The isolation proof: every packed sample's outputs equal that sample run alone on stock transformers.

:func:`prove` packs a few samples of different lengths into one row and runs the packfree model on it three times,
each time with the model's default ``use_cache``: boundaries from ``position_ids`` alone, as TRL sends them; with the
keyword arguments of ``DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)``; and with
those boundary keywords but no ``position_ids``. It runs each sample alone (``input_ids [1, n]`` and, where its
packed row carried ``position_ids``, its own slice of them, ``0 .. n-1``; an encoder-decoder also gets its ids as
``decoder_input_ids``, in the packed row too) on a stock twin with the same weights (``sdpa``, else ``eager``) and
compares the main output (``logits``, else ``last_hidden_state``): a per-token output ``[1, T, ...]`` sample by
sample, a pooled one (``[1, C]``) must come back once per sample. On a mismatch it names the modules where the packed
run first departs from the alone runs and, with the perturbation audit of :mod:`.audit`, those whose outputs crossed
samples.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..quirks.numbering import quiet
from ..forward.keywords import ATTN_IMPLEMENTATION
from ..forward.rope_ids import VISUAL_TOKEN_KEYS
from .audit import audit, record_outputs, with_decoder_inputs
from .shrink import TINY_VOCAB

__all__ = ["LENGTHS", "MODES", "Proof", "alone_batch", "build_pair", "build_stock", "main_output", "prove",
           "sample_tokens"]

LENGTHS = (6, 9, 5)
"""Packed sample lengths: each longer than a shrunk config's window / chunk (4 tokens)."""
MODES = ("position_ids", "collator", "cu_seq_lens")
"""How a packed row says where its samples start: restarting ``position_ids``; everything
``DataCollatorWithFlattening`` adds; its ``cu_seq_lens`` / ``seq_idx`` without ``position_ids``."""
_MODES_WITH_IDS = ("position_ids", "collator")
TOLERANCE = 1e-4
"""Largest |packed - alone| accepted, relative to ``max(1, max |alone|)`` (float32)."""


@dataclass
class Proof:
    """The verdict on one model: ``exact``, or the mode that failed with its error or its largest difference."""

    model_type: str
    cls: str
    stock: str
    exact: bool = False
    mode: str | None = None
    max_diff: float = 0.0
    error: str | None = None
    reason: str | None = None
    wrong_modules: list[str] = field(default_factory=list)
    leaking_modules: list[str] = field(default_factory=list)
    copy: str = "a tiny copy"  # which copy of the config was proved (:func:`.copies.proof_configs`)

    @property
    def kind(self) -> str:
        """``exact`` | ``error`` (packfree raised on a packed row) | ``wrong`` (it ran and gave other results)."""
        return "exact" if self.exact else ("error" if self.error is not None else "wrong")

    def summary(self) -> str:
        return f"{self.cls} ({self.model_type}): {self.verdict()}"

    def verdict(self) -> str:
        """What the proof found, without naming the model."""
        if self.exact:
            return f"every packed sample equals its stock {self.stock} run alone"
        if self.error is not None:
            return f"a packed row ({self.mode}) raised {self.error}"
        text = f"packed samples differ from each sample alone ({self.mode}: {self.reason})"
        if self.wrong_modules:
            text += f"; first wrong outputs in {', '.join(self.wrong_modules)}"
        if self.leaking_modules:
            text += f"; outputs that cross samples in {', '.join(self.leaking_modules)}"
        return text


_PLACEHOLDER_KEYS = (*VISUAL_TOKEN_KEYS, "audio_token_id", "audio_token_index")


def placeholder_tokens(config: Any) -> frozenset[int]:
    """The image/video/audio placeholder ids of ``config`` and its text config: a text-only proof must not draw them
    (stock fails on a placeholder without its media, and packfree refuses 2-D ids beside one)."""
    configs = [config] + ([config.get_text_config()] if hasattr(config, "get_text_config") else [])
    return frozenset(value for c in configs for key in _PLACEHOLDER_KEYS
                     if isinstance(value := getattr(c, key, None), int))


def sample_tokens(lengths: Sequence[int], vocab: int, *, seed: int = 0,
                  avoid: frozenset[int] = frozenset()) -> list[torch.Tensor]:
    """One ``[n]`` token tensor per length, ids in ``[3, vocab - 16)`` but ``avoid``: clear of pad/bos/eos, the top
    ids a shrunk config gives its other special tokens, and the placeholders passed."""
    generator = torch.Generator().manual_seed(seed)
    high = max(4, min(vocab, TINY_VOCAB) - 16)
    allowed = torch.tensor([token for token in range(3, high) if token not in avoid] or [3])
    return [allowed[torch.randint(0, len(allowed), (n,), generator=generator)] for n in lengths]


def packed_batch(samples: Sequence[torch.Tensor], mode: str) -> dict[str, Any]:
    """One packed row: ``input_ids`` and ``position_ids [1, T]``, plus in ``collator`` mode everything
    ``DataCollatorWithFlattening`` adds (``cu_seq_lens_q/k``, ``max_length_q/k``, ``seq_idx``); in ``cu_seq_lens``
    mode those without ``position_ids``."""
    from transformers import DataCollatorWithFlattening

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    flash = mode != "position_ids"
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash, return_seq_idx=flash)
    batch = collator([{"input_ids": s.tolist()} for s in samples])
    batch.pop("labels", None)
    if mode not in _MODES_WITH_IDS:
        batch.pop("position_ids")
    return dict(batch)


def alone_batch(sample: torch.Tensor, *, position_ids: bool = False) -> dict[str, torch.Tensor]:
    """``sample [n]`` run alone: ``input_ids [1, n]``, with ``position_ids`` ``0 .. n-1`` (the slice of a packed row's
    ids that a sample gets) when ``position_ids``."""
    batch = {"input_ids": sample[None]}
    if position_ids:
        batch["position_ids"] = torch.arange(len(sample), device=sample.device)[None]
    return batch


def main_output(output: Any) -> torch.Tensor:
    """The output a user reads: ``logits``, else ``last_hidden_state``, else the first tensor returned."""
    for name in ("logits", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    value = output[0] if isinstance(output, (tuple, list)) or hasattr(output, "to_tuple") else output
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"no tensor output in {type(output).__name__}")
    return value


def build_pair(cls: type, config, *, seed: int = 0) -> tuple[nn.Module, nn.Module, str]:
    """``(packfree_model, stock_model, stock_implementation)`` of class ``cls`` from ``config`` (copied),
    float32, eval mode, identical weights; stock is ``sdpa`` where the class has it, else ``eager``. ``"packfree"``
    must be registered (at start-up by default; else :func:`packfree_plugin.register`)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if ALL_ATTENTION_FUNCTIONS.get(ATTN_IMPLEMENTATION) is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION!r} is not registered with transformers (PACKFREE_AUTOLOAD=0?): call "
                           "packfree_plugin.register() before proving a class")
    torch.manual_seed(seed)
    model = _build(cls, config, ATTN_IMPLEMENTATION)
    stock, implementation = build_stock(cls, config)
    stock.load_state_dict(model.state_dict())
    if not all(torch.isfinite(p).all() for p in model.parameters()):  # e.g. built with initialisation off
        raise RuntimeError(f"the tiny {cls.__name__} has non-finite weights")
    return model, stock, implementation


def _build(cls: type, config, implementation: str) -> nn.Module:
    return cls._from_config(copy.deepcopy(config), attn_implementation=implementation, dtype=torch.float32,
                            experts_implementation="eager").eval()


def build_stock(cls: type, config) -> tuple[nn.Module, str]:
    """``(model, implementation)``: ``cls`` from ``config`` (copied) on ``sdpa``, else on ``eager``; float32, eval."""
    try:
        return _build(cls, config, "sdpa"), "sdpa"
    except (ValueError, ImportError):  # the class has no sdpa path
        return _build(cls, config, "eager"), "eager"


def alone_outputs(stock: nn.Module, samples: Sequence[torch.Tensor], *,
                  position_ids: bool = False) -> list[torch.Tensor]:
    """Main output of each sample run alone on ``stock`` (:func:`alone_batch`, and its ids as decoder inputs of an
    encoder-decoder; if stock's default cache raises, once more with ``use_cache=False``), float32."""
    outputs = []
    with torch.no_grad():
        for sample in samples:
            inputs = with_decoder_inputs(stock, alone_batch(sample, position_ids=position_ids))
            try:
                outputs.append(main_output(stock(**inputs)).float())
            except Exception:  # noqa: BLE001 - e.g. xLSTM's default cache fails on stock; retry without it
                outputs.append(main_output(stock(**inputs, use_cache=False)).float())
    return outputs


def _compare(packed: torch.Tensor, alone: list[torch.Tensor], lengths: Sequence[int]) -> tuple[float, str | None]:
    """Largest relative difference, and why the outputs cannot be compared (None when they can)."""
    total = sum(lengths)
    if packed.ndim >= 2 and packed.shape[0] == 1 and packed.shape[1] == total:
        pieces = packed.float().split(list(lengths), dim=1)
    elif packed.shape[0] == len(lengths):
        pieces = packed.float().split(1, dim=0)
    else:
        return float("inf"), (f"one output {list(packed.shape)} for the row, not one per sample "
                              f"({len(lengths)} x {list(alone[0].shape)})")
    worst = 0.0
    for piece, expected in zip(pieces, alone):
        if piece.shape != expected.shape:
            return float("inf"), f"output {list(piece.shape)} for a sample whose alone output is {list(expected.shape)}"
        scale = max(1.0, float(expected.abs().max()))
        diff = float((piece - expected).abs().max().nan_to_num(nan=float("inf"))) / scale
        worst = max(worst, diff)
    return worst, None


def _first_outputs(model: nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Module name -> first floating tensor of its first call's output (float32), in completion order."""
    first = {}
    for name, calls in record_outputs(model, batch).items():
        floats = [t for t in calls[0] if t.is_floating_point()]
        if floats:
            first[name] = floats[0].float()
    return first


def _wrong_modules(model: nn.Module, stock: nn.Module, samples: Sequence[torch.Tensor], mode: str,
                   limit: int = 3) -> list[str]:
    """The first modules (in completion order) whose per-token output on the packed row differs from the same
    module's output on a sample run alone on stock."""
    lengths = [len(s) for s in samples]
    packed = _first_outputs(model, with_decoder_inputs(model, packed_batch(samples, mode)))
    with_ids = mode in _MODES_WITH_IDS
    alone = [_first_outputs(stock, with_decoder_inputs(stock, alone_batch(s, position_ids=with_ids))) for s in samples]
    wrong = []
    for name, tensor in packed.items():
        if tensor.ndim < 2 or tensor.shape[0] != 1 or tensor.shape[1] != sum(lengths):
            continue
        for piece, reference in zip(tensor.split(lengths, dim=1), alone):
            expected = reference.get(name)
            if expected is None or expected.shape != piece.shape:
                continue
            if float((piece - expected).abs().max()) > TOLERANCE * max(1.0, float(expected.abs().max())):
                wrong.append(f"{name or '<model>'} ({type(model.get_submodule(name)).__name__})")
                break
        if len(wrong) >= limit:
            break
    return wrong


def prove(model: nn.Module, stock: nn.Module, *, stock_name: str = "sdpa", lengths: Sequence[int] = LENGTHS,
          seed: int = 0, diagnose: bool = True) -> Proof:
    """Compare ``model`` (packfree) on packed rows with ``stock`` (same weights) on each sample alone.

    An exception from ``stock`` propagates (the proof cannot run); one from ``model`` is the verdict.
    ``diagnose``: on a mismatch, name the modules that go wrong and those that leak (a few more forwards).
    """
    config = model.config
    proof = Proof(getattr(config, "model_type", "?"), type(model).__name__, stock_name)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(config, "vocab_size", None) or getattr(text_config, "vocab_size", None)
    samples = sample_tokens(lengths, int(vocab or TINY_VOCAB), seed=seed, avoid=placeholder_tokens(config))
    alone: dict[bool, list[torch.Tensor]] = {}  # with position ids or not -> each sample's stock output
    for mode in MODES:
        batch = with_decoder_inputs(model, packed_batch(samples, mode))
        try:
            with torch.no_grad(), quiet():  # 0-based ids on purpose, on a copy of the user's class: no warning
                packed = main_output(model(**batch))
        except Exception as error:  # noqa: BLE001 - any failure on a packed row is the verdict
            proof.mode, proof.error = mode, f"{type(error).__name__}: {error}"
            return proof
        with_ids = mode in _MODES_WITH_IDS
        if with_ids not in alone:  # after the packed run: a model that cannot take ids fails there, as the verdict
            alone[with_ids] = alone_outputs(stock, samples, position_ids=with_ids)
        diff, reason = _compare(packed, alone[with_ids], lengths)
        if reason is not None or diff > TOLERANCE:
            proof.mode, proof.max_diff = mode, diff
            proof.reason = reason or f"max |packed - alone| = {diff:.3g} x max(1, |alone|)"
            if diagnose:
                _diagnose(proof, model, stock, samples, mode)
            return proof
        proof.max_diff = max(proof.max_diff, diff)
    proof.exact = True
    return proof


def _diagnose(proof: Proof, model: nn.Module, stock: nn.Module, samples: Sequence[torch.Tensor], mode: str) -> None:
    try:
        proof.wrong_modules = _wrong_modules(model, stock, samples, mode)
        leaks = audit(model, lengths=[len(s) for s in samples]).leaks
        proof.leaking_modules = [f"{leak.module or '<model>'} ({leak.cls})" for leak in leaks[:4]]
    except Exception as error:  # noqa: BLE001 - the verdict stands; the diagnosis is best effort
        proof.wrong_modules.append(f"(diagnosis failed: {type(error).__name__}: {error})")
