"""The connect window, seen from the workers' side: a TCP proxy in front of every worker's sshd notes when each
connection arrives; with TPURUN_CONNECT_WINDOW=W no more than W connections arrive within any stretch shorter
than one SSH handshake through the proxy (a window's place frees only when a handshake is over)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_clean_error, create_node
from tpurun.testing.latency_proxy import ProxyGroup, address_map_env, proxy_workers

pytestmark = pytest.mark.integration

RTT = 0.4  # seconds the proxy adds to every round trip: an SSH handshake takes several


def _most_within(times: list[float], span: float) -> int:
    """The most of TIMES that fall within any stretch of SPAN seconds."""
    times = sorted(times)
    return max(sum(1 for u in times[i:] if u - t < span) for i, t in enumerate(times))


def _arrivals(cli, emulator, window: int) -> list[float]:
    """When each worker's connection arrived at its proxy, for one `tpurun exec` with WINDOW."""
    info = emulator.node_info(emulator.node_name("win8"))
    group = ProxyGroup(rtt=RTT).start()
    try:
        mapping = proxy_workers(group, [(w["address"], w["sshPort"]) for w in info["workers"]])
        cli.env["TPURUN_ADDRESS_MAP"] = address_map_env(mapping)
        cli.env["TPURUN_CONNECT_WINDOW"] = str(window)
        r = cli("exec", "--", "true")
        assert r.code == 0, r.err
        return [t for p in group.proxies for t in p.accepted]
    finally:
        del cli.env["TPURUN_ADDRESS_MAP"], cli.env["TPURUN_CONNECT_WINDOW"]
        group.close()


def test_at_most_the_window_of_workers_is_connected_to_at_once(cli, emulator):
    create_node(cli, "win8", "v4-64")  # 8 workers
    narrow = _arrivals(cli, emulator, 3)
    assert len(narrow) == 8  # every worker reached, one connection each
    # a handshake costs several round trips through the proxy: within one, only the window's connections start
    assert _most_within(narrow, RTT) <= 3, sorted(round(t - min(narrow), 2) for t in narrow)
    assert max(narrow) - min(narrow) >= 2 * RTT  # the others waited their turn
    # the same look sees every connection at once when the window holds the whole pod (the check can fail)
    wide = _arrivals(cli, emulator, 8)
    assert _most_within(wide, RTT) == 8, sorted(round(t - min(wide), 2) for t in wide)
    cli.env["TPURUN_CONNECT_WINDOW"] = "0"
    try:
        assert_clean_error(cli("exec", "--", "true"), 2)  # no window at all: said in one line, nothing run
    finally:
        del cli.env["TPURUN_CONNECT_WINDOW"]
