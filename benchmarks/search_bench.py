"""Gallery search (``facepipe.gallery.search``): latency, memory, index build time and recall@1 of
the exact NumPy path, the faiss flat index and the approximate indexes, side by side.

Data: clustered synthetic embeddings, like a real gallery: ``N / --rows-per-identity`` identity
centres drawn uniformly on the unit sphere, each row its centre plus Gaussian noise (``--noise``, the
norm of the noise against the unit centre) renormalised; probes are fresh noisy draws around random
centres. Every method runs through ``Gallery.search`` (identity top-k, k=5), on the same gallery, in
one process, one size after another:

- "batch ms": median over ``--repeats`` of one call with ``--probes`` probes; "probe ms": median of
  single-probe calls (``--singles`` of them);
- "build s": the gallery check (exact) or the faiss index build, once;
- "peak MiB": the rise of the process's peak RSS (VmHWM, reset through /proc/self/clear_refs) over
  its RSS before, during the build and the searches of that method;
- "recall@1": the share of ``--recall-probes`` probes whose top-1 identity is the exact path's.

Run: ``nice -n 10 .venv/bin/python benchmarks/search_bench.py > /tmp/search.md``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from facepipe.gallery import search as gallery_search
from facepipe.gallery.search import Gallery


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000,1000000", help="gallery rows, comma-separated")
    parser.add_argument("--dims", default="512,128", help="embedding sizes, comma-separated")
    parser.add_argument("--methods", default="exact,flat,ivf,hnsw", help="exact and faiss index kinds")
    parser.add_argument("--hnsw-max", type=int, default=10_000, help="largest gallery to build an HNSW graph for (its build is slow)")
    parser.add_argument("--probes", type=int, default=100, help="probes per batch")
    parser.add_argument("--recall-probes", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3, help="batch calls per method (median)")
    parser.add_argument("--singles", type=int, default=9, help="single-probe calls per method (median)")
    parser.add_argument("--rows-per-identity", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.7, help="noise norm around a unit identity centre")
    parser.add_argument("--nprobe", default="4,8,16,32,64,128", help="IVF lists scanned: the sweep of the last table")
    parser.add_argument("-k", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faiss-threads", type=int, default=0, help="faiss's OpenMP threads (0: faiss's default, one per core)")
    return parser


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as handle:
        return int(next(line for line in handle if line.startswith(field + ":")).split()[1]) / 1024


def reset_peak() -> float:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")
    return rss_mib()


def clustered(rng: np.random.Generator, centres: np.ndarray, labels: np.ndarray, noise: float) -> np.ndarray:
    """Unit rows: ``centres[labels]`` plus Gaussian noise of norm ~``noise``, built 64k rows at a time."""
    dim = centres.shape[1]
    out = np.empty((len(labels), dim), np.float32)
    for start in range(0, len(labels), 65536):
        part = labels[start : start + 65536]
        rows = centres[part] + rng.standard_normal((len(part), dim), dtype=np.float32) * np.float32(noise / np.sqrt(dim))
        out[start : start + len(part)] = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    return out


def unit(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    centres = rng.standard_normal((rows, dim), dtype=np.float32)
    return centres / np.linalg.norm(centres, axis=1, keepdims=True)


def median_ms(call: Callable[[], object], repeats: int, *, budget_s: float = 20) -> float:
    """The median of ``repeats`` calls, or of those done when they pass ``budget_s`` (slow flat scans)."""
    times: list[float] = []
    while len(times) < repeats and sum(times) < budget_s * 1000:
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def measure(gallery: Gallery, method: str, probes: np.ndarray, recall: np.ndarray, truth: list[str] | None, args) -> dict:
    """One method on one gallery: build, batch and single latency, peak memory, top-1 identities."""
    before = reset_peak()
    started = time.perf_counter()
    if method != "exact":
        gallery.index  # noqa: B018 - builds it
    build = time.perf_counter() - started
    mode = "exact" if method == "exact" else "faiss"
    batch = median_ms(lambda: gallery.search(probes, k=args.k, method=mode), args.repeats)
    singles = iter(range(args.singles))
    single = median_ms(lambda: gallery.search(probes[next(singles) : ][:1], k=args.k, method=mode), args.singles)
    batch_top = [[(m.identity, m.score) for m in matches] for matches in gallery.search(probes, k=args.k, method=mode)]
    # the flat scan is exact by construction (and tested): its recall probes are not worth the time
    top1 = None if method == "flat" else [matches[0].identity for matches in gallery.search(recall, k=args.k, method=mode)]
    peak = rss_mib("VmHWM") - before
    row = {"method": method, "build_s": build, "batch_ms": batch, "probe_ms": single, "peak_mib": peak, "top1": top1, "batch_top": batch_top}
    if truth is not None and top1 is not None:
        row["recall"] = float(np.mean([a == b for a, b in zip(top1, truth)]))
    return row


def one_size(rows: int, dim: int, args, out: list[dict], sweep: list[dict]) -> None:
    rng = np.random.default_rng(args.seed)
    identities = rows // args.rows_per_identity
    centres = unit(rng, identities, dim)
    labels = np.arange(rows) % identities
    embeddings = clustered(rng, centres, labels, args.noise)
    keys = [f"id{label:07d}" for label in labels.tolist()]
    probes = clustered(rng, centres, rng.integers(0, identities, args.probes), args.noise)
    recall = clustered(rng, centres, rng.integers(0, identities, args.recall_probes), args.noise)
    truth, reference = None, None
    for method in args.methods.split(","):
        if method == "hnsw" and rows > args.hnsw_max:
            continue
        started = time.perf_counter()
        gallery = Gallery(embeddings, keys, index="flat" if method == "exact" else method, seed=args.seed)
        check = time.perf_counter() - started
        row = measure(gallery, method, probes, recall, truth, args)
        if method == "exact":
            truth, reference = row["top1"], row["batch_top"]
        row["same_as_exact"] = same_as_exact(row["batch_top"], reference)
        row.update(rows=rows, dim=dim, check_s=check, gallery_mib=embeddings.nbytes / 2**20)
        out.append(row)
        print(f"# {rows} x {dim} {method}: {row['batch_ms']:.1f} ms/batch, {row['probe_ms']:.2f} ms/probe, build {row['build_s']:.1f} s", file=sys.stderr, flush=True)
        if method == "ivf":
            sweep.extend(nprobe_sweep(gallery, probes, recall, truth, rows, dim, args))
        del gallery


def same_as_exact(found: list[list[tuple[str, float]]], reference: list[list[tuple[str, float]]]) -> str:
    """The share of the batch's top-k lists that name the exact path's identities in order; when all
    do, the largest score gap."""
    same = [[n for n, _ in a] == [n for n, _ in b] for a, b in zip(found, reference)]
    if not all(same):
        return f"{np.mean(same):.2f}"
    gap = max(abs(x - y) for a, b in zip(found, reference) for (_, x), (_, y) in zip(a, b))
    return f"all (score gap {gap:.0e})"


def nprobe_sweep(gallery: Gallery, probes, recall, truth, rows, dim, args) -> list[dict]:
    found = []
    for nprobe in map(int, args.nprobe.split(",")):
        gallery.index.nprobe = nprobe
        single = median_ms(lambda: gallery.search(probes[:1], k=args.k, method="faiss"), args.singles)
        batch = median_ms(lambda: gallery.search(probes, k=args.k, method="faiss"), args.repeats)
        top1 = [m[0].identity for m in gallery.search(recall, k=args.k, method="faiss")]
        recall1 = float(np.mean([a == b for a, b in zip(top1, truth)])) if truth else float("nan")
        found.append({"rows": rows, "dim": dim, "nprobe": nprobe, "probe_ms": single, "batch_ms": batch, "recall": recall1})
    gallery.index.nprobe = max(1, round(gallery.index.nlist * gallery_search.IVF_PROBED_SHARE))
    return found


def table(results: list[dict], sweep: list[dict], args) -> str:
    lines = [
        f"k={args.k}, batches of {args.probes} probes, {args.rows_per_identity} rows per identity, noise {args.noise},"
        f" recall@1 over {args.recall_probes} probes against exact; IVF nprobe lists x {gallery_search.IVF_PROBED_SHARE:g},"
        f" HNSW M={gallery_search.HNSW_LINKS} efSearch={gallery_search.HNSW_SEARCH_CANDIDATES}",
        "",
        "| gallery | method | check s | build s | batch ms (median) | per probe in batch ms | single probe ms (median) | peak MiB (gallery MiB) | top-k lists = exact | recall@1 |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        recall = {"exact": "1 (reference)", "flat": "1 (exact scan)"}.get(r["method"]) or f"{r['recall']:.3f}"
        lines.append(
            f"| {r['rows']:,} x {r['dim']} | {r['method']} | {r['check_s']:.2f} | {r['build_s']:.2f} | {r['batch_ms']:.1f} |"
            f" {r['batch_ms'] / args.probes:.2f} | {r['probe_ms']:.2f} | {r['peak_mib']:.0f} ({r['gallery_mib']:.0f}) | {r['same_as_exact']} | {recall} |"
        )
    lines += ["", "IVF lists scanned per probe (nprobe) against recall@1:", "",
              "| gallery | lists | nprobe | single probe ms | batch ms | recall@1 |", "|---|---:|---:|---:|---:|---:|"]
    for s in sweep:
        lines.append(
            f"| {s['rows']:,} x {s['dim']} | {gallery_search.ivf_lists(s['rows'])} | {s['nprobe']} | {s['probe_ms']:.2f} |"
            f" {s['batch_ms']:.1f} | {s['recall']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.faiss_threads:
        import faiss

        faiss.omp_set_num_threads(args.faiss_threads)
    results: list[dict] = []
    sweep: list[dict] = []
    for dim in map(int, args.dims.split(",")):
        for rows in map(int, args.sizes.split(",")):
            one_size(rows, dim, args, results, sweep)
    print(table(results, sweep, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
