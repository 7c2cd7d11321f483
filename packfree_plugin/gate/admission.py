"""The load-time gate: a model is prepared for packed rows only once packfree has proved it exact.

:func:`admit` is called by :func:`packfree_plugin.apply` for every model prepared with packfree:

- a model class of transformers that the sweep (``nox -s sweep``) proved exact for the installed transformers
  version (:data:`VERIFIED_FILE`) passes at once, provided its config's switches (:func:`switches`: the
  boolean and string settings, e.g. Falcon's ``alibi`` or BERT's ``position_embedding_type``) are those the
  sweep proved;
- any other architecture (a newer transformers, ``trust_remote_code``, a type the sweep found wrong) gets
  the isolation proof (:func:`.proof.prove`) on a small random copy of its own config class, every distinct
  layer kind kept (:func:`.copies.proof_configs`: a tiny copy, else the user's config cut in depth and width as
  far as stock builds and runs it); if the copy is not exact, the load fails with a ``ValueError`` naming the
  model type and the modules that went wrong.

Opt-out: ``PACKFREE_TRUST_UNVERIFIED=1`` in the environment (or ``admit(model, trust_unverified=True)``)
skips the proof and logs a warning. A model built inside another model's constructor (a backbone inside its
head) is not checked on its own: the outer model's proof runs through it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from torch import nn

from ..compat import installed_transformers

__all__ = ["COPY_PARAMETERS", "NoCopyError", "TRUST_ENV", "VERIFIED_FILE", "admit", "bypassed", "is_verified",
           "prove_copy", "prove_tiny_copy", "switches", "verified_classes"]

TRUST_ENV = "PACKFREE_TRUST_UNVERIFIED"
VERIFIED_FILE = Path(__file__).with_name("verified.json")

logger = logging.getLogger("packfree")


class _Bypass(threading.local):
    def __init__(self) -> None:
        self.depth = 0


_bypass = _Bypass()
_verdicts: dict[tuple[type, str], str | None] = {}
"""(model class, tiny config JSON) -> None when proved exact, else the refusal message."""


@contextlib.contextmanager
def bypassed() -> Iterator[None]:
    """Within ``with``, on this thread, :func:`admit` admits everything (the proof's own tiny models, the sweep)."""
    _bypass.depth += 1
    try:
        yield
    finally:
        _bypass.depth -= 1


_IGNORED_SWITCHES = frozenset({"model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype",
                               "use_cache", "return_dict", "output_hidden_states", "output_attentions",
                               "tie_word_embeddings", "problem_type", "tokenizer_class", "is_encoder_decoder"})


def switches(config) -> dict[str, bool | str]:
    """The config's top-level boolean and string settings that can change what a layer computes (activation
    names and output/caching flags left out)."""
    return {name: value for name, value in config.to_dict().items()
            if isinstance(value, (bool, str)) and name not in _IGNORED_SWITCHES and not name.startswith("_")
            and "act" not in name}


@cache
def _verified(version: str) -> dict:
    return json.loads(VERIFIED_FILE.read_text()).get(version, {}) if VERIFIED_FILE.exists() else {}


def verified_classes(version: str | None = None) -> frozenset[tuple[str, str]]:
    """``(model_type, class name)`` pairs the sweep proved exact under transformers ``version`` (default: installed)."""
    exact = _verified(version or installed_transformers()).get("exact", {})
    return frozenset((model_type, name) for model_type, names in exact.items() for name in names)


def is_verified(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers class the sweep proved exact for the installed transformers, with
    the switches the sweep proved it with."""
    cls = type(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if not cls.__module__.startswith("transformers.models."):
        return False
    installed = installed_transformers()
    if (model_type, cls.__name__) not in verified_classes(installed):
        return False
    proved = _verified(installed).get("switches", {}).get(model_type, {})
    mine = switches(config)
    return all(mine.get(name, value) == value for name, value in proved.items())


def _inside_another_model(model: nn.Module) -> bool:
    """Whether ``model`` is being built inside another ``PreTrainedModel``'s constructor."""
    from transformers import PreTrainedModel

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if isinstance(owner, PreTrainedModel) and owner is not model:
                return True
        frame = frame.f_back
    return False


COPY_PARAMETERS = 20_000_000
"""Largest copy (parameters) the proof builds: a copy cut in depth only keeps the user's widths."""


class NoCopyError(RuntimeError):
    """No copy of a model's config could be built and run on stock transformers, so nothing could be proved.

    ``failures``: why each copy failed on stock (``"<copy>: <error>"``); ``stock_error``: the error stock raises on
    the user's config itself (built on the meta device, given the proof's row of token ids) when it is the one the
    tiny copy raised, else None. With it, the failure is stock's (it cannot build or run that config on a row of
    tokens), not the copies'."""

    def __init__(self, failures: list[str], stock_error: str | None = None) -> None:
        super().__init__("; ".join(failures))
        self.failures = failures
        self.stock_error = stock_error


def prove_tiny_copy(model: nn.Module):
    """The isolation proof on a small random copy of ``model``'s class and config: :func:`prove_copy`."""
    return prove_copy(type(model), model.config)


def prove_copy(cls: type, config):
    """The isolation proof on a small random copy of class ``cls`` and ``config`` (:class:`.proof.Proof`).

    The copies of :func:`.copies.proof_configs` are tried in turn, until one builds and runs on stock
    transformers (sdpa, else eager) with the proof's samples: a tiny copy, the tiny copy with each layer kind
    twice, the user's config cut in depth and width. A copy stock builds is built with packfree too: a refusal at
    load (a layer packfree cannot run exactly) propagates, whatever the proof's row does on stock. What packfree
    does on the first copy stock runs is the verdict. Raises :class:`NoCopyError` if no copy runs on stock."""
    import torch

    from .proof import LENGTHS, alone_outputs, build_pair, build_stock, placeholder_tokens, prove, sample_tokens
    from .copies import proof_configs

    failures: list[str] = []
    errors: list[str] = []

    def failed(description: str, error: BaseException) -> None:
        errors.append(_error_text(error))
        failures.append(f"{description}: {errors[-1]}")

    # from_pretrained may call this under its meta-device context (transformers 5.20 does): the copy and the
    # proof's inputs need real data
    with bypassed(), torch.device("cpu"):
        for description, make_config in proof_configs(config):
            try:
                copy_config = make_config()
                if description.startswith("a copy cut"):  # the tiny copies are small by construction
                    _check_size(cls, copy_config)
                build_stock(cls, copy_config)
            except Exception as error:  # noqa: BLE001 - stock cannot build this copy: try the next one
                failed(description, error)
                continue
            try:
                packed, stock, implementation = build_pair(cls, copy_config)
            except (ValueError, NotImplementedError):
                raise  # packfree refuses the copy's layers at load: the model's own reason
            except Exception as error:  # noqa: BLE001 - no refusal (e.g. non-finite initial weights): the next copy
                failed(description, error)
                continue
            try:
                alone_outputs(stock, sample_tokens(LENGTHS, _vocab(copy_config),
                                                   avoid=placeholder_tokens(copy_config)))
            except Exception as error:  # noqa: BLE001 - stock cannot run this copy: try the next one
                failed(description, error)
                continue
            proof = prove(packed, stock, stock_name=implementation)
            proof.copy = description
            return proof
    raise NoCopyError(failures, _stock_error_on(cls, config, errors[0]))


def _error_text(error: BaseException) -> str:
    """``"<type>: <message>"`` of ``error``, the message cut to 200 characters (how copies' failures compare)."""
    return f"{type(error).__name__}: {str(error)[:200]}"


def _stock_error_on(cls: type, config, copy_error: str) -> str | None:
    """The error stock raises building or running ``config`` itself, if it is ``copy_error`` (the tiny copy's); None if
    stock builds and runs it, or fails there otherwise (an op the meta device lacks, ``Tensor.item()``).

    ``config`` is built on the meta device (no memory, any size) and given the proof's first sample, with the
    model's default cache, then without one."""
    import torch

    from .audit import with_decoder_inputs
    from .proof import LENGTHS, build_stock, placeholder_tokens, sample_tokens

    with torch.device("cpu"):
        sample = sample_tokens(LENGTHS[:1], _vocab(config), avoid=placeholder_tokens(config))[0]
    with bypassed(), torch.device("meta"):
        try:
            stock, _ = build_stock(cls, config)
        except Exception as error:  # noqa: BLE001 - stock cannot build the user's config as it is
            return copy_error if _error_text(error) == copy_error else None
        inputs = with_decoder_inputs(stock, {"input_ids": sample[None].to("meta")})
        for cache in ({}, {"use_cache": False}):
            try:
                with torch.no_grad():
                    stock(**inputs, **cache)
            except Exception as error:  # noqa: BLE001
                if _error_text(error) == copy_error:
                    return copy_error
    return None


def _vocab(config) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(config, "vocab_size", None) or getattr(text_config, "vocab_size", None) or 128)


def _check_size(cls: type, config) -> None:
    """Raise ``ValueError`` if ``cls`` built from ``config`` has more than :data:`COPY_PARAMETERS` parameters."""
    import copy

    import torch

    with torch.device("meta"):
        copy_on_meta = cls._from_config(copy.deepcopy(config), attn_implementation="eager")
    count = sum(p.numel() for p in copy_on_meta.parameters())
    if count > COPY_PARAMETERS:
        raise ValueError(f"{count:,} parameters, over the proof's {COPY_PARAMETERS:,}")


def _refusal(model: nn.Module) -> str | None:
    """None when the copy is exact, else why the model is refused."""
    model_type = getattr(model.config, "model_type", "?")
    name = type(model).__name__
    opt_out = f"set {TRUST_ENV}=1 to load it anyway, at your own risk"
    try:
        proof = prove_tiny_copy(model)
    except NoCopyError as error:  # no copy runs on stock: nothing can be proved
        if error.stock_error is not None:
            return (f"packfree cannot prove {name} (model type {model_type!r}) exact on packed rows: stock "
                    f"transformers cannot build or run this config itself on a row of token ids "
                    f"({error.stock_error}, as on its tiny copy); {opt_out}")
        return (f"packfree cannot prove {name} (model type {model_type!r}) exact on packed rows: it found no copy "
                f"of this config that stock transformers runs on a row of token ids, although stock builds the "
                f"config itself; this is packfree's limitation, not the model's ({error}); {opt_out}")
    except Exception as error:  # noqa: BLE001 - packfree refused the copy at load (layers it cannot run exactly)
        return (f"packfree refuses {name} (model type {model_type!r}): {type(error).__name__}: {error}. "
                f"Load it without attn_implementation='packfree', or {opt_out}")
    if proof.exact:
        return None
    return (f"packfree refuses {name} (model type {model_type!r}): on {proof.copy}, {proof.summary()}. "
            f"Load it without attn_implementation='packfree', or {opt_out}")


def admit(model: nn.Module, *, trust_unverified: bool = False) -> None:
    """Return if ``model`` may run packed rows under packfree; raise ``ValueError`` saying why not otherwise.

    Verified classes cost nothing; others are proved on a tiny copy once per class and config (~1-2 s).
    ``trust_unverified`` (or ``PACKFREE_TRUST_UNVERIFIED=1``) skips the proof with a warning.
    """
    if _bypass.depth or getattr(model, "config", None) is None or is_verified(model):
        return
    if _inside_another_model(model):
        return
    name = f"{type(model).__name__} (model type {getattr(model.config, 'model_type', '?')!r})"
    if trust_unverified or os.environ.get(TRUST_ENV, "") not in ("", "0"):
        logger.warning("packfree: %s is not verified exact on packed rows and its proof is skipped (%s); "
                       "packed results may be wrong", name, TRUST_ENV)
        return
    key = (type(model), model.config.to_json_string(use_diff=False))
    if key not in _verdicts:
        _verdicts[key] = _refusal(model)
    if _verdicts[key] is not None:
        raise ValueError(_verdicts[key])
