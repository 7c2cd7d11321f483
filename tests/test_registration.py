"""Registration: idempotent, reversible, applied at load; and the entry-point autoload from a real wheel."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

import packfree_plugin
from packfree_plugin.loading.register import ATTN_IMPLEMENTATION
from packfree_plugin.forward.hook import has_entry
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def test_register_is_idempotent_and_unregister_restores() -> None:
    from transformers.models.lfm2 import modeling_lfm2

    from packfree_plugin.mixers.seam import install_routes, is_routed, uninstall_routes

    packfree_plugin.register()
    uninstall_routes()  # an earlier test's model may have routed the module: start from stock's functions
    stock_state = dict(vars(modeling_lfm2.causal_conv1d_fn)) if isinstance(modeling_lfm2.causal_conv1d_fn,
                                                                           torch.nn.Module) else None
    install_routes(modeling_lfm2)
    assert is_routed(modeling_lfm2, "causal_conv1d_fn")
    wrapped_post_init = PreTrainedModel.post_init
    packfree_plugin.register()
    assert PreTrainedModel.post_init is wrapped_post_init
    assert packfree_plugin.is_registered()
    assert ATTN_IMPLEMENTATION in AttentionMaskInterface._global_mapping
    try:
        packfree_plugin.unregister()
        assert ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping
        assert ATTN_IMPLEMENTATION not in AttentionMaskInterface._global_mapping
        assert PreTrainedModel.post_init is not wrapped_post_init
        from transformers.models.lfm2 import modeling_lfm2

        assert not is_routed(modeling_lfm2, "causal_conv1d_fn"), "routes not restored"
        if stock_state is not None:  # transformers' kernel seam: the kernel-function module is as it was
            assert vars(modeling_lfm2.causal_conv1d_fn) == stock_state
        with pytest.raises(ValueError, match="packfree"):
            AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree")
    finally:
        packfree_plugin.register()


def test_models_loaded_with_packfree_are_hooked_and_others_are_not() -> None:
    packfree_plugin.register()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree")
    stock = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    assert all(has_entry(m) for m in (model, model.model))
    assert not has_entry(stock) and not has_entry(stock.model)


def test_apply_switches_and_hooks_a_model_loaded_otherwise() -> None:
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa")
    assert packfree_plugin.apply(model) is model
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert has_entry(model.model)
    entry = model.forward
    packfree_plugin.apply(model)  # idempotent
    assert model.forward is entry and entry.args == (model,)


def test_boundaries_are_built_once_per_forward(monkeypatch) -> None:
    from packfree_plugin.boundaries import Boundaries

    calls = []
    original = Boundaries.from_model_inputs.__func__

    def counting(cls, **kwargs):
        calls.append(1)
        return original(cls, **kwargs)

    monkeypatch.setattr(Boundaries, "from_model_inputs", classmethod(counting))
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="packfree")
    model(input_ids=torch.randint(3, 100, (1, 9)), position_ids=torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]]))
    assert len(calls) == 1, f"boundaries were built {len(calls)} times for one forward of a 2-layer model"


# ------------------------------------------------------------------------------ wheel + fresh venv
FRESH_CHECK = textwrap.dedent(
    """
    import json, sys
    report = {"torch_at_start": "torch" in sys.modules, "transformers_at_start": "transformers" in sys.modules,
              "hook_at_start": "packfree_plugin.loading.autoload" in sys.modules}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    try:
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="packfree")
        config_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]),
                                                        attn_implementation="packfree")
    except ValueError as error:
        report["error"] = str(error)[:200]
    else:
        ids = torch.randint(3, 100, (1, 7))
        packed = model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]])).logits
        alone = model(input_ids=ids[:, 4:]).logits
        report["max_diff"] = (packed[:, 4:] - alone).abs().max().item()
        report["hooked"] = type(config_model.__dict__.get("forward")).__name__ == "ModelForward"
        report["packfree_file"] = __import__("packfree_plugin").__file__
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    """A new venv with the built wheel installed; torch/transformers come from this environment's site-packages."""
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(work), str(ROOT)],
        check=True,
    )
    wheel = next(work.glob("packfree-*.whl"))
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], check=True
    )
    fresh_site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    deps = [sysconfig.get_paths()["purelib"], *site.getsitepackages()]
    (fresh_site / "zz_parent_environment.pth").write_text("\n".join(dict.fromkeys(deps)) + "\n")
    return python


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa").save_pretrained(path)
    return path


def _run_fresh(python: Path, model_dir: Path, **env: str) -> dict:
    import json

    environment = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    result = subprocess.run(
        [str(python), "-c", FRESH_CHECK, str(model_dir)], capture_output=True, text=True, env=environment,
        cwd=model_dir, check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_wheel_autoregisters_in_a_fresh_interpreter(fresh_venv: Path, saved_model: Path) -> None:
    report = _run_fresh(fresh_venv, saved_model)
    assert report["hook_at_start"] and not report["torch_at_start"] and not report["transformers_at_start"]
    assert "error" not in report, report
    assert str(fresh_venv.parents[1]) in report["packfree_file"], "the wheel's copy must be the one imported"
    assert report["hooked"]
    assert report["max_diff"] < 1e-5


def test_environment_variable_turns_autoload_off(fresh_venv: Path, saved_model: Path) -> None:
    report = _run_fresh(fresh_venv, saved_model, PACKFREE_AUTOLOAD="0")
    assert "packfree" in report.get("error", ""), report
