"""Validation on insightface ``.bin`` sets while training (``train.validation``).

Rank 0 embeds each set's faces (decoded once, at the start) with the backbone in eval mode and
computes its 10-fold accuracy both ways (facepipe's and insightface's); the other ranks go on to
their next step and wait for rank 0 in its all-reduce, so no collective is added. The history lives
in dvclive beside the loss (``val/<set>/accuracy``, ``val/<set>/insightface_accuracy``,
``val/mean_accuracy``, ``val/seconds``: the pause), the best step is the one of the best mean
accuracy (the first on ties), and with ``keep_best`` that step's backbone is written to ``OUT/best/``.
A resumed run recovers the best step from the history it keeps (rows up to its checkpoint).

Which sets: ``train.validation.sets`` by path, or ``auto`` (also what an absent ``train.validation``
means) for the sets the training shard set carries (:mod:`facepipe.io.validation_sets`: what
``facepipe import`` of an insightface folder brought along), each checked against the sha256 its
manifest lists; a set that carries none is trained without validation.
"""

from __future__ import annotations

import copy
import csv
import logging
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from facepipe.config import ValidationParams
from facepipe.evaluation.bin_sets import decode_bin_faces
from facepipe.evaluation.embed import embed_images
from facepipe.evaluation.insightface_protocol import insightface_verification
from facepipe.evaluation.verification import cosine_scores, kfold_accuracy
from facepipe.io.insightface_bin import read_bin_set
from facepipe.io.model_dir import ModelSpec, save_model_dir
from facepipe.io.shards import ShardSet
from facepipe.io.validation_sets import BinFile, listed_bin_files

log = logging.getLogger("facepipe.training")

PREFIX = "val"
BEST_DIR = "best"
MEAN = f"{PREFIX}/mean_accuracy"


def validation_files(params: ValidationParams | None, *, shard_set: ShardSet) -> list[BinFile]:
    """The .bin files to validate on (empty: no validation): ``params.sets`` by path, or with ``auto`` and
    when ``params`` is None (``train.validation`` absent) the sets ``shard_set`` carries."""
    sets = (params or ValidationParams()).sets
    if sets != "auto":
        return [BinFile(Path(path)) for path in sets]
    carried = listed_bin_files(shard_set.root, shard_set.manifest)
    if carried:  # say why a run without train.validation validates
        log.info("validating on the sets %s carries: %s", shard_set.root, ", ".join(f.path.name for f in carried))
    elif params is not None:
        log.info("train.validation sets: auto, and %s carries no validation set: no validation", shard_set.root)
    return carried


class Validator:
    """Decoded faces of each set, and the best step so far. ``params`` None: the defaults (``files``
    then being the sets the shard set carries)."""

    def __init__(
        self, params: ValidationParams | None, *, files: list[BinFile], image_size: int, device: torch.device,
        out: Path, keep_best: bool, spec: ModelSpec,
    ) -> None:
        params = params or ValidationParams()
        self.every_steps, self.batch_size, self.device = params.every_steps, params.batch_size, device
        self.out, self.keep_best, self.spec = out, keep_best, spec
        self.sets = []
        for file in files:
            bin_set = read_bin_set(file.path, sha256=file.sha256)
            self.sets.append((bin_set.name, decode_bin_faces(bin_set, image_size=image_size), bin_set.same))
        self.best_step: int | None = None
        self.best_accuracy = -1.0

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def recover(self, directory: Path) -> None:
        """The best step of the kept history (``plots/metrics/val/mean_accuracy.tsv``, already trimmed)."""
        path = directory / "plots" / "metrics" / f"{MEAN}.tsv"
        if not path.is_file():
            return
        with open(path, newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle, delimiter="\t"):
                self._consider(int(float(row["step"])), float(row["mean_accuracy"]))

    def _consider(self, step: int, accuracy: float) -> bool:
        if accuracy > self.best_accuracy:
            self.best_step, self.best_accuracy = step, accuracy
            return True
        return False

    @torch.inference_mode()
    def measure(self, backbone: nn.Module) -> dict[str, float]:
        """``{"<set>/accuracy", "<set>/insightface_accuracy", "mean_accuracy"}`` of ``backbone`` (restored to
        its mode afterwards)."""
        was_training = backbone.training
        backbone.eval()
        values: dict[str, float] = {}
        try:
            for name, faces, same in self.sets:
                embeddings = embed_images(
                    backbone, iter(faces), count=len(faces), batch_size=self.batch_size, flip=True,
                    device=self.device, progress=False,
                    normalization=(self.spec.normalization.mean, self.spec.normalization.std),
                )
                accuracies, _ = kfold_accuracy(cosine_scores(embeddings[0::2], embeddings[1::2]), same)
                values[f"{name}/accuracy"] = float(accuracies.mean())
                theirs = insightface_verification(embeddings[0::2], embeddings[1::2], same)
                values[f"{name}/insightface_accuracy"] = theirs.accuracy_mean
        finally:
            backbone.train(was_training)
        values["mean_accuracy"] = float(np.mean([values[f"{name}/accuracy"] for name, _, _ in self.sets]))
        return values

    def validate(self, backbone: nn.Module, step: int) -> dict[str, float]:
        """Measure, time the pause, keep the best; returns the values to log (without the prefix)."""
        started = time.perf_counter()
        values = self.measure(backbone)
        if self._consider(step, values["mean_accuracy"]) and self.keep_best:
            (self.out / BEST_DIR).mkdir(parents=True, exist_ok=True)
            save_model_dir(self.out / BEST_DIR, copy.deepcopy(backbone).cpu(), self.spec)
        values["best_step"] = float(self.best_step)
        values["seconds"] = time.perf_counter() - started
        log.info(
            "validation at step %d: %s (best step %d) in %.1f s", step,
            ", ".join(f"{k} {v:.4f}" for k, v in values.items() if k.endswith("/accuracy")), self.best_step,
            values["seconds"],
        )
        return values
