"""The data-quality report as one self-contained HTML page.

No network and no scripts: images are ``data:`` URIs, charts inline SVG, styles inline, and a
Content-Security-Policy that lets the page load nothing but ``data:`` images (a URL slipped into a
path or detail would stay text anyway: every value is HTML-escaped).
"""

from __future__ import annotations

import base64
from html import escape

import numpy as np

from facepipe.quality.collect import QualityData, Thumb

#: The page's first line after the doctype: what marks a file as a report facepipe may replace.
GENERATOR = '<meta name="generator" content="facepipe data-quality report">'
#: What the page may load: nothing but its own inline styles and data: images.
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; } td, th { padding: 2px 10px; text-align: left; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.grid { display: flex; flex-wrap: wrap; gap: 8px; }
figure { margin: 0; width: 120px; font-size: 11px; word-break: break-all; }
figure img, .none { display: block; border: 1px solid #bbb; }
.none { width: 96px; height: 72px; background: #eee; color: #666; font-size: 11px; padding: 2px; box-sizing: border-box; }
.row { display: flex; align-items: center; gap: 4px; margin: 4px 0; }
.row .name { width: 180px; font-size: 12px; word-break: break-all; }
.pair { display: flex; gap: 8px; align-items: flex-start; margin: 6px 0; }
.note { color: #666; }
"""


def render(data: QualityData) -> str:
    """The report page for ``data`` (deterministic: the same data give the same text)."""
    sections = [
        _summary(data),
        _histograms(data),
        _faces(data),
        _rejects(data),
        _duplicates(data),
    ]
    return (
        f"<!DOCTYPE html>\n<html lang=\"en\"><head>{GENERATOR}<meta charset=\"utf-8\">"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
        f"<title>facepipe data quality: {data.num_samples} faces of {data.num_identities} identities</title><style>{_STYLE}</style></head><body>\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )


def _summary(data: QualityData) -> str:
    counts = data.counts
    image = data.image
    rows = [
        ("scanned", counts.get("scanned")),
        ("accepted", counts.get("accepted")),
        ("rejected", counts.get("rejected")),
        ("faces in the set", data.num_samples),
        ("identities", data.num_identities),
    ]
    table = "".join(f"<tr><th>{escape(k)}</th><td class=\"n\">{'' if v is None else v}</td></tr>" for k, v in rows)
    reasons = "".join(
        f"<tr><td>{escape(reason)}</td><td class=\"n\">{n}</td></tr>" for reason, n in data.rejected_by_reason.items()
    )
    face = f"{image.get('size')}×{image.get('size')} {escape(str(image.get('encoding')))}" if image else "?"
    return (
        "<h1>Data quality of a facepipe shard set</h1>"
        f"<p class=\"note\">Aligned faces {face}. Faces and scores are a seeded random sample;"
        " counts cover the whole set.</p>"
        f"<table>{table}</table><h2 id=\"reasons\">Rejects by reason</h2>"
        + (f"<table><tr><th>reason</th><th>files</th></tr>{reasons}</table>" if reasons else "<p>No rejects.</p>")
    )


def _histograms(data: QualityData) -> str:
    per_identity = data.faces_per_identity
    parts = ["<h2 id=\"histograms\">Distributions</h2><div class=\"grid\">"]
    if len(per_identity):
        parts.append(svg_histogram(per_identity, title="faces per identity", integer=True))
    scores = data.scores
    if len(scores):
        title = f"detection score ({len(scores)} sampled faces)"
        parts.append(svg_histogram(scores, title=title, integer=False))
    parts.append("</div>")
    return "".join(parts)


def svg_histogram(values: np.ndarray, *, title: str, integer: bool, width: int = 460, height: int = 220) -> str:
    """An inline SVG bar chart of ``values`` (1-D) with at most 30 bins; integer bins when ``integer``."""
    low, high = float(values.min()), float(values.max())
    if integer:
        step = max(1, int(np.ceil((high - low + 1) / 30)))
        edges = np.arange(low, high + step + 1, step) - 0.5
    else:
        edges = np.linspace(low, high, 21) if high > low else np.array([low - 0.0005, high + 0.0005])
    counts, edges = np.histogram(values, bins=edges)
    span = float(edges[-1] - edges[0])
    # enough decimals that the two ends differ (detection scores crowd just under 1.0)
    digits = 0 if integer else int(min(6, max(3, np.ceil(-np.log10(span)) + 1))) if span > 0 else 3
    left, bottom, top = 44, 36, 24
    plot_w, plot_h = width - left - 10, height - bottom - top
    peak = max(int(counts.max()), 1)
    bar_w = plot_w / len(counts)
    bars = "".join(
        f"<rect x=\"{left + i * bar_w + 1:.1f}\" y=\"{top + plot_h * (1 - c / peak):.1f}\" width=\"{max(bar_w - 2, 1):.1f}\""
        f" height=\"{plot_h * c / peak:.1f}\" fill=\"#4a78b5\"><title>{_edge(edges[i], digits)}–{_edge(edges[i + 1], digits, upper=True)}: {c}</title></rect>"
        for i, c in enumerate(counts.tolist())
    )
    axis = (
        f"<line x1=\"{left}\" y1=\"{top + plot_h}\" x2=\"{left + plot_w}\" y2=\"{top + plot_h}\" stroke=\"#333\"/>"
        f"<text x=\"{left}\" y=\"{height - 18}\" font-size=\"11\">{_edge(edges[0], digits)}</text>"
        f"<text x=\"{left + plot_w}\" y=\"{height - 18}\" font-size=\"11\" text-anchor=\"end\">{_edge(edges[-1], digits, upper=True)}</text>"
        f"<text x=\"{left - 4}\" y=\"{top + 10}\" font-size=\"11\" text-anchor=\"end\">{peak}</text>"
        f"<text x=\"{left - 4}\" y=\"{top + plot_h}\" font-size=\"11\" text-anchor=\"end\">0</text>"
        f"<text x=\"{left}\" y=\"16\" font-size=\"13\" font-weight=\"bold\">{escape(title)}</text>"
    )
    return (
        f"<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" role=\"img\""
        f" aria-label=\"{escape(title)}\">{axis}{bars}</svg>"
    )


def _edge(value: float, digits: int, *, upper: bool = False) -> str:
    """An axis value. Integer bins run from k - 0.5 to k + step - 0.5 and hold k .. k + step - 1:
    a lower edge is labelled with its first integer, an upper one with its last."""
    if digits == 0:
        return f"{value - 0.5 if upper else value + 0.5:.0f}"
    return f"{value:.{digits}f}"


def _faces(data: QualityData) -> str:
    shown = len(data.faces)
    head = (
        f"<h2 id=\"faces\">Aligned faces: {shown} of {data.num_identities} identities</h2>"
        f"<p class=\"note\">Up to {data.limits.faces_per_identity} random faces each.</p>"
    )
    rows = []
    for identity, payloads in data.faces:
        images = "".join(img_tag(payload, alt=identity) for payload in payloads)
        rows.append(f"<div class=\"row\"><div class=\"name\">{escape(identity)}</div>{images}</div>")
    return head + "".join(rows)


def _rejects(data: QualityData) -> str:
    if not data.reject_samples:
        return ""
    note = "" if data.raw_available else " Thumbnails need the source folder (<code>inspect --html FILE --raw RAW</code>)."
    parts = [
        f"<h2 id=\"rejects\">Rejected files</h2><p class=\"note\">Up to {data.limits.rejects_per_reason}"
        f" random files per reason, with the source path and detail.{note}</p>"
    ]
    for reason, samples in data.reject_samples.items():
        total = data.rejected_by_reason.get(reason, len(samples))
        figures = "".join(_figure(s.thumb, caption=f"{s.thumb.path} — {s.detail}") for s in samples)
        parts.append(f"<h3>{escape(reason)} ({total})</h3><div class=\"grid\">{figures}</div>")
    return "".join(parts)


def _duplicates(data: QualityData) -> str:
    head = f"<h2 id=\"duplicates\">Cross-identity duplicates: {data.cross_duplicates}</h2>"
    if not data.cross_duplicates:
        return head + "<p>No file has the same bytes as a file of another identity.</p>"
    note = (
        f"<p class=\"note\">The same bytes under two identities (a mislabelled or copied photo); the first"
        f" {len(data.duplicate_pairs)} shown: kept file, then the rejected copy.</p>"
    )
    pairs = "".join(
        f"<div class=\"pair\">{_figure(kept, caption=kept.path)}{_figure(copy, caption=copy.path)}</div>"
        for kept, copy in data.duplicate_pairs
    )
    return head + note + pairs


def _figure(thumb: Thumb, *, caption: str) -> str:
    if thumb.jpeg is not None:
        picture = img_tag(thumb.jpeg, alt=thumb.path)
    else:
        picture = f"<div class=\"none\">{escape(thumb.note)}</div>"
    return f"<figure>{picture}<figcaption>{escape(caption)}</figcaption></figure>"


def img_tag(jpeg_or_png: bytes, *, alt: str) -> str:
    """An <img> of a JPEG or PNG inlined as a data: URI, its alt text escaped."""
    kind = "png" if jpeg_or_png.startswith(b"\x89PNG") else "jpeg"
    encoded = base64.b64encode(jpeg_or_png).decode("ascii")
    return f"<img src=\"data:image/{kind};base64,{encoded}\" alt=\"{escape(alt)}\">"
