"""The split stage: a shard set -> identity-disjoint train / validation identities + verification pairs.

Works from the per-shard label indexes: its cost grows with identities and pairs, never with the
images (only the headers of the paired samples are read, for their paths).

Outputs (all deterministic for the same shard set and params)::

    OUT/train_identities.json   JSON list of identity names for training, in label order
    OUT/val_identities.json     JSON list of the held-out identity names, in label order
    OUT/pairs.jsonl             one pair a line: {"index1", "index2", "path1", "path2", "same"}
    OUT/split.json              counts, the resolved params and notes on any shortfall
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from facepipe.config import SplitParams
from facepipe.errors import FacepipeError
from facepipe.evaluation.pairs import Pair, choose_holdout, format_pairs_jsonl, sample_pairs
from facepipe.io.atomic import OutputKind, atomic_output_dir, check_output, json_key_file
from facepipe.io.manifest import dumps
from facepipe.io.shards import ShardSet

log = logging.getLogger("facepipe.split")

TRAIN_FILE = "train_identities.json"
VAL_FILE = "val_identities.json"
PAIRS_FILE = "pairs.jsonl"
SUMMARY_FILE = "split.json"

#: An existing OUT is replaced only when it holds these files and nothing else.
SPLIT_OUTPUT = OutputKind(
    "split",
    patterns=(TRAIN_FILE, VAL_FILE, PAIRS_FILE, SUMMARY_FILE),
    identify=json_key_file(SUMMARY_FILE, "params", "train", "val", "pairs"),
)


def run(params: SplitParams, prepared: str | Path, out: str | Path) -> dict[str, Any]:
    """Split the shard set ``prepared`` into ``out``; returns the summary (also ``split.json``)."""
    check_output(out, kind=SPLIT_OUTPUT, sources={"shard set": prepared})
    shard_set = ShardSet(prepared)
    labels = shard_set.labels()
    names = shard_set.identities
    try:
        # only identities with samples are held out: a grown set (prepare --update) keeps the labels of
        # identities whose files were all removed, and such an empty class can be neither side of a pair
        present = np.flatnonzero(np.bincount(labels, minlength=len(names)) > 0)
        val_labels = present[choose_holdout([names[i] for i in present], params.val_identities, seed=params.seed)]
        sampled = sample_pairs(labels, val_labels, num_pairs=params.num_pairs, seed=params.seed)
    except ValueError as error:
        raise FacepipeError(f"cannot split {prepared} ({len(names)} identities): {error}") from None

    paths = {int(i): shard_set.record(int(i)).path for i in np.unique(sampled.indexes)}
    pairs = [
        Pair(index1=a, path1=paths[a], index2=b, path2=paths[b], same=same)
        for (a, b), same in zip(sampled.indexes.tolist(), sampled.same.tolist())
    ]
    is_val = np.zeros(len(names), dtype=bool)
    is_val[val_labels] = True
    samples = np.bincount(labels, minlength=len(names))
    summary = {
        "params": params.model_dump(mode="json"),
        "prepared": {"num_identities": len(names), "num_samples": len(labels)},
        "train": {"identities": int((~is_val).sum()), "samples": int(samples[~is_val].sum())},
        "val": {
            "identities": int(is_val.sum()),
            "samples": int(samples[is_val].sum()),
            "identities_without_positives": sampled.val_identities_without_positives,
        },
        "pairs": {
            "requested": params.num_pairs,
            "total": len(pairs),
            "same": int(sampled.same.sum()),
            "different": int((~sampled.same).sum()),
        },
        "notes": sampled.notes,
    }
    with atomic_output_dir(out, kind=SPLIT_OUTPUT) as tmp:
        (tmp / TRAIN_FILE).write_text(dumps([name for name, val in zip(names, is_val) if not val]), encoding="utf-8")
        (tmp / VAL_FILE).write_text(dumps([name for name, val in zip(names, is_val) if val]), encoding="utf-8")
        (tmp / PAIRS_FILE).write_text(format_pairs_jsonl(pairs), encoding="utf-8")
        (tmp / SUMMARY_FILE).write_text(dumps(summary), encoding="utf-8")
    for note in sampled.notes:
        log.warning("split: %s", note)
    return summary


def summary_line(summary: dict[str, Any]) -> str:
    train, val, pairs = summary["train"], summary["val"], summary["pairs"]
    return (
        f"split: train {train['identities']} identities ({train['samples']} samples), "
        f"val {val['identities']} identities ({val['samples']} samples), "
        f"{pairs['total']} pairs ({pairs['same']} same, {pairs['different']} different)"
    )
