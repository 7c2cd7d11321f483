"""One cache for the constant tensors the ops build once and every layer reuses (triangles, row scales, chunk
layouts): kept apart per inference mode, since an inference tensor that a later training step reused could not be
saved for backward ("Inference tensors cannot be saved for backward")."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

__all__ = ["kept_per_mode"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def kept_per_mode(maxsize: int) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """``functools.lru_cache(maxsize)`` of a function of hashable arguments, keyed also by whether inference mode is
    on when it is called."""

    def decorate(build: Callable[_P, _R]) -> Callable[_P, _R]:
        @functools.lru_cache(maxsize=maxsize)
        def kept(inference: bool, *args: _P.args) -> _R:
            return build(*args)

        @functools.wraps(build)
        def call(*args: _P.args) -> _R:
            return kept(torch.is_inference_mode_enabled(), *args)

        return call

    return decorate
