"""The sweep's runs: prove every target of the installed transformers and classify it.

For every target (each ``MODEL_FOR_CAUSAL_LM`` and ``MODEL_FOR_MASKED_LM`` type, head and base model; the base model
of every catalogue type; the token- and sequence-classification heads of :data:`HEAD_FAMILIES`) the sweep builds a
tiny random model (:func:`packfree_plugin.gate.shrink.tiny_config_for`), runs the isolation proof with the gate
bypassed (what packfree itself does) and classifies the target:

- ``exact``; ``wrong`` (silently wrong: it ran and gave other results);
- ``refused`` (a ``ValueError`` / ``NotImplementedError`` at load or on the packed row);
- ``internal`` (any other exception from packfree: a bug that should become exact or a refusal);
- ``unbuildable`` (the tiny config or the stock model fails; or, for a model packfree does not refuse at load,
  stock's text-only forward; or the time limit).

For every target that is not exact it also records whether the gate refuses it at load. Targets run in
worker processes (``--jobs``) with a per-target time limit, so one hang cannot stall the sweep.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["HEAD_FAMILIES", "Result", "Target", "run_target", "run_worker", "sweep", "targets", "tiny_target"]

ROOT = Path(__file__).resolve().parents[2]
"""The source checkout the sweep runs from (its workers import ``tooling`` from here)."""
HEAD_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "phi3", "gpt2", "gpt_neox",
                 "olmo2", "mixtral", "bert", "roberta", "xlm-roberta", "distilbert", "deberta-v2", "electra",
                 "modernbert", "albert", "mpnet", "camembert")
"""Common decoder and encoder families whose token- and sequence-classification heads are swept."""
TIME_LIMIT_S = 120.0


@dataclass(frozen=True)
class Target:
    group: str  # "causal" | "masked" | "backbone" (a covered hybrid's base model) | "token" | "sequence"
    model_type: str
    cls: str


@dataclass
class Result:
    group: str
    model_type: str
    cls: str
    status: str  # exact | wrong | refused | internal | unbuildable
    detail: str = ""
    gate_refuses: bool | None = None  # for non-exact targets: whether admit() refuses the model at load
    config_type: str = ""  # model_type of the config the class was built from (a composite type's text config)
    switches: dict | None = None  # for exact targets: the config switches proved (admission.switches)
    default_config: str = ""  # the gate on the config class's defaults: see user_config_checks
    tester_config: str = ""  # the gate on a ModelTester-style config (2 heads, 2 kv heads, hidden 32)


def _names(value: str | Sequence[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def targets() -> list[Target]:
    """Every target of the installed transformers, in a stable order."""
    from transformers.models.auto import modeling_auto as auto

    from packfree_plugin.gate.catalogue import sized_types

    found: dict[Target, None] = {}
    for group, mapping in (("causal", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                           ("masked", auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)):
        for model_type in sorted(mapping):
            for name in _names(mapping[model_type]) + _names(auto.MODEL_MAPPING_NAMES.get(model_type, [])):
                found.setdefault(Target(group, model_type, name))
    for model_type in sorted(sized_types()):  # covered hybrid types with a backbone only (no causal-LM head)
        for name in _names(auto.MODEL_MAPPING_NAMES.get(model_type, [])):
            found.setdefault(Target("backbone", model_type, name))
    for group, mapping in (("token", auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES),
                           ("sequence", auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)):
        for model_type in HEAD_FAMILIES:
            for name in _names(mapping.get(model_type, [])):
                found.setdefault(Target(group, model_type, name))
    seen: set[tuple[str, str]] = set()
    ordered = []
    for target in found:  # a base model shared by both mappings is swept once, under the first group
        if (target.model_type, target.cls) not in seen:
            seen.add((target.model_type, target.cls))
            ordered.append(target)
    return ordered


def _is_refusal(error: BaseException) -> bool:
    return isinstance(error, (ValueError, NotImplementedError))


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]


def run_target(target: Target, *, user_configs: bool = True) -> Result:
    """Build ``target`` tiny, prove it (gate bypassed), classify it; for a non-exact one, ask the gate; then (with
    ``user_configs``) the gate on a user's configs (:func:`user_config_checks`)."""
    result = _prove_target(target)
    if user_configs:
        user_config_checks(target, result)
    return result


def _as_encoder(target: Target, config) -> None:
    """A masked LM is a bidirectional encoder: its config is no decoder's, whatever the type's published LM head
    needs (Reformer's ``is_decoder=True``, which its masked LM asserts against)."""
    if target.group == "masked" and getattr(config, "is_decoder", False):
        config.is_decoder = False


def tiny_target(target: Target) -> tuple[type, Any]:
    """``(class, tiny config)`` the sweep builds ``target`` from."""
    import transformers

    from packfree_plugin.gate.shrink import tiny_config_for

    cls = getattr(transformers, target.cls)
    config = tiny_config_for(target.model_type)
    if not isinstance(config, cls.config_class) and hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)  # a composite type's text model (the decoder: MusicGen)
    _as_encoder(target, config)
    return cls, config


def _prove_target(target: Target) -> Result:
    from packfree_plugin.gate.admission import bypassed, prove_tiny_copy, switches
    from packfree_plugin.gate.proof import alone_outputs, build_pair, build_stock, prove, sample_tokens

    result = Result(target.group, target.model_type, target.cls, "unbuildable")
    try:
        cls, config = tiny_target(target)
        result.config_type = config.model_type
    except Exception as error:  # noqa: BLE001
        result.detail = f"tiny config: {_error(error)}"
        return result
    with bypassed():
        try:  # stock first: if it cannot build the model, nothing can be proved
            build_stock(cls, config)
        except Exception as error:  # noqa: BLE001
            result.detail = f"stock: {_error(error)}"
            return result
        try:  # a refusal at load is the verdict, whatever stock does with a row of tokens
            model, stock, implementation = build_pair(cls, config)
        except Exception as error:  # noqa: BLE001
            result.status = "refused" if _is_refusal(error) else "internal"
            result.detail = f"at load: {_error(error)}"
            result.gate_refuses = True  # the load itself fails
            return result
        try:  # stock alone: if it cannot run the proof's rows, nothing can be proved
            alone_outputs(stock, sample_tokens((5,), int(getattr(config, "vocab_size", None) or 128)))
        except Exception as error:  # noqa: BLE001
            result.detail = f"stock: {_error(error)}"
            return result
        try:
            proof = prove(model, stock, stock_name=implementation)
        except Exception as error:  # noqa: BLE001 - stock raised on the sample set: not provable
            result.detail = f"stock: {_error(error)}"
            return result
    if proof.exact:
        result.status = "exact"
        result.switches = switches(config)
    elif proof.error is not None:
        result.status = "refused" if proof.error.startswith(("ValueError", "NotImplementedError")) else "internal"
        result.detail = f"at call ({proof.mode}): {proof.error}"[:300]
    else:
        result.status = "wrong"
        result.detail = proof.verdict()[:300]
    if not proof.exact:
        try:
            result.gate_refuses = not prove_tiny_copy(model).exact
        except Exception:  # noqa: BLE001 - the gate refuses what it cannot prove
            result.gate_refuses = True
    return result


TESTER = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=37, vocab_size=99)
"""The widths of transformers' own ModelTester configs (its test suites' tiny models)."""


def tester_config(config):
    """``config`` (a type's defaults) as transformers' test suites size it: :data:`TESTER` on its text config (under
    whatever names it uses: ``n_embd``, ``encoder_attention_heads``, ...), as few layers as keep each layer kind
    twice, special ids inside the vocabulary, a default language (X-MOD's tester sets one); the widths it leaves to
    their defaults derived from these."""
    import dataclasses

    from packfree_plugin.gate.config_keys import FFN_NAME, HEAD_KEYS, HIDDEN_KEYS, KV_HEAD_KEYS, is_width
    from packfree_plugin.gate.config_values import rebuilt, remap_special_ids
    from packfree_plugin.gate.layer_kinds import cut_depth

    values = config.to_dict()
    text_config = config.get_text_config(decoder=True)
    text_name = next((name for name, value in vars(config).items() if value is text_config), None)
    text = values[text_name] if text_name in values and isinstance(values[text_name], dict) else values
    set_here = {}
    for name, value in text.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if name in HIDDEN_KEYS:
            set_here[name] = TESTER["hidden_size"]
        elif name in HEAD_KEYS:
            set_here[name] = TESTER["num_attention_heads"]
        elif name in KV_HEAD_KEYS and value > 1:
            set_here[name] = TESTER["num_key_value_heads"]
        elif FFN_NAME.search(name) and value > TESTER["intermediate_size"]:
            set_here[name] = TESTER["intermediate_size"]
        elif name == "vocab_size" and value > TESTER["vocab_size"]:
            set_here[name] = TESTER["vocab_size"]
        elif name == "head_dim":
            set_here[name] = 16
    text.update(set_here)
    if dataclasses.is_dataclass(text_config):  # settings left to their derived default derive from the new widths
        text.update({field.name: None for field in dataclasses.fields(text_config)
                     if field.default is None and text.get(field.name) is not None and field.name not in set_here
                     and is_width(field.name)})
    cut_depth(text, repeats=2)
    remap_special_ids(text, int(text.get("vocab_size") or TESTER["vocab_size"]))
    for name in ("_name_or_path", "transformers_version", "architectures", "dtype"):
        values.pop(name, None)
    return rebuilt(config, values)


def _gate_on(cls: type, make_config, *, stock_runs_it: bool = False) -> str:
    """What the gate does at load for a class it has not verified, on the config ``make_config()`` returns:
    ``exact`` (admitted), ``refused: ...`` (the copy is not exact, or packfree refuses its layers at load: the
    model's own reason), ``no copy: ...`` (no copy of the config runs on stock, although stock builds and runs the
    config itself: packfree's problem), ``config: ...`` (stock cannot make the config, or raises on the config
    itself what it raised on its tiny copy, :class:`.admission.NoCopyError`; or with ``stock_runs_it``, a small
    one, cannot build and run it as it is)."""
    from packfree_plugin.gate.admission import NoCopyError, _check_size, bypassed, prove_copy
    from packfree_plugin.gate.proof import alone_outputs, build_stock, sample_tokens

    try:
        config = make_config()
        if stock_runs_it:
            _check_size(cls, config)  # a config the tester widths do not reach stays large: not built for real
            with bypassed():
                stock, _ = build_stock(cls, config)
    except Exception as error:  # noqa: BLE001
        return f"config: {_error(error)}"[:300]
    stock_fails = None
    if stock_runs_it:
        try:
            with bypassed():
                alone_outputs(stock, sample_tokens((5,), int(getattr(config, "vocab_size", None) or 99)))
        except Exception as error:  # noqa: BLE001 - unless packfree refuses its layers at load, stock's reason
            stock_fails = f"config: {_error(error)}"[:300]
    try:
        proof = prove_copy(cls, config)
    except NoCopyError as error:
        if stock_fails is not None:
            return stock_fails
        if error.stock_error is not None:  # measured: stock raises it on the config itself too
            return f"config: stock raises it on the config itself, as on its tiny copy: {error.stock_error}"[:300]
        return f"no copy: {error}"[:300]
    except Exception as error:  # noqa: BLE001 - refused at load
        return f"refused: {_error(error)}"[:300]
    if stock_fails is not None:
        return stock_fails
    return "exact" if proof.exact else f"refused: {proof.verdict()}"[:300]


def user_config_checks(target: Target, result: Result) -> None:
    """Set ``result.default_config`` / ``tester_config``: the gate (:func:`_gate_on`) on the config class's
    defaults (with the catalogue's ``published`` values) and on :func:`tester_config` of them, both as the
    target's class gets them (a composite type's text config for a text model)."""
    import transformers
    from transformers import AutoConfig

    from packfree_plugin.gate.catalogue import published_values
    from packfree_plugin.gate.shrink import shrink_config, tiny_config_for

    cls = getattr(transformers, target.cls)

    def defaults():
        config = AutoConfig.for_model(target.model_type, **published_values(target.model_type))
        if not isinstance(config, cls.config_class) and hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        _as_encoder(target, config)
        return config

    try:  # the gate's first copy of the defaults is the tiny config the target was proved on: the same proof
        same = result.status == "exact" and (tiny_config_for(target.model_type).to_json_string()
                                             == shrink_config(AutoConfig.for_model(
                                                 target.model_type, **published_values(target.model_type)))
                                             .to_json_string())
    except Exception:  # noqa: BLE001
        same = False
    result.default_config = "exact" if same else _gate_on(cls, defaults)
    result.tester_config = _gate_on(cls, lambda: tester_config(defaults()), stock_runs_it=True)


# ------------------------------------------------------------------------------------------ workers
def run_worker() -> None:
    """Read one target per stdin line (JSON), write one result per stdout line (JSON)."""
    import logging
    import warnings

    import torch

    import packfree_plugin

    packfree_plugin.register()  # the proofs build packfree twins, whatever PACKFREE_AUTOLOAD says
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    out = sys.stdout
    sys.stdout = sys.stderr  # models that print must not corrupt the protocol
    for line in sys.stdin:
        target = Target(**json.loads(line))
        out.write(json.dumps(asdict(run_target(target))) + "\n")
        out.flush()


class _Worker:
    def __init__(self) -> None:
        path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
        self.process = subprocess.Popen([sys.executable, "-m", "tooling.sweep", "--worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error",
                                                        "PYTHONPATH": path})
        self.target: Target | None = None
        self.started = 0.0

    def send(self, target: Target) -> None:
        self.target, self.started = target, time.monotonic()
        self.process.stdin.write(json.dumps(asdict(target)) + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def sweep(chosen: Iterable[Target], *, jobs: int = 1, time_limit: float = TIME_LIMIT_S,
          progress: bool = True) -> list[Result]:
    """Run ``chosen`` targets in ``jobs`` worker processes; a target past ``time_limit`` s is unbuildable."""
    import selectors

    pending = list(chosen)
    total = len(pending)
    results: list[Result] = []
    workers = [_Worker() for _ in range(max(1, min(jobs, total)))]
    selector = selectors.DefaultSelector()
    for worker in workers:
        selector.register(worker.process.stdout, selectors.EVENT_READ, worker)
    idle = list(workers)
    try:
        while pending or len(idle) < len(workers):
            while idle and pending:
                idle.pop().send(pending.pop(0))
            for key, _ in selector.select(timeout=1.0):
                worker: _Worker = key.data
                line = worker.process.stdout.readline()
                if line:
                    results.append(Result(**json.loads(line)))
                else:  # the worker died (a crash in native code): record and replace it
                    results.append(Result(worker.target.group, worker.target.model_type, worker.target.cls,
                                          "unbuildable", f"the process died (exit {worker.process.wait()})"))
                    selector.unregister(worker.process.stdout)
                    worker = _replace(workers, worker, selector)
                idle.append(worker)
                if progress:
                    last = results[-1]
                    print(f"[{len(results)}/{total}] {last.status:11} {last.cls} ({last.model_type}) "
                          f"{last.detail[:100]}", file=sys.stderr, flush=True)
            for worker in [w for w in workers if w not in idle and time.monotonic() - w.started > time_limit]:
                results.append(Result(worker.target.group, worker.target.model_type, worker.target.cls,
                                      "unbuildable", f"over the {time_limit:.0f} s time limit"))
                selector.unregister(worker.process.stdout)
                idle.append(_replace(workers, worker, selector))
    finally:
        for worker in workers:
            worker.stop()
    return results


def _replace(workers: list[_Worker], worker: _Worker, selector) -> _Worker:
    import selectors

    worker.stop()
    fresh = _Worker()
    workers[workers.index(worker)] = fresh
    selector.register(fresh.process.stdout, selectors.EVENT_READ, fresh)
    return fresh
