"""The Prefect prepare flow: same bytes as the CLI, every chunk task reported to one API."""

from __future__ import annotations

import pytest
import yaml

from facepipe.cli import main
from rawdata import TEST_PARAMS, make_faces_raw

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def test_flow_matches_cli_and_reports_every_chunk_to_one_api(harness, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.prepare import run_prepare_flow

    raw = tmp_path / "raw"
    make_faces_raw(raw)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"prepare": TEST_PARAMS}))
    assert main(["prepare", str(raw), str(tmp_path / "cli"), "--params", str(params), "--workers", "1"]) == 0

    report = run_prepare_flow(raw, tmp_path / "flow", params_file=params, workers=2)
    for name in ("manifest.json", "labels.json", "rejects.jsonl"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "flow" / name).read_bytes(), name
    for shard in (tmp_path / "cli" / "shards").iterdir():
        assert shard.read_bytes() == (tmp_path / "flow" / "shards" / shard.name).read_bytes()
    assert report["workers"] == 2

    # Every chunk ran as a task on a Dask worker process and reported to the harness's API (a worker
    # that had started its own temporary server would have recorded its task runs there instead).
    n_chunks = -(-report["counts"]["scanned"] // TEST_PARAMS["chunk_size"])
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs()
        assert len(flow_runs) == 1 and flow_runs[0].state.is_completed()
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_runs[0].id]))
        )
    chunk_runs = [t for t in task_runs if t.name.startswith("prepare-chunk")]
    assert len(chunk_runs) == n_chunks
    assert all(t.state.is_completed() for t in chunk_runs)


def test_a_failing_chunk_is_retried_once_then_fails_the_flow_naming_it(harness, tmp_path, monkeypatch):
    """In-process task runner, so that one chunk's fault can be injected; the others run for real."""
    import flows.prepare as flow_module

    raw = tmp_path / "raw"
    make_faces_raw(raw)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"prepare": TEST_PARAMS}))
    attempts = []
    real = flow_module.process_chunk

    def faulty(chunk, *args, **kwargs):
        if "hopper/0002.jpg" in chunk:  # not the first chunk: the failure must name the right one
            attempts.append(list(chunk))
            raise OSError("injected worker fault")
        return real(chunk, *args, **kwargs)

    monkeypatch.setattr(flow_module, "process_chunk", faulty)
    state = flow_module.prepare_flow(str(raw), str(tmp_path / "out"), params_file=str(params), workers=1,
                                     device="cpu", return_state=True)
    assert state.is_failed()
    assert len(attempts) == 2 and attempts[0] == attempts[1]  # tried, retried once, then given up
    broken = attempts[0]
    assert broken[0] != "astro/0001.jpg" and len(broken) == TEST_PARAMS["chunk_size"]
    expected = f"chunk {broken[0]} .. {broken[-1]} ({len(broken)} files) failed: OSError: injected worker fault"
    with pytest.raises(flow_module.ChunkFailed) as caught:
        state.result()
    assert str(caught.value) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "raw"]  # no set, no temporary folder


def test_flow_rejects_bad_input_before_starting_anything(tmp_path, capsys):
    from flows.prepare import main as flow_main

    assert flow_main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    assert "raw folder not found" in capsys.readouterr().err
