"""The training loop in one process: accumulation, DDP sync points, checkpoints, the stage and its CLI."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from train_helpers import (
    LinearBackbone,
    linear_model,
    load_weights,
    synthetic_set,
    tiny_params,
    write_params,
)

import facepipe.training.trainer as trainer_module
from facepipe.cli import main
from facepipe.config import load_section
from facepipe.errors import FacepipeError
from facepipe.heads import create_head
from facepipe.io.model_dir import load_backbone, read_model_spec
from facepipe.stages.train import build_model, run
from facepipe.training.checkpoint import (
    atomic_save,
    capture_rng_state,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
    state_checksum,
)
from facepipe.training.distributed import Distributed
from facepipe.training.optimizer import build_optimizer
from facepipe.training.schedule import Plan, build_scheduler
from facepipe.training.trainer import FaceModel, Trainer

CPU = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 identities x 12 samples of 16x16 in 3 shards: 6 steps of 8 per epoch."""
    return synthetic_set(tmp_path_factory.mktemp("train_loop") / "set")


@pytest.fixture(scope="module")
def finished_run(shard_set: Path, tmp_path_factory: pytest.TempPathFactory):
    """A complete 2-epoch run of the real tiny backbone, started from a git repository (dvclive must
    leave it alone)."""
    repo = tmp_path_factory.mktemp("repo")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    params = tiny_params(epochs=2, checkpoint_every=4, keep_checkpoints=3)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(repo)
        report = run(params, shard_set, repo / "model")
    return repo, report, params


def tiny_trainer(model: FaceModel, *, accum: int, batch: int, grad_clip: float | None = None) -> Trainer:
    plan = Plan(
        world_size=1,
        batch_size=batch,
        accum_steps=accum,
        effective_batch=batch * accum,
        lr=0.1,
        epochs=1,
        steps_per_epoch=10,
        total_steps=10,
        warmup_steps=2,
    )
    optimizer = build_optimizer([model], name="sgd", lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler = build_scheduler(optimizer, total_steps=10, warmup_steps=2, decay="cosine")
    return Trainer(model, optimizer, scheduler, context=CPU, plan=plan, grad_clip=grad_clip)


def linear_face_model(seed: int = 0) -> FaceModel:
    torch.manual_seed(seed)
    head = create_head("arcface", embedding_size=8, num_classes=5, scale=16.0)
    return FaceModel(LinearBackbone(8, 4), head).double()


# -- one optimizer step -------------------------------------------------------------------------------


@pytest.mark.parametrize("grad_clip", [None, 0.5])
def test_accumulating_k_batches_of_b_equals_one_batch_of_k_times_b(grad_clip):
    generator = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(12, 3, 4, 4, generator=generator, dtype=torch.float64),
            torch.randint(0, 5, (12,), generator=generator),
        )
        for _ in range(3)
    ]
    accumulated = tiny_trainer(linear_face_model(), accum=3, batch=4, grad_clip=grad_clip)
    whole = tiny_trainer(linear_face_model(), accum=1, batch=12, grad_clip=grad_clip)
    for images, labels in data:
        accumulated.train_step([(images[i : i + 4], labels[i : i + 4]) for i in (0, 4, 8)])
        whole.train_step([(images, labels)])
    for (name, a), (_, b) in zip(accumulated.module.named_parameters(), whole.module.named_parameters()):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name
    assert accumulated.state.step == whole.state.step == 3
    assert accumulated.scheduler.last_epoch == whole.scheduler.last_epoch == 3
    assert accumulated.state.epoch_samples == whole.state.epoch_samples == 36


@pytest.fixture
def single_rank_group(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_gradients_are_all_reduced_once_per_optimizer_step(single_rank_group):
    def all_reduces(accum: int) -> int:
        trainer = tiny_trainer(linear_face_model(), accum=accum, batch=2)
        ddp = DistributedDataParallel(trainer.module)
        calls = []

        def counting_hook(state, bucket):
            calls.append(bucket.index())
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, counting_hook)
        trainer.model = ddp
        images = torch.randn(2, 3, 4, 4, dtype=torch.float64)
        labels = torch.tensor([0, 1])
        trainer.train_step([(images, labels)] * accum)
        return len(calls)

    assert all_reduces(3) == all_reduces(1) >= 1


def test_fp16_is_refused_on_cpu_and_bf16_trains():
    with pytest.raises(FacepipeError, match="fp16 needs a CUDA device"):
        trainer_module.check_precision("fp16", torch.device("cpu"))
    torch.manual_seed(0)
    model = FaceModel(LinearBackbone(8, 4), create_head("cosface", embedding_size=8, num_classes=5, scale=16.0))
    trainer = tiny_trainer(model, accum=1, batch=4)
    trainer.amp_dtype = torch.bfloat16
    before = model.backbone.fc.weight.detach().clone()
    trainer.train_step([(torch.randn(4, 3, 4, 4), torch.tensor([0, 1, 2, 3]))])
    assert math.isfinite(trainer.collect_stats()["loss"])
    assert not torch.equal(before, model.backbone.fc.weight)


@pytest.mark.parametrize(("amp", "dtype"), [("bf16", torch.bfloat16), ("off", torch.float32)])
def test_train_amp_param_sets_autocast_in_the_forward(shard_set, tmp_path, amp, dtype):
    """Through params.yaml and the train stage's own model build: every convolution of the backbone's
    trunk runs in bf16 under `amp: bf16` (CPU autocast), in float32 under `amp: off`; the embedding
    layers run in float32 either way (MobileFaceNet keeps them there on purpose)."""
    (tmp_path / "params.yaml").write_text(f"train:\n  amp: {amp}\n")  # bare `off`, as users write it
    params = tiny_params(amp=load_section(tmp_path / "params.yaml", "train").amp)
    seen: dict[str, set[torch.dtype]] = {"conv": set(), "embedding": set()}

    def hooked_model(*args, **kwargs) -> FaceModel:
        model = build_model(*args, **kwargs)
        for module in model.backbone.layers.modules():
            if isinstance(module, torch.nn.Conv2d):
                module.register_forward_hook(lambda _m, _i, out: seen["conv"].add(out.dtype))
        model.backbone.register_forward_hook(lambda _m, _i, out: seen["embedding"].add(out.dtype))
        return model

    report = run(params, shard_set, tmp_path / "out", max_steps=1, model_factory=hooked_model)
    assert report.steps == 1 and math.isfinite(report.loss)
    assert seen == {"conv": {dtype}, "embedding": {torch.float32}}


# -- checkpoint files ---------------------------------------------------------------------------------


def test_checkpoints_are_atomic_pruned_and_tensor_only(tmp_path):
    directory = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        save_checkpoint(
            directory, {"format": "facepipe-train-checkpoint", "version": 1, "step": step}, step=step, keep=2
        )
    (directory / ".step-00000008.pt.tmp-999").write_bytes(b"half a checkpoint")
    assert [step for step, _ in list_checkpoints(directory)] == [4, 6]
    assert latest_checkpoint(directory).name == "step-00000006.pt"
    assert load_checkpoint(latest_checkpoint(directory))["step"] == 6
    with pytest.raises(TypeError):
        atomic_save({"x": threading.Lock()}, directory / "step-00000010.pt")  # cannot be saved
    assert not (directory / "step-00000010.pt").exists()
    assert sorted(p.name for p in directory.iterdir()) == [
        ".step-00000008.pt.tmp-999",
        "step-00000004.pt",
        "step-00000006.pt",
    ]


def test_unreadable_checkpoints_are_clear_errors(tmp_path):
    (tmp_path / "garbage.pt").write_bytes(b"\x00" * 100)
    with pytest.raises(FacepipeError, match="checkpoint unreadable"):
        load_checkpoint(tmp_path / "garbage.pt")
    torch.save({"format": "facepipe-train-checkpoint", "version": 1, "obj": random.Random()}, tmp_path / "pickled.pt")
    with pytest.raises(FacepipeError, match="checkpoint unreadable"):
        load_checkpoint(tmp_path / "pickled.pt")


def test_rng_states_round_trip_through_a_weights_only_file(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3), np.random.normal()  # a cached Gaussian too
    atomic_save({"rng": capture_rng_state(torch.device("cpu"))}, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), np.random.normal(), random.random())
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"], torch.device("cpu"))
    again = (torch.rand(3), np.random.rand(3), np.random.normal(), random.random())
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1])
    assert expected[2:] == again[2:]


# -- the stage in one process -------------------------------------------------------------------------


def test_single_process_run_writes_the_model_folder(finished_run):
    repo, report, params = finished_run
    out = repo / "model"
    assert (report.steps, report.total_steps, report.epochs_done, report.world_size) == (12, 12, 2, 1)
    assert report.resumed_from_step is None and report.loss is not None and np.isfinite(report.loss)
    spec = read_model_spec(out)
    assert (spec.backbone, spec.embedding_size, spec.image_size) == ("mobilefacenet", 16, 16)
    backbone, _ = load_backbone(out)
    assert backbone(torch.zeros(2, 3, 16, 16)).shape == (2, 16)
    assert [step for step, _ in list_checkpoints(out / "checkpoints")] == [6, 8, 12]  # every 4 + epoch ends, keep 3
    state = torch.load(out / "checkpoints" / "step-00000012.pt", weights_only=True)
    assert (state["step"], state["epoch"], state["epoch_samples"], state["world_size"]) == (12, 2, 0, 1)
    assert state["config"] == params.model_dump(mode="json") and state["plan"]["effective_batch"] == 8
    assert set(state) >= {"backbone", "head", "optimizer", "scheduler", "scaler", "rng", "data", "model"}
    final = load_weights(out / "backbone.pt")
    assert final.keys() == state["backbone"].keys()
    assert all(torch.equal(final[key], state["backbone"][key]) for key in final)


def test_metrics_and_plots_for_dvc(finished_run):
    repo, _, _ = finished_run
    out = repo / "model"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 12
    assert set(metrics["train"]) >= {"loss", "accuracy", "lr", "samples_per_s", "epoch", "epoch_time_s"}
    loss = (out / "plots" / "metrics" / "train" / "loss.tsv").read_text().splitlines()
    assert loss[0].split("\t") == ["step", "loss"] and len(loss) == 13  # one point per step (log_every 1)
    assert not (repo / ".dvc").exists() and not (repo / "dvc.yaml").exists()  # dvclive left the repo alone
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, check=True)
    assert status.stdout.strip() == "?? model/"


def test_a_finished_run_resumes_to_nothing_and_rewrites_the_same_weights(finished_run, shard_set, tmp_path):
    repo, _, params = finished_run
    out = tmp_path / "model"
    shutil.copytree(repo / "model", out)
    report = run(params, shard_set, out)
    assert report.resumed_from_step == 12 and report.steps == 12
    before, after = load_weights(repo / "model" / "backbone.pt"), load_weights(out / "backbone.pt")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_resume_refuses_other_params_and_fresh_starts_over(finished_run, shard_set, tmp_path):
    repo, _, params = finished_run
    out = tmp_path / "model"
    shutil.copytree(repo / "model", out)
    changed = params.model_copy(update={"lr": 0.2})
    with pytest.raises(FacepipeError, match=r"other train params \(lr; e.g. lr: 0.05 -> 0.2\)"):
        run(changed, shard_set, out)
    with pytest.raises(FacepipeError, match="trained on other data"):
        run(params, shard_set, out, identities=["id0000", "id0001"])
    operational = params.model_copy(update={"log_every": 5, "num_workers": 1})
    assert run(operational, shard_set, out).resumed_from_step == 12
    report = run(changed, shard_set, out, max_steps=1, fresh=True)
    assert report.resumed_from_step is None and report.steps == 1


def test_resume_with_another_world_size(finished_run, shard_set, tmp_path):
    """Dense head: continue with the position re-derived from the samples consumed (the world size is
    forged here; real runs at 2 -> 1, 1 -> 2 and 2 -> 3 processes, sharded head: tests/test_train_resize.py)."""
    _, _, params = finished_run
    out = tmp_path / "model"
    run(params, shard_set, out, max_steps=3, model_factory=linear_model)
    path = latest_checkpoint(out / "checkpoints")
    state = torch.load(path, weights_only=True)
    assert (state["step"], state["epoch_samples"]) == (3, 24)
    state.update(world_size=2, rng=state["rng"] * 2)  # as if 2 processes x batch 4 had written it
    atomic_save({**state, "checksum": state_checksum(state)}, path)
    report = run(params, shard_set, out, max_steps=5, model_factory=linear_model)
    assert report.resumed_from_step == 3 and report.steps == 5


def test_resume_at_another_effective_batch_recomputes_the_step_from_the_samples(shard_set, tmp_path, caplog):
    """A checkpoint of 2 processes x batch 8 (16 a step) at step 2 has consumed 32 samples: one process
    x batch 8 continues at step 32 // 8 = 4, not 2, and finishes the 2 epochs at step 12 (6 a epoch).
    Kept at step 2 it would end epoch 0 at step 4 and stop at 10. (The real 2 -> 1, 1 -> 2, 2 -> 3 runs
    of tests/test_train_resize.py keep the effective batch, where both positions are the same.)"""
    params = tiny_params(epochs=2, checkpoint_every=3, reference_batch=8)
    out = tmp_path / "model"
    run(params, shard_set, out, max_steps=3, model_factory=linear_model)
    path = latest_checkpoint(out / "checkpoints")
    state = torch.load(path, weights_only=True)
    state.update(world_size=2, step=2, epoch_samples=32, rng=state["rng"] * 2)  # forged: 2 x 8 at step 2
    atomic_save({**state, "checksum": state_checksum(state)}, path)
    with caplog.at_level("WARNING", logger="facepipe"):
        report = run(params, shard_set, out, model_factory=linear_model)
    assert report.resumed_from_step == 2 and (report.steps, report.epochs_done) == (12, 2)
    assert "from 2 processes with 1: effective batch 8, lr 0.05, continuing at step 4" in caplog.text


# -- the command line ---------------------------------------------------------------------------------


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "override,message",
    [
        ({"lrr": 0.1}, "unknown key 'train.lrr'"),
        ({"augment": {"p_flip": 0.5}}, "unknown key 'train.augment.p_flip'"),
        ({"batch_size": 0}, "train.batch_size: Value error, must be an integer >= 1 or auto, got 0"),
        ({"amp": "fp8"}, "train.amp: Input should be 'off', 'bf16' or 'fp16'"),
        ({"augment": {"jpeg_quality": [90, 40]}}, "train.augment.jpeg_quality: Value error, must be [min, max]"),
        ({"amp": "fp16"}, "train.amp: fp16 needs a CUDA device"),
    ],
)
def test_bad_params_are_one_line_errors(shard_set, tmp_path, capsys, override, message):
    params = write_params(tmp_path / "params.yaml", **override)
    assert message in one_line_error(capsys, ["train", str(shard_set), str(tmp_path / "out"), "--params", str(params)])


def test_missing_or_corrupt_shard_sets_fail_the_command_in_one_line(tmp_path, capsys):
    params = write_params(tmp_path / "params.yaml")
    err = one_line_error(capsys, ["train", str(tmp_path / "nowhere"), str(tmp_path / "out"), "--params", str(params)])
    assert "shard set not found" in err
    broken = synthetic_set(tmp_path / "broken", identities=2, per_identity=8)
    (broken / "shards" / "shard-00000.lmdb").write_bytes(b"\x01" * 4096)
    err = one_line_error(capsys, ["train", str(broken), str(tmp_path / "out"), "--params", str(params)])
    assert "shard-00000.lmdb" in err


def test_cli_trains_a_subset_of_identities(shard_set, tmp_path, capsys):
    identities = tmp_path / "train_identities.json"
    identities.write_text(json.dumps(["id0000", "id0002", "id0003"]))
    params = write_params(tmp_path / "params.yaml", epochs=1)
    argv = ["train", str(shard_set), str(tmp_path / "out"), "--params", str(params), "--identities", str(identities)]
    assert main(argv) == 0
    assert "trained 4/4 steps (1 epochs) on 36 samples of 3 identities" in capsys.readouterr().out
    state = load_checkpoint(latest_checkpoint(tmp_path / "out" / "checkpoints"))
    assert state["class_names"] == ["id0000", "id0002", "id0003"] and state["head"]["weight"].shape == (3, 16)


def test_a_bare_yaml_off_means_amp_off(tmp_path):
    """YAML 1.1 reads `amp: off` (and `dvc exp run -S train.amp=off`) as false."""
    (tmp_path / "params.yaml").write_text("train:\n  amp: off\n")
    assert load_section(tmp_path / "params.yaml", "train").amp == "off"


def test_resume_refuses_a_set_an_update_only_shrank(tmp_path):
    """An update that only deletes photos keeps every shard file (its records are excluded): the
    checkpoint's data must still differ (sample count, exclusions) and resuming is refused in one line."""
    from test_update import face, in_process, write

    from facepipe.config import PrepareParams
    from facepipe.data.dataset import FaceDataset
    from facepipe.stages import prepare
    from facepipe.stages.train import data_fingerprint

    raw, prepared, out = tmp_path / "raw", tmp_path / "prepared", tmp_path / "model"
    params = PrepareParams(detector="none", image_size=16, samples_per_shard=8, chunk_size=4, max_pixels=1_000_000)
    write(raw, {f"id{i}/{j}.jpg": face(10 * i + j) for i in range(4) for j in range(4)})
    prepare.run(params, raw, prepared, submit=in_process(raw, params), workers=1, progress=False)
    train = tiny_params(epochs=2)
    assert run(train, prepared, out, max_steps=1, model_factory=linear_model).num_samples == 16
    shards = {p.name: p.read_bytes() for p in (prepared / "shards").iterdir()}
    before = data_fingerprint(FaceDataset(prepared))
    for name in ("id0/3.jpg", "id1/3.jpg", "id2/3.jpg"):
        (raw / name).unlink()
    prepare.run(params, raw, prepared, update=True, submit=in_process(raw, params), workers=1, progress=False)
    assert {p.name: p.read_bytes() for p in (prepared / "shards").iterdir()} == shards  # the same shard files
    assert data_fingerprint(FaceDataset(prepared)) != before  # the exclusions are part of it
    with pytest.raises(FacepipeError, match=r"^.*step-00000001.pt was trained on other data \(16 samples, now 13\)") as error:
        run(train, prepared, out, max_steps=2, model_factory=linear_model)
    assert "\n" not in str(error.value)
    assert [step for step, _ in list_checkpoints(out / "checkpoints")] == [1]
    report = run(train, prepared, out, max_steps=1, fresh=True, model_factory=linear_model)
    assert report.resumed_from_step is None and report.num_samples == 13


def test_train_resumes_from_a_version_1_checkpoint_only_when_asked_to(finished_run, shard_set, tmp_path, capsys):
    """``facepipe train`` refuses a checkpoint without a checksum in one line (exit 2) and resumes from
    it with --trust-unverified-checkpoint."""
    repo, _, params = finished_run
    out = tmp_path / "model"
    shutil.copytree(repo / "model", out)
    path = latest_checkpoint(out / "checkpoints")
    state = torch.load(path, weights_only=True)
    del state["checksum"]
    atomic_save({**state, "version": 1}, path)
    params_file = write_params(tmp_path / "params.yaml", epochs=2, checkpoint_every=4, keep_checkpoints=3)
    argv = ["train", str(shard_set), str(out), "--params", str(params_file)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"facepipe train: error: checkpoint {path} is version 1, written before checksums") and err.count("\n") == 1
    assert main([*argv, "--trust-unverified-checkpoint"]) == 0
    assert capsys.readouterr().out.startswith("trained 12/12 steps")
