"""packfree's explicit tables against the installed transformers: every layer class it adapts and every kernel
function it routes must exist, so a transformers release that renames one fails here, not at a user's load."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import transformers

from packfree_plugin.mixers import entry as mixers

from packfree_plugin.mixers import registry  # noqa: F401 - mixers fills the adapters
from packfree_plugin.mixers.seam import routed_functions
from packfree_plugin.classes import CLASSES
from packfree_plugin.ops.family import families

MODELS = Path(transformers.__file__).parent / "models"

NEWER_THAN_OLDEST_RELEASE = {
    # model folder -> the layer classes packfree adapts in it; these model types are newer than the oldest
    # supported transformers (packfree_plugin.compat.OLDEST_TRANSFORMERS), which has none of them
    "lara_mini": {"LaraMiniGatedDeltaNet"},
    "lfm3": {"Lfm3ShortConv"},
    "inkling2": {"Inkling2FullAttention", "Inkling2SlidingAttention", "Inkling2ShortConvolution"},
    "inkling2_loop": {"Inkling2LoopFullAttention", "Inkling2LoopSlidingAttention", "Inkling2LoopShortConvolution"},
    "dots3_note": {"Dots3NoteTextAttention"},
}
ABSENT_HERE = {folder for folder in NEWER_THAN_OLDEST_RELEASE if not (MODELS / folder).is_dir()}
"""Model folders this (older) release lacks: their classes and routed functions are not expected here."""
ADAPTED = {name for name, class_entry in CLASSES.items() if class_entry.mixer is not None or class_entry.refused_at_load}
"""The layer classes packfree runs by a family of its own or refuses at load."""


def _defining_modules() -> dict[str, str]:
    """Layer class name -> the modeling module that defines it, for every class of :data:`ADAPTED` (a name qualified
    by its model folder, ``"openai.Attention"``, only in that folder's modeling module)."""
    wanted = {name for name in ADAPTED if "." not in name}
    found: dict[str, str] = {}
    for qualified in ADAPTED - wanted:
        folder, name = qualified.split(".")
        for path in (MODELS / folder).glob("modeling_*.py"):
            if re.search(rf"^class {name}\(", path.read_text(encoding="utf-8"), re.MULTILINE):
                found[qualified] = f"transformers.models.{folder}.{path.stem}"
    pattern = re.compile(r"^\s*class (\w+)\(", re.MULTILINE)  # some are defined inside an `if`
    for path in MODELS.glob("*/modeling_*.py"):
        for name in set(pattern.findall(path.read_text(encoding="utf-8"))) & wanted:
            found.setdefault(name, f"transformers.models.{path.parent.name}.{path.stem}")
    return found


def test_every_adapted_layer_class_exists() -> None:
    defined = _defining_modules()
    absent = {name for folder in ABSENT_HERE for name in NEWER_THAN_OLDEST_RELEASE[folder]}
    missing = sorted(ADAPTED - set(defined) - absent)
    assert not missing, f"layer classes packfree adapts but transformers {transformers.__version__} lacks: {missing}"
    for name, module in defined.items():
        cls = getattr(importlib.import_module(module), name.split(".")[-1], None)
        assert isinstance(cls, type), f"{module}.{name}"


@pytest.mark.parametrize("module_name", sorted(m for m in routed_functions() if m.split(".")[0] not in ABSENT_HERE))
def test_every_routed_function_exists(module_name: str) -> None:
    module = importlib.import_module(f"transformers.models.{module_name}")
    for function, route in routed_functions()[module_name].items():
        if not route.optional:  # fused and decoding kernels may go (5.25 dropped Mamba1's fused one)
            assert callable(getattr(module, function, None)), f"{module_name}.{function} is gone"


def test_every_class_of_a_native_family_routes_its_own_modeling_module() -> None:
    """A class of a routing family whose entry names another modeling module (or none) would route nothing where it
    lives and be refused at every packed call; and one of another family with a modeling module would route nothing
    at all: catch both here."""
    defined = _defining_modules()
    for name in defined:
        class_entry = CLASSES[name]
        family = families().get(class_entry.mixer)
        if family is not None and family.routes:
            assert class_entry.modeling == defined[name].removeprefix("transformers.models."), name
        else:
            assert class_entry.modeling is None, name


def test_every_family_an_entry_names_exists() -> None:
    named = {class_entry.mixer for class_entry in CLASSES.values() if class_entry.mixer is not None}
    assert named <= registry.ADAPTERS.keys(), sorted(named - registry.ADAPTERS.keys())
    assert set(registry.ADAPTERS) <= named, sorted(set(registry.ADAPTERS) - named)


def test_a_missing_routed_function_is_refused(monkeypatch) -> None:
    from transformers.models.lfm2 import modeling_lfm2

    from packfree_plugin.mixers.seam import install_routes

    monkeypatch.delattr(modeling_lfm2, "causal_conv1d_fn")
    with pytest.raises(ValueError, match=rf"causal_conv1d_fn, .* is missing on transformers {transformers.__version__}"
                                         r".*install a tested release \(pip install 'transformers>=5\.20\.0,<5\.26'"):
        install_routes(modeling_lfm2)


def test_a_model_whose_routed_function_vanished_is_refused_at_load_by_name(monkeypatch) -> None:
    """The refusal names the model, the modeling module's function, the release and what to do."""
    from transformers.models.lfm2 import modeling_lfm2

    from packfree_plugin.mixers import seam
    from packfree_plugin.cli.tiny import load_model

    seam.uninstall_routes()
    monkeypatch.delattr(modeling_lfm2, "causal_conv1d_fn")
    with pytest.raises(ValueError, match=r"Lfm2(ForCausalLM|Model) \((model\.)?layers\.\d\.conv\): .*causal_conv1d_fn.* is missing"
                                         r".*wait for a packfree release"):
        load_model("lfm2", "packfree")


def test_a_missing_fused_or_decoding_kernel_is_not_refused(monkeypatch) -> None:
    """transformers 5.25 dropped FalconMamba's and Jamba's fused ``mamba_inner_fn``: a packed call never needs a fused
    or decoding kernel (the layer's split path is routed step by step), so its absence refuses nothing."""
    from transformers.models.lfm2 import modeling_lfm2

    from packfree_plugin.mixers.seam import install_routes

    monkeypatch.delattr(modeling_lfm2, "causal_conv1d_update")
    assert install_routes(modeling_lfm2) == ["causal_conv1d_fn"]
