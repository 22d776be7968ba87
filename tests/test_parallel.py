"""The local Dask cluster facepipe starts: loopback only, dashboard included."""

from __future__ import annotations

import ipaddress
import os

import psutil
import pytest

from facepipe.cluster import dask_client

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

    from flows.api import api_shared_with_workers

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with api_shared_with_workers() as url:
        server = SubprocessASGIServer()  # the instance api_shared_with_workers started (one per port)
        try:
            assert os.environ["PREFECT_API_URL"] == url == server.api_url and url.startswith("http://127.0.0.1:")
            root = psutil.Process(server.server_process.pid)
            listening = _listening([proc.pid for proc in (root, *root.children(recursive=True))])
            assert listening and all(ipaddress.ip_address(ip).is_loopback for ip, _ in listening), listening
        finally:
            server.stop()
            assert not psutil.pid_exists(root.pid) or root.status() == psutil.STATUS_ZOMBIE
    # the URL of a server that is gone is not left for later runs in this process (or their children)
    assert "PREFECT_API_URL" not in os.environ


def test_an_api_given_by_settings_is_shared_and_the_environment_restored(monkeypatch: pytest.MonkeyPatch):
    """A harness or profile sets the API in Prefect's settings, not the environment: workers get it through
    the environment for the run only, and an earlier value comes back afterwards."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.api import api_shared_with_workers

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:2/api"}):
        with api_shared_with_workers() as url:
            assert url == os.environ["PREFECT_API_URL"] == "http://127.0.0.1:2/api"
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:1/api"
    monkeypatch.delenv("PREFECT_API_URL")
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:2/api"}):
        with api_shared_with_workers():
            pass
    assert "PREFECT_API_URL" not in os.environ
