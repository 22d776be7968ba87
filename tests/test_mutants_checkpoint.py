"""training/checkpoint.py function by function, fast and exact (the mutation tests of the module:
every message matched whole, the checksum's byte layout computed by hand)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import facepipe.training.checkpoint as checkpoint
from facepipe.errors import FacepipeError
from facepipe.training.checkpoint import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION,
    UnverifiedCheckpoint,
    agreed_resume_point,
    atomic_save,
    capture_rng_state,
    checkpoint_name,
    decode_class_names,
    disagreement,
    encode_class_names,
    latest_checkpoint,
    latest_good_checkpoint,
    list_checkpoints,
    load_checkpoint,
    remove_checkpoints,
    restore_rng_state,
    save_checkpoint,
    state_checksum,
)
from facepipe.training.distributed import Distributed

CPU = torch.device("cpu")
ONE = Distributed(rank=0, local_rank=0, world_size=1, device=CPU)


def state(step: int = 3, **extra: object) -> dict:
    return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "step": step, **extra}


def test_format_and_version_constants():
    assert (CHECKPOINT_FORMAT, CHECKPOINT_VERSION, checkpoint._READS) == ("facepipe-train-checkpoint", 3, (1, 2, 3))


def test_checkpoint_names_have_at_least_eight_digits():
    assert checkpoint_name(7) == "step-00000007.pt"
    assert checkpoint_name(123_456_789) == "step-123456789.pt"


def test_atomic_save_writes_the_object_and_leaves_no_temporary(tmp_path):
    path = atomic_save({"a": torch.arange(3)}, tmp_path / "x.pt")
    assert path == tmp_path / "x.pt"
    assert torch.equal(torch.load(path, weights_only=True)["a"], torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.pt"]


def test_class_names_round_trip_and_refusals():
    blob = encode_class_names(["a", "Zoë"])
    assert blob.dtype == torch.uint8 and blob.dim() == 1
    assert bytes(blob.numpy()) == json.dumps(["a", "Zoë"]).encode()
    assert decode_class_names(blob) == ["a", "Zoë"]
    with pytest.raises(FacepipeError) as error:
        decode_class_names(torch.tensor(list(b"[1, 2"), dtype=torch.uint8))
    assert re.fullmatch(r"checkpoint class_names unreadable \(.+\)", str(error.value))
    with pytest.raises(FacepipeError) as error:
        decode_class_names(torch.tensor(list(b"\xff\xfe"), dtype=torch.uint8))
    assert str(error.value).startswith("checkpoint class_names unreadable (")
    for value in (b'{"a": 1}', b'["a", 2]', b"[1]"):
        with pytest.raises(FacepipeError) as error:
            decode_class_names(torch.tensor(list(value), dtype=torch.uint8))
        assert str(error.value) == "checkpoint class_names is not a list of names"
    assert decode_class_names(encode_class_names([])) == []


def _by_hand(parts: list[bytes]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def test_the_checksum_layout_by_hand():
    tensor = torch.tensor([[1, 2], [3, 4]], dtype=torch.int16)
    value = {"checksum": "ignored", "b": [1, (2.5, None)], "a": {"t": tensor, 3: "x"}, "e": torch.zeros(0)}
    expected = _by_hand([
        b"D3",
        b"Kstr:'a'", b"D2",
        b"Kint:3", b"Vstr:'x'",  # keys sorted by (type name, repr): int before str
        b"Kstr:'t'", b"Ttorch.int16(2, 2)", tensor.numpy().tobytes(),
        b"Kstr:'b'", b"L2", b"Vint:1", b"L2", b"Vfloat:2.5", b"VNoneType:None",
        b"Kstr:'e'", b"Ttorch.float32(0,)",
    ])
    assert state_checksum(value) == expected
    assert state_checksum({**value, "checksum": "other"}) == expected


def test_the_checksum_tells_values_types_dtypes_and_shapes_apart():
    base = state_checksum({"t": torch.arange(4, dtype=torch.int32)})
    assert state_checksum({"t": torch.arange(4, dtype=torch.int32).reshape(2, 2)}) != base
    assert state_checksum({"t": torch.arange(4, dtype=torch.int32).view(torch.float32)}) != base
    assert state_checksum({"t": torch.tensor([0, 1, 2, 5], dtype=torch.int32)}) != base
    assert state_checksum({"a": 1}) != state_checksum({"a": 1.0}) != state_checksum({"a": "1"})
    assert state_checksum({1: 1}) != state_checksum({"1": 1})
    assert state_checksum({"a": [1, 2]}) == state_checksum({"a": (1, 2)})  # torch.load may give either
    assert state_checksum({"a": [1, 2]}) != state_checksum({"a": [[1, 2]]})
    non_contiguous = torch.arange(6, dtype=torch.int64).reshape(2, 3).t()
    assert state_checksum({"t": non_contiguous}) == state_checksum({"t": non_contiguous.contiguous()})


def test_list_and_latest_checkpoints(tmp_path):
    assert list_checkpoints(tmp_path / "missing") == [] and latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    names = ["step-00000002.pt", "step-100000000.pt", "step-99999999.pt", "step-1.pt", "step-00000003.pt.corrupt",
             ".step-00000009.pt.tmp-1", "step-0000000x.pt", "xstep-00000004.pt", "step-00000005.ptx"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert list_checkpoints(tmp_path) == [
        (2, tmp_path / "step-00000002.pt"), (99_999_999, tmp_path / "step-99999999.pt"), (100_000_000, tmp_path / "step-100000000.pt"),
    ]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-100000000.pt"


def test_save_checkpoint_checksums_encodes_names_and_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        path = save_checkpoint(tmp_path, state(step, class_names=("a", "b")), step=step, keep=2)
    assert path == tmp_path / "step-00000004.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003.pt", "step-00000004.pt"]
    raw = torch.load(path, weights_only=True)
    assert torch.equal(raw["class_names"], encode_class_names(["a", "b"]))
    assert raw["checksum"] == state_checksum(raw)
    save_checkpoint(tmp_path, state(5), step=5, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005.pt"]
    assert "class_names" not in torch.load(tmp_path / "step-00000005.pt", weights_only=True)


def test_load_checkpoint_refusals_are_whole_one_line_messages(tmp_path):
    path = tmp_path / "step-00000001.pt"
    for content in (b"not a zip", None):
        if content is None:  # a pickled object: weights_only refuses to build it
            torch.save({"format": CHECKPOINT_FORMAT, "version": 3, "obj": random.Random()}, path)
        else:
            path.write_bytes(content)
        try:
            torch.load(path, map_location="cpu", weights_only=True)
        except Exception as failure:  # noqa: BLE001  (what torch says, to compare with)
            said = f"{type(failure).__name__}: {str(failure).splitlines()[0]}"
        with pytest.raises(FacepipeError) as error:
            load_checkpoint(path)
        assert str(error.value) == f"checkpoint unreadable: {path} ({said})"
    for content in ([1, 2], {"format": "other", "version": 3}, {"version": 3}):
        torch.save(content, path)
        with pytest.raises(FacepipeError) as error:
            load_checkpoint(path)
        assert str(error.value) == f"not a facepipe training checkpoint: {path}"
    for version in (0, 4, None, "3"):
        torch.save({"format": CHECKPOINT_FORMAT, "version": version}, path)
        with pytest.raises(FacepipeError) as error:
            load_checkpoint(str(path))
        assert str(error.value) == f"checkpoint version {version} is not supported (reads 1, 2, 3): {path}"
    good = state(class_names=encode_class_names(["x"]))
    atomic_save({**good, "checksum": state_checksum(good)}, path)
    loaded = load_checkpoint(str(path))
    assert loaded["class_names"] == ["x"] and loaded["step"] == 3
    atomic_save({**good, "step": 4, "checksum": state_checksum(good)}, path)
    with pytest.raises(FacepipeError) as error:
        load_checkpoint(path)
    assert str(error.value) == f"checkpoint corrupt: {path} (its content does not match its checksum)"
    atomic_save({**good, "checksum": None}, path)
    with pytest.raises(FacepipeError, match="^checkpoint corrupt"):
        load_checkpoint(path, unverified_ok=True)
    bad_names = state(class_names=torch.tensor(list(b"[1]"), dtype=torch.uint8))
    atomic_save({**bad_names, "checksum": state_checksum(bad_names)}, path)
    with pytest.raises(FacepipeError) as error:
        load_checkpoint(path)
    assert str(error.value) == f"checkpoint class_names is not a list of names: {path}"


def test_version_2_files_verify_and_version_1_files_need_the_opt_in(tmp_path, caplog):
    path = tmp_path / "step-00000001.pt"
    old = state(version=2, class_names=["a"])
    atomic_save({**old, "checksum": state_checksum(old)}, path)
    assert load_checkpoint(path)["class_names"] == ["a"]
    atomic_save(state(version=1), path)
    with pytest.raises(UnverifiedCheckpoint) as error:
        load_checkpoint(path)
    assert str(error.value) == (
        f"checkpoint {path} is version 1, written before checksums: it cannot be verified; resume from it"
        " with --trust-unverified-checkpoint only if you know where it came from, or run with --fresh"
    )
    with caplog.at_level(logging.WARNING, logger="facepipe.training"):
        assert load_checkpoint(path, unverified_ok=True)["step"] == 3
    assert [r.getMessage() for r in caplog.records] == [
        f"{path} predates checkpoint checksums: loading it unverified (--trust-unverified-checkpoint)"
    ]


def test_latest_good_checkpoint_sets_corrupt_ones_aside(tmp_path, caplog):
    assert latest_good_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, state(1), step=1, keep=5)
    save_checkpoint(tmp_path, state(2), step=2, keep=5)
    (tmp_path / "step-00000003.pt").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="facepipe.training"):
        path, loaded = latest_good_checkpoint(tmp_path)
    assert path == tmp_path / "step-00000002.pt" and loaded["step"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt", "step-00000002.pt", "step-00000003.pt.corrupt"]
    message = caplog.records[-1].getMessage()
    assert re.fullmatch(
        rf"checkpoint unreadable: {re.escape(str(tmp_path))}/step-00000003.pt \(.+\); set aside as step-00000003.pt.corrupt,"
        r" trying the previous checkpoint",
        message,
    ), message
    for step in (1, 2):
        (tmp_path / checkpoint_name(step)).write_bytes(b"garbage")
    with pytest.raises(FacepipeError) as error:
        latest_good_checkpoint(str(tmp_path))
    assert str(error.value) == f"no usable checkpoint in {tmp_path} (all corrupt); run with --fresh"


def test_latest_good_checkpoint_stops_at_a_version_1_file_and_leaves_it(tmp_path):
    save_checkpoint(tmp_path, state(1), step=1, keep=5)
    atomic_save(state(2, version=1), tmp_path / "step-00000002.pt")
    with pytest.raises(UnverifiedCheckpoint):
        latest_good_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001.pt", "step-00000002.pt"]
    assert latest_good_checkpoint(tmp_path, unverified_ok=True)[1]["step"] == 2


def test_agreed_resume_point_in_one_process(tmp_path, monkeypatch):
    gathered = []
    real = checkpoint.all_gather_objects
    monkeypatch.setattr(checkpoint, "all_gather_objects", lambda facts, context: gathered.append(facts) or real(facts, context))
    assert agreed_resume_point(tmp_path, ONE, fresh=False, data={"samples": 5}) is None
    assert gathered[-1] == {"resumes from": "no checkpoint (a new run)", "newest checkpoint seen": "none", "samples": "5"}
    written = save_checkpoint(tmp_path, state(4), step=4, keep=5)
    path, loaded = agreed_resume_point(str(tmp_path), ONE, fresh=False, data={})
    assert path == written and loaded["step"] == 4
    checksum = loaded["checksum"]
    assert gathered[-1] == {"resumes from": f"step-00000004.pt (step 4, sha256 {checksum[:16]})", "newest checkpoint seen": "step-00000004.pt"}
    assert agreed_resume_point(tmp_path, ONE, fresh=True, data={}) is None
    assert gathered[-1]["newest checkpoint seen"] == "none" and gathered[-1]["resumes from"] == "no checkpoint (a new run)"
    atomic_save(state(5, version=1), tmp_path / "step-00000005.pt")
    with pytest.raises(FacepipeError, match=rf"^checkpoint {re.escape(str(tmp_path))}/step-00000005.pt is version 1, written before"):
        agreed_resume_point(tmp_path, ONE, fresh=False, data={})
    path, loaded = agreed_resume_point(tmp_path, ONE, fresh=False, data={}, unverified_ok=True)
    assert loaded["step"] == 5
    assert gathered[-1]["resumes from"] == f"step-00000005.pt (step 5, sha256 {state_checksum(loaded)[:16]})"
    for name in ("step-00000004.pt", "step-00000005.pt"):
        (tmp_path / name).write_bytes(b"garbage")
    with pytest.raises(FacepipeError) as error:
        agreed_resume_point(tmp_path, ONE, fresh=False, data={})
    assert str(error.value) == f"no usable checkpoint in {tmp_path} (all corrupt); run with --fresh"


def test_a_rank_that_cannot_open_the_chosen_checkpoint_says_why(tmp_path, monkeypatch):
    """Rank 1's view (rank 0 picked a file this rank cannot read): what it contributes to the comparison."""
    gathered = []
    monkeypatch.setattr(checkpoint, "broadcast_object", lambda obj, context: (str(tmp_path / "step-00000004.pt"), None))
    monkeypatch.setattr(checkpoint, "all_gather_objects", lambda facts, context: gathered.append(facts) or [facts])
    rank1 = Distributed(rank=1, local_rank=1, world_size=1, device=CPU)
    assert agreed_resume_point(tmp_path, rank1, fresh=False, data={}) is not None  # one "rank" agrees with itself
    assert gathered[-1]["resumes from"].startswith(f"cannot use it: checkpoint unreadable: {tmp_path}/step-00000004.pt (")
    monkeypatch.setattr(checkpoint, "all_gather_objects", lambda facts, context: [facts, {**facts, "samples": "9"}])
    with pytest.raises(FacepipeError) as error:
        agreed_resume_point(tmp_path, rank1, fresh=False, data={"samples": 8})
    assert str(error.value) == (
        "the 1 processes disagree on how to resume (samples): rank 0: samples 8; rank 1: samples 9; every node must see"
        " the same output folder (a shared filesystem, or copies made before the run) and the same shard set:"
        " README.md, 'Several machines'"
    )


def test_disagreement_names_the_differing_facts_per_group():
    same = {"a": "1", "b": "2"}
    assert disagreement([same]) is None and disagreement([same, dict(same)]) is None
    assert disagreement([same, {"a": "1", "b": "3"}, dict(same)]) == (
        "processes disagree on how to resume (b): ranks 0,2: b 2; rank 1: b 3"
    )
    assert disagreement([same, {"a": "0"}]) == "processes disagree on how to resume (a, b): rank 0: a 1, b 2; rank 1: a 0, b None"


def test_remove_checkpoints_removes_only_its_own_files(tmp_path):
    remove_checkpoints(tmp_path / "missing")
    ours = ["step-00000001.pt", "step-00000002.pt.corrupt", ".step-00000003.pt.tmp-12"]
    theirs = ["notes.txt", "step-1.pt", "step-00000004.pt.bak", ".step-00000003.pt.tmp-x"]
    for name in ours + theirs:
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "step-00000009.pt").mkdir()
    os.symlink(tmp_path / "notes.txt", tmp_path / "step-00000008.pt")
    remove_checkpoints(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*theirs, "step-00000008.pt", "step-00000009.pt"])
    assert (tmp_path / "notes.txt").exists()


def test_rng_states_restore_every_generator(tmp_path):
    torch.manual_seed(1)
    np.random.seed(2)
    random.seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's generator
    np.random.normal()  # and none in NumPy's
    np.random.standard_normal()
    saved = capture_rng_state(CPU)
    assert saved["cuda"].numel() == 0 and saved["cuda"].dtype == torch.uint8
    assert saved["numpy"]["keys"].dtype == torch.int64 and saved["python"]["state"].dtype == torch.int64
    atomic_save({"rng": saved}, tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.normal(size=3), np.random.rand(2), random.random(), random.gauss(0, 1))
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"], CPU)
    again = (torch.rand(3), np.random.normal(size=3), np.random.rand(2), random.random(), random.gauss(0, 1))
    assert torch.equal(expected[0], again[0]) and np.array_equal(expected[1], again[1]) and np.array_equal(expected[2], again[2])
    assert expected[3:] == again[3:]


def test_describe_names_the_file_step_and_recorded_checksum():
    assert checkpoint._describe(None, None) == "no checkpoint (a new run)"
    assert checkpoint._describe("a/step-00000001.pt", None) == "no checkpoint (a new run)"
    assert checkpoint._describe(None, {"step": 1}) == "no checkpoint (a new run)"
    assert checkpoint._describe("a/step-00000001.pt", {"step": 1, "checksum": "f" * 64}) == "step-00000001.pt (step 1, sha256 ffffffffffffffff)"
    unrecorded = {"step": 2}
    assert checkpoint._describe("step-00000002.pt", unrecorded) == f"step-00000002.pt (step 2, sha256 {state_checksum(unrecorded)[:16]})"


def test_rank_0_reads_its_checkpoint_once_and_other_ranks_honour_the_opt_in(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, state(4), step=4, keep=5)
    loads = []
    real = checkpoint.load_checkpoint
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda path, **kw: loads.append(path) or real(path, **kw))
    assert agreed_resume_point(tmp_path, ONE, fresh=False, data={})[1]["step"] == 4
    assert len(loads) == 1
    atomic_save(state(5, version=1), tmp_path / "step-00000005.pt")
    gathered = []
    monkeypatch.setattr(checkpoint, "broadcast_object", lambda obj, context: (str(tmp_path / "step-00000005.pt"), None))
    monkeypatch.setattr(checkpoint, "all_gather_objects", lambda facts, context: gathered.append(facts) or [facts])
    rank1 = Distributed(rank=1, local_rank=1, world_size=1, device=CPU)
    path, loaded = agreed_resume_point(tmp_path, rank1, fresh=False, data={}, unverified_ok=True)
    assert loaded["step"] == 5 and gathered[-1]["resumes from"].startswith("step-00000005.pt (step 5, sha256 ")
    agreed_resume_point(tmp_path, rank1, fresh=False, data={})
    assert gathered[-1]["resumes from"].startswith(f"cannot use it: checkpoint {tmp_path}/step-00000005.pt is version 1")
