"""tpurun train on emulated workers: per-core prefixes and logs, fail-fast, Ctrl-C, detach/reattach,
preemption recovery, and the dry-run env through the CLI. The tests share one v4-16 (2 workers), but for the
one whose TPU is preempted and the one that changes a worker's Python, which make their own."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import textwrap
import time

import pytest

from tests.helpers import assert_clean_error, create_node, finish, job_pids, lines_by_core, popen, read_until
from tests.integration.conftest import one_pod_per_file
from tpurun.emulator.pytest_plugin import fast_polling

pytestmark = pytest.mark.integration

POD = "pair"  # the shared v4-16, the default TPU of each test's project directory
shared_pod, cli = one_pod_per_file(POD, "v4-16")

PRINTER = """\
import os, sys, time
w, c = os.environ["TPURUN_WORKER_ID"], os.environ["TPURUN_CORE"]
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    print(f"line {i} from w{w} c{c} rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']}", flush=True)
    if i % 2:
        print(f"stderr {i} from w{w} c{c}", file=sys.stderr, flush=True)
print("restart", os.environ["TPURUN_RESTART_COUNT"], flush=True)
"""


def test_every_core_streams_in_order_and_logs_match(cli, shared_pod):
    d = shared_pod.node
    (cli.cwd / "printer.py").write_text(PRINTER)
    r = cli("train", "printer.py", "7", "--runtime", "cpu", "--cores", "2", "--python", "python3")
    assert r.code == 0, r.err
    by_core = lines_by_core(r.out)
    assert sorted(by_core) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ranks = set()
    for (w, c), lines in by_core.items():
        stdout_lines = [line for line in lines if line.startswith("line ")]
        assert stdout_lines == [f"line {i} from w{w} c{c} rank {w * 2 + c}/4" for i in range(7)]
        assert [line for line in lines if line.startswith("stderr ")] == [
            f"stderr {i} from w{w} c{c}" for i in (1, 3, 5)
        ]
        ranks.add(w * 2 + c)
    assert ranks == {0, 1, 2, 3}
    job = re.search(r"job (\S+):", r.err).group(1)
    for w, ep in enumerate(d["workerEndpoints"]):
        for c in range(2):
            out = subprocess.run(
                cli.ssh(ep["internalIp"], f"cat ~/.tpurun/jobs/{job}/w{w}-c{c}.log"), capture_output=True, text=True
            )
            assert out.returncode == 0, out.stderr
            assert out.stdout.splitlines() == by_core[(w, c)]


def test_fail_fast_names_first_failure_and_cleans_every_worker(cli, emulator):
    (cli.cwd / "fail.py").write_text(
        "import os, sys, time\n"
        "w, c = os.environ['TPURUN_WORKER_ID'], os.environ['TPURUN_CORE']\n"
        "print('up', flush=True)\n"
        "if (w, c) == ('1', '1'):\n    time.sleep(1); print('dying now', flush=True); sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    t0 = time.monotonic()
    r = cli("train", "fail.py", "--runtime", "cpu", "--cores", "2", "--python", "python3")
    assert r.code == 1, (r.out, r.err)
    assert time.monotonic() - t0 < 60
    assert "w1/c1" in r.err and "exit code 3" in r.err and "dying now" in r.err
    assert job_pids(emulator, POD, "fail.py") == []


def test_sigint_stops_everything_then_exits_130(cli, emulator):
    (cli.cwd / "sleepy.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = popen(cli, "train", "sleepy.py", "--runtime", "cpu", "--cores", "2", "--python", "python3")
    read_until(proc, lambda lines: sum("up" in line for line in lines) >= 4)
    assert job_pids(emulator, POD, "sleepy.py")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    assert job_pids(emulator, POD, "sleepy.py") == []


def test_client_sigkill_stops_attached_job(cli, emulator):
    (cli.cwd / "sleepy.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = popen(
        cli, "train", "sleepy.py", "--runtime", "cpu", "--cores", "2", "--python", "python3", stderr=subprocess.DEVNULL
    )
    read_until(proc, lambda lines: sum("up" in line for line in lines) >= 4)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while job_pids(emulator, POD, "sleepy.py") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job_pids(emulator, POD, "sleepy.py") == []


def _detached(cli, source: str, cores: int) -> str:
    """SOURCE as slow.py, started detached on CORES cores of the default TPU: its job id."""
    (cli.cwd / "slow.py").write_text(source)
    r = cli("train", "slow.py", "--runtime", "cpu", "--cores", str(cores), "--python", "python3", "--detach")
    assert r.code == 0, r.err
    return r.out.strip().splitlines()[-1]


def test_detached_job_survives_and_logs_reattach_exactly_once(cli, emulator):
    job = _detached(
        cli, "import os, time\nfor i in range(30):\n    print(f'tick {i}', flush=True); time.sleep(0.1)\n", 2
    )
    # a follower that is SIGKILLed half-way does not stop a detached job
    proc = popen(cli, "logs", job, "--follow", stderr=None)
    read_until(proc, lambda lines: len(lines) == 1)
    proc.kill()
    proc.wait()
    r = cli("logs", job, "--follow", timeout=120)
    assert r.code == 0, r.err
    by_core = lines_by_core(r.out)
    assert sorted(by_core) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for lines in by_core.values():
        assert lines == [f"tick {i}" for i in range(30)]
    assert job in cli("jobs", "--json").out
    assert_clean_error(cli("logs", "no-such-job"), 2)


def test_second_train_on_same_node_refuses(cli):
    (cli.cwd / "sleepy.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    first = cli("train", "sleepy.py", "--runtime", "cpu", "--python", "python3", "--detach")
    assert first.code == 0, first.err
    job = first.out.strip().splitlines()[-1]
    (cli.cwd / "sleepy.py").write_text("print('changed')\n")
    r = cli("train", "sleepy.py", "--runtime", "cpu", "--python", "python3")
    assert_clean_error(r, 2)
    assert job in r.err and "cancel" in r.err and "nothing was started" in r.err, r.err
    assert r.err.count("job ") == 1 and r.out == ""  # no job id allocated, shown or recorded: the running one
    assert [row["job_id"] for row in json.loads(cli("jobs", "--json").out)] == [job]
    synced = cli("exec", "--worker", "0", "--", "cat", "project/sleepy.py")
    assert "time.sleep(600)" in synced.out, synced.out  # nothing synced under the running job
    assert cli("cancel", job).code == 0


def test_preemption_with_max_restarts_recreates_and_finishes(own_cli, emulator):
    cli = own_cli  # its TPU is preempted and made anew: one of its own
    r = cli("create", "pre", "-t", "v4-16", "--spot")
    assert r.code == 0, r.err
    (cli.cwd / "long.py").write_text(
        "import os, time\n"
        "n = os.environ['TPURUN_RESTART_COUNT']\n"
        "print('restart count', n, flush=True)\n"
        "time.sleep(600 if n == '0' else 0.1)\n"
        "print('finished', flush=True)\n"
    )
    proc = popen(
        cli, "train", "long.py", "--runtime", "cpu", "--launch", "host", "--python", "python3", "--max-restarts", "1"
    )
    read_until(proc, lambda lines: sum("restart count 0" in line for line in lines) >= 2)
    emulator.preempt(emulator.node_name("pre"))
    out, err = finish(proc, 240)
    assert proc.returncode == 0, err
    assert "restart 1/1" in err
    assert out.count("restart count 1") == 2 and out.count("finished") == 2
    # preempted before the job starts: refused without --max-restarts, recovered with it
    assert cli("exec", "--", "true").code == 0  # remembered, as a user's earlier command would leave it
    emulator.preempt(emulator.node_name("pre"))
    r = cli("train", "long.py", "--runtime", "cpu", "--launch", "host", "--python", "python3")
    assert_clean_error(r, 4)
    assert "pre (the default TPU here, from" in r.err and "was preempted" in r.err and "--max-restarts" in r.err
    r = cli("train", "long.py", "--runtime", "cpu", "--launch", "host", "--python", "python3", "--max-restarts", "1")
    assert r.code == 0, r.err
    assert "restart 1/1: recreating pre" in r.err and r.out.count("finished") == 2, (r.out, r.err)


@pytest.fixture(scope="module")
def dry_run_tpu(emulator):
    """A TPU of each type the dry-run test asks for, made through the API once for both runtimes (a dry run
    reaches no worker: it reads the TPU's description): its id and its workers' addresses."""
    from google.cloud import tpu_v2

    from tpurun.topology import default_runtime_version, parse_accelerator_type

    client, made = emulator.client(), {}

    def tpu(accel: str) -> tuple[str, list[str]]:
        if accel not in made:
            node = tpu_v2.Node(
                accelerator_type=accel,
                runtime_version=default_runtime_version(parse_accelerator_type(accel).generation),
                network_config=tpu_v2.NetworkConfig(enable_external_ips=True),
            )
            node_id = "dry-" + accel
            op = client.create_node(parent=emulator.parent, node_id=node_id, node=node)
            made[accel] = (node_id, [ep.ip_address for ep in op.result(polling=fast_polling()).network_endpoints])
        return made[accel]

    yield tpu
    for op in [client.delete_node(name=emulator.node_name(node_id)) for node_id, _ in made.values()]:
        op.result(polling=fast_polling())


@pytest.mark.parametrize("accel", ["v2-8", "v3-32", "v4-32", "v5litepod-16", "v6e-8"])
@pytest.mark.parametrize("runtime", ["pjrt", "xrt"])
def test_dry_run_env_matches_the_contract(cli, dry_run_tpu, accel, runtime):
    from tpurun.job.env_contract import plan_job
    from tpurun.topology import parse_accelerator_type

    node_id, addresses = dry_run_tpu(accel)
    (cli.cwd / "train.py").write_text("print('x')\n")
    r = cli("train", "train.py", "--tpu", node_id, "--runtime", runtime, "--dry-run", "--json")
    if runtime == "xrt" and accel.startswith(("v5litepod", "v6e")):
        assert_clean_error(r, 2)  # XRT never ran on these generations: a clear refusal, not a wrong env
        assert "use --runtime pjrt" in r.err
        return
    assert r.code == 0, r.err
    got = json.loads(r.out)
    want = plan_job(
        job_id=got["job_id"], topology=parse_accelerator_type(accel), runtime=runtime, launch="host",
        worker_addresses=addresses, cores=None, core=None, script="train.py", args=[], python="python3",
    )  # fmt: skip
    assert got["launch"] == "host"  # the default on TPUs
    flat = [c for per in want for c in per]
    assert len(got["processes"]) == len(flat) == len(addresses)
    for row, spec in zip(got["processes"], flat, strict=True):
        assert (row["worker"], row["core"]) == (spec.worker, None)
        env = dict(row["env"])  # and each process's profiler server's first port (train --profile, the default)
        assert env.pop("TPURUN_PROFILE_PORT") == "9431"
        assert env == spec.env
        assert row["command"] == spec.argv
    env0 = got["processes"][0]["env"]
    if runtime == "pjrt":
        assert env0["PJRT_DEVICE"] == "TPU" and env0["TPURUN_LAUNCH"] == "host"
    else:
        assert "XRT_TPU_CONFIG" in env0 or "XRT_LOCAL_WORKER" in env0


def test_bad_train_input(cli):
    (cli.cwd / "ok.py").write_text("print(1)\n")
    for args, needle in [
        (["missing.py"], "no such script"),
        (["ok.py", "--cores", "0"], "--cores"),
        (["ok.py", "--core", "-1"], "--core"),
        (["ok.py", "--runtime", "gpu"], "--runtime"),
        (["ok.py", "--precision", "16"], "--precision"),
        (["ok.py", "--env", "=x"], "--env"),
        (["ok.py", "--env", "NOEQUALS"], "--env"),
        (["ok.py", "--cores", "2", "--core", "1"], "one of --cores and --core"),
        (["ok.py", "--launch", "rank"], "--launch"),
        (["ok.py", "--launch", "host", "--runtime", "cpu", "--cores", "2", "--local"], "--launch chip"),
    ]:
        r = cli("train", *args)
        assert_clean_error(r, 2)
        assert needle in r.err, (args, r.err)


def test_ctrl_c_on_logs_follow_stops_the_viewer_at_once_and_leaves_the_job(cli, emulator):
    job = _detached(cli, "import time\nfor i in range(600):\n    print('tick', i, flush=True); time.sleep(0.1)\n", 1)
    proc = popen(cli, "logs", job, "--follow")
    (first,) = read_until(proc, lambda lines: len(lines) == 1)
    assert "tick" in first
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    assert time.monotonic() - t0 < 5
    assert job_pids(emulator, POD, "slow.py")  # the job itself goes on
    assert cli("cancel", job).code == 0


LATE = """\
import os, sys, time
w = os.environ["TPURUN_WORKER_ID"]
print("up", flush=True)
time.sleep(0.5 if w == "1" else 2.5)  # worker 1 fails first; worker 0 on its own a little later
sys.exit(3 if w == "1" else 5)
"""


def test_logs_follow_ends_as_the_job_did_naming_the_first_failure_as_jobs_and_train_do(cli):
    """The documented reattach (`train --detach`, then `logs --follow`) exits with the job's result, as train
    would have; logs, jobs and train name the same process as the first failure, the one that failed first
    whichever worker comes first in order."""
    (cli.cwd / "late.py").write_text(LATE)
    (cli.cwd / "sleepy.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")

    def detached(script: str) -> str:
        r = cli("train", script, "--runtime", "cpu", "--launch", "host", "--detach")
        assert r.code == 0, r.err
        return r.out.strip().splitlines()[-1]

    def detail(job: str) -> str:
        return next(j["detail"] for j in json.loads(cli("jobs", "--json").out) if j["job_id"] == job)

    job = detached("late.py")
    r = cli("logs", job, "--follow")
    assert r.code == 1, (r.out[-500:], r.err[-500:])
    assert f"job {job} failed: w1: exit code 3 failed first" in r.err, r.err
    assert detail(job) == "w1: exit code 3"
    # replayed without --follow: the lines, and nothing said of the end
    assert cli("logs", job).code == 0

    r = cli("train", "late.py", "--runtime", "cpu", "--launch", "host")
    assert r.code == 1 and "w1 (" in r.err and "failed first (exit code 3)" in r.err, r.err[-800:]
    attached = re.search(r"job (\S+):", r.err).group(1)
    assert detail(attached) == "w1: exit code 3"

    job = detached("sleepy.py")
    assert cli("cancel", job).code == 0
    r = cli("logs", job, "--follow")
    assert r.code == 130 and f"job {job} ended (stopped): stopped by the user" in r.err, r.err

    (cli.cwd / "fine.py").write_text("print('fine', flush=True)\n")
    job = detached("fine.py")
    r = cli("logs", job, "--follow")
    assert r.code == 0 and "[w1] fine" in r.out, (r.out, r.err)


def test_logs_replays_every_worker_in_time_order(cli):
    # the workers take turns over a socket (w0 listens at MASTER_ADDR), 0.1 s apart: the true order of their
    # lines, whatever the skew between the two processes' starts
    (cli.cwd / "turns.py").write_text(
        textwrap.dedent(
            """\
            import os, socket, time
            w = int(os.environ["TPURUN_WORKER_ID"])
            addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            if w == 0:
                peer = socket.create_server(addr).accept()[0]
            else:
                for _ in range(300):
                    try:
                        peer = socket.create_connection(addr)
                        break
                    except OSError:
                        time.sleep(0.1)
            for i in range(5):
                if w == 1:
                    peer.recv(1)
                print("turn", i, "w", w, flush=True)
                time.sleep(0.1)
                peer.sendall(b".")
                if w == 0:
                    peer.recv(1)
            """
        )
    )
    r = cli("train", "turns.py", "--runtime", "cpu", "--cores", "1", "--python", "python3")
    assert r.code == 0, r.err
    job = re.search(r"job (\S+):", r.err).group(1)
    out = cli("logs", job).out
    turns = [line.split("] ", 1)[1] for line in out.splitlines() if "] turn " in line]
    assert turns == [f"turn {i} w {w}" for i in range(5) for w in (0, 1)], turns
    # one worker, the last lines of each process (then --follow: the job has ended, nothing more)
    for follow in ([], ["--follow"]):
        r = cli("logs", job, "--worker", "1", "--tail", "2", *follow)
        assert r.code == 0, r.err
        assert [line for line in r.out.splitlines() if "turn" in line] == ["[w1/c0] turn 3 w 1", "[w1/c0] turn 4 w 1"]
    assert_clean_error(cli("logs", job, "--tail", "-1"), 2)
    assert_clean_error(cli("logs", job, "--worker", "5"), 2)


def test_processes_meet_at_internal_addresses_whatever_tpurun_connects_to(cli, shared_pod):
    """tpurun may reach workers through other addresses (external IPs, a proxy); the processes reach
    each other inside the VPC, so MASTER_ADDR and the runtime's addresses are the internal ones."""
    d = shared_pod.node
    internal = [w["internalIp"] for w in d["workerEndpoints"]]
    cli.env["TPURUN_ADDRESS_MAP"] = json.dumps({a: f"127.0.0.1:{2200 + i}" for i, a in enumerate(internal)})
    (cli.cwd / "t.py").write_text("print(1)\n")
    r = cli("train", "t.py", "--runtime", "cpu", "--cores", "1", "--dry-run", "--json")
    assert r.code == 0, r.err
    rows = json.loads(r.out)["processes"]
    assert [p["address"] for p in rows] == ["127.0.0.1", "127.0.0.1"]  # where tpurun connects
    assert {p["env"]["MASTER_ADDR"] for p in rows} == {internal[0]}
    assert {p["env"]["JAX_COORDINATOR_ADDRESS"] for p in rows} == {f"{internal[0]}:8482"}


def test_a_package_differing_on_one_worker_is_refused_with_its_table(own_cli):
    """Worker 1's jax metadata says 0.0.1 (renamed in that worker's own copy of the image's Python, as a
    different install would leave it): the start is refused with the table of who differs, nothing started
    or recorded; --allow-skew starts it with a warning. (A TPU of its own: its worker's Python is changed.)"""
    cli = own_cli
    d = create_node(cli, "skew")
    w1 = d["workerEndpoints"][1]["internalIp"]
    purelib = "python3 -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'"
    plant = f'cd "$({purelib})" && mv jax-*.dist-info jax-0.0.1.dist-info'
    r = subprocess.run(cli.ssh(w1, plant), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (cli.cwd / "printer.py").write_text(PRINTER)
    train = ("--plain", "train", "printer.py", "1", "--runtime", "cpu", "--cores", "1", "--python", "python3")
    r = cli(*train)
    assert r.code == 2, (r.out, r.err)
    assert_clean_error(r)
    assert "the workers of skew differ: jax 0.0.1 on w1 (" in r.err and "nothing was started" in r.err
    rows = [line.split() for line in r.out.splitlines()]
    assert ["WHAT", "VERSION", "WORKERS"] in rows
    jax_at = next(i for i, row in enumerate(rows) if row and row[0] == "jax")
    assert rows[jax_at + 1] == ["0.0.1", "w1"] and rows[jax_at][2:] == ["w0"]
    assert not lines_by_core(r.out) and json.loads(cli("jobs", "--tpu", "skew", "--json").out) == []
    for ep in d["workerEndpoints"]:
        listed = subprocess.run(
            cli.ssh(ep["internalIp"], "ls ~/.tpurun/jobs 2>/dev/null | wc -l"), capture_output=True, text=True
        )
        assert listed.stdout.strip() == "0", listed
    r = cli(*train, "--allow-skew")
    assert r.code == 0, r.err
    assert "starting anyway (--allow-skew): the workers differ: jax 0.0.1 on w1" in r.err
    assert sorted(lines_by_core(r.out)) == [(0, 0), (1, 0)]
