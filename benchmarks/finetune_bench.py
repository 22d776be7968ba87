"""What a pretrained start buys (a benchmark, not a test): held-out verification accuracy after
fine-tuning a pretrained backbone on new identities, against training from scratch with the same steps.

    .venv/bin/python benchmarks/finetune_bench.py [--identities 60] [--images 8] [--json FILE]

1. ``facepipe sample-data`` photos (``--identities`` x ``--images``), prepared (MTCNN, arcface crops
   of ``--image-size``, 64 px by default to keep it to minutes on 2 cores) and split: ``--held-out`` identities for verification pairs, never trained on;
2. the other identities cut in two, disjoint: ``--pretrain-share`` of them pretrain a backbone
   (``--pretrain-epochs``), the rest are the "new" identities fine-tuned on;
3. on the new identities, with the same steps (``--epochs``): from scratch; from the pretrained backbone
   (``train.init_from``); and from it with ``freeze_epochs: 1``;
4. each model evaluated on the held-out pairs (10-fold accuracy, AUC), and the pretrained backbone too,
   as it is (no fine-tuning).

Everything runs on the CPU in this process (one torch thread per core given); the sample photos and
all seeds are fixed, so the figures repeat on one machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import facepipe  # noqa: F401  (offline environment defaults)
from facepipe.config import EvaluateParams, PrepareParams, SampleDataParams, SplitParams, TrainParams
from facepipe.synthetic.photos import make_sample_dataset
from facepipe.stages import evaluate, prepare, split
from facepipe.stages.train import run as train

#: The demo's training settings (params.yaml), on CPU.
BASE = {
    "backbone": "mobilefacenet",
    "embedding_size": 128,
    "head": "cosface",
    "scale": 32.0,
    "margin": 0.2,
    "batch_size": 32,
    "reference_batch": 128,
    "lr": 0.1,
    "warmup_epochs": 1,
    "grad_clip": 5.0,
    "weight_decay": 5e-4,
    "device": "cpu",
    "num_workers": 0,
    "checkpoint_every": 0,
    "log_every": 50,
    "seed": 0,
    "augment": {"p_hflip": 0.5, "p_color_jitter": 0.5, "p_crop": 0.3, "p_blur": 0.1, "p_grayscale": 0.05},
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--identities", type=int, default=60)
    parser.add_argument("--images", type=int, default=8, help="photos per identity")
    parser.add_argument("--held-out", type=int, default=12, help="identities of the verification pairs")
    parser.add_argument("--pretrain-share", type=float, default=0.7, help="share of the others that pretrain")
    parser.add_argument("--image-size", type=int, default=64, help="face side (the demo's 112 costs 3x the time)")
    parser.add_argument("--pretrain-epochs", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=5, help="epochs on the new identities, every variant")
    parser.add_argument("--pairs", type=int, default=600)
    parser.add_argument("--workdir", type=Path, default=None, help="keep the photos, sets and models here (reused)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as scratch:
        work = args.workdir or Path(scratch)
        result = bench(args, work)
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["machine"] = {"python": sys.version.split()[0], "torch": torch.__version__, "cpu": platform.processor()}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    raw = work / f"raw-{args.identities}x{args.images}"
    prepared, splits = work / f"prepared-{raw.name}-{args.image_size}", work / f"split-{raw.name}-{args.image_size}"
    if not raw.exists():
        sample = SampleDataParams(identities=args.identities, images_per_identity=args.images, seed=0, bad_files=False)
        make_sample_dataset(raw, sample)
    if not prepared.exists():
        prepare.run(PrepareParams(image_size=args.image_size), raw, prepared, workers=2, progress=False)
    if not splits.exists():
        split.run(SplitParams(val_identities=args.held_out, num_pairs=args.pairs, seed=0), prepared, splits)
    trainable = json.loads((splits / "train_identities.json").read_text())
    cut = round(len(trainable) * args.pretrain_share)
    old, new = trainable[:cut], trainable[cut:]
    pairs = splits / "pairs.jsonl"
    timings: dict[str, float] = {}

    def fit(name: str, identities: list[str], **overrides: Any) -> Path:
        out = work / f"{name}-{prepared.name}"
        if out.exists():
            shutil.rmtree(out)  # every variant trains afresh
        t0 = time.perf_counter()
        report = train(TrainParams.model_validate({**BASE, **overrides}), prepared, out, identities=identities)
        timings[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {report.steps} steps, loss {report.loss:.3f}, {timings[name]} s", file=sys.stderr)
        return out

    def score(model: Path) -> dict[str, float]:
        params = EvaluateParams(device="cpu", folds=10)
        out = work / f"eval-{model.name}"
        if out.exists():
            shutil.rmtree(out)
        metrics = evaluate.run(params, model, prepared, out, pairs=pairs, progress=False)
        return {"accuracy": metrics["accuracy_mean"], "std": metrics["accuracy_std"], "auc": metrics["auc"]}

    pretrained = fit("pretrained", old, epochs=args.pretrain_epochs)
    variants = {
        "from scratch": fit("scratch", new, epochs=args.epochs),
        "pretrained, fine-tuned": fit("finetuned", new, epochs=args.epochs, init_from=str(pretrained)),
        "pretrained, fine-tuned, freeze_epochs 1": fit(
            "finetuned-freeze", new, epochs=args.epochs, init_from=str(pretrained), freeze_epochs=1
        ),
    }
    results = {"pretrained, not fine-tuned": score(pretrained)}
    results.update({name: score(model) for name, model in variants.items()})
    return {
        "setup": {
            "identities": args.identities,
            "image_size": args.image_size,
            "images_per_identity": args.images,
            "held_out": args.held_out,
            "pretrain_identities": len(old),
            "new_identities": len(new),
            "pretrain_epochs": args.pretrain_epochs,
            "epochs": args.epochs,
            "pairs": args.pairs,
        },
        "held_out_verification": results,
        "train_seconds": timings,
    }


if __name__ == "__main__":
    raise SystemExit(main())
