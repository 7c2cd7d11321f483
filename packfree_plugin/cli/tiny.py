"""Tiny, randomly initialised models of a given family, for the demo, ``packfree verify`` and ``doctor``.

``tiny_config("qwen3_next")`` gives a two-layer config of that model type (one layer per kind the family
mixes, e.g. Gated DeltaNet + attention) small enough to run on a laptop CPU in milliseconds.
``load_model(target)`` accepts either such a model type or a saved model directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["auto_class", "is_model_dir", "load_config", "load_model", "tiny_config", "tiny_tokenizer"]

def tiny_config(model_type: str, *, vocab_size: int = 128, hidden_size: int = 64, num_hidden_layers: int | None = None,
                **overrides: Any):
    """A fresh tiny config of ``model_type`` (``pad=0, bos=1, eos=2``) from its
    :data:`~packfree_plugin.gate.catalogue.CATALOGUE` entry: its ``scalable`` settings under these sizes first, else its
    ``sized`` config, else the type's defaults shrunk by :func:`packfree_plugin.gate.shrink.tiny_config_for` (every
    distinct layer kind kept; ``overrides`` set on top). ``num_hidden_layers`` defaults to 2 (sized: the entry's
    depth; shrunk: as many layers as cover every layer kind)."""
    from ..gate.catalogue import catalogue_config, scalable_values, sized_types
    from ..gate.shrink import tiny_config_for

    scalable = scalable_values(model_type)
    if scalable is None and model_type in sized_types():
        if num_hidden_layers is not None:
            overrides["num_hidden_layers"] = num_hidden_layers
        return catalogue_config(model_type, **overrides)
    num_hidden_layers = num_hidden_layers or 2
    base = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if scalable is not None:
        kwargs = {**base, **scalable, **overrides}
        layer_types = kwargs.get("layer_types")
        if layer_types is not None and len(layer_types) != num_hidden_layers:
            kwargs["layer_types"] = [layer_types[i % len(layer_types)] for i in range(num_hidden_layers)]
        if model_type == "qwen3_next":
            kwargs["mlp_only_layers"] = list(range(num_hidden_layers))
        if model_type == "mamba2" and "num_heads" not in overrides:  # heads * head_dim must be hidden * expand
            kwargs["num_heads"] = kwargs["hidden_size"] * kwargs["expand"] // kwargs["head_dim"]
        return transformers_config(model_type, **kwargs)
    config = tiny_config_for(model_type)
    for name, value in {"vocab_size": vocab_size, "hidden_size": hidden_size, **overrides}.items():
        if getattr(config, name, value) != value:
            setattr(config, name, value)
    return config


def transformers_config(model_type: str, /, **values: Any):
    """A config of transformers' own class for ``model_type``. ``AutoConfig.for_model`` builds fla's once fla is
    imported: fla registers its own config classes under ``mamba``, ``mamba2`` and others."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return getattr(transformers, CONFIG_MAPPING_NAMES[model_type])(**values)


def is_model_dir(target: str) -> bool:
    return Path(target).is_dir() and (Path(target) / "config.json").exists()


def load_config(target: str):
    """The config of a saved model directory, else a tiny config of model type ``target``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(target) if is_model_dir(target) else tiny_config(target)


def auto_class(config):
    """``AutoModelForCausalLM`` for a config that has a causal-LM head, else ``AutoModel`` (text backbones)."""
    from transformers import AutoModel, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModel


def load_model(target: str, attn_implementation: str, *, dtype: torch.dtype = torch.float64, seed: int = 0):
    """A causal LM (or, for a backbone-only type, the base model) from a model directory (its weights) or a
    model type (tiny, seeded random weights), in eval mode.

    Mixture-of-experts layers use the ``eager`` experts implementation, which every dtype supports.
    """
    if attn_implementation == "packfree":
        from ..loading.register import register

        register()
    kwargs: dict[str, Any] = dict(attn_implementation=attn_implementation, dtype=dtype,
                                  experts_implementation="eager")
    if is_model_dir(target):
        return auto_class(load_config(target)).from_pretrained(target, **kwargs).eval()
    torch.manual_seed(seed)
    config = tiny_config(target)
    return auto_class(config).from_config(config, **kwargs).eval()


TOKENIZER_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
"""Ids 0-3 of :func:`tiny_tokenizer`, matching the tiny configs' ``pad=0, bos=1, eos=2``."""


def tiny_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` whose ids fit the tiny configs' 128-token vocabulary:
    ``<pad> <bos> <eos> <unk>`` are 0-3, printable ASCII characters 4-98, anything else ``<unk>``. For trainers
    (TRL's) that take text and tokenise it themselves."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {token: index for index, token in enumerate(TOKENIZER_SPECIALS)}
    for code in range(32, 127):
        vocabulary[chr(code)] = len(vocabulary)
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    pad, bos, eos, unk = TOKENIZER_SPECIALS
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos,
                                   unk_token=unk)
