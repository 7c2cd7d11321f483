"""Data-parallel training on packed rows: DDP and FSDP2 (``fully_shard``), gloo, 2 ranks on the CPU, each rank
its own packed row. The averaged gradients must equal one process computing both rows' mean loss."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.helpers import COLLECTIVE_SECONDS, fresh_pair, samples_of, wait_for_ranks

ROWS = [[5, 9, 3], [7, 4, 6, 2]]  # sample lengths of rank 0's and rank 1's packed row
RUN_SECONDS = 300
"""The limit for a run: importing transformers and one step on each rank (under a minute on a loaded 2-core machine)."""


def _batch(rank: int) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": s} for s in samples_of(ROWS[rank], seed=rank)]
    return dict(DataCollatorWithFlattening()(features))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _worker(rank: int, port: int, wrapper: str, model_type: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks share the CI machine's two cores
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=COLLECTIVE_SECONDS))
    try:
        torch.manual_seed(0)
        model, _ = fresh_pair(model_type)
        model.train()
        if wrapper == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.model.layers:
                fully_shard(layer)
            wrapped = fully_shard(model)
        wrapped(**_batch(rank)).loss.backward()
        if wrapper == "fsdp2":
            grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters() if p.grad is not None}
        else:
            grads = _grads(model)
        if rank == 0:
            torch.save(grads, out)
        dist.barrier()  # neither rank tears the group down while the other still talks to it
    finally:
        dist.destroy_process_group()
    # the work is done and saved: skip the interpreter's teardown, where gloo's threads can abort the process
    # ("terminate called without an active exception", seen once on transformers 5.20) after a good run
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
@pytest.mark.parametrize("model_type", ["qwen3_next"])  # GDN and attention layers in one model
def test_data_parallel_gradients_equal_one_process(wrapper: str, model_type: str, tmp_path) -> None:
    context = mp.get_context("spawn")
    out, port = str(tmp_path / "grads.pt"), _free_port()
    processes = [context.Process(target=_worker, args=(rank, port, wrapper, model_type, out)) for rank in range(2)]
    for process in processes:
        process.start()
    codes = wait_for_ranks(processes, RUN_SECONDS)  # a failed rank ends the wait, and its peer, at once
    assert codes == [0, 0], f"ranks exited with {codes} (None: still running after {RUN_SECONDS} s)"
    distributed = torch.load(out)
    torch.manual_seed(0)
    model, _ = fresh_pair(model_type)
    model.train()
    loss = (model(**_batch(0)).loss + model(**_batch(1)).loss) / 2  # DDP and FSDP average over ranks
    loss.backward()
    expected = _grads(model)
    assert distributed.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(distributed[name], grad, atol=1e-10, rtol=1e-7, msg=name)
