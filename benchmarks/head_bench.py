"""Dense vs sharded margin head at many classes: peak memory per rank and step time (issue 9).

Each configuration runs in its own W gloo processes on CPU (one thread each, one process = one
"device"): the head (``create_head`` or ``create_model_parallel_head``, CosFace, E = 512) with SGD +
momentum, a fixed batch of embeddings (``--batch`` samples in all, ``batch / W`` per rank), one
warm-up step and ``--steps`` timed steps (forward, backward, the dense head's gradient all-reduce at
W > 1 as DDP would do it, optimizer step). Memory is the process's peak resident set (VmHWM, reset
through /proc/self/clear_refs) above what it held before building the head: weights, momentum,
gradients, the ``[global batch, local classes]`` logits and their temporaries, and allocator slack.
Next to each measurement the analytic figure: weights + momentum + gradient (``C_r × E`` each), t
tensors the size of the used centres (F.normalize's copy and its backward) and k the size of the
logits, with t and k fitted to the measured peaks; and from it the projection for 10M classes at W = 8
and 64.

    python benchmarks/head_bench.py [--classes 100000,1000000] [--steps 3] [--batch 64] [--probe-batch 1024]

A configuration whose estimated need exceeds the memory available now (``free``) is skipped, not run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from facepipe.heads import create_head, create_model_parallel_head

E = 512
GIB = 2**30


@dataclass(frozen=True)
class Config:
    kind: str  # dense | sharded
    classes: int
    world: int
    rate: float = 1.0
    batch: int = 64  # the global batch, ``batch / world`` per rank

    @property
    def name(self) -> str:
        rate = "" if self.rate == 1 else f", r={self.rate:g}"
        return f"{self.kind}, C={self.classes:,}, W={self.world}{rate}, B={self.batch}"


def local_classes(config: Config) -> int:
    """Classes a rank holds: all of them for the dense head, ceil(C / W) at most for the sharded one."""
    return config.classes if config.kind == "dense" else -(-config.classes // config.world)


def sampled_classes(config: Config) -> int:
    """Columns of a rank's logits: its (sampled) classes; positives counted at most once per sample."""
    local = local_classes(config)
    return local if config.rate == 1 else min(local, math.ceil(config.rate * local) + config.batch)


@dataclass(frozen=True)
class Model:
    """Transient tensors alive at a step's peak: ``t`` the size of the used centres ``[K, E]``
    (F.normalize's copy of them and its backward), ``k`` the size of the logits ``[B, K]``."""

    t: float = 6.0
    k: float = 6.0


def analytic_bytes(config: Config, *, model: Model) -> dict[str, float]:
    """Per-rank fp32 bytes: weights, momentum and gradient (each ``C_r × E``), ``t`` tensors of the used
    centres (``K × E``, K = C_r at r = 1) and ``k`` of the logits (``B × K``; B = the global batch
    for the sharded head, the rank's batch for the dense one)."""
    local, used = local_classes(config), sampled_classes(config)
    rows = 4 * local * E
    logit_rows = config.batch if config.kind == "sharded" else config.batch // config.world
    parts = {
        "weights": rows,
        "momentum": rows,
        "gradient": rows,
        "centre temporaries": model.t * 4 * used * E,
        "logits": model.k * 4 * logit_rows * used,
    }
    parts["total"] = sum(parts.values())
    return parts


def fit_model(results: list[dict[str, Any]]) -> Model:
    """Least-squares ``t`` and ``k`` from the measured peaks minus the three persistent tensors."""
    import numpy as np

    rows, rest = [], []
    for result in results:
        if "peak" not in result:
            continue
        config = Config(**result["config"])
        unit_t = analytic_bytes(config, model=Model(1, 0))["centre temporaries"]
        unit_k = analytic_bytes(config, model=Model(0, 1))["logits"]
        persistent = analytic_bytes(config, model=Model(0, 0))["total"]
        rows.append([unit_t, unit_k])
        rest.append(result["peak"] - persistent)
    if len(rows) < 2:
        return Model()
    (t, k), *_ = np.linalg.lstsq(np.array(rows), np.array(rest), rcond=None)
    return Model(float(t), float(k))


def _status(field: str) -> int:
    """A /proc/self/status memory field, bytes."""
    match = re.search(rf"{field}:\s+(\d+) kB", open("/proc/self/status").read())
    return int(match.group(1)) * 1024 if match else 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # "5": reset VmHWM to the current RSS
        handle.write("5")


def _build(config: Config):  # type: ignore[no-untyped-def]
    kwargs = {"embedding_size": E, "num_classes": config.classes, "scale": 64.0, "seed": 0}
    if config.kind == "dense":
        return create_head("cosface", **kwargs)
    return create_model_parallel_head("cosface", sample_rate=config.rate, **kwargs)


def _step(head, optimizer, embeddings, labels, *, config: Config, step: int) -> None:  # type: ignore[no-untyped-def]
    if config.kind == "sharded":
        head.sample_key = (step, 0)
    head.loss_and_correct(embeddings, labels).loss.backward()
    if config.kind == "dense" and config.world > 1:
        dist.all_reduce(head.weight.grad)  # what DDP does with a replicated head
        head.weight.grad.div_(config.world)
    optimizer.step()
    optimizer.zero_grad()


def _run(config: Config, *, steps: int, rank: int, head=None, optimizer=None) -> list[float]:  # type: ignore[no-untyped-def]
    """Seconds of each of ``steps + 1`` steps (the first warms up) on a fixed batch of this rank's."""
    if head is None:
        head = _build(config)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(rank)
    embeddings = torch.randn(config.batch // config.world, E, generator=generator, requires_grad=True)
    labels = torch.randint(0, config.classes, (config.batch // config.world,), generator=generator)
    times = []
    for step in range(steps + 1):
        dist.barrier()
        started = time.perf_counter()
        _step(head, optimizer, embeddings, labels, config=config, step=step)
        times.append(time.perf_counter() - started)
    return times


def worker(rank: int, config: Config, steps: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.world)
    try:
        # a tiny run of the same kind first: code loaded on first use is not counted as the head's
        _run(replace(config, classes=64 * config.world), steps=1, rank=rank)
        base = _status("VmRSS")
        _reset_peak()
        started = time.perf_counter()
        head = _build(config)
        optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
        init_s, init_peak, held = time.perf_counter() - started, _status("VmHWM") - base, _status("VmRSS") - base
        _reset_peak()
        times = _run(config, steps=steps, rank=rank, head=head, optimizer=optimizer)
        peak = _status("VmHWM") - base
        queue.put({"rank": rank, "init_s": init_s, "init_peak": init_peak, "held": held, "peak": peak,
                   "step_s": statistics.median(times[1:])})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def available_bytes() -> int:
    match = re.search(r"MemAvailable:\s+(\d+) kB", open("/proc/meminfo").read())
    return int(match.group(1)) * 1024 if match else 0


def measure(config: Config, *, steps: int, guess: Model) -> dict[str, Any]:
    """Run ``config`` in W processes; per-rank figures (the largest rank's), or why it was skipped."""
    need = config.world * (analytic_bytes(config, model=guess)["total"] * 1.15 + 0.4 * GIB)
    if need > available_bytes() - 2 * GIB:
        return {"config": asdict(config), "skipped": f"needs ~{need / GIB:.1f} GiB, {available_bytes() / GIB:.1f} available"}
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(worker, args=(config, steps, _free_port(), queue), nprocs=config.world,
                       join=True, start_method="spawn")
    ranks = [queue.get() for _ in range(config.world)]
    figures = {key: max(r[key] for r in ranks) for key in ("init_s", "init_peak", "held", "peak", "step_s")}
    return {"config": asdict(config), **figures}


def configurations(classes: list[int], *, batch: int, probe_batch: int, big: int) -> list[Config]:
    """The comparison at each C (global batch ``batch``); at C >= ``big`` only what fits a shared
    machine: the dense head and r = 1 need ~17 GiB at 1M classes (see the analytic rows). Two probes at
    20k classes and ``probe_batch`` make the logits large next to the centres, so that ``k`` can be fitted."""
    runs = []
    for count in classes:
        if count < big:
            for kind, world in (("dense", 1), ("sharded", 2), ("dense", 2), ("sharded", 1)):
                runs.append(Config(kind, count, world, batch=batch))
            runs += [Config("sharded", count, 2, 0.1, batch), Config("sharded", count, 1, 0.1, batch)]
        else:
            runs += [Config("dense", count, 1, batch=batch), Config("sharded", count, 2, batch=batch)]
            runs += [Config("sharded", count, 2, 0.1, batch), Config("sharded", count, 1, 0.1, batch)]
    if probe_batch:
        runs += [Config("dense", 20_000, 1, batch=probe_batch), Config("sharded", 20_000, 2, batch=probe_batch)]
    return runs


def cuda_row() -> str:
    """iresnet50 + sharded head, 1M classes, bf16, batch 256 on one CUDA device: samples/s, peak memory."""
    if not torch.cuda.is_available():
        return "CUDA: no CUDA device"
    from facepipe.heads import create_model_parallel_head
    from facepipe.models import create_backbone

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        device = torch.device("cuda", 0)
        backbone = create_backbone("iresnet50", embedding_size=E).to(device)
        head = create_model_parallel_head("cosface", embedding_size=E, num_classes=1_000_000).to(device)
        optimizer = torch.optim.SGD([*backbone.parameters(), *head.parameters()], lr=0.1, momentum=0.9)
        images = torch.randn(256, 3, 112, 112, device=device)
        labels = torch.randint(0, 1_000_000, (256,), device=device)
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = head.loss_and_correct(backbone(images), labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        peak = torch.cuda.max_memory_allocated(device) / GIB
        return f"CUDA {torch.cuda.get_device_name(device)}: {256 / statistics.median(times[1:]):.0f} samples/s, peak {peak:.1f} GiB"
    finally:
        dist.destroy_process_group()


def report(results: list[dict[str, Any]], *, model: Model) -> None:
    mib = 2**20
    print(f"\nE {E}, fp32, SGD momentum; per rank (largest rank); fitted t = {model.t:.2f}, k = {model.k:.2f}")
    print("| head | init s | held after init MiB | peak in steps MiB | analytic MiB | step s |")
    print("|---|---:|---:|---:|---:|---:|")
    for result in results:
        config = Config(**result["config"])
        if "skipped" in result:
            print(f"| {config.name} | skipped: {result['skipped']} | | | | |")
            continue
        analytic = analytic_bytes(config, model=model)["total"] / mib
        print(f"| {config.name} | {result['init_s']:.1f} | {result['held'] / mib:,.0f} | {result['peak'] / mib:,.0f} "
              f"| {analytic:,.0f} | {result['step_s']:.3f} |")


def against_target(results: list[dict[str, Any]]) -> None:
    """Sharded per-rank peak against the dense head's (W = 1) divided by W: the target is within 10 %."""
    done = {Config(**r["config"]): r for r in results if "peak" in r}
    for config, result in sorted(done.items(), key=lambda item: item[0].name):
        dense = done.get(Config("dense", config.classes, 1, batch=config.batch))
        if config.kind == "sharded" and config.world > 1 and config.rate == 1 and dense:
            ratio = result["peak"] / (dense["peak"] / config.world)
            print(f"C={config.classes:,}, W={config.world}, B={config.batch}: sharded peak / (dense peak / W) = "
                  f"{ratio:.3f} (target <= 1.10)")


def projection(*, per_rank_batch: int, model: Model) -> None:
    print(f"\nanalytic, 10M classes, {per_rank_batch} samples per rank, fp32 (GiB per rank)")
    print("| W | r | weights | momentum | gradient | centre temporaries | logits | total |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world in (8, 64):
        for rate in (1.0, 0.1):
            parts = analytic_bytes(Config("sharded", 10_000_000, world, rate, per_rank_batch * world), model=model)
            cells = " | ".join(f"{parts[key] / GIB:.2f}" for key in
                               ("weights", "momentum", "gradient", "centre temporaries", "logits", "total"))
            print(f"| {world} | {rate:g} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", default="100000,1000000", help="comma-separated class counts")
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the W processes)")
    parser.add_argument("--probe-batch", type=int, default=1024, help="global batch of the two k probes (0: none)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--repeats", type=int, default=1, help="passes over all configurations (interleaved)")
    parser.add_argument("--merge", default=None, help="a --json file of an earlier run: its results join the table")
    parser.add_argument("--json", default=None, help="write the raw results here")
    args = parser.parse_args()
    classes = [int(c) for c in args.classes.split(",") if c]
    runs = configurations(classes, batch=args.batch, probe_batch=args.probe_batch, big=1_000_000)
    print(f"load average {os.getloadavg()[0]:.1f}; {available_bytes() / GIB:.1f} GiB available")
    passes = []
    for _ in range(args.repeats):
        passes.append([])
        for config in runs:
            passes[-1].append(measure(config, steps=args.steps, guess=Model(t=5.5, k=4.0)))
            print(json.dumps(passes[-1][-1]), flush=True)
    results = [_median_of(p[i] for p in passes) for i in range(len(runs))]
    if args.merge:
        results = [r for r in json.load(open(args.merge))["results"] if "peak" in r] + results
    model = fit_model(results)
    report(results, model=model)
    against_target(results)
    projection(per_rank_batch=128, model=model)
    print("\n" + cuda_row())
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": asdict(model), "results": results}, handle, indent=1)


def _median_of(samples) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    samples = list(samples)
    if any("skipped" in s for s in samples):
        return next(s for s in samples if "skipped" in s)
    merged = dict(samples[0])
    for key in ("init_s", "init_peak", "held", "peak", "step_s"):
        merged[key] = statistics.median(s[key] for s in samples)
    return merged


if __name__ == "__main__":
    main()
