"""The export check's arithmetic against hand-computed cases (tests/README.md)."""

from __future__ import annotations

import numpy as np
import torch

from facepipe.exporting import compare, random_batch, unit_rows


def test_unit_rows_by_hand() -> None:
    rows = unit_rows(np.array([[3.0, 4.0], [0.0, 0.0], [0.0, -2.0]], dtype=np.float32))
    assert rows.dtype == np.float64
    np.testing.assert_array_equal(rows, [[0.6, 0.8], [0.0, 0.0], [0.0, -1.0]])


def test_compare_bounds_by_hand() -> None:
    reference = np.array([[3.0, 4.0], [1.0, 0.0]])
    # |diff| = 0.5 on an element of size 4: passes with atol 0.1 + rtol 0.1 (0.1 + 0.4), fails at rtol 0.09
    exported = reference + np.array([[0.0, 0.5], [0.0, 0.0]])
    unit_gap = np.abs(unit_rows(exported) - unit_rows(reference)).max()  # direction moves by ~0.047
    check = compare(exported, reference, atol=0.1, rtol=0.1)
    assert check.passed and check.max_abs_diff == 0.5 and check.max_embedding_diff == unit_gap
    assert not compare(exported, reference, atol=0.1, rtol=0.09).passed
    # the absolute bound alone is not enough when the direction differs by more than atol
    assert not compare(exported, reference, atol=0.04, rtol=1.0).passed
    # the exact bound passes (<=), in both terms
    assert compare(reference + 0.25, reference, atol=0.25, rtol=0.0).max_abs_diff == 0.25


def test_compare_refuses_other_shapes_and_non_finite_outputs() -> None:
    reference = np.ones((2, 3))
    for exported in (np.ones((3, 2)), np.ones((2, 3, 1)), np.array([[1.0, np.nan, 1.0], [1.0, 1.0, 1.0]])):
        check = compare(exported, reference, atol=1.0, rtol=1.0)
        assert not check.passed and check.max_abs_diff == np.inf and check.max_embedding_diff == np.inf


def test_random_batch_is_seeded_uniform_in_range() -> None:
    batch = random_batch(4, 8, seed=3)
    assert batch.shape == (4, 3, 8, 8) and batch.dtype == torch.float32
    assert torch.equal(batch, random_batch(4, 8, seed=3)) and not torch.equal(batch, random_batch(4, 8, seed=4))
    assert batch.min() >= -1 and batch.max() <= 1 and batch.min() < -0.9 and batch.max() > 0.9
    assert abs(batch.mean().item()) < 0.1  # uniform on [-1, 1]: mean 0 (768 draws, std of the mean 0.02)
