"""The shard set's metadata files: ``manifest.json``, ``labels.json``, ``rejects.jsonl``.

All three are deterministic: sorted keys, no timestamps, no absolute paths, no host names. The
manifest records the sha256 of the other two (``files``) and of every shard, and each shard's size,
so that :func:`metadata_problems` can check a set's cross-references in a second or two before a
run reads it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lmdb

from facepipe.io.shards import SET_FORMAT, SET_VERSION, ShardInfo, ShardReader, ShardSet, ShardSetError, sha256_file
from facepipe.io.validation_sets import bin_set_problems

#: The small files whose sha256 the manifest records under ``files``.
HASHED_FILES = ("labels.json", "rejects.jsonl")
#: One JSON line per scanned entry, in scan order: ``{"path", "sha256", "reason", "sample", "size",
#: "mtime_ns", "generation"}`` (``sample``: stored index of its record, None for a reject). What
#: ``prepare --update`` compares RAW against and ``compact`` rebuilds from. The manifest records the
#: sha256 of its lines without sizes and modification times (:class:`SourcesDigest`, under
#: :data:`SOURCES_KEY`): those are this machine's hints, and the manifest stays the same on every machine.
SOURCES_FILE = "sources.jsonl"
#: The manifest key of :class:`SourcesDigest`'s hash of sources.jsonl.
SOURCES_KEY = "sources_sha256"


class SourcesDigest:
    """sha256 over what sources.jsonl says of each file that is the same on every machine (path, sha256,
    reason, sample, generation), line by line; a reader recomputes it before trusting the file."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()

    def add(self, path: str, sha256: str | None, reason: str | None, sample: int | None, generation: int) -> None:
        # NUL never occurs in a path, a hex digest, a reason code or a number: the fields cannot run together
        self._digest.update(f"{path}\0{sha256}\0{reason}\0{sample}\0{generation}\n".encode())

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


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
    generations: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The manifest dict of a finished set (``image``: size, encoding, quality, template).

    ``generations``: one entry per ``prepare`` / ``prepare --update`` run that made the set, oldest
    first (``{"generation", "shards", "counts", "reused", "removed", "labels", "excluded"}``);
    ``num_samples`` counts live samples (stored less every generation's ``excluded``).
    """
    excluded = sum(len(indexes) for g in generations for indexes in g.get("excluded", {}).values())
    manifest = {
        "format": SET_FORMAT,
        "version": SET_VERSION,
        "image": dict(image),
        "num_samples": sum(s.num_samples for s in shards) - excluded,
        "num_identities": num_identities,
        "shards": [s.manifest_entry() for s in shards],
        "counts": dict(counts),
        "params": dict(params),
    }
    if generations:
        manifest["generations"] = [dict(g) for g in generations]
    return manifest


def recorded_params(params: Any) -> dict[str, Any]:
    """Prepare params (``PrepareParams``) as a manifest records them: resolved, weights given by path
    recorded by name and sha256 (never the path: the same weights anywhere give the same manifest)."""
    resolved = params.model_dump()
    if params.crop == "arcface":
        # recorded only when it differs from the one crop there was before: earlier sets keep their
        # manifest byte for byte (and stay growable by --update)
        del resolved["crop"], resolved["margin"]
    if params.detector_weights is not None:
        resolved["detector_weights"] = weights_record(params.detector_weights)
    return resolved


def weights_record(path: str | Path) -> dict[str, str]:
    """What a manifest records of a weights file given by path: its name and sha256."""
    return {"file": Path(path).name, "sha256": sha256_file(Path(path))}


def shard_set_crop(manifest: Mapping[str, Any]) -> str:
    """How the set's faces were cut (``prepare.crop``): recorded only when not arcface, the crop of
    every set prepared before there was a choice (and of imported sets: aligned crops)."""
    params = manifest.get("params")
    return str(params.get("crop", "arcface")) if isinstance(params, Mapping) else "arcface"


def excluded_count(manifest: Mapping[str, Any]) -> int:
    """Stored samples that a later generation excluded (0 for a set of one generation)."""
    return sum(len(indexes) for g in manifest.get("generations", []) for indexes in g.get("excluded", {}).values())


def write_metadata(
    root: str | Path,
    *,
    manifest: Mapping[str, Any],
    identities: Sequence[str],
    rejects: Iterable[Mapping[str, Any]] | None = (),
) -> dict[str, Any]:
    """Write labels.json, rejects.jsonl (unless ``rejects`` is None: already streamed) and, last,
    manifest.json with their hashes added: its presence marks a complete set. Returns what it wrote."""
    root = Path(root)
    (root / "labels.json").write_text(dumps(list(identities)), encoding="utf-8")
    if rejects is not None:
        with open(root / "rejects.jsonl", "w", encoding="utf-8") as handle:
            for reject in rejects:
                handle.write(reject_line(reject))
    written = {**manifest, "files": {name: sha256_file(root / name) for name in HASHED_FILES}}
    (root / "manifest.json").write_text(dumps(written), encoding="utf-8")
    return written


def read_jsonl(path: str | Path, *, lenient: bool = False) -> Iterator[Any]:
    """The values of a JSONL file (rejects.jsonl, sources.jsonl), one line at a time: memory does not
    grow with the file. Strict (what acts on the set: update, compact): blank lines are skipped and
    a line that does not parse raises ValueError. ``lenient`` (what shows a set: verify, the report):
    undecodable bytes are replaced and a line that does not parse, blank or not, gives None.
    Raises OSError when the file cannot be read."""
    with open(path, encoding="utf-8", errors="replace" if lenient else "strict") as handle:
        for line in handle:
            if not lenient:
                if line.strip():
                    yield json.loads(line)
                continue
            try:
                yield json.loads(line)
            except ValueError:
                yield None


def reject_line(reject: Mapping[str, Any]) -> str:
    """One line of rejects.jsonl: ``{"detail", "path", "reason"}``."""
    return json.dumps(dict(reject), sort_keys=True, ensure_ascii=False) + "\n"


_SAME_BYTES = "same bytes as "
_CROSS_MARK = " (another identity)"


def _identity(path: str) -> str:
    return path.split("/", 1)[0]


def duplicate_detail(first: str, path: str) -> str:
    """The detail of ``path``'s ``duplicate`` reject: it holds the bytes of the earlier ``first``;
    marked when the two are of different identities."""
    return _SAME_BYTES + first + (_CROSS_MARK if _identity(first) != _identity(path) else "")


def duplicate_of(detail: str, path: str) -> tuple[str, bool] | None:
    """Inverse of :func:`duplicate_detail`: (first path, whether it is of another identity), or None
    for a detail it does not write. Decided by the reading that :func:`duplicate_detail` gives back,
    never by the end of the text alone: a file may itself be named ``a (another identity)``."""
    if not detail.startswith(_SAME_BYTES):
        return None
    named = detail[len(_SAME_BYTES) :]
    readings = ([named[: -len(_CROSS_MARK)]] if named.endswith(_CROSS_MARK) else []) + [named]
    for first in readings:
        if duplicate_detail(first, path) == detail:
            return first, _identity(first) != _identity(path)
    return None


def metadata_problems(shard_set: ShardSet) -> list[str]:
    """The cheap checks of a set (no record is read): hashes of labels.json and rejects.jsonl, counts
    against shards and rejects, each shard's size, sample count and label index against the
    manifest and labels.json, and the validation sets it carries (present, their sizes, none
    unlisted). Empty when they all agree. Seconds for millions of samples."""
    manifest, root = shard_set.manifest, shard_set.root
    problems = _small_file_problems(root, manifest.get("files"))
    names = shard_set.identities
    if len(set(names)) != len(names):
        problems.append("labels.json: an identity name appears twice")
    if manifest.get("num_identities") != len(names):
        problems.append(f"manifest num_identities {manifest.get('num_identities')} != {len(names)} names in labels.json")
    problems += _count_problems(manifest, root / "rejects.jsonl")
    for entry, reader in zip(manifest["shards"], shard_set.readers):
        problems += _shard_problems(entry, reader, num_identities=len(names))
    return problems + bin_set_problems(root, manifest)


def check_shard_set(root: str | Path) -> ShardSet:
    """The shard set at ``root`` if :func:`metadata_problems` finds nothing; else a one-line
    :class:`ShardSetError` naming the first problem (train and evaluate call it before starting)."""
    shard_set = ShardSet(root)
    problems = metadata_problems(shard_set)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ShardSetError(f"shard set {root} is inconsistent: {problems[0]}{more}; see facepipe verify {root}")
    return shard_set


def _small_file_problems(root: Path, recorded: Any) -> list[str]:
    if not isinstance(recorded, dict):
        return ["manifest.json records no hashes of labels.json and rejects.jsonl"]
    problems = []
    for name in HASHED_FILES:
        if not (root / name).is_file():
            problems.append(f"{name}: missing")
        elif sha256_file(root / name) != recorded.get(name):
            problems.append(f"{name}: sha256 differs from the manifest")
    return problems


def _count_problems(manifest: Mapping[str, Any], rejects: Path) -> list[str]:
    counts = manifest.get("counts")
    if not isinstance(counts, dict) or not all(isinstance(counts.get(k), int) for k in ("scanned", "accepted", "rejected")):
        return ["manifest counts: scanned, accepted and rejected must all be integers"]
    problems = []
    in_shards = sum(int(entry["num_samples"]) for entry in manifest["shards"]) - excluded_count(manifest)
    if manifest.get("num_samples") != in_shards:
        problems.append(f"manifest num_samples {manifest.get('num_samples')} != {in_shards}, the sum over shards (less excluded samples)")
    if counts["scanned"] != counts["accepted"] + counts["rejected"]:
        problems.append("manifest counts: scanned != accepted + rejected")
    for generation in manifest.get("generations", []):
        got = generation.get("counts") if isinstance(generation, dict) else None
        if not isinstance(got, dict) or got.get("scanned") != got.get("accepted", 0) + got.get("rejected", 0):
            problems.append(f"manifest generation {generation.get('generation') if isinstance(generation, dict) else '?'}"
                            " counts: scanned != accepted + rejected")
    if counts["accepted"] != in_shards:
        problems.append(f"manifest counts: accepted {counts['accepted']} != {in_shards} samples in the shards")
    if rejects.is_file():
        with open(rejects, "rb") as handle:
            lines = sum(1 for line in handle if line.strip())
        if counts["rejected"] != lines:
            problems.append(f"manifest counts: rejected {counts['rejected']} != {lines} lines in rejects.jsonl")
    return problems


def _shard_problems(entry: Mapping[str, Any], reader: ShardReader, *, num_identities: int) -> list[str]:
    name, expected = entry["file"], int(entry["num_samples"])
    if not reader.path.is_file():
        return [f"{name}: missing"]
    size = reader.path.stat().st_size
    if size != entry.get("bytes"):
        return [f"{name}: {size} bytes, manifest says {entry.get('bytes')}"]
    try:
        problems = []
        if len(reader) != expected:
            problems.append(f"{name}: {len(reader)} samples, manifest says {expected}")
        labels = reader.labels()
        if len(labels) != expected:
            problems.append(f"{name}: label index holds {len(labels)} labels, manifest says {expected} samples")
        if len(labels) and (labels.min() < 0 or labels.max() >= num_identities):
            problems.append(f"{name}: label index has labels outside labels.json's {num_identities} identities")
        return problems
    except (ShardSetError, lmdb.Error, ValueError) as error:
        return [f"{name}: unreadable ({error})"]
