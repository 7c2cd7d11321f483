"""The op tests' fixture ``route_to``: it installs fake CUDA packages in ``sys.modules`` and makes the shared
dispatcher believe every tensor is on CUDA. Their helpers are in :mod:`tests.ops.harness`.

Hypothesis profiles ("ci" default, "thorough" via HYPOTHESIS_PROFILE) are registered by
tests/conftest.py; nothing is registered here.
"""

from __future__ import annotations

import sys
import types

import pytest

from packfree_plugin.ops import backends


@pytest.fixture
def route_to(monkeypatch):
    """``route_to({"pkg.mod": {"fn": callable}})``: fake packages importable, every tensor 'on CUDA'.

    Parent packages are created as empty modules; the dispatcher's import cache is cleared before
    and after so neither real nor fake packages leak between tests.
    """

    def install(modules: dict[str, dict[str, object]]) -> None:
        for dotted, attrs in modules.items():
            parts = dotted.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in sys.modules or i == len(parts):
                    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
            for attr, value in attrs.items():
                setattr(sys.modules[dotted], attr, value)
        monkeypatch.setattr(backends, "on_cuda", lambda t: True)
        backends.load_kernel.cache_clear()

    yield install
    backends.load_kernel.cache_clear()
