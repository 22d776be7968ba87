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
