"""How the sampler's epoch order and the identity selection grow with the set (issue 9's scale rehearsal).

In one process, the best of ``--repeats`` runs (the least disturbed; medians of 5 swung 2x here): ``ShardOrderSampler.rank_items`` (rank 0 of 2) on
synthetic ``item_shards`` of 3 samples per identity in shards of 10,000, and ``select_identities`` of 3/4
of the names, at each identity count; next to NumPy's own ``np.sort`` and ``permutation`` of the same
number of items, so growth from the machine's caches can be told from growth in facepipe's algorithms.
Nothing is written to disk.

    python benchmarks/data_path_growth.py [--identities 100000,300000,1000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from facepipe.data.dataset import select_identities
from facepipe.data.batch_order import ShardOrderSampler


def best_seconds(work: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--identities", default="100000,300000,1000000")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    counts = [int(c) for c in args.identities.split(",")]
    rows = []
    for identities in counts:
        samples = 3 * identities
        item_shards = np.repeat(np.arange(-(-samples // 10_000)), 10_000)[:samples]
        sampler = ShardOrderSampler(item_shards, batch_size=128, rank=0, world_size=2, seed=0)
        names = [f"id{i:07d}" for i in range(identities)]
        wanted = names[::4] + names[1::4] + names[2::4]
        rng = np.random.default_rng(0)
        values = rng.integers(0, 2**62, samples)
        rows.append((
            identities, samples, len(wanted),
            best_seconds(sampler.rank_items, args.repeats),
            best_seconds(lambda: select_identities(names, wanted), args.repeats),
            best_seconds(lambda: np.sort(values), args.repeats),
            best_seconds(lambda: rng.permutation(samples), args.repeats),
        ))
    print("| identities | samples | sampler s (ns/sample) | select_identities s (ns/name) | np.sort, M int64 | permutation(M) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for identities, samples, wanted, sampler_s, select_s, sort_s, perm_s in rows:
        print(f"| {identities:,} | {samples:,} | {sampler_s:.3f} ({sampler_s / samples * 1e9:.0f}) | "
              f"{select_s:.3f} ({select_s / wanted * 1e9:.0f}) | {sort_s:.3f} | {perm_s:.3f} |")
    first, last = rows[0], rows[-1]
    print(f"ratio {first[0]:,} -> {last[0]:,} identities: " + ", ".join(
        f"{name} {last[i] / first[i]:.1f}x" for i, name in ((3, "sampler"), (4, "select_identities"), (5, "np.sort"), (6, "permutation"))
    ))


if __name__ == "__main__":
    main()
