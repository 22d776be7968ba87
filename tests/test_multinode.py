"""Two "nodes" on loopback: two torchrun launchers joined by a c10d rendezvous on 127.0.0.1.

Each launcher is what one machine of a multi-node job runs (``--nnodes 2 --nproc-per-node 1``). A shared
filesystem is both launchers using the same folders; node-local disks are each launcher working in its
own folder with the same relative paths (what a path broadcast from rank 0 means on another machine).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from train_helpers import PROBE, TORCHRUN, env, load_weights, run_process, synthetic_set, write_params

from facepipe.training.checkpoint import disagreement, list_checkpoints, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.multiprocess

DISAGREE = "processes disagree on how to resume"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_command(port: int, *args: str) -> list[str]:
    """One node's launcher: the rendezvous decides the node ranks (``--node-rank`` is ignored by c10d)."""
    return [
        *TORCHRUN,
        "--nnodes", "2",
        "--nproc-per-node", "1",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", "facepipe-test",
        "--local-addr", "127.0.0.1",
        str(PROBE), *args,
    ]  # fmt: skip


def run_nodes(commands: list[tuple[list[str], Path]], *, timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """Start every (command, working folder) at once, each in its own session; wait for all (at most
    ``timeout`` s in all), then kill whatever is left of each process group."""
    logs = [tempfile.TemporaryFile(mode="w+") for _ in commands]
    procs = [
        subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for (cmd, cwd), log in zip(commands, logs)
    ]
    timed_out = False
    try:
        for proc in procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                break
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    results = []
    for (cmd, _), proc, log in zip(commands, procs, logs):
        log.seek(0)
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, log.read(), None))
        log.close()
    if timed_out:
        raise AssertionError(f"timed out after {timeout} s:\n" + "\n----\n".join(r.stdout[-2000:] for r in results))
    return results


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A shard set, sharded-head params, and a 2-node run on loopback with a shared output folder."""
    root = tmp_path_factory.mktemp("multinode")
    synthetic_set(root / "set", identities=6, per_identity=8)
    write_params(root / "params.yaml", epochs=1, head_parallel="sharded", checkpoint_every=2)
    port = free_port()
    train = ["train", str(root / "set"), str(root / "model"), "--params", str(root / "params.yaml")]
    results = run_nodes(
        [(node_command(port, "--dump-params", str(root / f"node{n}"), "--", *train), root) for n in (0, 1)],
        timeout=240,
    )
    for result in results:
        assert result.returncode == 0, result.stdout[-4000:]
    return root


def test_two_nodes_on_loopback_train_like_one_node_with_two_processes(job: Path) -> None:
    """Same backbone on both nodes, and the same as ``torchrun --standalone --nproc-per-node 2``."""
    dumps = {path.name: load_weights(path) for path in job.glob("node*/rank-*.pt")}
    assert sorted(dumps) == ["rank-0.pt", "rank-1.pt"]  # one process per node
    rank0, rank1 = dumps["rank-0.pt"], dumps["rank-1.pt"]
    backbone = [name for name in rank0 if name.startswith("backbone.")]
    assert len(backbone) > 10 and all(torch.equal(rank0[name], rank1[name]) for name in backbone)
    assert not torch.equal(rank0["head.weight"], rank1["head.weight"])  # each node holds its own classes

    single = job / "single"
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", str(PROBE), "--dump-params", str(single / "ranks"),
           "--", "train", str(job / "set"), str(single / "model"), "--params", str(job / "params.yaml")]  # fmt: skip
    result = run_process(cmd, timeout=240)
    assert result.returncode == 0, result.stdout[-4000:]
    for rank, dump in dumps.items():
        same = load_weights(single / "ranks" / rank)
        assert same.keys() == dump.keys() and all(torch.equal(same[k], dump[k]) for k in dump), rank
    a, b = load_weights(job / "model" / "backbone.pt"), load_weights(single / "model" / "backbone.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _other_weights(path: Path) -> None:
    """Rewrite the checkpoint at ``path`` with other backbone weights (and a valid checksum): an older
    file of the same name on another machine's disk."""
    state = load_checkpoint(path)
    state.pop("checksum")
    name = next(k for k, v in state["backbone"].items() if v.is_floating_point())
    state["backbone"][name] = state["backbone"][name] + 1.0
    save_checkpoint(path.parent, state, step=int(state["step"]), keep=10)


@pytest.mark.parametrize("node_b", ["no checkpoints", "another checkpoint of the same name"])
def test_nodes_that_see_different_checkpoints_fail_together_in_one_line(job: Path, tmp_path: Path, node_b: str) -> None:
    """No shared output folder: node A holds the job's checkpoints, node B none or an older file of
    the same name. Both processes stop with the same one-line error, neither trains nor hangs."""
    nodes = [tmp_path / "a", tmp_path / "b"]
    for node in nodes:
        node.mkdir()
    shutil.copytree(job / "model" / "checkpoints", nodes[0] / "model" / "checkpoints")
    if node_b != "no checkpoints":
        shutil.copytree(job / "model" / "checkpoints", nodes[1] / "model" / "checkpoints")
        _other_weights(list_checkpoints(nodes[1] / "model" / "checkpoints")[-1][1])
    train = ["--", "train", str(job / "set"), "model", "--params", str(job / "params.yaml")]
    port = free_port()
    results = run_nodes([(node_command(port, *train), node) for node in nodes], timeout=120)
    for result in results:
        assert result.returncode != 0, result.stdout[-3000:]
        lines = [line for line in result.stdout.splitlines() if DISAGREE in line]
        assert len(lines) == 1, result.stdout[-3000:]
        assert "rank 0:" in lines[0] and "rank 1:" in lines[0] and "shared" in lines[0], lines[0]
    for node in nodes:
        assert not (node / "model" / "backbone.pt").exists()




def test_the_disagreement_names_what_differs_for_each_group_of_ranks() -> None:
    same = {"resumes from": "step-00000004.pt (step 4, sha256 00ff)", "samples": "48"}
    assert disagreement([same, dict(same), dict(same)]) is None
    other = {**same, "resumes from": "cannot use it: checkpoint unreadable: model/checkpoints/step-00000004.pt"}
    assert disagreement([same, dict(same), dict(same), other]) == (  # the last of many ranks counts too
        "processes disagree on how to resume (resumes from): ranks 0,1,2: resumes from step-00000004.pt "
        "(step 4, sha256 00ff); rank 3: resumes from cannot use it: checkpoint unreadable: "
        "model/checkpoints/step-00000004.pt"
    )
    message = disagreement([same, other, dict(same), dict(other)])
    assert message == (
        "processes disagree on how to resume (resumes from): "
        "ranks 0,2: resumes from step-00000004.pt (step 4, sha256 00ff); "
        "ranks 1,3: resumes from cannot use it: checkpoint unreadable: model/checkpoints/step-00000004.pt"
    )
