"""``facepipe inspect`` and ``facepipe verify``: look at, and re-check, a prepared shard set."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

from PIL import Image

from facepipe.errors import FacepipeError
from facepipe.io import ShardSet
from facepipe.io.atomic import OutputKind, check_output
from facepipe.io.records import RecordError, decode_image
from facepipe.io.shards import sha256_file


def summarize(root: str | Path) -> dict[str, Any]:
    """Identities, samples, rejects by reason, shard sizes and storage overhead of a shard set."""
    shard_set = ShardSet(root)
    root = Path(root)
    shard_bytes = {s["file"]: (root / "shards" / s["file"]).stat().st_size for s in shard_set.manifest["shards"]}
    report_path = root / "report.json"
    payload = json.loads(report_path.read_text()).get("payload_bytes") if report_path.is_file() else None
    if payload is None:
        payload = sum(len(reader.record(i).payload) for reader in shard_set.readers for i in range(len(reader)))
    reasons: Counter[str] = Counter()
    rejects_path = root / "rejects.jsonl"
    if rejects_path.is_file():
        with open(rejects_path) as handle:
            reasons.update(json.loads(line)["reason"] for line in handle if line.strip())
    total = sum(shard_bytes.values())
    per_identity = Counter(shard_set.labels().tolist())
    return {
        "identities": shard_set.num_identities,
        "samples": len(shard_set),
        "samples_per_identity": {
            "min": min(per_identity.values(), default=0),
            "max": max(per_identity.values(), default=0),
        },
        "counts": shard_set.manifest.get("counts", {}),
        "rejected_by_reason": dict(sorted(reasons.items())),
        "image": shard_set.manifest["image"],
        "shards": [{"file": f, "num_samples": s["num_samples"], "bytes": shard_bytes[f]}
                   for f, s in zip(shard_bytes, shard_set.manifest["shards"])],
        "shard_bytes": total,
        "payload_bytes": payload,
        "storage_overhead": round(total / payload - 1.0, 4) if payload else None,
    }


def dump_faces(root: str | Path, out: str | Path, *, limit: int | None = None) -> int:
    """Write aligned faces as PNG files under ``out``, mirroring their source paths; returns the count."""
    shard_set = ShardSet(root)
    out = Path(out)
    written = 0
    for reader in shard_set.readers:
        for record in reader:
            if limit is not None and written >= limit:
                return written
            target = (out / record.path).with_suffix(".png")
            target.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(record.image()).save(target)
            written += 1
    return written


def verify(root: str | Path) -> list[str]:
    """Every problem found (empty when the set is sound): checksums, counts, label index, decoding."""
    shard_set = ShardSet(root)
    problems = []
    for entry, reader in zip(shard_set.manifest["shards"], shard_set.readers):
        name = entry["file"]
        if not reader.path.is_file():
            problems.append(f"{name}: missing")
            continue
        if sha256_file(reader.path) != entry["sha256"]:
            problems.append(f"{name}: sha256 differs from the manifest")
            continue
        try:
            if len(reader) != entry["num_samples"]:
                problems.append(f"{name}: {len(reader)} samples, manifest says {entry['num_samples']}")
            labels = reader.labels()
            for index, record in enumerate(reader):
                if record.label != labels[index]:
                    problems.append(f"{name}[{index}]: label {record.label} != label index {labels[index]}")
                if not 0 <= record.label < shard_set.num_identities:
                    problems.append(f"{name}[{index}]: label {record.label} outside labels.json")
                decode_image(record.payload)
        except (RecordError, OSError, ValueError, FacepipeError) as error:
            problems.append(f"{name}: {error}")
    if sum(e["num_samples"] for e in shard_set.manifest["shards"]) != shard_set.manifest["num_samples"]:
        problems.append("manifest num_samples does not equal the sum over shards")
    counts = shard_set.manifest.get("counts")
    if counts and counts["scanned"] != counts["accepted"] + counts["rejected"]:
        problems.append("manifest counts: scanned != accepted + rejected")
    return problems


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    inspect = subparsers.add_parser("inspect", help="summary of a shard set; --dump writes faces as PNG")
    inspect.add_argument("root", type=Path, metavar="PREPARED")
    inspect.add_argument("--dump", type=Path, metavar="DIR", help="write aligned faces as PNG files here")
    inspect.add_argument("--limit", type=int, default=None, metavar="N", help="with --dump: at most N faces")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.set_defaults(func=_inspect)
    check = subparsers.add_parser("verify", help="re-check shard checksums and that every record decodes")
    check.add_argument("root", type=Path, metavar="PREPARED")
    check.set_defaults(func=_verify)


def _inspect(args: argparse.Namespace) -> int:
    if args.dump is not None:
        if args.limit is not None and args.limit < 0:
            raise FacepipeError("--limit must be >= 0")
        # writes into DIR: only a folder of earlier dumps (PNG files only), never one holding the set
        check_output(args.dump, kind=OutputKind("face dump", ("*.png",)), sources={"shard set": args.root})
        count = dump_faces(args.root, args.dump, limit=args.limit)
        print(f"wrote {count} faces under {args.dump}")
        return 0
    summary = summarize(args.root)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    counts = summary["counts"]
    print(f"{args.root}: {summary['samples']} samples of {summary['identities']} identities "
          f"({summary['samples_per_identity']['min']}-{summary['samples_per_identity']['max']} per identity)")
    if counts:
        print(f"  scanned {counts['scanned']}, accepted {counts['accepted']}, rejected {counts['rejected']}")
    for reason, n in summary["rejected_by_reason"].items():
        print(f"    {reason:<24} {n}")
    image = summary["image"]
    print(f"  faces {image['size']}x{image['size']} {image['encoding']}")
    for shard in summary["shards"]:
        print(f"  {shard['file']}  {shard['num_samples']:>8} samples  {shard['bytes'] / 1e6:9.2f} MB")
    if summary["storage_overhead"] is not None:
        print(f"  storage overhead over payload bytes: {100 * summary['storage_overhead']:.1f}%")
    return 0


def _verify(args: argparse.Namespace) -> int:
    problems = verify(args.root)
    for problem in problems:
        print(f"{args.root}: {problem}")
    if problems:
        print(f"facepipe verify: {len(problems)} problem(s) found")
        return 1
    print(f"{args.root}: OK ({len(ShardSet(args.root))} samples, every checksum and record verified)")
    return 0
