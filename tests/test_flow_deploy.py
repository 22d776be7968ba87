"""``python -m flows.deploy``: bad params are one line and exit 2 before anything is served; good ones
reach Prefect's ``serve`` as written. ``serve`` itself is replaced by a recorder, so no server starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flows import deploy


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every ``pipeline_flow.serve`` call (which would block, serving forever)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(deploy.pipeline_flow, "serve", lambda **kwargs: calls.append(kwargs))
    return calls


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pipeline:\n  cron: '61 * * * *'\n", "pipeline.cron: Value error, not a cron expression"),
        ("pipeline:\n  cron: [0, 3\n", "not valid YAML"),
        ("pipeline: nightly\n", "section 'pipeline' must be a mapping, got str"),
        ("pipeline:\n  crontab: '0 3 * * *'\n", "unknown key 'pipeline.crontab'"),
    ],
    ids=["bad_cron", "invalid_yaml", "section_not_a_mapping", "unknown_key"],
)
def test_bad_params_are_one_line_exit_2_and_nothing_is_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], served: list[dict[str, Any]], text: str, message: str
) -> None:
    params = tmp_path / "params.yaml"
    params.write_text(text)
    assert deploy.main(["--project", str(tmp_path), "--params", "params.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"flows.deploy: error: {params}: ") and message in err and err.count("\n") == 1, err
    assert served == []


def test_a_named_params_file_that_is_missing_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], served: list[dict[str, Any]]
) -> None:
    assert deploy.main(["--project", str(tmp_path), "--params", "nope.yaml"]) == 2
    assert capsys.readouterr().err == f"flows.deploy: error: params file not found: {tmp_path / 'nope.yaml'}\n"
    assert served == []


def test_good_params_reach_serve_as_written(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    (tmp_path / "params.yaml").write_text("pipeline:\n  cron: '*/15 2 * * 1-5'\n  raw: data/faces\n")
    assert deploy.main(["--project", str(tmp_path), "--name", "nightly"]) == 0
    assert len(served) == 1
    call = served[0]
    assert (call["name"], call["cron"]) == ("nightly", "*/15 2 * * 1-5")
    assert call["parameters"] == {"project": str(tmp_path.resolve()), "raw": "data/faces"}


def test_without_a_params_file_the_defaults_are_served(tmp_path: Path, served: list[dict[str, Any]]) -> None:
    assert deploy.main(["--project", str(tmp_path)]) == 0
    assert (served[0]["cron"], served[0]["parameters"]["raw"]) == ("0 3 * * *", "data/raw")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pipeline:\n  cron: [0, 3\n", "not valid YAML"),
        ("pipeline:\n  raw: [a, b]\n", "pipeline.raw"),
        ("- pipeline\n", "must be a mapping"),
    ],
    ids=["invalid_yaml", "bad_value", "top_level_list"],
)
def test_pipeline_main_turns_params_errors_into_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, text: str, message: str
) -> None:
    """``python -m flows.pipeline`` fails on bad params before any flow run starts."""
    from flows import pipeline

    runs: list[Any] = []
    monkeypatch.setattr(pipeline, "pipeline_flow", lambda **kwargs: runs.append(kwargs))
    (tmp_path / "params.yaml").write_text(text)
    assert pipeline.main(["--project", str(tmp_path), "--params", "params.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flows.pipeline: error: ") and message in err and err.count("\n") == 1, err
    assert runs == []
    assert pipeline.main(["--project", str(tmp_path), "--params", "absent.yaml"]) == 2
    assert "params file not found" in capsys.readouterr().err and runs == []
