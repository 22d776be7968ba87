"""End to end: `dvc repro` of the real dvc.yaml on a tiny sample dataset, in a fresh project copy."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[1]

TINY_PARAMS = {
    "sample_data": {"identities": 8, "images_per_identity": 5, "seed": 3, "bad_files": True},
    "prepare": {"chunk_size": 8, "samples_per_shard": 16},
    "split": {"val_identities": 3, "num_pairs": 40, "seed": 0},
    "train": {
        "backbone": "mobilefacenet",
        "embedding_size": 64,
        "head": "arcface",
        "epochs": 1,
        "batch_size": 8,
        "lr": 0.05,
        "reference_batch": 8,
        "warmup_epochs": 0,
        "num_workers": 0,
        "nproc_per_node": 1,
        "checkpoint_every": 0,
        "log_every": 1,
    },
    "evaluate": {"folds": 5, "batch_size": 16},
}


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e") / "project"
    root.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("facepipe", "flows"):
        shutil.copytree(REPO / name, root / name, ignore=ignore)
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    shutil.copytree(REPO / "data" / "pretrained", root / "data" / "pretrained", ignore=shutil.ignore_patterns("*.pt*"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in TINY_PARAMS.items():
        params[section] = {**params.get(section, {}), **values}
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PREFECT_API_URL", None)
    run(["git", "init", "-q"], root, env)
    run([sys.executable, "-m", "dvc", "init", "-q"], root, env)
    run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], root, env)
    run([sys.executable, "-m", "facepipe", "sample-data", "data/raw", "--params", "params.yaml"], root, env)
    run([sys.executable, "-m", "dvc", "add", "-q", "data/raw"], root, env)
    first = run([sys.executable, "-m", "dvc", "repro"], root, env)
    run(["git", "add", "-A"], root, env)
    # experiments are relative to a commit
    run(["git", "-c", "user.email=e2e@facepipe", "-c", "user.name=e2e", "commit", "-qm", "baseline"], root, env)
    return root, env, first


def test_repro_runs_every_stage_and_writes_the_contracts(project):
    root, _, first = project
    for stage in ("prepare", "split", "train", "evaluate", "export"):
        assert f"Running stage '{stage}'" in first.stdout, first.stdout
    manifest = json.loads((root / "data/prepared/manifest.json").read_text())
    counts = manifest["counts"]
    assert counts["scanned"] == counts["accepted"] + counts["rejected"] and counts["accepted"] >= 30
    assert (root / "data/model/backbone.pt").is_file() and (root / "data/export/backbone.onnx").is_file()
    metrics = json.loads((root / "data/eval/metrics.json").read_text())
    assert 0.0 <= metrics["accuracy_mean"] <= 1.0 and metrics["num_pairs"] == 40


def test_second_repro_does_nothing_and_status_is_clean(project):
    root, env, _ = project
    again = run([sys.executable, "-m", "dvc", "repro"], root, env)
    assert "Running stage" not in again.stdout
    status = run([sys.executable, "-m", "dvc", "status"], root, env)
    assert "up to date" in status.stdout


def test_a_rerun_of_prepare_with_the_same_result_stops_there(project):
    """report.json (timings) changes on every prepare run; the stages after it depend on the shards,
    manifest and labels only, so identical shards leave them up to date."""
    root, env, _ = project
    forced = run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", "prepare"], root, env)
    assert "Running stage 'prepare'" in forced.stdout
    again = run([sys.executable, "-m", "dvc", "repro"], root, env)
    assert "Running stage" not in again.stdout, again.stdout


def test_metrics_and_plots_render_offline(project):
    root, env, _ = project
    shown = json.loads(run([sys.executable, "-m", "dvc", "metrics", "show", "--json"], root, env).stdout)
    files = next(iter(shown.values()))["data"]
    assert "data/eval/metrics.json" in files and "data/model/metrics.json" in files
    run([sys.executable, "-m", "dvc", "plots", "show", "-o", "plots_html"], root, env)
    html = (root / "plots_html" / "index.html").read_text()
    assert "roc.csv" in html and "loss" in html


@pytest.fixture(scope="module")
def experiment(project):
    """One ``dvc exp run`` with two changed parameters, checked by the two tests below: a changed
    parameter (train.epochs) and a pretrained start (train.init_from, a copy of the baseline model)."""
    root, env, _ = project
    start = root / "data" / "pretrained" / "start"
    start.mkdir()
    for name in ("backbone.pt", "model.json"):
        shutil.copy(root / "data" / "model" / name, start / name)
    changes = ["-S", "train.epochs=2", "-S", "train.init_from=data/pretrained/start"]
    return start, run([sys.executable, "-m", "dvc", "exp", "run", *changes], root, env)


def test_an_experiment_with_a_changed_parameter(project, experiment):
    root, env, _ = project
    _, result = experiment
    assert "Running stage 'train'" in result.stdout and "Running stage 'prepare'" not in result.stdout
    assert yaml.safe_load((root / "params.yaml").read_text())["train"]["epochs"] == 2
    model_metrics = json.loads((root / "data/model/metrics.json").read_text())
    assert model_metrics, "training metrics were written"


def test_an_experiment_starting_from_a_pretrained_model(project, experiment):
    """``dvc exp run -S train.init_from=...`` trains from the file, records it in model.json, and the file
    is a dependency: other bytes in data/pretrained make train stale."""
    import hashlib

    root, env, _ = project
    start, result = experiment
    assert "Running stage 'train'" in result.stdout and "Running stage 'prepare'" not in result.stdout
    spec = json.loads((root / "data" / "model" / "model.json").read_text())
    digest = hashlib.sha256((start / "backbone.pt").read_bytes()).hexdigest()
    assert spec["init_from"] == {"kind": "facepipe", "file": "backbone.pt", "sha256": digest}
    clean = run([sys.executable, "-m", "dvc", "status", "train"], root, env)
    assert "changed deps" not in clean.stdout, clean.stdout
    original = (start / "model.json").read_bytes()
    try:
        (start / "model.json").write_bytes(original + b" ")
        stale = run([sys.executable, "-m", "dvc", "status", "train"], root, env)
        assert "modified:           data/pretrained" in stale.stdout or "data/pretrained" in stale.stdout, stale.stdout
    finally:
        (start / "model.json").write_bytes(original)
