"""The flows' console: facepipe's own lines and the flow run's, Dask and Prefect from WARNING up.

Prefect configures logging when it is imported: one console handler on the root logger, which
shows every INFO record that Dask's scheduler, nannies and workers and Prefect's server and task
runs propagate to it (on a big prepare: hundreds of lines, one per chunk task). The Prefect UI and
API still receive every record (their handlers are untouched); ``--verbose`` shows them all here too.
"""

from __future__ import annotations

import logging
import os

#: Loggers whose INFO lines the console keeps: facepipe's progress and the flow run's own lines
#: (its start, its end and what it prints: the summary).
SHOWN = ("facepipe", "prefect.flow_runs")


class ConsoleFilter(logging.Filter):
    """Passes WARNING and above, and everything from :data:`SHOWN`; with ``verbose``, everything."""

    def __init__(self, *, verbose: bool) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        return self.verbose or record.levelno >= logging.WARNING or record.name.startswith(SHOWN)


def console_filter(*, verbose: bool) -> ConsoleFilter:
    return ConsoleFilter(verbose=verbose)


def configure_console(*, verbose: bool) -> None:
    """Quiet this process's console, and that of the Dask worker processes it starts afterwards."""
    logging.getLogger("facepipe").setLevel(logging.DEBUG if verbose else logging.INFO)
    if verbose:
        return
    for handler in logging.getLogger().handlers:
        handler.addFilter(console_filter(verbose=False))
    # Worker processes configure Prefect's logging afresh when they import it (task runs log there).
    os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "WARNING"


def dask_silence(*, verbose: bool) -> int | bool:
    """``silence_logs`` for a local Dask cluster: its processes log from WARNING up (all when verbose)."""
    return False if verbose else logging.WARNING
