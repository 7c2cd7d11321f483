"""The multi-rank tests fail instead of hanging: a rank that fails ends the wait for its peers at once, and a peer
left waiting (in a collective, or anywhere) is ended, never left behind (:func:`tests.helpers.wait_for_ranks`)."""

from __future__ import annotations

import time

import torch.multiprocessing as mp

from tests.helpers import wait_for_ranks


def _rank(rank: int) -> None:
    if rank == 0:
        raise SystemExit(3)  # a rank that failed
    time.sleep(600)  # its peer, waiting for it forever


def test_a_failed_rank_ends_the_wait_and_its_waiting_peer() -> None:
    context = mp.get_context("spawn")
    processes = [context.Process(target=_rank, args=(rank,)) for rank in range(2)]
    for process in processes:
        process.start()
    started = time.monotonic()
    codes = wait_for_ranks(processes, 300)
    assert codes == [3, None] and time.monotonic() - started < 60
    assert not any(process.is_alive() for process in processes)
