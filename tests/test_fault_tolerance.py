"""Faults in the middle of work: a truncated checkpoint, a training process killed under
``torchrun --max-restarts`` (and a rank that restarts late), a Dask worker killed during
``prepare --scheduler-address``."""

from __future__ import annotations

import csv
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from rawdata import TEST_PARAMS, make_faces_raw
from train_helpers import (
    PROBE,
    TORCHRUN,
    linear_model,
    load_weights,
    run_process,
    synthetic_set,
    tiny_params,
    write_params,
)

from facepipe.config import PrepareParams
from facepipe.stages import prepare
from facepipe.stages.train import run as train
from facepipe.training.checkpoint import list_checkpoints


def losses(out: Path) -> list[float]:
    with open(out / "plots" / "metrics" / "train" / "loss.tsv") as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle, delimiter="\t")]


# -- a checkpoint cut short on disk --------------------------------------------------------------------


def test_a_truncated_checkpoint_is_set_aside_and_the_previous_one_resumed(tmp_path, caplog):
    """The newest checkpoint loses its second half (a full disk, a copy cut short): the run names it in
    a warning, sets it aside, resumes from the one before and ends exactly like the uninterrupted run."""
    shard_set = synthetic_set(tmp_path / "set")
    params = tiny_params(epochs=1, checkpoint_every=2)
    out = tmp_path / "model"
    train(params, shard_set, out, max_steps=4, model_factory=linear_model)
    straight = load_weights(out / "backbone.pt")
    (previous, _), (_, newest) = list_checkpoints(out / "checkpoints")[-2:]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])

    with caplog.at_level(logging.WARNING, logger="facepipe"):
        report = train(params, shard_set, out, max_steps=4, model_factory=linear_model)
    assert report.resumed_from_step == previous == 2 and report.steps == 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checkpoint unreadable" in w and str(newest) in w for w in warnings), warnings
    assert (out / "checkpoints" / f"{newest.name}.corrupt").read_bytes() == data[: len(data) // 2]
    resumed = load_weights(out / "backbone.pt")
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


# -- a training process killed, torchrun restarts the group --------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_killed_process_is_restarted_by_torchrun_and_the_run_ends_as_if_uninterrupted(tmp_path):
    """2 processes, sharded head, 6 steps. SIGKILL of one rank right after the step-2 checkpoint:
    ``--max-restarts 1`` restarts both, they resume at step 2, and the model, the class centres, the
    momentum and the loss curve equal those of a run nobody killed (CPU, gloo: bit for bit)."""
    shard_set = synthetic_set(tmp_path / "set", identities=6, per_identity=8)
    params = write_params(
        tmp_path / "params.yaml", epochs=2, head_parallel="sharded", checkpoint_every=2, num_workers=1
    )
    launch = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    train_args = ["train", str(shard_set)]
    straight, restarted = tmp_path / "straight", tmp_path / "restarted"

    result = run_process([*launch, "-m", "facepipe", *train_args, str(straight), "--params", str(params)], timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    kill = ["--kill-after-checkpoint", "2", "--kill-rank", "1"]  # the rank that writes nothing
    cmd = [*launch, str(PROBE), *kill, "--", *train_args, str(restarted), "--params", str(params)]
    result = run_process(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in result.stdout, result.stdout[-4000:]  # SIGKILL, then a restart
    assert "step 2, epoch 0" in result.stdout and "trained 6/6 steps" in result.stdout, result.stdout[-4000:]

    a, b = load_weights(straight / "backbone.pt"), load_weights(restarted / "backbone.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    final_a = torch.load(straight / "checkpoints" / "step-00000006.pt", weights_only=True)
    final_b = torch.load(restarted / "checkpoints" / "step-00000006.pt", weights_only=True)
    assert torch.equal(final_a["head"]["weight"], final_b["head"]["weight"])  # all centres, gathered
    for state_a, state_b in zip(final_a["optimizer"]["state"].values(), final_b["optimizer"]["state"].values()):
        assert torch.equal(state_a["momentum_buffer"], state_b["momentum_buffer"])
    assert losses(straight) == losses(restarted)


_LATE_RESTART = """
import os, signal, sys, time
import torch
import torch.distributed as dist
from facepipe.training.distributed import init_distributed, shutdown

attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 1:
    time.sleep(15)  # restarted later than rank 0: rank 0 must not meet the dead attempt's addresses
context = init_distributed("cpu")
total = torch.ones(1)
dist.all_reduce(total)
print(f"attempt {attempt} rank {rank} sum {total.item():g}", flush=True)
if attempt == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
shutdown(context)
"""


@pytest.mark.multiprocess
def test_a_restarted_group_forms_even_when_one_rank_restarts_late(tmp_path):
    """torchrun keeps one store across restarts; without a per-attempt prefix a fast rank of the new
    attempt reads a slow rank's address of the killed attempt and gloo fails: "connectFullMesh failed
    ... Connection refused" (seen under load in the restart test above)."""
    script = tmp_path / "late_restart.py"
    script.write_text(_LATE_RESTART)
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", str(script)]
    result = run_process(cmd, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "attempt 1 rank 0 sum 2" in result.stdout and "attempt 1 rank 1 sum 2" in result.stdout


# -- a Dask worker killed during prepare ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _set_bytes(root: Path) -> dict[str, bytes]:
    """Everything of a shard set that must not depend on how it was computed (report.json has timings)."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != "report.json"]
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in files}


@pytest.fixture
def dask_cluster(tmp_path: Path) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A real ``dask scheduler`` and two ``dask worker`` processes on 127.0.0.1 (no nanny, so a killed
    worker stays dead); every one stopped by PID afterwards."""
    from distributed import Client

    address = f"tcp://127.0.0.1:{_free_port()}"
    dask = Path(sys.executable).with_name("dask")
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "start_new_session": True}
    scheduler = subprocess.Popen(
        [dask, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1], "--no-dashboard"], **quiet
    )
    worker_cmd = [dask, "worker", address, "--nthreads", "1", "--no-nanny", "--host", "127.0.0.1", "--no-dashboard"]
    workers = [subprocess.Popen(worker_cmd, **quiet) for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(address, timeout="2s") as client:
                    if len(client.nthreads()) == 2:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the dask cluster did not come up"
            time.sleep(0.5)
        yield address, workers
    finally:
        for proc in (*workers, scheduler):
            if proc.poll() is None:
                proc.terminate()
        for proc in (*workers, scheduler):
            try:
                proc.wait(timeout=5)  # a worker busy in torch code can ignore SIGTERM for 20 s and more
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.multiprocess
def test_a_dask_worker_killed_during_prepare_leaves_the_shard_set_unchanged(tmp_path, dask_cluster):
    """One of two workers is SIGKILLed while it processes a chunk of ``prepare --scheduler-address``:
    the scheduler gives its chunks to the other worker, and the run ends with the very bytes of an
    undisturbed run (shards, manifest, labels, rejects)."""
    from distributed import Client

    address, workers = dask_cluster
    raw = tmp_path / "raw"
    make_faces_raw(raw)
    params = PrepareParams(**{**TEST_PARAMS, "chunk_size": 1})  # many small tasks: the kill lands mid-run
    undisturbed = tmp_path / "undisturbed"
    prepare.run(params, raw, undisturbed, scheduler_address=address, progress=False)  # both workers throughout

    out, outcome = tmp_path / "set", {}

    def run() -> None:
        try:
            outcome["report"] = prepare.run(params, raw, out, scheduler_address=address, progress=False)
        except BaseException as error:  # noqa: BLE001  (reported by the assertion below)
            outcome["error"] = error

    runner = threading.Thread(target=run)
    with Client(address, timeout="10s") as watcher:
        pids = {pid: name for name, pid in watcher.run(os.getpid).items()}
        assert sorted(pids) == sorted(proc.pid for proc in workers)
        runner.start()
        victim, deadline = None, time.monotonic() + 120
        while victim is None and runner.is_alive() and time.monotonic() < deadline:
            busy = [name for name, keys in watcher.processing().items() if keys]
            victim = next((proc for proc in workers if pids[proc.pid] in busy), None)
            time.sleep(0.05)
        assert victim is not None, "no worker ever held a chunk"
        os.kill(victim.pid, signal.SIGKILL)
        killed_mid_run = runner.is_alive()
        runner.join(timeout=180)
        assert not runner.is_alive(), "prepare did not finish after the kill"
        assert victim.wait(timeout=10) == -signal.SIGKILL and len(watcher.nthreads()) == 1
    assert "error" not in outcome, outcome.get("error")
    assert killed_mid_run and outcome["report"]["workers"] == 2
    expected = _set_bytes(undisturbed)
    assert sum(name.startswith("shards/") for name in expected) >= 2 and "manifest.json" in expected
    assert _set_bytes(out) == expected
