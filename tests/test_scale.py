"""Pieces of the scale rehearsal (benchmarks/scale_rehearsal.py) that tests can hold small."""

from __future__ import annotations

import numpy as np

from facepipe.data.dataset import FaceDataset
from facepipe.io.manifest import check_shard_set
from facepipe.io.synthetic import write_synthetic_shard_set


def test_a_pooled_synthetic_set_is_a_complete_set_with_repeating_payloads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = write_synthetic_shard_set(
        tmp_path / "set", num_identities=7, samples_per_identity=3, image_size=16, samples_per_shard=5, payload_pool=4
    )
    shard_set = check_shard_set(root)  # manifest, hashes and counts agree
    assert len(shard_set) == 21 and shard_set.num_identities == 7
    assert np.array_equal(shard_set.labels(), np.repeat(np.arange(7), 3))
    dataset = FaceDataset(shard_set, normalize=False)
    payloads = [dataset.read(i) for i in range(len(dataset))]
    images = [dataset[i][0] for i in range(len(dataset))]
    assert all(np.array_equal(images[i], images[i + 4]) for i in range(len(images) - 4))  # sample j: payload j mod 4
    assert len({bytes(p) for p in payloads}) == 21  # records differ (their headers); the images repeat
