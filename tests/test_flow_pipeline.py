"""The reprocessing flow on a small real DVC project: stages through DVC, metrics artifact, failures named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STAGE = (
    "python -c \"import json,pathlib,sys; files=sorted(pathlib.Path('data/raw').iterdir()); "
    "pathlib.Path('out').mkdir(exist_ok=True); "
    "json.dump({{'files': len(files), 'stage': '{name}'}}, open('out/{name}.json','w'))\""
)


def make_project(root: Path, *, failing: bool = False) -> Path:
    root.mkdir()
    run = lambda *cmd: subprocess.run(cmd, cwd=root, check=True, capture_output=True)  # noqa: E731
    run("git", "init", "-q")
    run(sys.executable, "-m", "dvc", "init", "-q")
    run(sys.executable, "-m", "dvc", "config", "core.analytics", "false")
    (root / "data" / "raw").mkdir(parents=True)
    (root / "data" / "raw" / "a.txt").write_text("a")
    stages = {
        "count": {"cmd": STAGE.format(name="count"), "deps": ["data/raw"], "outs": [{"out/count.json": {"cache": False}}]},
        "report": {
            "cmd": "exit 3" if failing else "python -c \"import json; d=json.load(open('out/count.json')); "
            "json.dump({'files': d['files'], 'acc': 0.5}, open('metrics.json','w'))\"",
            "deps": ["out/count.json"],
            "metrics": [{"metrics.json": {"cache": False}}],
        },
        "summary": {
            "cmd": "python -c \"import shutil; shutil.copy('metrics.json', 'summary.json')\"",
            "deps": ["metrics.json"],
            "outs": [{"summary.json": {"cache": False}}],
        },
    }
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def dvc_status_clean(root: Path) -> bool:
    out = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, capture_output=True, text=True)
    return out.returncode == 0 and "up to date" in out.stdout


def test_pipeline_runs_through_dvc_and_publishes_metrics(harness, tmp_path):
    from prefect import get_client

    from flows.pipeline import pipeline_flow

    root = make_project(tmp_path / "proj")
    result = pipeline_flow(project=str(root))
    assert result["raw_changed"] is True and result["stages"] == ["count", "report", "summary"]
    assert result["up_to_date"] and dvc_status_clean(root)
    assert {"file": "metrics.json", "metric": "files", "value": 1} in result["metrics"]
    with get_client(sync_client=True) as client:
        artifact = client.read_latest_artifacts()
        assert any(a.key == "facepipe-metrics" for a in artifact)

    # nothing new: nothing reruns
    again = pipeline_flow(project=str(root))
    assert again["raw_changed"] is False and again["up_to_date"]

    # new raw data: recorded by DVC, stages rerun, metrics follow
    (root / "data" / "raw" / "b.txt").write_text("b")
    third = pipeline_flow(project=str(root))
    assert third["raw_changed"] is True
    assert {"file": "metrics.json", "metric": "files", "value": 2} in third["metrics"]
    assert dvc_status_clean(root)


def test_a_failing_middle_stage_fails_the_flow_named_and_stops_the_later_ones(harness, tmp_path, capsys):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import main, pipeline_flow

    root = make_project(tmp_path / "proj", failing=True)
    state = pipeline_flow(project=str(root), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="stage 'report' failed"):
        state.result()
    assert (root / "out" / "count.json").exists()  # the stage before it ran
    assert not (root / "summary.json").exists()  # the stage after it did not
    this_run = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
    with get_client(sync_client=True) as client:
        names = {run.name for run in client.read_task_runs(flow_run_filter=this_run)}
    assert any(name.startswith("dvc-repro-report") for name in names)
    assert not any(name.startswith("dvc-repro-summary") for name in names)

    # the command line says so too: a non-zero exit and the stage named on stderr
    assert main(["--project", str(root)]) != 0
    assert "stage 'report' failed" in capsys.readouterr().err
    assert not (root / "summary.json").exists()


def test_missing_raw_data_is_named(harness, tmp_path):
    from flows.pipeline import pipeline_flow

    root = make_project(tmp_path / "proj")
    state = pipeline_flow(project=str(root), raw="data/nope", return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="data/nope does not exist"):
        state.result()


def test_embed_flow_refreshes_a_gallery_incrementally(harness, trained_pipeline, tmp_path):
    """flows/embed.py: a second run embeds only the photos that arrived (the stage's update)."""
    from facepipe.gallery import store
    from flows.embed import embed_flow
    from embed_helpers import EMBED, FACES, copy_tree

    pipeline = trained_pipeline

    raw = tmp_path / "raw"
    identities = sorted(p.name for p in pipeline.raw.iterdir() if p.is_dir())
    for identity in identities[:2]:
        copy_tree(pipeline.raw / identity, raw / identity)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"embed": EMBED.model_dump(mode="json"), "prepare": FACES.model_dump(mode="json")}))
    out = tmp_path / "gallery"
    count = lambda folder: sum(1 for p in folder.rglob("*") if p.is_file())  # noqa: E731
    first = embed_flow(str(raw), str(pipeline.model), str(out), params_file=str(params), workers=1)
    assert first["files"] == {"embedded": count(raw), "reused": 0, "removed": 0}
    copy_tree(pipeline.raw / identities[2], raw / identities[2])
    second = embed_flow(str(raw), str(pipeline.model), str(out), params_file=str(params), workers=1)
    assert second["files"] == {"embedded": count(raw / identities[2]), "reused": count(raw) - count(raw / identities[2]), "removed": 0}
    assert {r["identity"] for r in store.load_embeddings(out).rows} == set(identities[:3])
