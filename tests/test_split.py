"""The split stage: hold-out choice, pair sampling (pure) and the stage's files and errors."""

from __future__ import annotations

import json
import time
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from facepipe import cli
from facepipe.config import SplitParams
from facepipe.evaluation.pairs import (
    balanced_quotas,
    choose_holdout,
    holdout_count,
    parse_pairs_jsonl,
    sample_pairs,
    triangle_pairs,
)
from facepipe.io.shards import ShardSet
from facepipe.synthetic.shards import write_synthetic_shard_set
from facepipe.stages import split


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 identities x 5 samples, 16x16 faces."""
    root = tmp_path_factory.mktemp("split") / "prepared"
    return write_synthetic_shard_set(
        root, num_identities=12, samples_per_identity=5, image_size=16, samples_per_shard=7
    )


# --- hold-out ---------------------------------------------------------------------------------------


def test_holdout_count_from_fraction_or_count() -> None:
    assert holdout_count(40, 10) == 10
    assert holdout_count(40, 0.25) == 10
    with pytest.raises(ValueError, match="at least 2"):
        holdout_count(40, 0.01)
    with pytest.raises(ValueError, match="training needs at least 1"):
        holdout_count(40, 40)


def test_choose_holdout_is_seeded_and_ignores_the_order_of_names() -> None:
    names = [f"person{k}" for k in range(50)]
    held = choose_holdout(names, 10, seed=3)
    assert len(held) == 10 and np.all(np.diff(held) > 0)
    np.testing.assert_array_equal(held, choose_holdout(names, 10, seed=3))
    assert not np.array_equal(held, choose_holdout(names, 10, seed=4))
    reordered = names[::-1]
    assert {reordered[k] for k in choose_holdout(reordered, 10, seed=3)} == {names[k] for k in held}


# --- pair sampling ----------------------------------------------------------------------------------


def test_triangle_pairs_enumerate_every_pair_once() -> None:
    n = 40
    i, j = triangle_pairs(np.arange(n * (n - 1) // 2))
    assert list(zip(i.tolist(), j.tolist())) == sorted(combinations(range(n), 2), key=lambda p: (p[1], p[0]))
    big = np.array([10**12, 10**12 + 1, 5 * 10**11 - 1])  # float rounding territory
    i, j = triangle_pairs(big)
    assert np.all(j * (j - 1) // 2 + i == big) and np.all((0 <= i) & (i < j))


@pytest.mark.parametrize("total", [0, 1, 7, 12, 20, 26])
def test_balanced_quotas_fill_evenly_within_capacity(total: int) -> None:
    capacity = np.array([1, 10, 3, 10, 2], dtype=np.int64)
    quota = balanced_quotas(capacity, total)
    assert quota.sum() == total and np.all(quota <= capacity)
    # nobody below capacity is more than one short of anybody else
    open_quota = quota[quota < capacity]
    assert len(open_quota) == 0 or quota.max() - open_quota.min() <= 1


def _labels(sizes: list[int]) -> np.ndarray:
    return np.repeat(np.arange(len(sizes)), sizes).astype(np.int64)


def test_sample_pairs_are_balanced_distinct_and_among_held_out_identities() -> None:
    labels = np.random.default_rng(0).permutation(_labels([6] * 10 + [30] * 10))
    val = np.arange(0, 20, 2)
    result = sample_pairs(labels, val, num_pairs=200, seed=1)
    a, b = result.indexes.T
    assert result.same.sum() == 100 and (~result.same).sum() == 100
    assert np.all(a < b) and len({tuple(p) for p in result.indexes.tolist()}) == 200
    assert np.all(np.isin(labels[a], val)) and np.all(np.isin(labels[b], val))
    np.testing.assert_array_equal(labels[a] == labels[b], result.same)
    # same-identity pairs spread evenly over identities, not in proportion to their pairs of samples
    per_identity = np.bincount(labels[a[result.same]], minlength=20)[val]
    assert per_identity.max() - per_identity.min() <= 1
    assert result.notes == []
    # deterministic for a seed, different for another
    again = sample_pairs(labels, val, num_pairs=200, seed=1)
    np.testing.assert_array_equal(again.indexes, result.indexes)
    assert not np.array_equal(sample_pairs(labels, val, num_pairs=200, seed=2).indexes, result.indexes)


def test_sample_pairs_takes_all_same_pairs_when_short_and_says_so() -> None:
    labels = _labels([3, 1, 2, 4])  # same-identity pairs: 3 + 0 + 1 + 6 = 10
    result = sample_pairs(labels, np.arange(4), num_pairs=50, seed=0)
    assert result.same.sum() == 10 and (~result.same).sum() == 10
    assert result.val_identities_without_positives == 1
    assert any("fewer than 2 samples" in note for note in result.notes)
    assert any("only 10 same-identity pairs" in note for note in result.notes)


def test_sample_pairs_enumerates_few_negatives() -> None:
    labels = _labels([5, 1])  # 10 same pairs, only 5 different ones
    result = sample_pairs(labels, np.arange(2), num_pairs=20, seed=0)
    assert result.same.sum() == 10 and (~result.same).sum() == 5
    assert any("only 5 different-identity pairs" in note for note in result.notes)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [([5, 0, 0], "fewer than 2 held-out identities"), ([1, 1, 1], "no held-out identity has 2 or more")],
)
def test_sample_pairs_errors(sizes: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sample_pairs(_labels(sizes), np.arange(3), num_pairs=10, seed=0)


def test_sample_pairs_on_millions_of_labels_is_quick() -> None:
    labels = np.random.default_rng(0).integers(0, 20_000, size=3_000_000)
    started = time.perf_counter()
    val = choose_holdout([f"id{k}" for k in range(20_000)], 0.1, seed=0)
    result = sample_pairs(labels, val, num_pairs=6000, seed=0)
    assert len(result.indexes) == 6000
    assert time.perf_counter() - started < 30  # seconds on a busy 2-core machine; ~2 s when idle


# --- the stage --------------------------------------------------------------------------------------


def test_split_stage_files(prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Split reads labels and the headers of paired samples only, never an image.
    monkeypatch.setattr("facepipe.io.records.decode_image", _forbidden)
    summary = split.run(SplitParams(val_identities=4, num_pairs=40, seed=0), prepared, tmp_path / "out")
    out = tmp_path / "out"
    names = ["pairs.jsonl", "split.json", "train_identities.json", "val_identities.json"]
    assert sorted(p.name for p in out.iterdir()) == names
    shard_set = ShardSet(prepared)
    train = json.loads((out / "train_identities.json").read_text())
    val = json.loads((out / "val_identities.json").read_text())
    assert len(val) == 4 and not set(train) & set(val) and sorted(train + val) == sorted(shard_set.identities)
    pairs = parse_pairs_jsonl((out / "pairs.jsonl").read_text())
    assert len(pairs) == 40 and sum(p.same for p in pairs) == 20
    labels = shard_set.labels()
    for pair in pairs:
        assert shard_set.record(pair.index1).path == pair.path1 and shard_set.record(pair.index2).path == pair.path2
        assert shard_set.identities[labels[pair.index1]] in val and shard_set.identities[labels[pair.index2]] in val
        assert (labels[pair.index1] == labels[pair.index2]) == pair.same
    assert json.loads((out / "split.json").read_text()) == summary
    assert summary["train"] == {"identities": 8, "samples": 40}
    assert summary["val"] == {"identities": 4, "samples": 20, "identities_without_positives": 0}
    assert summary["pairs"] == {"requested": 40, "total": 40, "same": 20, "different": 20}


def _forbidden(*args: object) -> None:
    raise AssertionError("split decoded an image")


def test_split_stage_is_deterministic(prepared: Path, tmp_path: Path) -> None:
    params = SplitParams(val_identities=0.25, num_pairs=30, seed=5)
    split.run(params, prepared, tmp_path / "a")
    split.run(params, prepared, tmp_path / "b")
    for name in ("pairs.jsonl", "split.json", "train_identities.json", "val_identities.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_failed_split_leaves_the_old_output(prepared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    split.run(SplitParams(val_identities=4, num_pairs=20), prepared, out)
    before = (out / "pairs.jsonl").read_bytes()

    def broken(*args: object) -> str:
        raise RuntimeError("disk full")

    monkeypatch.setattr(split, "format_pairs_jsonl", broken)
    with pytest.raises(RuntimeError):
        split.run(SplitParams(val_identities=5, num_pairs=20), prepared, out)
    assert (out / "pairs.jsonl").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left


def test_split_cli(prepared: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    params = tmp_path / "params.yaml"
    params.write_text("split:\n  val_identities: 3\n  num_pairs: 20\n")
    assert cli.main(["split", str(prepared), str(tmp_path / "out"), "--params", str(params)]) == 0
    assert "val 3 identities (15 samples), 20 pairs (10 same, 10 different)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("params_text", "prepared_name", "message"),
    [
        ("split:\n  num_pairs: 20\n", "missing", "shard set not found"),
        ("split:\n  val_fraction: 0.2\n", None, "unknown key 'split.val_fraction'"),
        ("split:\n  val_identities: 1.5\n", None, "a fraction must be < 1"),
        ("split:\n  val_identities: 12\n", None, "training needs at least 1"),
    ],
)
def test_split_cli_errors(
    prepared: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    params_text: str,
    prepared_name: str | None,
    message: str,
) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(params_text)
    source = tmp_path / prepared_name if prepared_name else prepared
    assert cli.main(["split", str(source), str(tmp_path / "out"), "--params", str(params)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("facepipe split: error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()

