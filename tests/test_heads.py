"""Margin heads against closed forms on hand-made 2-D inputs, gradients, and 2-process gloo runs."""

from __future__ import annotations

import datetime
import math
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from facepipe.heads import (
    CurricularFaceMargin,
    MarginHead,
    class_shard,
    create_head,
    create_model_parallel_head,
    list_heads,
)

S = 64.0
# class centres on the unit circle at these angles (radians), with unequal lengths: heads normalize
CENTRE_ANGLES = [0.0, 1.2, 2.5]
CENTRE_LENGTHS = [2.0, 0.3, 5.0]
# (embedding angle, label): θ_y = 0.3, 0.8, 2.3 (θ_y + m < π) and 2.9 (θ_y + m > π for m = 0.5)
SAMPLES = [(0.3, 0), (2.0, 1), (0.2, 2), (-0.4, 2)]
EMBEDDING_LENGTHS = [3.0, 0.5, 1.0, 7.0]
# float64 logits up to |77| against the same formulas in Python floats: measured 1.4e-14 apart (a few ulps);
# torch's default float64 tolerance (1e-7) would hide a wrong constant in the 8th digit
LOGITS_CLOSE = {"rtol": 0.0, "atol": 1e-12}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def angle_between(a: float, b: float) -> float:
    """The angle θ in [0, π] between directions a and b."""
    return abs((a - b + math.pi) % (2 * math.pi) - math.pi)


def two_d_head(name: str, dtype: torch.dtype = torch.float64) -> tuple[MarginHead, torch.Tensor, torch.Tensor]:
    head = create_head(name, embedding_size=2, num_classes=3).to(dtype)
    with torch.no_grad():
        head.weight.copy_(
            torch.tensor(
                [[r * math.cos(a), r * math.sin(a)] for a, r in zip(CENTRE_ANGLES, CENTRE_LENGTHS)], dtype=dtype
            )
        )
    embeddings = torch.tensor(
        [[r * math.cos(phi), r * math.sin(phi)] for (phi, _), r in zip(SAMPLES, EMBEDDING_LENGTHS)], dtype=dtype
    )
    labels = torch.tensor([label for _, label in SAMPLES])
    return head, embeddings, labels


def thetas() -> list[list[float]]:
    return [[angle_between(phi, a) for a in CENTRE_ANGLES] for phi, _ in SAMPLES]


def arcface_by_hand(theta: float, m: float) -> float:
    # cos(θ + m) while θ + m ≤ π; past it the insightface rule cos θ − sin(π − m)·m
    return math.cos(theta + m) if theta < math.pi - m else math.cos(theta) - math.sin(math.pi - m) * m


# --- registry -----------------------------------------------------------------------------------


def test_registry_and_defaults():
    assert list_heads() == ["arcface", "cosface", "curricularface", "softmax"]
    defaults = {name: create_head(name, embedding_size=4, num_classes=3).margin.margin for name in list_heads()}
    assert defaults == {"arcface": 0.5, "cosface": 0.35, "curricularface": 0.5, "softmax": 0.0}
    head = create_head("cosface", embedding_size=4, num_classes=3, scale=30.0, margin=0.2)
    assert (head.scale, head.margin.margin, tuple(head.weight.shape)) == (30.0, 0.2, (3, 4))


def test_unknown_head_is_a_value_error_naming_the_known_ones():
    with pytest.raises(ValueError, match="'sphereface'.*arcface, cosface, curricularface"):
        create_head("sphereface", embedding_size=4, num_classes=3)


# --- closed forms ---------------------------------------------------------------------------------


def test_arcface_closed_form():
    head, embeddings, labels = two_d_head("arcface")
    expected = [
        [S * (arcface_by_hand(t, 0.5) if j == y else math.cos(t)) for j, t in enumerate(row)]
        for row, (_, y) in zip(thetas(), SAMPLES)
    ]
    torch.testing.assert_close(head(embeddings, labels), torch.tensor(expected, dtype=torch.float64), **LOGITS_CLOSE)
    # the last sample has θ_y = 2.9 > π − m: the linear branch, not cos(3.4) (which would be higher)
    assert head(embeddings, labels)[3, 2].item() == pytest.approx(S * (math.cos(2.9) - 0.5 * math.sin(0.5)), abs=1e-12)


def test_cosface_closed_form():
    head, embeddings, labels = two_d_head("cosface")
    expected = [
        [S * (math.cos(t) - 0.35 if j == y else math.cos(t)) for j, t in enumerate(row)]
        for row, (_, y) in zip(thetas(), SAMPLES)
    ]
    torch.testing.assert_close(head(embeddings, labels), torch.tensor(expected, dtype=torch.float64), **LOGITS_CLOSE)


def curricular_by_hand(t_before: float, m: float = 0.5, alpha: float = 0.01) -> tuple[list[list[float]], float]:
    """Expected logits of one training-mode call, and the updated t (used by that same call)."""
    angles = thetas()
    target_cos = [math.cos(row[y]) for row, (_, y) in zip(angles, SAMPLES)]
    t = alpha * sum(target_cos) / len(target_cos) + (1 - alpha) * t_before
    expected = []
    for row, (_, y) in zip(angles, SAMPLES):
        positive = math.cos(row[y] + m)  # the paper's T(cos θ_y): decides which negatives are hard
        logits = []
        for j, theta in enumerate(row):
            c = math.cos(theta)
            if j == y:
                logits.append(S * arcface_by_hand(theta, m))
            elif c > positive:
                logits.append(S * c * (t + c))
            else:
                logits.append(S * c)
        expected.append(logits)
    return expected, t


def test_curricularface_closed_form_and_t_update():
    head, embeddings, labels = two_d_head("curricularface")
    margin = head.margin
    assert isinstance(margin, CurricularFaceMargin) and margin.t.item() == 0.0

    expected, t1 = curricular_by_hand(0.0)
    torch.testing.assert_close(head(embeddings, labels), torch.tensor(expected, dtype=torch.float64), **LOGITS_CLOSE)
    assert margin.t.item() == pytest.approx(t1, rel=1e-12)  # float64 t: measured 7.5e-15 relative
    # the fixture has both kinds of negatives: hard (sample 2 vs class 0) and easy (sample 0 vs class 1)
    cos = [[math.cos(t) for t in row] for row in thetas()]
    assert cos[2][0] > math.cos(2.3 + 0.5) and cos[0][1] < math.cos(0.3 + 0.5)

    expected, t2 = curricular_by_hand(t1)
    torch.testing.assert_close(head(embeddings, labels), torch.tensor(expected, dtype=torch.float64), **LOGITS_CLOSE)
    assert margin.t.item() == pytest.approx(t2, rel=1e-12)  # float64 t: measured 7.5e-15 relative

    # evaluation mode reads t and leaves it alone
    head.eval()
    before = margin.t.clone()
    head(embeddings, labels)
    head(embeddings[:1], labels[:1])
    assert torch.equal(margin.t, before)


def test_arcface_stays_monotone_when_theta_plus_m_passes_pi():
    m = 0.5
    head = create_head("arcface", embedding_size=2, num_classes=1).double()
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0]]))
    theta = torch.linspace(0.0, math.pi, 401, dtype=torch.float64)
    embeddings = torch.stack([theta.cos(), theta.sin()], dim=1).requires_grad_(True)
    target = head(embeddings, torch.zeros(401, dtype=torch.long))[:, 0]

    steps = target[1:] - target[:-1]
    assert (steps < 0).all(), "the positive logit must fall as the angle grows"
    beyond = theta > math.pi - m
    assert beyond.sum() > 10
    torch.testing.assert_close(target[beyond], S * (theta[beyond].cos() - m * math.sin(m)))
    # the naive cos(θ + m) would turn back up there: that is the case the rule exists for
    naive = S * (theta + m).cos()
    assert (naive[beyond][1:] - naive[beyond][:-1] > 0).all()
    target.sum().backward()
    assert torch.isfinite(embeddings.grad).all()


def test_gradient_is_finite_on_a_class_centre():
    for name in list_heads():
        head = create_head(name, embedding_size=3, num_classes=4)
        embeddings = head.weight.detach()[:2, :3].clone().requires_grad_(True)  # cos θ_y = 1 exactly
        F.cross_entropy(head(embeddings, torch.tensor([0, 1])), torch.tensor([0, 1])).backward()
        assert torch.isfinite(embeddings.grad).all() and torch.isfinite(head.weight.grad).all(), name


# --- softmax: facenet-pytorch's classifier ----------------------------------------------------------


def linear_as_softmax_head(linear: torch.nn.Linear) -> MarginHead:
    """A softmax head holding ``linear``'s weight and bias (the bias is the last column of its rows)."""
    head = create_head("softmax", embedding_size=linear.in_features, num_classes=linear.out_features).double()
    with torch.no_grad():
        head.weight.copy_(torch.cat([linear.weight, linear.bias[:, None]], dim=1))
    return head


def test_softmax_head_equals_cross_entropy_on_a_linear_layer():
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 5).double()
    head = linear_as_softmax_head(linear)
    assert tuple(head.weight.shape) == (5, 7) and "embedding_size=6" in repr(head)
    # unnormalized embeddings of very different lengths: the softmax head must not normalize them
    embeddings = torch.randn(4, 6, dtype=torch.float64) * torch.tensor([[0.1], [1.0], [10.0], [3.0]])
    labels = torch.tensor([0, 4, 2, 2])
    ours_input, ref_input = embeddings.clone().requires_grad_(True), embeddings.clone().requires_grad_(True)
    output = head.loss_and_correct(ours_input, labels)
    logits = linear(ref_input)
    reference = torch.nn.CrossEntropyLoss()(logits, labels)
    output.loss.backward()
    reference.backward()
    torch.testing.assert_close(output.loss, reference, rtol=0, atol=1e-15)
    assert output.correct.item() == (logits.argmax(1) == labels).sum().item() and output.samples == 4
    torch.testing.assert_close(ours_input.grad, ref_input.grad, rtol=0, atol=1e-15)
    torch.testing.assert_close(head.weight.grad[:, :6], linear.weight.grad, rtol=0, atol=1e-15)
    torch.testing.assert_close(head.weight.grad[:, 6], linear.bias.grad, rtol=0, atol=1e-15)
    # scale and margin do not apply
    scaled = create_head("softmax", embedding_size=6, num_classes=5, scale=64.0, margin=0.5).double()
    scaled.load_state_dict(head.state_dict())
    torch.testing.assert_close(scaled(embeddings, labels), linear(embeddings), rtol=0, atol=1e-15)


def test_softmax_head_starts_with_the_seeded_centres_and_zero_bias():
    head = create_head("softmax", embedding_size=4, num_classes=3, seed=7)
    cosface = create_head("cosface", embedding_size=4, num_classes=3, seed=7)
    assert torch.equal(head.weight[:, :4], cosface.weight) and torch.equal(head.weight[:, 4], torch.zeros(3))


# --- gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["arcface", "cosface", "curricularface", "softmax"])
def test_gradcheck_float64(name: str):
    torch.manual_seed(0)
    head = create_head(name, embedding_size=4, num_classes=5).double()
    if isinstance(head.margin, CurricularFaceMargin):
        head.margin.t.fill_(0.3)
        head.eval()  # a training-mode call moves t, so repeated calls would not be one function
    embeddings = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, 4])

    def logits(e: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(head, {"weight": w}, (e, labels))

    assert torch.autograd.gradcheck(logits, (embeddings, head.weight.detach().clone().requires_grad_(True)))


@pytest.mark.parametrize("name", ["arcface", "cosface", "curricularface"])
def test_autograd_equals_the_hand_derivative(name: str):
    """2-D embeddings r·(cos φ, sin φ): every logit is a function of φ with a closed-form derivative."""
    head, _, labels = two_d_head(name)
    t = 0.0
    if name == "curricularface":
        head.eval()
        t = 0.25
        head.margin.t.fill_(t)
    m = head.margin.margin
    phi = torch.tensor([phi for phi, _ in SAMPLES], dtype=torch.float64, requires_grad=True)
    radius = torch.tensor(EMBEDDING_LENGTHS, dtype=torch.float64)
    embeddings = torch.stack([radius * phi.cos(), radius * phi.sin()], dim=1)
    weights = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (head(embeddings, labels) * weights).sum().backward()

    expected = []
    for i, (angle, y) in enumerate(SAMPLES):
        total = 0.0
        for j, centre in enumerate(CENTRE_ANGLES):
            delta = angle - centre
            d_cos = -math.sin(delta)  # d cos(φ − α_j) / dφ
            theta = angle_between(angle, centre)
            if j == y and name == "cosface":
                d = d_cos
            elif j == y and theta < math.pi - m:
                # d cos(θ + m)/dφ with θ = |φ − α| (wrapped): −sin(θ + m)·dθ/dφ, dθ/dφ = −d_cos / sin θ
                d = -math.sin(theta + m) * (-d_cos / math.sin(theta))
            elif j == y:
                d = d_cos  # linear branch: cos θ − m·sin m
            elif name == "curricularface" and math.cos(theta) > math.cos(angle_between(angle, CENTRE_ANGLES[y]) + m):
                d = (t + 2 * math.cos(theta)) * d_cos  # d/dφ [c (t + c)]
            else:
                d = d_cos
            total += weights[i, j].item() * S * d
        expected.append(total)
    # float64 sums of 3 terms up to ~200: measured 2.8e-14 apart; 1e-11 is far above rounding, far below a wrong term
    torch.testing.assert_close(phi.grad, torch.tensor(expected, dtype=torch.float64), rtol=0.0, atol=1e-11)


def test_float32_even_under_autocast():
    torch.manual_seed(0)
    for name in list_heads():
        head = create_head(name, embedding_size=8, num_classes=6).eval()
        embeddings = torch.randn(4, 8)
        labels = torch.tensor([0, 1, 2, 5])
        reference = head(embeddings, labels)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = head(embeddings, labels)
        assert under_autocast.dtype == torch.float32
        torch.testing.assert_close(under_autocast, reference, rtol=0, atol=0)
        # half-precision embeddings (a backbone under autocast) are upcast, not computed in bf16
        from_bf16 = head(embeddings.bfloat16(), labels)
        assert from_bf16.dtype == torch.float32
        torch.testing.assert_close(from_bf16, head(embeddings.bfloat16().float(), labels), rtol=0, atol=0)


def test_class_shards_partition_the_classes():
    for classes in (1, 2, 7, 10, 1001):
        for world in range(1, min(classes, 9) + 1):
            shards = [class_shard(classes, rank, world) for rank in range(world)]
            assert shards[0][0] == 0 and sum(count for _, count in shards) == classes
            assert all(a[0] + a[1] == b[0] for a, b in zip(shards, shards[1:]))
            assert max(c for _, c in shards) - min(c for _, c in shards) <= 1
    assert [class_shard(7, rank, 2) for rank in range(2)] == [(0, 4), (4, 3)]


def test_model_parallel_head_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(RuntimeError, match="process group"):
        create_model_parallel_head("arcface", embedding_size=4, num_classes=8)


# --- two processes ---------------------------------------------------------------------------------

WORLD = 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def join_group(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )


def rank_batch(rank: int, step: int, batch: int, embedding_size: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    embeddings = torch.randn(batch, embedding_size, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, classes, (batch,), generator=generator)
    return embeddings, labels


def curricular_t_worker(rank: int, port: int, result_dir: str) -> None:
    join_group(rank, port)
    try:
        torch.manual_seed(0)  # the same class centres on both ranks, as DDP would make them
        head = create_head("curricularface", embedding_size=6, num_classes=5).double()
        history = []
        for step in range(3):
            # ranks see different batches, of different sizes
            embeddings, labels = rank_batch(rank, step, 3 + rank, 6, 5)
            head(embeddings, labels)
            history.append(head.margin.t.item())
        torch.save(torch.tensor(history, dtype=torch.float64), f"{result_dir}/t-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_curricular_t_is_identical_across_ranks(tmp_path):
    mp.spawn(curricular_t_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    histories = [torch.load(tmp_path / f"t-{rank}.pt") for rank in range(WORLD)]
    assert torch.equal(histories[0], histories[1])

    torch.manual_seed(0)
    head = create_head("curricularface", embedding_size=6, num_classes=5).double()
    weight = F.normalize(head.weight.detach(), dim=1)
    t, local_t, expected = 0.0, 0.0, []
    for step in range(3):
        cosines = []
        for rank in range(WORLD):
            embeddings, labels = rank_batch(rank, step, 3 + rank, 6, 5)
            cosines.append((F.normalize(embeddings, dim=1) @ weight.T).gather(1, labels[:, None]).squeeze(1))
        t = 0.01 * torch.cat(cosines).mean().item() + 0.99 * t  # mean over the global batch
        local_t = 0.01 * cosines[0].mean().item() + 0.99 * local_t
        expected.append(t)
    torch.testing.assert_close(histories[0], torch.tensor(expected, dtype=torch.float64))
    assert abs(local_t - t) > 1e-6, "without the all-reduce rank 0 would drift: the test must see that"


def model_parallel_worker(rank: int, port: int) -> None:
    join_group(rank, port)
    try:
        embedding_size, classes, batch = 5, 7, 3  # 7 classes: shards of 4 and 3
        for name in list_heads():
            torch.manual_seed(0)
            dense = create_head(name, embedding_size=embedding_size, num_classes=classes).double()
            sharded = create_model_parallel_head(name, embedding_size=embedding_size, num_classes=classes).double()
            sharded.load_full_weight(dense.weight.detach())
            torch.testing.assert_close(sharded.gather_weight(), dense.weight.detach(), rtol=0, atol=0)
            start, count = class_shard(classes, rank, WORLD)
            assert (sharded.class_start, sharded.num_local) == (start, count)

            for step in range(2):  # two steps: CurricularFace's t must evolve the same way
                embeddings, labels = rank_batch(rank, step, batch, embedding_size, classes)
                dense_input = embeddings.clone().requires_grad_(True)
                sharded_input = embeddings.clone().requires_grad_(True)
                dense.zero_grad()
                sharded.zero_grad()

                # data parallel with the dense head: per-rank mean loss, DDP averages the head gradient
                dense_loss = F.cross_entropy(dense(dense_input, labels), labels)
                dense_loss.backward()
                mean_loss = dense_loss.detach().clone()
                dist.all_reduce(mean_loss)
                mean_loss /= WORLD
                weight_grad = dense.weight.grad.clone()
                dist.all_reduce(weight_grad)
                weight_grad /= WORLD

                loss = sharded(sharded_input, labels)
                loss.backward()
                message = f"{name} step {step} rank {rank}"
                torch.testing.assert_close(loss, mean_loss, msg=message)
                torch.testing.assert_close(sharded_input.grad, dense_input.grad, msg=message)
                torch.testing.assert_close(sharded.weight.grad, weight_grad[start : start + count], msg=message)
                if isinstance(dense.margin, CurricularFaceMargin):
                    torch.testing.assert_close(sharded.margin.t, dense.margin.t, msg=message)
                    assert dense.margin.t.item() != 0.0
    finally:
        dist.destroy_process_group()


def sharded_softmax_worker(rank: int, port: int) -> None:
    join_group(rank, port)
    try:
        embedding_size, classes, batch = 5, 7, 3  # 7 classes: shards of 4 and 3
        torch.manual_seed(0)  # the same layer on both ranks
        linear = torch.nn.Linear(embedding_size, classes).double()
        head = create_model_parallel_head("softmax", embedding_size=embedding_size, num_classes=classes).double()
        head.load_full_weight(torch.cat([linear.weight, linear.bias[:, None]], dim=1).detach())
        batches = [rank_batch(r, 0, batch, embedding_size, classes) for r in range(WORLD)]
        embeddings, labels = batches[rank]
        ours_input = embeddings.clone().requires_grad_(True)
        output = head.loss_and_correct(ours_input, labels)
        output.loss.backward()
        # the global batch through nn.Linear and CrossEntropyLoss, on one process
        every = torch.cat([e for e, _ in batches]).requires_grad_(True)
        every_labels = torch.cat([y for _, y in batches])
        logits = linear(every)
        reference = torch.nn.CrossEntropyLoss()(logits, every_labels)
        reference.backward()
        message = f"rank {rank}"
        torch.testing.assert_close(output.loss, reference, rtol=0, atol=1e-14, msg=message)
        assert output.correct.item() == (logits.argmax(1) == every_labels).sum().item(), message
        # the backbone sees the gradient of the global mean times W (DDP divides by W again)
        rows = every.grad[rank * batch : (rank + 1) * batch] * WORLD
        torch.testing.assert_close(ours_input.grad, rows, rtol=0, atol=1e-14, msg=message)
        start, count = class_shard(classes, rank, WORLD)
        full = torch.cat([linear.weight.grad, linear.bias.grad[:, None]], dim=1)
        torch.testing.assert_close(head.weight.grad, full[start : start + count], rtol=0, atol=1e-14, msg=message)
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_sharded_softmax_head_equals_cross_entropy_on_a_linear_layer():
    mp.spawn(sharded_softmax_worker, args=(free_port(),), nprocs=WORLD, join=True)


@pytest.mark.multiprocess
def test_model_parallel_head_equals_the_dense_head():
    mp.spawn(model_parallel_worker, args=(free_port(),), nprocs=WORLD, join=True)
