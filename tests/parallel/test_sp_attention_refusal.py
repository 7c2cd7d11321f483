"""A packfree model with Ulysses' core attention named as anything but packfree's is refused, naming the fix, on every
route a user takes: Ulysses would run that attention over the gathered row, where the samples of a packed row attend
to each other (and the advice of DeepSpeed's own mismatch error, reloading the model with it, is the silent path).

Every name a user can give (:data:`USER_NAMES`: transformers' attention registry, ``eager``, hub flash kernels):
- DeepSpeed's ``UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation=name, ...)`` called
  directly, in this process: packfree refuses before DeepSpeed sets anything up (no process group is needed, no
  attention function is wrapped, no hub kernel is fetched);
- accelerate's ``DeepSpeedSequenceParallelConfig(sp_attn_implementation=name)``: the names accelerate refuses itself
  (:data:`ACCELERATE_REFUSES`) never reach DeepSpeed; every other name goes through a Trainer step on 2 gloo ranks
  (tests/parallel/test_trainer_ulysses.py's set-up), refused in ``prepare``.

Planted: the check removed from ``integrations/deepspeed._register`` (the packfree route taken whatever the name):
every case fails, the Trainer trains and the direct call reaches DeepSpeed's set-up.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from tests.parallel.cases import SHARED, Case, _model, shared_results
from tests.parallel.test_trainer_ulysses import Run, _run_step

HUB_KERNELS = ("kernels-community/flash-attn2", "kernels-community/flash-attn3", "kernels-community/vllm-flash-attn3")
"""Hub-hosted flash attention kernels, which accelerate and DeepSpeed accept by name."""
ODD = (5, 9, 3)


def _user_names() -> list[str]:
    """Every attention implementation a user can name that is not packfree's."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return sorted((set(ALL_ATTENTION_FUNCTIONS.valid_keys()) | {"eager", *HUB_KERNELS}) - {"packfree"})


def _accelerate_refuses(name: str) -> bool:
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    try:
        DeepSpeedSequenceParallelConfig(sp_attn_implementation=name)
    except ValueError:
        return True
    return False


USER_NAMES = _user_names()
ACCELERATE_REFUSES = [name for name in USER_NAMES if _accelerate_refuses(name)]
TRAINER_RUNS = [Run("llama", ODD, sp_attn=name) for name in USER_NAMES if name not in ACCELERATE_REFUSES] + [
    Run("qwen3_next", ODD, sp_attn="flash_attention_2")]  # a hybrid: the refusal comes before its mixers are split


def packfree_refusal(name: str) -> str:
    """What packfree's refusal of ``name`` says: the name, why, and the fix."""
    return (rf"sp_attn_implementation={re.escape(repr(name))} \(DeepSpeed's core_attn_implementation\) for a model "
            r"loaded with attn_implementation='packfree'.*samples of a packed row attend to each other.*"
            r"Leave sp_attn_implementation unset")


@pytest.fixture
def ulysses() -> Iterator[type]:
    """DeepSpeed's ``UlyssesSPAttentionHF`` with packfree registered (and its adapter installed); packfree's
    registration restored after."""
    import packfree_plugin
    from packfree_plugin.integrations import deepspeed

    registered = packfree_plugin.is_registered()
    packfree_plugin.register()
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    assert deepspeed.installed()
    yield UlyssesSPAttentionHF
    if not registered:
        packfree_plugin.unregister()


@pytest.mark.parametrize("name", USER_NAMES)
def test_deepspeed_registration_refuses_every_other_core_attention(name: str, ulysses: type) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = _model(Case("llama", ODD, dtype=torch.float32))
    functions = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    with pytest.raises(ValueError, match=packfree_refusal(name)) as refused:
        ulysses.register_with_transformers(model_name_or_path=model, core_attn_implementation=name,
                                           sequence_parallel_size=2, micro_batch_size=1, seq_length_is_variable=True)
    assert "does not match" not in str(refused.value)  # packfree's refusal, not DeepSpeed's mismatch advice
    assert dict(ALL_ATTENTION_FUNCTIONS._local_mapping) == functions  # refused before DeepSpeed wrapped anything


@pytest.mark.parametrize("name", ACCELERATE_REFUSES)
def test_accelerate_refuses_the_rest_itself(name: str) -> None:
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    with pytest.raises(ValueError, match=rf"Invalid sp_attn_implementation: {re.escape(name)}"):
        DeepSpeedSequenceParallelConfig(sp_attn_implementation=name)


def _trainer_step(run: Run, rank: int, snapshot: dict) -> object:
    """One Trainer step of ``run`` on this rank (test_trainer_ulysses.py's), undone after."""
    return _run_step(run, snapshot)


SHARED.update({run.name: (_trainer_step, run) for run in TRAINER_RUNS})  # one spawn with other modules' runs


@pytest.fixture(scope="module")
def trainer_results() -> dict[str, object]:
    return shared_results([run.name for run in TRAINER_RUNS])


@pytest.mark.parametrize("run", TRAINER_RUNS, ids=lambda run: run.name)
def test_trainer_refuses_every_other_sp_attn_implementation(run: Run, trainer_results) -> None:
    result = trainer_results[run.name]
    assert isinstance(result, ValueError), f"{run.name} trained (loss {result['loss']:.6f}) instead of being refused"
    assert "does not match" not in str(result)
    with pytest.raises(ValueError, match=packfree_refusal(run.sp_attn)):
        raise result
