"""sentence-transformers as its users use it: ``SentenceTransformer(path, model_kwargs={"attn_implementation":
"packfree"})``. Its text batches must really be flattened into one packed row (packfree_plugin/integrations/
sentence_transformers.py switches its flattening on) and give what the padded sdpa model gives: embeddings, a
MultipleNegativesRankingLoss step's loss and gradients, and SentenceTransformerTrainer's training."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sentence_transformers")

from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer  # noqa: E402

import packfree_plugin  # noqa: E402
from packfree_plugin.integrations import sentence_transformers as integration  # noqa: E402
from packfree_plugin.cli.data import load_gsm8k  # noqa: E402
from tests import stock_facts  # noqa: E402
from tests.helpers import max_grad_diff  # noqa: E402

NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def _minilm(path: str, implementation: str, dtype: torch.dtype = torch.float32) -> SentenceTransformer:
    return SentenceTransformer(path, device="cpu", model_kwargs={"attn_implementation": implementation, "dtype": dtype},
                               config_kwargs=NO_DROPOUT)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [record["question"] for record in load_gsm8k(limit=8)]


@pytest.fixture(scope="module")
def minilm(minilm_path: str) -> tuple[SentenceTransformer, SentenceTransformer]:
    packfree_plugin.register()
    return _minilm(minilm_path, "packfree").eval(), _minilm(minilm_path, "sdpa").eval()


@pytest.fixture(scope="module")
def tiny_roberta(minilm_path: str, tmp_path_factory) -> tuple[SentenceTransformer, SentenceTransformer]:
    """A tiny random RoBERTa (positions numbered from ``padding_idx + 1``) with MiniLM's tokenizer, mean pooling."""
    from transformers import AutoTokenizer, RobertaConfig, RobertaModel

    packfree_plugin.register()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    config = RobertaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, max_position_embeddings=300, pad_token_id=tokenizer.pad_token_id,
                           initializer_range=0.5,  # weights that make attention matter: a leak shows in the means
                           bos_token_id=tokenizer.cls_token_id, eos_token_id=tokenizer.sep_token_id, **NO_DROPOUT)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny_roberta")
    RobertaModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)

    def build(implementation: str) -> SentenceTransformer:
        transformer = Transformer(str(directory), model_kwargs={"attn_implementation": implementation})
        return SentenceTransformer(modules=[transformer, Pooling(32, pooling_mode="mean")], device="cpu").eval()

    return build("packfree"), build("sdpa")


def _assert_flattened(model: SentenceTransformer, texts: list[str], first_position: int) -> None:
    """The batch is one packed row whose boundaries are the texts' own lengths (so this fails if flattening, or
    the boundaries, silently went away)."""
    lengths = [len(model.tokenizer(text)["input_ids"]) for text in texts]
    features = model[0].preprocess(texts)
    assert model[0].can_flatten_inputs
    assert list(features["input_ids"].shape) == [1, sum(lengths)] and "attention_mask" not in features
    assert features["cu_seq_lens_q"].tolist() == torch.tensor([0, *lengths]).cumsum(0).tolist()
    starts = features["cu_seq_lens_q"][:-1]
    assert (features["position_ids"][0, starts] == first_position).all()


def _assert_equal_embeddings(packed: torch.Tensor, padded: torch.Tensor, context: str = "") -> None:
    cosine = torch.nn.functional.cosine_similarity(packed, padded, dim=-1)
    assert cosine.min() >= 0.99999, f"cosine to the padded sdpa embeddings down to {cosine.min().item()}" + (
        f"; {context}" if context else "")


def test_the_adapter_is_installed_for_the_tested_release(minilm) -> None:
    from importlib.metadata import version

    assert integration.installed(), f"sentence-transformers {version('sentence-transformers')}: adapter not installed"


def test_minilm_encodes_flattened_and_equals_padded_sdpa(minilm, texts) -> None:
    packed, padded = minilm
    _assert_flattened(packed, texts, first_position=0)
    assert not padded[0].can_flatten_inputs  # the reference really pads
    mine = packed.encode(texts, batch_size=len(texts), convert_to_tensor=True)
    theirs = padded.encode(texts, batch_size=len(texts), convert_to_tensor=True)
    _assert_equal_embeddings(mine, theirs)


@pytest.mark.parametrize("keep_ids", [True, False], ids=["as-flattened", "cu-seq-lens-only"])
def test_the_flattened_batch_stock_is_measured_on_is_exact_under_packfree(minilm, texts, keep_ids: bool,
                                                                         record_property) -> None:
    """The equality above is not trivial where stock, given the same flattened row, mixes the texts. That is a fact
    of the installed transformers, recorded (``tests/stock_facts.py``), not asserted: on the row as
    sentence-transformers flattens it (``cu_seq_lens`` and ``position_ids``), 5.24's stock sdpa mixed the texts
    (cosine < 0.999) and 5.25's keeps them apart; with the ids dropped (``cu_seq_lens`` alone) 5.25's still mixes
    them (cosine 0.61). packfree's model, given that very row, must give the padded sdpa embeddings either way."""
    packed, padded = minilm
    features = dict(packed[0].preprocess(texts))
    if not keep_ids:
        del features["position_ids"]
    with torch.no_grad():
        theirs = padded.encode(texts, batch_size=len(texts), convert_to_tensor=True)
        stock = padded.forward(dict(features))["sentence_embedding"]
        mine = packed.forward(dict(features))["sentence_embedding"]
    what = "stock sdpa, MiniLM flattened " + ("as sentence-transformers does" if keep_ids else "by cu_seq_lens alone")
    fact = stock_facts.record(record_property, what, list(stock), list(theirs), tolerance=1e-5)
    cosine = torch.nn.functional.cosine_similarity(stock, theirs, dim=-1).min().item()
    record_property(f"{what}: min cosine to padded", cosine)
    _assert_equal_embeddings(mine, theirs, context=str(fact))


def test_roberta_family_mean_pooling_encodes_flattened_and_equals_padded(tiny_roberta, texts) -> None:
    """RoBERTa numbers a lone text from ``padding_idx + 1``; sentence-transformers shifts the flattened ids by that
    itself, and the caller's ids are what packfree follows: the means over each text's own tokens equal padded's."""
    packed, padded = tiny_roberta
    padding_idx = packed[0].model.embeddings.padding_idx
    _assert_flattened(packed, texts, first_position=padding_idx + 1)
    mine = packed.encode(texts, batch_size=len(texts), convert_to_tensor=True)
    theirs = padded.encode(texts, batch_size=len(texts), convert_to_tensor=True)
    _assert_equal_embeddings(mine, theirs)


def _ranking_step(model: SentenceTransformer, anchors: list[str], positives: list[str]) -> tuple[float, dict]:
    model.zero_grad()
    loss = MultipleNegativesRankingLoss(model)
    value = loss([model.preprocess(anchors), model.preprocess(positives)], labels=None)
    value.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return value.item(), grads


def test_a_ranking_loss_step_equals_padded_in_float64(minilm_path: str, texts) -> None:
    """MultipleNegativesRankingLoss over (question, answer) pairs: loss and every gradient, float64."""
    packfree_plugin.register()
    answers = [record["answer"][:80] for record in load_gsm8k(limit=len(texts))]
    packed, padded = _minilm(minilm_path, "packfree", torch.float64), _minilm(minilm_path, "sdpa", torch.float64)
    _assert_flattened(packed, answers, first_position=0)
    mine, mine_grads = _ranking_step(packed, texts, answers)
    theirs, their_grads = _ranking_step(padded, texts, answers)
    assert abs(mine - theirs) <= 1e-12, (mine, theirs)
    assert mine_grads.keys() == their_grads.keys() and len(mine_grads) > 50
    assert max_grad_diff(mine_grads, their_grads) <= 1e-10


def test_the_trainer_trains_flattened_as_it_trains_padded(minilm_path: str, texts, tmp_path, monkeypatch) -> None:
    """SentenceTransformerTrainer, two steps of MultipleNegativesRankingLoss: every batch reaches the model flattened,
    and the trained weights equal padded training's (float64, no dropout)."""
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    packfree_plugin.register()
    answers = [record["answer"][:80] for record in load_gsm8k(limit=len(texts))]
    data = Dataset.from_dict({"anchor": texts, "positive": answers})
    rows = []

    def train(implementation: str) -> SentenceTransformer:
        model = _minilm(minilm_path, implementation, torch.float64)
        forward = model[0].model.forward

        def recording(**kwargs):
            rows.append((implementation, list(kwargs["input_ids"].shape), "cu_seq_lens_q" in kwargs))
            return forward(**kwargs)

        monkeypatch.setattr(model[0].model, "forward", recording)
        arguments = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / implementation), max_steps=2, per_device_train_batch_size=4, learning_rate=1e-4,
            report_to="none", save_strategy="no", seed=0, use_cpu=True, dataloader_drop_last=True)
        SentenceTransformerTrainer(model=model, args=arguments, train_dataset=data,
                                   loss=MultipleNegativesRankingLoss(model)).train()
        return model

    packed, padded = train("packfree"), train("sdpa")
    assert [row for row in rows if row[0] == "packfree"] and all(
        shape[0] == 1 and flat for name, shape, flat in rows if name == "packfree"), rows
    assert all(shape[0] == 4 and not flat for name, shape, flat in rows if name == "sdpa"), rows
    worst = max((a - b).abs().max().item() for a, b in zip(packed.parameters(), padded.parameters()))
    assert worst <= 1e-9, f"trained weights differ by {worst}"
