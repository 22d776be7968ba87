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
