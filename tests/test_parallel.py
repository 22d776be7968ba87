"""The local Dask cluster facepipe starts: loopback only, dashboard included."""

from __future__ import annotations

import ipaddress
import os

import psutil
import pytest

from facepipe.parallel import dask_client

pytestmark = pytest.mark.multiprocess


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    addresses = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                addresses.append((conn.laddr.ip, conn.laddr.port))
    return addresses


def test_local_cluster_and_its_dashboard_listen_on_loopback_only():
    with dask_client(workers=1) as client:
        worker_pids = list(client.run(os.getpid).values())
        listening = _listening([os.getpid(), *worker_pids])
        dashboard_port = int(client.dashboard_link.split(":")[2].split("/")[0])
        assert client.dashboard_link.startswith("http://127.0.0.1:")
        ports = {port for _, port in listening}
        assert dashboard_port in ports  # the dashboard really runs (the README says so)
        # scheduler, dashboard, worker and nanny servers: at least 4 sockets, every one on loopback
        assert len(listening) >= 4
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in listening), listening


def test_the_prefect_server_a_flow_run_starts_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch):
    """Without PREFECT_API_URL the flows start one temporary Prefect server; it is stopped here by PID."""
    from prefect.server.api.server import SubprocessASGIServer

    from flows.api import share_api_with_workers

    # set, then deleted: monkeypatch then restores the variable's state from before the test at teardown
    # (share_api_with_workers exports the URL of a server this test stops)
    monkeypatch.setenv("PREFECT_API_URL", "")
    monkeypatch.delenv("PREFECT_API_URL")
    url = share_api_with_workers()
    server = SubprocessASGIServer()  # the instance share_api_with_workers started (one per port)
    try:
        assert url == server.api_url and url.startswith("http://127.0.0.1:")
        root = psutil.Process(server.server_process.pid)
        listening = _listening([proc.pid for proc in (root, *root.children(recursive=True))])
        assert listening and all(ipaddress.ip_address(ip).is_loopback for ip, _ in listening), listening
    finally:
        server.stop()
        assert not psutil.pid_exists(root.pid) or root.status() == psutil.STATUS_ZOMBIE

