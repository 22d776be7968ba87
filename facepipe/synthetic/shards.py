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
from facepipe.io.shards import SHARDS_DIR, ShardWriter


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
    payload_pool: int = 0,
) -> Path:
    """Write a complete shard set whose identities are distinguishable colour/pattern classes.

    Identity ``k`` has a fixed random base image; its samples are that image plus noise and a random
    shift, so a model can learn the classes. ``rejects`` (``{"path", "reason", "detail"}``) go to
    rejects.jsonl and the counts as if prepare had rejected them. ``payload_pool`` n > 0: every sample's
    image is one of n noisy images encoded once (sample j of the set gets image j mod n), so a set of
    millions of identities is written in minutes; only counts and labels are then meaningful. Returns
    ``root``.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    identities = [f"id{k:04d}" for k in range(num_identities)]
    landmarks = (ARCFACE_TEMPLATE_112 * image_size / 112).round(3).tolist()
    if payload_pool:
        pool = [_noisy_payload(_base(rng, image_size), rng, quality=quality) for _ in range(payload_pool)]
    else:
        coarse = rng.integers(0, 256, size=(num_identities, 8, 8, 3), dtype=np.uint8)
    with ShardWriter(root / SHARDS_DIR, samples_per_shard=samples_per_shard) as writer:
        for label, name in enumerate(identities):
            base = None if payload_pool else _base(rng, image_size, coarse[label])
            for i in range(samples_per_identity):
                if payload_pool:
                    payload = pool[(label * samples_per_identity + i) % payload_pool]
                else:
                    payload = _noisy_payload(base, rng, quality=quality)
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


def _base(rng: np.random.Generator, image_size: int, coarse: np.ndarray | None = None) -> np.ndarray:
    """An identity's base image ``[S, S, 3]`` int16: its ``[8, 8, 3]`` coarse pattern scaled up."""
    if coarse is None:
        coarse = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    base = np.kron(coarse, np.ones((image_size // 8 + 1, image_size // 8 + 1, 1), np.uint8))
    return base[:image_size, :image_size].astype(np.int16)


def _noisy_payload(base: np.ndarray, rng: np.random.Generator, *, quality: int) -> bytes:
    """One sample of an identity: its base image shifted by up to 3 pixels plus noise, as JPEG."""
    shift = rng.integers(-3, 4, size=2)
    noisy = np.roll(base, tuple(shift), axis=(0, 1)) + rng.normal(0, 12, base.shape)
    return encode_image(np.clip(noisy, 0, 255).astype(np.uint8), quality=quality)
