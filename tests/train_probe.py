"""Runs ``facepipe train`` (the CLI, as ``python -m facepipe`` would) with test probes attached.

    python tests/train_probe.py [--kill-after-checkpoint K] [--dump-params DIR] -- train PREPARED OUT ...

``--kill-after-checkpoint K``: SIGKILL this process right after the first checkpoint of a step >= K
is in place (a real kill in the middle of training, not a clean exit). ``--kill-rank R`` (default 0):
only the process of that rank dies (one that writes nothing waits until rank 0's file is in place).
Under torchrun only the first attempt dies, so a group that ``--max-restarts`` restarts runs on.
``--dump-params DIR``: after training, every rank saves its parameters to DIR/rank-R.pt, so that a
test can compare the ranks of a torchrun job; with ``--with-buffers`` its buffers too (BatchNorm's
running statistics and batch counts: the whole state dict).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

import facepipe.stages.train as train_stage
import facepipe.training.trainer as trainer_module
from facepipe.cli import main
from facepipe.training.checkpoint import checkpoint_name


def kill_after(step: int, *, rank: int = 0) -> None:
    original = trainer_module.Trainer._save

    def save_then_die(self, options):  # type: ignore[no-untyped-def]
        saved = original(self, options)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if saved >= step and self.context.rank == rank and first_attempt:
            written = options.out / checkpoint_name(saved)
            deadline = time.monotonic() + 60
            while not written.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        return saved

    trainer_module.Trainer._save = save_then_die


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
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--dump-params", type=Path, default=None)
    parser.add_argument("--with-buffers", action="store_true")
    args, rest = parser.parse_known_args()
    rest = rest[1:] if rest[:1] == ["--"] else rest
    if args.kill_after_checkpoint is not None:
        kill_after(args.kill_after_checkpoint, rank=args.kill_rank)
    models = dump_params(args.dump_params) if args.dump_params else []
    code = main(rest)
    if args.dump_params and models:
        args.dump_params.mkdir(parents=True, exist_ok=True)
        named = models[-1].state_dict().items() if args.with_buffers else models[-1].named_parameters()
        state = {name: p.detach().cpu() for name, p in named}
        torch.save(state, args.dump_params / f"rank-{os.environ.get('RANK', '0')}.pt")
    sys.exit(code)
