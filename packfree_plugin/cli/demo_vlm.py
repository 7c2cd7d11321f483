"""The vision-language demo: train a small Qwen2-VL on the embedded captioned images twice, padded and packed.

Data flows top to bottom:

1. :func:`vision_samples`: the 45 embedded CC0 images (three sizes each, so 4 to 16 image tokens) through
   transformers' Qwen2-VL image processor (PIL, offline), and their question and caption through MiniLM's
   WordPiece tokenizer, compacted to the ids used. A sample is ``<vision_start> <image> x n question answer``;
   only the text is trained on (labels -100 on the image placeholders).
2. :func:`vision_config`: a small Qwen2-VL (multimodal RoPE, a 2-layer vision tower).
3. :func:`packfree_plugin.cli.demo_runs.train` twice from the same weights, on the same samples in the same order:
   padded (:class:`PaddedVisionCollator`, stock ``sdpa``; the model numbers positions from the mask) and packed
   (:class:`packfree_plugin.packing.VisionPackedCollator`, ``packfree``; each sample's own
   ``get_rope_index`` positions, its images concatenated in sample order, one unpadded row per step).
4. :func:`run_vision_demo`: the report (``report-vlm.md``), per-step losses side by side, and ``demo-vlm.png``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .demo_batches import minilm_tokenizer
from .demo_report import RELATIVE_LOSS_DIFFERENCE, loss_table, plot, summarize, throughput_table
from .demo_runs import WARMUP_STEPS, build_model, default_threads, train

__all__ = ["PaddedVisionCollator", "VisionDemoOptions", "run_vision_demo", "vision_config", "vision_samples"]

PATCH = 14
MERGE = 2
"""Qwen2-VL's patch size and its 2 x 2 merge of patches into one image token."""
_AUTO = "AutoModelForImageTextToText"


@dataclass
class VisionDemoOptions:
    epochs: int = 4
    batch_size: int = 15
    hidden_size: int = 256
    num_layers: int = 4
    learning_rate: float = 2e-3
    seed: int = 0
    out: str = "packfree-report"
    progress: bool = True
    threads: int | None = None


@dataclass(frozen=True)
class SpecialIds:
    pad: int
    vision_start: int
    image: int
    video: int


def vision_samples(tokenizer=None) -> tuple[list[dict[str, Any]], int, SpecialIds]:
    """One feature per embedded image: ``input_ids``, ``labels``, ``mm_token_type_ids`` (``[T]`` lists),
    ``pixel_values [patches, 3 * 2 * 14 * 14]`` and ``image_grid_thw [1, 3]``; the vocabulary size; the special ids."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .data import load_captioned_images

    images = load_captioned_images()
    processor = Qwen2VLImageProcessorPil(min_pixels=(PATCH * MERGE) ** 2, max_pixels=112 * 112)
    tokenizer = tokenizer or minilm_tokenizer()
    texts = tokenizer([f"Question: {image.question} Answer: {image.answer}" for image in images])["input_ids"]
    used = sorted({token for text in texts for token in text})
    compact = {token: i + 1 for i, token in enumerate(used)}  # 0 stays the padding id
    special = SpecialIds(pad=0, vision_start=len(used) + 1, image=len(used) + 2, video=len(used) + 3)
    features = []
    for image, text in zip(images, texts):
        processed = processor(images=[image.pixels], return_tensors="pt")
        grid = processed["image_grid_thw"]
        placeholders = int(grid.prod()) // MERGE**2
        text_ids = [compact[token] for token in text]
        input_ids = [special.vision_start] + [special.image] * placeholders + text_ids
        features.append({
            "input_ids": input_ids,
            "labels": [-100] * (1 + placeholders) + text_ids,
            "mm_token_type_ids": [0] + [1] * placeholders + [0] * len(text_ids),
            "pixel_values": processed["pixel_values"],
            "image_grid_thw": grid,
        })
    return features, special.video + 1, special


def vision_config(vocab_size: int, special: SpecialIds, *, hidden_size: int = 128, num_layers: int = 4):
    """A small Qwen2-VL: ``num_layers`` text layers of width ``hidden_size`` with multimodal RoPE, 2 vision layers."""
    from transformers import AutoConfig

    head_dim = 32
    heads = hidden_size // head_dim
    return AutoConfig.for_model(
        "qwen2_vl",
        text_config=dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), intermediate_size=2 * hidden_size,
                         vocab_size=vocab_size, pad_token_id=special.pad, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4},
                         tie_word_embeddings=True),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=hidden_size, num_heads=2, mlp_ratio=2,
                           in_channels=3, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2),
        image_token_id=special.image, video_token_id=special.video, vision_start_token_id=special.vision_start,
        pad_token_id=special.pad, bos_token_id=None, eos_token_id=None, tie_word_embeddings=True,
    )


class PaddedVisionCollator:
    """Right-pad a step's samples to its longest (stock batching): ``attention_mask`` marks the padding, labels are
    -100 there, the images are concatenated in sample order."""

    def __init__(self, pad_token_id: int = 0) -> None:
        self.pad_token_id = pad_token_id
        self.slot_tokens = 0

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        self.slot_tokens += longest * len(features)

        def padded(key: str, fill: int) -> torch.Tensor:
            return torch.tensor([list(f[key]) + [fill] * (longest - len(f[key])) for f in features])

        return {
            "input_ids": padded("input_ids", self.pad_token_id),
            "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"]))
                                            for f in features]),
            "labels": padded("labels", -100),
            "mm_token_type_ids": padded("mm_token_type_ids", 0),
            "pixel_values": torch.cat([f["pixel_values"] for f in features]),
            "image_grid_thw": torch.cat([f["image_grid_thw"] for f in features]),
        }


class _CountingCollator:
    """A collator that also counts the tokens its rows hold, padding included (``slot_tokens``)."""

    def __init__(self, collate: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]) -> None:
        self.collate = collate
        self.slot_tokens = 0

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = self.collate(features)
        self.slot_tokens += batch["input_ids"].numel()
        return batch


def compare_vision_training(options: VisionDemoOptions) -> dict[str, Any]:
    """Both runs from the same initial weights; returns ``padded``/``packed`` results, the config and sizes."""
    from ..packing import VisionPackedCollator
    from ..loading.register import register

    threads = torch.get_num_threads()
    torch.set_num_threads(options.threads or default_threads())
    try:
        register()
        features, vocab, special = vision_samples()
        config = vision_config(vocab, special, hidden_size=options.hidden_size, num_layers=options.num_layers)
        initial = build_model(config, "eager", seed=options.seed, auto_class=_AUTO).state_dict()
        epochs = features * options.epochs
        steps = len(epochs) // options.batch_size
        common = dict(steps=steps, batch_size=options.batch_size, learning_rate=options.learning_rate,
                      seed=options.seed, out=options.out, progress=options.progress)
        padded_model = build_model(config, "sdpa", initial, options.seed, auto_class=_AUTO)
        padded = train(padded_model, epochs, PaddedVisionCollator(special.pad), label="padded", **common)
        packed_model = build_model(config, "packfree", initial, options.seed, auto_class=_AUTO)
        collator = _CountingCollator(VisionPackedCollator(packed_model, pad_token_id=special.pad))
        packed = train(packed_model, epochs, collator, label="packed", **common)
    finally:
        torch.set_num_threads(threads)
    return {"padded": padded, "packed": packed, "config": config, "vocab": vocab, "samples": len(features),
            "steps": steps}


def write_vision_report(out: Path, options: VisionDemoOptions, result: Mapping[str, Any]) -> Path:
    padded, packed = result["padded"], result["packed"]
    summary = summarize(result)
    lines = [
        "# packfree demo: padded vs packed vision-language training",
        "",
        f"Model: `qwen2_vl`, text width {options.hidden_size}, {options.num_layers} layers (multimodal RoPE), a 2-layer "
        f"vision tower; vocabulary {result['vocab']}. Data: the {result['samples']} embedded CC0 captioned images "
        f"(4 to 16 image tokens each), {options.epochs} epochs in the same order in both runs, {options.batch_size} "
        f"samples a step, {result['steps']} steps. HF `Trainer`, AdamW lr {options.learning_rate}.",
        "",
        *throughput_table(padded, packed),
    ]
    lines += [
        "",
        f"**Speedup: {summary['speedup']:.2f}x** (tokens run padded / packed {summary['tokens_run_ratio']:.2f}x; "
        f"each run's first {WARMUP_STEPS} steps left out). Largest relative loss difference "
        f"({RELATIVE_LOSS_DIFFERENCE}) over {len(padded.losses)} steps: **{summary['max_rel_loss_diff']:.2e}**; "
        f"padded loss went {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}.",
        "",
        *loss_table(padded, packed),
        "",
        "![loss and throughput](demo-vlm.png)",
        "",
    ]
    path = out / "report-vlm.md"
    path.write_text("\n".join(lines))
    (out / "demo-vlm.json").write_text(json.dumps({"options": asdict(options), "summary": summary}, indent=2))
    return path


def run_vision_demo(options: VisionDemoOptions, *, echo: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole vision-language demo; returns its summary and writes report-vlm.md, demo-vlm.png, demo-vlm.json."""
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = compare_vision_training(options)
    plot(out / "demo-vlm.png", result["padded"], result["packed"])
    report = write_vision_report(out, options, result)
    summary = summarize(result)
    summary.update(report=str(report), total_seconds=time.perf_counter() - started)
    echo(f"speedup {summary['speedup']:.2f}x (tokens run padded / packed {summary['tokens_run_ratio']:.2f}x; "
         f"{summary['padded_tokens_per_s']:,.0f} -> {summary['packed_tokens_per_s']:,.0f} real tokens/s); "
         f"largest relative loss difference {summary['max_rel_loss_diff']:.1e}")
    echo(f"report: {report}  ({summary['total_seconds']:.0f} s)")
    return summary
