"""Sequence-parallel runs on 2 or 4 CPU ranks (gloo, torch.multiprocessing) against the stock model run on each
sample alone.

Each case packs one row and splits it over its ranks, each holding an equal part; rank 0 saves the loss and every
parameter's gradient summed over the ranks. The reference runs the stock model (eager attention, same weights) on
every sample alone and sums the samples' token losses over the row's target count. Both sides run in float64 with
the modeling module's own float32 steps (RMSNorms, Qwen3-Next's delta rule) made float64 (:func:`float64_inside`).
Several cases share one spawn of the ranks (importing transformers dominates the cost).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import socket
import sys
import tempfile
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import COLLECTIVE_SECONDS, wait_for_ranks


@dataclass(frozen=True)
class Case:
    model_type: str
    lengths: tuple[int, ...]
    engine: str = "torch"  # "torch": prepare_sequence_parallel on the world group; "ulysses": DeepSpeed;
    # "torch_cp": the whole row inside torch's context_parallel
    checkpointing: bool = False
    dtype: torch.dtype = torch.float64
    plant: str | None = None  # a bug planted for this case (PLANTS)
    overrides: tuple[tuple[str, object], ...] = ()  # config overrides
    world: int = 2

    @property
    def name(self) -> str:
        parts = [self.model_type, self.engine, f"{self.world}ranks", "-".join(map(str, self.lengths)),
                 str(self.dtype).removeprefix("torch.")]
        extra = [f"{key}={value}" for key, value in self.overrides]
        return "/".join(parts + extra + (["ckpt"] if self.checkpointing else []) + ([self.plant] if self.plant else []))

    def unplanted(self) -> Case:
        return Case(self.model_type, self.lengths, self.engine, self.checkpointing, self.dtype, None, self.overrides,
                    self.world)


PLANTS = {
    "shard_edges": "every shard's first token starts a sample",
    "groups": "every rank reads the first Mamba2 B/C head groups, not its heads' own",
    "filler": "shard_batch's padding filler continues the row's last sample",
    "sinks": "every rank's attention takes the first heads' sinks, not its own heads'",
}


ENCODERS = {"bert"}


@dataclass(frozen=True)
class Result:
    loss: float
    grads: dict[str, torch.Tensor]
    logits_dtype: torch.dtype


def tolerance(case: Case, result: Result) -> float:
    """Relative tolerance of a comparison with the stock model: float64 to rounding; float32 where the model casts
    its logits to float32 (Mamba2's head does) or runs in float32."""
    return 1e-10 if result.logits_dtype == torch.float64 and case.dtype == torch.float64 else 1e-5


class _Float64Torch(types.ModuleType):
    """``torch`` as a modeling module sees it inside :func:`float64_inside`: ``torch.float32`` is float64."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> object:
        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@contextlib.contextmanager
def float64_inside(model: torch.nn.Module) -> Iterator[None]:
    """Make the float32 steps of ``model``'s modeling module (``x.to(torch.float32)`` in its RMSNorms, Qwen3-Next's
    delta rule, float32 default arguments) and ``Tensor.float()`` anywhere float64 while a float64 model runs: in
    float32 a row split over ranks and the samples run alone round differently (the matmuls' last float64 bit,
    carried to float32 rounding). Float32 models run as they are."""
    module = sys.modules[type(model).__module__]
    if next(model.parameters()).dtype != torch.float64 or module.torch is not torch:
        yield
        return
    defaults = _float32_defaults(module)
    module.torch, torch.Tensor.float = _Float64Torch(), _to_float64
    for function, values in defaults.items():
        function.__defaults__ = tuple(torch.float64 if value is torch.float32 else value for value in values)
    try:
        yield
    finally:
        module.torch, torch.Tensor.float = torch, _TENSOR_FLOAT
        for function, values in defaults.items():
            function.__defaults__ = values


def _float32_defaults(module: types.ModuleType) -> dict[types.FunctionType, tuple]:
    """The functions and methods of ``module`` with a ``torch.float32`` default argument (RecurrentGemma's RG-LRU
    scan: ``acc_dtype=torch.float32``, bound when the module loaded), and their defaults."""
    functions = [value for value in vars(module).values() if isinstance(value, types.FunctionType)]
    for cls in (value for value in vars(module).values() if isinstance(value, type)):
        functions += [value for value in vars(cls).values() if isinstance(value, types.FunctionType)]
    return {function: function.__defaults__ for function in functions
            if function.__module__ == module.__name__ and torch.float32 in (function.__defaults__ or ())}


_TENSOR_FLOAT = torch.Tensor.float


def _to_float64(tensor: torch.Tensor, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    """``Tensor.float()`` inside :func:`float64_inside` (Mamba's ``A_log.float()``, Mamba2's head's logits)."""
    return tensor.to(torch.float64, memory_format=memory_format)


def _model(case: Case, attn_implementation: str = "packfree") -> torch.nn.Module:
    from transformers import AutoModelForMaskedLM

    from packfree_plugin.loading.register import register
    from packfree_plugin.cli.tiny import auto_class, tiny_config

    register()
    torch.manual_seed(0)
    config = tiny_config(case.model_type, **dict(case.overrides))
    for name, value in config.to_dict().items():  # train mode (for checkpointing) without random dropout
        if "dropout" in name and isinstance(value, float):
            setattr(config, name, 0.0)
    kwargs = dict(attn_implementation=attn_implementation, dtype=case.dtype, experts_implementation="eager")
    cls = AutoModelForMaskedLM if case.model_type in ENCODERS else auto_class(config)
    model = cls.from_config(config, **kwargs).to(case.dtype)  # modules kept in float32 (routers, dt biases) too
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


def targets_of(case: Case, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[T]`` what each token of the packed row predicts: the next label for a causal LM (a sample's last token
    predicts nothing: the next label is the -100 at the next sample's start), the label itself for an encoder."""
    labels = batch["labels"][0]
    if case.model_type in ENCODERS:
        return labels
    return torch.cat([labels[1:], labels.new_full((1,), -100)])


@functools.lru_cache(maxsize=None)
def stock_alone(case: Case) -> tuple[float, dict[str, torch.Tensor]]:
    """The reference: the stock model (eager attention, the packfree model's weights) on every sample of the row
    alone, its token losses summed over the row's target count; the loss and every parameter's gradient."""
    model = _model(case, "eager")
    model.load_state_dict(_model(case).state_dict())
    batch = _batch(case)
    targets = targets_of(case, batch)
    count = (targets != -100).sum()
    total = 0.0
    with float64_inside(model):
        start = 0
        for length in case.lengths:
            mine = slice(start, start + length)
            logits = model(input_ids=batch["input_ids"][:, mine], use_cache=False).logits[0]
            loss = torch.nn.functional.cross_entropy(logits.to(case.dtype), targets[mine], ignore_index=-100,
                                                     reduction="sum") / count
            loss.backward()
            total += loss.item()
            start += length
    return total, _grads(model)


def _plant(case: Case) -> None:
    from packfree_plugin.parallel import batch, head_parallel, ulysses
    from packfree_plugin.parallel import setup as shard

    assert case.plant is None or case.plant in PLANTS, case.plant
    if case.plant == "shard_edges":
        def shard_local(local: torch.Tensor, group) -> torch.Tensor:
            restarted = local.clone()
            restarted[:, 0] = 0  # the shard's first token taken as a sample start
            parts = [torch.empty_like(restarted) for _ in range(case.world)]
            dist.all_gather(parts, restarted, group=group)
            return torch.cat(parts, dim=-1)

        shard._gather_rows = shard_local
    elif case.plant == "groups":
        def first_groups(groups: int, heads_: int, world: int, rank: int, layer: str) -> slice:
            mine = _GROUP_SLICE(groups, heads_, world, rank, layer)
            return slice(0, mine.stop - mine.start)

        head_parallel._group_slice = first_groups
    elif case.plant == "filler":
        batch._filler_positions = lambda position_ids, pad: (
            position_ids[:, -1:] + 1 + torch.arange(pad, dtype=position_ids.dtype).expand(position_ids.shape[0], pad))
    elif case.plant == "sinks":
        ulysses._rank_heads = lambda tensor, heads_, rank: tensor[:heads_]


def _sequence_parallel(case: Case, rank: int) -> Result:
    from packfree_plugin.parallel import prepare_sequence_parallel, register_ulysses, shard_batch, shard_loss

    model = _model(case)
    if case.engine == "torch_cp":
        return _torch_context_parallel(model, case)
    if case.engine == "ulysses":
        register_ulysses(model, case.world)
    else:
        prepare_sequence_parallel(model)
    inputs, targets = shard_batch(_batch(case), rank, case.world, causal=case.model_type not in ENCODERS)
    with float64_inside(model):
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
    mesh = init_device_mesh("cpu", (case.world,))
    with context_parallel(mesh, buffers=[input_ids, position_ids], buffer_seq_dims=[1, 1]):
        logits = model(input_ids=input_ids, position_ids=position_ids).logits
    raise AssertionError(f"a packed row ran inside torch's context_parallel (logits {list(logits.shape)})")


CASE_SECONDS = 240
"""A case's limit on each rank (a few seconds alone, a minute on a loaded 2-core machine): past it the rank prints
every thread's traceback and exits, so a collective one rank skipped fails the test instead of hanging it."""
START_SECONDS = 300
"""The limit for starting a rank (imports, the process group)."""


def start_rank(rank: int, world: int, port: int) -> None:
    """A spawned rank's environment: the launcher's variables, a limit on its start, one thread per rank (the ranks
    share the CI machine's two cores)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    faulthandler.dump_traceback_later(START_SECONDS, exit=True)
    torch.set_num_threads(1)


def run_on_rank(rank: int, runs: list[tuple[str, Callable[[], object]]], out: str) -> NoReturn:
    """Run each ``(name, run)`` on this rank under :data:`CASE_SECONDS`, keeping its result or the ``ValueError`` it
    raised (a refusal: every rank raises it alike); rank 0 saves the results to ``out``. Ends the process group and
    the process."""
    results: dict[str, object] = {}
    try:
        for name, run in runs:
            faulthandler.dump_traceback_later(CASE_SECONDS, exit=True)
            print(f"rank {rank}: {name}", file=sys.stderr, flush=True)  # names the case a traceback is from
            try:
                results[name] = run()
            except ValueError as error:
                results[name] = error
        faulthandler.cancel_dump_traceback_later()
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip the interpreter's teardown, where gloo's threads can abort a finished process


def _run_case(case: Case, rank: int) -> object:
    _plant(case)
    try:
        return _sequence_parallel(case, rank)
    finally:
        _undo_case(case)


def _worker(rank: int, world: int, port: int, cases: list[Case], out: str) -> None:
    start_rank(rank, world, port)
    timeout = timedelta(seconds=COLLECTIVE_SECONDS)  # a collective whose peer went elsewhere raises, not hangs
    if any(case.engine == "ulysses" for case in cases):
        from packfree_plugin.parallel import init_deepspeed

        init_deepspeed("gloo", timeout=timeout)  # without DeepSpeed's CPU start-up build (docs/distributed.md)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    run_on_rank(rank, [(case.name, functools.partial(_run_case, case, rank)) for case in cases], out)


def _undo_case(case: Case) -> None:
    """Undo what a case registered, so the next case starts as a fresh process would."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from packfree_plugin.attention.interface import packfree_attention_forward
    from packfree_plugin.parallel import setup as shard

    from packfree_plugin.parallel import batch, head_parallel, ulysses

    ALL_ATTENTION_FUNCTIONS["packfree"] = packfree_attention_forward  # undo Ulysses' wrapper
    if case.engine == "ulysses":
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp._release_sequence_parallel_groups()  # the next case registers afresh
    shard._gather_rows, head_parallel._group_slice, batch._filler_positions = _GATHER, _GROUP_SLICE, _FILLER
    ulysses._rank_heads = _RANK_HEADS


# restored after a planted case
from packfree_plugin.parallel.batch import _filler_positions as _FILLER  # noqa: E402
from packfree_plugin.parallel.head_parallel import _group_slice as _GROUP_SLICE  # noqa: E402
from packfree_plugin.parallel.setup import _gather_rows as _GATHER  # noqa: E402
from packfree_plugin.parallel.ulysses import _rank_heads as _RANK_HEADS  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_ranks(cases: list[Case], out: str) -> dict[str, object]:
    """Run every case on its ranks (every case of one call on as many); ``{case.name: its Result, or the ValueError
    it raised}``. Raises AssertionError as soon as a rank fails (its traceback is on stderr), ending the others."""
    (world,) = {case.world for case in cases}
    return spawn_ranks(_worker, world, cases, out)


def spawn_ranks(worker: Callable[[int, int, int, list, str], None], world: int, runs: list, out: str) -> dict:
    """Spawn ``worker(rank, world, port, runs, out)`` on ``world`` ranks (a module-level function that ends in
    :func:`run_on_rank`); what rank 0 saved to ``out``. Raises AssertionError as soon as a rank fails (its traceback
    is on stderr), ending the others."""
    context = mp.get_context("spawn")
    port = _free_port()
    processes = [context.Process(target=worker, args=(rank, world, port, runs, out)) for rank in range(world)]
    for process in processes:
        process.start()
    codes = wait_for_ranks(processes, START_SECONDS + CASE_SECONDS * len(runs))  # the ranks' own limits come first
    assert codes == [0] * world, f"ranks exited with {codes} (None: still running; tracebacks on stderr)"
    return torch.load(out, weights_only=False)


SHARED_WORLD = 2
SHARED: dict[str, tuple[Callable[[object, int, dict], object], object]] = {}
"""Runs of one spawn of :data:`SHARED_WORLD` ranks shared by several test modules, by name: ``(run, item)``, where
``run(item, rank, snapshot)`` is a module-level function (``snapshot``: transformers' attention functions as
registered, for its undo). A module adds its runs when it is collected; :func:`shared_results` runs every one not yet
run in one spawn (the imports on each rank cost most of a spawn), so a module run alone spawns for its own runs
only."""
_SHARED_RESULTS: dict[str, object] = {}


def shared_results(names: list[str]) -> dict[str, object]:
    """``{name: its result, or the ValueError it raised}`` for ``names`` (keys of :data:`SHARED`)."""
    pending = [(name, *SHARED[name]) for name in SHARED if name not in _SHARED_RESULTS]
    if any(name not in _SHARED_RESULTS for name in names):
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "results.pt")
            _SHARED_RESULTS.update(spawn_ranks(_shared_worker, SHARED_WORLD, pending, out))
    return {name: _SHARED_RESULTS[name] for name in names}


def _shared_worker(rank: int, world: int, port: int, runs: list[tuple[str, Callable, object]], out: str) -> None:
    """A rank of the shared spawn: packfree registered, DeepSpeed started on gloo, then each ``(name, run, item)``."""
    start_rank(rank, world, port)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from packfree_plugin.loading.register import register
    from packfree_plugin.parallel import init_deepspeed

    register()
    init_deepspeed("gloo", timeout=timedelta(seconds=COLLECTIVE_SECONDS))
    snapshot = dict(ALL_ATTENTION_FUNCTIONS._local_mapping)
    run_on_rank(rank, [(name, functools.partial(run, item, rank, snapshot)) for name, run, item in runs], out)


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
