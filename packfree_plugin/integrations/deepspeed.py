"""DeepSpeed Ulysses as accelerate and the HF Trainer launch it: a packfree model takes packfree's route.

accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` (which ``TrainingArguments(parallelism_config=
...)`` passes on) calls DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation,
...)`` in ``prepare``. DeepSpeed wraps the attention function named ``core_attn_implementation`` and refuses one that
differs from the model's; accelerate refuses ``"packfree"`` as that name. :func:`install` wraps that one classmethod:

- a model loaded with ``attn_implementation="packfree"`` and ``sp_attn_implementation`` unset (``None``) or
  ``"packfree"`` is registered by :func:`packfree_plugin.parallel.register_ulysses` (DeepSpeed Ulysses around packfree
  attention, whole-row boundaries, head-parallel mixers), for one packed row per batch (:class:`UlyssesRows`);
- the same model with another ``sp_attn_implementation`` (``"sdpa"``) is refused, naming the fix, before DeepSpeed's
  mismatch error (whose advice, loading the model with sdpa, leads to silent mixing);
- a model loaded with ``"sdpa"`` or ``"flex_attention"`` (not packfree) is refused at set-up if it has sequence mixers
  (Ulysses splits only attention), and its attention refuses a packed row in the forward: DeepSpeed drops the mask, so
  that attention is causal over the whole gathered row and its samples attend to each other.

Every other call goes to DeepSpeed as it is. Tested with DeepSpeed 0.19 (:data:`TESTED`); on another release packfree
leaves DeepSpeed untouched and logs why (DeepSpeed's own mismatch error then stands: never silent for a packfree model).
:func:`install_when_imported` (called by :func:`packfree_plugin.register`) installs it when DeepSpeed's module is
imported, without importing DeepSpeed itself; :func:`uninstall` undoes both.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..compat import installed_series
from ..forward.keywords import BOUNDARY_KWARGS

__all__ = ["TESTED", "UlyssesRows", "install", "install_when_imported", "installed", "uninstall"]

TESTED = ((0, 19),)
"""The (major, minor) releases of DeepSpeed this adapter was tested with."""

ULYSSES_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"
_ORIGINAL = "_packfree_original_register_with_transformers"
_STOCK_MASKLESS = ("sdpa", "flex_attention")
"""Attention implementations that DeepSpeed Ulysses runs causally over the whole gathered row (it drops the mask)."""
IGNORE = -100
LAYOUT_KEYS = ("attention_mask", *BOUNDARY_KWARGS)
"""Batch keys that describe the layout :class:`UlyssesRows` rebuilds as ``position_ids`` (dropped from its rows)."""
logger = logging.getLogger("packfree")


def _ulysses_class() -> type | None:
    module = sys.modules.get(ULYSSES_MODULE)
    return getattr(module, "UlyssesSPAttentionHF", None)


def installed() -> bool:
    """Whether DeepSpeed's ``register_with_transformers`` takes packfree's route for packfree models here."""
    ulysses = _ulysses_class()
    return ulysses is not None and _ORIGINAL in ulysses.__dict__


def install() -> None:
    """Wrap ``UlyssesSPAttentionHF.register_with_transformers`` (imports DeepSpeed's module; idempotent). On a
    release outside :data:`TESTED` it logs a warning and changes nothing."""
    release = installed_series("deepspeed")
    if release not in TESTED:
        logger.warning("packfree: DeepSpeed %s.%s is not a release packfree was tested with (%s); its Ulysses "
                       "registration is left as it is (register packfree's route with "
                       "packfree_plugin.parallel.register_ulysses)", *release,
                       ", ".join(f"{major}.{minor}" for major, minor in TESTED))
        return
    importlib.import_module(ULYSSES_MODULE)
    ulysses = _ulysses_class()
    if _ORIGINAL in ulysses.__dict__:
        return
    original = ulysses.register_with_transformers  # bound to the class
    signature = inspect.signature(original)

    @functools.wraps(original)
    def register_with_transformers(cls: type, *args: Any, **kwargs: Any) -> Any:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        return _register(original, call.arguments)

    setattr(ulysses, _ORIGINAL, ulysses.__dict__["register_with_transformers"])
    ulysses.register_with_transformers = classmethod(register_with_transformers)


def uninstall() -> None:
    """Undo :func:`install` and :func:`install_when_imported`."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AfterImport)]
    ulysses = _ulysses_class()
    if ulysses is not None and _ORIGINAL in ulysses.__dict__:
        ulysses.register_with_transformers = ulysses.__dict__[_ORIGINAL]
        delattr(ulysses, _ORIGINAL)


def install_when_imported() -> None:
    """:func:`install` now if DeepSpeed's Ulysses module is imported, else as soon as it is (accelerate imports it in
    ``prepare``); nothing where DeepSpeed is not installed. DeepSpeed itself is not imported here."""
    if ULYSSES_MODULE in sys.modules:
        install()
    elif importlib.util.find_spec("deepspeed") is not None and not any(
            isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: runs :func:`install` right after DeepSpeed's Ulysses module is executed."""

    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name != ULYSSES_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                execute = spec.loader.exec_module

                def exec_module(module: ModuleType) -> None:
                    execute(module)
                    uninstall()  # this finder's work is done
                    install()

                spec.loader.exec_module = exec_module
                return spec
        return None


def _register(original: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """packfree's route, a refusal, or DeepSpeed's own registration (see the module docstring)."""
    model = arguments["model_name_or_path"]
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None:  # a model name: DeepSpeed reads its config
        return original(**arguments)
    implementation = getattr(config, "_attn_implementation", None)
    core = arguments["core_attn_implementation"]
    if implementation == "packfree":
        if core not in (None, "packfree"):
            raise ValueError(
                f"sp_attn_implementation={core!r} (DeepSpeed's core_attn_implementation) for a model loaded with "
                f"attn_implementation='packfree': Ulysses would run {core} over the gathered row, where the samples "
                "of a packed row attend to each other. Leave sp_attn_implementation unset: packfree then registers "
                "DeepSpeed Ulysses around its own attention and splits its mixers head-parallel. Do not reload the "
                f"model with {core}: stock {core} under Ulysses mixes the samples of a packed row silently "
                "(docs/distributed.md)"
            )
        return _packfree_route(model, arguments)
    if core == implementation and core in _STOCK_MASKLESS:
        _refuse_stock_mixers(model, core)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        mpu = original(**arguments)
        ALL_ATTENTION_FUNCTIONS[core] = _refusing_packed_rows(ALL_ATTENTION_FUNCTIONS[core], core, mpu,
                                                              bool(arguments.get("disable_in_eval", False)))
        return mpu
    return original(**arguments)


def _packfree_route(model: nn.Module, arguments: dict[str, Any]) -> Any:
    """:func:`~packfree_plugin.parallel.register_ulysses` for one packed row per batch; DeepSpeed's ``mpu``."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ..parallel import register_ulysses

    disable_in_eval = bool(arguments.get("disable_in_eval", False))
    mpu = register_ulysses(model, arguments["sequence_parallel_size"], disable_in_eval=disable_in_eval)
    ALL_ATTENTION_FUNCTIONS["packfree"] = _one_row(ALL_ATTENTION_FUNCTIONS["packfree"], disable_in_eval)
    return mpu


def _one_row(attention: Callable[..., Any], disable_in_eval: bool) -> Callable[..., Any]:
    """``attention`` refusing a sharded batch of more than one row: Ulysses was registered for one packed row per
    batch (accelerate passes the samples per batch as DeepSpeed's micro batch size, which Ulysses would assert on)."""

    @functools.wraps(attention)
    def checked(module: nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if query.shape[0] != 1 and (module.training or not disable_in_eval):
            raise ValueError(
                f"a batch of {query.shape[0]} rows under DeepSpeed Ulysses with packfree: packfree's route runs one "
                "packed row per batch. Wrap the collator in packfree_plugin.integrations.deepspeed.UlyssesRows"
            )
        return attention(module, query, *args, **kwargs)

    return checked


def _refuse_stock_mixers(model: nn.Module, core: str) -> None:
    """Raise ``ValueError`` for the first sequence mixer (a layer packfree has an adapter for) of a stock model."""
    from ..classes import entry_of

    for path, module in model.named_modules():
        if entry_of(type(module)).mixer is not None:
            raise ValueError(
                f"{path} ({type(module).__name__}) mixes tokens outside attention, and DeepSpeed Ulysses splits only "
                f"the attention of this {core} model: each rank would run the layer on its shard alone, as if its "
                "samples began there. Load the model with attn_implementation='packfree' and leave "
                "sp_attn_implementation unset: packfree splits its mixers head-parallel over the whole row "
                "(docs/distributed.md)"
            )


def _refusing_packed_rows(ulysses: Callable[..., Any], core: str, mpu: ModuleType,
                          disable_in_eval: bool) -> Callable[..., Any]:
    """DeepSpeed's Ulysses wrapper of a stock attention ``core`` refusing a packed row: it drops the mask, so
    ``core`` attends causally over the whole row. In training, and in eval unless ``disable_in_eval``, the row is
    split: its ``position_ids`` are read gathered over the group, so every rank refuses alike, before DeepSpeed's own
    shape checks. In eval with ``disable_in_eval`` each rank runs its own whole rows, still without their mask
    (DeepSpeed drops it before it stands aside): its ``position_ids`` are read as they are."""

    @functools.wraps(ulysses)
    def checked(module: nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        position_ids = kwargs.get("position_ids")
        if isinstance(position_ids, torch.Tensor):
            rows = position_ids
            if module.training or not disable_in_eval:
                group = mpu.get_sequence_parallel_group()
                parts = [torch.empty_like(position_ids) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, position_ids.contiguous(), group=group)
                rows = torch.cat(parts, dim=-1)
            if bool((rows[..., 1:] == 0).any()):
                raise ValueError(
                    f"a packed row (position_ids restarting inside the row) reached {core} attention under DeepSpeed "
                    f"Ulysses, which drops the attention mask: {core} would attend causally over the whole row, so "
                    "its samples would attend to each other. Load the model with "
                    "attn_implementation='packfree' and leave sp_attn_implementation unset (docs/distributed.md)"
                )
        return ulysses(module, query, *args, **kwargs)

    return checked


def _positions_of(cu_seq_lens: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``position_ids`` of ``shape`` (``[1, T]``) restarting at every start of ``cu_seq_lens [n + 1]``."""
    return torch.cat([torch.arange(n) for n in cu_seq_lens.diff().tolist()]).reshape(shape)


class UlyssesRows:
    """A collator wrapper for DeepSpeed Ulysses (accelerate's ``sp_backend="deepspeed"``, the HF Trainer): every
    batch becomes one packed causal-LM row ``[1, T]`` of ``input_ids``, ``position_ids`` (restarting at 0 in every
    sample) and ``labels``, its length ``T`` a multiple of ``sp_size``, as DeepSpeed's ``UlyssesSPDataLoaderAdapter``
    shards it.

    ``collator`` may return padded rows (``attention_mask [B, L]``, ones contiguous) or packed ones (``position_ids
    [B, L]``, as ``DataCollatorWithFlattening`` or TRL's ``padding_free`` collator); their real tokens are
    concatenated in order. A sample's first label is set to -100: in a packed row the token before it belongs to
    another sample. The row ends with one padding sample (positions 0, 1, ...; labels -100) up to ``length`` tokens
    (a multiple of ``sp_size``; default: the next multiple of ``sp_size``). Give ``length`` on gloo (CPU): DeepSpeed's
    adapter all-gathers every rank's row, and gloo refuses rows of unequal sizes. Other per-token keys are refused."""

    def __init__(self, collator: Callable[[list[Any]], dict[str, Any]], sp_size: int, *, length: int | None = None,
                 pad_token_id: int = 0) -> None:
        if sp_size < 1 or (length is not None and length % sp_size):
            raise ValueError(f"UlyssesRows: length={length} must be a multiple of sp_size={sp_size} (>= 1)")
        self.collator, self.sp_size, self.length, self.pad_token_id = collator, sp_size, length, pad_token_id

    def __call__(self, features: list[Any]) -> dict[str, torch.Tensor]:
        batch = dict(self.collator(features))
        tokens = batch["input_ids"]
        unknown = sorted(name for name, value in batch.items() if isinstance(value, torch.Tensor)
                         and name not in ("input_ids", "position_ids", "labels", *LAYOUT_KEYS))
        if unknown:
            raise ValueError(f"UlyssesRows: {unknown} in the batch; it builds rows of input_ids, position_ids and "
                             "labels only (DeepSpeed shards every tensor along the row)")
        mask = batch.get("attention_mask")
        real = mask.bool() if isinstance(mask, torch.Tensor) and mask.shape == tokens.shape else \
            torch.ones_like(tokens, dtype=torch.bool)
        positions = batch.get("position_ids")
        if positions is None and isinstance(batch.get("cu_seq_lens_q"), torch.Tensor):
            positions = _positions_of(batch["cu_seq_lens_q"], tokens.shape)
        elif positions is None:
            positions = (real.cumsum(dim=1) - 1).clamp_min(0)
        labels = batch.get("labels")
        if labels is None:
            labels = torch.where(real, tokens, IGNORE)
        row_tokens, row_positions, row_labels = tokens[real], positions[real].long(), labels[real].clone()
        row_labels[row_positions == 0] = IGNORE
        return self._padded(row_tokens, row_positions, row_labels)

    def _padded(self, tokens: torch.Tensor, positions: torch.Tensor,
                labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[T]`` each -> ``[1, T']`` each, ``T'`` ``length`` or the next multiple of ``sp_size`` (the constructor's)."""
        size = tokens.shape[0]
        target = self.length if self.length is not None else size + (-size % self.sp_size)
        if size > target:
            raise ValueError(f"UlyssesRows: a batch of {size} tokens does not fit length={self.length}; lower the "
                             "samples per batch or raise length")
        pad = target - size
        filler = torch.arange(pad, dtype=positions.dtype)
        return {"input_ids": torch.cat([tokens, tokens.new_full((pad,), self.pad_token_id)])[None],
                "position_ids": torch.cat([positions, filler])[None],
                "labels": torch.cat([labels, labels.new_full((pad,), IGNORE)])[None]}
