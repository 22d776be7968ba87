"""Identity hold-out, verification pair sampling and pair-file formats. Pure: no I/O, no globals.

Everything here works on the label array of a shard set ([N] int64, label = identity index), never
on images, so it costs time and memory in proportion to the samples' labels and the pairs made.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

# How many times the requested negatives the set of all negatives must hold before they are drawn
# by rejection sampling; below it they are enumerated (then there are few of them).
_ENUMERATE_BELOW = 4


@dataclass(frozen=True)
class Pair:
    """One verification pair of a shard set: global sample indexes, their source paths, same identity."""

    index1: int
    path1: str
    index2: int
    path2: str
    same: bool


@dataclass(frozen=True)
class NamedPair:
    """One line of an LFW ``pairs.txt``: identity names and 1-based image numbers."""

    name1: str
    number1: int
    name2: str
    number2: int

    @property
    def same(self) -> bool:
        return self.name1 == self.name2


@dataclass(frozen=True)
class SampledPairs:
    """Pairs drawn by :func:`sample_pairs`.

    ``indexes``: [P, 2] int64 global sample indexes (smaller first); ``same``: [P] bool. ``notes``
    explain every way the result falls short of the request.
    """

    indexes: np.ndarray
    same: np.ndarray
    notes: list[str]
    val_identities_without_positives: int


# --- hold-out ---------------------------------------------------------------------------------------


def holdout_count(num_identities: int, amount: int | float) -> int:
    """Identities to hold out: ``amount`` itself if an int, else ``round(amount * num_identities)``."""
    count = amount if isinstance(amount, int) else round(amount * num_identities)
    if count < 2:
        raise ValueError(f"hold-out of {amount} gives {count} identities; verification needs at least 2")
    if count > num_identities - 1:
        raise ValueError(
            f"hold-out of {amount} gives {count} of {num_identities} identities; training needs at least 1"
        )
    return count


def choose_holdout(names: Sequence[str], amount: int | float, *, seed: int) -> np.ndarray:
    """Label ids ([K] int64, ascending) of the held-out identities.

    Identities are ranked by a seeded hash of their name, not by position, so the choice does not
    depend on the order of ``labels.json`` and an identity keeps its side when others are added
    (as long as the hold-out count does not change).
    """
    count = holdout_count(len(names), amount)
    keys = [hashlib.sha256(f"{seed}\0{name}".encode()).digest() for name in names]
    ranked = sorted(range(len(names)), key=keys.__getitem__)
    return np.sort(np.asarray(ranked[:count], dtype=np.int64))


# --- pair sampling ----------------------------------------------------------------------------------


def _groups(labels: np.ndarray, val_labels: np.ndarray) -> list[np.ndarray]:
    """Sample indexes (ascending) of each held-out identity that has any, in label order."""
    indexes = np.flatnonzero(np.isin(labels, val_labels))
    order = np.argsort(labels[indexes], kind="stable")
    indexes = indexes[order]
    _, starts = np.unique(labels[indexes], return_index=True)
    return [group for group in np.split(indexes, starts[1:]) if len(group)]


def balanced_quotas(capacity: np.ndarray, total: int) -> np.ndarray:
    """Spread ``total`` draws over groups as evenly as their ``capacity`` ([G] int64) allows.

    Water filling in order of capacity: each group takes its equal share of what is left, or all it
    can hold. Rounding pushes the remainder towards the larger groups, which can always absorb it
    when ``total <= capacity.sum()`` (required).
    """
    quota = np.zeros_like(capacity)
    remaining = total
    order = np.argsort(capacity, kind="stable")
    for position, group in enumerate(order):
        quota[group] = min(capacity[group], remaining // (len(order) - position))
        remaining -= quota[group]
    return quota


def triangle_pairs(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode pair numbers ``t`` ([M] int64) into (i, j) with ``0 <= i < j``, where ``t = j(j-1)/2 + i``."""
    j = np.floor((1 + np.sqrt(1 + 8 * t.astype(np.float64))) / 2).astype(np.int64)
    # float rounding can put j one off for huge t; one correction step each way is enough.
    j -= (j * (j - 1) // 2 > t).astype(np.int64)
    j += ((j + 1) * j // 2 <= t).astype(np.int64)
    return t - j * (j - 1) // 2, j


def _positive_pairs(groups: list[np.ndarray], quota: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    chunks = [np.zeros((0, 2), np.int64)]
    for group, count in zip(groups, quota):
        if count:
            capacity = len(group) * (len(group) - 1) // 2
            i, j = triangle_pairs(rng.choice(capacity, size=int(count), replace=False))
            chunks.append(np.stack([group[i], group[j]], axis=1))
    return np.concatenate(chunks)


def _all_negative_pairs(groups: list[np.ndarray]) -> np.ndarray:
    blocks = [np.zeros((0, 2), np.int64)]
    for k, first in enumerate(groups):
        for second in groups[k + 1 :]:
            a, b = np.meshgrid(first, second, indexing="ij")
            blocks.append(np.stack([a.ravel(), b.ravel()], axis=1))
    pairs = np.concatenate(blocks)
    return np.sort(pairs, axis=1)


def _drawn_negative_pairs(groups: list[np.ndarray], count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` distinct different-identity pairs: two distinct identities uniformly, one sample of each."""
    sizes = np.asarray([len(g) for g in groups], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    flat = np.concatenate(groups)
    seen: set[tuple[int, int]] = set()
    chosen: list[tuple[int, int]] = []
    while len(chosen) < count:
        m = 2 * (count - len(chosen)) + 16
        first = rng.integers(len(groups), size=m)
        second = rng.integers(len(groups) - 1, size=m)
        second += second >= first  # a different identity, uniformly
        a = flat[starts[first] + rng.integers(sizes[first])]
        b = flat[starts[second] + rng.integers(sizes[second])]
        for pair in zip(np.minimum(a, b).tolist(), np.maximum(a, b).tolist()):
            if pair not in seen:
                seen.add(pair)
                chosen.append(pair)
                if len(chosen) == count:
                    break
    return np.asarray(chosen, dtype=np.int64).reshape(-1, 2)


def sample_pairs(labels: np.ndarray, val_labels: np.ndarray, *, num_pairs: int, seed: int) -> SampledPairs:
    """Balanced, distinct verification pairs among the samples of the held-out identities.

    ``labels``: [N] int64 label of every sample; ``val_labels``: held-out label ids. Asks for
    ``num_pairs // 2`` same-identity pairs, spread as evenly over identities as their samples allow,
    and as many different-identity pairs (two distinct identities drawn uniformly, then one sample of
    each). Where fewer same-identity pairs exist, takes all of them and as many different ones, and
    says so in ``notes``. The order is shuffled so that any contiguous slice is mixed.
    """
    rng = np.random.default_rng(seed)
    groups = _groups(labels, np.asarray(val_labels, dtype=np.int64))
    notes: list[str] = []
    without = len(val_labels) - sum(len(g) >= 2 for g in groups)
    if without:
        notes.append(f"{without} held-out identities have fewer than 2 samples: no same-identity pairs from them")
    if len(groups) < 2:
        raise ValueError("fewer than 2 held-out identities have samples: no different-identity pairs possible")
    capacity = np.asarray([len(g) * (len(g) - 1) // 2 for g in groups], dtype=np.int64)
    if capacity.sum() == 0:
        raise ValueError("no held-out identity has 2 or more samples: no same-identity pairs possible")
    wanted = num_pairs // 2
    num_positive = min(wanted, int(capacity.sum()))
    if num_positive < wanted:
        notes.append(
            f"only {num_positive} same-identity pairs exist among the held-out samples ({wanted} asked): "
            f"all are used, with as many different-identity pairs"
        )
    positives = _positive_pairs(groups, balanced_quotas(capacity, num_positive), rng)

    sizes = np.asarray([len(g) for g in groups], dtype=np.int64)
    negative_capacity = int((sizes.sum() ** 2 - (sizes**2).sum()) // 2)
    num_negative = min(num_positive, negative_capacity)
    if num_negative < num_positive:
        notes.append(f"only {negative_capacity} different-identity pairs exist ({num_positive} asked): all are used")
    if negative_capacity < _ENUMERATE_BELOW * num_negative:
        every = _all_negative_pairs(groups)
        negatives = every[np.sort(rng.choice(len(every), size=num_negative, replace=False))]
    else:
        negatives = _drawn_negative_pairs(groups, num_negative, rng)

    indexes = np.concatenate([positives, negatives])
    same = np.concatenate([np.ones(len(positives), bool), np.zeros(len(negatives), bool)])
    order = rng.permutation(len(indexes))
    return SampledPairs(indexes[order], same[order], notes, without)


# --- formats ----------------------------------------------------------------------------------------


def format_pairs_jsonl(pairs: Iterable[Pair]) -> str:
    """One JSON object per line, sorted keys: ``{"index1", "index2", "path1", "path2", "same"}``."""
    return "".join(json.dumps(asdict(pair), sort_keys=True, ensure_ascii=False) + "\n" for pair in pairs)


def parse_pairs_jsonl(text: str) -> list[Pair]:
    """Inverse of :func:`format_pairs_jsonl`; raises ValueError naming the first bad line."""
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            pair = Pair(
                index1=row["index1"], path1=row["path1"], index2=row["index2"], path2=row["path2"], same=row["same"]
            )
            if not (
                type(pair.index1) is int
                and type(pair.index2) is int
                and isinstance(pair.path1, str)
                and isinstance(pair.path2, str)
                and isinstance(pair.same, bool)
            ):
                raise TypeError("wrong value types")
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"line {number}: not a pair ({type(error).__name__}: {error})") from None
        pairs.append(pair)
    return pairs


def lfw_image_key(name: str, number: int) -> str:
    """The LFW file of image ``number`` (1-based) of ``name``: ``name/name_000N.jpg``."""
    return f"{name}/{name}_{number:04d}.jpg"


def parse_lfw_pairs(text: str) -> list[NamedPair]:
    """Parse an LFW ``pairs.txt``: a header of counts, then ``name i j`` or ``name1 i name2 j`` lines.

    The header is ``SETS PAIRS`` (``10 300``: ten sets of 300 same then 300 different pairs) or one
    count (``pairsDevTrain.txt``: that many same then as many different). The number of lines must
    match it. Raises ValueError naming the first bad line.
    """
    lines = [line.split() for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    if not lines or not 1 <= len(lines[0]) <= 2 or not all(token.isdigit() for token in lines[0]):
        raise ValueError("line 1: expected a header of one or two counts, such as '10 300'")
    expected = 2 * int(np.prod([int(token) for token in lines[0]]))
    pairs = []
    for number, tokens in enumerate(lines[1:], start=2):
        try:
            if len(tokens) == 3:
                pairs.append(NamedPair(tokens[0], int(tokens[1]), tokens[0], int(tokens[2])))
            elif len(tokens) == 4:
                pairs.append(NamedPair(tokens[0], int(tokens[1]), tokens[2], int(tokens[3])))
            else:
                raise ValueError(f"{len(tokens)} fields")
        except ValueError as error:
            raise ValueError(f"line {number}: expected 'name i j' or 'name1 i name2 j' ({error})") from None
        if min(pairs[-1].number1, pairs[-1].number2) < 1:
            raise ValueError(f"line {number}: image numbers start at 1")
    if len(pairs) != expected:
        raise ValueError(f"header {' '.join(lines[0])!r} promises {expected} pairs, found {len(pairs)}")
    return pairs
