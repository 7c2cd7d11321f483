"""Boundary-aware sequence-mixing operators for packed rows.

Every op folder keeps a slow per-sample ``naive.py`` reference beside its fast path. Boundary
arguments (``cu_seqlens`` / ``seq_idx``) are described once in :mod:`._boundary_doc` and converted by
:mod:`._seq`; optional CUDA kernels are found lazily by :mod:`._dispatch` (never at import time).

Families: ``conv`` (causal depthwise conv1d), ``ssd`` (Mamba2 chunked scan), ``selective_scan``
(Mamba1), ``gated_delta``, ``linear_attention``, ``lru``. Import them from their subpackages; this
module imports nothing so that loading one op never loads the others.
"""
