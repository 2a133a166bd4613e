"""tpurun exec and ssh on emulated nodes: prefixes, exit codes, fail-fast, Ctrl-C cleanup, unreachable workers,
pins that come back from the API, and arguments that arrive exactly. The tests share one v4-64 (8 workers), but
for the one that deletes its TPU and the one that takes 12 of 16 workers down, which make their own."""

from __future__ import annotations

import json
import signal
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import assert_clean_error, create_node, job_pids, popen, read_until
from tests.integration.conftest import one_pod_per_file

pytestmark = pytest.mark.integration

POD = "pod8"  # the shared v4-64, 8 workers: each test's default TPU
shared_pod, cli = one_pod_per_file(POD, "v4-64")


def test_exec_every_worker_prefixed_with_exit_codes(cli):
    r = cli("exec", "--", "sh", "-c", 'echo "host $(hostname)"; echo "to stderr" >&2; exit 0')
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(f"[w{i}]" for i in range(8))
    assert len({line.split()[-1] for line in lines}) == 8  # eight different hostnames
    assert sum(1 for line in r.err.splitlines() if line.endswith("] to stderr")) == 8
    # failure on one worker: exit 1 naming it, the others still report
    r = cli("exec", "--", "sh", "-c", 'n=$(hostname); case "$n" in *-w-3) exit 5;; esac; echo ok')
    assert r.code == 1
    assert r.out.count("ok") == 7 and "w3" in r.err and "exit code 5" in r.err


def test_a_missing_command_is_named_without_tpuruns_wrapper(cli):
    r = cli("exec", "--worker", "0", "--", "nosuchcommand", "x")
    assert r.code == 1 and "[w0] cannot start nosuchcommand: command not found" in r.err, r.err
    assert "setsid" not in r.err and "sh:" not in r.err
    # a shell's command line given as one argument: every worker fails alike, said once, with the form that works
    r = cli("exec", "--worker", "0-2", "--", "ps -eo pid,args | grep x")
    assert r.code == 1
    assert "error: the command failed on every worker (w0, w1, w2) with exit code 127" in r.err, r.err
    assert "runs its command without a shell" in r.err and "tpurun exec -- bash -c 'ps -eo pid,args | grep x'" in r.err
    r = cli("exec", "--worker", "0-2", "--", "sh", "-c", 'case "$(hostname)" in *-w-0) exit 0;; esac; exit 3')
    assert "error: the command failed on 2 of 3 workers (w1, w2) with exit code 3" in r.err, r.err
    assert "hint" not in r.err


def test_worker_selection(cli):
    r = cli("exec", "--worker", "1-2,5", "--", "hostname")
    assert r.code == 0
    assert sorted(line.split()[0] for line in r.out.splitlines()) == ["[w1]", "[w2]", "[w5]"]
    assert_clean_error(cli("exec", "--worker", "9", "--", "true"), 2)
    assert_clean_error(cli("exec", "--worker", "x-", "--", "true"), 2)
    # train takes the same specs: one worker alone, or every worker; a part of the pod is refused in one line
    (cli.cwd / "x.py").write_text("print(1)\n")
    for spec, tags in (("5", ["w5"]), ("0-7", [f"w{i}" for i in range(8)]), ("all", [f"w{i}" for i in range(8)])):
        r = cli("train", "x.py", "--runtime", "cpu", "--launch", "host", "--worker", spec, "--dry-run", "--json")
        assert r.code == 0, r.err
        assert [p["name"] for p in json.loads(r.out)["processes"]] == tags
    r = cli("train", "x.py", "--runtime", "cpu", "--worker", "1-2", "--dry-run")
    assert_clean_error(r, 2)
    assert "--worker 1-2 selects 2 of 8 workers" in r.err
    assert_clean_error(cli("train", "x.py", "--runtime", "cpu", "--worker", "9", "--dry-run"), 2)


def test_fail_fast_stops_the_others(cli, emulator):
    t0 = time.monotonic()
    r = cli("exec", "--fail-fast", "--", "sh", "-c", 'case "$(hostname)" in *-w-2) sleep 0.5; exit 4;; esac; sleep 300')
    assert r.code == 1 and time.monotonic() - t0 < 60
    assert "w2" in r.err
    for w in range(8):
        assert job_pids(emulator, "pod8", "sleep 300", [w]) == []


def test_sigint_leaves_no_remote_process(cli, emulator):
    proc = popen(cli, "exec", "--", "sh", "-c", "echo started; sleep 1000")
    read_until(proc, lambda lines: sum("started" in line for line in lines) == 8)
    assert any(job_pids(emulator, POD, "sleep 1000", [w]) for w in range(8))
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    for w in range(8):
        assert job_pids(emulator, POD, "sleep 1000", [w]) == [], f"w{w} still runs it"


def test_client_killed_remote_group_dies(cli, emulator):
    proc = popen(cli, "exec", "--", "sh", "-c", "echo started; sleep 2000", stderr=None)
    lines = read_until(proc, lambda lines: len(lines) == 8)
    assert all("started" in line for line in lines)
    proc.kill()  # SIGKILL: no cleanup code runs on the client; the connection drop must do it
    proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if not any(job_pids(emulator, POD, "sleep 2000", [w]) for w in range(8)):
            break
        time.sleep(0.2)
    assert not any(job_pids(emulator, POD, "sleep 2000", [w]) for w in range(8))


def test_unreachable_worker_reported_others_finish(cli, emulator, shared_pod):
    emulator.kill_sshd(emulator.node_name(POD), 2)
    try:
        r = cli("exec", "--", "echo", "alive")
    finally:
        emulator.emu.hosts.restart_sshd(emulator.node_name(POD), 2)  # the pod as the other tests find it
    assert r.code == 4, (r.out, r.err)
    assert r.out.count("alive") == 7
    addr = shared_pod.node["workerEndpoints"][2]["internalIp"]
    assert "w2" in r.err and addr in r.err


def test_a_worker_runs_its_command_without_waiting_for_a_slow_handshake(cli, emulator):
    """w1 is 1 s of round trip away (its handshake takes about 4 of them): w0's command runs at once, not
    once w1 has proved who it is, and w1's still runs (its key checked as ever)."""
    from tpurun.testing.latency_proxy import ProxyGroup, address_map_env, proxy_workers

    info = emulator.node_info(emulator.node_name(POD))
    group = ProxyGroup().start()
    try:
        mapping = proxy_workers(group, [(w["address"], w["sshPort"]) for w in info["workers"]])
        cli.env["TPURUN_ADDRESS_MAP"] = address_map_env(mapping)
        group.proxies[1].set_rtt(1.0)
        r = cli("exec", "--", "python3", "-c", "import time; print(time.time())")
    finally:
        group.close()
        cli.env.pop("TPURUN_ADDRESS_MAP")
    assert r.code == 0, r.err
    started = {line.split()[0]: float(line.split()[1]) for line in r.out.splitlines()}
    # waiting for w1's handshake would start w0 at most about 1.5 round trips before w1
    assert started["[w1]"] - started["[w0]"] > 3.0, started


def test_lost_pins_come_back_from_the_api_never_from_the_host(cli, emulator, shared_pod):
    d = shared_pod.node
    cli.known_hosts.write_text("")  # this test's copy of the HOME that made the pod
    r = cli("exec", "--", "true")
    assert r.code == 0, r.err
    published = emulator.node_info(emulator.node_name(POD))["workers"]
    pinned = sorted(cli.known_hosts.read_text().splitlines())
    assert pinned == [f"tpu.{d['id']}-{i} {w['hostKey']}" for i, w in enumerate(published)]


def test_ssh_runs_one_command_exactly(cli):
    r = cli("ssh", "--worker", "1", "--", "printf", "%s|", "a b", "$HOME", "it's")
    assert r.code == 0, r.err
    assert r.out == "a b|$HOME|it's|"


def test_ssh_forwards_a_local_port_and_refuses_a_gone_tpu(own_cli, emulator):
    """`tpurun ssh -L` (ssh's own flag): the worker's sshd is reached through the forwarded local port. (A TPU of
    its own: it deletes it.)"""
    import socket

    cli = own_cli
    d = create_node(cli, "fwd", "v4-16")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = d["workerEndpoints"][1]["internalIp"]
    proc = popen(
        cli, "ssh", "--worker", "1", "-L", f"127.0.0.1:{port}:{target}:22",
        "--ssh-flag", "-o ExitOnForwardFailure=yes", "--", "sleep", "20",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        banner = b""
        while not banner.startswith(b"SSH-2.0-"):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                    banner = c.recv(64)
            except OSError:
                time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait()
    assert cli("delete", "fwd", "--yes").code == 0
    r = cli("ssh", "--tpu", "fwd", "--", "true")
    assert_clean_error(r, 3)
    assert "no TPU named 'fwd'" in r.err and "deleted by `tpurun delete`" in r.err


_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=0, max_size=40
)


# Each example is a CLI start (about a second): 10 of them carry as many strings, about 60, as 25 of up to 4 did
# (hypothesis makes lists of 6 on average when they may be that long).
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(args=st.lists(_text, min_size=1, max_size=20))
def test_arguments_arrive_exactly(cli, args):
    # each argument comes back as one JSON string: exact bytes, no shell re-splitting
    r = cli(
        "exec", "--worker", "0", "--", "python3", "-c", "import json,sys; print(json.dumps(sys.argv[1:]))", *args,
    )  # fmt: skip
    assert r.code == 0, r.err
    line = r.out.rstrip("\n")
    assert line.startswith("[w0] ")
    assert json.loads(line[len("[w0] ") :]) == args


def test_a_large_pod_is_summed_up_per_outcome_and_gathers_on_request(own_cli, emulator):
    """16 workers: one summary row per outcome with its folded workers, failures named; --by-worker gives a row
    each; --gather prints each distinct output once under its workers, and the set pastes back into --worker;
    the workers that cannot be reached beyond the first few are named once per reason. (A TPU of its own: it
    takes 12 workers down.)"""
    cli = own_cli
    create_node(cli, "pod16", "v4-128")  # 16 workers
    odd = 'case "$(hostname)" in *-w-5|*-w-11) echo odd; exit 3;; esac; echo same'
    r = cli("exec", "--", "sh", "-c", odd)
    assert r.code == 1
    assert sorted(line.split()[0] for line in r.out.splitlines()) == sorted(f"[w{i}]" for i in range(16))
    rows = [line.split() for line in r.err.splitlines()]
    assert rows[0] == ["RESULT", "WORKERS", "WHICH", "TIME"]
    assert rows[1][:4] == ["exit", "0", "14", "w[0-4,6-10,12-15]"] and rows[2][:4] == ["exit", "3", "2", "w[5,11]"]
    assert "error: the command failed on 2 of 16 workers (w5, w11) with exit code 3" in r.err
    assert len(r.err.splitlines()) == 4, r.err
    r = cli("exec", "--by-worker", "--", "sh", "-c", odd)
    assert r.code == 1 and [row.split()[0] for row in r.err.splitlines()[1:17]] == [f"w{i}" for i in range(16)]
    r = cli("exec", "--gather", "--", "sh", "-c", odd)
    assert r.code == 1
    assert r.out == (
        "---------------\nw[0-4,6-10,12-15] (14)\n---------------\nsame\n"
        "---------------\nw[5,11] (2)\n---------------\nodd\n"
    )
    r = cli("exec", "--worker", "w[5,11]", "-b", "--", "hostname")
    assert r.code == 0 and r.out.count("---------------\n") == 4, r.out  # two workers, two hostnames
    for w in range(12):
        emulator.kill_sshd(emulator.node_name("pod16"), w)
    r = cli("exec", "--", "true")
    assert r.code == 4
    errors = [line for line in r.err.splitlines() if line.startswith("error: ")]
    # as it comes, the reason once (the first worker's words); the others alike at the end, folded
    assert len(errors) == 2 and errors[0].startswith("error: cannot reach worker w0 "), r.err
    assert "cannot reach worker w1 " in errors[1] and errors[1].endswith("(and 10 more workers alike: w[2-11])"), r.err
    rows = [line.split()[:3] for line in r.err.splitlines()[2:4]]
    assert rows == [["unreachable", "12", "w[0-11]"], ["exit", "0", "4"]], r.err
