"""``facepipe inspect``: the summary against independently computed figures, and ``--dump``: one PNG per
sample, never outside DIR, whatever paths the records carry (issue 8, items 10 and 11)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from tamper import small_set

from facepipe.cli import main
from facepipe.errors import FacepipeError
from facepipe.io.manifest import build_manifest, write_metadata
from facepipe.io.records import encode_image, encode_record
from facepipe.io.shards import ShardSet, ShardWriter
from facepipe.stages.inspect import dump_faces, summarize, verify


def set_with_paths(root: Path, paths: list[str]) -> Path:
    """A shard set of 8x8 faces, one per path (face ``i`` is uniformly grey level ``10 * i``), labelled
    by the path's first part as prepare does; 2 samples per shard."""
    names: list[str] = []
    with ShardWriter(root / "shards", samples_per_shard=2) as writer:
        for i, path in enumerate(paths):
            name = path.strip("/").split("/", 1)[0]
            names += [] if name in names else [name]
            payload = encode_image(np.full((8, 8, 3), 10 * i, np.uint8), encoding="png")
            writer.write(encode_record({"label": names.index(name), "path": path}, payload), label=names.index(name))
        shards = writer.close()
    counts = {"scanned": len(paths), "accepted": len(paths), "rejected": 0}
    manifest = build_manifest(shards, image={"size": 8, "encoding": "png"}, num_identities=len(names), counts=counts, params={})
    write_metadata(root, manifest=manifest, identities=names)
    return root


def files_under(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def grey(png: bytes) -> int:
    """The grey level of a uniformly grey dumped face."""
    pixels = np.asarray(Image.open(io.BytesIO(png)))
    assert pixels.shape == (8, 8, 3) and (pixels == pixels.flat[0]).all()
    return int(pixels.flat[0])


# -- summary -----------------------------------------------------------------------------------------


def test_summary_figures_match_the_files(tmp_path):
    root = small_set(tmp_path / "set")
    shard_set = ShardSet(root)
    payload = sum(len(shard_set.record(i).payload) for i in range(len(shard_set)))
    sizes = [(root / "shards" / f"shard-{i:05d}.lmdb").stat().st_size for i in range(3)]
    summary = summarize(root)
    assert summary["identities"] == 3 and summary["samples"] == 12
    assert summary["samples_per_identity"] == {"min": 4, "max": 4}
    assert summary["counts"] == {"scanned": 14, "accepted": 12, "rejected": 2}
    assert summary["rejected_by_reason"] == {"face_too_small": 1, "unreadable": 1}
    assert [(s["file"], s["num_samples"], s["bytes"]) for s in summary["shards"]] == [
        ("shard-00000.lmdb", 5, sizes[0]), ("shard-00001.lmdb", 5, sizes[1]), ("shard-00002.lmdb", 2, sizes[2])
    ]
    assert summary["shard_bytes"] == sum(sizes) and summary["payload_bytes"] == payload
    assert summary["storage_overhead"] == round(sum(sizes) / payload - 1, 4)


def test_uneven_identities_are_summarized(tmp_path):
    root = set_with_paths(tmp_path / "set", ["a/1.jpg", "a/2.jpg", "a/3.jpg", "b/1.jpg"])
    assert summarize(root)["samples_per_identity"] == {"min": 1, "max": 3}


def test_inspect_cli_prints_the_summary_as_text_and_json(tmp_path, capsys):
    root = small_set(tmp_path / "set")
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "12 samples of 3 identities (4-4 per identity)" in out
    assert "scanned 14, accepted 12, rejected 2" in out and "face_too_small" in out and "shard-00002.lmdb" in out
    assert main(["inspect", str(root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == summarize(root)
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "shard set not found" in capsys.readouterr().err


# -- dump ----------------------------------------------------------------------------------------------


def test_dump_writes_one_png_per_sample_with_its_pixels(tmp_path, capsys):
    root = set_with_paths(tmp_path / "set", ["a/1.jpg", "a/2.jpg", "b/1.jpg"])
    assert main(["inspect", str(root), "--dump", str(tmp_path / "faces")]) == 0
    assert "wrote 3 faces" in capsys.readouterr().out
    dumped = files_under(tmp_path / "faces")
    assert {name: grey(png) for name, png in dumped.items()} == {"a/1.jpg.png": 0, "a/2.jpg.png": 10, "b/1.jpg.png": 20}
    assert main(["inspect", str(root), "--dump", str(tmp_path / "two"), "--limit", "2"]) == 0
    assert len(files_under(tmp_path / "two")) == 2
    assert main(["inspect", str(root), "--dump", str(tmp_path / "none"), "--limit", "-1"]) == 2


def test_sources_that_differ_only_by_extension_or_case_get_a_file_each(tmp_path):
    """Issue 8, item 11: a.jpg and a.webp once dumped to one a.png while both were reported."""
    paths = ["a/x.jpg", "a/x.webp", "a/x.png", "a/X.jpg", "a/y.jpg", "a/y.jpg"]  # the last two: one path twice
    root = set_with_paths(tmp_path / "set", paths)
    assert dump_faces(root, tmp_path / "faces") == len(paths)
    dumped = files_under(tmp_path / "faces")
    assert sorted(grey(png) for png in dumped.values()) == [0, 10, 20, 30, 40, 50]  # every face, once
    assert {"a/x.jpg.png", "a/x.webp.png", "a/x.png.png", "a/y.jpg.png"} <= set(dumped)


@pytest.mark.parametrize("layout", ["dotdot", "absolute"])
def test_record_paths_never_lead_outside_the_dump_folder(tmp_path, layout):
    """Issue 8, item 10: ``a/../../../x.jpg`` or an absolute path wrote outside DIR."""
    dump = tmp_path / "deep" / "faces"
    hostile = {"dotdot": "a/../../../escaped.jpg", "absolute": f"{tmp_path}/escaped.jpg"}[layout]
    root = set_with_paths(tmp_path / "set", ["a/1.jpg", hostile, "b/1.jpg"])
    before = files_under(tmp_path)
    assert dump_faces(root, dump) == 3
    after = files_under(tmp_path)
    written = {name: grey(png) for name, png in after.items() if name not in before}
    assert all(name.startswith("deep/faces/") for name in written), written
    assert written == {"deep/faces/a/1.jpg.png": 0, "deep/faces/_renamed/shard-00000-00000001.png": 10, "deep/faces/b/1.jpg.png": 20}
    assert any(f"unsafe path {hostile!r}" in problem for problem in verify(root))  # and verify rejects the set


def test_a_link_inside_the_dump_folder_is_not_followed_out(tmp_path):
    root = set_with_paths(tmp_path / "set", ["a/1.jpg"])
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "faces").mkdir()
    (tmp_path / "faces" / "a").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FacepipeError, match="leaves"):
        dump_faces(root, tmp_path / "faces")
    assert not any((tmp_path / "elsewhere").iterdir())
