"""Learning-rate scaling and schedule: pure functions against closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import tiny_params

from facepipe.errors import FacepipeError
from facepipe.training.schedule import (
    build_scheduler,
    effective_batch,
    lr_factor,
    make_plan,
    scale_lr,
    steps_per_epoch,
    warmup_steps,
)


def test_effective_batch_is_batch_times_world_times_accumulation():
    assert effective_batch(64, world_size=4, accum_steps=2) == 512


@pytest.mark.parametrize(
    "rule,expected", [("linear", 0.1 * 2048 / 512), ("sqrt", 0.1 * math.sqrt(2048 / 512)), ("none", 0.1)]
)
def test_scale_lr(rule, expected):
    assert scale_lr(0.1, reference_batch=512, effective_batch=2048, rule=rule) == pytest.approx(expected, rel=1e-12)


def test_steps_per_epoch_drops_the_incomplete_step():
    assert steps_per_epoch(1000, 64) == 15
    assert warmup_steps(0.5, 15) == 8


def test_warmup_is_linear_from_the_first_step():
    factors = [lr_factor(s, total_steps=100, warmup_steps=4, decay="cosine") for s in range(4)]
    assert factors == pytest.approx([0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_cosine_decay_closed_form(min_ratio):
    total, warm = 110, 10
    for step in range(warm, total + 5):
        t = min((step - warm) / (total - warm), 1.0)
        expected = min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        got = lr_factor(step, total_steps=total, warmup_steps=warm, decay="cosine", min_ratio=min_ratio)
        assert got == pytest.approx(expected, abs=1e-12)
    assert lr_factor(total, total_steps=total, warmup_steps=warm, decay="cosine", min_ratio=min_ratio) == pytest.approx(
        min_ratio
    )


@pytest.mark.parametrize("power", [1.0, 2.0, 0.9])
def test_poly_decay_closed_form(power):
    total = 50
    for step in range(total + 1):
        expected = (1 - step / total) ** power
        assert lr_factor(step, total_steps=total, warmup_steps=0, decay="poly", power=power) == pytest.approx(expected)


def test_scheduler_applies_the_factor_once_per_optimizer_step():
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=0.4)
    scheduler = build_scheduler(optimizer, total_steps=20, warmup_steps=3, decay="poly", power=2.0, min_ratio=0.05)
    for step in range(20):
        expected = 0.4 * lr_factor(step, total_steps=20, warmup_steps=3, decay="poly", power=2.0, min_ratio=0.05)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)
        optimizer.step()
        scheduler.step()


def test_plan_is_derived_not_written_back():
    params = tiny_params(
        batch_size=16, accum_steps=2, lr=0.1, reference_batch=32, lr_scaling="sqrt", epochs=3, warmup_epochs=0.5
    )
    plan = make_plan(params, num_samples=1000, world_size=4)
    assert plan.effective_batch == 128
    assert plan.lr == pytest.approx(0.1 * 2.0)
    assert (plan.steps_per_epoch, plan.total_steps, plan.warmup_steps) == (7, 21, 4)
    assert params.lr == 0.1 and params.batch_size == 16  # the config is untouched (and frozen)


def test_plan_refuses_a_dataset_smaller_than_one_step():
    with pytest.raises(FacepipeError, match="do not fill one optimizer step of 64"):
        make_plan(tiny_params(batch_size=32), num_samples=63, world_size=2)


# --- found by mutation testing (tests/README.md) ----------------------------------------------------


def test_unknown_rules_are_value_errors():
    with pytest.raises(ValueError, match="^unknown lr scaling 'cubic'$"):
        scale_lr(0.1, reference_batch=256, effective_batch=512, rule="cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^unknown decay 'linear'$"):
        lr_factor(5, total_steps=10, warmup_steps=0, decay="linear")  # type: ignore[arg-type]


def test_lr_factor_defaults_and_edges():
    # defaults: power 2, min_ratio 0 -> (1 - t)^2 for poly; t = 1/4 here
    assert lr_factor(3, total_steps=6, warmup_steps=2, decay="poly") == pytest.approx(0.75**2, abs=1e-15)
    assert lr_factor(3, total_steps=6, warmup_steps=2, decay="cosine") == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 4)), abs=1e-15
    )
    # a decay of one step reaches min_ratio at its end, and stays there after total_steps
    assert lr_factor(4, total_steps=4, warmup_steps=3, decay="poly", min_ratio=0.2) == pytest.approx(0.2, abs=1e-15)
    assert lr_factor(9, total_steps=4, warmup_steps=3, decay="cosine", min_ratio=0.2) == pytest.approx(0.2, abs=1e-15)
    # warmup as long as the run: never divides by zero, the last warmup step is the peak
    assert lr_factor(4, total_steps=5, warmup_steps=5, decay="cosine") == 1.0
    assert lr_factor(5, total_steps=5, warmup_steps=5, decay="cosine") == 1.0
    assert lr_factor(6, total_steps=5, warmup_steps=5, decay="cosine") == pytest.approx(0.0, abs=1e-15)
    # no warmup: the first step is already the peak
    assert lr_factor(0, total_steps=5, warmup_steps=0, decay="poly") == 1.0


def test_plan_fields_and_rounding():
    params = tiny_params(
        batch_size=10, accum_steps=1, lr=0.3, reference_batch=40, lr_scaling="linear", epochs=2, warmup_epochs=0.25
    )
    plan = make_plan(params, num_samples=100, world_size=2)  # 20 per step, 5 steps an epoch
    assert plan.as_dict() == {
        "world_size": 2,
        "batch_size": 10,
        "accum_steps": 1,
        "effective_batch": 20,
        "lr": pytest.approx(0.15, abs=1e-15),
        "epochs": 2,
        "steps_per_epoch": 5,
        "total_steps": 10,
        "warmup_steps": 1,  # round(1.25)
    }
    assert warmup_steps(0.3, 5) == 2 and warmup_steps(0.0, 5) == 0
    assert steps_per_epoch(20, 20) == 1 and steps_per_epoch(19, 20) == 0
    with pytest.raises(FacepipeError, match=r"^19 training samples do not fill one optimizer step of 20 \(train.batch_size 10 x 2 processes x train.accum_steps 1\)$"):
        make_plan(params, num_samples=19, world_size=2)


def test_scheduler_defaults_and_power_reach_the_factor():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    default = build_scheduler(optimizer, total_steps=4, warmup_steps=0, decay="poly")  # power 2, min_ratio 0
    assert [default.lr_lambdas[0](s) for s in range(5)] == pytest.approx([1.0, 0.5625, 0.25, 0.0625, 0.0])
    linear = build_scheduler(optimizer, total_steps=4, warmup_steps=0, decay="poly", power=1.0)
    assert [linear.lr_lambdas[0](s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
