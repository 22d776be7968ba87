"""facepipe never deletes or overwrites what it did not write, never mixes runs, and never loads
corrupt checkpoints or weights (issue 8, items 1-6 and 9)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from train_helpers import ROOT, env, linear_model, synthetic_set, tiny_params, write_params

import facepipe.io.atomic as atomic
import facepipe.training.trainer as trainer_module
from facepipe.cli import main
from facepipe.config import SplitParams, read_params_file
from facepipe.errors import FacepipeError
from facepipe.io.model_dir import MODEL_FOLDER, ModelSpec, load_backbone, save_model_dir
from facepipe.models import create_backbone
from facepipe.stages import split
from facepipe.stages.evaluate import EVALUATE_OUTPUT
from facepipe.stages.export import EXPORT_OUTPUT
from facepipe.shardset import SHARD_SET
from facepipe.stages.train import run as train
from facepipe.training.checkpoint import list_checkpoints, load_checkpoint, remove_checkpoints


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 identities x 12 samples of 16x16 (synthetic, written by facepipe's own shard writer)."""
    return synthetic_set(tmp_path_factory.mktemp("safety") / "set")


@pytest.fixture(scope="module")
def trained(shard_set: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run (linear backbone, 4 steps, a checkpoint every 2): a model folder to copy."""
    out = tmp_path_factory.mktemp("trained") / "model"
    train(tiny_params(epochs=1, checkpoint_every=2), shard_set, out, max_steps=4, model_factory=linear_model)
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


def empty_params(tmp_path: Path) -> str:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    return str(path)


# -- 1. an existing output is replaced only when it is positively facepipe's ---------------------------------


def test_prepare_refuses_a_folder_that_merely_holds_a_manifest(tmp_path, capsys):
    raw = tmp_path / "raw"
    (raw / "alice").mkdir(parents=True)
    web = tmp_path / "web"
    web.mkdir()
    (web / "manifest.json").write_text('{"name": "my web app", "icons": []}')
    (web / "index.html").write_text("<html></html>")
    before = snapshot(web)
    code, err = cli(capsys, "prepare", str(raw), str(web), "--params", empty_params(tmp_path))
    assert code == 2 and len(err.splitlines()) == 1 and "refusing to replace" in err, err
    assert snapshot(web) == before
    (web / "index.html").unlink()  # a manifest.json alone, of another format: still not a shard set
    code, err = cli(capsys, "prepare", str(raw), str(web), "--params", empty_params(tmp_path))
    assert code == 2 and "not those of a facepipe shard set" in err, err


def test_a_shard_set_with_a_user_file_in_it_is_not_replaced(shard_set, tmp_path):
    out = tmp_path / "set"
    shutil.copytree(shard_set, out)
    assert SHARD_SET.foreign(out) is None  # a set facepipe wrote is recognised
    (out / "shards" / "notes.txt").write_text("mine")
    assert "shards/notes.txt" in SHARD_SET.foreign(out)


def test_split_replaces_its_own_output_or_an_empty_folder_only(shard_set, tmp_path):
    params = SplitParams(val_identities=2, num_pairs=8, seed=0)
    out = tmp_path / "split"
    out.mkdir()  # an empty folder may be used
    split.run(params, shard_set, out)
    first = snapshot(out)
    split.run(params, shard_set, out)  # its own output: replaced
    assert snapshot(out) == first
    (out / "todo.txt").write_text("mine")
    with pytest.raises(FacepipeError, match="refusing to replace .*todo.txt"):
        split.run(params, shard_set, out)
    assert (out / "todo.txt").read_text() == "mine"
    only_names = tmp_path / "lookalike"
    only_names.mkdir()
    (only_names / "split.json").write_text('{"not": "a split"}')
    with pytest.raises(FacepipeError, match="refusing to replace"):
        split.run(params, shard_set, only_names)
    assert (only_names / "split.json").read_text() == '{"not": "a split"}'


@pytest.mark.parametrize(
    ("command", "kind", "files"),
    [
        ("evaluate", EVALUATE_OUTPUT, {"metrics.json": '{"accuracy_mean": 0.5}', "roc.csv": "fpr,tpr,threshold\n"}),
        ("export", EXPORT_OUTPUT, {"export.json": '{"model": {}, "input": {}, "output": {}, "files": {}}',
                                   "backbone.onnx": ""}),
    ],
)
def test_evaluate_and_export_refuse_a_foreign_output(shard_set, trained, tmp_path, capsys, command, kind, files):
    out = tmp_path / "out"
    out.mkdir()
    for name, text in files.items():
        (out / name).write_text(text)
    assert kind.foreign(out) is None  # exactly what the stage writes: its own
    (out / "thesis.tex").write_text("mine")
    before = snapshot(out)
    inputs = [str(trained), str(shard_set)] if command == "evaluate" else [str(trained)]
    code, err = cli(capsys, command, *inputs, str(out), "--params", empty_params(tmp_path))
    assert code == 2 and "refusing to replace" in err and "thesis.tex" in err, err
    assert snapshot(out) == before


def test_an_output_that_is_a_symlink_is_refused(shard_set, tmp_path):
    real = tmp_path / "real"
    split.run(SplitParams(val_identities=2, num_pairs=8, seed=0), shard_set, real)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(FacepipeError, match="symbolic link"):
        split.run(SplitParams(val_identities=2, num_pairs=8, seed=1), shard_set, link)
    assert link.is_symlink() and link.resolve() == real


def test_inspect_dump_writes_only_into_a_folder_of_dumps(shard_set, tmp_path, capsys):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "photo.jpg").write_bytes(b"mine")
    code, err = cli(capsys, "inspect", str(shard_set), "--dump", str(dump), "--limit", "2")
    assert code == 2 and "refusing to replace" in err, err
    assert sorted(p.name for p in dump.rglob("*")) == ["photo.jpg"]


# -- 2. inputs and outputs apart -----------------------------------------------------------------------------


def test_prepare_refuses_raw_inside_out(shard_set, tmp_path, capsys):
    out = tmp_path / "set"
    shutil.copytree(shard_set, out)
    (out / "raw" / "alice").mkdir(parents=True)
    (out / "raw" / "alice" / "1.jpg").write_bytes(b"precious")
    code, err = cli(capsys, "prepare", str(out / "raw"), str(out), "--params", empty_params(tmp_path))
    assert code == 2 and "lies inside the output" in err, err
    assert (out / "raw" / "alice" / "1.jpg").read_bytes() == b"precious"
    link = tmp_path / "raw-link"  # the same through a symlink
    link.symlink_to(out / "raw")
    code, err = cli(capsys, "prepare", str(link), str(out), "--params", empty_params(tmp_path))
    assert code == 2 and "lies inside the output" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["split", "{set}", "{set}/split"],  # OUT inside PREPARED
        ["split", "{set}", "{tmp}"],  # PREPARED inside OUT
        ["evaluate", "{model}", "{set}", "{model}/eval"],
        ["evaluate", "{model}", "{set}", "{tmp}/eval", "--pairs", "{tmp}/eval/pairs.txt"],
        ["export", "{model}", "{model}/export"],
        ["inspect", "{set}", "--dump", "{set}/faces"],
        ["train", "{set}", "{set}/model"],
        ["train", "{tmp}/model/set", "{tmp}/model"],
    ],
)
def test_an_input_and_the_output_never_nest(shard_set, trained, tmp_path, capsys, argv):
    root = tmp_path / "root"
    shutil.copytree(shard_set, root / "set")
    shutil.copytree(trained, root / "model")
    (root / "eval").mkdir()
    (root / "eval" / "pairs.txt").write_text("10\n")
    shutil.copytree(shard_set, root / "model" / "set")
    before = snapshot(root)
    args = [a.format(set=root / "set", model=root / "model", tmp=root) for a in argv]
    code, err = cli(capsys, *args, *(["--params", empty_params(tmp_path)] if argv[0] != "inspect" else []))
    assert code == 2 and "lies inside" in err and len(err.splitlines()) == 1, err
    assert snapshot(root) == before


# -- 3. train writes only into a model folder; --fresh removes only checkpoints -------------------------------


def test_train_refuses_a_folder_that_is_not_a_model_folder(shard_set, tmp_path, capsys):
    out = tmp_path / "home"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    params = write_params(tmp_path / "params.yaml", epochs=1)
    code, err = cli(capsys, "train", str(shard_set), str(out), "--params", str(params), "--fresh")
    assert code == 2 and "refusing to replace" in err and "notes.txt" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_fresh_never_deletes_a_file_it_did_not_write(shard_set, trained, tmp_path, capsys):
    out = tmp_path / "model"
    shutil.copytree(trained, out)
    (out / "checkpoints" / "best-by-hand.pt").write_bytes(b"mine")
    params = write_params(tmp_path / "params.yaml", epochs=1)
    code, err = cli(capsys, "train", str(shard_set), str(out), "--params", str(params), "--fresh", "--max-steps", "1")
    assert code == 2 and "best-by-hand.pt" in err, err
    assert (out / "checkpoints" / "best-by-hand.pt").read_bytes() == b"mine"
    assert len(list_checkpoints(out / "checkpoints")) == 2


def test_remove_checkpoints_removes_only_checkpoint_names(tmp_path):
    names = ["step-00000002.pt", ".step-00000004.pt.tmp-123", "step-00000001.pt.corrupt", "step-2.pt", "keep.pt"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    remove_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.pt", "step-2.pt"]


def test_model_folder_kind_matches_what_train_writes(trained):
    assert MODEL_FOLDER.foreign(trained) is None


def test_train_writes_into_a_model_folder_holding_dvcs_gitignore(shard_set, trained, tmp_path):
    """dvc.yaml's train outs make DVC write OUT/.gitignore: train leaves it alone and runs."""
    out = tmp_path / "model"
    shutil.copytree(trained, out)
    (out / ".gitignore").write_text("/backbone.pt\n/model.json\n/checkpoints\n")
    report = train(tiny_params(epochs=1, checkpoint_every=2), shard_set, out, max_steps=4, model_factory=linear_model)
    assert report.resumed_from_step == 4 and (out / ".gitignore").read_text().startswith("/backbone.pt")


# -- 4. final files never mixed between runs ------------------------------------------------------------------


class Killed(BaseException):
    """Stands for a SIGKILL in the middle of training (nothing after it runs)."""


def test_a_killed_fresh_run_never_leaves_the_old_model_beside_new_checkpoints(shard_set, trained, tmp_path, monkeypatch):
    out = tmp_path / "model"
    shutil.copytree(trained, out)
    changed = tiny_params(epochs=1, checkpoint_every=2, lr=0.2)
    saved = trainer_module.save_checkpoint

    def save_then_die(*args, **kwargs):
        saved(*args, **kwargs)
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(trainer_module, "save_checkpoint", save_then_die)
        with pytest.raises(Killed):
            train(changed, shard_set, out, max_steps=4, fresh=True, model_factory=linear_model)
    assert not (out / "model.json").exists() and not (out / "backbone.pt").exists()
    assert [load_checkpoint(p)["config"]["lr"] for _, p in list_checkpoints(out / "checkpoints")] == [0.2]
    report = train(changed, shard_set, out, max_steps=4, model_factory=linear_model)  # resumes the new run
    assert report.resumed_from_step == 2 and report.steps == 4
    assert json.loads((out / "model.json").read_text())["weights_sha256"]


def test_weights_from_another_run_are_refused_by_their_checksum(tmp_path):
    out = tmp_path / "model"
    spec = ModelSpec(backbone="mobilefacenet", embedding_size=16, image_size=16)
    save_model_dir(out, create_backbone(spec.backbone, embedding_size=16, image_size=16), spec)
    load_backbone(out)
    weights = torch.load(out / "backbone.pt", weights_only=True)
    torch.save({k: v + 1 for k, v in weights.items()}, out / "backbone.pt")
    with pytest.raises(FacepipeError, match="sha256 differs"):
        load_backbone(out)


# -- 5. interrupted publishes and temporaries are recovered by the next run ------------------------------------


_KILL_BETWEEN_RENAMES = """
import os, signal, sys
import facepipe.io.atomic as atomic
from facepipe.config import SplitParams
from facepipe.stages import split
atomic._between_renames = lambda: os.kill(os.getpid(), signal.SIGKILL)
split.run(SplitParams(val_identities=2, num_pairs=8, seed=1), sys.argv[1], sys.argv[2])
"""


def test_a_run_killed_between_the_publish_renames_is_recovered_by_the_next(shard_set, tmp_path):
    out = tmp_path / "split"
    params = SplitParams(val_identities=2, num_pairs=8, seed=0)
    split.run(params, shard_set, out)
    first = snapshot(out)
    killed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILL_BETWEEN_RENAMES), str(shard_set), str(out)],
        env=env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -9, killed.stderr
    assert not out.exists() and [p.name.startswith(".split.old-") for p in tmp_path.iterdir()].count(True) == 1
    atomic.check_output(out, kind=split.SPLIT_OUTPUT)  # the next run puts the old output back first
    assert snapshot(out) == first
    split.run(params.model_copy(update={"seed": 1}), shard_set, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["split"]  # no .old- or .partial- leftovers


def test_a_failure_between_the_renames_puts_the_old_output_back(shard_set, tmp_path, monkeypatch):
    out = tmp_path / "split"
    split.run(SplitParams(val_identities=2, num_pairs=8, seed=0), shard_set, out)
    first = snapshot(out)

    def fail() -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(atomic, "_between_renames", fail)
    with pytest.raises(OSError, match="disk gone"):
        split.run(SplitParams(val_identities=2, num_pairs=8, seed=1), shard_set, out)
    assert snapshot(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["split"]


def dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_checkpoint_temporaries_of_a_killed_run_are_removed_by_the_next(shard_set, trained, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(trained, out)
    pid = dead_pid()
    stale = [out / "checkpoints" / f".step-00000006.pt.tmp-{pid}", out / f".backbone.pt.tmp-{pid}"]
    for path in stale:
        path.write_bytes(b"half a checkpoint")
    live = out / "checkpoints" / f".step-00000008.pt.tmp-{os.getpid()}"  # a running process's: kept
    live.write_bytes(b"being written")
    train(tiny_params(epochs=1, checkpoint_every=2), shard_set, out, max_steps=4, model_factory=linear_model)
    assert not any(path.exists() for path in stale) and live.exists()


# -- 6. a params file that is named must exist ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["prepare", "{tmp}", "{tmp}/out"],
        ["split", "{tmp}", "{tmp}/out"],
        ["train", "{tmp}", "{tmp}/out"],
        ["evaluate", "{tmp}", "{tmp}", "{tmp}/out"],
        ["export", "{tmp}", "{tmp}/out"],
        ["sample-data", "{tmp}/out"],
    ],
)
def test_a_named_params_file_that_does_not_exist_is_an_error(tmp_path, capsys, argv):
    args = [a.format(tmp=tmp_path) for a in argv]
    code, err = cli(capsys, *args, "--params", str(tmp_path / "no_such.yaml"))
    assert code == 2 and err == f"facepipe {argv[0]}: error: params file not found: {tmp_path / 'no_such.yaml'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_only_the_default_params_file_may_be_absent(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert read_params_file(None) == {}
    with pytest.raises(FacepipeError, match="params file not found: params.yaml"):
        read_params_file("params.yaml")  # named explicitly: must exist


def test_the_prepare_flow_refuses_a_missing_params_file(tmp_path, capsys):
    from flows.prepare import main as flow_main

    assert flow_main([str(tmp_path), str(tmp_path / "out"), "--params", str(tmp_path / "no_such.yaml")]) == 2
    assert "params file not found" in capsys.readouterr().err


# -- 9. checkpoints carry a checksum; a corrupt newest one falls back to the previous ------------------------


def flip_a_weight_byte(path: Path) -> None:
    """Flip one byte inside a tensor's stored bytes, where torch.load notices nothing."""
    state = torch.load(path, weights_only=True)
    weight = state["head"]["weight"].contiguous().numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(weight)
    assert at >= 0
    data[at + len(weight) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    torch.load(path, weights_only=True)  # still loads: only the checksum can tell


def test_a_flipped_byte_in_a_checkpoint_is_caught(trained, tmp_path):
    _, newest = list_checkpoints(trained / "checkpoints")[-1]
    copy = tmp_path / newest.name
    shutil.copy(newest, copy)
    load_checkpoint(copy)
    flip_a_weight_byte(copy)
    with pytest.raises(FacepipeError, match="checkpoint corrupt"):
        load_checkpoint(copy)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_with_a_warning(shard_set, trained, tmp_path, caplog):
    out = tmp_path / "model"
    shutil.copytree(trained, out)
    (previous_step, _), (_, newest) = list_checkpoints(out / "checkpoints")[-2:]
    flip_a_weight_byte(newest)
    with caplog.at_level(logging.WARNING, logger="facepipe"):
        report = train(tiny_params(epochs=1, checkpoint_every=2), shard_set, out, max_steps=4, model_factory=linear_model)
    assert report.resumed_from_step == previous_step and report.steps == 4
    assert any(newest.name in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert (out / "checkpoints" / f"{newest.name}.corrupt").exists()


def test_a_set_aside_output_is_recovered_when_the_next_run_gets_the_same_pid(shard_set, tmp_path):
    """In a container every run may get the same PID: a killed run's ``.OUT.old-PID`` is still a
    leftover for the next run with that PID, restored rather than taken for its own work."""
    out = tmp_path / "split"
    split.run(SplitParams(val_identities=2, num_pairs=8, seed=0), shard_set, out)
    first = snapshot(out)
    atomic.mark(out)  # what the killed run with our PID left: its marker, then the rename
    out.rename(tmp_path / f".split.old-{os.getpid()}")
    atomic.check_output(out, kind=split.SPLIT_OUTPUT)
    assert snapshot(out) == first and sorted(p.name for p in tmp_path.iterdir()) == ["split"]


def test_a_foreign_folder_in_the_set_aside_name_is_never_deleted(shard_set, tmp_path):
    out = tmp_path / "split"
    split.run(SplitParams(val_identities=2, num_pairs=8, seed=0), shard_set, out)
    foreign = tmp_path / f".split.old-{os.getpid()}"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FacepipeError, match="in the way"):
        split.run(SplitParams(val_identities=2, num_pairs=8, seed=1), shard_set, out)
    assert (foreign / "notes.txt").read_text() == "mine"


def _users_folder(path: Path) -> dict[str, bytes]:
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    return snapshot(path)


def test_folders_named_like_leftovers_are_never_taken_by_name(shard_set, tmp_path, capsys):
    """Leftovers are recognised by facepipe's marker inside and a dead PID, not by name: a user's
    ``.E.partial-999999`` survives export-rec, a user's ``.G.old-999999`` is not renamed to a missing G,
    and a user's folder with this process's temporary name is refused in one line, untouched."""
    from facepipe.stages import export_rec

    rec = tmp_path / "rec"
    partial = tmp_path / ".rec.partial-999999"
    kept = _users_folder(partial)
    export_rec.run(shard_set, rec, progress=False)
    assert snapshot(partial) == kept and (rec / "train.rec").is_file()
    old = tmp_path / ".split.old-999999"
    kept = _users_folder(old)
    split.run(SplitParams(val_identities=2, num_pairs=8, seed=0), shard_set, tmp_path / "split")
    assert snapshot(old) == kept and not (tmp_path / "split" / "notes.txt").exists()
    ours = tmp_path / f".split2.partial-{os.getpid()}"
    kept = _users_folder(ours)
    with pytest.raises(FacepipeError, match=r"^.*\.split2\.partial-\d+ is in the way of replacing .*split2.*: move it$"):
        split.run(SplitParams(val_identities=2, num_pairs=8, seed=0), shard_set, tmp_path / "split2")
    assert snapshot(ours) == kept and not (tmp_path / "split2").exists()


def test_a_marker_a_killed_run_left_in_the_published_output_is_removed_by_the_next(shard_set, tmp_path):
    """Killed between the rename into place and the marker's removal: the output is still its kind
    (the marker is tolerated), and the next run drops the marker."""
    out = tmp_path / "split"
    split.run(SplitParams(val_identities=2, num_pairs=8, seed=0), shard_set, out)
    first = snapshot(out)
    (out / atomic.MARKER).write_text(json.dumps({"format": "facepipe-temporary-folder", "pid": 999999}))
    assert split.SPLIT_OUTPUT.foreign(out) is None
    atomic.check_output(out, kind=split.SPLIT_OUTPUT)
    assert snapshot(out) == first
