"""GPU check (``nox -s gpu``, or offline ``gpu-bundle/run.sh``): packfree on a CUDA machine against stock transformers
on the same GPU, in one command.

What it compares (every row says ``ok``, ``MISMATCH``, ``skipped (...)`` or ``error: ...``; a failing check never
stops the others; every measured row gives a ratio, ``x_...``, against a baseline timed in the same run):

1. **install** (``--install``): ``flash-linear-attention`` (fla, Triton) from the registry; ``flash-attn``,
   ``mamba-ssm`` and ``causal-conv1d`` as prebuilt wheels only, each under a time limit, skipped if they do not
   install in time. Or **bundle** (``--bundle``, from ``run.sh``): each carried wheel intact and imported from where
   ``run.sh`` installed it, and what could not travel (gpu/gpu_bundle.py) skipped with its reason.
2. **attention**: a packed bf16 row (16 samples of skewed lengths, GQA) at head_dim 128, 256 and 512, without a
   window and with both sliding-window conventions (causal ``i - W < j <= i``; bidirectional ``|i - j| <= W``),
   through every fused varlen backend that loads (torch varlen, flash-attn, kernels-hub) and packfree's portable
   path on the GPU, against the float32 CPU reference; max difference and fwd+bwd time vs the portable path.
3. **mixer ops**: each CUDA route (causal-conv1d, fla GDN/KDA, mamba-ssm SSD) against packfree's torch path on
   the same packed inputs, timed against it.
4. **stock**: models at small width (Llama head_dim 128 and 512, Gemma3 head_dim 256 with a causal sliding
   window, ModernBERT with a bidirectional one): packfree's packed row and stock transformers on the same row
   packed by ``DataCollatorWithFlattening`` (``sdpa``, and ``flash_attention_2`` where flash-attn installed),
   each against stock ``sdpa`` on every sample alone; max logit difference and forward+backward time
   (``x_packfree_time``: stock's time / packfree's).
5. **compiled**: packed bf16 training steps under ``torch.compile`` (Llama, Qwen3-Next, Mamba2) against eager
   (``x_eager_time``: compiled step time / eager's).
6. **ranks**: one packed row over 2 ranks needs a second GPU; one is lent, so the row says so.

On a GPU the checks share ``--budget`` (420 s; :data:`BUDGET_SHARES`): a check past its share keeps the rows it
finished, says it stopped, and the next one runs. The results are rewritten after every check.

Everything lands in one folder (``--out``, default ``gpu-results/``): ``gpu.md`` (one Markdown table) and
``gpu.json``. Exit code 1 if any check that ran failed. ``--dry-run`` runs every check on the CPU in float32 at
small sizes with no CUDA call (kernel packages and varlen backends report themselves missing, compiled steps
use the ``aot_eager`` backend): it is what the tests run, so the script works the first time on a GPU.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

if __package__:  # python -m gpu.gpu_check (nox -s gpu, the tests)
    from .gpu_setup import bundle_rows, error_row, install_rows
else:  # the offline bundle runs this file beside its copy of gpu_setup.py
    from gpu_setup import bundle_rows, error_row, install_rows

HEAD_DIMS = (128, 256, 512)
WINDOWS: tuple[tuple[str, int | None, bool], ...] = (("none", None, True), ("causal W=512", 512, True),
                                                     ("bidirectional W=128", 128, False))


@dataclass(frozen=True)
class Env:
    """Where the check runs: ``device``/``dtype`` of the checked runs and the problem size."""

    device: torch.device
    dtype: torch.dtype
    tokens: int
    dry_run: bool
    repeats: int
    unavailable: dict[str, str] = field(default_factory=dict)
    """``{package or backend: why it is not here}`` (the bundle's ``not_carried``): the skip reason of its rows."""

    @classmethod
    def make(cls, dry_run: bool, tokens: int | None = None, unavailable: dict[str, str] | None = None) -> Env:
        if dry_run:
            return cls(torch.device("cpu"), torch.float32, tokens=tokens or 256, dry_run=True, repeats=1,
                       unavailable=unavailable or {})
        return cls(torch.device("cuda"), torch.bfloat16, tokens=tokens or 8192, dry_run=False, repeats=5,
                   unavailable=unavailable or {})

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> float:
        """Mean seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
        fn()
        self.sync()
        start = time.perf_counter()
        for _ in range(self.repeats):
            fn()
        self.sync()
        return (time.perf_counter() - start) / self.repeats


def skewed_lengths(total: int, samples: int = 16, seed: int = 0) -> list[int]:
    """``samples`` lengths >= 1 summing to ``total``, a few long and many short."""
    raw = torch.rand(samples, generator=torch.Generator().manual_seed(seed)).pow(3.0) + 0.02
    lengths = (raw / raw.sum() * (total - samples)).floor().long() + 1
    lengths[0] += total - int(lengths.sum())
    return lengths.tolist()


def _missing(env: Env, name: str, fallback: str) -> str:
    return f"skipped ({env.unavailable.get(name, fallback)})"


# ---------------------------------------------------------------------------------------------- attention
def attention_rows(env: Env, rows: list[dict]) -> list[dict]:
    from packfree_plugin.attention.interface import run_packed_attention
    from packfree_plugin.attention.reference import AttentionOptions
    from packfree_plugin.attention.varlen import VARLEN_BACKENDS
    from packfree_plugin.boundaries import Boundaries

    tokens = env.tokens
    lengths = skewed_lengths(tokens)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    boundaries = Boundaries.from_position_ids(positions.to(env.device))
    cpu_boundaries = Boundaries.from_position_ids(positions)
    for head_dim in HEAD_DIMS:
        generator = torch.Generator().manual_seed(head_dim)
        q, k, v = (torch.randn(1, heads, tokens, head_dim, generator=generator).to(env.device, env.dtype)
                   for heads in (8, 2, 2))
        for window_name, window, causal in WINDOWS:
            options = AttentionOptions(scale=head_dim**-0.5, causal=causal, window=window)
            base = {"check": f"attention head_dim={head_dim} window={window_name}", "tokens": tokens}
            try:
                expected = run_packed_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cpu_boundaries,
                                                options, backend="segments")

                def fwd_bwd(backend: str) -> None:
                    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
                    run_packed_attention(qq, kk, vv, boundaries, options, backend=backend).float().sum().backward()

                portable = env.timed(lambda: fwd_bwd("segments"))
                got = run_packed_attention(q, k, v, boundaries, options, backend="segments")
                rows.append(base | {"backend": "segments (portable)", **_compare(got, expected, env),
                                    "ms": portable * 1e3, "x_portable_time": 1.0})
            except Exception as error:  # noqa: BLE001 - report and go on
                rows.append(error_row(base | {"backend": "segments (portable)"}, error))
                continue
            for backend in VARLEN_BACKENDS:
                row = base | {"backend": backend.name}
                if env.dry_run or not backend.available():
                    rows.append(row | {"status": _missing(env, backend.name, "CUDA only" if env.dry_run
                                                          else "not available")})
                    continue
                try:
                    got = run_packed_attention(q, k, v, boundaries, options, backend=backend.name)
                    seconds = env.timed(lambda name=backend.name: fwd_bwd(name))
                    rows.append(row | _compare(got, expected, env) | {"ms": seconds * 1e3,
                                                                      "x_portable_time": seconds / portable})
                except Exception as error:  # noqa: BLE001 - a backend may refuse a head_dim: say so
                    rows.append(error_row(row, error))
    return rows


def _compare(got: torch.Tensor, expected: torch.Tensor, env: Env) -> dict:
    diff = (got.float().cpu() - expected.float().cpu()).abs().max().item()
    tolerance = 3e-2 if env.dtype in (torch.bfloat16, torch.float16) else 1e-4
    return {"status": "ok" if diff <= tolerance * max(1.0, expected.abs().max().item()) else "MISMATCH",
            "max_diff": diff}


# --------------------------------------------------------------------------------------------------- ops
def _op_cases(env: Env) -> list[tuple[str, Callable[[str], torch.Tensor]]]:
    """``(name, make)`` where ``make(backend) -> output`` runs one packed op on fresh inputs (same seed)."""
    from packfree_plugin.ops.conv import causal_conv1d
    from packfree_plugin.ops.gated_delta import chunk_gated_delta_rule, chunk_kda
    from packfree_plugin.ops.ssd import ssd_chunk_scan

    tokens, device, dtype = env.tokens, env.device, env.dtype
    lengths = skewed_lengths(tokens)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(device)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
    seq_idx = seq_idx.to(device)

    def inputs(seed: int):
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape, dtype=dtype, scale=1.0, shift=0.0):
            return (torch.randn(*shape, generator=gen) * scale + shift).to(device, dtype).requires_grad_()

        def unit(*shape, dtype=dtype, scale=1.0):
            return (torch.rand(*shape, generator=gen) * scale).to(device, dtype).requires_grad_()

        return rand, unit

    def conv(backend: str) -> torch.Tensor:
        rand, _ = inputs(1)
        x, w, b = rand(1, tokens, 1024), rand(1024, 4, scale=0.3), rand(1024, scale=0.1)
        return causal_conv1d(x, w, b, activation="silu", seq_idx=seq_idx, backend=backend)

    def gdn(backend: str) -> torch.Tensor:
        rand, unit = inputs(2)
        q, k, v = rand(1, tokens, 8, 128), rand(1, tokens, 8, 128), rand(1, tokens, 8, 128)
        gate, beta = unit(1, tokens, 8, dtype=torch.float32, scale=-1.0), unit(1, tokens, 8)
        return chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                      backend=backend)[0]

    def kda(backend: str) -> torch.Tensor:
        rand, unit = inputs(3)
        q, k, v = rand(1, tokens, 8, 128), rand(1, tokens, 8, 128), rand(1, tokens, 8, 128)
        gate, beta = unit(1, tokens, 8, 128, dtype=torch.float32, scale=-0.1), unit(1, tokens, 8)
        return chunk_kda(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend=backend)[0]

    def ssd(backend: str) -> torch.Tensor:
        rand, unit = inputs(4)
        x, dt = rand(1, tokens, 16, 64), rand(1, tokens, 16, dtype=torch.float32, scale=0.5)
        a = unit(16, dtype=torch.float32, scale=-1.0)
        b, c = rand(1, tokens, 1, 64), rand(1, tokens, 1, 64)
        return ssd_chunk_scan(x, dt, a, b, c, chunk_size=128, dt_softplus=True, seq_idx=seq_idx, backend=backend)

    return [("causal-conv1d (conv, seq_idx)", conv), ("fla chunk_gated_delta_rule (cu_seqlens)", gdn),
            ("fla chunk_kda (cu_seqlens)", kda), ("mamba-ssm mamba_chunk_scan_combined (seq_idx)", ssd)]


def op_rows(env: Env, rows: list[dict]) -> list[dict]:
    """Each CUDA kernel route against packfree's torch path on the same packed inputs."""
    for name, make in _op_cases(env):
        row = {"check": name, "tokens": env.tokens}
        try:
            reference = make("torch")
            reference.float().sum().backward()
            if env.dry_run:  # no CUDA call: the kernel side is the GPU's
                rows.append(row | {"status": _missing(env, name.split()[0], "CUDA only")})
                continue
            try:
                routed = make("kernel")
            except ValueError as missing:
                rows.append(row | {"status": _missing(env, name.split()[0], str(missing))[:160]})
                continue
            diff = (routed.float() - reference.float()).abs().max().item()
            scale = reference.float().abs().max().item()
            torch_s = env.timed(lambda: make("torch").float().sum().backward())
            kernel_s = env.timed(lambda: make("kernel").float().sum().backward())
            rows.append(row | {"status": "ok" if diff <= 3e-2 * max(scale, 1.0) else "MISMATCH", "max_diff": diff,
                               "ms": kernel_s * 1e3, "x_portable_time": kernel_s / torch_s})
        except Exception as error:  # noqa: BLE001 - report and go on
            rows.append(error_row(row, error))
    return rows


# ------------------------------------------------------------------------------------------------- stock
STOCK_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama head_dim=128": ("llama", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=128)),
    "llama head_dim=512": ("llama", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=512)),
    "gemma3 head_dim=256, causal window 512": (
        "gemma3_text", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=256, sliding_window=512, layer_types=["sliding_attention", "full_attention"])),
    "deepseek_v3 MLA, q/k heads 192, v heads 128": (
        "deepseek_v3", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=4,
                            q_lora_rank=None, kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64,
                            v_head_dim=128, first_k_dense_replace=2)),
    "modernbert bidirectional window 128": (
        "modernbert", dict(hidden_size=512, intermediate_size=768, num_attention_heads=8, local_attention=128,
                           layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
                           bos_token_id=2, cls_token_id=2, sep_token_id=1)),
}


def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means "not usable"
        return False
    return True


def transformers_model(config: Any, implementation: str, env: Env, masked: bool = False):
    """transformers' own class for ``config``'s type, in ``env``'s dtype and device, training. By class, not through
    the auto classes: importing fla (its routes do) registers fla's own Mamba2 under ``"mamba2"``."""
    import transformers
    from transformers.models.auto import modeling_auto

    mapping = (modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES if masked
               else modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    model_class = getattr(transformers, mapping[config.model_type])
    return model_class._from_config(config, attn_implementation=implementation, dtype=env.dtype).to(env.device).train()


def _stock_model(model_type: str, config: dict[str, Any], implementation: str, env: Env):
    from packfree_plugin.cli.tiny import transformers_config

    torch.manual_seed(0)
    cfg = transformers_config(model_type, num_hidden_layers=2, vocab_size=4096, **config)
    return transformers_model(cfg, implementation, env, masked=model_type == "modernbert")


def stock_rows(env: Env, rows: list[dict]) -> list[dict]:
    """packfree's packed row and stock's packed paths against stock sdpa on each sample alone."""
    from transformers import DataCollatorWithFlattening

    import packfree_plugin

    packfree_plugin.register()
    tokens = min(env.tokens, 4096)
    lengths = skewed_lengths(tokens)
    ids = torch.randint(3, 4096, (tokens,), generator=torch.Generator().manual_seed(5))
    features = [{"input_ids": piece.tolist()} for piece in ids.split(lengths)]
    for name, (model_type, config) in STOCK_MODELS.items():
        encoder = model_type == "modernbert"
        collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
        batch = {k: v.to(env.device) if isinstance(v, torch.Tensor) else v for k, v in collate(features).items()}
        batch.pop("labels", None)
        extra = {} if encoder else {"use_cache": False}
        try:
            alone_model = _stock_model(model_type, config, "sdpa", env)
            with torch.no_grad():
                alone = torch.cat([alone_model(input_ids=p[None].to(env.device), **extra).logits[0].float()
                                   for p in ids.split(lengths)])
        except Exception as error:  # noqa: BLE001
            rows.append(error_row({"check": f"stock {name}", "tokens": tokens}, error))
            continue
        timings: dict[str, float] = {}
        for label, implementation in (("packfree", "packfree"), ("stock sdpa + collator", "sdpa"),
                                      ("stock flash_attention_2 + collator", "flash_attention_2")):
            row = {"check": f"stock {name}", "backend": label, "tokens": tokens}
            if implementation == "flash_attention_2" and (env.dry_run or not _flash_attn_installed()):
                rows.append(row | {"status": _missing(env, "flash-attn", "flash-attn not installed")})
                continue
            try:
                model = _stock_model(model_type, config, implementation, env)
                inputs = dict(batch) if implementation != "packfree" else {
                    "input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
                if encoder and implementation != "packfree":
                    # stock ModernBERT unpads from an attention mask; a flattened row has none: that is the
                    # point of the comparison (a MISMATCH here is stock's, not packfree's)
                    inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "position_ids")}
                with torch.no_grad():
                    logits = model(**inputs, **extra).logits[0].float()

                def step(model=model, inputs=inputs) -> None:
                    model.zero_grad(set_to_none=True)
                    model(**inputs, **extra).logits.float().square().mean().backward()

                seconds = env.timed(step)
                timings[label] = seconds
                diff = (logits - alone).abs().max().item()
                tolerance = 5e-2 if env.dtype in (torch.bfloat16, torch.float16) else 1e-4
                status = "ok" if diff <= tolerance * max(1.0, alone.abs().max().item()) else (
                    "MISMATCH" if implementation == "packfree" else "differs from alone (stock)")
                rows.append(row | {"status": status, "max_diff": diff, "ms": seconds * 1e3,
                                   "x_packfree_time": seconds / timings["packfree"] if "packfree" in timings else None})
            except ValueError as error:
                if implementation == "packfree" and str(error).startswith("packfree refuses"):
                    # the load-time gate refused a type it cannot run exactly: the promise kept, not a failure
                    rows.append(row | {"status": "refused by packfree's gate (not exact on packed rows yet)"})
                else:
                    rows.append(error_row(row, error))
            except Exception as error:  # noqa: BLE001 - report and go on
                rows.append(error_row(row, error))
    return rows


# ---------------------------------------------------------------------------------------------- compiled
def compiled_rows(env: Env, rows: list[dict]) -> list[dict]:
    """``torch.compile`` of one packed training step (Llama, Qwen3-Next, Mamba2) against eager: loss, gradients,
    graphs per forward and step time over eager's (inductor on the GPU, ``aot_eager`` in a dry run)."""
    import packfree_plugin
    from packfree_plugin.cli.tiny import tiny_config
    from packfree_plugin.gate.audit import packed_row

    packfree_plugin.register()
    backend = "aot_eager" if env.dry_run else "inductor"
    tokens = min(env.tokens, 1000)
    for model_type in ("llama", "qwen3_next", "mamba2"):
        row = {"check": f"compiled packed step {model_type} ({backend})", "tokens": tokens}
        try:
            torch.manual_seed(0)
            model = transformers_model(tiny_config(model_type), "packfree", env)
            samples = [torch.randint(3, 128, (n,)) for n in skewed_lengths(tokens)]
            batch = {k: v.to(env.device) for k, v in packed_row(samples).items()}

            def step(module) -> tuple[float, list[torch.Tensor]]:
                model.zero_grad(set_to_none=True)
                labels = batch["input_ids"].masked_fill(batch["position_ids"] == 0, -100)  # the label contract
                loss = module(**batch, labels=labels, use_cache=False).loss
                loss.backward()
                return loss.item(), [p.grad.float().clone() for p in model.parameters() if p.grad is not None]

            eager_loss, eager_grads = step(model)
            torch._dynamo.reset()
            compiled = torch.compile(model, backend=backend)
            compiled_loss, compiled_grads = step(compiled)
            eager_s, compiled_s = env.timed(lambda: step(model)), env.timed(lambda: step(compiled))
            graphs = {"runs": 0}

            def counting(graph_module, example_inputs):
                def run(*args):
                    graphs["runs"] += 1
                    return graph_module.forward(*args)
                return run

            torch._dynamo.reset()
            counted = torch.compile(model, backend=counting)
            with torch.no_grad():
                counted(**batch, use_cache=False)
                graphs["runs"] = 0
                counted(**batch, use_cache=False)
            torch._dynamo.reset()
            diff = max((a - b).abs().max().item() for a, b in zip(compiled_grads, eager_grads))
            scale = max(g.abs().max().item() for g in eager_grads)
            ok = abs(compiled_loss - eager_loss) < 2e-2 and diff <= 5e-2 * max(scale, 1e-3) and graphs["runs"] <= 2
            rows.append(row | {"status": "ok" if ok else "MISMATCH", "max_diff": diff,
                               "loss_diff": abs(compiled_loss - eager_loss), "graphs_per_forward": graphs["runs"],
                               "ms": compiled_s * 1e3, "x_eager_time": compiled_s / eager_s})
        except Exception as error:  # noqa: BLE001 - report and go on
            rows.append(error_row(row, error))
    return rows


# ------------------------------------------------------------------------------------------------ output
def markdown(rows: list[dict]) -> str:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [f"{row[c]:.4g}" if isinstance(row.get(c), float) else str(row.get(c, "") if row.get(c) is not None
                                                                         else "") for c in columns]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines)


def ranks_row(env: Env) -> dict:
    """One packed row over ranks needs a second GPU: none has been lent (one chip), so this row says so."""
    count = 0 if env.dry_run else torch.cuda.device_count()
    reason = "dry run" if env.dry_run else (
        f"{count} GPU here: one packed row over ranks needs 2" if count < 2
        else f"{count} GPUs here, but no over-ranks check is built yet: only one GPU has been lent so far")
    return {"check": "one packed row over 2 ranks", "status": f"skipped ({reason})"}


CHECKS: dict[str, Callable[[Env, list[dict]], list[dict]]] = {
    "attention": attention_rows, "ops": op_rows, "stock": stock_rows, "compiled": compiled_rows}
BUDGET_SHARES = {"attention": 0.15, "ops": 0.3, "stock": 0.2, "compiled": 0.35}
"""Each check's share of ``--budget``: past it, the rows it finished stay and the next check runs."""


class OverBudget(BaseException):
    """A check ran past its share of ``--budget`` (a BaseException, so no check's own ``except`` swallows it)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise OverBudget


def run_check(name: str, env: Env, seconds: float | None) -> list[dict]:
    """The rows of check ``name``; past ``seconds`` (SIGALRM) those it finished, then one row saying it stopped."""
    rows: list[dict] = []
    previous = signal.signal(signal.SIGALRM, _on_alarm) if seconds else None
    if seconds:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        CHECKS[name](env, rows)
    except OverBudget:
        torch._dynamo.reset()
        rows.append({"check": name, "status": f"skipped (over its {seconds:.0f} s share of --budget; "
                                              f"the {len(rows)} rows above finished)"})
    except Exception:  # noqa: BLE001 - report and go on
        rows.append({"check": name, "status": "error: " + traceback.format_exc(limit=2)[-300:]})
    finally:
        if seconds:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
    return rows


def write(out: Path, header: str, rows: list[dict]) -> None:
    """``out/gpu.md`` and ``out/gpu.json`` (rewritten after every check, so a killed run leaves what finished)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.md").write_text(header + markdown(rows) + "\n")
    (out / "gpu.json").write_text(json.dumps({"header": header, "torch": torch.__version__, "rows": rows},
                                             indent=2))


def _header(args: argparse.Namespace, manifest: dict | None) -> str:
    import packfree_plugin

    device = "CPU dry run" if args.dry_run else torch.cuda.get_device_name()
    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = "not installed"
    bundle = f", bundle of commit {manifest['commit']}" if manifest else ""
    return (f"# packfree GPU check\n\ndevice: {device}, torch {torch.__version__}, transformers {transformers}, "
            f"Python {sys.version.split()[0]}, packfree from {Path(packfree_plugin.__file__).parent}{bundle}\n\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, float32, small sizes, no CUDA call")
    parser.add_argument("--out", default="gpu-results", help="folder for gpu.md and gpu.json")
    parser.add_argument("--install", action="store_true", help="pip-install fla and the optional CUDA wheels first")
    parser.add_argument("--install-timeout", type=float, default=120.0, help="seconds per package")
    parser.add_argument("--bundle", type=Path, help="the offline bundle's manifest.json (gpu-bundle/run.sh)")
    parser.add_argument("--site", type=Path, help="where run.sh installed the bundle's wheels")
    parser.add_argument("--budget", type=float, help="seconds for all checks, shared by BUDGET_SHARES (default "
                        "420 on a GPU, none in a dry run)")
    parser.add_argument("--only", choices=list(CHECKS), action="append", help="run only these checks")
    parser.add_argument("--tokens", type=int, help="tokens per packed row (default 8192, dry run 256)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (use --dry-run to exercise the script on the CPU)")
        return 0
    budget = args.budget if args.budget is not None else (None if args.dry_run else 420.0)
    manifest = json.loads(args.bundle.read_text()) if args.bundle else None
    env = Env.make(args.dry_run, args.tokens, unavailable=manifest["not_carried"] if manifest else None)
    out, header = Path(args.out), _header(args, manifest)
    rows = install_rows(args.install_timeout, dry_run=args.dry_run) if args.install else []
    if manifest:
        rows += bundle_rows(manifest, args.site, args.bundle.parent)
    write(out, header, rows)
    for name in CHECKS:
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        rows += run_check(name, env, budget * BUDGET_SHARES[name] if budget else None)
        print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        write(out, header, rows)
    rows.append(ranks_row(env))
    write(out, header, rows)
    print(header + markdown(rows))
    return 1 if any(str(row.get("status", "")).startswith(("MISMATCH", "error")) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
