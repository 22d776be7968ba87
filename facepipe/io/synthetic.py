"""Synthetic shard sets: for tests and throughput benchmarks that need no face detection."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from facepipe.alignment import ARCFACE_TEMPLATE_112
from facepipe.io.manifest import build_manifest, write_metadata
from facepipe.io.records import encode_image, encode_record
from facepipe.io.shards import ShardWriter


def write_synthetic_shard_set(
    root: str | Path,
    *,
    num_identities: int = 4,
    samples_per_identity: int = 8,
    image_size: int = 112,
    samples_per_shard: int = 16,
    seed: int = 0,
    quality: int = 90,
    rejects: Sequence[Mapping[str, Any]] = (),
) -> Path:
    """Write a complete shard set whose identities are distinguishable colour/pattern classes.

    Identity ``k`` has a fixed random base image; its samples are that image plus noise and a random
    shift, so a model can learn the classes. ``rejects`` (``{"path", "reason", "detail"}``) go to
    rejects.jsonl and the counts as if prepare had rejected them. Returns ``root``.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    identities = [f"id{k:04d}" for k in range(num_identities)]
    landmarks = (ARCFACE_TEMPLATE_112 * image_size / 112).round(3).tolist()
    coarse = rng.integers(0, 256, size=(num_identities, 8, 8, 3), dtype=np.uint8)
    with ShardWriter(root / "shards", samples_per_shard=samples_per_shard) as writer:
        for label, name in enumerate(identities):
            base = np.kron(coarse[label], np.ones((image_size // 8 + 1, image_size // 8 + 1, 1), np.uint8))
            base = base[:image_size, :image_size].astype(np.int16)
            for i in range(samples_per_identity):
                shift = rng.integers(-3, 4, size=2)
                noisy = np.roll(base, tuple(shift), axis=(0, 1)) + rng.normal(0, 12, base.shape)
                payload = encode_image(np.clip(noisy, 0, 255).astype(np.uint8), quality=quality)
                header = {
                    "label": label,
                    "path": f"{name}/{i:04d}.jpg",
                    "landmarks": landmarks,
                    "box": [0.0, 0.0, float(image_size), float(image_size)],
                    "score": 1.0,
                    "sha256": f"{label:032x}{i:032x}",
                    "encoding": "jpeg",
                    "size": [image_size, image_size],
                }
                writer.write(encode_record(header, payload), label=label, payload_bytes=len(payload))
        shards = writer.close()
    total = num_identities * samples_per_identity
    manifest = build_manifest(
        shards,
        image={"size": image_size, "encoding": "jpeg", "quality": quality, "template": "arcface"},
        num_identities=num_identities,
        counts={"scanned": total + len(rejects), "accepted": total, "rejected": len(rejects)},
        params={"synthetic": True, "seed": seed},
    )
    manifest["rejected_by_reason"] = dict(sorted(Counter(str(r["reason"]) for r in rejects).items()))
    write_metadata(root, manifest=manifest, identities=identities, rejects=rejects)
    return root
