"""Per-segment positions: every packed sample is numbered the way the model numbers that sample alone (with its own
slice of the caller's ``position_ids``, where the caller passes them).

Most models read their positions from ``position_ids``, which packfree's boundaries restart in every sample.
Some compute positions themselves, and on a packed row they would number the whole row as one sequence. A
``numbering`` quirk of the embedding module's class (:data:`packfree_plugin.classes.CLASSES`) makes each such
module number every sample on its own while a packed row is in flight (:func:`~.forward.context.boundaries_here`
with ``packed=True`` returns boundaries with more than one sample in some row). With one sample per row (unpacked, padded,
``generate()``, decoding) the module's own forward runs untouched. The numbering rules:

- ``after_padding_idx``: fairseq-style embeddings (RoBERTa and its copies): a sample's tokens are numbered
  ``padding_idx + 1, padding_idx + 2, ...`` (padding tokens get ``padding_idx``), as
  ``create_position_ids_from_input_ids`` numbers a lone sample (without the rule, positions would run on across
  samples).
- ``position_buffer``: embeddings that number a lone sample from their ``position_ids`` buffer (MRA's starts
  at 2): token ``t`` of a sample gets ``buffer[t]``.
- ``by_shape``: positional embeddings computed from the input's shape alone (BART-style learned tables with an
  offset, sinusoidal tables): the module runs once for the longest sample's shape, and every token takes the
  row of its position inside its sample. Rows longer than the table are fine as long as each sample fits.
- ``per_sample``: embeddings that mix neighbouring tokens (MobileBERT's trigram input concatenates the previous
  and next tokens' embeddings; TrOCR's sinusoidal positions count non-padding tokens): the module runs on each
  group of equal-length samples, so no sample sees another's tokens.

**The caller's ``position_ids`` win.** Where the caller passes ``position_ids``, the module reads them as stock does,
token by token (``per_sample`` embeddings: sample by sample, each with its slice), so every sample gets what it gets
alone called with its own slice of those ids (packed 0-based ids give a RoBERTa-style sample positions ``0, 1, ...``,
as stock does with them, and as transformers' padding-free tests expect). The rules above number a packed sample only
where no ids were passed (boundaries from ``cu_seq_lens`` or ``seq_idx`` alone; the ids packfree then hands the model,
``Boundaries.position_ids``, are its own and do not count as the caller's, nor do ids a model makes itself, such as
BART's decoder's ``0 .. T-1`` over the row: only the very tensor the caller passed,
:attr:`Boundaries.callers_position_ids`, does): each sample is numbered the way the model numbers a lone sample called
without ``position_ids``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..boundaries import Boundaries
from ..classes import entry_of
from ..forward.context import boundaries_here
from ..mixers.generic import run_unpacked
from ..forward.instance import install, own_forward, own_parameters, uninstall
from .numbering import Numbering, check_callers_ids, lone_sample_numbering, mark

__all__ = ["install_numbering", "numbering_of", "uninstall_numbering"]

_TAG = "position_"
"""Keeps these instance forwards apart from the other adapters' (:mod:`packfree_plugin.forward.instance`)."""

Rule = Callable[[nn.Module, Callable, Boundaries, dict[str, Any]], Any]
"""``(module, own_forward, boundaries, bound_arguments) -> output`` for a packed row."""


# ------------------------------------------------------------------------------------ numbering rules
def _count_in_sample(flags: torch.Tensor, boundaries: Boundaries) -> torch.Tensor:
    """``flags [B, T]`` bool -> ``[B, T]`` int64: how many flagged tokens the token's sample holds up to and
    including it (a cumulative sum that restarts at every segment)."""
    batch = flags.shape[0]
    local = boundaries.position_ids.to(flags.device)
    start = torch.arange(boundaries.seq_len, device=flags.device) - local  # column where each token's segment starts
    running = flags.long().cumsum(1)
    before = torch.cat([running.new_zeros(batch, 1), running], dim=1).gather(1, start)  # flagged before the segment
    return running - before


def _after_padding_idx(module: nn.Module, forward: Callable, boundaries: Boundaries,
                       arguments: dict[str, Any]) -> Any:
    input_ids = arguments.get("input_ids")
    if input_ids is not None:
        counted = input_ids != module.padding_idx
    else:
        counted = torch.ones(arguments["inputs_embeds"].shape[:2], dtype=torch.bool,
                             device=arguments["inputs_embeds"].device)
    arguments["position_ids"] = module.padding_idx + _count_in_sample(counted, boundaries) * counted
    return forward(**arguments)


def _position_buffer(module: nn.Module, forward: Callable, boundaries: Boundaries,
                     arguments: dict[str, Any]) -> Any:
    arguments["position_ids"] = module.position_ids[0][boundaries.position_ids.to(module.position_ids.device)]
    return forward(**arguments)


def _shrink(name: str, value: Any, boundaries: Boundaries, length: int) -> Any:
    """A per-token argument (``[B, T, ...]`` or ``[1, T, ...]`` tensor, ``[T]`` positions, a ``(B, T)`` shape)
    cut to one row of ``length`` tokens, ``position_ids`` made ``0 .. length-1`` (what the model passes for a
    lone sample; a packed row may carry the caller's ids); anything else unchanged."""
    seq_len = boundaries.seq_len
    if isinstance(value, torch.Tensor):
        if value.ndim >= 2 and value.shape[1] == seq_len and value.shape[0] in (1, boundaries.batch_size):
            value = value[:1, :length]
        elif _is_codebook_ids(value) and value.shape[2] == seq_len and value.shape[0] in (1, boundaries.batch_size):
            value = value[:1, :, :length]
        elif value.ndim == 1 and value.shape[0] == seq_len:
            value = value[:length]
        else:
            return value
        if name == "position_ids":
            value = torch.arange(length, device=value.device).view(value.shape)
        return value
    elif isinstance(value, tuple) and len(value) >= 2 and tuple(value[:2]) == (boundaries.batch_size, seq_len):
        return type(value)((1, length, *value[2:]))
    return value


def _by_shape(module: nn.Module, forward: Callable, boundaries: Boundaries, arguments: dict[str, Any]) -> Any:
    longest = boundaries.max_seqlen
    table = forward(**{name: _shrink(name, value, boundaries, longest) for name, value in arguments.items()})
    table = table.reshape(longest, table.shape[-1])  # positions 0 .. longest-1 of one sample
    return table[boundaries.position_ids.to(table.device)]  # [B, T, D]


def _per_sample(module: nn.Module, forward: Callable, boundaries: Boundaries, arguments: dict[str, Any]) -> Any:
    if not _callers_ids(arguments.get("position_ids"), boundaries):
        arguments.pop("position_ids", None)  # each sample numbered as the module numbers a lone sample
    # else the caller's ids are cut per sample below, with the tokens
    token_names = tuple(name for name, value in arguments.items()
                        if isinstance(value, torch.Tensor) and value.ndim >= 2)
    fixed = {name: value for name, value in arguments.items() if name not in token_names}

    def run(tokens: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return forward(**fixed, **dict(zip(token_names, tokens)))

    # max_waste=0: every group holds samples of one length, so no sample is padded and none sees padding
    return run_unpacked(run, tuple(arguments[name] for name in token_names), boundaries, max_waste=0.0)


RULES: dict[str, Rule] = {
    "after_padding_idx": _after_padding_idx,
    "position_buffer": _position_buffer,
    "by_shape": _by_shape,
    "per_sample": _per_sample,
}


# ---------------------------------------------------------------------------------------- the wrapper
def _is_codebook_ids(value: torch.Tensor) -> bool:
    """``[B, codebooks, T]`` token ids (MusicGen's parallel audio-code streams)."""
    return value.ndim == 3 and not value.is_floating_point()


def _row_length(arguments: dict[str, Any]) -> int | None:
    """``T`` of the module's input: its first ``[B, T, ...]`` tensor, ``[B, codebooks, T]`` ids, ``(B, T)`` shape or
    ``[T]`` positions."""
    for value in arguments.values():
        if isinstance(value, torch.Tensor) and _is_codebook_ids(value):
            return int(value.shape[2])
        if isinstance(value, torch.Tensor) and value.ndim >= 1:
            return int(value.shape[1] if value.ndim >= 2 else value.shape[0])
        if isinstance(value, tuple) and len(value) >= 2 and all(isinstance(v, int) for v in value[:2]):
            return int(value[1])
    return None


def _callers_ids(position_ids: Any, boundaries: Boundaries) -> bool:
    """Whether a module got the very ``position_ids`` tensor the caller passed (:attr:`Boundaries.callers_position_ids`):
    not the per-sample ids packfree's model hook passes when the batch carries none, and not ids the model makes
    itself (BART's decoder counts ``0 .. T-1`` over the row, whatever the caller passed), which stock reads for a lone
    sample too."""
    given = boundaries.callers_position_ids
    return isinstance(given, torch.Tensor) and position_ids is given


def _position_forward(module: nn.Module, *args, **kwargs):
    """The forward every covered embedding module gets, as ``functools.partial(_position_forward, module)``
    in its ``__dict__`` (picklable; a deep copy binds to the copy)."""
    forward = own_forward(module, tag=_TAG)
    parameters = own_parameters(module, tag=_TAG)
    arguments = parameters.bind(args, kwargs)
    length = _row_length(arguments)
    boundaries = boundaries_here(packed=True, length=length) if length is not None else None
    if boundaries is None:
        # one sample per row (the module numbers it as stock does), or not this forward's packed row (a nested
        # model's own inputs)
        return forward(*args, **kwargs)
    numbering = entry_of(type(module)).numbering
    extra = arguments.pop(parameters.var_keyword, {}) if parameters.var_keyword else {}
    return _number(numbering, module, functools.partial(forward, **extra), boundaries, arguments)


@torch.compiler.disable  # the numbering follows the packing: compiled, every new packing would recompile
def _number(numbering: str, module: nn.Module, forward: Callable, boundaries: Boundaries,
            arguments: dict[str, Any]) -> Any:
    if numbering != "per_sample" and _callers_ids(arguments.get("position_ids"), boundaries):
        check_callers_ids(module, numbering, arguments["position_ids"], boundaries)  # 0-based ids on RoBERTa: said
        return forward(**arguments)  # read token by token: each sample takes its own slice of the caller's ids
    return RULES[numbering](module, forward, boundaries, arguments)


def install_numbering(module: nn.Module, model: nn.Module, path: str) -> None:
    """Give ``module`` (an embedding with a ``numbering`` quirk, at ``path`` in ``model``) its per-sample numbering
    (idempotent). An unknown rule raises ``ValueError``."""
    rule = entry_of(type(module)).numbering
    if rule not in RULES:
        raise ValueError(f"{type(module).__name__}: numbering quirk {rule!r} is none of {sorted(RULES)}")
    install(module, _position_forward, tag=_TAG)
    mark(module, model, path)


def uninstall_numbering(module: nn.Module) -> None:
    uninstall(module, _position_forward, tag=_TAG)


def numbering_of(model: nn.Module) -> Numbering:
    """How ``model`` numbers a lone sample called without ``position_ids``: from where its first position module
    with a ``numbering`` quirk that does not start at 0 starts (RoBERTa: ``padding_idx + 1``), else from 0 where
    the model takes ``position_ids``, else not by ids."""
    for path, module in model.named_modules():
        rule = entry_of(type(module)).numbering
        if rule is not None:
            numbering = lone_sample_numbering(module, rule, path)
            if numbering.start:
                return numbering
    return Numbering(0 if "position_ids" in inspect.signature(type(model).forward).parameters else None)
