"""Boundary-aware sequence-mixing operators for packed rows.

Every family folder has the same files: ``fast.py`` (the pure-PyTorch fast path), ``naive.py`` (``naive_<op>``:
slow per-sample, per-token references the fast path is tested against) and, where a CUDA kernel exists,
``op.py`` (the public op: checks, then the kernel or the fast path). Boundary arguments (``cu_seqlens`` /
``seq_idx``) are described once in :mod:`._boundary_doc` and converted by :mod:`._seq`; optional CUDA kernels
are found lazily by :mod:`._dispatch` (never at import time); :mod:`._chunk_layout` holds the sample-aligned chunk
layout of the recurrent ops that carry per-sample states.

Families: ``conv`` (causal depthwise conv1d), ``ssd`` (Mamba2 chunked scan), ``selective_scan``
(Mamba1), ``gated_delta``, ``linear_attention``, ``lru``. Import them from their subpackages; this
module imports nothing so that loading one op never loads the others.
"""
