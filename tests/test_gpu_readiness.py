"""GPU and multi-node readiness (issue 9), checked on CPU: PowerSGD after an fp16 overflow, device
resolution for training / evaluation / prepare workers, what DDP and backbone.pt are given, the
throughput defaults."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- PowerSGD + fp16 loss scaling: one overflow must not poison every later step ------------------

WORLD, CLASSES, BATCH, STEPS, OVERFLOW_AT = 2, 5, 4, 9, 5


def powersgd_trainer(rank: int, *, start_iter: int = 2):  # type: ignore[no-untyped-def]
    import torch
    from train_helpers import LinearBackbone, tiny_params

    import facepipe.training.trainer as trainer_module
    from facepipe.stages.train import build_head
    from facepipe.training.distributed import Distributed
    from facepipe.training.optimizer import build_optimizer
    from facepipe.training.schedule import Plan, build_scheduler
    from facepipe.training.trainer import FaceModel, Trainer

    # fp16 loss scaling runs on CUDA only; the CPU GradScaler is the same algorithm, so let the trainer
    # take it here (the one thing this test changes about the code under test)
    trainer_module.check_precision = lambda amp, device: None
    params = tiny_params(head="cosface", embedding_size=8, seed=3)
    torch.manual_seed(0)
    model = FaceModel(LinearBackbone(8, 4), build_head(params, num_classes=CLASSES))
    plan = Plan(
        world_size=WORLD, batch_size=BATCH, accum_steps=1, effective_batch=BATCH * WORLD, lr=0.05,
        epochs=1, steps_per_epoch=STEPS, total_steps=STEPS, warmup_steps=0,
    )
    optimizer = build_optimizer([model], name="sgd", lr=plan.lr, momentum=0.9, weight_decay=0.0)
    scheduler = build_scheduler(optimizer, total_steps=STEPS, warmup_steps=0, decay="cosine")
    context = Distributed(rank=rank, local_rank=rank, world_size=WORLD, device=torch.device("cpu"))
    trainer = Trainer(
        model, optimizer, scheduler, context=context, plan=plan, amp="fp16", comm_hook="powersgd",
        powersgd_start_iter=start_iter,
    )
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)  # no spontaneous overflow in this tiny model
    return trainer


def overflow_batch(rank: int, step: int):  # type: ignore[no-untyped-def]
    import torch

    generator = torch.Generator().manual_seed(100 * step + rank)
    images = torch.randn(BATCH, 3, 4, 4, generator=generator)
    if step == OVERFLOW_AT and rank == 0:
        images[0, 0, 0, 0] = float("inf")  # what an fp16 overflow does to one rank's gradients
    return [(images, torch.randint(0, CLASSES, (BATCH,), generator=generator))]


def powersgd_worker(rank: int, port: int, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        trainer = powersgd_trainer(rank)
        scales, moved = [], []
        for step in range(STEPS):
            before = [p.detach().clone() for p in trainer.module.parameters()]
            trainer.train_step(overflow_batch(rank, step))
            scales.append(trainer.scaler.get_scale())
            moved.append(any(not torch.equal(a, b) for a, b in zip(before, trainer.module.parameters())))
        finite = all(torch.isfinite(p).all() for p in trainer.module.parameters())
        torch.save({"scales": scales, "moved": moved, "finite": finite}, f"{out}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_powersgd_recovers_from_one_fp16_overflow(tmp_path: Path) -> None:
    """2 gloo processes, PowerSGD from step 2, one inf injected at step 5: that step is skipped and the
    scale halves once; every later step updates the weights again (the hook state was reset)."""
    import torch
    import torch.multiprocessing as mp

    mp.spawn(powersgd_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        scales, moved = result["scales"], result["moved"]
        assert scales[:OVERFLOW_AT] == [256.0] * OVERFLOW_AT
        assert scales[OVERFLOW_AT:] == [128.0] * (STEPS - OVERFLOW_AT), scales  # halved once, not every step
        assert moved == [True] * OVERFLOW_AT + [False] + [True] * (STEPS - OVERFLOW_AT - 1), moved
        assert result["finite"]


def test_powersgd_starts_after_a_tenth_of_the_run_and_after_warmup() -> None:
    from facepipe.config import ParamsError, TrainParams, parse_section
    from facepipe.training.distributed import powersgd_start

    assert powersgd_start(None, total_steps=1000, warmup_steps=50) == 100
    assert powersgd_start(None, total_steps=1000, warmup_steps=300) == 300  # not before warmup ends
    assert powersgd_start(None, total_steps=5, warmup_steps=0) == 2  # PyTorch's error feedback needs >= 2
    assert powersgd_start(7, total_steps=1000, warmup_steps=300) == 7  # a configured value is kept
    assert TrainParams().powersgd_start_iter is None
    with pytest.raises(ParamsError, match="train.powersgd_start_iter: Input should be greater than or equal to 2"):
        parse_section(TrainParams, "train", {"powersgd_start_iter": 1})


# --- DDP without a buffer broadcast per forward; running statistics averaged at checkpoints --------


def buffers_worker(rank: int, port: int, out: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    from facepipe.heads import create_head
    from facepipe.training.distributed import Distributed
    from facepipe.training.optimizer import build_optimizer
    from facepipe.training.schedule import Plan, build_scheduler
    from facepipe.training.trainer import FaceModel, Trainer

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.manual_seed(0)
        backbone = nn.Sequential(nn.Flatten(), nn.Linear(48, 8), nn.BatchNorm1d(8))
        model = FaceModel(backbone, create_head("cosface", embedding_size=8, num_classes=CLASSES, scale=16.0, seed=0))
        plan = Plan(
            world_size=WORLD, batch_size=BATCH, accum_steps=1, effective_batch=BATCH * WORLD, lr=0.05,
            epochs=1, steps_per_epoch=3, total_steps=3, warmup_steps=0,
        )
        optimizer = build_optimizer([model], name="sgd", lr=plan.lr, momentum=0.9, weight_decay=0.0)
        scheduler = build_scheduler(optimizer, total_steps=3, warmup_steps=0, decay="cosine")
        context = Distributed(rank=rank, local_rank=rank, world_size=WORLD, device=torch.device("cpu"))
        trainer = Trainer(model, optimizer, scheduler, context=context, plan=plan)
        for step in range(3):
            generator = torch.Generator().manual_seed(10 * step + rank)
            images = torch.randn(BATCH, 3, 4, 4, generator=generator) + 3 * rank  # ranks see other statistics
            trainer.train_step([(images, torch.randint(0, CLASSES, (BATCH,), generator=generator))])
        bn = backbone[2]
        local = bn.running_mean.clone()
        gathered = [torch.zeros_like(local) for _ in range(WORLD)]
        dist.all_gather(gathered, local)
        state = trainer.checkpoint_state({})
        torch.save(
            {"local": gathered, "saved": state["backbone"]["2.running_mean"], "live": bn.running_mean.clone()},
            f"{out}/rank-{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_running_statistics_are_averaged_over_ranks_at_checkpoints(tmp_path: Path) -> None:
    """DDP broadcasts no buffers per forward (each rank's BatchNorm statistics follow its own batches);
    a checkpoint holds, and every rank continues with, their mean over ranks."""
    import torch
    import torch.multiprocessing as mp

    mp.spawn(buffers_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True) for rank in range(WORLD)]
    first, second = results[0]["local"]
    assert not torch.allclose(first, second)  # not broadcast from rank 0 before each forward
    mean = (first.double() + second.double()).div(2).float()
    for result in results:
        torch.testing.assert_close(result["saved"], mean, rtol=0, atol=1e-7)
        assert torch.equal(result["live"], result["saved"])
    assert torch.equal(results[0]["saved"], results[1]["saved"])


def test_cuda_setup_keeps_matmuls_full_float32() -> None:
    """TF32 for cuDNN convolutions only: the heads' cosine matmul stays float32 on a GPU."""
    import torch

    from facepipe.stages.train import _configure_device
    from facepipe.training.distributed import Distributed

    flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = True  # as something imported before might have left it
    try:
        _configure_device(Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cuda", 0)))
        assert torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


def test_backbone_pt_is_written_from_cpu_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backbone is moved to the CPU after training and before backbone.pt is written (on a GPU its
    tensors would otherwise be saved as CUDA tensors, which a CPU-only machine cannot load plainly)."""
    import torch
    from train_helpers import LinearBackbone, synthetic_set, tiny_params

    import facepipe.stages.train as train_stage
    from facepipe.training.trainer import FaceModel

    moves: list[str] = []

    class Recording(LinearBackbone):
        def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
            moves.append(fn(torch.zeros(1)).device.type)  # where .to() / .cpu() / .cuda() sends it
            return super()._apply(fn, recurse)

    def factory(params, *, num_classes, image_size):  # type: ignore[no-untyped-def]
        return FaceModel(Recording(params.embedding_size, image_size), train_stage.build_head(params, num_classes=num_classes))

    saved: list[tuple[list[str], dict]] = []
    original = train_stage.save_model_dir

    def spy(out, module, spec):  # type: ignore[no-untyped-def]
        saved.append((list(moves), {k: v.device.type for k, v in module.state_dict().items()}))
        return original(out, module, spec)

    monkeypatch.setattr(train_stage, "save_model_dir", spy)
    shard_set = synthetic_set(tmp_path / "set")
    train_stage.run(tiny_params(epochs=1), shard_set, tmp_path / "model", max_steps=1, model_factory=factory)
    (moves_before_save, devices), = saved
    assert moves_before_save[-1] == "cpu" and len(moves_before_save) >= 2  # moved after the move to the device
    assert set(devices.values()) == {"cpu"}
    weights = torch.load(tmp_path / "model" / "backbone.pt", weights_only=True, map_location="meta")
    assert weights.keys() == devices.keys()


# --- one device rule; prepare's workers spread over the GPUs --------------------------------------


def test_one_device_rule_for_every_stage() -> None:
    import torch

    from facepipe.devices import resolve_device, resolve_device_name
    from facepipe.errors import FacepipeError

    assert resolve_device("auto", device_count=0) == torch.device("cpu")
    assert resolve_device("auto", index=1, device_count=2) == torch.device("cuda", 1)  # a rank's own GPU
    assert resolve_device("cuda", device_count=2) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", index=0, device_count=2) == torch.device("cuda", 1)
    assert resolve_device("cpu", index=3, device_count=2) == torch.device("cpu")
    with pytest.raises(FacepipeError, match=r"^train.device is 'cuda' but no CUDA device is available$"):
        resolve_device("cuda", device_count=0, what="train.device")
    with pytest.raises(FacepipeError, match=r"cuda:2 does not exist \(2 GPU\(s\) visible\)"):
        resolve_device("auto", index=2, device_count=2)
    with pytest.raises(FacepipeError, match=r"^device: 'gpu' is not a device \(auto, cpu, cuda or cuda:N\)$"):
        resolve_device("gpu")
    for wrong in ("cuda:", "cpu:x", "CUDA", " cpu", "cuda:1 "):
        with pytest.raises(FacepipeError, match="is not a device"):
            resolve_device_name(wrong, device_count=2)
    # the same rule as names, without torch: what the RetinaFace CPU path uses
    assert resolve_device_name("auto", device_count=0) == "cpu" == resolve_device_name("cpu:0", device_count=2)
    assert resolve_device_name("auto", index=1, device_count=2) == "cuda:1" == resolve_device_name("cuda:1", device_count=2)
    # the detectors, evaluate and the trainer all use it (no second copy of the rule)
    import facepipe.detection.mtcnn as mtcnn
    import facepipe.detection.retinaface as retinaface
    import facepipe.stages.evaluate as evaluate
    import facepipe.training.distributed as distributed

    assert mtcnn.resolve_device is evaluate.resolve_device is resolve_device
    assert retinaface.resolve_device_name is resolve_device_name
    assert distributed.resolve_device is resolve_device and not hasattr(distributed, "pick_device")


def test_prepare_workers_spread_over_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    import facepipe.cluster as cluster
    from facepipe.devices import worker_gpus

    monkeypatch.setattr(cluster, "available_cores", lambda: 96)
    assert cluster.default_workers() == 96  # CPU detection: one per core
    assert cluster.default_workers(gpus=8) == 16  # not 96 CUDA contexts on GPU 0
    monkeypatch.setattr(cluster, "available_cores", lambda: 4)
    assert cluster.default_workers(gpus=8) == 4
    assert worker_gpus(5, device_count=2, visible="") == ["0", "1", "0", "1", "0"]
    assert worker_gpus(3, device_count=2, visible="4,7") == ["4", "7", "4"]  # this process's own GPU list
    assert worker_gpus(3, device_count=0) == []
    assert cluster.detection_gpus("auto", device_count=4) == cluster.detection_gpus("cuda", device_count=4) == 4
    assert cluster.detection_gpus("cpu", device_count=4) == cluster.detection_gpus("cuda:1", device_count=4) == 0


@contextlib.contextmanager
def _flow_cluster_client(*, workers: int, device: str, device_count: int):  # type: ignore[no-untyped-def]
    """The Prefect flow's own task runner (``flows.prepare.task_runner``), started: its Dask client."""
    from flows.prepare import task_runner

    with task_runner(workers=workers, scheduler_address=None, device=device, verbose=False, device_count=device_count) as runner:
        yield runner.client


@pytest.mark.multiprocess
@pytest.mark.parametrize("path", ["cli", "flow"])
def test_local_dask_workers_each_see_one_gpu(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A real LocalCluster with 2 GPUs injected, as the CLI (``dask_client``) and the Prefect flow start
    it: worker i starts with CUDA_VISIBLE_DEVICES = i mod 2; with device cpu no worker is restricted."""
    import os

    from facepipe.cluster import dask_client

    start = dask_client if path == "cli" else _flow_cluster_client
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with start(workers=3, device="auto", device_count=2) as client:
        seen = client.run(lambda dask_worker: (dask_worker.name, os.environ.get("CUDA_VISIBLE_DEVICES")))
    assert sorted(seen.values()) == [(0, "0"), (1, "1"), (2, "0")]
    with start(workers=1, device="cpu", device_count=2) as client:
        seen = client.run(lambda: os.environ.get("CUDA_VISIBLE_DEVICES"))
    assert list(seen.values()) == [None]


# --- throughput defaults ---------------------------------------------------------------------------


def test_loader_workers_follow_the_cores_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    import facepipe.training.loader as loader

    monkeypatch.setattr(loader, "available_cores", lambda: 2)
    assert loader.loader_workers("auto", device_type="cpu", local_processes=1) == 1  # the demo
    assert loader.loader_workers(3, device_type="cpu", local_processes=1) == 3  # a number is kept
    monkeypatch.setattr(loader, "available_cores", lambda: 96)
    assert loader.loader_workers("auto", device_type="cuda", local_processes=8) == 8  # 12 cores each, capped
    monkeypatch.setattr(loader, "available_cores", lambda: 32)
    assert loader.loader_workers("auto", device_type="cuda", local_processes=8) == 3  # 4 cores each, one drives
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's
    assert loader.loader_workers("auto", device_type="cpu") == 4


def test_metric_points_are_sparse_on_long_runs_and_every_step_on_the_demo() -> None:
    from facepipe.config import TrainParams, load_section
    from facepipe.training.trainer import auto_log_every

    assert [auto_log_every(n) for n in (1, 48, 199, 3000, 10**6)] == [1, 1, 1, 30, 50]
    demo = load_section(Path(__file__).parents[1] / "params.yaml", "train")
    assert demo.log_every == demo.num_workers == "auto" and TrainParams().log_every == "auto"


def test_channels_last_backbone_trains_like_the_default_layout() -> None:
    """Same step, other memory layout: weights in channels-last and results equal up to float rounding
    (the convolution kernels differ, so not bit-identical: off by default)."""
    import torch
    from train_helpers import tiny_params

    from facepipe.stages.train import build_model
    from facepipe.training.distributed import Distributed
    from facepipe.training.optimizer import build_optimizer
    from facepipe.training.schedule import Plan, build_scheduler
    from facepipe.training.trainer import Trainer

    plan = Plan(
        world_size=1, batch_size=4, accum_steps=1, effective_batch=4, lr=1e-3,
        epochs=1, steps_per_epoch=2, total_steps=2, warmup_steps=0,
    )
    context = Distributed(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    trainers = []
    for channels_last in (False, True):
        torch.manual_seed(0)
        model = build_model(tiny_params(), num_classes=3, image_size=16)
        optimizer = build_optimizer([model], name="sgd", lr=plan.lr, momentum=0.9, weight_decay=5e-4)
        scheduler = build_scheduler(optimizer, total_steps=2, warmup_steps=0, decay="cosine")
        trainers.append(Trainer(model, optimizer, scheduler, context=context, plan=plan, channels_last=channels_last))
    images = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for trainer in trainers:  # one step: rounding differences grow chaotically over steps of batch 4
        trainer.train_step([(images, torch.tensor([0, 1, 2, 0]))])
    losses = [trainer.collect_stats()["loss"] for trainer in trainers]
    # The two layouts run different convolution kernels, and which ones depends on the CPU: this tiny
    # model's embeddings (BatchNorm over 4 samples amplifies rounding) differ by 4.6e-5 relative on an AMD
    # EPYC (AVX2; 5.5e-5 with ATEN_CPU_CAPABILITY=default), its loss by 1.0e-5 to 1.2e-5 (1 or 2 threads),
    # its weights after the step by up to 3.3e-4 of the tensor's largest (+ 1e-3), less on an AVX-512
    # Xeon. A layout bug (a wrong permutation) moves the loss by > 1e-2.
    assert losses[0] == pytest.approx(losses[1], rel=5e-4) and losses[0] != losses[1]
    plain, last = (t.module.backbone for t in trainers)
    convs = [p for p in last.parameters() if p.dim() == 4]
    assert convs and all(p.is_contiguous(memory_format=torch.channels_last) for p in convs)
    for (name, a), b in zip(plain.state_dict().items(), last.state_dict().values()):
        assert (a.double() - b.double()).abs().max() <= 2e-3 * a.double().abs().max() + 1e-6, name
