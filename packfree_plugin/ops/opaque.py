"""Boundary-aware functions as one opaque custom op, for ``torch.compile``.

Packed computations read their boundaries on the host (segment loops, ``cu_seqlens.tolist()`` inside
varlen kernels). Traced by Dynamo, each such read would break the graph or bake the packing into it as a
constant. Under compilation every boundary-aware function therefore runs through the custom op
``packfree::boundary_function``: it receives the boundaries as a small CPU tensor of offsets (a graph
input, so a new packing is new data, not a recompile), rebuilds a :class:`Boundaries` inside, and calls
the registered eager function. Its backward (``packfree::boundary_function_backward``) recomputes that
forward under autograd and differentiates it, which costs one extra forward of the function; that is why
eager code calls the functions directly and only compiled code takes the op.

A function is registered once with :func:`boundary_function` and called with :func:`call`.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..boundaries import Boundaries

__all__ = ["boundary_function", "call", "op_arguments"]

BoundaryFunction = Callable[..., torch.Tensor]
"""``(boundaries, *tensors, **options) -> Tensor``; ``tensors`` may hold None."""


@dataclass(frozen=True)
class _Registered:
    run: BoundaryFunction
    output: Callable[..., torch.Tensor]
    """``(*tensors, **options) -> empty tensor`` shaped like ``run``'s result (for tracing)."""


_FUNCTIONS: dict[str, _Registered] = {}


def boundary_function(name: str, *, output: Callable[..., torch.Tensor] | None = None):
    """Decorator: register ``run(boundaries, *tensors, **options)`` under ``name``. ``output`` gives an empty
    tensor of the result's shape and dtype from the same tensors and options (default: like the first)."""

    def register(run: BoundaryFunction) -> BoundaryFunction:
        if name in _FUNCTIONS and _FUNCTIONS[name].run is not run:
            raise ValueError(f"a boundary function named {name!r} is already registered")
        _FUNCTIONS[name] = _Registered(run, output or (lambda first, *_, **__: torch.empty_like(first)))
        return run

    return register


def call(name: str, boundaries: Boundaries, *tensors: torch.Tensor | None, rows: tuple[int, int] | None = None,
         **options: Any) -> torch.Tensor:
    """Run the function registered as ``name``: directly in eager mode, as the custom op while compiling.

    ``options`` must be literals (None, bool, int, float, str, lists/tuples of them): they are written into
    the compiled graph. ``rows``: ``(B, T)`` of the segments, default ``tensors[0].shape[:2]``.
    """
    if boundaries.sequence_shard is not None:  # a shard of a sequence-parallel row: head-parallel on the whole row
        return boundaries.sequence_shard.call(name, _FUNCTIONS[name].run, tensors, options)
    if not torch.compiler.is_compiling():
        return _FUNCTIONS[name].run(boundaries, *tensors, **options)
    return _boundary_op(*op_arguments(name, boundaries, *tensors, rows=rows, **options))


def op_arguments(name: str, boundaries: Boundaries, *tensors: torch.Tensor | None,
                 rows: tuple[int, int] | None = None, **options: Any) -> tuple:
    """The arguments of ``torch.ops.packfree.boundary_function`` for :func:`call`'s arguments."""
    batch_size, seq_len = rows if rows is not None else tensors[0].shape[:2]
    missing = [i for i, t in enumerate(tensors) if t is None]
    encoded = repr((missing, sorted(options.items())))  # json.dumps cannot be traced; repr of literals can
    present = [t if t is not None else tensors[0].new_empty(0) for t in tensors]
    return name, present, boundaries.host_offsets, boundaries.host_padding, batch_size, seq_len, encoded


class _NonFinite(ast.NodeTransformer):
    """``repr`` writes infinite floats as the names ``inf`` / ``nan``; make them constants for literal_eval."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in ("inf", "nan"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        raise ValueError(f"unexpected name {node.id!r} in encoded options")


def _decode(tensors: Sequence[torch.Tensor], encoded: str) -> tuple[list[torch.Tensor | None], dict[str, Any]]:
    missing, options = ast.literal_eval(_NonFinite().visit(ast.parse(encoded, mode="eval")))
    return [None if i in missing else t for i, t in enumerate(tensors)], dict(options)


def _boundaries(host_offsets: torch.Tensor, host_padding: torch.Tensor, batch_size: int, seq_len: int,
                device: torch.device) -> Boundaries:
    return Boundaries(host_offsets.tolist(), batch_size=batch_size, seq_len=seq_len, device=device,
                      padding=host_padding.tolist())


@torch.library.custom_op("packfree::boundary_function", mutates_args=())
def _boundary_op(name: str, tensors: list[torch.Tensor], host_offsets: torch.Tensor, host_padding: torch.Tensor,
                 batch_size: int, seq_len: int, encoded: str) -> torch.Tensor:
    """``_FUNCTIONS[name]`` on ``tensors``; ``host_offsets [N+1]`` int64 / ``host_padding [N]`` bool on the CPU."""
    inputs, options = _decode(tensors, encoded)
    boundaries = _boundaries(host_offsets, host_padding, batch_size, seq_len, tensors[0].device)
    return _fresh(_FUNCTIONS[name].run(boundaries, *inputs, **options), tensors)


def _fresh(result: torch.Tensor, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``result`` contiguous (the layout the fake promises) and sharing no memory with ``inputs``."""
    result = result.contiguous()
    storage = result.untyped_storage().data_ptr()
    if any(t.numel() and t.untyped_storage().data_ptr() == storage for t in inputs):
        result = result.clone()
    return result


@_boundary_op.register_fake
def _(name, tensors, host_offsets, host_padding, batch_size, seq_len, encoded) -> torch.Tensor:
    inputs, options = _decode(tensors, encoded)
    like = _FUNCTIONS[name].output(*inputs, **options)
    return like.new_empty(like.shape)


def _differentiable(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and (tensor.dtype.is_floating_point or tensor.dtype.is_complex)


@torch.library.custom_op("packfree::boundary_function_backward", mutates_args=())
def _boundary_op_backward(name: str, tensors: list[torch.Tensor], host_offsets: torch.Tensor,
                          host_padding: torch.Tensor, batch_size: int, seq_len: int, encoded: str,
                          grad: torch.Tensor) -> list[torch.Tensor]:
    """Gradient of every floating input by recomputing the forward (zeros where unused, ``[0]`` elsewhere),
    contiguous."""
    inputs, options = _decode(tensors, encoded)
    leaves = [t.detach().requires_grad_() if _differentiable(t) else t for t in inputs]
    wrt = [t for t in leaves if _differentiable(t)]
    boundaries = _boundaries(host_offsets, host_padding, batch_size, seq_len, tensors[0].device)
    with torch.enable_grad(), _autograd_inside_custom_op():
        out = _FUNCTIONS[name].run(boundaries, *leaves, **options)
        grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True) if wrt else ())
    result = []
    for leaf in leaves:
        if _differentiable(leaf):
            found = next(grads)
            result.append(_fresh(found, [*tensors, grad]) if found is not None else leaf.new_zeros(leaf.shape))
        else:
            result.append(tensors[0].new_empty(0))
    return result


@_boundary_op_backward.register_fake
def _(name, tensors, host_offsets, host_padding, batch_size, seq_len, encoded, grad):
    inputs, _ = _decode(tensors, encoded)
    return [t.new_empty(t.shape) if _differentiable(t) else tensors[0].new_empty(0) for t in inputs]


def _save(ctx, inputs, output) -> None:
    name, tensors, host_offsets, host_padding, batch_size, seq_len, encoded = inputs
    ctx.save_for_backward(*tensors, host_offsets, host_padding)
    ctx.call = (name, batch_size, seq_len, encoded)


def _backward(ctx, grad: torch.Tensor):
    *tensors, host_offsets, host_padding = ctx.saved_tensors
    name, batch_size, seq_len, encoded = ctx.call
    inputs, _ = _decode(tensors, encoded)
    grads = _boundary_op_backward(name, tensors, host_offsets, host_padding, batch_size, seq_len, encoded, grad)
    tensor_grads = [g if _differentiable(t) else None for g, t in zip(grads, inputs)]
    return None, tensor_grads, None, None, None, None, None


_boundary_op.register_autograd(_backward, setup_context=_save)


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
