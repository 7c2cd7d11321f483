"""Helpers shared by the tests (import them from here; conftest.py files hold fixtures and hooks): a packfree model
and its stock twin, samples, batch layouts, gradient comparisons."""

from __future__ import annotations

from functools import cache

import torch

from packfree_plugin.cli.tiny import load_model

FAMILIES = ("llama", "qwen3_next", "mamba2", "lfm2")
"""One representative tiny model per family: attention only, Gated DeltaNet hybrid, Mamba2, LFM2 short conv."""

STOCK = {"mamba2": "eager", "falcon_mamba": "eager"}
"""Stock implementation of the reference twin (pure Mamba models have no sdpa path); sdpa otherwise."""


def fresh_pair(model_type: str, *, dtype: torch.dtype = torch.float64, seed: int = 0):
    """``(packfree_model, stock_model)`` with identical tiny random weights, in eval mode."""
    model = load_model(model_type, "packfree", dtype=dtype, seed=seed)
    stock = load_model(model_type, STOCK.get(model_type, "sdpa"), dtype=dtype, seed=seed + 1)
    stock.load_state_dict(model.state_dict())
    return model, stock


@cache
def shared_pair(model_type: str, dtype: torch.dtype = torch.float64):
    """A cached pair (float64 by default): callers must leave weights unchanged and zero their gradients."""
    return fresh_pair(model_type, dtype=dtype)


def samples_of(lengths: list[int], *, seed: int = 0, vocab: int = 128) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed + 31 * len(lengths) + sum(lengths))
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def padded_batch(samples: list[list[int]]) -> dict[str, torch.Tensor]:
    """Right-padded stock batch; labels -100 on padding and on each sample's first token (never predicted)."""
    from packfree_plugin.cli.demo import PaddedCollator

    return PaddedCollator()([{"input_ids": s} for s in samples])


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def max_grad_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference; a parameter with a gradient in only one dict counts with its own size."""
    worst = 0.0
    for name in a.keys() | b.keys():
        x, y = a.get(name), b.get(name)
        if x is None or y is None:
            worst = max(worst, float((x if y is None else y).abs().max()))
        else:
            worst = max(worst, float((x - y).abs().max()))
    return worst


# ------------------------------------------------------------------------------------- ranks
COLLECTIVE_SECONDS = 60
"""How long a rank waits in one collective for its peers (the gloo process group's timeout) before it raises: the
ranks of a test run the same small steps, seconds apart even on a loaded 2-core machine, so a rank that waits this
long waits for a peer that took another path (a planted bug in a head-group split hung 4 minutes before this)."""


def wait_for_ranks(processes: list, seconds: float) -> list[int | None]:
    """Wait for spawned rank ``processes`` until all exit, one fails, or ``seconds`` pass; end the ones still running
    (a rank left waiting in a collective for a failed peer) and return the exit codes as they were (None: it was
    still running)."""
    import time

    deadline = time.monotonic() + seconds
    while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
        if any(process.exitcode not in (None, 0) for process in processes):
            break
        time.sleep(0.5)
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return codes
