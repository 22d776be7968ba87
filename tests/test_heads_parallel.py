"""Margin heads across processes and accumulation steps (issue 9): seeded class centres that do not
depend on the world size, and CurricularFace's statistic under gradient accumulation."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from facepipe.heads import create_head, create_model_parallel_head

CLASSES, EMBEDDING = 2500, 6  # more than two blocks of centres, an uneven split for 2 and 3 ranks


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def centres_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.manual_seed(100 + rank)  # the global generator must not matter, and differs per rank here
        head = create_model_parallel_head("arcface", embedding_size=EMBEDDING, num_classes=CLASSES, seed=7)
        full = head.gather_weight()
        if rank == 0:
            torch.save(full, f"{out}/centres-{world}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_sharded_centres_are_the_dense_centres_whatever_the_world_size(tmp_path: Path) -> None:
    torch.manual_seed(123)
    dense = create_head("arcface", embedding_size=EMBEDDING, num_classes=CLASSES, seed=7).weight.detach()
    for world in (1, 2, 3):
        mp.spawn(centres_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
        sharded = torch.load(tmp_path / f"centres-{world}.pt", weights_only=True)
        assert torch.equal(sharded, dense), f"{world} processes"
    # every class its own centre (the defect: with 2 ranks, classes i and i + C/2 started equal)
    assert torch.unique(dense, dim=0).shape[0] == CLASSES
    assert not torch.equal(create_head("arcface", embedding_size=EMBEDDING, num_classes=CLASSES, seed=8).weight, dense)


def test_centres_of_any_class_range_are_rows_of_the_full_set() -> None:
    from facepipe.heads.centres import BLOCK, init_centres

    full = init_centres(0, 3 * BLOCK + 5, embedding_size=3, seed=-2)
    for start, count in [(0, 1), (5, BLOCK), (BLOCK - 1, 2), (2 * BLOCK, BLOCK + 5), (17, 0)]:
        part = init_centres(start, count, embedding_size=3, seed=-2)
        assert torch.equal(part, full[start : start + count]), (start, count)
    assert abs(full.std().item() - 0.01) < 5e-4
