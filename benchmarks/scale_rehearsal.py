"""Scale rehearsal: the data path and the start of training on a shard set of a million identities (issue 9).

For each identity count N (default 100k and 1M, a few records each; payloads repeat, so only counts and
labels mean anything) it writes a synthetic shard set under ``--root``, then times each step of the
data path in a fresh process, with that process's peak resident set after the step (VmHWM):

    open        check_shard_set: manifest, labels.json, shard headers, small files' hashes
    labels      the per-shard label indexes, concatenated ([M] int32)
    split       the split stage (identity-disjoint train / validation lists and pairs) into a folder
    dataset     FaceDataset restricted to the split's training identities (labels remapped)
    sampler     ShardOrderSampler's epoch order for rank 0 of 2 (shuffled shards + buffer)
    fingerprint data_fingerprint (shard hashes + every class name)
    checkpoint  one checkpoint's class-name cost: save_checkpoint + load_checkpoint of a state holding
                only the class names, encoded once as the train stage does (the weights are not in it)

and then ``facepipe train`` (the stage's ``run``) in 2 gloo processes with the sharded head for a few
steps: time from the call to the first optimizer step, per-rank peak RSS, step time. Targets (issue 9):
nothing grows worse than linearly from 100k to 1M; opening the set and starting training < 60 s and
< 4 GB RSS per process. The sets are deleted afterwards unless ``--keep``.

    python benchmarks/scale_rehearsal.py [--identities 100000,1000000] [--per-identity 3] [--root /tmp/scale]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from facepipe.stages.split import TRAIN_FILE

GIB = 2**30


def _peak_rss() -> int:
    match = re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())
    return int(match.group(1)) * 1024 if match else 0


def write_set(root: Path, *, identities: int, per_identity: int) -> float:
    """The synthetic set at ``root`` (16 x 16 faces, 10,000 per shard, 64 distinct payloads); seconds."""
    from facepipe.synthetic.shards import write_synthetic_shard_set

    started = time.perf_counter()
    write_synthetic_shard_set(
        root, num_identities=identities, samples_per_identity=per_identity, image_size=16,
        samples_per_shard=10_000, payload_pool=64,
    )
    return time.perf_counter() - started


def data_phases(_rank: int, shard_root: str, split_root: str, queue) -> None:  # type: ignore[no-untyped-def]
    """Each step of the data path in order, in this (fresh) process: (name, seconds, peak RSS bytes)."""
    from facepipe.config import SplitParams
    from facepipe.data.dataset import FaceDataset
    from facepipe.data.batch_order import ShardOrderSampler
    from facepipe.io.manifest import check_shard_set
    from facepipe.stages import split
    from facepipe.stages.train import data_fingerprint

    timings = []

    def timed(name: str, work):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        value = work()
        timings.append((name, time.perf_counter() - started, _peak_rss()))
        return value

    shard_set = timed("open", lambda: check_shard_set(shard_root))
    timed("labels", shard_set.labels)
    timed("split", lambda: split.run(SplitParams(), shard_root, split_root))
    dataset = timed("dataset", lambda: FaceDataset(shard_set, identities=f"{split_root}/{TRAIN_FILE}", normalize=False))
    sampler = ShardOrderSampler(dataset.item_shards, batch_size=128, rank=0, world_size=2, seed=0)
    timed("sampler", sampler.rank_items)
    timed("fingerprint", lambda: data_fingerprint(dataset))
    timed("checkpoint", lambda: _checkpoint_round_trip(dataset.class_names, Path(split_root) / "checkpoints"))
    queue.put(timings)


def _checkpoint_round_trip(names: list[str], directory: Path) -> None:
    from facepipe.training.checkpoint import (
        CHECKPOINT_FORMAT, CHECKPOINT_VERSION, encode_class_names, load_checkpoint, save_checkpoint,
    )

    directory.mkdir(parents=True, exist_ok=True)
    state = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": 1, "class_names": encode_class_names(names)}
    assert load_checkpoint(save_checkpoint(directory, state, step=1, keep=1))["class_names"] == names


def train_worker(rank: int, port: int, shard_root: str, split_root: str, out: str, queue) -> None:  # type: ignore[no-untyped-def]
    """One rank of the train stage: 3 steps with the sharded head; reports when the first step began."""
    import torch

    from facepipe.config import TrainParams
    from facepipe.stages import train
    from facepipe.training.trainer import Trainer

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        GLOO_SOCKET_IFNAME="lo",
    )
    torch.set_num_threads(1)
    marks: dict[str, float] = {}
    original = Trainer.train_step

    def first_step_marked(self, batches):  # type: ignore[no-untyped-def]
        marks.setdefault("first_step", time.perf_counter())
        marks.setdefault("rss_at_first_step", _peak_rss())
        return original(self, batches)

    Trainer.train_step = first_step_marked  # a benchmark's probe: when the loop starts, nothing else
    params = TrainParams(
        backbone="mobilefacenet", embedding_size=128, head="cosface", head_parallel="sharded", sample_rate=0.1,
        batch_size=16, reference_batch=32, warmup_epochs=0.0, num_workers=0, log_every=1, device="cpu",
        checkpoint_every=0,
    )
    started = time.perf_counter()
    report = train.run(params, shard_root, out, identities=f"{split_root}/{TRAIN_FILE}", max_steps=3, fresh=True)
    ended = time.perf_counter()
    queue.put({
        "rank": rank, "to_first_step_s": marks["first_step"] - started, "rss_at_first_step": marks["rss_at_first_step"],
        "peak_rss": _peak_rss(), "steps_s": ended - marks["first_step"], "steps": report.steps,
        "classes": report.num_classes,
    })


def _in_fresh_processes(target, args: tuple, nprocs: int) -> list[Any]:  # type: ignore[no-untyped-def]
    """``target(rank, *args, queue)`` in ``nprocs`` new processes; what each put on the queue. A failed
    process raises here (``start_processes`` joins them all) instead of leaving the queue empty."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(target, args=(*args, queue), nprocs=nprocs, join=True, start_method="spawn")
    return [queue.get() for _ in range(nprocs)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rehearse(root: Path, *, identities: int, per_identity: int) -> dict[str, Any]:
    """Write the set, time the data path, start training; the figures of one identity count."""
    shard_root, split_root, out = root / "set", root / "split", root / "model"
    written = write_set(shard_root, identities=identities, per_identity=per_identity)
    size = sum(f.stat().st_size for f in shard_root.rglob("*") if f.is_file())
    (phases,) = _in_fresh_processes(data_phases, (str(shard_root), str(split_root)), 1)
    ranks = _in_fresh_processes(train_worker, (_free_port(), str(shard_root), str(split_root), str(out)), 2)
    return {"identities": identities, "samples": identities * per_identity, "write_s": written, "bytes": size,
            "phases": phases, "train": sorted(ranks, key=lambda r: r["rank"])}


def report(results: list[dict[str, Any]]) -> None:
    print("\n| step | " + " | ".join(f"{r['identities']:,} ids: s / peak RSS GiB" for r in results) + " | time ratio |")
    print("|---|" + "---:|" * (len(results) + 1))
    names = [name for name, _, _ in results[0]["phases"]]
    for index, name in enumerate(names):
        cells = [f"{r['phases'][index][1]:.2f} / {r['phases'][index][2] / GIB:.2f}" for r in results]
        ratio = results[-1]["phases"][index][1] / max(results[0]["phases"][index][1], 1e-9)
        print(f"| {name} | " + " | ".join(cells) + f" | {ratio:.1f}x |")
    for label, key, scale in (("train: call -> first step, s", "to_first_step_s", 1), ("train: RSS at first step, GiB", "rss_at_first_step", GIB),
                              ("train: peak RSS, GiB", "peak_rss", GIB), ("train: 3 steps, s", "steps_s", 1)):
        cells = [" / ".join(f"{rank[key] / scale:.2f}" for rank in r["train"]) for r in results]
        print(f"| {label} (rank 0 / 1) | " + " | ".join(cells) + " | |")
    for r in results:
        print(f"{r['identities']:,} identities, {r['samples']:,} samples: written in {r['write_s']:.0f} s, "
              f"{r['bytes'] / GIB:.2f} GiB; trained on {r['train'][0]['classes']:,} classes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", default="100000,1000000")
    parser.add_argument("--per-identity", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path("/tmp/facepipe-scale-rehearsal"))
    parser.add_argument("--keep", action="store_true", help="keep the sets (default: delete them)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.root.exists():
        raise SystemExit(f"{args.root} exists: choose another --root (this script deletes what it writes)")
    print(f"load average {os.getloadavg()[0]:.1f}")
    results = []
    try:
        for count in (int(c) for c in args.identities.split(",")):
            results.append(rehearse(args.root / str(count), identities=count, per_identity=args.per_identity))
            print(json.dumps(results[-1]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.root, ignore_errors=True)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
