"""Startup hook (run from ``packfree_autoload.pth`` at interpreter start): register packfree lazily.

Imports neither torch nor transformers. It installs a tiny import hook; the moment
``transformers.modeling_utils`` finishes importing (the module that defines ``AttentionInterface``),
every entry point in the ``transformers.plugins`` group is loaded and called (packfree's is
:func:`packfree_plugin.loading.register.register`). An entry point whose module is itself mid-import at that
moment (someone imported it first, and it imported transformers) is retried at the next import, so
registration never runs on a half-initialized module. ``PACKFREE_AUTOLOAD=0`` turns the hook off.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import warnings
from types import ModuleType

ENV_VAR = "PACKFREE_AUTOLOAD"
ENTRY_POINT_GROUP = "transformers.plugins"
TRIGGER_MODULE = "transformers.modeling_utils"


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in {"0", "false", "no", "off"}


def _initializing(module_name: str) -> bool:
    """True while ``module_name`` or one of its parent packages is executing its import."""
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:depth]))
        if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False):
            return True
    return False


class _Autoloader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder: wraps the loader of :data:`TRIGGER_MODULE`, then calls the plugins' entry points."""

    def __init__(self) -> None:
        self._wrapped: importlib.abc.Loader | None = None
        self._pending: list | None = None  # None: trigger not imported yet
        self._draining = False

    # finder --------------------------------------------------------------------------------------
    def find_spec(self, fullname, path, target=None):
        if self._pending:
            self.drain()
        if fullname != TRIGGER_MODULE or self._pending is not None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        self._wrapped = spec.loader
        spec.loader = self
        return spec

    # loader --------------------------------------------------------------------------------------
    def create_module(self, spec) -> ModuleType | None:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        self.start()

    # entry points --------------------------------------------------------------------------------
    def start(self) -> None:
        from importlib.metadata import entry_points

        self._pending = list(entry_points(group=ENTRY_POINT_GROUP))
        self.drain()

    def drain(self) -> None:
        """Call every pending entry point whose module is not mid-import; uninstall once none is left."""
        if self._draining:
            return
        self._draining = True
        try:
            waiting = []
            for entry_point in self._pending:
                if _initializing(entry_point.module):
                    waiting.append(entry_point)
                    continue
                try:
                    entry_point.load()()
                except Exception as error:  # noqa: BLE001 - a broken plugin must not break `import transformers`
                    warnings.warn(f"transformers plugin {entry_point.name!r} failed to register: {error!r}", stacklevel=2)
            self._pending = waiting
        finally:
            self._draining = False
        if not self._pending and self in sys.meta_path:
            sys.meta_path.remove(self)


_AUTOLOADER = _Autoloader()


def install() -> None:
    """Install the import hook (or run the entry points now if transformers is already imported)."""
    if not enabled() or _AUTOLOADER in sys.meta_path:
        return
    sys.meta_path.insert(0, _AUTOLOADER)
    if TRIGGER_MODULE in sys.modules:
        _AUTOLOADER.start()


install()
