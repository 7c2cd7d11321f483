"""The instance-forward installer, under the name ``adapters/mixers.py`` and ``adapters/families.py`` still import
it by: it lives in :mod:`packfree_plugin.forward.instance`, which the model entry uses too."""

from __future__ import annotations

from ..forward.instance import install, own_forward, own_parameters, uninstall

__all__ = ["install", "own_forward", "own_parameters", "uninstall"]
