"""Serve the reprocessing flow as a deployment on a cron schedule from ``params.yaml`` (``pipeline.cron``).

    prefect server start --host 127.0.0.1 --port 4200       # terminal 1: the API and the UI
    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.deploy   # terminal 2: serves the schedule

Then open http://127.0.0.1:4200: Deployments -> facepipe-pipeline/reprocess shows the scheduled
runs; each run's page shows its stage tasks, logs and the ``facepipe-metrics`` table artifact.
Nothing is created at import time: the deployment exists while this process serves it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import facepipe  # noqa: F401
from facepipe.config import DEFAULT_PARAMS, load_section
from facepipe.errors import FacepipeError

from flows.pipeline import pipeline_flow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.splitlines()[0])
    parser.add_argument("--project", default=".", help="the facepipe project (folder with dvc.yaml)")
    parser.add_argument("--params", default=None, help="params file (default: the project's params.yaml)")
    parser.add_argument("--name", default="reprocess", help="deployment name")
    args = parser.parse_args(argv)
    project = Path(args.project).resolve()
    try:
        params = load_section(project / (args.params or DEFAULT_PARAMS), "pipeline", missing_ok=args.params is None)
    except FacepipeError as error:
        # Before serving: serve() blocks, and a schedule Prefect refuses would only surface as its traceback.
        print(f"flows.deploy: error: {error}", file=sys.stderr)
        return 2
    pipeline_flow.serve(
        name=args.name,
        cron=params.cron,
        parameters={"project": str(project), "raw": params.raw},
        description="Record new raw data with DVC, reproduce stale stages, publish metrics.",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
