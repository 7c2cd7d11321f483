"""Gaps ``nox -s mutants`` found (docs/testing.md, "Planted bugs"): inputs a user passes that no other test passed
in this form, each held to its clear refusal (named, with the shape it needs) or to the same segments as its plain
form. In the boundary object, the model entry's release, segment attention's query blocks and the public ops'
input checks."""

from __future__ import annotations

import pytest
import torch

from packfree_plugin.attention import segments
from packfree_plugin.attention.interface import run_packed_attention
from packfree_plugin.attention.reference import AttentionOptions
from packfree_plugin.boundaries import Boundaries
from packfree_plugin.forward.hook import has_entry
from packfree_plugin.ops.conv import causal_conv1d
from packfree_plugin.ops.selective_scan import selective_scan
from packfree_plugin.ops.ssd import ssd_chunk_scan
from tests.attention.test_segments import _packed_inputs, naive_attention
from tests.conftest import assert_close
from tests.helpers import STOCK, fresh_pair, samples_of


def _cu(lengths: list[int]) -> torch.Tensor:
    """``[N+1]`` int32 running sum of ``lengths`` with a leading 0."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("offsets", [[[0, 4, 8]], [[0, 4], [4, 8]]], ids=["one row", "per-row offsets"])
def test_cu_seqlens_of_two_dimensions_are_refused_as_such(offsets: list[list[int]]) -> None:
    """A collator's ``[1, N + 1]`` or per-row ``[B, N + 1]`` offsets are refused naming the 1-D form they need
    (mutant: the check read ``and``, so any tensor passed it and the offsets broke later in int())."""
    with pytest.raises(ValueError, match=r"cu_seqlens must be a 1-D tensor \[N\+1\], got \("):
        Boundaries.from_cu_seqlens(torch.tensor(offsets), batch_size=1, seq_len=8)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_max_length_given_as_a_tensor_reads_as_its_int(dtype: torch.dtype) -> None:
    """``max_length_q`` / ``_k`` as one-element tensors (as some collators send them) bound the samples exactly as
    the ints do: the longest length is accepted, a shorter one refused with its value (mutant: the tensor's host
    copy was read from None)."""
    lengths = [3, 5]
    as_int = Boundaries.from_model_inputs(batch_size=1, seq_len=8, device="cpu", cu_seq_lens_q=_cu(lengths),
                                          cu_seq_lens_k=_cu(lengths), max_length_q=5, max_length_k=5)
    as_tensor = Boundaries.from_model_inputs(batch_size=1, seq_len=8, device="cpu", cu_seq_lens_q=_cu(lengths),
                                             cu_seq_lens_k=_cu(lengths), max_length_q=torch.tensor(5, dtype=dtype),
                                             max_length_k=torch.tensor([5], dtype=dtype))
    assert as_tensor.offsets == as_int.offsets == (0, 3, 8)
    with pytest.raises(ValueError, match="max_length 4 contradicts cu_seqlens, whose longest segment is 5"):
        Boundaries.from_cu_seqlens(_cu(lengths), batch_size=1, seq_len=8, max_seqlen=torch.tensor(4, dtype=dtype))
    with pytest.raises(ValueError, match="max_length_q=4 differs from max_length_k=5"):
        Boundaries.from_model_inputs(batch_size=1, seq_len=8, device="cpu", cu_seq_lens_q=_cu(lengths),
                                     cu_seq_lens_k=_cu(lengths), max_length_q=torch.tensor(4, dtype=dtype),
                                     max_length_k=torch.tensor(5, dtype=dtype))


def test_position_ids_of_one_row_number_every_row() -> None:
    """``position_ids [1, T]`` beside ``B`` rows of tokens (what a collator or the model's own arange sends) give the
    segments of those ids repeated on every row (mutant: the broadcast to ``B`` rows lost its batch size)."""
    one_row = torch.cat([torch.arange(n) for n in (3, 5)])[None]
    shared = Boundaries.from_model_inputs(batch_size=2, seq_len=8, device="cpu", position_ids=one_row)
    per_row = Boundaries.from_model_inputs(batch_size=2, seq_len=8, device="cpu", position_ids=one_row.repeat(2, 1))
    assert shared.offsets == per_row.offsets == (0, 3, 8, 11, 16)


def _ssd_inputs(batch: int = 1, tokens: int = 6, heads: int = 4, head_dim: int = 2, groups: int = 2,
                state: int = 3) -> dict[str, torch.Tensor]:
    """Well-formed ``ssd_chunk_scan`` inputs: x ``[B, T, H, P]``, dt ``[B, T, H]``, A ``[H]``, B/C ``[B, T, G, N]``."""
    return dict(x=torch.randn(batch, tokens, heads, head_dim), dt=torch.rand(batch, tokens, heads),
                A=-torch.rand(heads), B=torch.randn(batch, tokens, groups, state),
                C=torch.randn(batch, tokens, groups, state))


@pytest.mark.parametrize(("name", "bad", "message"), [
    ("x", torch.randn(1, 6, 8), r"x must be a \[B, T, H, P\] tensor"),
    ("B", torch.randn(1, 5, 2, 3), r"B must be \[B, T, G, N\] with B=1, T=6"),
], ids=["x of 3 dims", "B of another length"])
def test_ssd_inputs_of_another_shape_are_refused_naming_the_input(name: str, bad: torch.Tensor, message: str) -> None:
    """packfree's own refusal, not a failure deeper in the op (mutants: ``or`` read as ``and`` in its checks)."""
    inputs = {**_ssd_inputs(), name: bad}
    if name == "B":
        inputs["C"] = bad
    with pytest.raises(ValueError, match=message):
        ssd_chunk_scan(**inputs, chunk_size=4)


SSD_OPTIONAL = {"D": (4,), "z": (1, 6, 4, 2), "dt_bias": (4,)}
"""``ssd_chunk_scan``'s optional inputs and their shapes beside :func:`_ssd_inputs` (H=4, P=2)."""


@pytest.mark.parametrize("name", ["x", "dt", "A", "B", "C", *SSD_OPTIONAL])
def test_an_ssd_input_of_integers_is_refused_naming_it(name: str) -> None:
    """Each input given as integers is refused by its own name, as the caller passed it (mutants: the names in the
    check's list changed, so the refusal named another input or none)."""
    inputs = {**_ssd_inputs(), **{key: torch.randn(shape) for key, shape in SSD_OPTIONAL.items()}}
    inputs[name] = inputs[name].round().long()
    with pytest.raises(ValueError, match=rf"^{name} must be floating point"):
        ssd_chunk_scan(**inputs, chunk_size=4)


@pytest.mark.parametrize("name", ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"])
def test_a_selective_scan_input_of_integers_is_refused_naming_it(name: str) -> None:
    """The same for ``selective_scan``: u, delta, z ``[B, D, T]``, A ``[D, N]``, B, C ``[B, N, T]``, D and
    delta_bias ``[D]``."""
    inputs = dict(u=torch.randn(1, 4, 6), delta=torch.rand(1, 4, 6), A=-torch.rand(4, 3), B=torch.randn(1, 3, 6),
                  C=torch.randn(1, 3, 6), D=torch.randn(4), z=torch.randn(1, 4, 6), delta_bias=torch.randn(4))
    inputs[name] = inputs[name].round().long()
    positional = [inputs.pop(key) for key in ("u", "delta", "A", "B", "C")]
    with pytest.raises(ValueError, match=rf"^{name} must be floating point"):
        selective_scan(*positional, **inputs)


@pytest.mark.parametrize("name", ["B", "C"])
def test_a_selective_scan_b_or_c_of_another_length_is_refused_naming_it(name: str) -> None:
    """``B`` / ``C`` of 5 tokens beside ``u [1, 4, 6]``: refused by the name of the one passed."""
    inputs = dict(u=torch.randn(1, 4, 6), delta=torch.rand(1, 4, 6), A=-torch.rand(4, 3), B=torch.randn(1, 3, 6),
                  C=torch.randn(1, 3, 6))
    inputs[name] = torch.randn(1, 3, 5)
    with pytest.raises(ValueError, match=rf"^{name} must be \[B, N, T\] = \[1, 3, 6\]"):
        selective_scan(*inputs.values())


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_a_conv_weight_or_bias_of_another_dtype_is_refused_naming_it(name: str) -> None:
    """``causal_conv1d``'s weight ``[C, K]`` or bias ``[C]`` in float32 beside a float64 ``x [B, T, C]``."""
    inputs = dict(x=torch.randn(1, 6, 4, dtype=torch.float64), weight=torch.randn(4, 3, dtype=torch.float64),
                  bias=torch.randn(4, dtype=torch.float64))
    inputs[name] = inputs[name].float()
    with pytest.raises(ValueError, match=rf"^{name} is torch.float32 on cpu, x is torch.float64"):
        causal_conv1d(**inputs)


def test_a_selective_scan_u_of_two_dims_is_refused_naming_it() -> None:
    """``u [D, T]`` without its batch axis (mutant: the check read ``and``, and the unpacking of its shape failed)."""
    u = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"u must be a \[B, D, T\] tensor"):
        selective_scan(u, torch.rand(4, 6), -torch.rand(4, 3), torch.randn(1, 3, 6), torch.randn(1, 3, 6))


@pytest.mark.parametrize("model_type", ["llama", "mamba2"])
def test_a_released_model_under_accelerate_offload_runs_as_stock(model_type: str) -> None:
    """accelerate's ``cpu_offload`` wraps the forward packfree's entry took; switching back to stock attention
    releases it (``packfree_plugin.release``), which gives it back the class's forward, and the model then equals its
    stock twin under the same hooks (mutant: the forward restored was None, and the next call raised)."""
    accelerate = pytest.importorskip("accelerate")
    model, stock = fresh_pair(model_type)
    for twin in (model, stock):
        accelerate.cpu_offload(twin, execution_device="cpu")
    model.set_attn_implementation(STOCK.get(model_type, "sdpa"))
    assert not has_entry(model)
    ids = torch.tensor(samples_of([7])[0])[None]
    with torch.no_grad():
        released = model(input_ids=ids, use_cache=False).logits
        expected = stock(input_ids=ids, use_cache=False).logits
    assert_close(released, expected, atol=0, rtol=0, what=f"{model_type} released")


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["GQA", "MQA"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_grouped_keys_in_query_blocks_equal_each_sample_alone(kv_heads: int, causal: bool) -> None:
    """Samples longer than a query block under a window that binds, without softcap or sinks: each block runs sdpa
    on its keys in reach, grouped (4 query heads on fewer key heads). Each sample equals the naive reference alone
    (mutants: ``enable_gqa`` dropped from the block's sdpa call, or read from the block's length, which then failed
    on grouped keys)."""
    lengths = [10, 3, 9]  # query blocks of 4, 4, 2 and 4, 4, 1 tokens: a last block as long as the key heads
    q, k, v, boundaries = _packed_inputs(lengths, 4, kv_heads, 1)
    options = AttentionOptions(scale=0.4, causal=causal, window=3)
    out = segments.segment_attention(q, k, v, boundaries, options, query_block=4)
    for start, length in zip(boundaries.offsets, boundaries.lengths):
        piece = slice(start, start + length)
        expected = naive_attention(q[0, :, piece], k[0, :, piece], v[0, :, piece], scale=0.4, causal=causal,
                                   window=3, softcap=None, sinks=None)
        assert_close(out[0, piece].transpose(0, 1), expected, what=f"sample at {start}")


def test_forcing_the_portable_backend_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PACKFREE_ATTENTION_BACKEND=segments`` (a backend packfree has) runs segment attention: each sample equals
    the naive reference alone (mutant: the check of the forced name read ``or``, and refused every backend)."""
    monkeypatch.setenv("PACKFREE_ATTENTION_BACKEND", "segments")
    lengths = [5, 2, 6]
    q, k, v, boundaries = _packed_inputs(lengths, 4, 2, 1)
    out = run_packed_attention(q, k, v, boundaries, AttentionOptions(scale=0.4, causal=True))
    for start, length in zip(boundaries.offsets, boundaries.lengths):
        piece = slice(start, start + length)
        expected = naive_attention(q[0, :, piece], k[0, :, piece], v[0, :, piece], scale=0.4, causal=True,
                                   window=None, softcap=None, sinks=None)
        assert_close(out[0, piece].transpose(0, 1), expected, what=f"sample at {start}")
