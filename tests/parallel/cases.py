"""Sequence-parallel runs on 2 CPU ranks (gloo, torch.multiprocessing) against one process on the same packed row.

Each case packs one row, runs it in one process (the packed run packfree already proves equal to each sample alone),
then on 2 ranks, each holding half the row; rank 0 saves the loss and every parameter's gradient summed over the
ranks. Several cases share one spawn of the ranks (importing transformers dominates the cost).
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


@dataclass(frozen=True)
class Case:
    model_type: str
    lengths: tuple[int, ...]
    engine: str = "torch"  # "torch": prepare_sequence_parallel on the world group; "ulysses": DeepSpeed;
    # "torch_cp": the whole row inside torch's context_parallel
    checkpointing: bool = False
    dtype: torch.dtype = torch.float64
    plant: str | None = None  # "shard_edges": every shard's first token starts a sample (the bug this guards)
    overrides: dict = field(default_factory=dict, hash=False)

    @property
    def name(self) -> str:
        parts = [self.model_type, self.engine, "-".join(map(str, self.lengths)), str(self.dtype).removeprefix("torch.")]
        return "/".join(parts + (["ckpt"] if self.checkpointing else []) + ([self.plant] if self.plant else []))


ENCODERS = {"bert"}


@dataclass(frozen=True)
class Result:
    loss: float
    grads: dict[str, torch.Tensor]
    logits_dtype: torch.dtype



FLOAT32_INSIDE = {"qwen3_next"}
"""Model types that compute in float32 inside a float64 model (Qwen3-Next's RMSNorms cast to float32): a shard's
matmuls round differently in the last float64 bit, and the float32 cast carries that to float32 rounding."""


def tolerance(case: Case, result: Result) -> float:
    """Relative tolerance of a comparison with one process: float64 to rounding; float32 where the model computes
    (or casts its logits, as Mamba2's head does) in float32."""
    exact = result.logits_dtype == torch.float64 and case.model_type not in FLOAT32_INSIDE
    return 1e-10 if exact else 1e-5


def _model(case: Case) -> torch.nn.Module:
    from transformers import AutoModelForMaskedLM

    from packfree_plugin.registration import register
    from packfree_plugin.tiny import auto_class, tiny_config

    register()
    torch.manual_seed(0)
    config = tiny_config(case.model_type, **case.overrides)
    for name, value in config.to_dict().items():  # train mode (for checkpointing) without random dropout
        if "dropout" in name and isinstance(value, float):
            setattr(config, name, 0.0)
    kwargs = dict(attn_implementation="packfree", dtype=case.dtype, experts_implementation="eager")
    cls = AutoModelForMaskedLM if case.model_type in ENCODERS else auto_class(config)
    model = cls.from_config(config, **kwargs)
    model.train()  # gradient checkpointing runs in train mode only
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batch(case: Case) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(sum(case.lengths))
    samples = [torch.randint(3, 120, (n,), generator=generator).tolist() for n in case.lengths]
    batch = dict(DataCollatorWithFlattening()([{"input_ids": s} for s in samples]))
    if case.model_type in ENCODERS:  # masked-LM targets on every third token
        labels = batch["input_ids"].clone()
        labels[:, torch.arange(labels.shape[1]) % 3 != 0] = -100
        batch["labels"] = labels
    return batch


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@functools.lru_cache(maxsize=None)
def one_process(case: Case) -> tuple[float, dict[str, torch.Tensor]]:
    """The single-process packed run: the row's mean token loss (in the model's dtype) and the gradients (kept for
    the module: a planted case compares with its unplanted twin's)."""
    from packfree_plugin.boundaries import Boundaries

    model = _model(case)
    batch = _batch(case)
    labels = batch.pop("labels")
    if len(case.lengths) == 1:
        # One process runs a row of one sample stock (Qwen3-Next's stock delta rule computes in float32); its shards
        # run packfree's packed ops, so this reference runs them too, on the whole row, in the model's dtype.
        boundaries = Boundaries.from_position_ids(batch["position_ids"], device=batch["input_ids"].device)
        boundaries.is_packed = True
        batch.update(packfree_boundaries=boundaries, use_cache=False)
    logits = model(**batch).logits
    if case.model_type not in ENCODERS:  # token t predicts t + 1 (transformers' loss would cast to float32)
        logits, labels = logits[:, :-1], labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return loss.item(), _grads(model)


def _plant(case: Case) -> None:
    if case.plant == "shard_edges":
        from packfree_plugin.parallel import prepare as shard

        def shard_local(local: torch.Tensor, group) -> torch.Tensor:
            restarted = local.clone()
            restarted[:, 0] = 0  # the shard's first token taken as a sample start
            parts = [torch.empty_like(restarted) for _ in range(WORLD)]
            dist.all_gather(parts, restarted, group=group)
            return torch.cat(parts, dim=-1)

        shard._gather_rows = shard_local


def _sequence_parallel(case: Case, rank: int) -> Result:
    from packfree_plugin.parallel import prepare_sequence_parallel, register_ulysses, shard_batch, shard_loss

    model = _model(case)
    if case.engine == "torch_cp":
        return _torch_context_parallel(model, case)
    if case.engine == "ulysses":
        register_ulysses(model, WORLD)
    else:
        prepare_sequence_parallel(model)
    inputs, targets = shard_batch(_batch(case), rank, WORLD, causal=case.model_type not in ENCODERS)
    logits = model(**inputs).logits
    loss = shard_loss(logits, targets)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = _grads(model)
    for grad in grads.values():
        dist.all_reduce(grad)
    return Result(total.item(), grads, logits.dtype)


def _torch_context_parallel(model: torch.nn.Module, case: Case) -> Result:
    """One forward of the whole packed row inside torch's ``context_parallel`` (which shards it in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    batch = _batch(case)
    input_ids, position_ids = batch["input_ids"].clone(), batch["position_ids"].clone()
    mesh = init_device_mesh("cpu", (WORLD,))
    with context_parallel(mesh, buffers=[input_ids, position_ids], buffer_seq_dims=[1, 1]):
        logits = model(input_ids=input_ids, position_ids=position_ids).logits
    raise AssertionError(f"a packed row ran inside torch's context_parallel (logits {list(logits.shape)})")


CASE_SECONDS = 240
"""A case's limit on each rank (a few seconds alone, a minute on a loaded 2-core machine): past it the rank prints
every thread's traceback and exits, so a collective one rank skipped fails the test instead of hanging it."""
START_SECONDS = 300
"""The limit for starting a rank (imports, the process group)."""


def _worker(rank: int, port: int, cases: list[Case], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    faulthandler.dump_traceback_later(START_SECONDS, exit=True)
    torch.set_num_threads(1)  # two ranks share the CI machine's two cores
    timeout = timedelta(seconds=CASE_SECONDS)  # a collective whose peer is gone raises instead of waiting forever
    if any(case.engine == "ulysses" for case in cases):
        import deepspeed

        # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU ranks at start-up (minutes on 2 cores, and a
        # compile killed midway leaves a lock file every later start waits on); Ulysses needs gloo's all-to-all only
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
        deepspeed.init_distributed(dist_backend="gloo", timeout=timeout)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timeout)
    results: dict[str, object] = {}
    try:
        for case in cases:
            faulthandler.dump_traceback_later(CASE_SECONDS, exit=True)
            print(f"rank {rank}: {case.name}", file=sys.stderr, flush=True)  # names the case a traceback is from
            _plant(case)
            try:
                results[case.name] = _sequence_parallel(case, rank)
            except ValueError as error:  # a refusal: every rank raises it in the forward
                results[case.name] = error
            finally:
                _undo_case(case)
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown, where gloo's threads can abort a finished process


def _undo_case(case: Case) -> None:
    """Undo what a case registered, so the next case starts as a fresh process would."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from packfree_plugin.attention.interface import packfree_attention_forward
    from packfree_plugin.parallel import prepare as shard

    ALL_ATTENTION_FUNCTIONS["packfree"] = packfree_attention_forward  # undo Ulysses' wrapper
    if case.engine == "ulysses":
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp._release_sequence_parallel_groups()  # the next case registers afresh
    shard._gather_rows = _GATHER


from packfree_plugin.parallel.prepare import _gather_rows as _GATHER  # noqa: E402  (restored after a planted case)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_two_ranks(cases: list[Case], out: str) -> dict[str, object]:
    """Run every case on 2 ranks; ``{case.name: its Result, or the ValueError it raised}``. Raises AssertionError
    as soon as a rank fails (its traceback is on stderr), ending the other."""
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, port, cases, out)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + START_SECONDS + CASE_SECONDS * len(cases)  # the ranks' own limits come first
    try:
        while any(process.is_alive() for process in processes) and time.monotonic() < deadline:
            if any(process.exitcode not in (None, 0) for process in processes):
                break
            time.sleep(0.5)
        codes = [process.exitcode for process in processes]
        assert codes == [0] * WORLD, f"ranks exited with {codes} (None: still running; tracebacks on stderr)"
    finally:
        for process in processes:  # a rank stuck in a collective (its peer failed) is ended, never left behind
            if process.is_alive():
                process.kill()
                process.join()
    return torch.load(out, weights_only=False)


def relative_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest ``|got - expected|`` of a parameter's gradient over its largest ``|expected|`` (at least 1e-3 of
    the model's largest: a gradient that is zero in exact arithmetic, e.g. BERT's key bias, is rounding noise), and
    that parameter's name."""
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    scale = max(grad.abs().max().item() for grad in expected.values())
    errors = {name: ((got[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-3 * scale)).item()
              for name, grad in expected.items()}
    worst = max(errors, key=errors.get)
    return errors[worst], worst
