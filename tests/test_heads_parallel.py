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


# --- CurricularFace's statistic under gradient accumulation ---------------------------------------


def linear_trainer(head_name: str, *, accum: int, batch: int, lr: float = 0.1):  # type: ignore[no-untyped-def]
    """A float64 trainer of a BN-free linear backbone (4x4 images -> 8-d) and a real head of 5 classes."""
    from train_helpers import LinearBackbone

    from facepipe.training.distributed import Distributed
    from facepipe.training.optimizer import build_optimizer
    from facepipe.training.schedule import Plan, build_scheduler
    from facepipe.training.trainer import FaceModel, Trainer

    torch.manual_seed(0)
    head = create_head(head_name, embedding_size=8, num_classes=5, scale=16.0)
    model = FaceModel(LinearBackbone(8, 4), head).double()
    plan = Plan(
        world_size=1, batch_size=batch, accum_steps=accum, effective_batch=batch * accum, lr=lr, epochs=1,
        steps_per_epoch=10, total_steps=10, warmup_steps=2,
    )
    optimizer = build_optimizer([model], name="sgd", lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=2, decay="cosine")
    cpu = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    return Trainer(model, optimizer, scheduler, context=cpu, plan=plan, grad_clip=0.5)


def step_data(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(12, 3, 4, 4, generator=generator, dtype=torch.float64), torch.randint(0, 5, (12,), generator=generator))
        for _ in range(steps)
    ]


def train_both(head_name: str, *, lr: float = 0.1) -> tuple:  # type: ignore[type-arg]
    """The same 3 optimizer steps as 3 micro-batches of 4 and as one batch of 12; t after each step."""
    accumulated = linear_trainer(head_name, accum=3, batch=4, lr=lr)
    whole = linear_trainer(head_name, accum=1, batch=12, lr=lr)
    history: list[tuple[float, float]] = []
    for images, labels in step_data():
        accumulated.train_step([(images[i : i + 4], labels[i : i + 4]) for i in (0, 4, 8)])
        whole.train_step([(images, labels)])
        if head_name == "curricularface":
            history.append((accumulated.module.head.margin.t.item(), whole.module.head.margin.t.item()))
    return accumulated, whole, history


def test_curricular_t_moves_once_per_optimizer_step_whatever_the_accumulation() -> None:
    # lr 0: the same cosines every step, so t's trajectory alone is compared, exactly
    _, _, history = train_both("curricularface", lr=0.0)
    accumulated, whole = zip(*history)
    assert whole[0] != 0.0 and len(set(whole)) == 3
    torch.testing.assert_close(torch.tensor(accumulated), torch.tensor(whole), rtol=1e-12, atol=0)
    # training: the first step's t is the same; later ones differ only through the weights, which
    # differ because the micro-batches of a step use the previous step's t (measured 7.7e-7 after 3
    # steps; t moving per micro-batch made it 8.9e-4)
    _, _, history = train_both("curricularface")
    accumulated, whole = zip(*history)
    assert accumulated[0] == pytest.approx(whole[0], rel=1e-12)
    torch.testing.assert_close(torch.tensor(accumulated), torch.tensor(whole), rtol=0, atol=1e-5)


@pytest.mark.parametrize("head_name", ["arcface", "cosface", "curricularface"])
def test_with_t_frozen_accumulation_equals_one_big_batch(head_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from facepipe.heads.margins import CurricularFaceMargin

    # momentum 0 freezes t where it is put: the step then has no statistic that depends on the split
    monkeypatch.setattr(CurricularFaceMargin, "momentum", 0.0)
    monkeypatch.setattr(CurricularFaceMargin, "__init__", _init_with_t(CurricularFaceMargin.__init__))
    accumulated, whole, history = train_both(head_name)
    for (name, a), (_, b) in zip(accumulated.module.named_parameters(), whole.module.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    assert all(a == b == pytest.approx(0.3) for a, b in history)


def _init_with_t(original):  # type: ignore[no-untyped-def]
    def init(self, margin=None):  # type: ignore[no-untyped-def]
        original(self, margin)
        self.t.fill_(0.3)  # a t that makes hard negatives count (0 would hide the modulation)

    return init
