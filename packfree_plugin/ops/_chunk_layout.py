"""Sample-boundary bookkeeping shared by the recurrent-op families (linear attention, gated delta, LRU).

The ``cu_seqlens`` contract of these ops (their docstrings use :data:`._boundary_doc.RECURRENT_CU_SEQLENS_DOC`):

    cu_seqlens: ``[N+1]`` int32 or int64 cumulative sample offsets on the data's device, starting at 0,
        non-decreasing, ending at ``T``. With it the batch dimension ``B`` must be 1 (one flattened row);
        ``N`` is the number of samples, ``T`` the total number of tokens. Sample ``i`` is
        ``x[:, cu_seqlens[i]:cu_seqlens[i+1]]`` and starts from its own initial state (zero, or
        ``initial_state[i]``). Empty samples are allowed; their final state is their initial state.

The chunked paths use one layout for all samples at once (:class:`ChunkLayout`): every sample is cut into
chunks of ``C`` tokens that start on a sample start (the last chunk of a sample is zero-padded), and the
chunks are stored *step-major*: first chunk 0 of every sample, then chunk 1 of every sample that has one,
and so on, with samples ordered longest first. The inter-chunk recurrence then loops over chunk *steps*
(``ceil(max_len / C)`` iterations, never more than the unsplit sequence needs) and step ``j`` touches one
contiguous slice of chunks, one per still-active sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..boundaries import host_of
from ._kept import kept_per_mode
from ._seq import check_cu_seqlens_form



def host_offsets(cu_seqlens: torch.Tensor, *, batch: int, total: int, device: torch.device) -> tuple[int, ...]:
    """Validate ``cu_seqlens`` for a ``[batch, total, ...]`` input and return its offsets as Python ints.

    Raises ValueError naming the offending values. This is the one device-to-host sync of an op call.
    """
    check_cu_seqlens_form(cu_seqlens, batch, device)
    offsets = tuple(host_of(cu_seqlens).tolist())
    if offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {offsets[0]} (cu_seqlens={_short(offsets)})")
    bad = [i for i in range(1, len(offsets)) if offsets[i] < offsets[i - 1]]
    if bad:
        i = bad[0]
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{i - 1}]={offsets[i - 1]} > "
            f"cu_seqlens[{i}]={offsets[i]} (cu_seqlens={_short(offsets)})"
        )
    if offsets[-1] != total:
        raise ValueError(f"cu_seqlens must end at T={total}, got {offsets[-1]} (cu_seqlens={_short(offsets)})")
    return offsets


def row_offsets(batch: int, length: int) -> tuple[int, ...]:
    """Offsets that make each of ``batch`` rows of ``length`` tokens one sample (used when cu_seqlens is None)."""
    return tuple(i * length for i in range(batch + 1))


def _short(offsets: tuple[int, ...], limit: int = 12) -> str:
    if len(offsets) <= limit:
        return str(list(offsets))
    return f"[{', '.join(map(str, offsets[:limit]))}, ... ({len(offsets)} values)]"


def check_same_device(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but q/a is on {device}")


def check_floating(**tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64, everything else runs in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ChunkLayout:
    """All chunks of all samples, step-major (see module docstring).

    Attributes:
        chunk: chunk size ``C``.
        num_samples: ``N``.
        num_tokens: ``T``.
        num_chunks: ``M`` (sum over samples of ``ceil(len_i / C)``).
        active: ``active[j]`` = number of samples with more than ``j`` chunks (non-increasing).
        step_start: first chunk index of step ``j`` (exclusive prefix sum of ``active``).
        rank_to_sample: ``[N]`` long, sample id of rank ``r`` (longest first).
        sample_to_rank: ``[N]`` long, inverse permutation.
        scatter: ``[T]`` long padded slot of every token.
    """

    chunk: int
    num_samples: int
    num_tokens: int
    num_chunks: int
    active: tuple[int, ...]
    step_start: tuple[int, ...]
    rank_to_sample: torch.Tensor
    sample_to_rank: torch.Tensor
    scatter: torch.Tensor

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, ...]`` -> ``[M, C, ...]``, zero in padding slots (one copy: tokens scattered into zeros)."""
        out = x.new_zeros((self.num_chunks * self.chunk, *x.shape[1:]))
        return out.index_copy_(0, self.scatter, x).view(self.num_chunks, self.chunk, *x.shape[1:])

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """``[M, C, ...]`` -> ``[T, ...]`` (drops padding slots)."""
        return y.reshape(self.num_chunks * self.chunk, *y.shape[2:]).index_select(0, self.scatter)

    def to_rank_order(self, per_sample: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` in sample order -> rank order."""
        return per_sample.index_select(0, self.rank_to_sample)

    def to_sample_order(self, per_rank: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` in rank order -> sample order."""
        return per_rank.index_select(0, self.sample_to_rank)


@kept_per_mode(maxsize=64)
def chunk_layout(offsets: tuple[int, ...], chunk: int, device: torch.device) -> ChunkLayout:
    """Build (and cache: every layer of a model reuses it) the step-major chunk layout for ``offsets``."""
    cu = torch.tensor(offsets, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    n = len(offsets) - 1
    total = offsets[-1]
    nchunks = (lens + chunk - 1) // chunk
    rank_to_sample = torch.sort(nchunks, descending=True, stable=True).indices
    sample_to_rank = torch.empty_like(rank_to_sample)
    sample_to_rank[rank_to_sample] = torch.arange(n)
    max_steps = int(nchunks.max()) if n else 0
    # active[j] = #{i : nchunks_i > j}
    counts = torch.bincount(nchunks, minlength=max_steps + 1)
    active = n - torch.cumsum(counts, 0)[:max_steps]
    step_start = torch.cumsum(active, 0) - active
    m = int(active.sum())
    # For every chunk slot m: its step j and rank r, hence its sample and first token.
    step_of = torch.repeat_interleave(torch.arange(max_steps), active)
    rank_of = torch.arange(m) - step_start[step_of]
    sample_of = rank_to_sample[rank_of]
    first = cu[sample_of] + step_of * chunk
    valid_len = torch.clamp(lens[sample_of] - step_of * chunk, max=chunk)
    pos = torch.arange(chunk)
    valid = pos[None, :] < valid_len[:, None]
    gather = torch.where(valid, first[:, None] + pos[None, :], torch.full_like(valid_len[:, None], total))
    scatter = torch.empty(total, dtype=torch.long)
    scatter[gather[valid]] = torch.arange(m * chunk).view(m, chunk)[valid]
    return ChunkLayout(
        chunk=chunk,
        num_samples=n,
        num_tokens=total,
        num_chunks=m,
        active=tuple(int(a) for a in active),
        step_start=tuple(int(s) for s in step_start),
        rank_to_sample=rank_to_sample.to(device),
        sample_to_rank=sample_to_rank.to(device),
        scatter=scatter.to(device),
    )


def split_steps(layout: ChunkLayout, *tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Split chunk-indexed tensors ``[M, ...]`` into per-step pieces ``[active[j], ...]``.

    One ``split`` per tensor rather than a slice per step: the backward of a slice zero-fills a gradient of
    the full ``[M, ...]`` shape every step (quadratic in the number of steps), a split's backward is one cat.
    """
    pieces = [t.split(list(layout.active), dim=0) for t in tensors]
    return list(zip(*pieces))


def run_chunk_steps(layout: ChunkLayout, state: torch.Tensor, step, *per_chunk: torch.Tensor) -> tuple[list, torch.Tensor]:
    """Drive the inter-chunk recurrence over the layout.

    Args:
        state: ``[N, ...]`` initial states in rank order.
        step: ``step(state [a, ...], *pieces) -> (new_state [a, ...], extra)`` for the ``a`` active samples of
            a step, where ``pieces`` are that step's ``[a, ...]`` slices of ``per_chunk``; ``extra`` (anything)
            is collected per step.
        per_chunk: chunk-indexed tensors ``[M, ...]`` the step reads.

    Returns:
        (extras per step, final states ``[N, ...]`` in rank order).
    """
    finished: list[torch.Tensor] = []
    extras: list = []
    n = layout.num_samples
    first_active = layout.active[0] if layout.active else 0
    if first_active < n:
        finished.append(state[first_active:])
    state = state[:first_active]
    steps = split_steps(layout, *per_chunk) if per_chunk else [()] * len(layout.active)
    for j, (a, pieces) in enumerate(zip(layout.active, steps)):
        state, extra = step(state, *pieces)
        extras.append(extra)
        nxt = layout.active[j + 1] if j + 1 < len(layout.active) else 0
        if nxt < a:
            finished.append(state[nxt:])
            state = state[:nxt]
    finished.reverse()
    return extras, torch.cat(finished, dim=0)


def check_qkv(q, k, v, initial_state, cu_seqlens, **other: torch.Tensor | None) -> tuple[int, int, int, int, int]:
    """Shared checks of the fla-style ops that need no host sync: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``,
    ``initial_state [N, H, K, V]``, the form of ``cu_seqlens`` (not its values); ``other`` tensors (gates) are
    checked for dtype class and device only. Returns ``(B, T, H, K, V)``; raises ValueError naming the argument."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_floating(q=q, k=k, v=v, initial_state=initial_state, **other)
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must have shape [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    V = v.shape[-1]
    check_same_device(q.device, k=k, v=v, initial_state=initial_state, **other)
    if cu_seqlens is not None:
        check_cu_seqlens_form(cu_seqlens, B, q.device)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(
            f"initial_state must have shape [N, H, K, V] = {[N, H, K, V]} (N = number of samples), "
            f"got {tuple(initial_state.shape)}"
        )
    return B, T, H, K, V


def validate_qkv(q, k, v, initial_state, cu_seqlens, **other: torch.Tensor | None):
    """:func:`check_qkv` plus the values of ``cu_seqlens`` (a host sync). Returns ``(offsets, (B, T, H, K, V))``."""
    B, T, H, K, V = check_qkv(q, k, v, initial_state, cu_seqlens, **other)
    offsets = host_offsets(cu_seqlens, batch=B, total=T, device=q.device) if cu_seqlens is not None else row_offsets(B, T)
    return offsets, (B, T, H, K, V)
