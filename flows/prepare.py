"""Prefect flow for the prepare stage: the library's ``prepare.run`` with groups of chunks as Prefect tasks on Dask.

Run: ``python -m flows.prepare RAW OUT [--params params.yaml] [--workers N] [--scheduler-address ADDR]``.
Outputs are byte-identical to ``facepipe prepare`` (same chunks, same ordered writer).

A task carries up to :data:`CHUNKS_PER_TASK` chunks (``prepare.task_groups``: large groups first,
single chunks at the end): each task run costs its worker, this process and the Prefect server
fixed work (state events, logs), which one task per chunk made a third of the run
(benchmarks/README.md). A group is still the unit that is retried, and a failure names its chunk.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Literal

import facepipe  # noqa: F401  - offline environment first
from facepipe.config import PrepareParams, load_section
from facepipe.errors import FacepipeError
from facepipe.cluster import local_cluster_kwargs, worker_config
from facepipe.quality import REPORT_FILE
from facepipe.stages import prepare as prepare_stage
from facepipe.stages.prepare import Outcome, process_chunks, warm_up
from prefect import flow, task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.cache_policies import NONE as NO_CACHE
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture
from prefect_dask import DaskTaskRunner

from flows.api import api_shared_with_workers
from flows.logs import configure_console, dask_silence


#: The most chunks (of ``prepare.chunk_size`` files) one task carries: 8 x 16 photos, about 6 s of a
#: worker's time, against well under a second of fixed cost per task run.
CHUNKS_PER_TASK = 8


@task(name="prepare-chunks", task_run_name="prepare-chunks {first}-{last}", cache_policy=NO_CACHE, retries=1,
      retry_delay_seconds=2)
def prepare_chunks(
    chunks: list[list[str]], raw: str, params: PrepareParams, device: str, *, first: int, last: int
) -> list[list[Outcome]]:
    """Chunks ``first`` to ``last`` (numbers in the run, for the UI) through the stage's chunk worker.

    Per-image problems are rejects; what escapes is a worker fault (memory, a lost file system),
    retried once (the whole group), then raised as ``prepare.ChunkFailed`` naming the chunk, so the
    flow's failure says where.
    """
    return process_chunks(chunks, raw, params, device)


def warm_worker(params: PrepareParams, device: str) -> None:
    """Ready a Dask worker before the first chunk task is timed, as the CLI's workers are: the detector
    loaded, and Prefect's task engine imported and its logging set up (about 2.5 s of one core, which
    each worker's first task paid inside the processing phase). Runs in the worker: this module is
    imported there by reference, with Prefect."""
    import prefect.task_engine  # noqa: F401 - imported for its cost, now rather than in the first task
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()
    warm_up(params, device)


@flow(name="facepipe-prepare", log_prints=True)
def prepare_flow(
    raw: str, out: str, params_file: str | None = None, workers: int | None = None, device: str = "auto",
    update: bool | Literal["auto"] = False,
) -> dict[str, Any]:
    """Prepare ``raw`` into the shard set ``out`` with the ``prepare`` section of ``params_file``
    (None: params.yaml, all defaults if absent; a named file must exist)."""
    params = load_section(params_file, "prepare")

    def warm() -> None:
        # every Dask worker loads the detector and Prefect's engine at once, before the first chunk task
        runner = FlowRunContext.get().task_runner
        if isinstance(runner, DaskTaskRunner):
            runner.client.run(warm_worker, params, device)  # starts the cluster if not yet started

    submitted = 0  # chunks so far: run() submits its groups in order

    def submit(group: list[list[str]]) -> PrefectFuture:
        nonlocal submitted
        first, submitted = submitted, submitted + len(group)
        return prepare_chunks.submit(group, str(Path(raw)), params, device, first=first, last=submitted - 1)

    report = prepare_stage.run(
        params,
        raw,
        out,
        update=update,  # OUT holds a set: one new generation for new and changed files (README: growing)
        workers=workers,
        submit=submit,
        warm=warm,
        chunks_per_task=CHUNKS_PER_TASK,
        progress=True,  # facepipe's own progress (a bar on a terminal, a line every 10 s otherwise)
    )
    counts = report["counts"]
    rows = [{"measure": k, "value": v} for k, v in counts.items()]
    rows += [{"measure": f"rejected: {k}", "value": v} for k, v in report["rejected_by_reason"].items()]
    rows += [{"measure": f"files {k}", "value": v} for k, v in report["files"].items()]  # reused, processed, removed
    rows.append({"measure": "images/s", "value": report["images_per_s"]})
    create_table_artifact(rows, key="prepare-report", description=f"prepare {raw} -> {out}")
    publish_quality_report(out)
    print(prepare_stage.summary_line(report))
    return report


def publish_quality_report(out: str | Path) -> str:
    """A link artifact (key ``prepare-quality-report``) to ``OUT/report.html``; returns the link."""
    link = (Path(out).resolve() / REPORT_FILE).as_uri()
    create_link_artifact(
        link,
        link_text=f"data-quality report of {Path(out).name}",
        key="prepare-quality-report",
        description="rejects by reason with thumbnails, sample faces per identity, histograms, cross-identity duplicates (self-contained HTML: opens offline)",
    )
    return link


def run_prepare_flow(
    raw: str | Path,
    out: str | Path,
    *,
    params_file: str | Path | None = None,
    workers: int | None = None,
    scheduler_address: str | None = None,
    device: str = "auto",
    verbose: bool = True,
    update: bool | Literal["auto"] = False,
) -> dict[str, Any]:
    """Run :func:`prepare_flow` on a local Dask cluster (one single-threaded process per core) or an
    existing one, with all Dask workers reporting to this process's Prefect API. Without
    ``verbose`` the local cluster's processes log from WARNING up."""
    # fail on bad input before any server or cluster starts
    load_section(params_file, "prepare")
    prepare_stage.check_paths(raw, out)
    with api_shared_with_workers():
        runner = task_runner(workers=workers, scheduler_address=scheduler_address, device=device, verbose=verbose)
        with worker_config():  # the task runner starts its cluster inside the flow
            return prepare_flow.with_options(task_runner=runner)(
                str(raw), str(out), params_file=None if params_file is None else str(params_file),
                workers=workers, device=device, update=update,
            )


def task_runner(
    *, workers: int | None, scheduler_address: str | None, device: str, verbose: bool, device_count: int | None = None
) -> DaskTaskRunner:
    """The flow's Dask task runner: an existing cluster, or a local one laid out as the CLI's
    (:func:`facepipe.cluster.local_cluster_kwargs`: one worker per core, or with GPUs each worker on its
    own GPU); ``device_count`` overrides how many GPUs there are, for tests."""
    if scheduler_address:
        return DaskTaskRunner(address=scheduler_address)
    return DaskTaskRunner(
        cluster_kwargs=local_cluster_kwargs(
            workers=workers, device=device, device_count=device_count, silence_logs=dask_silence(verbose=verbose)
        )
    )


def main(argv: list[str] | None = None) -> int:
    from facepipe.cli import at_least, prepare_arguments

    parser = argparse.ArgumentParser(prog="python -m flows.prepare", description=__doc__.splitlines()[0])
    prepare_arguments(parser)  # the arguments of facepipe prepare, declared once
    parser.add_argument("-v", "--verbose", action="store_true", help="Dask's and Prefect's INFO logs on the console too")
    args = parser.parse_args(argv)
    configure_console(verbose=args.verbose)
    try:
        at_least("--workers", args.workers, 1)
        run_prepare_flow(
            args.raw, args.out, params_file=args.params, workers=args.workers,
            scheduler_address=args.scheduler_address, device=args.device, verbose=args.verbose, update=args.update,
        )
    except FacepipeError as error:
        print(f"flows.prepare: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
