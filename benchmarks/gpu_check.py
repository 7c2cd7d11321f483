"""GPU check (``nox -s gpu`` on a CUDA machine): each CUDA backend against the CPU reference, and timed.

For every fused varlen attention backend that loads here, a packed bf16 batch (16 samples of skewed
lengths, causal, GQA, with and without a sliding window) is run through it and through packfree's
portable path on the CPU in float32; the table gives the max difference and the fwd+bwd time against
the portable path on the same GPU. Each mixer op's CUDA route (causal-conv1d,
fla GDN/KDA, mamba-ssm SSD; whichever installs) is compared with packfree's torch path on the same
packed inputs and timed against it. A tiny Llama then runs a packed row end to end on the GPU with
``attn_implementation="packfree"`` and is compared with each sample alone, and compiled packed training
steps (Llama, Qwen3-Next, Mamba2) are compared with eager and their graphs counted. Every check reports its own
failure instead of stopping the script. Prints Markdown; exit code 1 if any available check fails.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch

from benchmarks.attention import skewed_lengths
from packfree_plugin.attention.interface import run_packed_attention
from packfree_plugin.attention.reference import AttentionOptions
from packfree_plugin.attention.varlen import VARLEN_BACKENDS
from packfree_plugin.boundaries import Boundaries


def _timed(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def attention_rows(tokens: int = 8192) -> list[dict]:
    lengths = skewed_lengths(tokens)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    boundaries = Boundaries.from_position_ids(positions)
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 16, tokens, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
    k = torch.randn(1, 4, tokens, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
    v = torch.randn(1, 4, tokens, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
    rows = []
    for window in (None, 512):
        options = AttentionOptions(scale=128**-0.5, causal=True, window=window)
        cpu_boundaries = Boundaries.from_position_ids(positions.cpu())
        expected = run_packed_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cpu_boundaries, options,
                                        backend="segments")

        def fwd_bwd(backend: str) -> None:
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            run_packed_attention(qq, kk, vv, boundaries, options, backend=backend).float().sum().backward()

        portable = _timed(lambda: fwd_bwd("segments"))
        for backend in VARLEN_BACKENDS:
            row = {"check": f"attention {backend.name}", "window": window, "tokens": tokens}
            if not backend.available():
                rows.append(row | {"status": "not installed"})
                continue
            try:
                out = run_packed_attention(q, k, v, boundaries, options, backend=backend.name)
                diff = (out.float().cpu() - expected).abs().max().item()
                seconds = _timed(lambda name=backend.name: fwd_bwd(name))
                rows.append(row | {"status": "ok" if diff < 3e-2 else "MISMATCH", "max_diff": diff,
                                   "ms": seconds * 1e3, "x_portable_time": seconds / portable})
            except Exception as error:  # noqa: BLE001 - report and go on
                rows.append(row | {"status": f"error: {error!r}"[:200]})
        rows.append({"check": "attention segments (portable, GPU)", "window": window, "tokens": tokens,
                     "status": "ok", "ms": portable * 1e3, "x_portable_time": 1.0})
    return rows


def _op_cases(tokens: int) -> list[tuple[str, object]]:
    """``(name, make)`` where ``make(backend) -> output`` runs one packed op on fresh CUDA inputs."""
    from packfree_plugin.ops.conv import causal_conv1d
    from packfree_plugin.ops.gated_delta import chunk_gated_delta_rule, chunk_kda
    from packfree_plugin.ops.ssd import ssd_chunk_scan

    lengths = skewed_lengths(tokens)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), device="cuda", dtype=torch.int32),
                                      torch.tensor(lengths, device="cuda"))[None]
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype).requires_grad_()

    def conv(backend):
        x, w, b = rand(1, tokens, 1024), rand(1024, 4, scale=0.3), rand(1024, scale=0.1)
        return causal_conv1d(x, w, b, activation="silu", seq_idx=seq_idx, backend=backend)

    def gdn(backend):
        q, k, v = rand(1, tokens, 8, 128), rand(1, tokens, 8, 128), rand(1, tokens, 8, 128)
        gate = -torch.rand(1, tokens, 8, device="cuda", generator=g).requires_grad_()
        beta = torch.rand(1, tokens, 8, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        return chunk_gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                      backend=backend)[0]

    def kda(backend):
        q, k, v = rand(1, tokens, 8, 128), rand(1, tokens, 8, 128), rand(1, tokens, 8, 128)
        gate = (-torch.rand(1, tokens, 8, 128, device="cuda", generator=g) * 0.1).requires_grad_()
        beta = torch.rand(1, tokens, 8, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
        return chunk_kda(q, k, v, gate, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu, backend=backend)[0]

    def ssd(backend):
        x = rand(1, tokens, 16, 64)
        dt = rand(1, tokens, 16, dtype=torch.float32, scale=0.5)
        a = (-torch.rand(16, device="cuda", generator=g)).requires_grad_()
        b, c = rand(1, tokens, 1, 64), rand(1, tokens, 1, 64)
        return ssd_chunk_scan(x, dt, a, b, c, chunk_size=128, dt_softplus=True, seq_idx=seq_idx, backend=backend)

    return [("causal-conv1d (conv, seq_idx)", conv), ("fla chunk_gated_delta_rule (cu_seqlens)", gdn),
            ("fla chunk_kda (cu_seqlens)", kda), ("mamba-ssm mamba_chunk_scan_combined (seq_idx)", ssd)]


def op_rows(tokens: int = 8192) -> list[dict]:
    """Each CUDA kernel route against packfree's torch path on the same packed inputs (same seeds)."""
    rows = []
    for name, make in _op_cases(tokens):
        row = {"check": name, "tokens": tokens}
        try:
            reference = make("torch")
            try:
                routed = make("kernel")
            except ValueError as missing:
                rows.append(row | {"status": f"not installed ({missing})"[:120]})
                continue
            diff = (routed.float() - reference.float()).abs().max().item()
            scale = reference.float().abs().max().item()
            torch_s = _timed(lambda: make("torch").float().sum().backward())
            kernel_s = _timed(lambda: make("kernel").float().sum().backward())
            rows.append(row | {"status": "ok" if diff <= 3e-2 * max(scale, 1.0) else "MISMATCH", "max_diff": diff,
                               "ms": kernel_s * 1e3, "x_portable_time": kernel_s / torch_s})
        except Exception as error:  # noqa: BLE001 - report and go on
            rows.append(row | {"status": f"error: {error!r}"[:200]})
    return rows


def model_row() -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import packfree_plugin

    packfree_plugin.register()
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=2048)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="packfree", dtype=torch.bfloat16).cuda()
    lengths = skewed_lengths(4096)
    ids = torch.randint(3, 2048, (1, 4096), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0].float()
        alone = torch.cat([model(input_ids=p).logits[0].float() for p in ids.split(lengths, dim=1)])
    diff = (packed - alone).abs().max().item()
    return {"check": "tiny Llama packed vs alone (bf16, auto backend)", "tokens": 4096, "max_diff": diff,
            "status": "ok" if diff < 5e-2 else "MISMATCH"}


def compiled_rows() -> list[dict]:
    """``torch.compile`` (inductor) on the GPU: one packed bf16 training step of tiny Llama, Qwen3-Next (GDN)
    and Mamba2 against eager (loss and largest gradient difference), and graphs per forward."""
    from transformers import AutoModelForCausalLM

    import packfree_plugin
    from packfree_plugin.tiny import tiny_config
    from packfree_plugin.verify import packed_row

    packfree_plugin.register()
    rows = []
    for model_type in ("llama", "qwen3_next", "mamba2"):
        row = {"check": f"compiled packed step {model_type} (bf16)", "tokens": 1000}
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="packfree",
                                                     dtype=torch.bfloat16).cuda().train()
            batch = {k: v.cuda() for k, v in packed_row([torch.randint(3, 128, (n,)) for n in skewed_lengths(1000)]).items()}

            def step(module) -> tuple[float, list[torch.Tensor]]:
                model.zero_grad(set_to_none=True)
                loss = module(**batch, labels=batch["input_ids"], use_cache=False).loss
                loss.backward()
                return loss.item(), [p.grad.float().clone() for p in model.parameters() if p.grad is not None]

            eager_loss, eager_grads = step(model)
            torch._dynamo.reset()
            compiled_loss, compiled_grads = step(torch.compile(model))
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
                               "loss_diff": abs(compiled_loss - eager_loss), "graphs_per_forward": graphs["runs"]})
        except Exception as error:  # noqa: BLE001 - report and go on
            rows.append(row | {"status": f"error: {error!r}"[:200]})
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows = []
    for check in (attention_rows, op_rows, model_row, compiled_rows):
        try:
            result = check()
            rows.extend(result if isinstance(result, list) else [result])
        except Exception:  # noqa: BLE001
            rows.append({"check": check.__name__, "status": "error: " + traceback.format_exc(limit=2)[-300:]})
    columns = list(dict.fromkeys(key for row in rows for key in row))
    print("| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.4g}" if isinstance(row.get(c), float) else str(row.get(c, ""))
                                for c in columns) + " |")
    return 1 if any(str(row["status"]).startswith(("MISMATCH", "error")) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
