"""Gallery search (facepipe.gallery.search) against answers computed here, in float64, by brute force:
top-1 is the cosine argmax, an identity scores its best row, ties go by name, k past the identities
lists them all, the faiss flat index and the blocked NumPy path give the exact answer, the
approximate indexes find most of it, and bad input is a one-line FacepipeError."""

from __future__ import annotations

import numpy as np
import pytest

from facepipe.errors import FacepipeError
from facepipe.gallery import search as search_module
from facepipe.gallery.search import Gallery, Match, exact_top_rows, search


def unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def clustered(seed: int, identities: int, per_identity: int, dim: int, probes: int, noise: float = 0.8):
    """Rows around unit identity centres (keys ``id0007``), and probes around random centres."""
    rng = np.random.default_rng(seed)
    centres = unit(rng.standard_normal((identities, dim)))
    labels = np.arange(identities * per_identity) % identities
    gallery = unit(centres[labels] + rng.standard_normal((len(labels), dim)) * noise / np.sqrt(dim))
    chosen = rng.integers(0, identities, probes)
    queries = unit(centres[chosen] + rng.standard_normal((probes, dim)) * noise / np.sqrt(dim))
    return gallery, [f"id{label:04d}" for label in labels], queries


def brute_force(gallery: np.ndarray, keys: list[str], probes: np.ndarray, k: int) -> list[list[tuple[str, float, int]]]:
    """Each identity's best row in float64, sorted by score then name: (identity, score, row)."""
    scores = probes.astype(np.float64) @ gallery.astype(np.float64).T
    answers = []
    for row_scores in scores:
        best: dict[str, tuple[float, int]] = {}
        for row, (key, score) in enumerate(zip(keys, row_scores.tolist())):
            if key not in best or score > best[key][0]:
                best[key] = (score, row)
        ranked = sorted(best.items(), key=lambda item: (-item[1][0], item[0]))[:k]
        answers.append([(key, score, row) for key, (score, row) in ranked])
    return answers


def as_tuples(found: list[list[Match]]) -> list[list[tuple[str, float, int]]]:
    return [[(m.identity, m.score, m.row) for m in matches] for matches in found]


def assert_same(found: list[list[Match]], expected: list[list[tuple[str, float, int]]], atol: float = 1e-5) -> None:
    assert [[(i, r) for i, _, r in matches] for matches in as_tuples(found)] == [[(i, r) for i, _, r in e] for e in expected]
    np.testing.assert_allclose([s for m in as_tuples(found) for _, s, _ in m], [s for e in expected for _, s, _ in e], atol=atol)


@pytest.mark.parametrize("method", ["exact", "faiss"])
def test_top1_is_the_cosine_argmax(method):
    rng = np.random.default_rng(0)
    gallery, probes = unit(rng.standard_normal((700, 48))), unit(rng.standard_normal((25, 48)))
    paths = [f"photos/{i:04d}.jpg" for i in range(700)]  # no identity folders: one key per file
    found = search(gallery, paths, probes, k=1, method=method)
    argmax = (probes.astype(np.float64) @ gallery.astype(np.float64).T).argmax(axis=1)
    assert [m[0].row for m in found] == argmax.tolist()
    assert [m[0].identity for m in found] == [paths[i] for i in argmax]
    np.testing.assert_allclose([m[0].score for m in found], (probes.astype(np.float64) * gallery[argmax]).sum(1), atol=1e-5)


@pytest.mark.parametrize("method", ["exact", "faiss", "auto"])
def test_top_k_identities_are_brute_forces(method):
    gallery, keys, probes = clustered(1, identities=60, per_identity=5, dim=32, probes=40, noise=2.0)
    assert_same(search(gallery, keys, probes, k=7, method=method), brute_force(gallery, keys, probes, 7))


@pytest.mark.parametrize("method", ["exact", "faiss"])
def test_an_identity_scores_its_best_row_once(method):
    # cosines with the probe e0: a 0.1 (row 0) and 0.9 (row 2), b 0.5 (row 1), c 0.3 (row 3)
    gallery = np.array([[0.1, np.sqrt(0.99)], [0.5, np.sqrt(0.75)], [0.9, np.sqrt(0.19)], [0.3, np.sqrt(0.91)]], np.float32)
    found = search(gallery, ["a", "b", "a", "c"], np.array([[1, 0]], np.float32), k=3, method=method)
    assert [(m.identity, m.row) for m in found[0]] == [("a", 2), ("b", 1), ("c", 3)]
    np.testing.assert_allclose([m.score for m in found[0]], [0.9, 0.5, 0.3], atol=1e-6)


@pytest.mark.parametrize("method", ["exact", "faiss"])
def test_ties_go_by_identity_name_then_row(method):
    rng = np.random.default_rng(2)
    top = unit(rng.standard_normal((1, 16)))
    others = unit(rng.standard_normal((6, 16)) + top * 0.1)
    # rows 0..3 score the same: identities c, a, b, and a again (its row 3 never beats row 1)
    gallery = np.concatenate([top, top, top, top, others])
    keys = ["c", "a", "b", "a", "d", "e", "f", "g", "h", "i"]
    found = search(gallery, keys, top, k=4, method=method)
    assert [(m.identity, m.row) for m in found[0][:3]] == [("a", 1), ("b", 2), ("c", 0)]
    assert found[0][0].score == found[0][1].score == found[0][2].score
    assert found[0][3].identity == brute_force(gallery, keys, top, 4)[0][3][0]


@pytest.mark.parametrize("method", ["exact", "faiss"])
def test_an_identity_with_many_rows_ahead_does_not_hide_the_next_ones(method):
    """One identity owns the 60 best rows, more than the first fetch: the search fetches further
    until k identities are known (the rows per identity average 6, so it first asks for 2*2*6)."""
    rng = np.random.default_rng(3)
    probe = unit(rng.standard_normal((1, 24)))
    crowd = unit(probe + rng.standard_normal((60, 24)) * 0.05)  # cosine ~0.97 with the probe
    rest = unit(rng.standard_normal((12, 24)))
    gallery, keys = np.concatenate([crowd, rest]), ["crowd"] * 60 + [f"other{i:02d}" for i in range(12)]
    found = search(gallery, keys, probe, k=2, method=method)
    assert_same(found, brute_force(gallery, keys, probe, 2))
    assert len(found[0]) == 2


@pytest.mark.parametrize("method", ["exact", "faiss"])
def test_k_past_the_identities_lists_every_identity(method):
    gallery, keys, probes = clustered(4, identities=6, per_identity=3, dim=16, probes=5)
    found = search(gallery, keys, probes, k=50, method=method)
    assert all(sorted(m.identity for m in matches) == sorted(set(keys)) for matches in found)
    assert_same(found, brute_force(gallery, keys, probes, 50))


def test_faiss_flat_equals_exact_and_the_index_is_built_once():
    gallery, keys, probes = clustered(5, identities=300, per_identity=4, dim=64, probes=60)
    built = Gallery(gallery, keys)
    exact = built.search(probes, k=5, method="exact")
    index = built.index
    for batch in (probes[:17], probes[17:]):  # two batches through the one index
        start = 0 if len(batch) == 17 else 17
        flat = built.search(batch, k=5, method="faiss")
        assert_same(flat, as_tuples(exact[start : start + len(batch)]), atol=1e-5)
    assert built.index is index and index.ntotal == len(gallery)


def test_auto_is_exact_below_the_threshold_and_faiss_from_it(monkeypatch):
    gallery, keys, probes = clustered(6, identities=50, per_identity=4, dim=32, probes=10)
    built = Gallery(gallery, keys)
    built.search(probes, method="auto")
    assert built._index is None  # 200 rows: NumPy, no index built
    monkeypatch.setattr(search_module, "AUTO_FAISS_FROM", 200)
    built.search(probes, method="auto")
    assert type(built._index).__name__ == "IndexFlatIP"  # the gallery's index, chosen when it was made
    assert Gallery(gallery, keys).index_kind == "ivf" and Gallery(gallery[:199], keys[:199]).index_kind == "flat"
    assert Gallery(gallery, keys, index="flat").index_kind == "flat"


@pytest.mark.parametrize("kind, identities, rows_per_identity", [("ivf", 1500, 8), ("hnsw", 1000, 4)])
def test_approximate_indexes_find_the_exact_top1(kind, identities, rows_per_identity):
    gallery, keys, probes = clustered(7, identities=identities, per_identity=rows_per_identity, dim=64, probes=300)
    built = Gallery(gallery, keys, index=kind)
    exact = [m[0].identity for m in built.search(probes, k=5, method="exact")]
    approximate = built.search(probes, k=5, method="faiss")
    assert type(built.index).__name__ == {"ivf": "IndexIVFFlat", "hnsw": "IndexHNSWFlat"}[kind]
    recall = np.mean([m[0].identity == e for m, e in zip(approximate, exact)])
    assert recall >= 0.95, recall
    assert all(len(m) == 5 and len({x.identity for x in m}) == 5 for m in approximate)


def test_an_index_that_finds_fewer_rows_than_asked_gives_what_it_found(monkeypatch):
    """IVF scanning one list of ~40 rows, asked for 600: faiss pads with row -1, which is no row."""
    monkeypatch.setattr(search_module, "IVF_PROBED_SHARE", 1e-6)  # one list
    gallery, keys, probes = clustered(10, identities=200, per_identity=10, dim=16, probes=20)
    found = Gallery(gallery, keys, index="ivf").search(probes, k=30, method="faiss")
    assert all(1 <= len(matches) <= 30 for matches in found) and min(map(len, found)) < 30
    for matches, probe in zip(found, probes):
        assert all(keys[m.row] == m.identity and m.row >= 0 for m in matches)
        assert len({m.identity for m in matches}) == len(matches)
        np.testing.assert_allclose([m.score for m in matches], gallery[[m.row for m in matches]] @ probe, atol=1e-5)
        assert [m.score for m in matches] == sorted((m.score for m in matches), reverse=True)


def test_blocked_exact_equals_one_block(monkeypatch):
    """Blocks of 7 probes and 13 rows (neither divides 1000 rows nor 30 probes) give the answer of
    one block each; the rows kept per probe (8 or 40) are both under and over a block."""
    gallery, keys, probes = clustered(8, identities=250, per_identity=4, dim=32, probes=30)
    whole = {k: Gallery(gallery, keys).search(probes, k=k, method="exact") for k in (1, 5)}
    rows_whole = exact_top_rows(gallery, probes, 40)
    monkeypatch.setattr(search_module, "PROBE_BLOCK", 7)
    monkeypatch.setattr(search_module, "GALLERY_BLOCK", 13)
    for k in (1, 5):  # the same identities and rows; scores to float32 rounding (BLAS sums by shape)
        assert_same(Gallery(gallery, keys).search(probes, k=k, method="exact"), as_tuples(whole[k]), atol=1e-6)
    scores, rows = exact_top_rows(gallery, probes, 40)
    assert [sorted(r) for r in rows.tolist()] == [sorted(r) for r in rows_whole[1].tolist()]
    np.testing.assert_allclose(np.sort(scores, axis=1), np.sort(rows_whole[0], axis=1), atol=1e-6)
    assert_same(whole[5], brute_force(gallery, keys, probes, 5))


@pytest.mark.parametrize("method", ["exact", "faiss"])
@pytest.mark.parametrize("first", [True, False])
def test_a_tie_below_the_rows_fetched_is_fetched_too(method, first):
    """10 rows of m score 0.9, then 30 one-row identities tie at 0.5: the second identity is the
    first name of the 30 however many of them the first fetches held (t00 first or last in the gallery)."""
    rng = np.random.default_rng(11)
    probe = unit(rng.standard_normal((1, 8)))
    side = unit(rng.standard_normal((1, 8)))
    side = unit(side - (side @ probe.T) * probe)  # orthogonal to the probe
    high, tied = unit(0.9 * probe + np.sqrt(0.19) * side), unit(0.5 * probe + np.sqrt(0.75) * side)
    names = [f"t{i:02d}" for i in range(30)]
    names = names if first else names[::-1]
    gallery, keys = np.concatenate([np.repeat(high, 10, 0), np.repeat(tied, 30, 0)]), ["m"] * 10 + names
    found = search(gallery, keys, probe, k=2, method=method)
    assert [m.identity for m in found[0]] == ["m", "t00"]


def test_unit_rows_within_the_tolerance_are_accepted():
    gallery = np.array([[1.0005, 0.0], [0.0, 0.9995]], np.float32)
    assert search(gallery, ["a", "b"], np.array([[1, 0]], np.float32), k=1)[0][0].identity == "a"


GOOD = unit(np.random.default_rng(9).standard_normal((4, 8)))


@pytest.mark.parametrize(
    "gallery, keys, probes, k, method, message",
    [
        (GOOD, list("abcd"), GOOD[:, :6] / np.linalg.norm(GOOD[:, :6], axis=1, keepdims=True), 1, "exact",
         "the probes have 6 values per row and the gallery 8"),
        (np.empty((0, 8), np.float32), [], GOOD, 1, "exact", "the gallery is empty"),
        (GOOD, list("abcd"), GOOD, 0, "exact", "k must be at least 1, not 0"),
        (np.where(np.arange(8) == 3, np.nan, GOOD), list("abcd"), GOOD, 1, "exact", "gallery row 0 holds a NaN or an infinity"),
        (GOOD, list("abcd"), np.where(np.arange(8) == 0, np.inf, GOOD)[::-1].copy(), 1, "exact", "probes row 0 holds a NaN or an infinity"),
        (GOOD * np.array([[1], [1], [1.01], [1]], np.float32), list("abcd"), GOOD, 1, "exact", "gallery row 2 has L2 norm 1.01, not 1"),
        (GOOD, list("abcd"), GOOD * 0.5, 1, "exact", "probes row 0 has L2 norm 0.5, not 1"),
        (GOOD, list("abc"), GOOD, 1, "exact", "3 keys for 4 gallery rows"),
        (GOOD, list("abcd"), GOOD, 1, "annoy", "unknown search method 'annoy': one of auto, exact, faiss"),
        (GOOD[0], ["a"], GOOD, 1, "exact", "the gallery must be a [rows, E] matrix"),
    ],
    ids=["dimensions", "empty", "k", "nan", "inf", "norm", "probe-norm", "keys", "method", "1-d"],
)
def test_bad_input_is_a_one_line_error(gallery, keys, probes, k, method, message):
    with pytest.raises(FacepipeError) as error:
        search(gallery, keys, probes, k=k, method=method)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_an_unknown_index_is_refused():
    with pytest.raises(FacepipeError, match="unknown faiss index 'lsh': one of flat, ivf, hnsw"):
        Gallery(GOOD, list("abcd"), index="lsh")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- fast exact checks (mutation testing)


def test_exact_searches_without_an_index_whatever_the_gallery_size(monkeypatch):
    monkeypatch.setattr(search_module, "AUTO_FAISS_FROM", 1)  # auto would take the index
    built = Gallery(GOOD, list("abcd"), index="flat")
    assert [m[0].identity for m in built.search(GOOD, k=1, method="exact")] == list("abcd")
    assert built._index is None
    assert [m[0].identity for m in built.search(GOOD, k=1, method="auto")] == list("abcd")
    assert built._index is not None


def test_the_rows_fetched_start_at_twice_k_identities_and_grow_fourfold(monkeypatch):
    """160 rows, 101 identities (2 rows each on average, rounded up): k=2 asks 2*2*2 = 8 rows for
    both probes; the crowd's probe, whose 60 best rows are one identity, asks again for 32 and 128."""
    rng = np.random.default_rng(3)
    probe = unit(rng.standard_normal((1, 24)))
    crowd = unit(probe + rng.standard_normal((60, 24)) * 0.05)
    rest = unit(rng.standard_normal((100, 24)) * 0.2 - probe)  # all well below the crowd
    gallery, keys = np.concatenate([crowd, rest]), ["crowd"] * 60 + [f"other{i:03d}" for i in range(100)]
    probes = np.concatenate([rest[7:8], probe])
    calls = []
    real = search_module.exact_top_rows

    def spy(rows, asked, m):
        calls.append((asked.tolist(), m))
        return real(rows, asked, m)

    monkeypatch.setattr(search_module, "exact_top_rows", spy)
    found = Gallery(gallery, keys).search(probes, k=2, method="exact")
    assert [(len(a), m) for a, m in calls] == [(2, 8), (1, 32), (1, 128)]
    assert calls[1][0] == calls[2][0] == probe.tolist()  # the first probe was done after one fetch
    assert_same(found, brute_force(gallery, keys, probes, 2))


def test_each_faiss_index_kind_its_settings_training_rows_and_added_blocks(monkeypatch):
    """500 rows of 8 added 4 * 8 = 32 at a time; the ivf index (12 lists: sqrt(500) -> 16, at most
    500 // 39) trains on 12 * 10 rows the seed picks, in row order, and scans a quarter of its lists."""
    import faiss

    rows = unit(np.random.default_rng(12).standard_normal((500, 8)))
    added, trained = [], []

    def spied(base):
        class Spy(base):
            def add(self, x):
                added.append(np.array(x))
                super().add(x)

            def train(self, x):
                trained.append(np.array(x))
                super().train(x)

        return Spy

    for name in ("IndexFlatIP", "IndexIVFFlat", "IndexHNSWFlat"):
        monkeypatch.setattr(faiss, name, spied(getattr(faiss, name)))
    monkeypatch.setattr(search_module, "GALLERY_BLOCK", 4)
    monkeypatch.setattr(search_module, "IVF_TRAIN_PER_LIST", 10)
    monkeypatch.setattr(search_module, "IVF_PROBED_SHARE", 0.25)

    def added_whole(index):
        assert [len(x) for x in added] == [32] * 15 + [20]
        np.testing.assert_array_equal(np.concatenate(added), rows)
        assert index.ntotal == 500 and index.metric_type == faiss.METRIC_INNER_PRODUCT and index.d == 8
        added.clear()

    flat = search_module.build_index(rows, "flat")
    assert type(flat).__name__ == "Spy" and isinstance(flat, faiss.IndexFlatIP) and not trained
    np.testing.assert_array_equal(flat.reconstruct_n(0, 500), rows)
    added_whole(flat)

    hnsw = search_module.build_index(rows, "hnsw")
    assert isinstance(hnsw, faiss.IndexHNSWFlat) and not trained
    assert (hnsw.hnsw.nb_neighbors(1), hnsw.hnsw.efConstruction, hnsw.hnsw.efSearch) == (32, 40, 64)
    added_whole(hnsw)

    ivf = search_module.build_index(rows, "ivf", seed=7)
    assert isinstance(ivf, faiss.IndexIVFFlat) and (ivf.nlist, ivf.nprobe) == (12, 3)
    assert (ivf.cp.niter, ivf.cp.seed, ivf.cp.spherical) == (10, 7, True)
    assert faiss.downcast_index(ivf.quantizer).metric_type == faiss.METRIC_INNER_PRODUCT
    sample = np.sort(np.random.default_rng(7).choice(500, size=120, replace=False))
    assert len(trained) == 1
    np.testing.assert_array_equal(trained[0], rows[sample])
    added_whole(ivf)
    # all 12 lists scanned: exact top-1, each row its own best
    ivf.nprobe = 12
    assert ivf.search(rows[:20], 1)[1][:, 0].tolist() == list(range(20))

    monkeypatch.setattr(search_module, "IVF_PROBED_SHARE", 1e-6)  # rounds to no list: one is scanned
    trained.clear()
    assert search_module.build_index(rows, "ivf").nprobe == 1
    np.testing.assert_array_equal(trained[0], rows[np.sort(np.random.default_rng(0).choice(500, size=120, replace=False))])


@pytest.mark.parametrize("rows, lists", [(1, 1), (38, 1), (100, 2), (512, 13), (2000, 32), (10_000, 128), (1 << 20, 1024)])
def test_ivf_lists_is_the_power_of_two_nearest_the_root_at_most_a_list_per_39_rows(rows, lists):
    assert search_module.ivf_lists(rows) == lists


def test_the_default_index_is_flat_below_auto_faiss_from_and_ivf_from_it():
    assert search_module.default_index(search_module.AUTO_FAISS_FROM - 1) == "flat"
    assert search_module.default_index(search_module.AUTO_FAISS_FROM) == "ivf"


def test_matches_are_final_once_k_identities_score_above_the_lowest_row_fetched():
    built = Gallery(np.eye(4, dtype=np.float32), ["a", "b", "c", "b"])
    # fetched: row 0 (a) 0.9, row 1 (b) 0.8, rows 2 (c) and 3 (b) 0.7, the lowest
    scores, rows = np.array([0.7, 0.9, 0.8, 0.7], np.float32), np.array([2, 0, 1, 3])
    found = built._matches(scores, rows, 2, complete=False)
    assert [(m.identity, m.score, m.row) for m in found] == [("a", float(np.float32(0.9)), 0), ("b", float(np.float32(0.8)), 1)]
    assert built._matches(scores, rows, 3, complete=False) is None  # c ties the lowest: a row not fetched could beat it
    assert [(m.identity, m.row) for m in built._matches(scores, rows, 3, complete=True)] == [("a", 0), ("b", 1), ("c", 2)]
    # an index that gives fewer rows than asked (row -1) has no more: what it gave is final
    padded = built._matches(np.array([0.9, 0.8, -3.4e38], np.float32), np.array([0, 1, -1]), 3, complete=False)
    assert [(m.identity, m.row) for m in padded] == [("a", 0), ("b", 1)]


def test_one_search_gives_the_top5_by_default():
    found = search(np.eye(7, dtype=np.float32), list("abcdefg"), np.eye(7, dtype=np.float32)[:2])
    assert [[m.identity for m in matches] for matches in found] == [list("abcde"), list("bacde")]


def test_one_search_passes_its_index_kind_on():
    with pytest.raises(FacepipeError, match="unknown faiss index 'lsh'"):
        search(GOOD, list("abcd"), GOOD, index="lsh")  # type: ignore[arg-type]


def test_exact_top_rows_are_float32_scores_and_int64_rows_of_the_best_m():
    scores, rows = exact_top_rows(GOOD, GOOD[:3], 2)
    assert (scores.dtype, rows.dtype, scores.shape, rows.shape) == (np.float32, np.int64, (3, 2), (3, 2))
    expected = GOOD[:3] @ GOOD.T
    assert [sorted(r) for r in rows.tolist()] == [sorted(np.argsort(-e)[:2].tolist()) for e in expected]
    np.testing.assert_allclose(np.take_along_axis(expected, rows, 1), scores, atol=1e-6)


def test_exact_top_rows_scores_each_probe_block_against_each_gallery_block_once(monkeypatch):
    """5 probes in blocks of 2, 6 rows in blocks of 4, m=3: per probe block, the top of each
    gallery block's scores, then the top of those kept beside the ones before."""
    shapes = []
    real = search_module._top_columns

    def spy(scores, m):
        shapes.append(scores.shape)
        return real(scores, m)

    monkeypatch.setattr(search_module, "_top_columns", spy)
    monkeypatch.setattr(search_module, "PROBE_BLOCK", 2)
    monkeypatch.setattr(search_module, "GALLERY_BLOCK", 4)
    gallery = unit(np.random.default_rng(13).standard_normal((6, 8)))
    probes = unit(np.random.default_rng(14).standard_normal((5, 8)))
    scores, rows = exact_top_rows(gallery, probes, 3)
    assert shapes == [(b, c) for b in (2, 2, 1) for c in (4, 3, 2, 5)]
    expected = probes @ gallery.T
    assert [sorted(r) for r in rows.tolist()] == [sorted(np.argsort(-e)[:3].tolist()) for e in expected]
    np.testing.assert_allclose(np.take_along_axis(expected, rows, 1), scores, atol=1e-6)


def test_checked_names_a_bad_row_past_the_first_block_in_one_whole_line(monkeypatch):
    monkeypatch.setattr(search_module, "GALLERY_BLOCK", 3)  # rows 0-2, 3-5, 6-7
    rows = unit(np.random.default_rng(15).standard_normal((8, 4)))
    checked = search_module._checked(np.asfortranarray(rows.astype(np.float64)), "gallery")
    assert checked.dtype == np.float32 and checked.flags.c_contiguous
    np.testing.assert_array_equal(checked, rows)
    bad = rows.copy()
    bad[7, 1] = np.nan
    with pytest.raises(FacepipeError, match=r"^gallery row 7 holds a NaN or an infinity$"):
        search_module._checked(bad, "gallery")
    bad = rows.copy()
    bad[4] *= 2
    bad[6, 0] = np.inf
    with pytest.raises(FacepipeError) as error:
        search_module._checked(bad, "probes")
    assert str(error.value) == "probes row 4 has L2 norm 2, not 1 (within 0.001): embeddings must be L2-normalised"
    bad = rows.copy()
    bad[5] = [1e20, 0, 0, 0]  # finite, but its sum of squares is past float32
    with pytest.raises(FacepipeError, match=r"^probes row 5 has L2 norm inf, not 1 \(within 0\.001\)"):
        search_module._checked(bad, "probes")
    with pytest.raises(FacepipeError) as error:
        search_module._checked(rows[0], "gallery")
    assert str(error.value) == "the gallery must be a [rows, E] matrix, not an array of shape (4,)"


def test_probes_of_another_width_are_refused_in_one_whole_line():
    narrow = unit(GOOD[:, :6])
    with pytest.raises(FacepipeError) as error:
        Gallery(GOOD, list("abcd")).search(narrow)
    assert str(error.value) == "the probes have 6 values per row and the gallery 8: embeddings of two different models?"
