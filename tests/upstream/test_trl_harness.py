"""The offline TRL harness's own logic: the stand-in models are the architectures their Hub names give, the
stand-in datasets have each configuration's columns, FlashAttention requests go to the implementation under
test, and the report names every test stock passes and packfree does not."""

from __future__ import annotations

import pytest
import transformers

from tests.upstream import trl_offline, trl_run


@pytest.mark.parametrize("name", sorted(trl_offline.MODELS))
def test_stand_in_config_is_the_named_architecture(name: str) -> None:
    """Every stand-in's tiny config is of the model type whose class the repository names (the name's
    ``tiny-<Architecture>`` part), so a test runs the architecture it asks for."""
    from packfree_plugin.cli.tiny import tiny_config

    model_type, architecture = trl_offline.MODELS[name]
    assert name.removeprefix("tiny-").startswith(architecture)
    config = tiny_config(model_type)
    assert config.model_type == model_type
    assert getattr(transformers, architecture).config_class is type(config)


@pytest.mark.parametrize("name", ["tiny-Qwen3MoeForCausalLM", "tiny-Qwen2ForSequenceClassification-2.5"])
def test_built_stand_in_loads_as_named(tmp_path, name: str) -> None:
    """A built repository loads back through the Auto classes as its architecture, with a usable tokenizer."""
    trl_offline.build_hub_cache(tmp_path, [name])
    directory = trl_offline.repo_dir(tmp_path, name)
    _, architecture = trl_offline.MODELS[name]
    auto = (transformers.AutoModelForSequenceClassification if "Sequence" in architecture
            else transformers.AutoModelForCausalLM)
    model = auto.from_pretrained(directory)
    assert type(model).__name__ == architecture
    assert (tmp_path / f"models--{trl_offline.HUB_ORG}--{name}" / "refs" / "main").read_text() == trl_offline.SNAPSHOT
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    assert max(tokenizer("plain nested.")["input_ids"]) < model.config.vocab_size


def test_chat_template_prompt_is_prefix_of_the_conversation() -> None:
    tokenizer = trl_offline.tiny_tokenizer_with_template()
    prompt = [{"role": "user", "content": "flat is better."}]
    answer = [{"role": "assistant", "content": "now."}]
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(prompt + answer, tokenize=False)
    assert whole.startswith(head) and whole != head


@pytest.mark.parametrize("config", trl_offline.ZEN_CONFIGS)
def test_zen_stand_in_columns(config: str) -> None:
    expected = {
        "language_modeling": {"text"}, "prompt_only": {"prompt"}, "prompt_completion": {"prompt", "completion"},
        "preference": {"prompt", "chosen", "rejected"}, "implicit_prompt_preference": {"chosen", "rejected"},
        "unpaired_preference": {"prompt", "completion", "label"},
    }[config.partition("_")[2]]
    if config == "conversational_language_modeling":
        expected = {"messages"}
    dataset = trl_offline.load_dataset("trl-internal-testing/zen", config, split="train")
    assert set(dataset.column_names) == expected
    assert len(dataset) == trl_offline.DATASET_ROWS["train"]
    lengths = {len(str(row)) for row in dataset}
    assert len(lengths) > 1, "rows of one length would need no padding"
    again = trl_offline.load_dataset("trl-internal-testing/zen", config, split="train")
    assert again.to_dict() == dataset.to_dict(), "the stand-in must be the same in both processes"


def test_unknown_dataset_raises_as_offline() -> None:
    with pytest.raises(FileNotFoundError):
        trl_offline.load_dataset("trl-internal-testing/zen-image", "conversational_preference", split="train")
    with pytest.raises(ValueError):
        trl_offline.load_dataset("trl-internal-testing/zen", "no_such_config", split="train")


def test_attention_substitution() -> None:
    for flash in trl_offline.FLASH:
        assert trl_offline.substitute_attention(flash, "sdpa") == "sdpa"
    assert trl_offline.substitute_attention(None, "packfree") == "packfree"
    assert trl_offline.substitute_attention("eager", "packfree") == "packfree"
    assert trl_offline.substitute_attention("eager", "sdpa") == "eager"
    assert trl_offline.substitute_attention(None, "sdpa") is None  # stock keeps transformers' default


def test_report_lists_what_packfree_loses() -> None:
    stock = {"a": {"test": "a", "outcome": "passed", "detail": ""},
             "b": {"test": "b", "outcome": "passed", "detail": ""},
             "c": {"test": "c", "outcome": "failed", "detail": "offline"},
             "d": {"test": "d", "outcome": "passed", "detail": ""}}
    packfree = {"a": {"test": "a", "outcome": "passed", "detail": "", "packed_batches": 3},
                "b": {"test": "b", "outcome": "failed", "detail": "ValueError: boom", "packed_batches": 0},
                "c": {"test": "c", "outcome": "failed", "detail": "offline", "packed_batches": 0}}
    assert trl_run.regressions(stock, packfree) == [("b", "ValueError: boom"), ("d", "no result")]
    report = trl_run.render(stock, packfree, {})
    assert "| passed | 3 | 1 |" in report and "| failed | 1 | 2 |" in report
    assert "ran packed batches: 1 of 1" in report and "`b`: ValueError: boom" in report
