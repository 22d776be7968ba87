"""Reprocessing flow: notice new raw data, run the DVC pipeline stage by stage, publish the metrics.

Everything goes through DVC (``dvc add`` for the raw data, ``dvc repro STAGE`` for each stage), so
``dvc.lock`` and ``dvc status`` stay truthful after a flow run. Each stage is one Prefect task: the
UI shows which ran, how long each took, its log tail, and which one failed.

Run once: ``python -m flows.pipeline [--project DIR]``; on a schedule: ``python -m flows.deploy``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

import facepipe  # noqa: F401  - offline environment first
from facepipe.config import DEFAULT_PARAMS, PipelineParams, load_section
from facepipe.errors import FacepipeError
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact


class StageFailed(RuntimeError):
    """A DVC stage exited non-zero; the message names the stage and ends with its output's tail."""


def _env() -> dict[str, str]:
    # Stage commands say `python`, `torchrun`, `facepipe`: resolve them in this interpreter's environment.
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def dvc(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``dvc ARGS`` in ``project``; output captured, never raises on a non-zero exit."""
    return subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=project, env=_env(), capture_output=True, text=True
    )


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def pipeline_stages(project: Path) -> list[str]:
    """Stage names in the order ``dvc.yaml`` lists them (upstream first)."""
    spec = yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8")) or {}
    return list((spec.get("stages") or {}).keys())


@task(name="snapshot-raw-data", retries=0)
def snapshot_raw(project: Path, raw: str) -> bool:
    """``dvc add`` the raw folder when it changed; returns whether it did."""
    logger = get_run_logger()
    if not (project / raw).exists():
        raise StageFailed(f"raw data folder {raw} does not exist in {project}")
    status = dvc(project, "status", "--json", f"{raw}.dvc") if (project / f"{raw}.dvc").exists() else None
    if status is not None and status.returncode == 0 and json.loads(status.stdout or "{}") == {}:
        logger.info("raw data %s unchanged", raw)
        return False
    added = dvc(project, "add", "--quiet", raw)
    if added.returncode != 0:
        raise StageFailed(f"dvc add {raw} failed:\n{_tail(added.stdout + added.stderr)}")
    logger.info("new raw data in %s recorded by DVC", raw)
    return True


@task(name="dvc-repro")
def repro_stage(project: Path, stage: str) -> str:
    """``dvc repro STAGE``: runs it only if DVC says it is stale. Raises :class:`StageFailed`."""
    logger = get_run_logger()
    result = dvc(project, "repro", stage)
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        raise StageFailed(f"stage '{stage}' failed (dvc repro exit {result.returncode}):\n{_tail(output)}")
    logger.info("stage %s:\n%s", stage, _tail(output))
    return output


def flatten_metrics(shown: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows ``{file, metric, value}`` from ``dvc metrics show --json`` output."""
    rows = []
    for workspace in shown.values():
        for file, content in (workspace.get("data") or {}).items():
            stack = [("", content.get("data", {}))]
            while stack:
                prefix, node = stack.pop()
                for key, value in sorted(node.items(), reverse=True):
                    name = f"{prefix}.{key}" if prefix else key
                    if isinstance(value, dict):
                        stack.append((name, value))
                    elif isinstance(value, (int, float, str, bool)) or value is None:
                        rows.append({"file": file, "metric": name, "value": value})
    return sorted(rows, key=lambda r: (r["file"], r["metric"]))


def prepare_file_counts(project: Path) -> list[dict[str, Any]]:
    """Rows ``{file, metric, value}``: the files the last prepare reused, processed and removed (its
    report.json, inside the prepare stage's output folder: not a DVC metric, since that folder is an output)."""
    spec = yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8")) or {}
    outs = ((spec.get("stages") or {}).get("prepare") or {}).get("outs") or []
    if not outs:
        return []
    report = f"{_entry_path(outs[0]).rstrip('/')}/report.json"
    try:
        files = json.loads((project / report).read_text(encoding="utf-8")).get("files") or {}
    except (OSError, ValueError, AttributeError):
        return []
    return [{"file": report, "metric": f"files.{key}", "value": value} for key, value in sorted(files.items())]


@task(name="publish-metrics")
def publish_metrics(project: Path) -> list[dict[str, Any]]:
    """Publish ``dvc metrics show`` as a table artifact (key ``facepipe-metrics``) in the Prefect UI."""
    shown = dvc(project, "metrics", "show", "--json")
    if shown.returncode != 0:
        raise StageFailed(f"dvc metrics show failed:\n{_tail(shown.stdout + shown.stderr)}")
    rows = flatten_metrics(json.loads(shown.stdout or "{}")) + prepare_file_counts(project)
    if rows:
        create_table_artifact(rows, key="facepipe-metrics", description="metrics of the latest pipeline run")
    return rows


#: What a person opens without a network: image plots, and the data-quality page of an output folder.
IMAGE_SUFFIXES = (".png", ".svg", ".jpg", ".jpeg", ".gif")
REPORT_PAGE = "report.html"


def _entry_path(entry: str | dict[str, Any]) -> str:
    return entry if isinstance(entry, str) else next(iter(entry))


def offline_views(project: Path) -> list[str]:
    """Paths (relative to ``project``, in ``dvc.yaml`` order) of the image plots its stages declare and
    of the ``report.html`` in their output folders, where those files exist."""
    spec = yaml.safe_load((project / "dvc.yaml").read_text(encoding="utf-8")) or {}
    views = []
    for stage in (spec.get("stages") or {}).values():
        views += [p for p in map(_entry_path, stage.get("plots") or []) if p.lower().endswith(IMAGE_SUFFIXES)]
        views += [f"{_entry_path(out).rstrip('/')}/{REPORT_PAGE}" for out in stage.get("outs") or []]
    return [path for path in views if (project / path).is_file()]


@task(name="publish-plots")
def publish_plots(project: Path) -> list[str]:
    """Link the offline views (:func:`offline_views`) from a markdown artifact (key ``facepipe-plots``)."""
    views = offline_views(project)
    if views:
        lines = [f"- [{path}]({(project / path).resolve().as_uri()})" for path in views]
        create_markdown_artifact(
            "\n".join(lines), key="facepipe-plots",
            description="training curves, ROC and data-quality report of the latest run (files on this machine; open offline)",
        )
    return views


@flow(name="facepipe-pipeline", log_prints=True)
def pipeline_flow(project: str = ".", raw: str = "data/raw", stages: list[str] | None = None) -> dict[str, Any]:
    """Record new raw data, bring every stage up to date through DVC, publish the metrics and link the plots.

    A failing stage fails the flow with the stage named; later stages do not run.
    """
    root = Path(project).resolve()
    changed = snapshot_raw(root, raw)
    names = stages or pipeline_stages(root)
    for name in names:
        repro_stage.with_options(name=f"dvc-repro-{name}")(root, name)
    metrics = publish_metrics(root)
    publish_plots(root)
    status = dvc(root, "status", "--json")
    up_to_date = status.returncode == 0 and json.loads(status.stdout or "{}") == {}
    print(f"pipeline: raw data {'changed' if changed else 'unchanged'}; stages {', '.join(names)}; "
          f"dvc status {'up to date' if up_to_date else 'NOT up to date'}")
    return {"raw_changed": changed, "stages": names, "metrics": metrics, "up_to_date": up_to_date}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--project", default=".", help="the facepipe project (folder with dvc.yaml)")
    parser.add_argument("--params", default=None, help="params file (default: the project's params.yaml)")
    args = parser.parse_args(argv)
    params_file = Path(args.project) / (args.params or DEFAULT_PARAMS)
    try:
        params: PipelineParams = load_section(params_file, "pipeline", missing_ok=args.params is None)
    except FacepipeError as error:  # before any flow run, so the UI never shows a run that could not start
        print(f"flows.pipeline: error: {error}", file=sys.stderr)
        return 2
    state = pipeline_flow(project=args.project, raw=params.raw, return_state=True)
    if state.is_failed():
        print(f"flows.pipeline: error: {state.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
