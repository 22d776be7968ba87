"""Runs ``facepipe train`` (the CLI, as ``python -m facepipe`` would) with test probes attached.

    python tests/train_probe.py [--kill-after-checkpoint K] [--dump-params DIR] -- train PREPARED OUT ...

``--kill-after-checkpoint K``: SIGKILL this process right after the first checkpoint of a step >= K
is in place (a real kill in the middle of training, not a clean exit).
``--dump-params DIR``: after training, every rank saves its parameters to DIR/rank-R.pt, so that a
test can compare the ranks of a torchrun job.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

import facepipe.stages.train as train_stage
import facepipe.training.trainer as trainer_module
from facepipe.cli import main


def kill_after(step: int) -> None:
    original = trainer_module.save_checkpoint

    def save_then_die(directory, state, *, step: int, keep: int):  # type: ignore[no-untyped-def]
        path = original(directory, state, step=step, keep=keep)
        if step >= kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    kill_step = step
    trainer_module.save_checkpoint = save_then_die


def dump_params(directory: Path) -> list:
    models: list = []
    build = train_stage.build_model

    def keep(params, **kwargs):  # type: ignore[no-untyped-def]
        models.append(build(params, **kwargs))
        return models[-1]

    train_stage.build_model = keep
    return models


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-after-checkpoint", type=int, default=None)
    parser.add_argument("--dump-params", type=Path, default=None)
    args, rest = parser.parse_known_args()
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if args.kill_after_checkpoint is not None:
        kill_after(args.kill_after_checkpoint)
    models = dump_params(args.dump_params) if args.dump_params else []
    code = main(rest)
    if args.dump_params and models:
        args.dump_params.mkdir(parents=True, exist_ok=True)
        state = {name: p.detach().cpu() for name, p in models[-1].named_parameters()}
        torch.save(state, args.dump_params / f"rank-{os.environ.get('RANK', '0')}.pt")
    sys.exit(code)
