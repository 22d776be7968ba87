"""The shard set's metadata files: ``manifest.json``, ``labels.json``, ``rejects.jsonl``.

All three are deterministic: sorted keys, no timestamps, no absolute paths, no host names.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from facepipe.io.shards import SET_FORMAT, SET_VERSION, ShardInfo


def dumps(obj: Any) -> str:
    """Canonical pretty JSON with a trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def build_manifest(
    shards: Sequence[ShardInfo],
    *,
    image: Mapping[str, Any],
    num_identities: int,
    counts: Mapping[str, int],
    params: Mapping[str, Any],
) -> dict[str, Any]:
    """The manifest dict of a finished set (``image``: size, encoding, quality, template)."""
    return {
        "format": SET_FORMAT,
        "version": SET_VERSION,
        "image": dict(image),
        "num_samples": sum(s.num_samples for s in shards),
        "num_identities": num_identities,
        "shards": [s.manifest_entry() for s in shards],
        "counts": dict(counts),
        "params": dict(params),
    }


def write_metadata(
    root: str | Path,
    *,
    manifest: Mapping[str, Any],
    identities: Sequence[str],
    rejects: Iterable[Mapping[str, Any]] | None = (),
) -> None:
    """Write labels.json, rejects.jsonl (unless ``rejects`` is None: already streamed) and, last,
    manifest.json: its presence marks a complete set."""
    root = Path(root)
    (root / "labels.json").write_text(dumps(list(identities)))
    if rejects is not None:
        with open(root / "rejects.jsonl", "w") as handle:
            for reject in rejects:
                handle.write(reject_line(reject))
    (root / "manifest.json").write_text(dumps(dict(manifest)))


def reject_line(reject: Mapping[str, Any]) -> str:
    """One line of rejects.jsonl: ``{"detail", "path", "reason"}``."""
    return json.dumps(dict(reject), sort_keys=True, ensure_ascii=False) + "\n"
