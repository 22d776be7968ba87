"""Partial FC through the real train stage: ``train.run`` in 2 gloo processes at ``sample_rate`` < 1."""

from __future__ import annotations

import pytest

WORLD, IDENTITIES, RATE = 2, 40, 0.1  # 20 classes per rank: 2 drawn + the global batch's positives


def stage_worker(rank: int, port: int, shard_set: str, out: str, queue) -> None:  # type: ignore[no-untyped-def]
    """One rank of ``facepipe train`` (the stage's ``run``), one optimizer step; reports what moved."""
    import os

    import torch
    from train_helpers import tiny_params

    from facepipe.stages import train

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    built = {}

    def recording_factory(params, *, num_classes, image_size):  # type: ignore[no-untyped-def]
        model = train.build_model(params, num_classes=num_classes, image_size=image_size)
        built["model"], built["initial"] = model, model.head.weight.detach().clone()
        return model

    # no weight decay: SGD's first step moves a centre only by its gradient (momentum starts at it)
    params = tiny_params(
        head_parallel="sharded", sample_rate=RATE, batch_size=4, reference_batch=8, weight_decay=0.0,
        checkpoint_every=1,
    )
    report = train.run(params, shard_set, out, max_steps=1, model_factory=recording_factory)
    head = built["model"].head
    moved = (head.weight.detach() != built["initial"]).any(dim=1)
    queue.put(
        {
            "rank": rank,
            "steps": report.steps,
            "num_local": head.num_local,
            "sampled": sorted(head.last_index.tolist()),  # the one forward of the one step (accum 1)
            "moved": sorted(torch.nonzero(moved).flatten().tolist()),
        }
    )


@pytest.mark.multiprocess
def test_the_train_stage_updates_only_the_sampled_centres(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import socket

    import torch.multiprocessing as mp
    from train_helpers import synthetic_set

    shard_set = synthetic_set(tmp_path / "set", identities=IDENTITIES, per_identity=2, shard=40)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(stage_worker, args=(port, str(shard_set), str(tmp_path / "model"), queue), nprocs=WORLD, join=True)
    results = sorted((queue.get() for _ in range(WORLD)), key=lambda r: r["rank"])
    for result in results:
        assert result["steps"] == 1 and result["num_local"] == IDENTITIES // WORLD
        # a sample, not every class: 2 drawn + at most the 8 positives of the global batch
        assert 2 <= len(result["sampled"]) <= 10 < result["num_local"]
        assert result["moved"], result  # the step trained this rank's sampled centres ...
        assert set(result["moved"]) <= set(result["sampled"]), result  # ... and left the others exactly as they were
    assert (tmp_path / "model" / "backbone.pt").exists()
