"""Local stand-ins for the Hub repositories TRL's own trainer tests load (``trl-internal-testing/*``), so those
tests run offline: tiny models of the architecture each repository name gives, and small datasets with the
columns of each ``trl-internal-testing/zen`` configuration.

Models are written into a Hugging Face hub cache (``models--trl-internal-testing--NAME/snapshots/...``), so with
``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing there every ``from_pretrained`` of TRL and of the tests
(config, tokenizer, model, generation config, PEFT base) resolves them unchanged. A repository whose
architecture is not in :data:`MODELS` is not built: a test naming it fails the same way under every
implementation. Nothing here is TRL's code or data.
"""

from __future__ import annotations

import random
import zlib
from pathlib import Path
from typing import Any

HUB_ORG = "trl-internal-testing"
SNAPSHOT = "0" * 40

# repository name -> (model type, architecture). Same architecture as the Hub repository's name says.
MODELS: dict[str, tuple[str, str]] = {
    "tiny-Qwen2ForCausalLM-2.5": ("qwen2", "Qwen2ForCausalLM"),
    "tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "Qwen2ForSequenceClassification"),
    "tiny-Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "tiny-Qwen3ForSequenceClassification": ("qwen3", "Qwen3ForSequenceClassification"),
    "tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "tiny-LlamaForCausalLM-3.2": ("llama", "LlamaForCausalLM"),
    "tiny-LlamaForSequenceClassification-3.2": ("llama", "LlamaForSequenceClassification"),
    "tiny-MistralForCausalLM-0.2": ("mistral", "MistralForCausalLM"),
    "tiny-GPTNeoXForCausalLM": ("gpt_neox", "GPTNeoXForCausalLM"),
    "tiny-Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "tiny-Cohere2ForCausalLM": ("cohere2", "Cohere2ForCausalLM"),
    "tiny-Glm4MoeForCausalLM": ("glm4_moe", "Glm4MoeForCausalLM"),
    "tiny-GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "tiny-Olmo3ForCausalLM": ("olmo3", "Olmo3ForCausalLM"),
    "tiny-Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "tiny-Lfm2ForCausalLM-2.5": ("lfm2", "Lfm2ForCausalLM"),
    "tiny-NemotronHForCausalLM-nano": ("nemotron_h", "NemotronHForCausalLM"),
}

# A chat template over the character tokenizer: each message as ``<role>content<eos>``; a prompt templated with
# ``add_generation_prompt`` is a prefix of the same prompt templated with its answer, as TRL checks.
CHAT_TEMPLATE = (
    "{% for message in messages %}<{{ message['role'] }}>{{ message['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)

_WORDS = ("plain", "nested", "sparse", "dense", "errors", "silence", "explicit", "flat", "simple", "complex",
          "readable", "practical", "special", "rules", "namespaces", "ideas", "now", "never", "better", "obvious")
DATASET_ROWS = {"train": 17, "test": 3}
ZEN_CONFIGS = (
    "standard_language_modeling", "conversational_language_modeling",
    "standard_prompt_only", "conversational_prompt_only",
    "standard_prompt_completion", "conversational_prompt_completion",
    "standard_preference", "conversational_preference",
    "standard_implicit_prompt_preference", "conversational_implicit_prompt_preference",
    "standard_unpaired_preference", "conversational_unpaired_preference",
)


FLASH = ("flash_attention_2", "flash_attention_3", "kernels-community/flash-attn2", "kernels-community/flash-attn3",
         "kernels-community/vllm-flash-attn3")


def substitute_attention(requested: str | None, impl: str) -> str | None:
    """The implementation a ``from_pretrained(attn_implementation=requested)`` gets in a run of ``impl``: FlashAttention
    (which a CPU lacks) becomes ``impl``; under packfree every request does. A stock run keeps transformers' own
    default (``None``: sdpa where the model supports it, eager for GPT-OSS)."""
    if impl == "packfree" or requested in FLASH:
        return impl
    return requested


def repo_dir(cache: Path, name: str) -> Path:
    """The snapshot folder of ``trl-internal-testing/name`` in hub cache ``cache``."""
    return cache / f"models--{HUB_ORG}--{name}" / "snapshots" / SNAPSHOT


def tiny_tokenizer_with_template():
    """packfree's character tokenizer (ids fit the tiny configs' 128-token vocabulary) with :data:`CHAT_TEMPLATE`."""
    from packfree_plugin.cli.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(name: str, directory: Path) -> None:
    """Save a tiny seeded model of :data:`MODELS` ``[name]``'s architecture, and the tokenizer, to ``directory``."""
    import torch
    import transformers

    from packfree_plugin.cli.tiny import tiny_config

    model_type, architecture = MODELS[name]
    config = tiny_config(model_type)
    if architecture.endswith("ForSequenceClassification"):
        config.num_labels = 1
    torch.manual_seed(0)
    model = getattr(transformers, architecture)._from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer_with_template = tiny_tokenizer_with_template()
    tokenizer_with_template.save_pretrained(directory)


def build_hub_cache(cache: Path, names: list[str] | None = None) -> list[str]:
    """Write every (or each named) repository of :data:`MODELS` into hub cache ``cache`` once; returns the names."""
    built = []
    for name in names or list(MODELS):
        directory = repo_dir(cache, name)
        if not (directory / "config.json").exists():
            directory.mkdir(parents=True, exist_ok=True)
            build_model(name, directory)
            refs = cache / f"models--{HUB_ORG}--{name}" / "refs"
            refs.mkdir(parents=True, exist_ok=True)
            (refs / "main").write_text(SNAPSHOT)
        built.append(name)
    return built


def _sentence(rng: random.Random, low: int = 2, high: int = 6) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high))) + "."


def zen_rows(config: str, rows: int, seed: int) -> dict[str, list[Any]]:
    """Columns of ``trl-internal-testing/zen``'s configuration ``config``, ``rows`` rows of short sentences of
    varying length (so batches need padding)."""
    if config not in ZEN_CONFIGS:
        raise ValueError(f"no local stand-in for trl-internal-testing/zen configuration {config!r}")
    rng = random.Random(seed)
    kind, _, form = config.partition("_")
    conversational = kind == "conversational"

    def turn(role: str, text: str) -> list[dict[str, str]]:
        return [{"role": role, "content": text}]

    def prompt() -> Any:
        text = _sentence(rng)
        return turn("user", text) if conversational else text

    def answer() -> Any:
        text = _sentence(rng, 1, 8)
        return turn("assistant", text) if conversational else " " + text

    columns: dict[str, list[Any]] = {}
    for _ in range(rows):
        if form == "language_modeling":
            row = ({"messages": turn("user", _sentence(rng)) + turn("assistant", _sentence(rng))} if conversational
                   else {"text": _sentence(rng, 3, 12)})
        elif form == "prompt_only":
            row = {"prompt": prompt()}
        elif form == "prompt_completion":
            row = {"prompt": prompt(), "completion": answer()}
        elif form == "preference":
            row = {"prompt": prompt(), "chosen": answer(), "rejected": answer()}
        elif form == "implicit_prompt_preference":
            shared = prompt()
            row = {"chosen": shared + answer(), "rejected": shared + answer()}
        else:  # unpaired_preference
            row = {"prompt": prompt(), "completion": answer(), "label": rng.random() < 0.5}
        for column, value in row.items():
            columns.setdefault(column, []).append(value)
    return columns


def load_dataset(path: str, name: str | None = None, split: str | None = None, *, streaming: bool = False,
                 **_: Any):
    """``datasets.load_dataset`` for ``trl-internal-testing/zen``: a ``Dataset`` (``IterableDataset`` when
    ``streaming``) for ``split``, else a ``DatasetDict`` of both splits. Any other dataset raises, as offline."""
    from datasets import Dataset, DatasetDict, IterableDatasetDict

    if path != f"{HUB_ORG}/zen" or name is None:
        raise FileNotFoundError(f"no local stand-in for dataset {path!r} ({name!r}); the Hub is offline")

    def one(split_name: str):
        dataset = Dataset.from_dict(zen_rows(name, DATASET_ROWS[split_name], seed=zlib.crc32(f"{name}/{split_name}".encode())))
        return dataset.to_iterable_dataset() if streaming else dataset

    if split is not None:
        return one(split)
    return (IterableDatasetDict if streaming else DatasetDict)({s: one(s) for s in DATASET_ROWS})
