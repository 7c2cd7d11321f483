"""``torch.compile`` on a packed row: same results, and how many graphs one forward runs.

A counting backend wraps every graph Dynamo compiles, so a forward's number of graph *executions* is known
(``torch._dynamo.explain`` counts compilations, and a break repeated in every layer compiles once). Graph
breaks per forward = executions - 1. Measured at 2 and 4 layers: any growth is a break per layer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import packfree_plugin
from packfree_plugin.tiny import tiny_config
from packfree_plugin.verify import packed_row
from tests.conftest import assert_close


def graphs_per_forward(model_type: str, layers: int, implementation: str = "packfree") -> tuple[int, float]:
    """(graph executions in one compiled forward, max |compiled - eager| logit difference)."""
    packfree_plugin.register()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, num_hidden_layers=layers),
                                             attn_implementation=implementation, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    batch = packed_row([torch.randint(3, 128, (n,), generator=generator) for n in (5, 9, 3)])
    calls = {"n": 0}

    def counting_backend(graph_module, example_inputs):
        def run(*args):
            calls["n"] += 1
            return graph_module.forward(*args)

        return run

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend)
    with torch.no_grad():
        expected = model(**batch, use_cache=False).logits
        compiled(**batch, use_cache=False)  # compiles
        calls["n"] = 0
        actual = compiled(**batch, use_cache=False).logits
    torch._dynamo.reset()
    assert_close(actual, expected, atol=1e-6, rtol=0, what=f"compiled {model_type}")
    return calls["n"], float((actual - expected).abs().max())


@pytest.fixture(scope="module")
def graph_counts() -> dict[str, dict[int, int]]:
    return {model_type: {layers: graphs_per_forward(model_type, layers)[0] for layers in (2, 4)}
            for model_type in ("llama", "qwen3_next")}


def test_compiled_packed_forward_matches_eager(graph_counts, record_property) -> None:
    """Compiled results equal eager ones (checked inside graphs_per_forward); record the counts."""
    record_property("graphs_per_forward", graph_counts)
    assert all(count >= 1 for counts in graph_counts.values() for count in counts.values())


GDN_BREAKS = pytest.mark.xfail(strict=True, reason=(
    "known limitation: on the Gated DeltaNet hybrid, packfree's Python-side boundary handling breaks the graph "
    "in every layer. Measured (tiny qwen3_next, one packed row of 3 samples, torch 2.13): 29 graphs per forward "
    "at 2 layers, 49 at 4 (stock sdpa Llama: 1). Repeated break sites: host reads of cu_seqlens/seq_idx "
    "(ops/linear_attention/_varlen.py `cu_seqlens.tolist()`, ops/_seq.py `(seq_idx < 0).any()`, ops/conv/masked.py "
    "`.nonzero()`), and ContextVar.get in adapters/routes.py and adapters/registry.py"))


@pytest.mark.parametrize("model_type", ["llama", pytest.param("qwen3_next", marks=GDN_BREAKS)])
def test_boundaries_cause_no_graph_break_per_layer(graph_counts, model_type: str) -> None:
    counts = graph_counts[model_type]
    assert counts[4] == counts[2], f"{model_type} graphs per forward by layer count: {counts}"
