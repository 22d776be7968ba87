"""Search a gallery of face embeddings: for each probe, the top-k identities by cosine similarity.

Every row of the gallery belongs to an identity (a key: an identity folder's name, or a file's path
when the gallery has none); one identity may own many rows. An identity's score for a probe is the
best cosine over its rows, so the answer is a ranking of identities, never of rows.

Two ways to the same answer:

- ``exact``: NumPy, blocked over probes and over gallery rows, so the memory it takes beside the
  gallery is bounded whatever the gallery or the batch: at most ``PROBE_BLOCK x GALLERY_BLOCK``
  float32 scores (16 MiB) and ``argpartition``'s int64 positions of the same shape (32 MiB), plus the
  rows kept per probe; about 50 MiB for a 1M x 512 gallery as for a 1k one.
- ``faiss``: a faiss index built once per :class:`Gallery` (on its first faiss search) and reused for
  every batch of probes. ``flat`` is an exact inner-product scan: the same identities as ``exact``,
  scores equal to float tolerance. ``ivf`` (inverted lists, ``IVF_PROBED_SHARE`` of them scanned
  per probe) and ``hnsw`` (a graph) are approximate: recall@1 against exact is in benchmarks/README.md
  ("gallery search"). Each holds a copy of the gallery (N x E x 4 bytes). Unless one is named, a
  gallery of fewer than ``AUTO_FAISS_FROM`` rows gets ``flat`` and a larger one ``ivf``.
- ``auto``: ``exact`` below ``AUTO_FAISS_FROM`` rows, the gallery's faiss index from there on.

Both fetch a probe's best rows and walk them down: the best rows of k distinct identities are
enough only when every identity not yet seen must score lower, so the row count grows (x4) until k
identities score strictly above the lowest row fetched (or every row is fetched). Ties are broken
by identity name, then by row: the same input gives the same list.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from facepipe.config import SearchMethod
from facepipe.errors import FacepipeError

#: faiss index kinds: ``flat`` exact inner product; ``ivf`` (inverted lists) and ``hnsw`` (a graph)
#: approximate.
IndexKind = Literal["flat", "ivf", "hnsw"]

#: Probes and gallery rows per score block of the exact path (the memory bound above).
PROBE_BLOCK = 128
GALLERY_BLOCK = 32768
#: How far from 1 a row's L2 norm may be (float16 storage of a unit row is off by ~1e-3 at worst).
UNIT_TOLERANCE = 1e-3
#: ``auto`` searches exactly below this many gallery rows and with the gallery's faiss index from it.
#: benchmarks/README.md ("gallery search", 2 vCPU AMD EPYC, 512-d): NumPy's exact batch beats faiss's
#: flat scan at every size and an IVF index's build up to 1M rows (100k: 1.1 s a batch of 100 probes,
#: 0.12 s one probe); at 1M one exact probe reads the whole 2 GB gallery (0.7-1.1 s) where the IVF
#: index answers in 56 ms at recall@1 0.99, after a 90-110 s build paid back in ~200 single probes.
AUTO_FAISS_FROM = 1_000_000
#: The share of its inverted lists an ``ivf`` index scans per probe: 1/16 kept recall@1 against exact
#: at 0.99 or more from 10k to 1M rows, where a fixed 16 lists fell to 0.92 at 1M (benchmarks/README.md).
IVF_PROBED_SHARE = 1 / 16
#: k-means of the ``ivf`` index: rows sampled per list to train on, and iterations.
IVF_TRAIN_PER_LIST = 64
IVF_ITERATIONS = 10
#: The ``hnsw`` graph: links per node, and candidates kept while building and while searching.
HNSW_LINKS, HNSW_BUILD_CANDIDATES, HNSW_SEARCH_CANDIDATES = 32, 40, 64


@dataclass(frozen=True)
class Match:
    """One identity found for a probe: its best cosine (in [-1, 1]) and the gallery row that gave it."""

    identity: str
    score: float
    row: int


#: (probes [P, E] float32, rows wanted m) -> scores [P, m] float32 and rows [P, m] int64 (-1: none).
Fetch = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]


class Gallery:
    """A checked gallery: ``embeddings`` [N, E] float32 unit rows and ``keys`` (N identities, row by row).

    The faiss index of kind ``index`` (by default :func:`default_index` of N) is built on the first
    faiss search and kept for the next ones (``seed`` picks the rows an ``ivf`` index trains on).
    """

    def __init__(self, embeddings: np.ndarray, keys: Sequence[str], *, index: IndexKind | None = None, seed: int = 0) -> None:
        if np.size(embeddings) == 0:
            raise FacepipeError("the gallery is empty: there is nothing to search")
        self.embeddings = _checked(embeddings, "gallery")
        if len(keys) != len(self.embeddings):
            raise FacepipeError(f"{len(keys)} keys for {len(self.embeddings)} gallery rows: give one key per row")
        index = default_index(len(self.embeddings)) if index is None else index
        if index not in get_args(IndexKind):
            raise FacepipeError(f"unknown faiss index {index!r}: one of {', '.join(get_args(IndexKind))}")
        #: the identities, sorted: a row's code is its identity's position, so codes sort as names do
        self.identities: list[str] = sorted(set(keys))
        position = {name: i for i, name in enumerate(self.identities)}
        self.codes = np.fromiter((position[key] for key in keys), dtype=np.int64, count=len(keys))
        self.index_kind: IndexKind = index
        self.seed = seed
        self._index: Any = None

    def __len__(self) -> int:
        return len(self.embeddings)

    @property
    def index(self) -> Any:
        """The faiss index of the gallery (built on first use)."""
        if self._index is None:
            self._index = build_index(self.embeddings, self.index_kind, seed=self.seed)
        return self._index

    def search(self, probes: np.ndarray, *, k: int = 5, method: SearchMethod = "auto") -> list[list[Match]]:
        """For each probe of ``probes`` ([P, E] float32 unit rows), its ``min(k, identities)`` best
        identities: score descending, ties by identity name."""
        probes = _checked(probes, "probes")
        if probes.shape[1] != self.embeddings.shape[1]:
            raise FacepipeError(
                f"the probes have {probes.shape[1]} values per row and the gallery {self.embeddings.shape[1]}:"
                " embeddings of two different models?"
            )
        if k < 1:
            raise FacepipeError(f"k must be at least 1, not {k}")
        return self._top_identities(probes, k, self._fetch(method))

    def _fetch(self, method: str) -> Fetch:
        if method not in get_args(SearchMethod):
            raise FacepipeError(f"unknown search method {method!r}: one of {', '.join(get_args(SearchMethod))}")
        if method == "exact" or (method == "auto" and len(self) < AUTO_FAISS_FROM):
            return lambda probes, m: exact_top_rows(self.embeddings, probes, m)
        return lambda probes, m: _faiss_top_rows(self.index, probes, m)

    def _top_identities(self, probes: np.ndarray, k: int, fetch: Fetch) -> list[list[Match]]:
        found: list[list[Match] | None] = [None] * len(probes)
        pending = np.arange(len(probes))
        # enough rows for k identities of average size, twice over: one fetch in the common case
        wanted = min(len(self), 2 * k * math.ceil(len(self) / len(self.identities)))
        while len(pending):
            scores, rows = fetch(probes[pending], wanted)
            complete = wanted >= len(self)
            for i, probe in enumerate(pending.tolist()):
                found[probe] = self._matches(scores[i], rows[i], k, complete=complete)
            pending = np.array([p for p in pending.tolist() if found[p] is None], dtype=np.int64)
            wanted = min(len(self), wanted * 4)
        return found  # type: ignore[return-value]

    def _matches(self, scores: np.ndarray, rows: np.ndarray, k: int, *, complete: bool) -> list[Match] | None:
        """The k best identities among fetched rows (``scores``, ``rows`` [m], row -1: none), or None
        when rows not fetched could still change them."""
        fetched = rows >= 0
        complete = complete or not fetched.all()  # an index that returns fewer rows has no more
        scores, rows = scores[fetched], rows[fetched]
        codes = self.codes[rows]
        order = np.lexsort((rows, codes, -scores))
        firsts = np.unique(codes[order], return_index=True)[1]
        best = order[np.sort(firsts)]  # each identity's best row, best identity first
        # a row not fetched scores at most the lowest fetched: identities above it are final
        if not complete and np.count_nonzero(scores[best] > scores.min()) < k:
            return None
        return [Match(self.identities[codes[i]], float(scores[i]), int(rows[i])) for i in best[:k].tolist()]


def search(
    embeddings: np.ndarray,
    keys: Sequence[str],
    probes: np.ndarray,
    *,
    k: int = 5,
    method: SearchMethod = "auto",
    index: IndexKind | None = None,
) -> list[list[Match]]:
    """One search of ``probes`` [P, E] in a gallery (``embeddings`` [N, E], ``keys`` [N]); for many
    batches, build a :class:`Gallery` once and call its ``search``."""
    return Gallery(embeddings, keys, index=index).search(probes, k=k, method=method)


def exact_top_rows(gallery: np.ndarray, probes: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``min(m, N)`` best rows of ``gallery`` [N, E] for each of ``probes`` [P, E], unordered:
    scores [P, m] float32 and rows [P, m] int64. Memory beside the inputs is bounded by the blocks."""
    m = min(m, len(gallery))
    scores = np.empty((len(probes), m), np.float32)
    rows = np.empty((len(probes), m), np.int64)
    for p0 in range(0, len(probes), PROBE_BLOCK):
        block = probes[p0 : p0 + PROBE_BLOCK]
        kept_scores = np.empty((len(block), 0), np.float32)
        kept_rows = np.empty((len(block), 0), np.int64)
        for g0 in range(0, len(gallery), GALLERY_BLOCK):
            block_scores = block @ gallery[g0 : g0 + GALLERY_BLOCK].T
            top = _top_columns(block_scores, m)
            kept_scores = np.concatenate([kept_scores, np.take_along_axis(block_scores, top, axis=1)], axis=1)
            kept_rows = np.concatenate([kept_rows, top + g0], axis=1)
            top = _top_columns(kept_scores, m)
            kept_scores, kept_rows = np.take_along_axis(kept_scores, top, 1), np.take_along_axis(kept_rows, top, 1)
        scores[p0 : p0 + len(block)], rows[p0 : p0 + len(block)] = kept_scores, kept_rows
    return scores, rows


def _top_columns(scores: np.ndarray, m: int) -> np.ndarray:
    """Positions [B, min(m, C)] of the m largest of each row of ``scores`` [B, C], unordered."""
    columns = scores.shape[1]
    if columns <= m:
        return np.broadcast_to(np.arange(columns), scores.shape)
    return np.argpartition(scores, columns - m, axis=1)[:, columns - m :]


def _faiss_top_rows(index: Any, probes: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    scores, rows = index.search(np.ascontiguousarray(probes), m)
    return scores, rows


def default_index(rows: int) -> IndexKind:
    """The faiss index of a gallery of ``rows`` rows unless one is named: the exact ``flat`` scan
    below ``AUTO_FAISS_FROM`` rows, where ``auto`` searches exactly, and ``ivf`` from there on."""
    return "flat" if rows < AUTO_FAISS_FROM else "ivf"


def ivf_lists(rows: int) -> int:
    """Inverted lists of an ``ivf`` index over ``rows`` rows: the power of two nearest sqrt(rows),
    at most one per 39 rows (faiss's minimum of training points per centroid)."""
    lists = 1 << max(0, round(math.log2(math.sqrt(rows))))
    return max(1, min(lists, rows // 39))


def build_index(embeddings: np.ndarray, kind: IndexKind, *, seed: int = 0) -> Any:
    """A faiss inner-product index of kind ``kind`` holding ``embeddings`` [N, E] float32 (row i is id i)."""
    import faiss  # only a faiss search needs it

    rows, dim = embeddings.shape
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, HNSW_LINKS, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction, index.hnsw.efSearch = HNSW_BUILD_CANDIDATES, HNSW_SEARCH_CANDIDATES
    else:
        lists = ivf_lists(rows)
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, lists, faiss.METRIC_INNER_PRODUCT)
        index.cp.niter, index.cp.seed, index.cp.spherical = IVF_ITERATIONS, seed, True
        sample = np.random.default_rng(seed).choice(rows, size=min(rows, lists * IVF_TRAIN_PER_LIST), replace=False)
        index.train(embeddings[np.sort(sample)])
        index.nprobe = max(1, round(lists * IVF_PROBED_SHARE))
    for start in range(0, rows, GALLERY_BLOCK * 8):
        index.add(embeddings[start : start + GALLERY_BLOCK * 8])
    return index


def _checked(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` as a C-contiguous float32 matrix, or a one-line error: not 2-D, not finite, or a
    row whose L2 norm is off 1 by more than ``UNIT_TOLERANCE`` (checked block by block)."""
    array = np.ascontiguousarray(values, dtype=np.float32)
    if array.ndim != 2:
        raise FacepipeError(f"the {what} must be a [rows, E] matrix, not an array of shape {array.shape}")
    for start in range(0, len(array), GALLERY_BLOCK):
        block = array[start : start + GALLERY_BLOCK]
        norms = np.sqrt(np.einsum("ij,ij->i", block, block))
        if not np.isfinite(norms).all():  # a NaN or an infinity, or a sum of squares past float32
            finite = np.isfinite(block).all(axis=1)
            if not finite.all():
                raise FacepipeError(f"{what} row {start + int(np.argmin(finite))} holds a NaN or an infinity")
        off = ~(np.abs(norms - 1) <= UNIT_TOLERANCE)
        if off.any():
            row = int(np.argmax(off))
            raise FacepipeError(
                f"{what} row {start + row} has L2 norm {norms[row]:.6g}, not 1 (within {UNIT_TOLERANCE}):"
                " embeddings must be L2-normalised"
            )
    return array
