"""Routing into the fused CUDA varlen kernels, checked on CPU with contract fakes.

Each fake has the real function's signature, asserts the boundary arguments it receives, and computes
with the naive reference of ``test_segments``. The "is this on an accelerator" predicate is swapped so
the dispatcher takes the CUDA route for CPU tensors.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.attention.varlen as torch_varlen_module

from packfree_plugin.ops import backends
from packfree_plugin.attention import interface, varlen
from packfree_plugin.attention.reference import AttentionOptions
from packfree_plugin.boundaries import Boundaries
from tests.attention.test_segments import naive_attention
from tests.conftest import assert_close

LENGTHS = [3, 1, 6, 2]


class FakeKernel:
    """Records calls and checks the flash-style varlen contract: ``[total, H, D]`` + int32 cu_seqlens."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def check_and_compute(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal, window, softcap):
        assert q.ndim == 3 and k.ndim == 3 and v.ndim == 3, "varlen kernels take [total_tokens, H, D]"
        head_dim = q.shape[-1]  # FlashAttention 2's mha_varlen_fwd: one head dim, a multiple of 8, at most 256
        assert k.shape[-1] == v.shape[-1] == head_dim and head_dim % 8 == 0 and head_dim <= 256, "head dims"
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, "cu_seqlens must be int32"
        assert cu_q.device == q.device and cu_q.ndim == 1
        assert torch.equal(cu_q, cu_k)
        assert isinstance(max_q, int) and isinstance(max_k, int), "max_seqlen must be a host int (no sync)"
        lengths = cu_q.diff().tolist()
        assert max_q == max_k == max(lengths)
        assert cu_q[-1].item() == q.shape[0]
        left = window[0]
        self.calls.append({"cu": cu_q.tolist(), "window": window, "softcap": softcap, "causal": causal})
        pieces = []
        for start, end in zip(cu_q.tolist(), cu_q.tolist()[1:]):
            width = None if left < 0 else left + 1  # flash's inclusive band -> transformers' window
            pieces.append(
                naive_attention(
                    q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
                    scale=scale, causal=causal, window=width, softcap=softcap or None, sinks=None,
                ).transpose(0, 1)
            )
        return torch.cat(pieces).to(q.dtype)


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(backends, "on_cuda", lambda tensor: True)
    monkeypatch.setattr(varlen, "_HALF_DTYPES", (torch.float16, torch.bfloat16, torch.float64))
    for loader in (backends.load_kernel, varlen._kernels_hub):
        loader.cache_clear()
    yield
    for loader in (backends.load_kernel, varlen._kernels_hub):
        loader.cache_clear()


def _install_flash_attn(monkeypatch, kernel: FakeKernel) -> None:
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        assert dropout_p == 0.0
        return kernel.check_and_compute(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        scale=softmax_scale, causal=causal, window=window_size, softcap=softcap)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))


def _install_torch_varlen(monkeypatch, kernel: FakeKernel) -> None:
    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert enable_gqa == (query.shape[1] != key.shape[1])
        causal = window_size[1] == 0
        return kernel.check_and_compute(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale,
                                        causal=causal, window=window_size, softcap=None)

    monkeypatch.setattr(torch_varlen_module, "varlen_attn", varlen_attn)


def _inputs(kv_heads: int = 2):
    generator = torch.Generator().manual_seed(0)
    seq_len = sum(LENGTHS)
    q = torch.randn(1, 4, seq_len, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(1, kv_heads, seq_len, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(1, kv_heads, seq_len, 8, generator=generator, dtype=torch.float64)
    return q, k, v, Boundaries.from_position_ids(torch.cat([torch.arange(n) for n in LENGTHS])[None])


def _expected(q, k, v, boundaries, options):
    from packfree_plugin.attention.segments import segment_attention

    return segment_attention(q, k, v, boundaries, options)


@pytest.mark.parametrize("window", [None, 2], ids=["full", "window2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_torch_varlen_gets_cu_seqlens_and_window(monkeypatch, on_cuda, causal: bool, window: int | None) -> None:
    kernel = FakeKernel()
    _install_torch_varlen(monkeypatch, kernel)
    q, k, v, boundaries = _inputs()
    options = AttentionOptions(scale=0.4, causal=causal, window=window)
    assert interface.choose_backend(q, q, options, training=False) == "torch-varlen"
    out = interface.run_packed_attention(q, k, v, boundaries, options)
    assert kernel.calls[0]["cu"] == [0, 3, 4, 10, 12]
    expected_left = -1 if window is None else window - 1  # flash's convention, causal and bidirectional
    assert kernel.calls[0]["window"] == (expected_left, 0 if causal else expected_left)
    assert_close(out, _expected(q, k, v, boundaries, options))


def test_softcap_skips_torch_varlen_and_reaches_flash_attn(monkeypatch, on_cuda) -> None:
    torch_kernel, flash_kernel = FakeKernel(), FakeKernel()
    _install_torch_varlen(monkeypatch, torch_kernel)
    _install_flash_attn(monkeypatch, flash_kernel)
    q, k, v, boundaries = _inputs()
    options = AttentionOptions(scale=0.4, causal=True, softcap=2.0, window=3)
    assert interface.choose_backend(q, q, options, training=False) == "flash-attn"
    out = interface.run_packed_attention(q, k, v, boundaries, options)
    assert not torch_kernel.calls and flash_kernel.calls[0]["softcap"] == 2.0
    assert_close(out, _expected(q, k, v, boundaries, options))


def test_dropout_in_training_skips_torch_varlen_and_reaches_flash_attn(monkeypatch, on_cuda) -> None:
    """torch's varlen kernel takes no dropout: a training call with attention dropout goes to flash-attn, an
    evaluation call (no dropout applied) still to torch's kernel (mutant: the choice was asked without ``training``,
    and training calls took torch's kernel)."""
    _install_torch_varlen(monkeypatch, FakeKernel())
    _install_flash_attn(monkeypatch, FakeKernel())
    q, _, v, _ = _inputs()
    options = AttentionOptions(scale=0.4, causal=True, dropout=0.1)
    assert interface.choose_backend(q, v, options, training=True) == "flash-attn"
    assert interface.choose_backend(q, v, options, training=False) == "torch-varlen"


def test_kernels_hub_is_used_when_flash_attn_is_missing(monkeypatch, on_cuda) -> None:
    kernel = FakeKernel()
    _install_flash_attn(monkeypatch, kernel)
    hub_module = sys.modules.pop("flash_attn")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` now fails
    import kernels

    monkeypatch.setattr(kernels, "get_kernel", lambda repo_id, **kwargs: hub_module)
    monkeypatch.delattr(torch_varlen_module, "varlen_attn")
    q, k, v, boundaries = _inputs()
    options = AttentionOptions(scale=0.4, causal=True, softcap=1.5)
    assert interface.choose_backend(q, q, options, training=False) == "kernels-hub"
    out = interface.run_packed_attention(q, k, v, boundaries, options)
    assert kernel.calls
    assert_close(out, _expected(q, k, v, boundaries, options))


@pytest.mark.parametrize(("q_dim", "v_dim"), [(12, 12), (24, 16), (16, 24)], ids=["dim12", "mla", "wide-v"])
@pytest.mark.parametrize("backend", ["torch-varlen", "flash-attn"])
def test_head_dims_are_padded_to_one_the_kernel_takes(monkeypatch, on_cuda, backend: str, q_dim: int, v_dim: int) -> None:
    """q/k and v heads that differ (MLA) or are not a multiple of 8 reach the kernel zero-padded to one head dim;
    the output is cropped back to v's and equals the samples' attention."""
    kernel = FakeKernel()
    {"torch-varlen": _install_torch_varlen, "flash-attn": _install_flash_attn}[backend](monkeypatch, kernel)
    generator = torch.Generator().manual_seed(1)
    q, k, v, boundaries = _inputs()
    q, k = (torch.randn(*t.shape[:3], q_dim, generator=generator, dtype=torch.float64) for t in (q, k))
    v = torch.randn(*v.shape[:3], v_dim, generator=generator, dtype=torch.float64)
    options = AttentionOptions(scale=q_dim**-0.5, causal=True)
    out = interface.run_packed_attention(q, k, v, boundaries, options, backend=backend)
    assert kernel.calls and out.shape[-1] == v_dim
    assert_close(out, _expected(q, k, v, boundaries, options))


def test_heads_over_256_take_the_portable_path(monkeypatch, on_cuda) -> None:
    _install_flash_attn(monkeypatch, FakeKernel())
    q = torch.zeros(1, 4, 8, 264, dtype=torch.float16)
    assert interface.choose_backend(q, q, AttentionOptions(scale=0.1, causal=True), training=False) == "segments"


def test_sinks_and_float32_take_the_portable_path(monkeypatch, on_cuda) -> None:
    _install_flash_attn(monkeypatch, FakeKernel())
    q, _, _, _ = _inputs()
    sinks = AttentionOptions(scale=0.4, causal=True, sinks=torch.zeros(4))
    assert interface.choose_backend(q, q, sinks, training=False) == "segments"
    monkeypatch.setattr(varlen, "_HALF_DTYPES", (torch.float16, torch.bfloat16))
    assert interface.choose_backend(q, q, AttentionOptions(scale=0.4, causal=True), training=False) == "segments"


def test_padding_segments_are_zeroed_by_fused_backends(monkeypatch, on_cuda) -> None:
    kernel = FakeKernel()
    _install_torch_varlen(monkeypatch, kernel)
    q, k, v, _ = _inputs()
    mask = torch.ones(1, q.shape[2], dtype=torch.long)
    mask[0, -3:] = 0
    boundaries = Boundaries.from_attention_mask(mask)
    out = interface.run_packed_attention(q, k, v, boundaries, AttentionOptions(scale=0.4, causal=True))
    assert torch.count_nonzero(out[0, -3:]) == 0
    assert_close(out[0, :-3], _expected(q, k, v, boundaries, AttentionOptions(scale=0.4, causal=True))[0, :-3])


def test_forced_backend_must_exist(monkeypatch) -> None:
    monkeypatch.setenv("PACKFREE_ATTENTION_BACKEND", "nonsense")
    q, _, _, _ = _inputs()
    with pytest.raises(ValueError, match="not a packfree attention backend"):
        interface.choose_backend(q, q, AttentionOptions(scale=1.0, causal=True), training=False)


def test_unknown_tensor_arguments_are_refused_not_ignored() -> None:
    q, k, v, boundaries = _inputs()
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="position_bias"):
        interface.packfree_attention_forward(module, q, k, v, boundaries, position_bias=torch.zeros(1))


def test_sinks_keyword_is_applied_like_s_aux() -> None:
    q, k, v, boundaries = _inputs()
    module = torch.nn.Module()
    sinks = torch.linspace(-1, 1, 4, dtype=torch.float64)
    as_sinks, _ = interface.packfree_attention_forward(module, q, k, v, boundaries, scaling=0.4, sinks=sinks)
    as_s_aux, _ = interface.packfree_attention_forward(module, q, k, v, boundaries, scaling=0.4, s_aux=sinks)
    plain, _ = interface.packfree_attention_forward(module, q, k, v, boundaries, scaling=0.4)
    assert torch.equal(as_sinks, as_s_aux) and not torch.allclose(as_sinks, plain)
