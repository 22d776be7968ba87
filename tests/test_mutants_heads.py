"""The model-parallel head in this process, on a real one-rank gloo group (tests/README.md).

The two-process equivalence test in test_heads.py is a ``multiprocess`` test that the mutation run
cannot attribute to the head's functions; this one runs in-process, so every mutant of the sharded
head's single-rank arithmetic (cross-entropy, its hand-written backward, weight gathering) meets it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from facepipe.heads import create_head, create_model_parallel_head, list_heads


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["arcface", "cosface", "curricularface"])
def test_one_rank_sharded_head_is_the_dense_head(one_rank_group: None, name: str) -> None:
    torch.manual_seed(0)
    dense = create_head(name, embedding_size=5, num_classes=7, scale=16.0).double()
    sharded = create_model_parallel_head(name, embedding_size=5, num_classes=7, scale=16.0).double()
    sharded.load_full_weight(dense.weight.detach())
    assert (sharded.class_start, sharded.num_local, sharded.world_size, sharded.rank) == (0, 7, 1, 0)
    torch.testing.assert_close(sharded.gather_weight(), dense.weight.detach(), rtol=0, atol=0)
    assert sharded.margin.sync_statistics is False and dense.margin.sync_statistics is True
    for step in range(2):  # CurricularFace's t must move the same way in both
        generator = torch.Generator().manual_seed(step)
        embeddings = torch.randn(6, 5, dtype=torch.float64, generator=generator)
        labels = torch.tensor([0, 6, 3, 3, 1, 5])
        dense_input = embeddings.clone().requires_grad_(True)
        sharded_input = embeddings.clone().requires_grad_(True)
        dense_loss = F.cross_entropy(dense(dense_input, labels), labels)
        dense_loss.backward()
        loss = sharded(sharded_input, labels)
        loss.backward()
        assert loss.shape == () and loss.dtype == torch.float64
        torch.testing.assert_close(loss, dense_loss)
        torch.testing.assert_close(sharded_input.grad, dense_input.grad)
        torch.testing.assert_close(sharded.weight.grad, dense.weight.grad)
        dense.zero_grad()
        sharded.zero_grad()
    if name == "curricularface":
        torch.testing.assert_close(sharded.margin.t, dense.margin.t)
        assert dense.margin.t.item() != 0.0


def test_sharded_loss_is_the_cross_entropy_at_large_logits(one_rank_group: None) -> None:
    # float32 logits of ±100: exp(100) overflows float32, so this needs the shift by the row maximum
    head = create_model_parallel_head("cosface", embedding_size=2, num_classes=3, scale=100.0, margin=0.0)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
    embeddings = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    loss = head(embeddings, torch.tensor([0, 0]))
    # row 0: logits (100, 0, -100), target 100; row 1: (0, 100, 0), target 0
    row0 = torch.logsumexp(torch.tensor([100.0, 0.0, -100.0], dtype=torch.float64), 0) - 100.0
    row1 = torch.logsumexp(torch.tensor([0.0, 100.0, 0.0], dtype=torch.float64), 0)
    expected = ((row0 + row1) / 2).float()
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected)


def test_load_full_weight_checks_the_shape(one_rank_group: None) -> None:
    head = create_model_parallel_head("arcface", embedding_size=4, num_classes=3)
    with pytest.raises(ValueError, match=r"^expected class centres \[3, 4\], got \[3, 5\]$"):
        head.load_full_weight(torch.zeros(3, 5))
    assert "(\n  embedding_size=4, num_classes=3, scale=64.0, sample_rate=1.0, classes=[0, 3) of rank 0/1\n" in repr(head)


def test_head_arguments_are_checked() -> None:
    for kwargs, message in [
        ({"embedding_size": 0, "num_classes": 3}, "^embedding_size must be positive, got 0$"),
        ({"embedding_size": 4, "num_classes": 0}, "^num_classes must be positive, got 0$"),
        ({"embedding_size": 4, "num_classes": 3, "scale": 0.0}, "^scale must be positive, got 0.0$"),
    ]:
        with pytest.raises(ValueError, match=message):
            create_head("arcface", **kwargs)
    # the smallest legal values build
    head = create_head("arcface", embedding_size=1, num_classes=1, scale=1e-3)
    assert tuple(head.weight.shape) == (1, 1)
    assert "(\n  embedding_size=1, num_classes=1, scale=0.001\n" in repr(head)
    assert sorted(list_heads()) == list_heads()


def test_heads_defaults_and_initial_centres(one_rank_group: None) -> None:
    # defaults by name: scale 64 for both head kinds, the margin's own default; centres drawn from N(0, 0.01²)
    dense = create_head("arcface", embedding_size=8, num_classes=2000)
    sharded = create_model_parallel_head("cosface", embedding_size=8, num_classes=2000)
    assert (dense.scale, dense.margin.margin, sharded.scale, sharded.margin.margin) == (64.0, 0.5, 64.0, 0.35)
    for head in (dense, sharded):
        assert tuple(head.weight.shape) == (2000, 8)
        # 16,000 draws: the sample std of N(0, 0.01²) is within 3 % of 0.01 (about 5 standard errors)
        assert abs(head.weight.std().item() - 0.01) < 3e-4 and abs(head.weight.mean().item()) < 1e-3


def test_model_parallel_head_class_count_against_the_ranks(one_rank_group: None) -> None:
    from facepipe.heads.margins import CosFaceMargin
    from facepipe.heads.model_parallel import ModelParallelMarginHead

    head = create_model_parallel_head("cosface", embedding_size=2, num_classes=1)  # as many classes as ranks
    assert (head.class_start, head.num_local) == (0, 1)
    with pytest.raises(ValueError, match=r"^num_classes \(0\) must be at least the number of ranks \(1\)$"):
        ModelParallelMarginHead(CosFaceMargin(), embedding_size=2, num_classes=0, scale=1.0)


def test_model_parallel_head_without_a_process_group_says_so() -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="^the model-parallel head needs an initialized process group$"):
        create_model_parallel_head("arcface", embedding_size=2, num_classes=2)


def test_curricularface_takes_the_given_margin_and_modulates_strictly_harder_negatives_only() -> None:
    from facepipe.heads.margins import CurricularFaceMargin

    assert create_head("curricularface", embedding_size=2, num_classes=2, margin=0.3).margin.margin == 0.3
    # m = 0: cos(θ_y + 0) = cos θ_y exactly, so a negative equal to the positive is not "harder" than it
    margin = CurricularFaceMargin(0.0).eval()  # eval: t stays 0, so a hard negative becomes cos²
    cos = torch.tensor([[0.5, 0.5, 0.7, 0.2]], dtype=torch.float64)
    out = margin(cos, torch.tensor([0]), torch.tensor([0.5], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.5, 0.49, 0.2]], dtype=torch.float64), rtol=0, atol=1e-15)


def test_curricularface_logits_stay_float32_for_float32_embeddings_in_a_float64_head() -> None:
    # the docstring: float32 logits for float32 (or lower) input whatever the head's own dtype
    head = create_head("curricularface", embedding_size=3, num_classes=4, scale=2.0).double().train()
    logits = head(torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0]))
    assert logits.dtype == torch.float32 and head.margin.t.dtype == torch.float64


# --- Partial FC class sampling and the heads' loss_and_correct -----------------------------------------


def test_sample_count_closed_forms() -> None:
    from facepipe.heads.partial_fc import sample_count

    assert [sample_count(10, r) for r in (0.25, 0.3, 1.0, 0.01)] == [3, 3, 10, 1]  # ceil(2.5), ceil(3.0)
    assert sample_count(7, 0.999) == 7  # ceil(6.993) = 7, never more than the rank holds


def test_sample_classes_keeps_positives_remaps_labels_and_draws_the_rest_uniformly() -> None:
    from facepipe.heads.partial_fc import sample_classes

    local = torch.tensor([2, -1, 5, 2])
    chosen = torch.zeros(10, dtype=torch.long)
    subsets = set()
    for step in range(400):
        index, labels = sample_classes(local, num_local=10, sample_rate=0.3, key=(7, step, 0, 0))
        assert index.dtype == torch.int64 and len(index) == 3  # ceil(0.3 * 10) with both positives in it
        assert torch.equal(index, torch.unique(index)) and {2, 5} <= set(index.tolist())
        assert labels.tolist()[1] == -1 and all(index[labels[k]] == local[k] for k in (0, 2, 3))
        again = sample_classes(local, num_local=10, sample_rate=0.3, key=(7, step, 0, 0))
        assert torch.equal(again[0], index) and torch.equal(again[1], labels)  # a resumed run redraws it
        chosen[index] += 1
        subsets.add(tuple(index.tolist()))
    assert chosen[2] == chosen[5] == 400
    # the third class is uniform over the 8 others: 50 each expected (binomial std 6.6; 25..75 > 3.5 std)
    others = chosen[[k for k in range(10) if k not in (2, 5)]]
    assert int(others.sum()) == 400 and bool(((25 <= others) & (others <= 75)).all()), others
    # more distinct positives than the sample size: exactly the positives
    index, labels = sample_classes(torch.tensor([0, 3, 6, 9]), num_local=10, sample_rate=0.1, key=(1,))
    assert index.tolist() == [0, 3, 6, 9] and labels.tolist() == [0, 1, 2, 3]


def test_dense_loss_and_correct_by_hand() -> None:
    head = create_head("cosface", embedding_size=2, num_classes=3, scale=4.0, margin=0.5)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]))
    embeddings = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1]])
    labels = torch.tensor([0, 0, 1])
    output = head.loss_and_correct(embeddings, labels)
    # row 0: class 0 at cos 1 - 0.5 beats 0 and -1: correct; row 1: class 0 at 0 - 0.5 < class 1's 1:
    # wrong; row 2: class 1 at 0.0995 - 0.5 < class 0's 0.995: wrong
    assert int(output.correct) == 1 and output.correct.dtype == torch.int64 and output.samples == 3
    torch.testing.assert_close(output.loss, F.cross_entropy(head(embeddings, labels), labels))


def test_one_rank_partial_fc_is_the_dense_head_on_the_sampled_classes(one_rank_group: None) -> None:
    torch.manual_seed(0)
    sharded = create_model_parallel_head("arcface", embedding_size=4, num_classes=12, scale=8.0, sample_rate=0.25)
    sharded.double()
    embeddings = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([3, 3, 7, 0, 7])
    output = sharded.loss_and_correct(embeddings, labels)
    index = sharded.last_index
    assert index is not None and {0, 3, 7} <= set(index.tolist()) and len(index) == 3  # ceil(3) = the positives
    # the same computation by the dense head restricted to those centres, labels renumbered
    dense = create_head("arcface", embedding_size=4, num_classes=len(index), scale=8.0).double()
    with torch.no_grad():
        dense.weight.copy_(sharded.weight[index])
    remapped = torch.searchsorted(index, labels)
    logits = dense(embeddings.detach(), remapped)
    torch.testing.assert_close(output.loss, F.cross_entropy(logits, remapped))
    assert int(output.correct) == int((logits.argmax(dim=1) == remapped).sum()) and output.samples == 5
    output.loss.backward()
    unsampled = [k for k in range(12) if k not in index.tolist()]
    assert torch.count_nonzero(sharded.weight.grad[unsampled]) == 0
    assert torch.count_nonzero(sharded.weight.grad[index]) > 0


def test_initial_centres_do_not_depend_on_the_range_they_are_drawn_in() -> None:
    from facepipe.heads.centres import BLOCK, init_centres

    whole = init_centres(0, 2 * BLOCK + 10, embedding_size=3, seed=5)
    assert whole.shape == (2 * BLOCK + 10, 3) and whole.dtype == torch.float32
    # any split, across block boundaries or inside one block, gives the same rows
    for start, count in [(0, 1), (1, 2), (BLOCK - 2, 5), (BLOCK, 3), (BLOCK + 7, BLOCK + 3), (2 * BLOCK + 9, 1)]:
        torch.manual_seed(start)  # the global generator must not matter
        torch.testing.assert_close(
            init_centres(start, count, embedding_size=3, seed=5), whole[start : start + count], rtol=0, atol=0
        )
    for start in (0, 7, BLOCK):
        assert init_centres(start, 0, embedding_size=3, seed=5).shape == (0, 3)
    assert not torch.equal(init_centres(0, 4, embedding_size=3, seed=6), whole[:4])  # another seed
    assert not torch.equal(whole[:BLOCK], whole[BLOCK : 2 * BLOCK])  # blocks have their own generators
    # negative seeds wrap to 64 bits; N(0, 0.01²): 6,000+ draws put the sample std within 5 % of 0.01
    torch.testing.assert_close(init_centres(0, 2, embedding_size=3, seed=-1), init_centres(0, 2, embedding_size=3, seed=2**64 - 1))
    assert abs(whole.std().item() - 0.01) < 5e-4
    for start, count in [(-1, 2), (0, -1)]:
        with pytest.raises(ValueError, match=rf"^class range must be non-negative, got start {start}, count {count}$"):
            init_centres(start, count, embedding_size=3, seed=5)


def test_curricularface_deferred_mode_applies_the_whole_steps_mean_at_end_step() -> None:
    from facepipe.heads.margins import CurricularFaceMargin

    margin = CurricularFaceMargin(0.5).train()
    margin.deferred = True  # as the trainer sets it with gradient accumulation
    assert margin.pending.dtype == torch.float64 and "pending" not in margin.state_dict()
    for cos, target in [([[0.9, 0.1]], [0.9]), ([[0.3, 0.2], [0.3, 0.1]], [0.3, 0.3])]:  # step mean 0.5, last 0.3
        margin(torch.tensor(cos, dtype=torch.float64), torch.zeros(len(target), dtype=torch.long), torch.tensor(target, dtype=torch.float64))
    assert margin.t.item() == 0.0  # micro-batches only collect
    margin.end_step()
    assert margin.t.item() == pytest.approx(0.01 * 0.5)  # alpha x the mean of 0.9, 0.3, 0.3
    assert margin.pending.tolist() == [0.0, 0.0]
    margin.end_step()  # an empty step leaves t as it is
    assert margin.t.item() == pytest.approx(0.005)


def test_head_seed_and_sample_rate_defaults_and_limits(one_rank_group: None) -> None:
    from facepipe.heads.centres import init_centres
    from facepipe.heads.partial_fc import sample_classes

    # default seed 0, rows from class 0 on
    expected = init_centres(0, 6, embedding_size=3, seed=0)
    torch.testing.assert_close(create_head("arcface", embedding_size=3, num_classes=6).weight.detach(), expected)
    full = create_model_parallel_head("arcface", embedding_size=3, num_classes=6)
    torch.testing.assert_close(full.weight.detach(), expected)
    full(torch.randn(2, 3), torch.tensor([1, 4]))
    assert full.last_index is None  # rate 1: no sampling at all
    sampled = create_model_parallel_head("arcface", embedding_size=3, num_classes=6, sample_rate=0.5)
    sampled(torch.randn(2, 3), torch.tensor([1, 4]))
    # the first draw is keyed by (seed 0, step 0, micro-batch 0, first class 0)
    assert torch.equal(sampled.last_index, sample_classes(torch.tensor([1, 4]), num_local=6, sample_rate=0.5, key=(0, 0, 0, 0))[0])
    create_model_parallel_head("arcface", embedding_size=3, num_classes=6, sample_rate=1.0)
    for rate in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"^sample_rate must be in \(0, 1\], got {rate}$"):
            create_model_parallel_head("arcface", embedding_size=3, num_classes=6, sample_rate=rate)


def test_factories_pass_the_seed_and_arcface_takes_the_linear_branch_from_the_boundary_on(one_rank_group: None) -> None:
    import math

    from facepipe.heads.centres import init_centres
    from facepipe.heads.margins import angular_target

    for head in (
        create_head("cosface", embedding_size=3, num_classes=4, seed=9),
        create_model_parallel_head("cosface", embedding_size=3, num_classes=4, seed=9),
    ):
        torch.testing.assert_close(head.weight.detach(), init_centres(0, 4, embedding_size=3, seed=9))
    # cos θ exactly at cos(π − m): θ + m = π, where the logit switches to cos θ − m·sin m
    m = 0.5
    boundary = torch.tensor([math.cos(math.pi - m)], dtype=torch.float64)
    torch.testing.assert_close(angular_target(boundary, m), boundary - m * math.sin(m))


# --- softmax (facenet-pytorch's classifier), dense and sharded ------------------------------------------


def softmax_reference(weight: torch.Tensor, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a linear layer whose rows are ``weight[:, :-1]`` and bias ``weight[:, -1]``."""
    return F.cross_entropy(embeddings @ weight[:, :-1].T + weight[:, -1], labels)


def test_softmax_margin_ignores_margin_and_passes_logits_through() -> None:
    from facepipe.heads import SoftmaxLogits

    margin = SoftmaxLogits(0.7)
    assert margin.margin == 0.0 and margin.angular is False and repr(margin) == "SoftmaxLogits(margin=0.0)"
    logits = torch.tensor([[1.5, -2.0], [0.25, 3.0]])
    assert margin(logits, torch.tensor([0, 1]), torch.tensor([1.5, 3.0])) is logits
    assert margin.target_logit(logits) is logits
    head = create_head("softmax", embedding_size=3, num_classes=5, scale=8.0, margin=0.3)
    assert head.margin.margin == 0.0
    assert head.extra_repr() == "embedding_size=3, num_classes=5, scale=8.0"


def test_affine_logits_are_float32_or_float64_outside_autocast() -> None:
    from facepipe.heads.margins import affine_logits

    weight = torch.tensor([[1.0, 2.0, 0.5], [-1.0, 0.0, -0.25]], dtype=torch.float64)
    embeddings = torch.tensor([[3.0, 1.0], [0.0, -2.0]], dtype=torch.float64)
    expected = torch.tensor([[5.5, -3.25], [-3.5, -0.25]], dtype=torch.float64)
    assert torch.equal(affine_logits(embeddings, weight), expected)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = affine_logits(embeddings.to(dtype), weight.float())
        assert got.dtype == torch.float32 and torch.equal(got, expected.float()), dtype
    got = affine_logits(embeddings.float(), weight)  # a float64 head, float32 embeddings: float32
    assert got.dtype == torch.float32 and torch.equal(got, expected.float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = affine_logits(embeddings.float() / 3, weight.float() / 7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (embeddings / 3) @ (weight[:, :2] / 7).T + weight[:, 2] / 7, rtol=1e-6, atol=0, check_dtype=False)


def test_softmax_head_initial_rows_are_the_centres_and_a_zero_bias(one_rank_group: None) -> None:
    from facepipe.heads.centres import init_centres
    from facepipe.heads.dense import initial_rows

    dense = create_head("softmax", embedding_size=4, num_classes=6, seed=3)
    sharded = create_model_parallel_head("softmax", embedding_size=4, num_classes=6, seed=3)
    centres = init_centres(0, 6, embedding_size=4, seed=3)
    for weight in (dense.weight.detach(), sharded.weight.detach()):
        assert weight.shape == (6, 5) and torch.equal(weight[:, :4], centres) and torch.equal(weight[:, 4], torch.zeros(6))
    assert torch.equal(initial_rows(dense.margin, 2, 3, embedding_size=4, seed=3)[:, :4], centres[2:5])
    assert initial_rows(create_head("arcface", embedding_size=4, num_classes=1).margin, 0, 6, embedding_size=4, seed=3).shape == (6, 4)
    assert sharded.extra_repr() == (
        "embedding_size=4, num_classes=6, scale=64.0, sample_rate=1.0, classes=[0, 6) of rank 0/1"
    )


@pytest.mark.parametrize("sample_rate", [1.0, 0.5])
def test_one_rank_sharded_softmax_is_the_linear_cross_entropy(one_rank_group: None, sample_rate: float) -> None:
    torch.manual_seed(0)
    sharded = create_model_parallel_head("softmax", embedding_size=5, num_classes=8, sample_rate=sample_rate).double()
    dense = create_head("softmax", embedding_size=5, num_classes=8).double()
    weight = torch.randn(8, 6, dtype=torch.float64)
    sharded.load_full_weight(weight)
    with torch.no_grad():
        dense.weight.copy_(weight)
    embeddings = torch.randn(6, 5, dtype=torch.float64) * torch.tensor([[0.1], [1.0], [10.0], [3.0], [1.0], [2.0]])
    labels = torch.tensor([0, 6, 3, 3, 1, 5])
    sharded.sample_key = (0, 0)
    ours = embeddings.clone().requires_grad_(True)
    output = sharded.loss_and_correct(ours, labels)
    output.loss.backward()
    rows = sharded.last_index if sample_rate < 1 else torch.arange(8)
    local = torch.searchsorted(rows, labels)
    theirs = embeddings.clone().requires_grad_(True)
    sub = weight[rows].clone().requires_grad_(True)
    reference = softmax_reference(sub, theirs, local)
    reference.backward()
    torch.testing.assert_close(output.loss, reference, rtol=0, atol=1e-13)
    logits = theirs.detach() @ sub.detach()[:, :-1].T + sub.detach()[:, -1]
    assert output.correct.item() == (logits.argmax(1) == local).sum().item() and output.samples == 6
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-13)
    torch.testing.assert_close(sharded.weight.grad[rows], sub.grad, rtol=0, atol=1e-13)
    dense_output = dense.loss_and_correct(embeddings, labels)
    if sample_rate == 1.0:
        torch.testing.assert_close(output.loss, dense_output.loss, rtol=0, atol=1e-13)
        assert dense_output.correct.item() == output.correct.item()
    else:
        assert len(rows) < 8
