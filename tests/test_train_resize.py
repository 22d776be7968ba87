"""Resuming at another number of processes (issue 9): 2 -> 1, 1 -> 2 and 2 -> 3, with the sharded head.

A checkpoint holds every class centre and its momentum in class order; a run at another world size
re-shards them, restarts the sampler at the samples consumed and continues. With the same effective
batch (12 samples per optimizer step, laid out as 1 x 6 x accum 2, 2 x 3 x accum 2, 3 x 2 x accum 2)
every optimizer step sees the same 12 samples at every size, so the resumed run continues the loss
curve of an uninterrupted run at the new size. Not bit for bit: the global-batch sums (the DDP
all-reduce of the backbone gradient, the sharded softmax's all-reduced sums, the gradient norm for
clipping) add the same terms in another order at another size, so float64 results agree to a few
ulps (measured: <= 1e-15 relative after 8 steps); the tests allow 1e-9. At the same size resuming is
bit-exact (tests/test_train_sharded.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from facepipe.data.batch_order import ShardOrderSampler

CLASSES, EMBEDDING, IMAGE, ITEMS, SHARD = 7, 8, 4, 72, 12  # 7 classes: shards of 4+3 and 3+2+2
GLOBAL = 12  # samples per optimizer step at every size: 6 steps per epoch
LAYOUT = {1: (6, 2), 2: (3, 2), 3: (2, 2)}  # world size -> (batch per process, accum_steps)
SAVE_AT, STOP = 4, 8  # checkpoint mid-epoch 0; the resumed part crosses into epoch 1
CLOSE = {"rtol": 1e-9, "atol": 1e-12}


class Faces(torch.utils.data.Dataset):
    """Fixed random float64 images [3, 4, 4] and labels in [0, 7), indexed like FaceDataset by (item, seed)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(11)
        self.images = torch.randn(ITEMS, 3, IMAGE, IMAGE, dtype=torch.float64, generator=generator)
        self.labels = torch.randint(0, CLASSES, (ITEMS,), generator=generator)

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        item, _ = key
        return self.images[item], self.labels[item]


class Recorder:
    """Stands in for TrainMetrics: keeps (step, loss) of every metric point."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def log(self, step: int, values: dict[str, float]) -> None:
        if "loss" in values:
            self.losses[step] = values["loss"]


def train(world: int, rank: int, *, out: Path, resume_from: Path | None) -> dict:  # type: ignore[type-arg]
    """Train to STOP steps at ``world`` processes (checkpoints every SAVE_AT into ``out``), optionally
    from a checkpoint; returns the losses per step and the full model (gathered centres) on every rank."""
    from train_helpers import LinearBackbone, tiny_params

    from facepipe.stages.train import build_head
    from facepipe.training.checkpoint import load_checkpoint
    from facepipe.training.distributed import Distributed
    from facepipe.training.optimizer import build_optimizer
    from facepipe.training.schedule import Plan, build_scheduler
    from facepipe.training.trainer import FaceModel, LoopOptions, Trainer

    batch, accum = LAYOUT[world]
    params = tiny_params(head="curricularface", head_parallel="sharded", embedding_size=EMBEDDING, seed=3)
    torch.manual_seed(0)
    model = FaceModel(LinearBackbone(EMBEDDING, IMAGE), build_head(params, num_classes=CLASSES)).double()
    plan = Plan(
        world_size=world, batch_size=batch, accum_steps=accum, effective_batch=GLOBAL, lr=0.2,
        epochs=2, steps_per_epoch=ITEMS // GLOBAL, total_steps=2 * ITEMS // GLOBAL, warmup_steps=1,
    )
    optimizer = build_optimizer([model], name="sgd", lr=plan.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = build_scheduler(optimizer, total_steps=plan.total_steps, warmup_steps=1, decay="cosine")
    context = Distributed(rank=rank, local_rank=rank, world_size=world, device=torch.device("cpu"))
    trainer = Trainer(model, optimizer, scheduler, context=context, plan=plan, grad_clip=0.5)
    if resume_from is not None:
        trainer.load_checkpoint_state(load_checkpoint(resume_from), source=str(resume_from))
        assert (trainer.state.step, trainer.state.epoch, trainer.state.epoch_samples) == (SAVE_AT, 0, SAVE_AT * GLOBAL)
    sampler = ShardOrderSampler(
        np.arange(ITEMS) // SHARD, batch_size=batch, rank=rank, world_size=world, accum_steps=accum,
        buffer_size=8, seed=5,
    )
    loader = torch.utils.data.DataLoader(Faces(), batch_sampler=sampler, num_workers=0)
    recorder = Recorder()
    options = LoopOptions(out=out, checkpoint_every=SAVE_AT, keep_checkpoints=10, log_every=1, max_steps=STOP)
    trainer.fit(loader, sampler, options=options, metrics=recorder)  # type: ignore[arg-type]
    head = trainer.module.head
    centres = head.gather_weight() if trainer.sharded else head.weight.detach().clone()
    return {
        "sharded": trainer.sharded,
        "losses": recorder.losses,
        "backbone": {k: v.clone() for k, v in trainer.module.backbone.state_dict().items()},
        "centres": centres,
        "t": head.margin.t.clone(),
    }


def worker(rank: int, world: int, port: int, root: str, resume_from: str) -> None:
    """One rank of ``world``: the uninterrupted run at this size, then the run resumed from ``resume_from``."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        base = Path(root)
        whole = train(world, rank, out=base / f"w{world}", resume_from=None)
        resumed = train(world, rank, out=base / f"w{world}-resumed", resume_from=Path(resume_from))
        if rank == 0:
            torch.save({"whole": whole, "resumed": resumed}, base / f"results-w{world}.pt")
    finally:
        dist.destroy_process_group()


def spawn(world: int, root: Path, resume_from: Path) -> dict:  # type: ignore[type-arg]
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(worker, args=(world, port, str(root), str(resume_from)), nprocs=world, join=True)
    return torch.load(root / f"results-w{world}.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:  # type: ignore[type-arg]
    """Uninterrupted runs at 1, 2 and 3 processes, and runs resumed 1 -> 2, 2 -> 1 and 2 -> 3 from step 4."""
    root = tmp_path_factory.mktemp("resize")
    checkpoint = f"step-{SAVE_AT:08d}.pt"
    results = {"1": train(1, 0, out=root / "w1", resume_from=None)}  # one process: no process group
    two = spawn(2, root, resume_from=root / "w1" / checkpoint)
    results.update({"2": two["whole"], "1->2": two["resumed"]})
    results["2->1"] = train(1, 0, out=root / "w1-resumed", resume_from=root / "w2" / checkpoint)
    three = spawn(3, root, resume_from=root / "w2" / checkpoint)
    results.update({"3": three["whole"], "2->3": three["resumed"]})
    return results


def assert_continues(resumed: dict, whole: dict) -> None:  # type: ignore[type-arg]
    assert sorted(resumed["losses"]) == list(range(SAVE_AT + 1, STOP + 1))  # steps 5..8 only
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(whole["losses"][step], rel=1e-9), step
    for name, value in whole["backbone"].items():
        torch.testing.assert_close(resumed["backbone"][name], value, **CLOSE, msg=name)
    torch.testing.assert_close(resumed["centres"], whole["centres"], **CLOSE)
    torch.testing.assert_close(resumed["t"], whole["t"], **CLOSE)


@pytest.mark.multiprocess
def test_the_sizes_agree_uninterrupted(runs) -> None:  # type: ignore[no-untyped-def]
    """The premise: at one effective batch, 1, 2 and 3 processes train the same model (float rounding)."""
    assert not runs["1"]["sharded"] and runs["2"]["sharded"] and runs["3"]["sharded"]
    assert sorted(runs["1"]["losses"]) == list(range(1, STOP + 1))
    for world in ("2", "3"):
        later = {step: runs[world]["losses"][step] for step in range(SAVE_AT + 1, STOP + 1)}
        assert_continues({**runs[world], "losses": later}, runs["1"])


@pytest.mark.multiprocess
def test_resume_two_processes_with_one(runs) -> None:  # type: ignore[no-untyped-def]
    """Sharded (2 ranks) -> dense (1 process): the gathered centres and momentum go into the dense head."""
    assert_continues(runs["2->1"], runs["1"])


@pytest.mark.multiprocess
def test_resume_one_process_with_two(runs) -> None:  # type: ignore[no-untyped-def]
    """Dense -> sharded over 2 ranks: each takes its rows of the centres and of their momentum."""
    assert_continues(runs["1->2"], runs["2"])


@pytest.mark.multiprocess
def test_resume_two_processes_with_three(runs) -> None:  # type: ignore[no-untyped-def]
    """Shards of 4 + 3 classes -> 3 + 2 + 2: re-sharded rows, sampler restarted at sample 48."""
    assert_continues(runs["2->3"], runs["3"])


def test_resumed_sampler_continues_the_stream_at_another_global_batch() -> None:
    """2 processes x 3 for 5 steps (30 samples), then 3 processes x 3 from sample 30: the epoch's
    stream is consumed in order, nothing skipped or repeated, only in larger steps.

    (With another effective batch the step counter restarts at ``samples // new effective batch``,
    here 30 // 9 = 3, and the peak rate is rescaled: the curve is that run's, not the old one's.)
    """
    from facepipe.data.batch_order import shuffled_stream

    shards = np.arange(ITEMS) // SHARD
    stream = shuffled_stream(shards, epoch=0, seed=5, buffer_size=8).tolist()

    def taken(world: int, start: int, steps: int | None) -> list[int]:
        samplers = [
            ShardOrderSampler(shards, batch_size=3, rank=r, world_size=world, seed=5, buffer_size=8) for r in range(world)
        ]
        for sampler in samplers:
            sampler.set_epoch(0, start_sample=start)
        batches = [list(sampler)[:steps] for sampler in samplers]
        # a step's global batch in stream order: position k of the step is rank k mod W's (k // W)-th item
        return [batches[k % world][step][k // world][0] for step in range(len(batches[0])) for k in range(3 * world)]

    before, after = taken(2, 0, 5), taken(3, 30, None)
    assert len(after) == (ITEMS - 30) // 9 * 9
    assert before + after == stream[: 30 + len(after)]


# --- the train stage: `facepipe train` run by 2 processes, resumed by 1 with accum_steps 2 ---------------


def stage_worker(rank: int, port: int, shard_set: str, out: str, overrides: dict) -> None:  # type: ignore[type-arg]
    """One rank of a 2-process `run()`, the environment set as torchrun would."""
    import os

    from train_helpers import linear_model, tiny_params

    from facepipe.stages.train import run

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    run(tiny_params(**overrides), shard_set, out, max_steps=3, model_factory=linear_model)


def stage_losses(out: Path) -> dict[int, float]:
    import csv

    with open(out / "plots" / "metrics" / "train" / "loss.tsv") as handle:
        return {int(row["step"]): float(row["loss"]) for row in csv.DictReader(handle, delimiter="\t")}


@pytest.mark.multiprocess
def test_train_stage_resumes_a_sharded_two_process_run_in_one_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """2 processes x batch 4, sharded head, stopped at step 3 -> 1 process x batch 8 (the same 8 samples
    per step, so `head_parallel` and `batch_size` may change): the run finishes like an uninterrupted
    1-process run (float32: summation order, 1e-5), and no backbone.pt holds the head. CurricularFace
    may not go from accum_steps 1 to 2 (its t moves before use at 1, after the step above 1)."""
    import socket

    import torch.multiprocessing as mp
    from train_helpers import LinearBackbone, linear_model, load_weights, synthetic_set, tiny_params

    from facepipe.errors import FacepipeError
    from facepipe.stages.train import run

    shard_set = synthetic_set(tmp_path / "set", identities=5, per_identity=12)  # 60 samples: 7 steps of 8
    common = {"head": "curricularface", "scale": 8.0, "checkpoint_every": 3, "reference_batch": 8, "epochs": 1}
    out, whole = tmp_path / "resized", tmp_path / "whole"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    two = {**common, "head_parallel": "sharded", "batch_size": 4}
    mp.spawn(stage_worker, args=(port, str(shard_set), str(out), two), nprocs=2, join=True)
    head_keys = set(LinearBackbone(16, 16).state_dict())
    assert set(load_weights(out / "backbone.pt")) == head_keys  # the sharded run's export: backbone only

    with pytest.raises(FacepipeError, match=r"other train params \(accum_steps;"):
        run(tiny_params(**common, batch_size=4, accum_steps=2), shard_set, out, model_factory=linear_model)
    one = tiny_params(**common, head_parallel="dense", batch_size=8)
    report = run(one, shard_set, out, model_factory=linear_model)
    assert (report.resumed_from_step, report.steps, report.world_size) == (3, 7, 1)
    run(one, shard_set, whole, model_factory=linear_model)
    resumed, reference = stage_losses(out), stage_losses(whole)
    assert sorted(resumed) == sorted(reference) == list(range(1, 8))
    assert resumed == pytest.approx(reference, rel=1e-5)
    weights = load_weights(out / "backbone.pt")
    assert set(weights) == head_keys
    for name, value in load_weights(whole / "backbone.pt").items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=name)
