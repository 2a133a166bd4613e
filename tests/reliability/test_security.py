"""Trust: tpurun's secrets are private, outputs never show them, values cannot inject shell, and the
emulator with everything it starts listens on loopback only. (A VM that is not the worker it stands for
is refused: tests/integration/test_identity.py.)"""

from __future__ import annotations

import json
import os
import stat

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import create

pytestmark = pytest.mark.integration


def test_private_state_is_private_and_never_printed(cli, emulator):
    create(cli, "secrets", "v4-8")
    (cli.cwd / "ok.py").write_text("print('ok')\n")
    r = cli("train", "ok.py", "--local", "--runtime", "cpu")
    assert r.code == 0, r.err
    home = cli.tpurun_home
    assert stat.S_IMODE(cli.key.stat().st_mode) == 0o600
    for d in [home, home / "ssh", home / "jobs"]:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    records = list((home / "jobs").glob("*.json"))
    assert records and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in records)
    body = "".join(cli.key.read_text().splitlines()[1:-1])
    job = records[0].stem
    outputs = [
        cli("describe", "secrets"),
        cli("describe", "secrets", "--json"),
        cli("--debug", "describe", "secrets"),
        cli("--debug", "exec", "--", "true"),
        cli("logs", job),
        cli("--debug", "config", "show"),
    ]
    for r in outputs:
        text = r.out + r.err
        assert "PRIVATE KEY" not in text
        for i in range(0, len(body) - 40, 40):
            assert body[i : i + 40] not in text
        assert "access_token" not in text.lower() and "ya29." not in text


_value = st.text(
    alphabet=st.sampled_from(list("$()`;'\"\\|&<>*?~ \n\tab{}!#é")), min_size=0, max_size=20
) | st.sampled_from(["$(touch /tmp/pwned)", "`id`", "a; rm -rf ~", "'; echo x; '", "$HOME", "a\nb"])


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=_value, arg=_value)
def test_env_values_and_arguments_reach_the_program_literally(cli, emulator, value, arg):
    node = "inj"
    if not any(n.name.endswith("/" + node) for n in emulator.client().list_nodes(parent=emulator.parent)):
        create(cli, node, "v4-8")
        (cli.cwd / "show.py").write_text("import json, os, sys\nprint(json.dumps([os.environ['INJ'], sys.argv[1:]]))\n")
    r = cli("train", "show.py", arg, "--env", f"INJ={value}", "--runtime", "cpu", "--cores", "1", "--python", "python3")
    assert r.code == 0, r.err
    line = next(x for x in r.out.splitlines() if x.startswith("[w0/c0] ["))
    assert json.loads(line.split("] ", 1)[1]) == [value, [arg]]
    assert not os.path.exists("/tmp/pwned")


def _listening_inodes() -> dict[int, str]:
    """inode -> local address of every LISTEN tcp socket (IPv4 and IPv6) of this network namespace."""
    out = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(path).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":
                out[int(f[9])] = f[1]
    return out


def _is_loopback(hex_addr: str) -> bool:
    ip = hex_addr.split(":")[0]
    if len(ip) == 8:
        return bytes.fromhex(ip)[::-1][0] == 127
    return ip in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F") or ip.endswith("7F")


def test_emulator_and_its_servers_bind_loopback_only(cli, emulator):
    create(cli, "lo", "v4-16")
    pids = [os.getpid()]
    for w in range(2):
        pids += emulator.emu.hosts.worker_root_pids(emulator.node_name("lo"), w)
    listening = _listening_inodes()
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = int(target[8:-1])
                if inode in listening:
                    found.append((pid, listening[inode]))
    assert found, "no listening socket found: the check would prove nothing"
    assert all(_is_loopback(addr) for _, addr in found), found
