"""Pieces of the scale rehearsal (benchmarks/scale_rehearsal.py) that tests can hold small."""

from __future__ import annotations

import numpy as np

from facepipe.data.dataset import FaceDataset
from facepipe.io.manifest import check_shard_set
from facepipe.synthetic.shards import write_synthetic_shard_set


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


INIT_PROBE = """
import re, sys
from facepipe.heads.centres import BLOCK, init_centres
def status(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
init_centres(0, 2 * BLOCK, embedding_size=8, seed=0)  # code loaded on first use is not counted
before = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
centres = init_centres(0, 100 * BLOCK, embedding_size=512, seed=0)
print((status("VmHWM") - before) / centres.numel() / 4)
"""


def test_initial_centres_cost_their_own_size_once() -> None:
    """A rank's [C_r, E] centres are drawn into place: the peak above the process's RSS is the tensor
    (plus a block), not twice it as when the blocks are drawn apart and concatenated."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", INIT_PROBE], capture_output=True, text=True, check=True)
    assert float(result.stdout) < 1.15, result.stdout
