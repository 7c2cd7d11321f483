"""Boundary-aware functions as custom ops, one per function, for ``torch.compile``.

Packed computations read their boundaries on the host (segment loops, ``cu_seqlens.tolist()`` inside varlen
kernels). Traced by Dynamo, each such read would break the graph or bake the packing into it as a constant. Under
compilation every boundary-aware function therefore runs as its own custom op ``packfree::<name>``: it receives the
boundaries as two small CPU tensors (offsets and padding flags: graph inputs, so a new packing is new data, not a
recompile), rebuilds a :class:`Boundaries` inside, and calls the eager function. Its backward
(``packfree::<name>_backward``) recomputes that forward under autograd and differentiates it, which costs one extra
forward of the function; that is why eager code calls the functions directly and only compiled code takes the op.

A function is declared once with :func:`boundary_op`: its annotated signature is the op's schema (tensors
positional, options keyword-only), and its :class:`Layout` says what each tensor is to a sequence-parallel shard
(:mod:`packfree_plugin.parallel.head_parallel` reads it). It is called with :func:`call`.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..boundaries import Boundaries

__all__ = ["CHANNELS", "GROUPS", "PARAMS", "SHARED", "TOKENS", "BoundaryOp", "Layout", "boundary_op", "call",
           "declared", "declared_ops"]

BoundaryFunction = Callable[..., torch.Tensor]
"""``(boundaries, *tensors, **options) -> Tensor``; ``tensors`` may hold None."""

TOKENS = "tokens"
"""``[B, T, H, ...]`` (or ``[B, T, C]``): one entry per token, heads (or channels) on dim 2."""
CHANNELS = "channels"
"""``[B, C, T]``: channels on dim 1, tokens on dim 2."""
PARAMS = "params"
"""``[H, ...]``: per-head (or per-channel) parameters."""
GROUPS = "groups"
"""``[B, T, G, N]``: head groups that several heads read (Mamba2's B/C)."""
SHARED = "shared"
"""``[B, N, T]`` or ``[B, G, N, T]``: read by every head, or by a group of heads (Mamba1's B/C)."""


@dataclass(frozen=True)
class Layout:
    """What each tensor argument of an op is (:data:`TOKENS`, :data:`CHANNELS`, :data:`PARAMS`, :data:`GROUPS`,
    :data:`SHARED`), and what its output is: how a sequence-parallel shard splits it by heads."""

    inputs: tuple[str, ...]
    output: str


@dataclass(frozen=True)
class BoundaryOp:
    """One declared boundary function and its custom op."""

    name: str
    run: BoundaryFunction
    output: Callable[..., torch.Tensor]
    """``(*tensors, **options) -> empty tensor`` shaped like ``run``'s result (for tracing)."""
    layout: Layout | None
    tensors: tuple[str, ...]
    """The names of its tensor arguments, in order."""
    options: tuple[str, ...]
    """The names of its keyword-only options."""

    @property
    def op(self) -> torch._ops.OpOverloadPacket:
        return getattr(torch.ops.packfree, self.name)


_OPS: dict[str, BoundaryOp] = {}
_LIBRARY = torch.library.Library("packfree", "DEF")  # kept alive: dropping it would unregister the ops
_BOUNDARY_SCHEMA = "Tensor host_offsets, Tensor host_padding, SymInt batch_size, SymInt seq_len"
_SCALARS = {float: "float", int: "SymInt", bool: "bool", str: "str", torch.Tensor: "Tensor"}


def _schema_type(annotation: Any, where: str) -> str:
    """The schema type of a parameter's annotation: a tensor or literal, optional (``| None``) or a list of them."""
    arguments = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in arguments:
        (inner,) = [a for a in arguments if a is not type(None)]
        return _schema_type(inner, where) + "?"
    if typing.get_origin(annotation) in (list, tuple):
        return _schema_type(arguments[0], where) + "[]"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    raise TypeError(f"{where}: no custom-op schema type for {annotation!r}")


def boundary_op(name: str, *, layout: Layout | None = None, output: Callable[..., torch.Tensor] | None = None):
    """Decorator: declare ``run(boundaries, *tensors, **options)`` as the custom op ``packfree::<name>``. Its
    positional parameters after ``boundaries`` are tensors (``torch.Tensor`` or ``torch.Tensor | None``), its
    keyword-only ones options (float, int, bool, str, optional or lists of them). ``output`` gives an empty tensor of
    the result's shape and dtype from the same arguments (default: like the first tensor)."""

    def declare(run: BoundaryFunction) -> BoundaryFunction:
        if name in _OPS:
            raise ValueError(f"a boundary op named {name!r} is already declared")
        hints = typing.get_type_hints(run)
        parameters = list(inspect.signature(run).parameters.values())[1:]
        tensors = tuple(p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD)
        options = tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)
        if layout is not None and len(layout.inputs) != len(tensors):
            raise ValueError(f"{name}: the layout names {len(layout.inputs)} tensors, the function takes {tensors}")
        positional = ", ".join(f"{_schema_type(hints[n], name)} {n}" for n in tensors)
        keywords = "".join(f", {_schema_type(hints[n], name)} {n}" for n in options)
        keywords = f", *{keywords}" if keywords else ""
        _LIBRARY.define(f"{name}({positional}, {_BOUNDARY_SCHEMA}{keywords}) -> Tensor")
        _LIBRARY.define(f"{name}_backward({positional}, {_BOUNDARY_SCHEMA}, Tensor grad{keywords}) -> Tensor[]")
        declared_op = BoundaryOp(name, run, output or (lambda first, *_, **__: torch.empty_like(first)), layout,
                                 tensors, options)
        _register(declared_op)
        _OPS[name] = declared_op
        return run

    return declare


def declared(name: str) -> BoundaryOp:
    """The boundary op declared as ``name``."""
    return _OPS[name]


def declared_ops() -> dict[str, BoundaryOp]:
    """Every declared boundary op, by name."""
    return dict(_OPS)


def call(name: str, boundaries: Boundaries, *tensors: torch.Tensor | None, rows: tuple[int, int] | None = None,
         **options: Any) -> torch.Tensor:
    """Run the boundary op ``name``: directly in eager mode, as its custom op while compiling; on a shard of a
    sequence-parallel row, head-parallel on the whole row. ``rows``: ``(B, T)`` of the segments, default
    ``tensors[0].shape[:2]``."""
    declared_op = _OPS[name]
    if boundaries.sequence_shard is not None:
        return boundaries.sequence_shard.call(name, declared_op.run, tensors, options)
    if not torch.compiler.is_compiling():
        return declared_op.run(boundaries, *tensors, **options)
    batch_size, seq_len = rows if rows is not None else tensors[0].shape[:2]
    return declared_op.op(*tensors, boundaries.host_offsets, boundaries.host_padding, batch_size, seq_len, **options)


def _boundaries(host_offsets: torch.Tensor, host_padding: torch.Tensor, batch_size: int, seq_len: int,
                device: torch.device) -> Boundaries:
    """``host_offsets [N+1]`` int64 / ``host_padding [N]`` bool on the CPU, back into boundaries on ``device``."""
    return Boundaries(host_offsets.tolist(), batch_size=batch_size, seq_len=seq_len, device=device,
                      padding=host_padding.tolist())


def _device(tensors: Sequence[torch.Tensor | None]) -> torch.device:
    return next(t for t in tensors if t is not None).device


def _fresh(result: torch.Tensor, inputs: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """``result`` contiguous (the layout the fake promises) and sharing no memory with ``inputs``."""
    result = result.contiguous()
    storage = result.untyped_storage().data_ptr()
    if any(t is not None and t.numel() and t.untyped_storage().data_ptr() == storage for t in inputs):
        result = result.clone()
    return result


def _differentiable(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and (tensor.dtype.is_floating_point or tensor.dtype.is_complex)


def _register(declared_op: BoundaryOp) -> None:
    """The forward, fake, backward and autograd of ``packfree::<name>``."""
    name, run, count = declared_op.name, declared_op.run, len(declared_op.tensors)

    def forward(*arguments: Any, **options: Any) -> torch.Tensor:
        tensors, boundary = arguments[:count], arguments[count:]
        return _fresh(run(_boundaries(*boundary, _device(tensors)), *tensors, **options), tensors)

    def fake(*arguments: Any, **options: Any) -> torch.Tensor:
        like = declared_op.output(*arguments[:count], **options)
        return like.new_empty(like.shape)

    def backward_op(*arguments: Any, **options: Any) -> list[torch.Tensor]:
        """Gradient of every floating input by recomputing the forward (zeros where unused, ``[0]`` elsewhere)."""
        tensors, boundary, grad = arguments[:count], arguments[count:-1], arguments[-1]
        leaves = [t.detach().requires_grad_() if _differentiable(t) else t for t in tensors]
        wrt = [t for t in leaves if _differentiable(t)]
        with torch.enable_grad(), _autograd_inside_custom_op():
            out = run(_boundaries(*boundary, _device(tensors)), *leaves, **options)
            grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True) if wrt else ())
        result = []
        for leaf in leaves:
            found = next(grads) if _differentiable(leaf) else None
            if found is not None:
                result.append(_fresh(found, [*tensors, grad]))
            else:
                result.append(leaf.new_zeros(leaf.shape) if _differentiable(leaf) else grad.new_empty(0))
        return result

    def backward_fake(*arguments: Any, **options: Any) -> list[torch.Tensor]:
        grad = arguments[-1]
        return [t.new_empty(t.shape) if _differentiable(t) else grad.new_empty(0) for t in arguments[:count]]

    def save(ctx: Any, inputs: tuple, output: torch.Tensor, keyword_only_inputs: dict[str, Any] | None = None) -> None:
        tensors, (host_offsets, host_padding, batch_size, seq_len) = inputs[:count], inputs[count:]
        ctx.present = [t is not None for t in tensors]
        ctx.save_for_backward(*(t for t in tensors if t is not None), host_offsets, host_padding)
        ctx.sizes, ctx.options = (batch_size, seq_len), keyword_only_inputs or {}

    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        *saved, host_offsets, host_padding = ctx.saved_tensors
        given = iter(saved)
        tensors = [next(given) if present else None for present in ctx.present]
        grads = getattr(torch.ops.packfree, f"{name}_backward")(*tensors, host_offsets, host_padding, *ctx.sizes,
                                                                 grad, **ctx.options)
        return (*(g if _differentiable(t) else None for g, t in zip(grads, tensors)), None, None, None, None)

    _LIBRARY.impl(name, forward, "CompositeExplicitAutograd")
    _LIBRARY.impl(f"{name}_backward", backward_op, "CompositeExplicitAutograd")
    torch.library.register_fake(f"packfree::{name}", lib=_LIBRARY)(fake)
    torch.library.register_fake(f"packfree::{name}_backward", lib=_LIBRARY)(backward_fake)
    torch.library.register_autograd(f"packfree::{name}", backward, setup_context=save, lib=_LIBRARY)


def _autograd_inside_custom_op() -> torch._C._ForceDispatchKeyGuard:
    """Custom ops run with autograd dispatch keys excluded; a recomputing backward needs them back
    (autocast stays excluded, as it was for the forward)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    autocast = [key for name, key in vars(torch._C.DispatchKey).items()
                if name.startswith("Autocast") and isinstance(key, torch._C.DispatchKey) and excluded.has(key)]
    keep = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU).remove(torch._C.DispatchKey.AutocastCPU)
    for key in autocast:
        keep = keep.add(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keep)
