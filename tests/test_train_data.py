"""Training data: shard-aware distributed sampling, identity restriction, seeded augmentation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import synthetic_set

from facepipe.config import AugmentParams
from facepipe.data.augment import Augmenter, normalize, to_tensor
from facepipe.data.dataset import FaceDataset, make_loader
from facepipe.data.batch_order import ShardOrderSampler, augment_seeds, shuffled_stream
from facepipe.errors import FacepipeError
from facepipe.io import ShardSetError
from facepipe.io.shards import ShardReader

STRONG = AugmentParams(p_hflip=0.5, p_color_jitter=1.0, hue=0.1, p_crop=0.5, p_blur=0.3, p_grayscale=0.2, p_jpeg=0.3)


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 identities x 10 samples of 16x16, 16 samples per shard (4 shards, identities sorted)."""
    return synthetic_set(tmp_path_factory.mktemp("train_data") / "set", identities=6, per_identity=10)


def epoch_batches(sampler: ShardOrderSampler, epoch: int, start: int = 0) -> list[list[tuple[int, int]]]:
    sampler.set_epoch(epoch, start_sample=start)
    return list(sampler)


# -- sampler ------------------------------------------------------------------------------------------


ITEM_SHARDS = np.repeat(np.arange(7), [16, 16, 16, 16, 16, 16, 7])  # 103 items in 7 shards


@pytest.mark.parametrize("world_size,accum", [(1, 1), (2, 1), (3, 2)])
def test_ranks_are_disjoint_and_cover_the_epoch(world_size, accum):
    samplers = [
        ShardOrderSampler(
            ITEM_SHARDS, batch_size=4, rank=r, world_size=world_size, accum_steps=accum, buffer_size=8, seed=1
        )
        for r in range(world_size)
    ]
    per_rank = [[item for batch in epoch_batches(s, 0) for item, _ in batch] for s in samplers]
    assert len({len(items) for items in per_rank}) == 1  # every rank runs the same number of steps
    assert all(len(batch) == 4 for s in samplers for batch in epoch_batches(s, 0))
    everything = [item for items in per_rank for item in items]
    assert len(everything) == len(set(everything))  # disjoint
    global_batch = 4 * world_size * accum
    usable = len(ITEM_SHARDS) // global_batch * global_batch
    stream = shuffled_stream(ITEM_SHARDS, epoch=0, seed=1, buffer_size=8)
    assert sorted(everything) == sorted(stream[:usable].tolist())  # drop_last, nothing else missing
    assert samplers[0].steps_per_epoch() == usable // global_batch


def test_each_epoch_is_reshuffled_and_reproducible():
    sampler = ShardOrderSampler(ITEM_SHARDS, batch_size=8, buffer_size=8, seed=3)
    first, second = epoch_batches(sampler, 0), epoch_batches(sampler, 1)
    assert first != second
    assert first == epoch_batches(ShardOrderSampler(ITEM_SHARDS, batch_size=8, buffer_size=8, seed=3), 0)
    assert first != epoch_batches(ShardOrderSampler(ITEM_SHARDS, batch_size=8, buffer_size=8, seed=4), 0)


def test_reads_stay_within_a_shard_window():
    """Shards come in a shuffled order, and a window of buffer_size samples spans at most two of them."""
    for epoch in range(3):
        stream = shuffled_stream(ITEM_SHARDS, epoch=epoch, seed=0, buffer_size=8)
        assert sorted(stream.tolist()) == list(range(len(ITEM_SHARDS)))
        for start in range(0, len(stream), 8):
            assert len(set(ITEM_SHARDS[stream[start : start + 8]])) <= 2
    orders = {
        tuple(dict.fromkeys(ITEM_SHARDS[shuffled_stream(ITEM_SHARDS, epoch=e, seed=0, buffer_size=8)]))
        for e in range(4)
    }
    assert len(orders) > 1  # the shard order changes between epochs


def test_a_resumed_epoch_continues_where_it_stopped_for_any_world_size():
    straight = ShardOrderSampler(ITEM_SHARDS, batch_size=4, rank=0, world_size=1, buffer_size=8)
    batches = epoch_batches(straight, 2)
    assert epoch_batches(straight, 2, start=12) == batches[3:]
    # Two ranks resuming after 12 samples consumed by one: together they take the same stream.
    pair = [ShardOrderSampler(ITEM_SHARDS, batch_size=4, rank=r, world_size=2, buffer_size=8) for r in range(2)]
    resumed = {item for s in pair for batch in epoch_batches(s, 2, start=12) for item, _ in batch}
    stream = shuffled_stream(ITEM_SHARDS, epoch=2, seed=0, buffer_size=8)
    assert resumed == set(stream[12 : 12 + (len(stream) - 12) // 8 * 8].tolist())


def test_augmentation_seeds_differ_between_ranks_and_reproduce():
    pair = [ShardOrderSampler(ITEM_SHARDS, batch_size=4, rank=r, world_size=2, seed=5) for r in range(2)]
    seeds = [[seed for batch in epoch_batches(s, 0) for _, seed in batch] for s in pair]
    assert not set(seeds[0]) & set(seeds[1])
    assert seeds[0] == [seed for batch in epoch_batches(pair[0], 0) for _, seed in batch]
    assert not np.array_equal(augment_seeds(10, epoch=0, seed=5), augment_seeds(10, epoch=1, seed=5))


def test_the_epoch_order_is_pinned():
    """Seed 7, epoch 1, shards of 5, 4 and 3 items, windows of 4. A change here changes which samples a
    resumed run skips, so it must be deliberate: shard order 0, 2, 1, then each window shuffled."""
    item_shards = np.repeat(np.arange(3), [5, 4, 3])
    stream = shuffled_stream(item_shards, epoch=1, seed=7, buffer_size=4)
    assert stream.dtype == np.int64
    assert stream.tolist() == [0, 2, 1, 3, 10, 11, 4, 9, 7, 6, 5, 8]
    # the windows hold exactly the shard-ordered items [0..4, 9..11, 5..8] cut in fours
    shard_ordered = [0, 1, 2, 3, 4, 9, 10, 11, 5, 6, 7, 8]
    for start in range(0, 12, 4):
        assert sorted(stream[start : start + 4]) == sorted(shard_ordered[start : start + 4])
    assert augment_seeds(3, epoch=1, seed=7).tolist() == [6869552546566219249, 5755065231262107888, 1041231652669620789]


def test_a_window_of_one_keeps_storage_order_within_shards():
    stream = shuffled_stream(ITEM_SHARDS, epoch=0, seed=0, buffer_size=1)
    starts = [i for i in range(len(stream)) if i == 0 or ITEM_SHARDS[stream[i]] != ITEM_SHARDS[stream[i - 1]]]
    assert len(starts) == 7  # each shard in one run
    assert all(b == a + 1 for a, b in zip(stream, stream[1:]) if ITEM_SHARDS[a] == ITEM_SHARDS[b])
    assert shuffled_stream(np.zeros(0, np.int64), epoch=0, seed=0, buffer_size=8).tolist() == []


def test_the_stream_is_dealt_round_robin_with_its_seeds():
    world, start = 3, 5
    stream = shuffled_stream(ITEM_SHARDS, epoch=4, seed=2, buffer_size=8)
    seeds = augment_seeds(len(ITEM_SHARDS), epoch=4, seed=2)
    usable = (len(ITEM_SHARDS) - start) // (2 * world * 2) * (2 * world * 2)  # 96 of the 98 left
    for rank in range(world):
        sampler = ShardOrderSampler(
            ITEM_SHARDS, batch_size=2, rank=rank, world_size=world, accum_steps=2, buffer_size=8, seed=2
        )
        batches = epoch_batches(sampler, 4, start=start)
        positions = range(start + rank, start + usable, world)
        assert [pair for batch in batches for pair in batch] == [(stream[i], seeds[i]) for i in positions]
        assert len(sampler) == len(batches) == usable // (2 * world)


def test_sampler_defaults_and_limits():
    items = np.repeat(np.arange(3), 3000)  # more than the default window of 4096
    default = ShardOrderSampler(items, batch_size=4)
    explicit = ShardOrderSampler(items, batch_size=4, rank=0, world_size=1, accum_steps=1, buffer_size=4096, seed=0)
    assert epoch_batches(default, 0) == epoch_batches(explicit, 0)
    assert (default.global_batch, default.steps_per_epoch(), len(default)) == (4, 2250, 2250)
    sampler = ShardOrderSampler(ITEM_SHARDS, batch_size=4, world_size=2, accum_steps=1)  # 8 per step, 103 items
    assert not sampler.epoch_finished(95) and sampler.epoch_finished(96)
    sampler.set_epoch(0, start_sample=200)  # past the end: nothing left, not an error
    assert len(sampler) == 0 and list(sampler) == []
    for rank, world in [(-1, 2), (2, 2), (0, 0)]:
        with pytest.raises(ValueError, match=f"^rank {rank} outside world size {world}$"):
            ShardOrderSampler(ITEM_SHARDS, batch_size=4, rank=rank, world_size=world)


# -- augmentation -------------------------------------------------------------------------------------


def test_a_fresh_sampler_and_set_epochs_default_start_at_the_first_sample():
    # before any set_epoch call the sampler is at epoch 0, sample 0; set_epoch's start defaults to 0
    fresh = ShardOrderSampler(ITEM_SHARDS, batch_size=4, buffer_size=8, seed=2)
    batches = list(fresh)
    assert len(batches) == len(fresh) == 103 // 4
    stream = shuffled_stream(ITEM_SHARDS, epoch=0, seed=2, buffer_size=8)
    assert [item for item, _ in batches[0]] == stream[:4].tolist()
    assert batches == epoch_batches(ShardOrderSampler(ITEM_SHARDS, batch_size=4, buffer_size=8, seed=2), 0, start=0)
    fresh.set_epoch(3)
    assert list(fresh) == epoch_batches(ShardOrderSampler(ITEM_SHARDS, batch_size=4, buffer_size=8, seed=2), 3, start=0)
    # the stream is int64 even when there is nothing to shuffle
    assert shuffled_stream(np.zeros(0, np.int64), epoch=0, seed=0, buffer_size=8).dtype == np.int64


def test_a_start_at_or_past_the_end_leaves_nothing():
    sampler = ShardOrderSampler(ITEM_SHARDS, batch_size=1)  # one sample per step: no rounding hides a count
    for start in (103, 110):
        sampler.set_epoch(0, start_sample=start)
        assert len(sampler) == 0 and list(sampler) == []
    sampler.set_epoch(0, start_sample=102)
    assert len(sampler) == 1 and len(list(sampler)) == 1


def test_augmentation_depends_only_on_the_seed():
    image = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    augment = Augmenter(STRONG, image_size=16)
    first = augment(image, 123)
    for seed in range(20):  # whatever ran in between (another worker's history)
        augment(image, seed)
    assert np.array_equal(augment(image, 123), first)
    assert np.array_equal(Augmenter(STRONG, image_size=16)(image, 123), first)
    outputs = {augment(image, seed).tobytes() for seed in range(20)}
    assert len(outputs) > 15
    assert first.shape == (16, 16, 3) and first.dtype == np.uint8


def test_no_augmentation_is_identity():
    image = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    none = AugmentParams(p_hflip=0.0)
    assert Augmenter(none, image_size=16).pipeline is None
    assert Augmenter(none, image_size=16)(image, 1) is image


def test_to_tensor_maps_pixels_to_minus_one_one():
    image = np.array([[[0, 127, 255]]], dtype=np.uint8)
    tensor = to_tensor(image)
    assert tensor.shape == (3, 1, 1) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert tensor.flatten().tolist() == pytest.approx([-1.0, 127 / 127.5 - 1, 1.0])


# -- dataset ------------------------------------------------------------------------------------------


def test_dataset_items(shard_set):
    dataset = FaceDataset(shard_set)
    assert len(dataset) == 60 and dataset.num_classes == 6 and dataset.image_size == 16
    image, label = dataset[0]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32
    assert -1.0 <= image.min() and image.max() <= 1.0
    assert label == 0 and dataset.shards.record(0).label == 0


def test_identity_restriction_remaps_labels_without_reading_images(shard_set, tmp_path, monkeypatch):
    def no_image_reads(*args, **kwargs):  # the label indexes alone must decide
        raise AssertionError("read image bytes")

    # Every way a record leaves a shard: one record, a batch in one transaction, and iteration.
    for method in ("get", "get_many", "__iter__"):
        monkeypatch.setattr(ShardReader, method, no_image_reads)
    by_names = FaceDataset(shard_set, identities=["id0004", "id0001", "id0004"])  # a repeated name counts once
    path = tmp_path / "train_identities.json"
    path.write_text(json.dumps(["id0001", "id0004"]))
    by_file = FaceDataset(shard_set, identities=path)
    reader = by_names.shards.readers[0]
    for read in (lambda: reader.get(0), lambda: reader.get_many([0]), lambda: next(iter(reader))):
        with pytest.raises(AssertionError, match="read image bytes"):  # the guard is live on each path
            read()
    monkeypatch.undo()
    for dataset in (by_names, by_file):
        assert dataset.class_names == ["id0001", "id0004"]  # labels.json order, whatever the list order
        assert dataset.num_classes == 2 and len(dataset) == 20
        assert sorted(set(dataset.labels.tolist())) == [0, 1]
        for item in (0, 9, 10, 19):
            original = dataset.shards.record(int(dataset.indices[item])).label
            assert dataset.class_names[dataset[item][1]] == dataset.shards.identities[original]


def test_unknown_or_empty_identity_lists_are_clear_errors(shard_set, tmp_path):
    with pytest.raises(FacepipeError, match="not in the shard set, e.g. 'nobody'"):
        FaceDataset(shard_set, identities=["id0001", "nobody"])
    with pytest.raises(FacepipeError, match="empty"):
        FaceDataset(shard_set, identities=[])
    with pytest.raises(FacepipeError, match="identity list not found"):
        FaceDataset(shard_set, identities=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"a": 1}')
    with pytest.raises(FacepipeError, match="JSON list of names"):
        FaceDataset(shard_set, identities=tmp_path / "bad.json")


def test_missing_or_corrupt_shard_sets_are_clear_errors(shard_set, tmp_path):
    with pytest.raises(ShardSetError, match="shard set not found"):
        FaceDataset(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardSetError, match="no manifest.json"):
        FaceDataset(tmp_path / "empty")
    broken = synthetic_set(tmp_path / "broken", identities=2, per_identity=8)
    (broken / "shards" / "shard-00000.lmdb").write_bytes(b"not an lmdb file" * 100)
    with pytest.raises(ShardSetError, match="shard-00000.lmdb"):
        FaceDataset(broken)
    (broken / "shards" / "shard-00000.lmdb").unlink()
    with pytest.raises(ShardSetError, match="shard missing"):
        FaceDataset(broken)


def loader_batches(shard_set: Path, workers: int, normalize: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    dataset = FaceDataset(shard_set, seed=0, normalize=normalize)
    dataset.augment = Augmenter(STRONG, image_size=dataset.image_size)
    sampler = ShardOrderSampler(dataset.item_shards, batch_size=8, rank=1, world_size=2, buffer_size=16, seed=0)
    sampler.set_epoch(1)
    return list(make_loader(dataset, sampler, num_workers=workers))


def test_uint8_batches_normalize_to_exactly_the_float_batches(shard_set):
    floats, pixels = loader_batches(shard_set, 0), loader_batches(shard_set, 0, normalize=False)
    assert len(floats) == len(pixels) == 3
    for (images_f, labels_f), (images_u, labels_u) in zip(floats, pixels):
        assert images_u.dtype == torch.uint8 and images_f.dtype == torch.float32
        assert torch.equal(normalize(images_u), images_f) and torch.equal(labels_u, labels_f)
    assert normalize(images_f) is images_f  # float batches pass through


def test_batch_reads_equal_single_reads(shard_set):
    dataset = FaceDataset(shard_set)
    items = [17, 0, 31, 5, 17]  # across shards, out of order, repeated
    assert dataset.read_many(items) == [dataset.read(item) for item in items]


@pytest.mark.multiprocess
@pytest.mark.parametrize("normalized", [True, False])
def test_loader_batches_do_not_depend_on_the_number_of_workers(shard_set, normalized):
    serial, parallel = loader_batches(shard_set, 0, normalized), loader_batches(shard_set, 2, normalized)
    assert len(serial) == len(parallel) == 3
    for (images_a, labels_a), (images_b, labels_b) in zip(serial, parallel):
        assert torch.equal(images_a, images_b) and torch.equal(labels_a, labels_b)
        assert images_a.shape == (8, 3, 16, 16) and labels_a.dtype == torch.int64
