"""The sample-data stage: ``facepipe sample-data OUT`` writes the built-in offline raw dataset.

The work is :func:`facepipe.data.sample.make_sample_dataset`; this module resolves parameters
(``params.yaml`` section ``sample_data`` plus command-line overrides) and reports one line.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from facepipe.config import SampleDataParams, load_section, parse_section
from facepipe.data.sample import SampleReport, make_sample_dataset
from facepipe.progress import Progress

log = logging.getLogger("facepipe.sample_data")

#: Command-line options that override keys of the ``sample_data`` section.
_OVERRIDES = ("identities", "images_per_identity", "seed")


def run(params: SampleDataParams, out: str | Path, *, show_progress: bool = True) -> SampleReport:
    """Write the sample dataset for ``params`` to ``out`` (absent or empty) and return what was written."""
    total = params.identities * params.images_per_identity
    with Progress(total, desc="sample-data", logger=log, enabled=show_progress) as progress:
        return make_sample_dataset(out, params, progress=progress.update)


def resolve_params(params: SampleDataParams, overrides: dict[str, Any]) -> SampleDataParams:
    """``params`` with the non-None ``overrides`` applied, validated like the params file."""
    changes = {key: value for key, value in overrides.items() if value is not None}
    return parse_section(SampleDataParams, "sample_data", {**params.model_dump(), **changes})


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from facepipe.cli import add_params_argument  # here, not at the top: cli imports this module

    parser = subparsers.add_parser(
        "sample-data", help="write a small offline raw face dataset (OUT/<identity>/<image>)"
    )
    parser.add_argument("out", type=Path, metavar="OUT", help="folder to create (must not exist or be empty)")
    add_params_argument(parser)
    parser.add_argument("--identities", type=int, default=None, metavar="N", help="override sample_data.identities")
    parser.add_argument(
        "--images-per-identity", type=int, default=None, metavar="N", help="override sample_data.images_per_identity"
    )
    parser.add_argument("--seed", type=int, default=None, metavar="N", help="override sample_data.seed")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    params = resolve_params(load_section(args.params, "sample_data"), {k: getattr(args, k) for k in _OVERRIDES})
    report = run(params, args.out)
    print(f"sample-data: wrote {report.summary()}")
    return 0
