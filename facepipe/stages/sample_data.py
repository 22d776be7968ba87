"""The sample-data stage: ``facepipe sample-data OUT`` writes the built-in offline raw dataset.

The work is :func:`facepipe.synthetic.photos.make_sample_dataset`; this module resolves parameters
(``params.yaml`` section ``sample_data`` plus command-line overrides) and reports one line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from facepipe.config import SampleDataParams, parse_section
from facepipe.synthetic.photos import SampleReport, make_sample_dataset
from facepipe.progress import Progress

log = logging.getLogger("facepipe.sample_data")

def run(params: SampleDataParams, out: str | Path, *, show_progress: bool = True) -> SampleReport:
    """Write the sample dataset for ``params`` to ``out`` (absent or empty) and return what was written."""
    total = params.identities * params.images_per_identity
    with Progress(total, desc="sample-data", logger=log, enabled=show_progress) as progress:
        return make_sample_dataset(out, params, progress=progress.update)


def resolve_params(params: SampleDataParams, overrides: dict[str, Any]) -> SampleDataParams:
    """``params`` with the non-None ``overrides`` applied, validated like the params file."""
    changes = {key: value for key, value in overrides.items() if value is not None}
    return parse_section(SampleDataParams, "sample_data", {**params.model_dump(), **changes})
