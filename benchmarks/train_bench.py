"""Throughput of the train stage's data path and training step (a benchmark, not a test).

    .venv/bin/python benchmarks/train_bench.py [--quick] [--json FILE]

1. loader overhead: ``DataLoader(num_workers=0)`` over a synthetic shard set against a plain loop
   doing the same decode + augmentation on the same JPEG bytes held in memory (target >= 0.9x);
2. loader scaling: ``num_workers=2`` against ``num_workers=0`` (target >= 1.7x);
3. training: the full train step (sampler -> LMDB -> decode -> augment -> Trainer.train_step)
   against a bare forward/backward/step on in-memory tensors of the same shape (target >= 0.9x),
   for mobilefacenet and iresnet50 (and, on CUDA, iresnet50 at bf16 with batch 256);
4. read order on a cold page cache: shuffled shards + shuffle buffer against a global random order
   (raw record reads only, page cache of the shard files dropped before each pass);
5. record checksums: the CRC-32 check of every read against the JPEG decode of the same records
   (target < 3% of the decode time), and the loader of row 1 with the check against without it.

Every figure is the median of ``--repeats`` runs; the two sides of a comparison run alternately.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import facepipe  # noqa: F401  (offline environment defaults)
from facepipe.config import TrainParams
from facepipe.data.augment import Augmenter, to_tensor, to_uint8_tensor
from facepipe.data.dataset import FaceDataset, make_loader
from facepipe.data.batch_order import ShardOrderSampler
from facepipe.io.records import decode_image, decode_record, payload_offset
from facepipe.io.shards import ShardReader
from facepipe.synthetic.shards import write_synthetic_shard_set
from facepipe.stages.train import build_model
from facepipe.training.distributed import Distributed
from facepipe.training.optimizer import build_optimizer
from facepipe.training.schedule import build_scheduler, make_plan
from facepipe.training.trainer import Trainer

AUGMENT = {"p_hflip": 0.5, "p_color_jitter": 0.5}  # the demo configuration's augmentation


def median_pair(a: Callable[[], float], b: Callable[[], float], repeats: int) -> tuple[float, float]:
    """Medians of ``a()`` and ``b()``, run alternately ``repeats`` times each."""
    results_a, results_b = [], []
    for _ in range(repeats):
        results_a.append(a())
        results_b.append(b())
    return statistics.median(results_a), statistics.median(results_b)


def dataset_for(root: Path, params: TrainParams, *, normalize: bool = False) -> FaceDataset:
    """The train stage's dataset: uint8 batches (normalized on the device) unless ``normalize``."""
    dataset = FaceDataset(root, seed=params.seed, normalize=normalize)
    dataset.augment = Augmenter(params.augment, image_size=dataset.image_size)
    return dataset


# -- 1 and 2: the loader ------------------------------------------------------------------------------


def loader_rate(dataset: FaceDataset, *, batch: int, workers: int, epochs: int) -> Callable[[], float]:
    """Images/s of the DataLoader over whole epochs (workers started before the clock runs)."""
    sampler = ShardOrderSampler(dataset.item_shards, batch_size=batch, buffer_size=4096)
    loader = make_loader(dataset, sampler, num_workers=workers)
    sampler.set_epoch(0)
    for _ in loader:  # start workers, open environments, warm the page cache
        pass

    def measure() -> float:
        count, start = 0, time.perf_counter()
        for epoch in range(1, epochs + 1):
            sampler.set_epoch(epoch)
            for images, _ in loader:
                count += images.shape[0]
        return count / (time.perf_counter() - start)

    return measure


def plain_loop_rate(dataset: FaceDataset, *, batch: int, epochs: int) -> Callable[[], float]:
    """Images/s of decode + augment + tensor conversion + stack over JPEG bytes already in memory
    (the same conversion as the dataset's: uint8, or float32 in [-1, 1])."""
    payloads = [decode_record(dataset.read(item)).payload for item in range(len(dataset))]
    labels = torch.as_tensor(dataset.labels)
    pipeline = dataset.augment.pipeline
    convert = to_tensor if dataset.normalize else to_uint8_tensor
    usable = len(payloads) // batch * batch

    def measure() -> float:
        start = time.perf_counter()
        for _ in range(epochs):
            order = np.random.permutation(len(payloads))[:usable]
            for first in range(0, usable, batch):
                chosen = order[first : first + batch]
                images = [decode_image(payloads[i]) for i in chosen]
                if pipeline is not None:
                    images = [pipeline(image=image)["image"] for image in images]
                torch.stack([convert(image) for image in images]), labels[chosen]
        return usable * epochs / (time.perf_counter() - start)

    return measure


# -- 3: training --------------------------------------------------------------------------------------


def training_rates(
    root: Path, *, backbone: str, batch: int, steps: int, device: torch.device, amp: str, workers: int
) -> tuple[Callable[[], float], Callable[[], float]]:
    """Samples/s of the full train step and of a bare step on in-memory tensors (same model shape)."""
    params = TrainParams(
        backbone=backbone,
        batch_size=batch,
        reference_batch=batch,
        amp=amp,
        num_workers=workers,
        augment=AUGMENT,
        device=device.type,
        epochs=1000,
    )
    dataset = dataset_for(root, params)
    context = Distributed(rank=0, local_rank=0, world_size=1, device=device)
    plan = make_plan(params, num_samples=len(dataset), world_size=1)
    dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]

    def new_model() -> torch.nn.Module:
        torch.manual_seed(0)
        return build_model(params, num_classes=dataset.num_classes, image_size=dataset.image_size).to(device)

    model = new_model()
    optimizer = build_optimizer([model], name="sgd", lr=plan.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = build_scheduler(optimizer, total_steps=plan.total_steps, warmup_steps=0, decay="cosine")
    trainer = Trainer(model, optimizer, scheduler, context=context, plan=plan, amp=amp)
    sampler = ShardOrderSampler(dataset.item_shards, batch_size=batch, buffer_size=params.shuffle_buffer)
    loader = make_loader(dataset, sampler, num_workers=workers, pin_memory=device.type == "cuda")
    state = {"epoch": 0, "batches": iter(())}

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return next(state["batches"])
        except StopIteration:
            state["epoch"] += 1
            sampler.set_epoch(state["epoch"])
            state["batches"] = iter(loader)
            return next(state["batches"])

    def full() -> float:
        for _ in range(2):  # warm-up (first batches, allocator, cudnn autotune)
            trainer.train_step([next_batch()])
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step([next_batch()])
        trainer.collect_stats()  # the sync point logging would add
        synchronize(device)
        return steps * batch / (time.perf_counter() - start)

    bare_model = new_model()
    bare_optimizer = torch.optim.SGD(bare_model.parameters(), lr=plan.lr, momentum=0.9, weight_decay=5e-4)
    images = torch.rand(batch, 3, dataset.image_size, dataset.image_size, device=device) * 2 - 1
    labels = torch.randint(0, dataset.num_classes, (batch,), device=device)

    def bare() -> float:
        def step() -> None:
            with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                logits = bare_model(images, labels)
            F.cross_entropy(logits.float(), labels).backward()
            bare_optimizer.step()
            bare_optimizer.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize(device)
        return steps * batch / (time.perf_counter() - start)

    return full, bare


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 4: read order on a cold cache --------------------------------------------------------------------


def drop_page_cache(root: Path) -> None:
    for path in (root / "shards").glob("*.lmdb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rate(dataset: FaceDataset, order: Callable[[int], np.ndarray]) -> Callable[[], float]:
    """Records/s reading raw records in ``order(epoch)`` after dropping the shard files' page cache."""
    epoch = {"n": 0}

    def measure() -> float:
        epoch["n"] += 1
        items = order(epoch["n"])
        dataset.shards.close()
        drop_page_cache(dataset.shards.root)
        start = time.perf_counter()
        for item in items.tolist():
            dataset.read(item)
        return len(items) / (time.perf_counter() - start)

    return measure


# -- 5: record checksums ----------------------------------------------------------------------------


def per_record_us(raws: list[bytes], work: Callable[[bytes], object], repeats: int) -> float:
    """Median microseconds per record of ``work`` over ``raws``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for raw in raws:
            work(raw)
        times.append((time.perf_counter() - start) / len(raws) * 1e6)
    return statistics.median(times)


def checksum_costs(dataset: FaceDataset, repeats: int) -> dict[str, float]:
    """µs per record: prefix check with and without the CRC-32, and the JPEG decode."""
    raws = [dataset.read(item) for item in range(len(dataset))]
    return {
        "crc": per_record_us(raws, payload_offset, repeats),
        "prefix": per_record_us(raws, lambda raw: payload_offset(raw, verify=False), repeats),
        "decode": per_record_us(raws, lambda raw: decode_image(memoryview(raw)[payload_offset(raw, verify=False) :]), repeats),
    }


def unchecked_loader_rate(dataset: FaceDataset, *, batch: int, epochs: int) -> Callable[[], float]:
    """Row 1's loader with the readers' checksum check switched off for the measurement only."""
    measure = loader_rate(dataset, batch=batch, workers=0, epochs=epochs)

    def unchecked() -> float:
        checked = ShardReader.checked
        ShardReader.checked = lambda self, raw, index: raw  # type: ignore[method-assign]
        try:
            return measure()
        finally:
            ShardReader.checked = checked  # type: ignore[method-assign]

    return unchecked


# -- driver -------------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            names = [line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return f"{os.cpu_count()} x {cpu}{gpu}; torch {torch.__version__}, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples, steps and repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--only", default="loader,scaling,train,read,crc", help="comma-separated parts to run")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads for the training part")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    repeats = args.repeats or (3 if quick else 5)
    parts = set(args.only.split(","))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: dict[str, Any] = {
        "machine": machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "rows": [],
    }

    def report(name: str, a: float, b: float, unit: str, target: float) -> None:
        row = {"name": name, "ours": a, "reference": b, "unit": unit, "ratio": a / b, "target": target}
        results["rows"].append(row)
        verdict = "ok" if a / b >= target else "BELOW TARGET"
        print(f"{name:<48} {a:9.1f} vs {b:9.1f} {unit:<10} {a / b:5.2f}x (target {target}x) {verdict}", flush=True)

    with tempfile.TemporaryDirectory(prefix="facepipe-train-bench-") as tmp:
        root = write_synthetic_shard_set(
            Path(tmp) / "set",
            num_identities=50 if quick else 200,
            samples_per_identity=20,
            image_size=112,
            samples_per_shard=500,
            seed=0,
        )
        params = TrainParams(augment=AUGMENT)
        datasets = {"uint8": dataset_for(root, params), "float32": dataset_for(root, params, normalize=True)}
        dataset = datasets["uint8"]
        epochs = 1 if quick else 2
        threads = torch.get_num_threads()
        # One intra-op thread for the data path, as in a loader worker: on a busy machine a second
        # OpenMP thread turns a 10 MB torch.stack into 100+ ms of spinning, which measures the
        # machine, not the loader.
        torch.set_num_threads(1)
        # uint8 is what the train stage loads (normalized on the device); float32 batches for comparison.
        for kind, data in datasets.items():
            if "loader" in parts:
                a, b = median_pair(
                    loader_rate(data, batch=64, workers=0, epochs=epochs),
                    plain_loop_rate(data, batch=64, epochs=epochs),
                    repeats,
                )
                report(f"1. DataLoader(num_workers=0) vs plain loop, {kind}", a, b, "images/s", 0.9)
            if "scaling" in parts:
                a, b = median_pair(
                    loader_rate(data, batch=64, workers=2, epochs=epochs),
                    loader_rate(data, batch=64, workers=0, epochs=epochs),
                    repeats,
                )
                report(f"2. DataLoader num_workers=2 vs 0, {kind}", a, b, "images/s", 1.7)
        torch.set_num_threads(threads)
        if "train" in parts:
            cpu = device.type == "cpu"
            # CPU: small batches so that a run takes minutes; CUDA: the sizes people train with.
            cases = [("mobilefacenet", 32 if cpu else 256, "off"), ("iresnet50", 8 if cpu else 128, "off")]
            if not cpu:
                cases.append(("iresnet50", 256, "bf16"))
            workers = 0 if cpu else 6  # on 2 CPU cores, loader workers would only take cores from the step
            for backbone, batch, amp in cases:
                steps = (2 if quick else 3) if cpu else 30
                full, bare = training_rates(
                    root, backbone=backbone, batch=batch, steps=steps, device=device, amp=amp, workers=workers
                )
                a, b = median_pair(full, bare, repeats)
                report(f"3. train step {backbone} b{batch} amp={amp} vs bare", a, b, "samples/s", 0.9)
        if "read" in parts:
            sampler = ShardOrderSampler(dataset.item_shards, batch_size=64, buffer_size=params.shuffle_buffer)

            def shard_order(epoch: int) -> np.ndarray:
                sampler.set_epoch(epoch)
                return sampler.rank_items()[0]

            def random_order(epoch: int) -> np.ndarray:
                return np.random.default_rng(epoch).permutation(len(dataset))

            a, b = median_pair(read_rate(dataset, shard_order), read_rate(dataset, random_order), repeats)
            report("4. cold-cache reads: shard+buffer vs random", a, b, "records/s", 1.0)
        if "crc" in parts:
            torch.set_num_threads(1)
            costs = checksum_costs(dataset, repeats)
            share = (costs["crc"] - costs["prefix"]) / costs["decode"]
            results["rows"].append({"name": "5. CRC-32 check / JPEG decode", **costs, "ratio": share, "target": 0.03})
            print(
                f"{'5. CRC-32 check per record vs JPEG decode':<48} {costs['crc'] - costs['prefix']:9.2f} vs "
                f"{costs['decode']:9.1f} us/record  {100 * share:5.2f}% (target < 3%) "
                f"{'ok' if share < 0.03 else 'ABOVE TARGET'}",
                flush=True,
            )
            a, b = median_pair(
                loader_rate(dataset, batch=64, workers=0, epochs=epochs),
                unchecked_loader_rate(dataset, batch=64, epochs=epochs),
                repeats,
            )
            report("5. DataLoader(num_workers=0) checked vs unchecked", a, b, "images/s", 0.97)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"machine: {results['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
