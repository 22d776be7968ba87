"""Dask plumbing for prepare and import: a cluster to run on, where a chunk runs (here or on Dask), and
an ordered, bounded map over chunks. (The training data loader's worker count: :mod:`facepipe.training.loader`.)"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

from facepipe.devices import available_cores, worker_gpus
from facepipe.errors import FacepipeError

T = TypeVar("T")
log = logging.getLogger(__name__)


class FutureLike(Protocol):
    def result(self) -> Any: ...


# Dask's nanny starts worker processes with MALLOC_TRIM_THRESHOLD_=65536. Setting any glibc malloc
# threshold switches off glibc's adaptive mmap threshold, so every large temporary (image pyramids,
# network activations) becomes a fresh mmap and page-faults on each use: prepare chunks ran ~35 %
# slower in workers than in-process (benchmarks/README.md). Workers keep glibc's defaults instead.
# The dashboard shows a long prepare's progress per worker; loopback only, like every facepipe server.
DASHBOARD_ADDRESS = "127.0.0.1:8787"

WORKER_CONFIG = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}


@contextmanager
def worker_config(*, fork: bool = False) -> Iterator[None]:
    """Dask configuration for the worker processes facepipe starts (see ``WORKER_CONFIG``). ``fork``:
    start them by forking this process (:func:`can_fork`) instead of spawning fresh interpreters."""
    import dask

    method = {"distributed.worker.multiprocessing-method": "fork"} if fork else {}
    with dask.config.set({**WORKER_CONFIG, **method}):
        yield


def can_fork() -> bool:
    """True when local workers may be forked from this process: on Linux, and before torch is
    imported here (its OpenMP thread pool does not survive a fork). A forked worker starts with this
    process's imports (Dask, NumPy, OpenCV, facepipe) in place: a 2-worker cluster starts in ~0.7 s
    instead of ~3 s, and closes in 0.1 s instead of 1 s (benchmarks/README.md, "start-up"). Workers
    never touch the parent's open files: each opens what it reads itself."""
    return sys.platform.startswith("linux") and "torch" not in sys.modules


#: Local workers per GPU when prepare detects on GPUs: two keep a GPU busy while the other decodes and
#: encodes on the CPU; more would only add CUDA contexts (~300 MB of GPU memory each).
WORKERS_PER_GPU = 2


def default_workers(*, gpus: int = 0) -> int:
    """One worker process per core; with ``gpus`` > 0 (detection on GPUs), ``WORKERS_PER_GPU`` per
    GPU, never more than the cores."""
    cores = available_cores()
    return min(cores, WORKERS_PER_GPU * gpus) if gpus > 0 else cores


def local_workers(workers: int | None, *, chunks: int, device: str = "cpu") -> int:
    """Worker processes worth starting on this machine for ``chunks`` chunks: ``workers`` (default:
    :func:`default_workers` for ``device``), never more than there are chunks, at least 1. One means
    the work runs in this process: a cluster's start (seconds) would only delay the one chunk."""
    wanted = workers or default_workers(gpus=detection_gpus(device))
    return max(1, min(wanted, chunks))


def detection_gpus(device: str, *, device_count: int | None = None) -> int:
    """GPUs the local workers spread over: all those visible for ``auto`` / ``cuda``, none for ``cpu``
    or one named GPU (``cuda:N``, which every worker then uses as told)."""
    from facepipe.devices import cuda_device_count

    if device not in ("auto", "cuda"):
        return 0
    return cuda_device_count() if device_count is None else device_count


def ordered_results(submit: Callable[[T], FutureLike], items: Iterable[T], *, window: int) -> Iterator[Any]:
    """Submit ``items`` lazily, at most ``window`` in flight, and yield their results in item order.

    In-order delivery keeps the writer deterministic; the window bounds memory however many items
    there are (results are consumed as fast as the oldest one finishes).
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    pending: deque[FutureLike] = deque()
    for item in items:
        pending.append(submit(item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def done(value: Any) -> Future:
    """A future that already holds ``value``: the result of work that ran here."""
    future: Future = Future()
    future.set_result(value)
    return future


@contextmanager
def chunk_runner(
    work: Callable[..., Any],
    *args: Any,
    here: bool = False,
    workers: int | None = None,
    scheduler_address: str | None = None,
    device: str = "cpu",
    warm: Callable[[], Any] | None = None,
    broadcast: bool = False,
) -> Iterator[tuple[Callable[[Any], FutureLike], int]]:
    """Where ``work(chunk, *args)`` runs, chunk by chunk: yields a submit function (chunk -> future)
    and the number of workers behind it. ``here``: in this process, one worker, every call a done
    future (no cluster to start; ``warm`` runs here first). Else on Dask (:func:`dask_client`: a local cluster of ``workers``
    processes on ``device``, or the cluster at ``scheduler_address``); ``warm`` runs once on every
    worker before the first chunk (loads a detector before anything is timed); ``broadcast`` sends
    ``args`` to every worker once instead of with each chunk (large arguments)."""
    if here:
        if warm is not None:
            warm()
        yield (lambda chunk: done(work(chunk, *args))), 1
        return
    with dask_client(workers=workers, scheduler_address=scheduler_address, device=device) as client:
        n_workers = max(1, sum(client.nthreads().values()))
        if warm is not None:
            client.run(warm)
        shared = tuple(client.scatter(list(args), broadcast=True)) if broadcast else args
        yield (lambda chunk: client.submit(work, chunk, *shared, pure=False)), n_workers


@contextmanager
def dask_client(
    *,
    workers: int | None = None,
    scheduler_address: str | None = None,
    device: str = "cpu",
    device_count: int | None = None,
) -> Iterator[Any]:
    """A ``distributed.Client``: on an existing cluster, or a ``LocalCluster`` of single-threaded processes
    shut down on exit. Every server of the local cluster (scheduler, workers, and the Dask dashboard on
    ``DASHBOARD_ADDRESS``, or a free port when that one is taken) listens on 127.0.0.1 only.

    With ``device`` auto or cuda and GPUs present (``device_count`` overrides how many, for tests),
    local worker i sees only GPU i mod N (:func:`facepipe.devices.worker_gpus`) and there are
    ``WORKERS_PER_GPU`` workers per GPU by default. An existing cluster's workers keep their own
    placement (dask-cuda's ``dask cuda worker`` gives each one GPU the same way).
    """
    from distributed import Client, LocalCluster

    if scheduler_address:
        try:
            client = Client(scheduler_address, timeout="10s")
        except (OSError, TimeoutError) as error:
            raise FacepipeError(f"cannot reach the Dask scheduler at {scheduler_address}: {error}") from None
        try:
            yield client
        finally:
            client.close()
        return
    with worker_config(fork=can_fork()):
        cluster = LocalCluster(**local_cluster_kwargs(workers=workers, device=device, device_count=device_count))
    client = Client(cluster)
    log.info("Dask dashboard (this machine only): %s", client.dashboard_link)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def local_cluster_kwargs(
    *,
    workers: int | None = None,
    device: str = "cpu",
    device_count: int | None = None,
    silence_logs: int | bool = logging.ERROR,
) -> dict[str, Any]:
    """``LocalCluster`` arguments for detection workers, the CLI's (:func:`dask_client`) and the Prefect
    flow's alike: single-threaded processes listening on 127.0.0.1, one per core (``workers`` to
    choose), and with ``device`` auto or cuda and GPUs present, ``WORKERS_PER_GPU`` per GPU with worker i
    seeing only GPU i mod N."""
    gpus = detection_gpus(device, device_count=device_count)
    n_workers = workers or default_workers(gpus=gpus)
    kwargs: dict[str, Any] = {
        "n_workers": n_workers,
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": DASHBOARD_ADDRESS,
        "silence_logs": silence_logs,
    }
    if gpus:
        kwargs["worker_class"] = _gpu_nanny(worker_gpus(n_workers, device_count=gpus))
        log.info("%d Dask workers on %d GPU(s), %d per GPU at most", n_workers, gpus, -(-n_workers // gpus))
    return kwargs


def _gpu_nanny(visible: list[str]) -> type:
    """A Nanny class whose worker named i starts with ``CUDA_VISIBLE_DEVICES=visible[i]`` (LocalCluster
    names its workers 0, 1, ...)."""
    from distributed import Nanny

    class GPUNanny(Nanny):
        def __init__(self, *args: Any, name: Any = None, env: dict[str, str] | None = None, **kwargs: Any) -> None:
            env = {**(env or {}), "CUDA_VISIBLE_DEVICES": visible[int(name) % len(visible)]}
            super().__init__(*args, name=name, env=env, **kwargs)

    return GPUNanny
