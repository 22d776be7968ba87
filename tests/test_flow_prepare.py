"""The Prefect prepare flow: same bytes as the CLI, every chunk in one task reported to one API, a failing
group retried once and then named."""

from __future__ import annotations

import pytest
import yaml

from facepipe.cli import main
from facepipe.stages import prepare as prepare_stage
from rawdata import TEST_PARAMS, make_faces_raw


def test_task_groups_shrink_to_single_chunks_and_keep_the_order():
    chunks = [[f"a/{i}.jpg"] for i in range(100)]
    groups = prepare_stage.task_groups(chunks, workers=2, most=8)
    assert [c for g in groups for c in g] == chunks
    sizes = [len(g) for g in groups]
    assert max(sizes) == 8 and sizes == sorted(sizes, reverse=True) and sizes[-4:] == [1, 1, 1, 1]
    assert len(groups) < 100 / 3
    assert [len(g) for g in prepare_stage.task_groups(chunks, workers=2)] == [1] * 100  # the CLI: one per chunk
    assert prepare_stage.task_groups([], workers=2, most=8) == []


def test_the_chunk_worker_names_the_chunk_that_broke(tmp_path, monkeypatch):
    params = prepare_stage.PrepareParams(**TEST_PARAMS)
    done = prepare_stage.process_chunks([[], ["x", "a/missing.jpg"]], str(tmp_path), params)
    assert [[o.reason for o in chunk] for chunk in done] == [[], ["outside_identity_folder", "io_error"]]

    def broken(paths, *args):
        if "a/2.jpg" in paths:
            raise MemoryError("injected")
        return []

    monkeypatch.setattr(prepare_stage, "process_chunk", broken)
    with pytest.raises(prepare_stage.ChunkFailed, match=r"^chunk a/1.jpg .. a/2.jpg \(2 files\) failed: MemoryError: injected$"):
        prepare_stage.process_chunks([["a/0.jpg"], ["a/1.jpg", "a/2.jpg"]], str(tmp_path), params)


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.mark.multiprocess
@pytest.mark.slow
def test_flow_matches_cli_and_reports_every_chunk_to_one_api(harness, tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.prepare import CHUNKS_PER_TASK, run_prepare_flow

    raw = tmp_path / "raw"
    make_faces_raw(raw)
    params = tmp_path / "params.yaml"
    chunk_size = 2  # 9 chunks: the first task of 2 workers carries 2 (prepare.task_groups), the CLI's 1
    params.write_text(yaml.safe_dump({"prepare": {**TEST_PARAMS, "chunk_size": chunk_size}}))
    assert main(["prepare", str(raw), str(tmp_path / "cli"), "--params", str(params), "--workers", "1"]) == 0

    report = run_prepare_flow(raw, tmp_path / "flow", params_file=params, workers=2)
    for name in ("manifest.json", "labels.json", "rejects.jsonl"):
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "flow" / name).read_bytes(), name
    for shard in (tmp_path / "cli" / "shards").iterdir():
        assert shard.read_bytes() == (tmp_path / "flow" / "shards" / shard.name).read_bytes()
    assert report["workers"] == 2

    # Every chunk ran in one task on a Dask worker process and reported to the harness's API (a worker
    # that had started its own temporary server would have recorded its task runs there instead).
    n_chunks = -(-report["counts"]["scanned"] // chunk_size)
    groups = prepare_stage.task_groups(list(range(n_chunks)), workers=2, most=CHUNKS_PER_TASK)
    assert len(groups) < n_chunks
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs()
        assert len(flow_runs) == 1 and flow_runs[0].state.is_completed()
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_runs[0].id]))
        )
    chunk_runs = [t for t in task_runs if t.name.startswith("prepare-chunks")]
    assert sorted(t.name for t in chunk_runs) == sorted(f"prepare-chunks {g[0]}-{g[-1]}" for g in groups)
    assert all(t.state.is_completed() for t in chunk_runs)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_failing_chunk_is_retried_once_then_fails_the_flow_naming_it(harness, tmp_path, monkeypatch):
    """In-process task runner, so that one chunk's fault can be injected; the others run for real.
    The group that holds it is the task retried; the failure names the chunk."""
    import flows.prepare as flow_module

    raw = tmp_path / "raw"
    make_faces_raw(raw)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"prepare": TEST_PARAMS}))
    calls = []
    real = prepare_stage.process_chunk

    def faulty(chunk, *args, **kwargs):
        calls.append(list(chunk))
        if "hopper/0001.jpg" in chunk:  # the second chunk: the failure must name the right one
            raise OSError("injected worker fault")
        return real(chunk, *args, **kwargs)

    monkeypatch.setattr(prepare_stage, "process_chunk", faulty)
    monkeypatch.setattr(flow_module, "CHUNKS_PER_TASK", 2)  # one worker: chunks 0-1 are the first task
    state = flow_module.prepare_flow(str(raw), str(tmp_path / "out"), params_file=str(params), workers=1,
                                     device="cpu", return_state=True)
    assert state.is_failed()
    attempts = [chunk for chunk in calls if "hopper/0001.jpg" in chunk]
    assert len(attempts) == 2 and attempts[0] == attempts[1]  # tried, retried once, then given up
    broken = attempts[0]
    first_chunk = [chunk for chunk in calls if "astro/0001.jpg" in chunk]
    assert len(first_chunk) == 2 and broken != first_chunk[0]  # the group ran again as a whole
    expected = f"chunk {broken[0]} .. {broken[-1]} ({len(broken)} files) failed: OSError: injected worker fault"
    with pytest.raises(prepare_stage.ChunkFailed) as caught:
        state.result()
    assert str(caught.value) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "raw"]  # no set, no temporary folder


def test_flow_rejects_bad_input_before_starting_anything(tmp_path, capsys, monkeypatch):
    """Bad paths and bad params end in one line and exit 2 before the Prefect API (the first thing the
    flow starts) is shared with workers, and nothing is written."""
    import flows.prepare as flow_module

    def no_start():
        raise AssertionError("started before the input was checked")

    monkeypatch.setattr(flow_module, "api_shared_with_workers", no_start)
    (tmp_path / "raw" / "a").mkdir(parents=True)
    (tmp_path / "bad.yaml").write_text("prepare:\n  min_face_sise: 30\n")
    for argv, message in (
        ([str(tmp_path / "missing"), str(tmp_path / "out")], "raw folder not found"),
        ([str(tmp_path / "raw"), str(tmp_path / "out"), "--params", str(tmp_path / "bad.yaml")], "unknown key 'prepare.min_face_sise'"),
        ([str(tmp_path / "raw"), str(tmp_path / "out"), "--update", "auto", "--workers", "0"], "--workers must be >= 1, got 0"),
    ):
        assert flow_module.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "raw"]
