"""A search as one self-contained HTML page: each probe beside its best matches.

Made like the data-quality report (:mod:`facepipe.quality.render`): no network and no scripts,
thumbnails inlined as ``data:`` URIs, styles inline, the same Content-Security-Policy, and every text
(names, identities, the title) HTML-escaped. Deterministic: the same input gives the same bytes.

Bounded: at most ``max_probes`` probes (default ``MAX_PROBES``) are drawn, those whose top-1 match is
wrong first, then the others, each group in the order given; at most ``MAX_MATCHES`` matches per
probe; a thumbnail over ``MAX_THUMBNAIL_BYTES`` is replaced by a note. The page says how many probes
it left out. Counts at the top (wrong top-1s) cover every probe, drawn or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape

from facepipe.quality.render import CSP, img_tag

#: The page's first line after the doctype: what marks a file as a search page facepipe may replace.
GENERATOR = '<meta name="generator" content="facepipe search page">'
#: Probes drawn at most, matches per probe, bytes of one inlined thumbnail: a page holds at most
#: 100 x 11 thumbnails of 24 KiB, 35 MB in base64 (about 6 MB with 112 px JPEG faces of ~4 KB).
MAX_PROBES = 100
MAX_MATCHES = 10
MAX_THUMBNAIL_BYTES = 24 * 1024
_STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 22px; } .note { color: #666; }
.probe { display: flex; gap: 10px; align-items: flex-start; padding: 8px 0; border-bottom: 1px solid #ddd; }
.probe > figure { margin-right: 14px; }
figure { margin: 0; width: 120px; font-size: 11px; word-break: break-all; }
figure img, .none { display: block; width: 112px; border: 3px solid #ccc; }
.none { height: 112px; background: #eee; color: #666; padding: 2px; box-sizing: border-box; }
figure.wrong img, figure.wrong .none { border-color: #d00; }
figure.truth img, figure.truth .none { border-color: #2a2; }
.mark { font-weight: bold; } .same { color: #2a2; } .different { color: #888; }
.wrong-count { color: #d00; font-weight: bold; }
"""


@dataclass(frozen=True)
class MatchView:
    """One match as drawn: identity, cosine score, thumbnail (JPEG or PNG bytes) or None."""

    identity: str
    score: float
    thumbnail: bytes | None = None


@dataclass(frozen=True)
class ProbeView:
    """One probe as drawn: its name (a path), its true identity when known, thumbnail, best matches first."""

    name: str
    identity: str | None
    thumbnail: bytes | None
    matches: Sequence[MatchView] = field(default_factory=tuple)

    @property
    def wrong(self) -> bool:
        """Its identity is known and the top-1 match names another one."""
        return self.identity is not None and bool(self.matches) and self.matches[0].identity != self.identity


def render_page(probes: Sequence[ProbeView], *, title: str, threshold: float | None = None, max_probes: int = MAX_PROBES) -> str:
    """The page of a search: ``probes`` with their matches; ``threshold`` (a cosine) marks each match
    same (score >= threshold) or different."""
    drawn = [p for p in probes if p.wrong][:max_probes]
    drawn += [p for p in probes if not p.wrong][: max_probes - len(drawn)]
    rows = "\n".join(_probe(probe, threshold) for probe in drawn)
    return (
        f"<!DOCTYPE html>\n<html lang=\"en\"><head>{GENERATOR}<meta charset=\"utf-8\">"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}\">"
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>\n"
        f"<h1>{escape(title)}</h1>\n{_summary(probes, len(drawn), threshold, max_probes)}\n{rows}\n</body></html>\n"
    )


def _summary(probes: Sequence[ProbeView], drawn: int, threshold: float | None, max_probes: int) -> str:
    known = [p for p in probes if p.identity is not None and p.matches]
    wrong = sum(p.wrong for p in known)
    parts = [f"<p id=\"wrong\" class=\"{'wrong-count' if wrong else 'note'}\">top-1 wrong for {wrong} of {len(known)} probes"]
    if len(known) < len(probes):
        parts.append(f" ({len(probes) - len(known)} more of unknown identity, not counted)")
    parts.append("</p>")
    if threshold is not None:
        parts.append(f"<p class=\"note\">same identity when the score is at least {threshold:.3f}, different below.</p>")
    shown = f"All {drawn} probes shown." if drawn == len(probes) else (
        f"{drawn} of {len(probes)} probes shown (at most {max_probes}: those with a wrong top-1 first, then in"
        f" the order given); {len(probes) - drawn} left out."
    )
    parts.append(f"<p id=\"shown\" class=\"note\">{shown} Red: a wrong top-1 match; green: the probe's own identity.</p>")
    return "".join(parts)


def _probe(probe: ProbeView, threshold: float | None) -> str:
    caption = escape(probe.name) + ("" if probe.identity is None else f"<br>identity: {escape(probe.identity)}")
    parts = [f"<div class=\"probe\"><figure>{_picture(probe.thumbnail, alt=probe.name)}<figcaption>{caption}</figcaption></figure>"]
    for rank, match in enumerate(probe.matches[:MAX_MATCHES]):
        kind = "wrong" if rank == 0 and probe.wrong else "truth" if match.identity == probe.identity else "match"
        mark = ""
        if threshold is not None:
            same = match.score >= threshold
            mark = f" <span class=\"mark {'same' if same else 'different'}\">{'same' if same else 'different'}</span>"
        parts.append(
            f"<figure class=\"{kind}\">{_picture(match.thumbnail, alt=match.identity)}"
            f"<figcaption>{escape(match.identity)}<br>{match.score:.3f}{mark}</figcaption></figure>"
        )
    if len(probe.matches) > MAX_MATCHES:
        parts.append(f"<p class=\"note\">{len(probe.matches) - MAX_MATCHES} more matches not shown</p>")
    return "".join(parts) + "</div>"


def _picture(thumbnail: bytes | None, *, alt: str) -> str:
    if thumbnail is None:
        return "<div class=\"none\">no thumbnail</div>"
    if len(thumbnail) > MAX_THUMBNAIL_BYTES:
        return f"<div class=\"none\">thumbnail over {MAX_THUMBNAIL_BYTES // 1024} KiB, not inlined</div>"
    return img_tag(thumbnail, alt=alt)
