"""One Prefect API per run, shared with every Dask worker process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def api_shared_with_workers() -> Iterator[str]:
    """The Prefect API this process reports to, exported in ``PREFECT_API_URL`` for child processes
    while the block runs.

    In Prefect's local mode every process that reports a task run starts its own temporary server
    (a subprocess with its own SQLite database) unless ``PREFECT_API_URL`` is set. Starting the one
    temporary server here, before the Dask cluster spawns its workers, makes every worker report to
    it: one server per run instead of one per worker, and every task run visible in one place.
    The variable's earlier state comes back on exit: a later run in the same process (a notebook, a
    test session) must not hand its workers the address of a server that has stopped since.
    """
    from prefect.settings import PREFECT_API_URL

    before = os.environ.get("PREFECT_API_URL")
    url = PREFECT_API_URL.value()
    if not url:
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()  # the same instance Prefect's own client would start
        server.start()
        url = server.api_url
    os.environ["PREFECT_API_URL"] = url
    try:
        yield url
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before
