"""TRL's preference and RL trainers on packed rows: DPO, reward models and GRPO's log-probs.

TRL 1.16 packs only for SFT: ``DPOConfig(padding_free=True)`` logs that it is "temporarily unavailable" and pads,
and the reward and GRPO trainers have no padding-free mode. The trainers here are TRL's, with one change: every
*scoring* forward runs on packed rows. TRL's collators still build their padded batches (a few ``[2B, L]`` integer
tensors), and all of TRL's loss and metric code still runs on them. Only the model call in between is packed:

1. :class:`~packfree_plugin.integrations.packed_rows.PackedRows` reads the call's padded ``attention_mask``
   ``[B, L]`` (each row's ones contiguous: right-, left- or both-side padding) and packs the real tokens of its rows
   into ``R`` rows of ``T`` tokens: one row when no budget is given, else rows of at most ``max_tokens_per_row``
   tokens (best-fit decreasing), padded to the fullest.
2. The model runs on the packed rows, with each sample's boundaries (:class:`~packfree_plugin.Boundaries`) and
   positions restarting at 0: each sample gives what it gives alone.
3. The per-sample outputs go back to the padded layout, so the loss sees the same tensors as TRL's padded path:
   a causal LM's per-token log-probs (and entropies, ...) ``[B, L - 1]``, zero where nothing is predicted; a reward
   head's scores ``[B, 1]`` in row order. DPO's log-prob sums stay per sequence and its loss per pair.

Labels never cross a sample: a sample's first token is never predicted (as for the sample alone), so the last
token of the sample before it in a packed row predicts nothing. Calls that are not scoring calls (generation, a
plain forward, a batch with no padding) run as stock.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import trl
from torch import nn

from ..forward.context import is_prepared
from ..forward.keywords import ATTN_IMPLEMENTATION
from ..forward.signature import class_forward_parameters
from .packed_rows import PackedRows

__all__ = [
    "PackedDPOTrainer",
    "PackedGRPOTrainer",
    "PackedRewardTrainer",
    "PackedRows",  # the layout, from packed_rows.py: TRL's packed forwards are where it is used
    "pack_scoring",
]

_PER_TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
"""The per-token ``[B, L - 1]`` fields of TRL's ``FusedCausalLMOutput``."""
_TOKEN_INPUTS = ("input_ids", "inputs_embeds")
_SCORING_ATTR = "_packfree_packed_scoring"


# ------------------------------------------------------------------------------------------ set-up checks
def _check_packfree(model: nn.Module, role: str) -> None:
    """``model`` must be a text model loaded with ``attn_implementation="packfree"`` (or ``packfree_plugin.apply``)."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"padding-free {role} runs on packed rows, which need attn_implementation='packfree', but it was loaded "
            f"with {implementation!r}. Load it with from_pretrained(..., attn_implementation='packfree') (or call "
            "packfree_plugin.apply(model)); a model on another implementation would score the packed samples "
            "as one sequence"
        )
    if not is_prepared(model):
        raise ValueError(f"the {role} was switched to 'packfree' but never prepared: call packfree_plugin.apply(model)")
    if config.get_text_config() is not config:
        raise ValueError(
            f"the {role} is a {type(model).__name__}: packing TRL's scoring forwards covers text models only "
            "(images ride in other tensors than the rows); train it padded, without padding_free"
        )


def _unwrapped(trainer: Any, model: nn.Module) -> nn.Module:
    from accelerate.utils import is_peft_model

    model = trainer.accelerator.unwrap_model(model)
    return model.get_base_model() if is_peft_model(model) else model


# ------------------------------------------------------------------------------ causal LM scoring forwards
def _refuse_unpackable(kwargs: dict[str, Any], mask: torch.Tensor) -> None:
    for name, value in kwargs.items():
        if name in _TOKEN_INPUTS or name == "attention_mask":
            continue
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and tuple(value.shape[:2]) == tuple(mask.shape):
            raise ValueError(
                f"a scoring forward was called with {name} {list(value.shape)}, laid out like its padded rows: "
                f"packed scoring moves input_ids/inputs_embeds and attention_mask only, and would leave {name} "
                "out of step with the packed tokens"
            )


@dataclass
class _Scoring:
    """What :func:`pack_scoring` installs on a model: its original forward and the packing it applies."""

    original: Callable[..., Any]
    max_tokens_per_row: int | None
    passes_position_ids: bool
    pad_token_id: int


def _is_padded(mask: Any) -> bool:
    """Whether ``mask`` is a 2-D padding mask ``[B, L]`` with padding: a batch that packing changes."""
    return isinstance(mask, torch.Tensor) and mask.ndim == 2 and not bool(mask.all())


def _packed_call(kwargs: dict[str, Any], max_tokens_per_row: int | None, pad_token_id: int, *, position_ids: bool,
                 not_inputs: tuple[str, ...] = ()) -> tuple[PackedRows, dict[str, Any]]:
    """The packed rows of a padded call's ``attention_mask`` and the call's keyword arguments on them: its token
    inputs packed (``input_ids`` filled with ``pad_token_id``), the rows' padding tails as the mask (MoE load
    balancing reads it too), their positions where ``position_ids``, their boundaries; ``not_inputs`` dropped.
    Refuses other per-token inputs (:func:`_refuse_unpackable`)."""
    mask = kwargs["attention_mask"]
    _refuse_unpackable(kwargs, mask)
    rows = PackedRows.of(mask, max_tokens_per_row)
    call = {name: value for name, value in kwargs.items()
            if name not in (*_TOKEN_INPUTS, "attention_mask", "packfree_boundaries", *not_inputs)}
    for name in _TOKEN_INPUTS:
        if kwargs.get(name) is not None:
            call[name] = rows.pack(kwargs[name], fill=pad_token_id if name == "input_ids" else 0)
    if rows.attention_mask is not None:
        call["attention_mask"] = rows.attention_mask
    if position_ids:
        call["position_ids"] = rows.position_ids
    call["packfree_boundaries"] = rows.boundaries
    return rows, call


def _score_packed(scoring: _Scoring, labels: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    rows, call = _packed_call(kwargs, scoring.max_tokens_per_row, scoring.pad_token_id,
                              position_ids=scoring.passes_position_ids)
    output = scoring.original(fused_lm_head=True, labels=rows.packed_labels(labels), **call)
    for name in _PER_TOKEN_FIELDS:
        value = getattr(output, name, None)
        if value is not None:
            setattr(output, name, rows.unpack_predictions(value))
    return output


def _is_fused_head(forward: Any) -> bool:
    """Whether ``forward`` is the bound forward ``trl.trainer.utils.add_fused_lm_head`` installs."""
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    return getattr(code, "co_name", None) == "_fused_forward"  # its functools.wraps keeps the model's name


def pack_scoring(model: nn.Module, *, max_tokens_per_row: int | None = None, role: str = "model") -> None:
    """Run ``model``'s fused-LM-head calls (TRL's scoring forwards) on packed rows; idempotent.

    ``model`` is a causal LM that TRL gave its fused LM head (``trl.trainer.utils.add_fused_lm_head``; under PEFT,
    the base model). A call ``model(input_ids=[B, L], attention_mask=[B, L], labels=[B, L], fused_lm_head=True)``
    with padding is packed (:class:`PackedRows`), run, and its per-token outputs returned in the padded layout,
    ``[B, L - 1]``. Every other call (generation, a plain forward, rows without padding) runs unchanged.

    Raises:
        ValueError: ``model`` is not a packfree text model, or has no fused LM head.
    """
    _check_packfree(model, role)
    forward = model.__dict__.get("forward")
    installed = getattr(model, _SCORING_ATTR, None)
    if installed is not None:
        installed.max_tokens_per_row = max_tokens_per_row
        return
    # accelerate's mixed-precision wrapper (its prepare_model, which TRL runs on a reference model at set-up under
    # bf16) keeps the forward it wraps as _original_forward; packing wraps the outer one, so autocast still applies
    fused = forward if _is_fused_head(forward) else model.__dict__.get("_original_forward")
    if not _is_fused_head(fused):
        raise ValueError(
            f"the {role} has no TRL fused LM head (trl.trainer.utils.add_fused_lm_head), whose calls are the "
            "scoring forwards this packs"
        )
    backbone = model.base_model
    if inspect.signature(type(backbone).forward).parameters.get("kwargs") is None:
        raise ValueError(f"{type(backbone).__name__}.forward takes no **kwargs, so it cannot be given the boundaries")
    pad_token_id = model.config.get_text_config().pad_token_id
    scoring = _Scoring(forward, max_tokens_per_row, "position_ids" in class_forward_parameters(type(backbone)).names,
                       0 if pad_token_id is None else int(pad_token_id))

    @functools.wraps(forward)
    def packed_forward(*args: Any, fused_lm_head: bool = False, labels: torch.Tensor | None = None, **kwargs: Any):
        if (fused_lm_head and labels is not None and not args and kwargs.get("shift_labels") is None
                and _is_padded(kwargs.get("attention_mask"))):
            return _score_packed(scoring, labels, kwargs)
        return forward(*args, fused_lm_head=fused_lm_head, labels=labels, **kwargs)

    model.forward = packed_forward
    setattr(model, _SCORING_ATTR, scoring)


# ------------------------------------------------------------------------------------------- the trainers
@contextlib.contextmanager
def _silenced(logger_name: str, message: str) -> Iterator[None]:
    """Drop log records of ``logger_name`` that contain ``message`` (TRL's fallback warning, which no longer holds)."""

    class Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return message not in record.getMessage()

    logger, drop = logging.getLogger(logger_name), Drop()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _config_of(init: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """The ``args`` (config) argument of a call of TRL's bound trainer ``__init__``, positional or not."""
    bound = inspect.signature(init).bind_partial(*args, **kwargs)
    return bound.arguments.get("args")


class _PackedScoringTrainer:
    """Mixin: pack the policy's and the reference model's scoring forwards once TRL has built them."""

    _packfree_max_tokens: int | None
    _packfree_enabled: bool

    def _pack_scoring_models(self) -> None:
        if not self._packfree_enabled:
            return
        pack_scoring(_unwrapped(self, self.model), max_tokens_per_row=self._packfree_max_tokens, role="policy")
        reference = getattr(self, "ref_model", None)
        if reference is not None:
            pack_scoring(_unwrapped(self, reference), max_tokens_per_row=self._packfree_max_tokens,
                         role="reference model")


class PackedDPOTrainer(_PackedScoringTrainer, trl.DPOTrainer):
    """``trl.DPOTrainer`` whose ``DPOConfig(padding_free=True)`` packs: the policy's and the reference's
    log-probs of every prompt + chosen and prompt + rejected are computed on packed rows (one row per batch, or
    rows of at most ``max_tokens_per_row`` tokens). Loss, metrics and gradients are TRL's, per pair, on the same
    per-sequence log-prob sums as padded. With ``padding_free=False`` it is ``trl.DPOTrainer``.

    The reference is a ``ref_model`` (loaded with ``attn_implementation="packfree"``; TRL's own copy of a model
    given by path is), the PEFT base model (adapter off), or precomputed log-probs, computed packed as well.
    """

    def __init__(self, *args: Any, max_tokens_per_row: int | None = None, **kwargs: Any) -> None:
        # TRL's own __init__ (the base), not ``trl.DPOTrainer``: code that patches that name to this class is common
        config = _config_of(super().__init__, args, kwargs)
        self._packfree_enabled = bool(getattr(config, "padding_free", False))
        self._packfree_max_tokens = max_tokens_per_row
        with _silenced("trl.trainer.dpo_trainer", "`padding_free=True` is temporarily unavailable"):
            super().__init__(*args, **kwargs)
        self._pack_scoring_models()
        self.padding_free = self._packfree_enabled

    def compute_ref_log_probs(self, model, inputs):  # precomputation runs inside DPOTrainer.__init__
        self._pack_scoring_models()
        return super().compute_ref_log_probs(model, inputs)


class PackedGRPOTrainer(_PackedScoringTrainer, trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose log-prob forwards (the policy's, the old policy's and the reference's) run on
    packed rows: prompt + completion per sample, one row per forward or rows of at most ``max_tokens_per_row``.
    Generation is TRL's, untouched; loss, KL and advantages are TRL's, on the same per-token log-probs as padded.
    ``padding_free=False`` makes it ``trl.GRPOTrainer``."""

    def __init__(self, *args: Any, padding_free: bool = True, max_tokens_per_row: int | None = None,
                 **kwargs: Any) -> None:
        self._packfree_enabled = padding_free
        self._packfree_max_tokens = max_tokens_per_row
        super().__init__(*args, **kwargs)
        self._pack_scoring_models()


class _PackedHeadCall:
    """Calls a reward model on the packed form of its padded batch and returns its scores in row order."""

    def __init__(self, model: nn.Module, max_tokens_per_row: int | None, pad_token_id: int) -> None:
        self.model = model
        self.max_tokens_per_row = max_tokens_per_row
        self.pad_token_id = pad_token_id

    def __call__(self, **kwargs: Any) -> Any:
        if not _is_padded(kwargs.get("attention_mask")) or kwargs.get("input_ids") is None:
            return self.model(**kwargs)
        # TRL hands its per-pair "margin" [B] to the model too (the loss reads it from the batch): it is no model input,
        # and packfree's attention refuses an argument it does not know
        rows, call = _packed_call(kwargs, self.max_tokens_per_row, self.pad_token_id, position_ids=True,
                                  not_inputs=("margin",))
        output = self.model(**call)
        samples = rows.order.numel()
        if output.logits.shape[0] != samples:  # index_put would broadcast one score to every sample, silently
            raise ValueError(
                f"the reward model's head returned {output.logits.shape[0]} scores for the {samples} packed samples "
                f"(logits {list(output.logits.shape)}): it pooled once per packed row, not once per sample; a head "
                "packfree does not pool per sample (e.g. its score layer wrapped by an adapter) cannot score packed "
                "rows, so train it with padding_free=False"
            )
        output.logits = rows.in_row_order(output.logits)
        return output


class PackedRewardTrainer(trl.RewardTrainer):
    """``trl.RewardTrainer`` scoring chosen and rejected sequences on packed rows: the sequence-classification
    head scores each sample's last token (packfree pools once per packed sample), and the scores return in the
    padded batch's order, so loss and metrics are TRL's. ``padding_free=False`` makes it ``trl.RewardTrainer``."""

    def __init__(self, *args: Any, padding_free: bool = True, max_tokens_per_row: int | None = None,
                 **kwargs: Any) -> None:
        self._packfree_enabled = padding_free
        self._packfree_max_tokens = max_tokens_per_row
        super().__init__(*args, **kwargs)
        if padding_free:
            _check_packfree(_unwrapped(self, self.model), "reward model")

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._packfree_enabled:
            pad_token_id = _unwrapped(self, self.model).config.get_text_config().pad_token_id or 0
            model = _PackedHeadCall(model, self._packfree_max_tokens, pad_token_id)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
