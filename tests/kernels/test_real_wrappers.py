"""flash-attn's ``flash_attn_varlen_func``, torch's ``varlen_attn`` and causal-conv1d's ``causal_conv1d_fn``: their
real Python code, over stand-ins for the compiled CUDA code that apply its argument checks (tests/kernels/standins.py).

Each packed call equals each sample alone, computed here independently in float64 (forward and gradients); a
planted wrong boundary fails; shapes the compiled kernels refuse take packfree's portable path instead of raising.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from packfree_plugin.attention import interface
from packfree_plugin.attention.reference import AttentionOptions
from packfree_plugin.ops.conv import causal_conv1d

from .test_real_fla import boundaries_of, close

ATTENTION_KERNELS = {"flash-attn": ("flash_attn", "flash_attn_varlen_func"),
                     "torch-varlen": ("torch.nn.attention.varlen", "varlen_attn")}
ROWS = [[(1, False), (9, False), (4, False), (2, True)], [(12, False), (3, False), (1, True)]]
"""Two rows of 16 tokens: samples (a one-token one first) and padding spans (True)."""
HALF = torch.float16


def spans(rows: list[list[tuple[int, bool]]]):
    """``(row, start, end, is_padding)`` per span."""
    for b, row in enumerate(rows):
        start = 0
        for length, pad in row:
            yield b, start, start + length, pad
            start += length


def alone_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows, options: AttentionOptions) -> torch.Tensor:
    """Each sample on its own, float64 with explicit masks: ``q [B, H, T, D]``, ``k/v [B, Hkv, T, D*]`` ->
    ``[B, T, H, Dv]``, zeros on padding."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[2], heads, v.shape[-1], dtype=torch.float64)
    for b, start, end, pad in spans(rows):
        if pad:
            continue
        qs = q[b, :, start:end].double()
        ks = k[b, :, start:end].double().repeat_interleave(heads // kv_heads, dim=0)
        vs = v[b, :, start:end].double().repeat_interleave(heads // kv_heads, dim=0)
        logits = qs @ ks.transpose(-1, -2) * options.scale
        if options.softcap:
            logits = options.softcap * torch.tanh(logits / options.softcap)
        i = torch.arange(end - start)[:, None]
        j = torch.arange(end - start)[None, :]
        visible = (j <= i) if options.causal else torch.ones_like(i * j, dtype=torch.bool)
        if options.window is not None:
            visible &= (i - j < options.window) if options.causal else ((i - j).abs() < options.window)
        weights = logits.masked_fill(~visible, -math.inf).softmax(-1)
        out[b, start:end] = (weights @ vs).transpose(0, 1)
    return out


def attention_inputs(q_dim: int, v_dim: int, *, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    batch, seq_len = len(ROWS), sum(n for n, _ in ROWS[0])

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(HALF).requires_grad_()

    return leaf(batch, heads, seq_len, q_dim), leaf(batch, kv_heads, seq_len, q_dim), leaf(batch, kv_heads, seq_len, v_dim)


CASES = {
    # name: (q/k head dim, v head dim, options)
    "gqa-causal": (16, 16, AttentionOptions(scale=0.25, causal=True)),
    "bidirectional": (16, 16, AttentionOptions(scale=0.25, causal=False)),
    "window-causal": (16, 16, AttentionOptions(scale=0.25, causal=True, window=3)),
    "window-bidirectional": (16, 16, AttentionOptions(scale=0.25, causal=False, window=3)),
    "head-dim-12": (12, 12, AttentionOptions(scale=12 ** -0.5, causal=True)),
    "mla-24-16": (24, 16, AttentionOptions(scale=24 ** -0.5, causal=True)),
    "softcap": (16, 16, AttentionOptions(scale=0.25, causal=True, softcap=2.0)),
}
ROUTES = [(backend, case) for backend in ATTENTION_KERNELS for case in CASES
          if not (backend == "torch-varlen" and CASES[case][2].softcap)]
"""softcap runs through flash-attn only (torch's varlen_attn has none: packfree never routes it there)."""


@pytest.mark.parametrize(("backend", "case"), ROUTES)
def test_packed_attention_through_the_real_wrapper(spy, backend, case):
    q_dim, v_dim, options = CASES[case]
    calls = spy(*ATTENTION_KERNELS[backend])
    q, k, v = attention_inputs(q_dim, v_dim)
    boundaries = boundaries_of(ROWS)
    chosen = interface.choose_backend(q, v, options, training=True)
    assert chosen == ("flash-attn" if options.softcap else "torch-varlen")
    out = interface.run_packed_attention(q, k, v, boundaries, options, training=True, backend=backend)
    args, _ = calls.only()
    assert args[3].tolist() == list(boundaries.offsets)
    want = alone_attention(q, k, v, ROWS, options)
    close(out, want, "output vs each sample alone", tol=2e-3)

    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * cot).sum(), [q, k, v])
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad((alone_attention(*ref, ROWS, options) * cot).sum(), ref)
    for name, g, w in zip("qkv", got, expected):
        close(g, w, f"grad {name} vs each sample alone", tol=5e-3)


@pytest.mark.parametrize("backend", list(ATTENTION_KERNELS))
def test_planted_wrong_cu_seqlens_fails(spy, backend):
    """A kernel handed shifted boundaries (the first sample one token longer) disagrees with the samples."""
    calls = spy(*ATTENTION_KERNELS[backend])
    q, k, v = (t.detach() for t in attention_inputs(16, 16))
    options = CASES["gqa-causal"][2]
    shifted = [[(2, False), (8, False), (4, False), (2, True)], ROWS[1]]
    out = interface.run_packed_attention(q, k, v, boundaries_of(shifted), options, backend=backend)
    assert len(calls.calls) == 1
    with pytest.raises(AssertionError, match="max error"):
        close(out, alone_attention(q, k, v, ROWS, options), "output", tol=2e-3)


@pytest.mark.parametrize("backend", list(ATTENTION_KERNELS))
def test_heads_wider_than_flash_takes_the_portable_path(spy, backend):
    """FlashAttention 2 refuses head dims over 256: auto picks the portable path (no kernel call, exact); forcing
    the kernel shows the compiled code's own refusal."""
    calls = spy(*ATTENTION_KERNELS[backend])
    q, k, v = (t.detach() for t in attention_inputs(264, 264))
    options = AttentionOptions(scale=264 ** -0.5, causal=True)
    boundaries = boundaries_of(ROWS)
    assert interface.choose_backend(q, v, options, training=False) == "segments"
    out = interface.run_packed_attention(q, k, v, boundaries, options)
    assert calls.calls == []
    close(out, alone_attention(q, k, v, ROWS, options), "output", tol=2e-3)
    with pytest.raises(RuntimeError, match="head dimension at most 256"):
        interface.run_packed_attention(q, k, v, boundaries, options, backend=backend)


# --------------------------------------------------------------------------- causal-conv1d


def alone_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, rows) -> torch.Tensor:
    """Each span on its own with torch's conv1d, float64: ``x [B, T, C]`` -> ``[B, T, C]`` (silu)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    width = weight.shape[1]
    for b, start, end, _ in spans(rows):
        piece = x[b, start:end].double().T[None]  # [1, C, L]
        conv = F.conv1d(piece, weight.double()[:, None], bias.double(), padding=width - 1, groups=x.shape[2])
        out[b, start:end] = F.silu(conv[0, :, : end - start]).T
    return out


def conv_inputs(channels: int, width: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    batch, seq_len = len(ROWS), sum(n for n, _ in ROWS[0])
    return (torch.randn(batch, seq_len, channels, generator=gen).requires_grad_(),
            torch.randn(channels, width, generator=gen).requires_grad_(),
            torch.randn(channels, generator=gen).requires_grad_())


@pytest.mark.kernels_smoke
def test_packed_conv_through_the_real_wrapper(spy):
    calls = spy("causal_conv1d", "causal_conv1d_fn")
    x, weight, bias = conv_inputs(16)
    seq_idx = boundaries_of(ROWS).seq_idx
    out = causal_conv1d(x, weight, bias, activation="silu", seq_idx=seq_idx)
    args, kwargs = calls.only()
    assert torch.equal(kwargs["seq_idx"], seq_idx) and args[0].shape == (2, 16, 16)
    want = alone_conv(x, weight, bias, ROWS)
    close(out, want, "output vs each sample alone", tol=1e-5)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * cot).sum(), [x, weight, bias])
    ref = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    expected = torch.autograd.grad((alone_conv(*ref, ROWS) * cot).sum(), ref)
    for name, g, w in zip(("x", "weight", "bias"), got, expected):
        close(g, w, f"grad {name} vs each sample alone", tol=1e-5)


def test_planted_wrong_seq_idx_fails_through_the_real_wrapper(spy):
    calls = spy("causal_conv1d", "causal_conv1d_fn")
    x, weight, bias = (t.detach() for t in conv_inputs(16))
    shifted = [[(2, False), (8, False), (4, False), (2, True)], ROWS[1]]
    out = causal_conv1d(x, weight, bias, activation="silu", seq_idx=boundaries_of(shifted).seq_idx)
    assert len(calls.calls) == 1
    with pytest.raises(AssertionError, match="max error"):
        close(out, alone_conv(x, weight, bias, ROWS), "output", tol=1e-5)


def test_channels_causal_conv1d_refuses_take_the_torch_path(spy):
    """causal-conv1d's channel-last (``seq_idx``) layout needs channels divisible by 8: 12 channels stay on torch."""
    calls = spy("causal_conv1d", "causal_conv1d_fn")
    x, weight, bias = (t.detach() for t in conv_inputs(12))
    seq_idx = boundaries_of(ROWS).seq_idx
    out = causal_conv1d(x, weight, bias, activation="silu", seq_idx=seq_idx)
    assert calls.calls == []
    close(out, alone_conv(x, weight, bias, ROWS), "output", tol=1e-5)
    with pytest.raises(RuntimeError, match="divisible by 8"):
        causal_conv1d(x, weight, bias, activation="silu", seq_idx=seq_idx, backend="kernel")


# --------------------------------------------------------------------------- whole models


def attention_pair(model_type: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(packfree model in float16, stock sdpa / eager model in float64)`` with the same weights."""
    from transformers import AutoModelForCausalLM

    from packfree_plugin.cli.tiny import tiny_config
    from tests.conftest import STOCK_REFERENCE, TINY_CAUSAL_LM, build_pair

    if model_type in TINY_CAUSAL_LM:
        model, stock = build_pair(model_type)
        return model.half(), stock
    # DeepSeek-V3's MLA: q/k heads of 16 + 8, v heads of 16
    kwargs = dict(dtype=torch.float64, experts_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, qk_nope_head_dim=16), attn_implementation="packfree",
                                             **kwargs)
    stock = AutoModelForCausalLM.from_config(tiny_config(model_type, qk_nope_head_dim=16),
                                             attn_implementation=STOCK_REFERENCE.get(model_type, "sdpa"), **kwargs)
    stock.load_state_dict(model.state_dict())
    return model.eval().half(), stock.eval()


def sample_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy inside one sample (``logits [L, V]``, ``ids [L]``), summed, in float64."""
    return F.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum")


MODELS = {
    # model type: the backend packfree picks on CUDA for it (float16)
    "llama": "torch-varlen",  # GQA
    "mistral": "torch-varlen",  # sliding window on every layer
    "gemma2": "flash-attn",  # softcap (torch's varlen_attn has none) and per-layer windows
    "deepseek_v3": "torch-varlen",  # MLA: v heads narrower than q/k heads
}


@pytest.mark.parametrize("model_type", list(MODELS))
def test_whole_model_packed_equals_each_sample_alone(spy, model_type):
    """One packed row (position_ids restart per sample) through the model's own layers into the real wrapper:
    logits, the summed per-sample loss and every parameter's gradient equal stock float64 on each sample alone."""
    backend = MODELS[model_type]
    calls = spy(*ATTENTION_KERNELS[backend])
    model, stock = attention_pair(model_type)
    lengths = [1, 9, 6]
    gen = torch.Generator().manual_seed(3)
    samples = [torch.randint(3, 128, (n,), generator=gen) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(input_ids=torch.cat(samples)[None], position_ids=position_ids, use_cache=False).logits[0]
    assert calls.calls, f"the packed forward did not reach {backend}"
    assert all(call[0][3].tolist() == [0, 1, 10, 16] for call in calls.calls)
    loss = sum(sample_loss(piece, ids) for piece, ids in zip(logits.split(lengths), samples))
    loss.backward()

    alone = [stock(input_ids=ids[None], use_cache=False).logits[0] for ids in samples]
    stock_loss = sum(sample_loss(piece, ids) for piece, ids in zip(alone, samples))
    stock_loss.backward()
    close(logits, torch.cat(alone), "logits vs each sample alone", tol=1e-2)
    assert abs(loss.item() - stock_loss.item()) <= 1e-2 * abs(stock_loss.item()), (loss.item(), stock_loss.item())
    stock_params = dict(stock.named_parameters())
    for name, param in model.named_parameters():
        if param.grad is not None:
            close(param.grad, stock_params[name].grad, f"grad {name}", tol=5e-2)


def test_the_installed_wrappers_have_the_recorded_parameters():
    """The default suite holds the contract fakes to these records; here the installed packages themselves import,
    so a release that renames, reorders or re-defaults a parameter fails here too."""
    import causal_conv1d
    import flash_attn

    from tests.kernels.test_signatures import CAUSAL_CONV1D_FN, FLASH_ATTN_VARLEN, parameters

    assert parameters(flash_attn.flash_attn_varlen_func) == FLASH_ATTN_VARLEN
    assert parameters(causal_conv1d.causal_conv1d_fn) == CAUSAL_CONV1D_FN
