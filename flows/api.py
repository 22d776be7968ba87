"""One Prefect API per run, shared with every Dask worker process."""

from __future__ import annotations

import os


def share_api_with_workers() -> str:
    """The Prefect API this process reports to, exported in ``PREFECT_API_URL`` for child processes.

    In Prefect's local mode every process that reports a task run starts its own temporary server
    (a subprocess with its own SQLite database) unless ``PREFECT_API_URL`` is set. Starting the one
    temporary server here, before the Dask cluster spawns its workers, makes every worker report to
    it: one server per run instead of one per worker, and every task run visible in one place.
    """
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()  # the same instance Prefect's own client would start
        server.start()
        url = server.api_url
    os.environ["PREFECT_API_URL"] = url
    return url
