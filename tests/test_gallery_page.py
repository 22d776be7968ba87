"""The search page (facepipe.gallery.page): escaped text, a bounded size that says what it left out,
the same bytes for the same search, wrong top-1 matches counted and marked, same/different marks at
a threshold, and, in headless Chromium, a page that requests nothing and shows every thumbnail."""

from __future__ import annotations

import functools
import io
import re

import numpy as np
import pytest
from PIL import Image

from browser import chromium, needs_chromium  # noqa: F401 - chromium is a fixture
from facepipe.gallery import page as page_module
from facepipe.gallery.page import MatchView, ProbeView, render_page
from facepipe.quality.render import CSP


@functools.lru_cache(maxsize=None)
def jpeg(seed: int, size: int = 32) -> bytes:
    """A ``size`` x ``size`` JPEG of noise (a big one does not compress below the inlining limit)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def probe(i: int, *, truth: str | None, top1: str, matches: int = 3) -> ProbeView:
    found = [MatchView(top1, 0.9, jpeg(i + 1))] + [MatchView(f"other{j}", 0.5 - j / 10, jpeg(i + j + 2)) for j in range(matches - 1)]
    return ProbeView(f"probes/{i:03d}.jpg", truth, jpeg(i), found)


def images_in(page: str) -> list[str]:
    return re.findall(r"<img [^>]*src=\"([^\"]*)\"", page)


def test_every_text_is_escaped():
    hostile = "<script>alert(1)</script>"
    probes = [
        ProbeView("a\"b<i>&.jpg", hostile, jpeg(1), [MatchView(hostile, 0.8, jpeg(2)), MatchView("x' onerror='y", 0.2, jpeg(3))]),
    ]
    page = render_page(probes, title="search <b>of</b> & more", threshold=0.5)
    assert "<script" not in page and "<b>" not in page and "<i>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a&quot;b&lt;i&gt;&amp;.jpg" in page
    assert "alt=\"x&#x27; onerror=&#x27;y\"" in page
    assert "<title>search &lt;b&gt;of&lt;/b&gt; &amp; more</title>" in page
    assert all(src.startswith("data:image/jpeg;base64,") for src in images_in(page)) and len(images_in(page)) == 3
    assert not re.search(r"(src|href|url)\s*[=(]\s*[\"']?\s*(https?:|//|ftp:|file:)", page, re.I)
    assert f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">" in page


def test_the_page_is_bounded_and_says_what_it_left_out():
    probes = [probe(i, truth=f"id{i}", top1=f"id{i}", matches=12) for i in range(240)]
    probes += [probe(240 + i, truth=f"id{i}", top1="someone else", matches=12) for i in range(10)]  # wrong, last
    probes[0] = ProbeView(probes[0].name, "id0", jpeg(0, size=200), probes[0].matches)  # a thumbnail too big to inline
    page = render_page(probes, title="big")
    assert f"100 of 250 probes shown (at most {page_module.MAX_PROBES}" in page and "150 left out" in page
    assert page.count("<div class=\"probe\">") == 100
    assert len(images_in(page)) == 100 * (1 + page_module.MAX_MATCHES) - 1
    assert page.count("2 more matches not shown") == 100 and "thumbnail over 24 KiB, not inlined" in page
    # the wrong ones come first, then the others in the order given
    drawn = re.findall(r"probes/(\d{3})\.jpg<br>", page)
    assert drawn == [f"{i:03d}" for i in [*range(240, 250), *range(90)]]
    assert "top-1 wrong for 10 of 250 probes" in page  # counted over every probe, drawn or not
    assert len(render_page(probes, title="big", max_probes=5)) < len(page) / 10


def test_the_same_search_gives_the_same_bytes():
    probes = [probe(i, truth=f"id{i % 3}", top1=f"id{i % 4}") for i in range(12)]
    first = render_page(probes, title="t", threshold=0.45)
    assert render_page(list(probes), title="t", threshold=0.45) == first
    assert render_page(probes, title="t", threshold=0.46) != first


def test_wrong_top1_matches_are_counted_and_marked():
    probes = [probe(i, truth=f"id{i}", top1=f"id{i}") for i in range(5)]
    probes += [probe(5 + i, truth=f"other{1}", top1=f"id{i}") for i in range(3)]  # the truth in third place
    probes += [probe(8 + i, truth=None, top1=f"id{i}") for i in range(2)]
    page = render_page(probes, title="t")
    assert "<p id=\"wrong\" class=\"wrong-count\">top-1 wrong for 3 of 8 probes (2 more of unknown identity, not counted)</p>" in page
    assert page.count("<figure class=\"wrong\">") == 3
    assert page.count("<figure class=\"truth\">") == 5 + 3  # the right top-1s, and the true identity in place 2
    right = render_page(probes[:5], title="t")
    assert "<p id=\"wrong\" class=\"note\">top-1 wrong for 0 of 5 probes</p>" in right and "class=\"wrong\"" not in right


def test_a_threshold_marks_each_match_same_or_different():
    probes = [ProbeView("p.jpg", None, None, [MatchView("a", 0.5, None), MatchView("b", 0.4, None), MatchView("c", 0.3999, None)])]
    page = render_page(probes, title="t", threshold=0.4)
    marks = re.findall(r"<figcaption>(\w)<br>[0-9.]+ <span class=\"mark (\w+)\">", page)
    assert marks == [("a", "same"), ("b", "same"), ("c", "different")]
    assert "same identity when the score is at least 0.400" in page
    assert "class=\"mark" not in render_page(probes, title="t")
    assert page.count("no thumbnail") == 4


@needs_chromium
@pytest.mark.multiprocess
def test_the_page_in_headless_chromium(chromium, tmp_path):
    probes = [probe(i, truth=f"id{i}", top1=f"id{i % 5}", matches=4) for i in range(12)]
    target = tmp_path / "search.html"
    target.write_text(render_page(probes, title="search", threshold=0.6), encoding="utf-8")
    seen = chromium.open(target.as_uri())
    assert [url for url in seen["requests"] if not url.startswith("data:") and url != target.as_uri()] == []
    assert len(seen["images"]) == 12 * 5
    assert [alt for width, height, alt in seen["images"] if width == 0 or height == 0] == []
    assert {(width, height) for width, height, _ in seen["images"]} == {(32, 32)}
