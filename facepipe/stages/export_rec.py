"""``facepipe export-rec PREPARED OUT``: a shard set as an insightface RecordIO pack.

OUT holds ``train.rec``, ``train.idx`` and ``property.txt`` in the layout arcface_torch's
``MXFaceDataset`` reads (and :mod:`facepipe.stages.import_rec` imports back), plus ``export.json``,
which marks the folder as facepipe's so that a later run may replace it:

- key 0: the header record, flag 2, label ``[n + 1, n + 1 + K]`` (n images, K identities);
- keys 1..n: the images grouped by label in ascending order (within a label, in the set's order),
  flag 0, label = the facepipe label as a float, ``id`` = the key; payload = the stored face as it is
  (JPEG or PNG; both decode with ``mx.image.imdecode``, to RGB);
- keys n + 1 .. n + K: one identity record per label, flag 2, label ``[first key, end key)``;
- property.txt: ``K,S,S`` (S: the set's image size).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from facepipe.errors import FacepipeError
from facepipe.io.atomic import OutputKind, atomic_output_dir, check_output, json_key_file
from facepipe.io.manifest import check_shard_set, dumps
from facepipe.io.insightface_rec import FLOAT32_EXACT, IRHeader, RecordIOWriter, pack
from facepipe.io.shards import ShardSet, sha256_file
from facepipe.progress import Progress

EXPORT_FORMAT = "facepipe-rec-export"

#: An existing OUT is replaced only when it is a pack this command wrote (export.json says so).
REC_PACK = OutputKind(
    "RecordIO export",
    patterns=("train.rec", "train.idx", "property.txt", "export.json"),
    identify=json_key_file("export.json", "version", format=EXPORT_FORMAT),
)


def run(prepared: str | Path, out: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Write the shard set ``prepared`` as a pack in ``out``; returns what export.json says."""
    prepared, out = Path(prepared), Path(out)
    check_output(out, kind=REC_PACK, sources={"shard set": prepared})
    shard_set = check_shard_set(prepared)
    labels = shard_set.labels()
    order = np.argsort(labels, kind="stable")
    n, k = len(order), shard_set.num_identities
    if n + 1 + k > FLOAT32_EXACT:
        raise FacepipeError(f"{n} images and {k} identities exceed the 2^24 keys a RecordIO header's float32 labels hold")
    size = int(shard_set.manifest["image"]["size"])
    with atomic_output_dir(out, kind=REC_PACK) as tmp:
        with RecordIOWriter(tmp / "train.rec", tmp / "train.idx") as writer:
            writer.write(0, pack(IRHeader(2, (float(n + 1), float(n + 1 + k))), b""))
            _write_images(writer, shard_set, order, progress=progress)
            ends = np.searchsorted(labels[order], np.arange(k), side="right") + 1
            for label in range(k):
                first, end = (int(ends[label - 1]) if label else 1), int(ends[label])
                writer.write(n + 1 + label, pack(IRHeader(2, (float(first), float(end)), n + 1 + label), b""))
        (tmp / "property.txt").write_text(f"{k},{size},{size}\n", encoding="utf-8")
        summary = {
            "format": EXPORT_FORMAT,
            "version": 1,
            "num_images": n,
            "num_identities": k,
            "image_size": size,
            "source_manifest_sha256": sha256_file(prepared / "manifest.json"),
            "identities": shard_set.identities,  # label -> name: packs carry numbers only
        }
        (tmp / "export.json").write_text(dumps(summary), encoding="utf-8")
    return summary


def _write_images(writer: RecordIOWriter, shard_set: ShardSet, order: np.ndarray, *, progress: bool) -> None:
    """Keys 1..n: the records of ``order`` (global sample indexes), payloads unchanged."""
    with Progress(len(order), desc="export-rec", enabled=progress) as bar:
        for key, index in enumerate(order.tolist(), start=1):
            record = shard_set.record(index)
            writer.write(key, pack(IRHeader(0, float(record.label), key), record.payload))
            bar.update(1)
