"""Two CPU processes under torchrun (gloo): the DDP path end to end, and exact resume after a kill."""

from __future__ import annotations

import csv
import signal
from pathlib import Path

import pytest
import torch
from train_helpers import (
    PROBE,
    PYTHON,
    TORCHRUN,
    load_weights,
    run_process,
    synthetic_set,
    write_params,
)

pytestmark = pytest.mark.multiprocess


def losses(out: Path) -> list[float]:
    with open(out / "plots" / "metrics" / "train" / "loss.tsv") as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle, delimiter="\t")]


def test_two_gloo_processes_stay_in_sync_and_learn(tmp_path):
    shard_set = synthetic_set(tmp_path / "set", identities=4, per_identity=24)
    params = write_params(
        tmp_path / "params.yaml",
        epochs=5,
        batch_size=8,
        accum_steps=2,
        reference_batch=32,
        scale=8.0,
        comm_hook="fp16",
        num_workers=1,
        checkpoint_every=4,
    )
    out, ranks = tmp_path / "model", tmp_path / "ranks"
    cmd = [
        *TORCHRUN,
        "--standalone",
        "--nproc-per-node",
        "2",
        str(PROBE),
        "--dump-params",
        str(ranks),
        "--",
        "train",
        str(shard_set),
        str(out),
        "--params",
        str(params),
    ]
    result = run_process(cmd, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "2 process(es) x batch 8 x accum 2 = 32 per step" in result.stdout
    assert result.stdout.count("trained 15/15 steps") == 1  # only rank 0 reports
    rank0, rank1 = load_weights(ranks / "rank-0.pt"), load_weights(ranks / "rank-1.pt")
    assert rank0.keys() == rank1.keys() and len(rank0) > 10
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    backbone = load_weights(out / "backbone.pt")
    assert all(
        torch.equal(backbone[name], rank0[f"backbone.{name}"]) for name in backbone if f"backbone.{name}" in rank0
    )
    history = losses(out)
    assert len(history) == 15
    assert sum(history[-3:]) < 0.5 * sum(history[:3]), history
    state = torch.load(out / "checkpoints" / "step-00000015.pt", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng"]) == 2
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])  # ranks draw differently


@pytest.mark.slow
def test_killed_and_resumed_run_equals_a_straight_run(tmp_path):
    """12 steps straight vs. killed (SIGKILL) right after the step-5 checkpoint, then resumed to 12."""
    shard_set = synthetic_set(tmp_path / "set", identities=4, per_identity=12)
    params = write_params(tmp_path / "params.yaml", epochs=2, checkpoint_every=5, num_workers=2)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train = ["train", str(shard_set)]

    result = run_process([PYTHON, "-m", "facepipe", *train, str(straight), "--params", str(params)], timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]

    killed = [PYTHON, str(PROBE), "--kill-after-checkpoint", "5", "--", *train, str(resumed), "--params", str(params)]
    result = run_process(killed, timeout=180)
    assert result.returncode == -signal.SIGKILL, result.stdout[-4000:]
    assert not (resumed / "backbone.pt").exists()
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-00000005.pt"]

    result = run_process([PYTHON, "-m", "facepipe", *train, str(resumed), "--params", str(params)], timeout=180)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "resuming from" in result.stdout and "step 5, epoch 0" in result.stdout

    a, b = load_weights(straight / "backbone.pt"), load_weights(resumed / "backbone.pt")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    final_a = torch.load(straight / "checkpoints" / "step-00000012.pt", weights_only=True)
    final_b = torch.load(resumed / "checkpoints" / "step-00000012.pt", weights_only=True)
    assert torch.equal(final_a["head"]["weight"], final_b["head"]["weight"])
    for group_a, group_b in zip(final_a["optimizer"]["state"].values(), final_b["optimizer"]["state"].values()):
        assert torch.equal(group_a["momentum_buffer"], group_b["momentum_buffer"])
    assert losses(straight)[5:] == losses(resumed)[5:]  # the history was trimmed and continued


def test_freeze_epochs_on_two_processes_keep_the_backbone_and_the_heads_in_step(tmp_path):
    """While the backbone is frozen the trainer bypasses DDP, so it averages the dense head's gradients
    itself: both ranks end with the same head, and the frozen epoch leaves the init weights as they were."""
    from facepipe.models import create_backbone

    shard_set = synthetic_set(tmp_path / "set", identities=4, per_identity=16)
    torch.manual_seed(5)
    start = tmp_path / "start.pth"
    torch.save(create_backbone("mobilefacenet", embedding_size=16, image_size=16).state_dict(), start)
    params = write_params(
        tmp_path / "params.yaml", epochs=2, freeze_epochs=1, batch_size=4, reference_batch=8, init_from=str(start)
    )
    out, ranks = tmp_path / "model", tmp_path / "ranks"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(PROBE), "--dump-params", str(ranks), "--",
           "train", str(shard_set), str(out), "--params", str(params)]
    result = run_process(cmd, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    rank0, rank1 = load_weights(ranks / "rank-0.pt"), load_weights(ranks / "rank-1.pt")
    assert torch.equal(rank0["head.weight"], rank1["head.weight"])
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    frozen = torch.load(out / "checkpoints" / "step-00000008.pt", weights_only=True)  # 64 samples / 8 a step
    assert frozen["epoch"] == 1
    initial = torch.load(start, weights_only=True)
    assert all(torch.equal(frozen["backbone"][key], initial[key]) for key in initial)


def test_freeze_epochs_with_the_sharded_head_keep_both_ranks_backbones_while_the_shards_train(tmp_path):
    """Partial FC (head_parallel sharded, sample_rate 0.5) on 2 processes: in the frozen epoch the backbone
    bypasses DDP and autograd and its BatchNorm runs in eval mode, so on both ranks its weights, running
    statistics and batch counts stay bit-identical to the init file while each rank's own shard of
    centres trains; after it the backbone trains, and the ranks' backbones stay equal."""
    from facepipe.heads import create_head
    from facepipe.models import create_backbone

    shard_set = synthetic_set(tmp_path / "set", identities=4, per_identity=16)  # 4 classes: 2 per rank
    torch.manual_seed(5)
    backbone = create_backbone("mobilefacenet", embedding_size=16, image_size=16)
    generator = torch.Generator().manual_seed(6)
    for norm in backbone.modules():  # statistics away from (0, 1): a frozen forward depends on them
        if isinstance(norm, torch.nn.modules.batchnorm._BatchNorm):
            norm.running_mean.copy_(torch.randn(norm.running_mean.shape, generator=generator) * 0.1)
            norm.running_var.copy_(torch.rand(norm.running_var.shape, generator=generator) + 0.5)
            norm.num_batches_tracked.fill_(7)
    start = tmp_path / "start.pth"
    torch.save(backbone.state_dict(), start)
    params = write_params(
        tmp_path / "params.yaml", epochs=2, freeze_epochs=1, batch_size=4, reference_batch=8, init_from=str(start),
        head_parallel="sharded", sample_rate=0.5, seed=11,
    )
    out = tmp_path / "model"

    def train(ranks: Path, *limit: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(PROBE), "--dump-params", str(ranks),
               "--with-buffers", "--", "train", str(shard_set), str(out), "--params", str(params), *limit]
        result = run_process(cmd, timeout=240)
        assert result.returncode == 0, result.stdout[-4000:]
        return load_weights(ranks / "rank-0.pt"), load_weights(ranks / "rank-1.pt")

    initial = torch.load(start, weights_only=True)
    centres = create_head("cosface", embedding_size=16, num_classes=4, seed=11).weight.detach()
    # the frozen epoch: 64 samples / (2 x 4) = 8 steps, then stop
    rank0, rank1 = train(tmp_path / "frozen", "--max-steps", "8")
    frozen = torch.load(out / "checkpoints" / "step-00000008.pt", weights_only=True)
    assert frozen["epoch"] == 1 and frozen["world_size"] == 2
    for rank, state in enumerate((rank0, rank1)):
        backbone_keys = sorted(key.removeprefix("backbone.") for key in state if key.startswith("backbone."))
        assert backbone_keys == sorted(initial), rank
        changed = [key for key in initial if not torch.equal(state[f"backbone.{key}"], initial[key])]
        assert changed == [], (rank, changed)  # weights, running means and variances, batch counts
        shard = centres[2 * rank : 2 * rank + 2]
        assert state["head.weight"].shape == shard.shape and not torch.equal(state["head.weight"], shard), rank
    # the checkpoint gathers both shards, in class order
    assert torch.equal(frozen["head"]["weight"], torch.cat([rank0["head.weight"], rank1["head.weight"]]))
    assert all(torch.equal(frozen["backbone"][key], initial[key]) for key in initial)

    # resumed to the end: the second epoch trains the backbone, the same on both ranks
    rank0, rank1 = train(tmp_path / "trained")
    assert torch.load(out / "checkpoints" / "step-00000016.pt", weights_only=True)["epoch"] == 2
    backbone_keys = [key for key in rank0 if key.startswith("backbone.")]
    moved = [key for key in backbone_keys if not torch.equal(rank0[key], initial[key.removeprefix("backbone.")])]
    assert any(key.endswith("running_mean") for key in moved) and any(key.endswith(".weight") for key in moved)
    assert [key for key in backbone_keys if not torch.equal(rank0[key], rank1[key])] == []
    assert not torch.equal(rank0["head.weight"], rank1["head.weight"])  # each rank its own classes
