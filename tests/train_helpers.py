"""Shared pieces of the train tests: tiny configurations, synthetic shard sets, subprocess runs."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn

from facepipe.config import TrainParams
from facepipe.heads import create_head
from facepipe.synthetic.shards import write_synthetic_shard_set
from facepipe.training.trainer import FaceModel

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
PROBE = Path(__file__).with_name("train_probe.py")
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]

#: A CPU run small enough for tests: mobilefacenet on 16x16 faces, 16-d embeddings.
TINY: dict[str, Any] = {
    "backbone": "mobilefacenet",
    "embedding_size": 16,
    "head": "cosface",
    "scale": 16.0,
    "batch_size": 8,
    "reference_batch": 8,
    "lr": 0.05,
    "warmup_epochs": 0.0,
    "weight_decay": 5e-4,
    "num_workers": 0,
    "log_every": 1,
    "device": "cpu",
    "augment": {"p_hflip": 0.5, "p_color_jitter": 0.5},
}


def tiny_params(**overrides: Any) -> TrainParams:
    return TrainParams.model_validate({**TINY, **overrides})


def write_params(path: Path, **overrides: Any) -> Path:
    path.write_text(yaml.safe_dump({"train": {**TINY, **overrides}}))
    return path


def synthetic_set(root: Path, *, identities: int = 4, per_identity: int = 12, shard: int = 16, size: int = 16) -> Path:
    return write_synthetic_shard_set(
        root, num_identities=identities, samples_per_identity=per_identity, image_size=size, samples_per_shard=shard
    )


class LinearBackbone(nn.Module):
    """BN-free stand-in: [B, 3, S, S] -> [B, E] by one linear map (exact accumulation tests)."""

    def __init__(self, embedding_size: int, image_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(3 * image_size * image_size, embedding_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.fc(images.flatten(1))


def linear_model(params: TrainParams, *, num_classes: int, image_size: int) -> FaceModel:
    """A model factory for ``run``: the linear stand-in backbone with the configured real head."""
    from facepipe.stages.train import build_head

    return FaceModel(LinearBackbone(params.embedding_size, image_size), build_head(params, num_classes=num_classes))


def env(**extra: str) -> dict[str, str]:
    """A child environment: one thread, loopback only, this checkout importable."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", **extra)
    return base


def run_process(cmd: list[str], *, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; afterwards (or on timeout) kill whatever is left of its process
    group (torchrun's workers, a loader's fork server) so that nothing outlives the test."""
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env(), stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        timed_out = proc.poll() is None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        log.seek(0)
        output = log.read()
    if timed_out:
        raise AssertionError(f"timed out after {timeout} s: {' '.join(cmd)}\n{output[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output, None)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)
