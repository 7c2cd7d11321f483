"""The native tier: route packed boundaries into the kernel functions transformers' mixers already call.

transformers builds its Mamba, Mamba2, Gated DeltaNet, KDA and short-conv layers around a fixed set of
module-level kernel functions (``causal_conv1d_fn``, ``torch_chunk_gated_delta_rule``,
``chunk_kimi_delta_attention``, ``mamba2_chunk_scan``, ``mamba_selective_scan``, ...). Each mixer class's entry
(:data:`packfree_plugin.classes.CLASSES`, ``routes``) names them and its modeling module, and :func:`install_routes` gives each packfree's
route: through ``kernels.kernelize`` and a kernel mapping where transformers declares the function as a kernel seam
(a ``kernels`` layer, :func:`packfree_plugin.compat.kernel_seam`), else by wrapping the module function in a
router. Outside a packfree native call the route is transparent (it calls the original). Inside one
(:func:`native_forward`, which pushes a :class:`~packfree_plugin.forward.context.NativeCall`), it calls the
matching route of :data:`ROUTED_KERNELS`, which runs packfree's boundary-aware op on that call's
boundaries; the op itself picks the CUDA kernel (causal-conv1d, mamba-ssm, fla) when present.

Rules that keep this from ever being silently wrong:

- fused whole-layer kernels (``mamba_inner_fn``, ``mamba_split_conv1d_scan_combined``) return None under
  packing, so the layer takes its split path, where each step is routed;
- decoding kernels (``*_update``, ``fused_recurrent_*``) and any cache state raise;
- a native call in which the layer routed no kernel at all raises: the layer mixes tokens some other
  way and must use the generic tier.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn

from .. import compat
from ..ops import backends, opaque
from ..boundaries import Boundaries, host_of, keep_host, memo
from ..classes import routed_functions
from ..forward.context import NativeCall, enter_native, exit_native, native_call
from ..forward.keywords import CACHE_ARGUMENTS, PACKFREE_KWARGS
from ..ops._nonfinite import Quarantine
from ..ops.opaque import CHANNELS, GROUPS, PARAMS, SHARED, TOKENS, Layout, boundary_op
from .registry import MixerAdapter

__all__ = ["OPTIONAL_KERNELS", "PackfreeRoutes", "ROUTED_KERNELS", "install_routes", "is_routed", "may_reach_kernels",
           "native_forward", "quarantined", "uninstall_routes"]

_ROUTED_ATTR = "_packfree_routed_original"


# ------------------------------------------------------------------------------------------ routes
# Each route adapts a transformers kernel's call convention to a packfree op, called through
# ``opaque.call`` so compiled graphs get it as one custom op that takes the boundaries as data.

@boundary_op("causal_conv1d", layout=Layout((TOKENS, PARAMS, PARAMS), TOKENS))
def _conv_op(boundaries: Boundaries, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
             activation: str | None) -> torch.Tensor:
    """``x [B, T, C]``, ``weight [C, K]`` -> ``[B, T, C]``."""
    from ..ops.conv import causal_conv1d

    # validate=False: boundaries build their seq_idx valid (reading it back per layer costs a short row dearly)
    return causal_conv1d(x, weight, bias, activation=activation, seq_idx=boundaries.seq_idx, validate=False)


def _conv(call: NativeCall, hidden_states, weight, bias=None, activation=None, **_: Any):
    """transformers' ``causal_conv1d_fn``: ``[B, C, T]`` in and out."""
    x = hidden_states.to(weight.dtype).transpose(1, 2)
    out = opaque.call("causal_conv1d", call.boundaries, x, weight, bias, activation=activation)
    return out.transpose(1, 2).to(hidden_states.dtype)


def _refuse_state(call: NativeCall, kernel: str, **states: Any) -> None:
    given = [name for name, value in states.items() if value not in (None, False)]
    if given:
        raise ValueError(f"{call.layer_name}: {kernel} got {', '.join(given)} in a packed batch (no cache allowed)")


def _like_value(query, key, value, *_: Any, **__: Any) -> torch.Tensor:
    return torch.empty_like(value)


@boundary_op("chunk_gated_delta_rule", layout=Layout((TOKENS,) * 5, TOKENS), output=_like_value)
def _gated_delta_op(boundaries: Boundaries, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor, *, scale: float | None,
                    use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    """``q/k [B, T, H, K]``, ``v [B, T, H, V]``, ``g/beta [B, T, H]`` -> ``[B, T, H, V]``."""
    from ..ops.gated_delta import chunk_gated_delta_rule

    return _flattened(boundaries, chunk_gated_delta_rule, query, key, value, g, beta, scale=scale,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


@boundary_op("chunk_kda", layout=Layout((TOKENS,) * 5, TOKENS), output=_like_value)
def _kda_op(boundaries: Boundaries, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, *, scale: float | None, use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    """``q/k [B, T, H, K]``, ``v [B, T, H, V]``, ``g [B, T, H, K]``, ``beta [B, T, H]`` -> ``[B, T, H, V]``."""
    from ..ops.gated_delta import chunk_kda

    return _flattened(boundaries, chunk_kda, q, k, v, g, beta, scale=scale,
                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _flattened(boundaries: Boundaries, op: Callable, *tensors: torch.Tensor, **options: Any) -> torch.Tensor:
    """Run an fla-style op (``[B, T, ...]`` tensors, ``cu_seqlens`` needs B == 1) on the flattened rows.
    validate=False: boundaries build their cu_seqlens valid (reading it back per layer costs a short row dearly),
    and hand over the per-token form they hold (the op would derive it again)."""
    from ..ops._seq import describe_cu_seqlens

    batch, seq_len = tensors[0].shape[:2]
    flat = [t.reshape(1, batch * seq_len, *t.shape[2:]) for t in tensors]
    flat_ids = memo(boundaries, "flat_seq_idx", None, lambda: keep_host(
        boundaries.seq_idx.view(1, batch * seq_len), host_of(boundaries.seq_idx).reshape(1, -1)))
    cu_seqlens = describe_cu_seqlens(boundaries.cu_seqlens, flat_ids)
    out, _ = op(*flat, cu_seqlens=cu_seqlens, validate=False, **options)
    return out.reshape(batch, seq_len, *out.shape[2:]).to(tensors[2].dtype)


def _gated_delta(call: NativeCall, query, key, value, g, beta, chunk_size=64, initial_state=None,
                 output_final_state=False, use_qk_l2norm_in_kernel=False, scale=None, **_: Any):
    _refuse_state(call, "chunk_gated_delta_rule", initial_state=initial_state, output_final_state=output_final_state)
    query, key = _value_heads(query, key, value)
    return opaque.call("chunk_gated_delta_rule", call.boundaries, query, key, value, g, beta, scale=scale,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel), None


def _kda(call: NativeCall, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
         use_qk_l2norm_in_kernel=False, **_: Any):
    _refuse_state(call, "chunk_kda", initial_state=initial_state, output_final_state=output_final_state)
    q, k = _value_heads(q, k, v)
    return opaque.call("chunk_kda", call.boundaries, q, k, v, g, beta, scale=scale,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel), None


def _value_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped value heads (more value than key heads, ``[B, T, H, D]``): repeat q/k heads as transformers does."""
    repeat = value.shape[2] // key.shape[2]
    if repeat == 1:
        return query, key
    return query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)


@boundary_op("ssd_chunk_scan", layout=Layout((TOKENS, TOKENS, PARAMS, GROUPS, GROUPS, PARAMS, TOKENS, PARAMS), TOKENS))
def _ssd_op(boundaries: Boundaries, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None, dt_bias: torch.Tensor | None, *,
            chunk_size: int, dt_softplus: bool, dt_limit: list[float]) -> torch.Tensor:
    """``x [B, T, H, P]`` -> ``[B, T, H, P]``."""
    from ..ops.ssd import ssd_chunk_scan

    return ssd_chunk_scan(x, dt, A, B, C, chunk_size=chunk_size, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                          dt_limit=tuple(dt_limit), seq_idx=boundaries.seq_idx, validate=False).to(x.dtype).contiguous()


def _ssd(call: NativeCall, hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
         dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, z=None, **_: Any):
    """transformers' ``mamba_chunk_scan_combined``: ``x [B, T, H, P]``."""
    _refuse_state(call, "mamba_chunk_scan_combined", initial_states=initial_states,
                  return_final_states=return_final_states)
    # contiguous: callers .view() the result, as mamba-ssm allows
    return opaque.call("ssd_chunk_scan", call.boundaries, hidden_states, dt, A, B, C, D, z, dt_bias,
                       chunk_size=int(chunk_size), dt_softplus=bool(dt_softplus),
                       dt_limit=[float(v) for v in dt_limit])


@boundary_op("selective_scan", layout=Layout(
    (CHANNELS, CHANNELS, PARAMS, SHARED, SHARED, PARAMS, CHANNELS, PARAMS), CHANNELS))
def _selective_scan_op(boundaries: Boundaries, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor,
                       B: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None,
                       delta_bias: torch.Tensor | None, *, delta_softplus: bool) -> torch.Tensor:
    """``u [B, D, T]`` -> ``[B, D, T]``."""
    from ..ops.selective_scan import selective_scan

    return selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus,
                          seq_idx=boundaries.seq_idx, validate=False).to(u.dtype).contiguous()


def _selective_scan(call: NativeCall, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                    delta_softplus=False, return_last_state=False, **_: Any):
    """transformers' ``selective_scan_fn``: ``u [B, D, T]``."""
    _refuse_state(call, "selective_scan_fn", return_last_state=return_last_state)
    return opaque.call("selective_scan", call.boundaries, hidden_states, dt, A, B, C, D, z, delta_bias,
                       delta_softplus=bool(delta_softplus), rows=(hidden_states.shape[0], hidden_states.shape[2]))


def _unfused(call: NativeCall, *args: Any, **kwargs: Any) -> None:
    """Fused whole-layer kernels: decline, so the layer runs its routed split path."""
    call.routed -= 1  # declining is not routing
    return None


def _decode_only(kernel: str) -> Callable:
    def refuse(call: NativeCall, *args: Any, **kwargs: Any):
        raise ValueError(f"{call.layer_name} called the decoding kernel {kernel} on a packed batch")

    return refuse


ROUTED_KERNELS: dict[str, Callable] = {
    "causal_conv1d_fn": _conv,
    "chunk_gated_delta_rule": _gated_delta,
    "chunk_kda": _kda,
    "mamba_chunk_scan_combined": _ssd,
    "selective_scan_fn": _selective_scan,
    "mamba_inner_fn": _unfused,
    "mamba_split_conv1d_scan_combined": _unfused,
    "causal_conv1d_update": _decode_only("causal_conv1d_update"),
    "selective_state_update": _decode_only("selective_state_update"),
    "fused_recurrent_gated_delta_rule": _decode_only("fused_recurrent_gated_delta_rule"),
    "fused_recurrent_kda": _decode_only("fused_recurrent_kda"),
}
"""transformers kernel name -> packfree route ``(call, *args, **kwargs)`` with the kernel's call convention."""


# ------------------------------------------------------------------------------------ installation
_PREFIX = "transformers.models."

OPTIONAL_KERNELS = frozenset({"mamba_inner_fn", "mamba_split_conv1d_scan_combined", "causal_conv1d_update",
                              "selective_state_update", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda"})
"""Kernels a modeling module may lack without losing its packed path: the fused whole-layer kernels (the layer then
runs its split path, every step routed) and the decoding kernels (a packed call never decodes). transformers 5.25
dropped ``mamba_inner_fn`` from FalconMamba and Jamba."""


@functools.cache
def _kernel_packages() -> dict[str, tuple[str, str]]:
    """Routed kernel name -> the CUDA kernel package ``(module, attr)`` its packfree op calls where it can."""
    from ..ops.conv.op import KERNEL as CONV
    from ..ops.gated_delta.op import FLA_GDN, FLA_KDA
    from ..ops.ssd.op import KERNEL as SSD

    return {"causal_conv1d_fn": CONV, "chunk_gated_delta_rule": FLA_GDN, "chunk_kda": FLA_KDA,
            "mamba_chunk_scan_combined": SSD}


def may_reach_kernels(layer: nn.Module, probe: torch.Tensor) -> bool:
    """Whether a native call of ``layer`` on tensors like ``probe`` may run a CUDA kernel package (causal-conv1d,
    fla, mamba-ssm) rather than packfree's torch ops only. Those packages do not keep a sample's NaN or inf out of
    the others, the torch ops do (:mod:`packfree_plugin.ops._nonfinite`; the conv by construction), so the mixer
    quarantines its input only when this holds. False off CUDA: no device sync, no import."""
    if not backends.on_cuda(probe):
        return False
    routed = routed_functions().get(type(layer).__module__.removeprefix(_PREFIX), {}).values()
    packages = _kernel_packages()
    return any(backends.load_kernel(*packages[kernel]) is not None for kernel in routed if kernel in packages)


def _route(kernel: str, original: Callable, *args: Any, **kwargs: Any) -> Any:
    """``original(*args, **kwargs)`` outside a native call; inside one, the packfree route of ``kernel``."""
    call = native_call()
    if call is None:
        return original(*args, **kwargs)
    call.routed += 1
    return ROUTED_KERNELS[kernel](call, *args, **kwargs)


def _router(kernel: str, original: Callable) -> Callable:
    """A plain module function's router (a release without the kernel seam)."""

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any):
        return _route(kernel, original, *args, **kwargs)

    setattr(routed, _ROUTED_ATTR, original)
    return routed


_INSTALLED: set[str] = set()
"""Names of the modeling modules whose kernel functions are routed now."""
_SEAMED: dict[nn.Module, dict[str, Any]] = {}
"""Kernel-function modules packfree kernelized -> the instance attributes ``kernelize`` changed on them, as they were
before (absent ones as :data:`_ABSENT`), so :func:`uninstall_routes` puts back exactly what was there."""
_ABSENT = object()


def install_routes(module: ModuleType) -> list[str]:
    """Route every function the class entries' ``routes`` list for ``module`` (idempotent); returns their kernel
    names.

    Where transformers declares the function as a kernel function (``use_kernel_func_from_hub_with_fallback``, a
    ``kernels`` layer: :func:`packfree_plugin.compat.kernel_seam`), ``kernels.kernelize`` gives it packfree's route
    (:class:`PackfreeRoutes`); on a release without that seam, the module function is wrapped in a router. Raises
    ``ValueError`` when a function that mixes tokens is missing (a transformers release packfree does not know)."""
    functions = routed_functions().get(module.__name__.removeprefix(_PREFIX), {})
    installed = []
    for function, kernel in functions.items():
        current = getattr(module, function, None)
        if current is None and kernel in OPTIONAL_KERNELS:
            continue
        if current is None:
            raise ValueError(compat.unroutable_message(module.__name__, function, kernel, "is missing"))
        if compat.kernel_seam(current):
            _kernelize(module.__name__, function, current, kernel)
        elif not hasattr(current, _ROUTED_ATTR):
            setattr(module, function, _router(kernel, current))
        installed.append(kernel)
    _INSTALLED.add(module.__name__)
    return installed


def _kernelize(module_name: str, function: str, kernel_function: nn.Module, kernel: str) -> None:
    """Give the kernel-function module ``kernel_function`` packfree's route through ``kernels``' own mapping and
    ``kernelize``: the route runs the function's forward as before outside a packfree native call."""
    from kernels import Mode, kernelize, use_kernel_mapping

    if kernel_function in _SEAMED:
        return
    before = dict(kernel_function.__dict__)
    mapping = {kernel: {"cpu": PackfreeRoutes(module_name, function, kernel)}}
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(kernel_function, device="cpu", mode=Mode.TRAINING | Mode.TORCH_COMPILE, use_fallback=False)
    except (ValueError, TypeError) as error:  # the seam names another kernel, or its signature changed
        why = f"is a kernels layer that refused packfree's route ({error})"
        raise ValueError(compat.unroutable_message(module_name, function, kernel, why)) from error
    after = kernel_function.__dict__
    _SEAMED[kernel_function] = {name: before.get(name, _ABSENT) for name in {*before, *after}
                                if before.get(name, _ABSENT) is not after.get(name, _ABSENT)}


class PackfreeRoutes:
    """A ``kernels`` repository (``load()`` -> layer class) holding packfree's route of one transformers kernel
    function: a layer with the function's signature whose forward, inside a native call, runs the route of
    :data:`ROUTED_KERNELS`, and outside one the function's own forward (so the model's per-layer kernels, hub
    kernels a user chose included, run as before)."""

    def __init__(self, module_name: str, function: str, kernel: str) -> None:
        self.module_name, self.function, self.kernel = module_name, function, kernel

    def load(self) -> type[nn.Module]:
        kernel, function_type = self.kernel, type(getattr(sys.modules[self.module_name], self.function))

        class Routed(nn.Module):
            can_torch_compile = True
            has_backward = True

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                return _route(kernel, functools.partial(function_type.forward, self), *args, **kwargs)

        Routed.forward.__signature__ = inspect.signature(function_type.forward)
        Routed.__name__ = Routed.__qualname__ = f"Packfree_{kernel}"
        return Routed

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackfreeRoutes) and (self.module_name, self.function) == (other.module_name,
                                                                                            other.function)

    def __hash__(self) -> int:
        return hash((self.module_name, self.function))

    def __str__(self) -> str:
        return f"packfree's route of {self.module_name}.{self.function} ({self.kernel})"


def is_routed(module: ModuleType, function: str) -> bool:
    """Whether ``module.function`` runs packfree's route now (wrapped in a router, or kernelized by packfree)."""
    current = getattr(module, function, None)
    return hasattr(current, _ROUTED_ATTR) or (isinstance(current, nn.Module) and current in _SEAMED)


def uninstall_routes() -> None:
    """Restore every routed function in every loaded modeling module."""
    for name, functions in routed_functions().items():
        module = sys.modules.get(_PREFIX + name)
        if module is None:
            continue
        for function in functions:
            current = getattr(module, function, None)
            if current is not None and hasattr(current, _ROUTED_ATTR):
                setattr(module, function, getattr(current, _ROUTED_ATTR))
    for kernel_function, changed in _SEAMED.items():
        for name, value in changed.items():
            if value is _ABSENT:
                kernel_function.__dict__.pop(name, None)
            else:
                kernel_function.__dict__[name] = value
    _SEAMED.clear()
    _INSTALLED.clear()


@torch.compiler.disable  # patches module globals: runs when a model is prepared, so compiled code never gets here
def routed_kernels_of(layer: nn.Module) -> list[str]:
    """Kernel names the layer's modeling module routes to packfree (installing the routes)."""
    module = sys.modules.get(type(layer).__module__)
    return install_routes(module) if module is not None else []


def native_forward(layer: nn.Module, original: Callable, boundaries: Boundaries, arguments: dict[str, Any]) -> Any:
    """Run ``layer``'s own forward on the packed batch with its kernel calls routed to packfree's ops."""
    arguments = dict(arguments)
    extra = arguments.pop("kwargs", {})
    for name in (*CACHE_ARGUMENTS, "attention_mask"):
        if arguments.get(name) is not None:
            if name == "attention_mask":
                arguments[name] = None  # padding lives in the boundaries (padding segments)
            else:
                raise ValueError(f"{type(layer).__name__}: a cache was passed with a packed batch")
    extra = {k: v for k, v in extra.items() if k not in PACKFREE_KWARGS}
    if type(layer).__module__ not in _INSTALLED:  # routes were removed (unregister) since the model was prepared
        routed_kernels_of(layer)
    call = enter_native(boundaries, type(layer).__name__)
    try:
        out = original(**arguments, **extra)
    finally:
        exit_native()
    if call.routed <= 0:
        raise ValueError(
            f"{type(layer).__name__} routed none of its sequence mixing through a known kernel function; "
            "it needs the generic tier"
        )
    return out


def quarantined(adapter: MixerAdapter, boundaries: Boundaries, arguments: dict[str, Any],
                 run: Callable[[dict[str, Any]], Any]) -> Any:
    """``run(arguments)`` with a sample whose input hidden states hold NaN/inf taken out of the mixing (zeros in, NaN
    out: :class:`packfree_plugin.ops._nonfinite.Quarantine`), whichever kernel the native tier reaches (fla,
    mamba-ssm and causal-conv1d do not isolate samples; packfree's torch ops do, so routed layers that reach only
    those skip this: :func:`.routes.may_reach_kernels`). Finite inputs pass unchanged.
    Compiled graphs skip it: its per-token sample index follows the packing, which graphs take as data only inside
    packfree's opaque op (whose torch ops quarantine on their own)."""
    if torch.compiler.is_compiling():
        return run(arguments)
    hidden = arguments[adapter.hidden_arg]
    quarantine = Quarantine(boundaries.seq_idx.to(hidden.device), [(hidden, 1)])
    (arguments[adapter.hidden_arg],) = quarantine.clean()
    out = run(arguments)
    if adapter.output_index is None:
        return quarantine.mark(out)
    indices = {adapter.output_index} if isinstance(adapter.output_index, int) else set(adapter.output_index)
    marked = [quarantine.mark(value) if i in indices and isinstance(value, torch.Tensor) else value
              for i, value in enumerate(out)]
    return marked if isinstance(out, list) else tuple(marked)
