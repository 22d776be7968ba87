"""Training with the model-parallel head (issue 9), and the warmup's documented first factor."""

from __future__ import annotations

import pytest

from facepipe.config import TrainParams
from facepipe.training.schedule import lr_factor


def test_warmup_starts_at_one_over_the_warmup_steps_as_documented() -> None:
    factors = [lr_factor(step, total_steps=10, warmup_steps=4, decay="cosine") for step in range(5)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0]
    description = TrainParams.model_fields["warmup_epochs"].description
    assert "from 0" not in description and "1/warmup_steps" in description


# --- the sharded head in the trainer: 2 gloo processes, float64, against the dense head -----------

WORLD, CLASSES, BATCH, ACCUM = 2, 7, 3, 2  # 7 classes: shards of 4 and 3


def make_trainer(head_name: str, parallel: str, rank: int):  # type: ignore[no-untyped-def]
    import torch
    from train_helpers import LinearBackbone, tiny_params

    from facepipe.stages.train import build_head
    from facepipe.training.distributed import Distributed
    from facepipe.training.optimizer import build_optimizer
    from facepipe.training.schedule import Plan, build_scheduler
    from facepipe.training.trainer import FaceModel, Trainer

    params = tiny_params(head=head_name, head_parallel=parallel, embedding_size=8, seed=3)
    torch.manual_seed(0)
    model = FaceModel(LinearBackbone(8, 4), build_head(params, num_classes=CLASSES)).double()
    plan = Plan(
        world_size=WORLD, batch_size=BATCH, accum_steps=ACCUM, effective_batch=BATCH * WORLD * ACCUM, lr=0.2,
        epochs=1, steps_per_epoch=10, total_steps=10, warmup_steps=1,
    )
    optimizer = build_optimizer([model], name="sgd", lr=plan.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=1, decay="cosine")
    context = Distributed(rank=rank, local_rank=rank, world_size=WORLD, device=torch.device("cpu"))
    return Trainer(model, optimizer, scheduler, context=context, plan=plan, grad_clip=0.5)


def micro_batches(rank: int, step: int):  # type: ignore[no-untyped-def]
    import torch

    generator = torch.Generator().manual_seed(100 * step + rank)
    return [
        (
            torch.randn(BATCH, 3, 4, 4, dtype=torch.float64, generator=generator),
            torch.randint(0, CLASSES, (BATCH,), generator=generator),
        )
        for _ in range(ACCUM)
    ]


def sharded_vs_dense_worker(rank: int, port: int) -> None:
    import datetime
    import io

    import torch
    import torch.distributed as dist

    from facepipe.heads import ModelParallelMarginHead

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    close = {"rtol": 1e-9, "atol": 1e-12}
    try:
        for name in ("arcface", "cosface", "curricularface"):
            dense, sharded = make_trainer(name, "dense", rank), make_trainer(name, "sharded", rank)
            assert isinstance(sharded.module.head, ModelParallelMarginHead) and not dense.sharded
            # only the backbone is in DDP: the centres (different on each rank) are never all-reduced
            assert sharded.model.module is sharded.module.backbone
            torch.testing.assert_close(sharded.module.head.gather_weight(), dense.module.head.weight, rtol=0, atol=0)
            for step in range(3):
                for trainer in (dense, sharded):
                    trainer.train_step(micro_batches(rank, step))
                a, b = dense.collect_stats(), sharded.collect_stats()
                message = f"{name} step {step} rank {rank}"
                assert a["loss"] == pytest.approx(b["loss"], rel=1e-9) and a["accuracy"] == b["accuracy"], message
            for (key, x), (_, y) in zip(dense.module.backbone.named_parameters(), sharded.module.backbone.named_parameters()):
                torch.testing.assert_close(x, y, **close, msg=f"{name} {key}")
            torch.testing.assert_close(sharded.module.head.gather_weight(), dense.module.head.weight.detach(), **close)
            if name == "curricularface":
                torch.testing.assert_close(sharded.module.head.margin.t, dense.module.head.margin.t, **close)

            # the checkpoint holds the full centres and momentum (gathered), as the dense one does
            saved, dense_saved = sharded.checkpoint_state({}), dense.checkpoint_state({})
            torch.testing.assert_close(saved["head"]["weight"], dense_saved["head"]["weight"], **close)
            moments = [s["momentum_buffer"] for s in saved["optimizer"]["state"].values()]
            dense_moments = [s["momentum_buffer"] for s in dense_saved["optimizer"]["state"].values()]
            assert [m.shape for m in moments] == [m.shape for m in dense_moments]
            for m, n in zip(moments, dense_moments):
                torch.testing.assert_close(m, n, **close)
            # re-sharded on load: a fresh run continues exactly where this one is
            resumed, buffer = make_trainer(name, "sharded", rank), io.BytesIO()
            torch.save(saved, buffer)  # through bytes, as on disk: no tensor shared with the live run
            buffer.seek(0)
            resumed.load_checkpoint_state(torch.load(buffer, weights_only=True))
            for trainer in (sharded, resumed):
                trainer.train_step(micro_batches(rank, 3))
            for x, y in zip(sharded.module.parameters(), resumed.module.parameters()):
                assert torch.equal(x, y), name
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_sharded_head_trains_like_the_dense_head_and_checkpoints_all_centres() -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(sharded_vs_dense_worker, args=(port,), nprocs=WORLD, join=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_sharded_run_equals_the_dense_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`torchrun --nproc-per-node 2 -m facepipe train` with head_parallel sharded vs dense, CurricularFace,
    3 optimizer steps of 2 x 8 x accum 2, gradient clipping: the same losses and backbone (float32)."""
    import csv

    import torch
    from train_helpers import TORCHRUN, load_weights, run_process, synthetic_set, write_params

    shard_set = synthetic_set(tmp_path / "set", identities=5, per_identity=24)
    results = {}
    for parallel in ("dense", "sharded"):
        params = write_params(
            tmp_path / f"{parallel}.yaml", head="curricularface", head_parallel=parallel, accum_steps=2,
            reference_batch=32, scale=8.0, grad_clip=1.0, checkpoint_every=3,
        )
        out = tmp_path / parallel
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "-m", "facepipe", "train", str(shard_set),
               str(out), "--params", str(params), "--max-steps", "3"]
        result = run_process(cmd, timeout=240)
        assert result.returncode == 0, result.stdout[-4000:]
        with open(out / "plots" / "metrics" / "train" / "loss.tsv") as handle:
            losses = [float(row["loss"]) for row in csv.DictReader(handle, delimiter="\t")]
        checkpoint = torch.load(out / "checkpoints" / "step-00000003.pt", weights_only=True)
        results[parallel] = (losses, load_weights(out / "backbone.pt"), checkpoint)
    (dense_losses, dense_backbone, dense_state), (losses, backbone, state) = results["dense"], results["sharded"]
    assert len(losses) == 3
    assert losses == pytest.approx(dense_losses, rel=1e-5)
    for name, value in dense_backbone.items():
        torch.testing.assert_close(backbone[name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert state["head"]["weight"].shape == dense_state["head"]["weight"].shape  # all centres, gathered
    torch.testing.assert_close(state["head"]["weight"], dense_state["head"]["weight"], rtol=1e-4, atol=1e-6)
