"""``train.batch_size: auto`` (issue 9, Memory): the largest batch that fits, found by trial steps with
an injected out-of-memory error; peak memory and step time in the metrics."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from train_helpers import linear_model, load_weights, synthetic_set, tiny_params

from facepipe.errors import FacepipeError
from facepipe.training.memory import largest_batch


def out_of_memory_above(threshold: int, tried: list[int]):  # type: ignore[no-untyped-def]
    def probe(batch: int) -> None:
        tried.append(batch)
        if batch > threshold:
            raise torch.OutOfMemoryError(f"injected: {batch} > {threshold}")

    return probe


def test_halving_then_bisection_finds_the_largest_batch_that_fits() -> None:
    tried: list[int] = []
    assert largest_batch(out_of_memory_above(37, tried), limit=100) == 37
    assert tried == [100, 50, 25, 37, 43, 40, 38]  # halve to a fit, then bisect (25, 50)
    tried.clear()
    assert largest_batch(out_of_memory_above(500, tried), limit=64) == 64 and tried == [64]
    assert largest_batch(out_of_memory_above(1, []), limit=64) == 1
    with pytest.raises(FacepipeError, match="not even a batch of 1 fits"):
        largest_batch(out_of_memory_above(0, []), limit=64)


def oom_factory(threshold: int, tried: list[int]):  # type: ignore[no-untyped-def]
    """The linear test model whose backbone raises torch.OutOfMemoryError on batches above
    ``threshold``, as a GPU would (a forward pre-hook: the code under test is unchanged)."""

    def factory(params, *, num_classes, image_size):  # type: ignore[no-untyped-def]
        model = linear_model(params, num_classes=num_classes, image_size=image_size)

        def hook(module, inputs):  # type: ignore[no-untyped-def]
            tried.append(len(inputs[0]))
            if len(inputs[0]) > threshold:
                raise torch.OutOfMemoryError("injected")

        model.backbone.register_forward_pre_hook(hook)
        return model

    return factory


@pytest.mark.slow  # three short training runs
def test_auto_batch_trains_exactly_like_the_batch_it_found(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """48 samples, out of memory above 20: the search settles on 20 and logs it; stopped after 2 steps
    and resumed where a new search would find more, the run keeps 20 (from its checkpoint) and ends
    equal to a run with batch_size 20 written out (rate scaled alike): the trial steps leave no trace."""
    from facepipe.stages.train import run

    shard_set = synthetic_set(tmp_path / "set")  # 4 identities x 12
    params, tried = tiny_params(batch_size="auto", epochs=2), []
    caplog.set_level(logging.INFO, logger="facepipe")
    first = run(params, shard_set, tmp_path / "auto", max_steps=2, model_factory=oom_factory(20, tried))
    assert tried[:8] == [48, 24, 12, 18, 21, 19, 20, 20]  # limit = the 48 samples; then training at 20
    assert first.effective_batch == 20 and first.steps == 2
    assert "batch_size auto: 20 per process (largest that fits)" in caplog.text
    state = torch.load(tmp_path / "auto" / "checkpoints" / "step-00000002.pt", weights_only=True)
    assert state["plan"]["batch_size"] == 20 and state["config"]["batch_size"] == 20

    tried.clear()
    resumed = run(params, shard_set, tmp_path / "auto", model_factory=oom_factory(10**6, tried))
    assert resumed.resumed_from_step == 2 and resumed.effective_batch == 20 and resumed.steps == 4
    assert set(tried) == {20}  # no search this time (it would have found 48)
    assert "batch_size auto: 20 per process (from the checkpoints)" in caplog.text

    fixed = run(tiny_params(batch_size=20, epochs=2), shard_set, tmp_path / "fixed", model_factory=oom_factory(20, []))
    assert fixed.lr == resumed.lr
    a, b = load_weights(tmp_path / "auto" / "backbone.pt"), load_weights(tmp_path / "fixed" / "backbone.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_peak_memory_and_step_time_are_logged_per_epoch(tmp_path: Path) -> None:
    from facepipe.stages.train import run

    run(tiny_params(epochs=2), synthetic_set(tmp_path / "set"), tmp_path / "model", model_factory=linear_model)
    summary = json.loads((tmp_path / "model" / "metrics.json").read_text())["train"]
    assert summary["peak_memory_mb"] > 50  # the CPU process's peak RSS: torch alone is more
    assert 0 < summary["step_time_s"] < summary["epoch_time_s"]
    folder = tmp_path / "model" / "plots" / "metrics" / "train"
    for name in ("peak_memory_mb", "step_time_s"):
        rows = (folder / f"{name}.tsv").read_text().splitlines()
        assert rows[0] == f"step\t{name}" and len(rows) == 3, rows  # one point per epoch


def test_batch_size_is_a_count_or_auto() -> None:
    from facepipe.config import ParamsError, TrainParams, parse_section

    assert parse_section(TrainParams, "train", {"batch_size": "auto"}).batch_size == "auto"
    for bad in (0, "big", 2.5, True):
        with pytest.raises(ParamsError, match=r"^train.batch_size: .*must be an integer >= 1 or auto"):
            parse_section(TrainParams, "train", {"batch_size": bad})
    with pytest.raises(ParamsError, match="batch_size auto needs head_parallel: dense"):
        parse_section(TrainParams, "train", {"batch_size": "auto", "head_parallel": "sharded"})
