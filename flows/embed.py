"""Prefect flow for the embed stage: keep a gallery's embeddings up to date as photos arrive.

Run: ``python -m flows.embed RAW MODEL OUT [--params params.yaml] [--workers N]``, or schedule it (a
deployment of :func:`embed_flow`, like ``flows/deploy.py``'s). Each run is incremental: photos already
in OUT with the same size and mtime keep their embeddings, only new and changed ones are embedded,
removed ones leave (``facepipe.stages.embed``). The stage fans the photos out over its own Dask
workers; the flow's one task wraps the whole run, so no Prefect engine starts in a worker.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import facepipe  # noqa: F401  - offline environment first
from facepipe.config import load_section
from facepipe.errors import FacepipeError
from facepipe.stages import embed as embed_stage
from prefect import flow, task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NONE as NO_CACHE

from flows.logs import configure_console


@task(name="embed-photos", cache_policy=NO_CACHE, retries=0)
def embed_photos(raw: str, model: str, out: str, params_file: str | None, workers: int | None) -> dict[str, Any]:
    """One incremental embed run (the library's ``embed.run``); returns its report."""
    faces = load_section(params_file, "prepare") if params_file is not None else None
    return embed_stage.run(load_section(params_file, "embed"), raw, model, out, faces_params=faces, workers=workers)


@flow(name="facepipe-embed", log_prints=True)
def embed_flow(raw: str, model: str, out: str, params_file: str | None = None, workers: int | None = None) -> dict[str, Any]:
    """Embed the new and changed photos of ``raw`` into the embedding folder ``out`` with ``model``;
    publishes the run's counts as a table artifact (key ``embed-report``)."""
    report = embed_photos(raw, model, out, params_file, workers)
    rows = [{"measure": key, "value": value} for key, value in report["counts"].items()]
    rows += [{"measure": f"photos {key}", "value": value} for key, value in report["files"].items()]
    rows.append({"measure": "faces/s", "value": report["faces_per_s"]})
    create_table_artifact(rows, key="embed-report", description=f"embed {raw} -> {out}")
    print(embed_stage.summary_line(report))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.embed", description=__doc__.splitlines()[0])
    parser.add_argument("raw", type=Path, metavar="RAW")
    parser.add_argument("model", type=Path, metavar="MODEL")
    parser.add_argument("out", type=Path, metavar="OUT")
    parser.add_argument("--params", default=None, metavar="FILE")
    parser.add_argument("--workers", type=int, default=None, metavar="N")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    configure_console(verbose=args.verbose)
    try:
        load_section(args.params, "embed")  # bad input fails before a server starts
        embed_flow(str(args.raw), str(args.model), str(args.out), params_file=args.params, workers=args.workers)
    except FacepipeError as error:
        print(f"flows.embed: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
