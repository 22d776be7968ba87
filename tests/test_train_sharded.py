"""Training with the model-parallel head (issue 9), and the warmup's documented first factor."""

from __future__ import annotations

import pytest

from facepipe.config import TrainParams
from facepipe.training.schedule import lr_factor


def test_warmup_starts_at_one_over_the_warmup_steps_as_documented() -> None:
    factors = [lr_factor(step, total_steps=10, warmup_steps=4, decay="cosine") for step in range(5)]
    assert factors == [0.25, 0.5, 0.75, 1.0, 1.0]
    description = TrainParams.model_fields["warmup_epochs"].description
    assert "from 0" not in description and "1/warmup_steps" in description
