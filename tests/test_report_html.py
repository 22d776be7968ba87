"""The data-quality report (OUT/report.html) as a person sees it: opened in headless Chromium.

The browser runs with its proxy pointed at a closed port and every host name unresolvable, so
nothing could leave the machine; on top of that the DevTools protocol records every request the page
makes, and the test holds each one to ``data:`` or the report's own ``file:`` URL. A control page
with one external image proves the recorder sees such a request and that its image does not decode.
"""

from __future__ import annotations

import base64
import io
import json
import re

import numpy as np
import pytest
from PIL import Image

from facepipe.cli import main
from facepipe.config import PrepareParams
from facepipe.synthetic.shards import write_synthetic_shard_set
from facepipe.quality import REPORT_FILE, Limits, collect, write_report
from facepipe.stages import prepare
from browser import chromium, needs_chromium  # noqa: F401 - chromium is a fixture
from rawdata import TEST_PARAMS, in_process, make_faces_raw


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A real prepare of real faces and one bad file per reject reason; returns (raw, out, report)."""
    raw = tmp_path_factory.mktemp("raw")
    make_faces_raw(raw)
    out = tmp_path_factory.mktemp("prep") / "set"
    params = PrepareParams(**TEST_PARAMS)
    report = prepare.run(params, raw, out, submit=in_process(raw, params), workers=1, progress=False)
    return raw, out, report


def images_in(page: str) -> list[str]:
    return re.findall(r"<img [^>]*src=\"([^\"]*)\"", page)


def test_prepare_writes_a_self_contained_report(prepared):
    raw, out, report = prepared
    page = (out / REPORT_FILE).read_text()
    assert report["timings_s"]["report_html"] < 30
    # every reason with its count, every rejected path, the cross-identity duplicate and its original
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    for reason, n in report["rejected_by_reason"].items():
        assert f"<td>{reason}</td><td class=\"n\">{n}</td>" in page
    for reject in rejects:
        assert reject["path"] in page
    assert "Cross-identity duplicates: 1<" in page and "astro/0002.jpg" in page
    # self-contained: no URL but data: anywhere a browser would fetch one, no script at all
    sources = images_in(page)
    assert sources and all(src.startswith("data:image/") for src in sources)
    assert not re.search(r"(src|href|url)\s*[=(]\s*[\"']?\s*(https?:|//|ftp:|file:)", page, re.I)
    assert "<script" not in page and "<link" not in page
    # thumbnails of decodable rejects (no_face, image_too_small, duplicates) and none of the others
    for path in ("astro/coffee.jpg", "hopper/tiny.png", "zz_astro2/0002.jpg"):
        assert f"alt=\"{path}\"" in page, path
    for path in ("astro/huge.png", "astro/dangling.jpg", "astro/empty.jpg", "hopper/notes.jpg"):
        assert f"alt=\"{path}\"" not in page, path


def test_report_is_deterministic_and_bounded(tmp_path):
    root = write_synthetic_shard_set(tmp_path / "set", num_identities=30, samples_per_identity=9, samples_per_shard=50)
    limits = Limits(identities=5, faces_per_identity=3, scores=40)
    first = write_report(root, tmp_path / "a.html", limits=limits).read_bytes()
    assert write_report(root, tmp_path / "b.html", limits=limits).read_bytes() == first
    page = first.decode()
    assert len(images_in(page)) == 5 * 3
    assert "Aligned faces: 5 of 30 identities" in page
    data = collect(root, limits=limits)
    assert len(data.scores) == 40 and data.faces_per_identity.tolist() == [9] * 30
    other = collect(root, limits=limits, seed=1)
    assert [name for name, _ in other.faces] != [name for name, _ in data.faces]


def test_report_reads_a_sample_not_every_record(tmp_path, monkeypatch):
    """Cost is bounded by the limits: 2 identities x 2 faces and 10 scores out of 600 records."""
    from facepipe.io import shards

    root = write_synthetic_shard_set(tmp_path / "set", num_identities=60, samples_per_identity=10, samples_per_shard=100)
    reads = []
    # every record read goes through one of these two (get() and record() call get_many)
    get_many, iterate = shards.ShardReader.get_many, shards.ShardReader.__iter__
    monkeypatch.setattr(shards.ShardReader, "get_many", lambda self, i: reads.extend(i) or get_many(self, i))
    monkeypatch.setattr(shards.ShardReader, "__iter__", lambda self: (reads.append(r) or r for r in iterate(self)))
    collect(root, limits=Limits(identities=2, faces_per_identity=2, scores=10))
    assert len(reads) == 2 * 2 + 10


def test_inspect_html_cli(prepared, tmp_path, capsys):
    raw, out, _ = prepared
    target = tmp_path / "r.html"
    assert main(["inspect", str(out), "--html", str(target), "--raw", str(raw)]) == 0
    assert target.read_bytes() == (out / REPORT_FILE).read_bytes()  # same set, same source: same page
    assert main(["inspect", str(out), "--html", str(tmp_path / "paths.html")]) == 0
    assert "source folder not given" in (tmp_path / "paths.html").read_text()
    mine = tmp_path / "mine.html"
    mine.write_text("<html>my notes</html>")
    capsys.readouterr()
    assert main(["inspect", str(out), "--html", str(mine)]) == 2
    assert "not a facepipe report" in capsys.readouterr().err
    assert mine.read_text() == "<html>my notes</html>"  # a file facepipe did not write is never replaced


def test_inspect_html_never_writes_into_an_input(prepared, tmp_path, capsys):
    """--html follows the rules of every other output: never inside RAW (the next prepare would scan
    it) or the shard set (prepare would then refuse to replace it); and only a page named .html."""
    raw, out, _ = prepared
    before = {p: p.read_bytes() for root in (raw, out) for p in sorted(root.rglob("*")) if p.is_file()}
    first_identity = next(p for p in sorted(raw.iterdir()) if p.is_dir())
    for target, expected in (
        (first_identity / "report.html", f"the output {first_identity / 'report.html'} lies inside the raw folder {raw}"),
        (out / "shards" / "x.html", f"the output {out / 'shards' / 'x.html'} lies inside the shard set {out}"),
        (tmp_path / "cron.daily", f"the report is an HTML page: give a FILE ending in .html, not {tmp_path / 'cron.daily'}"),
    ):
        capsys.readouterr()
        assert main(["inspect", str(out), "--html", str(target), "--raw", str(raw)]) == 2
        assert capsys.readouterr().err.strip() == f"facepipe inspect: error: {expected}"
        assert not target.exists()
    assert {p: p.read_bytes() for root in (raw, out) for p in sorted(root.rglob("*")) if p.is_file()} == before


# --- in the browser --------------------------------------------------------------------------------


@needs_chromium
@pytest.mark.multiprocess
def test_report_in_headless_chromium(prepared, chromium, tmp_path):
    raw, out, _ = prepared
    page_file = out / REPORT_FILE
    shot = tmp_path / "report.png"
    seen = chromium.open(page_file.as_uri(), screenshot=shot)
    # nothing but the page itself and its inlined images was requested
    off_page = [url for url in seen["requests"] if not url.startswith("data:") and url != page_file.as_uri()]
    assert off_page == []
    # every image the page holds decoded: faces 112x112, thumbnails up to 96 on their longest side
    expected = len(images_in(page_file.read_text()))
    assert len(seen["images"]) == expected > 10
    undecoded = [alt for width, height, alt in seen["images"] if width == 0 or height == 0]
    assert undecoded == []
    faces = [(w, h) for w, h, alt in seen["images"] if (w, h) == (112, 112)]
    assert len(faces) == sum(min(n, Limits().faces_per_identity) for n in (3, 3, 1))  # hopper, astro, zz_astro2
    # the screenshot shows a page: a real PNG, full width, not blank
    with Image.open(shot) as pil:
        assert pil.width == 1200 and pil.height == min(seen["height"], 5000) > 600
        pixels = np.asarray(pil.convert("L"))
    assert pixels.std() > 20 and (pixels < 128).mean() > 0.02


@needs_chromium
@pytest.mark.multiprocess
def test_the_browser_check_sees_an_external_request(chromium, tmp_path):
    """Control: a page with one external image shows up as a request off the page, and its image
    never decodes (the proxy is a closed port, names resolve to nothing)."""
    page = tmp_path / "leaky.html"
    face = base64.b64encode(_tiny_png()).decode()
    page.write_text(f"<html><body><img src=\"data:image/png;base64,{face}\" alt=\"inline\">"
                    "<img src=\"http://example.com/face.png\" alt=\"external\"></body></html>")
    seen = chromium.open(page.as_uri())
    assert [url for url in seen["requests"] if not url.startswith(("data:", "file:"))] == ["http://example.com/face.png"]
    assert sorted((alt, width > 0) for width, _, alt in seen["images"]) == [("external", False), ("inline", True)]


def _tiny_png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_prefect_prepare_flow_links_the_report(prepared, tmp_path):
    """The prepare flow (chunks as Prefect tasks, in threads here) publishes a link to OUT/report.html."""
    import yaml
    from prefect import get_client
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect.testing.utilities import prefect_test_harness

    from flows.prepare import prepare_flow

    raw, out, _ = prepared
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump({"prepare": TEST_PARAMS}))
    flow_out = tmp_path / "flow"
    with prefect_test_harness(server_startup_timeout=180):
        prepare_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=1))(
            str(raw), str(flow_out), params_file=str(params), device="cpu"
        )
        with get_client(sync_client=True) as client:
            links = [a for a in client.read_latest_artifacts() if a.key == "prepare-quality-report"]
    assert len(links) == 1 and links[0].type == "markdown"
    assert f"]({(flow_out / REPORT_FILE).as_uri()})" in links[0].data
    assert (flow_out / REPORT_FILE).read_bytes() == (out / REPORT_FILE).read_bytes()


def test_a_file_named_like_the_cross_identity_mark_is_counted_by_its_identity(tmp_path):
    """The report tells a cross-identity duplicate by the identities of the two paths, not by the end
    of a detail string: a file named ``a (another identity)`` copied within its identity is not one."""
    from test_update import PARAMS, face, run, write

    raw, out = tmp_path / "raw", tmp_path / "out"
    write(raw, {"id0/a (another identity)": face(1), "id0/b.jpg": face(1), "id1/c.jpg": face(1), "id1/d.jpg": face(2)})
    run(raw, out, params=PARAMS)
    details = {r["path"]: r["detail"] for r in map(json.loads, (out / "rejects.jsonl").read_text().splitlines())}
    assert details == {
        "id0/b.jpg": "same bytes as id0/a (another identity)",
        "id1/c.jpg": "same bytes as id0/a (another identity) (another identity)",
    }
    data = collect(out)
    assert data.cross_duplicates == 1
    assert [(kept.path, copy.path) for kept, copy in data.duplicate_pairs] == [("id0/a (another identity)", "id1/c.jpg")]
