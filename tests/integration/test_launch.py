"""The TPU process model, checked with the ecosystem's own code on emulated TPU VMs.

Real torch_xla 2.9 and Lightning run users' unmodified scripts under `tpurun train` (host launch, the
default) with PJRT_DEVICE=TPU on emulated v3-8, v4-16, v5litepod-16 and v6e-8 nodes, whose workers look
like TPU VMs to them (PCI chips, tpu-env metadata: docs/emulator.md); on v5litepod-16, torch_xla's own topology
code is run for each chip in one process per host instead of one process per chip. With no libtpu here, a test-only
module (launch_scripts/tpu_stop) stops each process where torch_xla starts the TPU client and prints
what it was given; everything before that is torch_xla's, Lightning's and the script's own doing.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import create_node, finish, job_pids, popen, read_until
from tpurun.topology import parse_accelerator_type

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

SCRIPTS = Path(__file__).with_name("launch_scripts")
REPORT = re.compile(r"^\[w(\d+)(?:/c(\d+))?\] TPU-START (\{.*\})$")


def parse_reports(lines: list[str]) -> list[tuple[int, int | None, dict]]:
    """(worker, chip or None for a host process's own line, report) of every TPU-START line among LINES."""
    found = []
    for m in map(REPORT.match, lines):
        if m:
            found.append((int(m.group(1)), None if m.group(2) is None else int(m.group(2)), json.loads(m.group(3))))
    return found


class Run:
    """`tpurun train ...` in the background; its stdout lines as they come."""

    def __init__(self, cli, *args: str) -> None:
        self.proc = popen(cli, "train", *args)
        self.lines: list[str] = []
        self.err = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def reports(self) -> list[tuple[int, int | None, dict]]:
        return parse_reports(list(self.lines))

    def wait_reports(self, n: int, timeout: float = 300) -> list[tuple[int, int | None, dict]]:
        deadline = time.monotonic() + timeout
        while len(self.reports()) < n and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # a surplus replica (oversubscription) would report now
        return self.reports()

    def interrupt(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        _, self.err = self.proc.communicate(timeout=120)
        return self.proc.returncode

    def context(self) -> str:
        return "\n".join(self.lines[-40:]) + "\n--- stderr\n" + (self.err or "")[-3000:]


FLOOD = re.compile(r"^\[w(\d+)(?:/c(\d+))?\] (.*)$")
FLOOD_LINE = re.compile(
    r"(IMPORT(?:-ERR)? (?:HOST|CHILD)|(?:RUN(?:-ERR)?|FLOOD-DONE) rank=(\d+)|RANK (\d+)) pid=(\d+)(.*)"
)


def check_flood(text: str, workers: int, ranks: int, task: bool = True, lines: int = 300) -> None:
    """Every line print_flood.py's processes printed (in TEXT, tpurun's output) came once, whole and in its
    process's order, tagged with its process's own chip ([wN/cM], M its rank; [wN] for the host process's),
    including those a child printed at import, before its rank was known: none lost, doubled, mangled or
    misattributed. TASK: the children ran the task (else each stopped at its device's start, where
    tpu_stop reports its pid and chip)."""
    pad = " " + "x" * 160
    got: dict[tuple[int, int], list[tuple[int | None, str]]] = {}  # (worker, pid) -> (chip, text) in order
    for line in text.splitlines():
        tag = FLOOD.match(line)
        if "pid=" not in line or not any(word in line for word in ("IMPORT", "RUN", "RANK", "FLOOD-DONE")):
            continue  # a line of torch's, torch_xla's or tpurun's
        assert tag, f"an untagged line: {line[:300]!r}"
        m = FLOOD_LINE.fullmatch(tag.group(3))
        assert m, f"a mangled line: {line[:300]!r}"
        chip = None if tag.group(2) is None else int(tag.group(2))
        got.setdefault((int(tag.group(1)), int(m.group(4))), []).append((chip, tag.group(3)))
    started = {(w, r["pid"]): (c, r["chips"]) for w, c, r in parse_reports(text.splitlines())}
    hosts = {k: v for k, v in got.items() if " HOST pid=" in v[0][1]}
    assert sorted(w for w, _ in hosts) == list(range(workers)), sorted(hosts)
    children = {k: v for k, v in got.items() if k not in hosts}
    assert len(children) == workers * ranks, sorted(children)
    kinds = [("IMPORT", "IMPORT {} pid={}")] + ([("RUN", "RUN rank={} pid={}")] if task else [])
    per_worker: dict[int, set[int]] = {}
    for (w, pid), seen in got.items():
        texts, host = [t for _, t in seen], (w, pid) in hosts
        if host:
            rank = None
        elif task:
            said = [int(t.split()[1]) for t in texts if t.startswith("RANK ")]
            assert len(said) == 1, f"w{w} pid {pid}: {len(seen)} lines, tags {sorted({str(c) for c, _ in seen})}"
            rank = said[0]
            assert texts.count(f"FLOOD-DONE rank={rank} pid={pid}") == 1
        else:
            rank, chips = started[(w, pid)]
            assert chips == [rank], f"w{w} pid {pid}: chips {chips}, its report tagged c{rank}"
        assert {c for c, _ in seen} == {rank}, f"w{w} pid {pid} ({rank}) tagged {sorted({str(c) for c, _ in seen})}"
        if not host:
            per_worker.setdefault(w, set()).add(rank)  # type: ignore[arg-type]
        for kind, name in kinds[:1] if host else kinds:
            name = name.format("HOST" if host else "CHILD", pid) if kind == "IMPORT" else name.format(rank, pid)
            want = [f"{name} line={i}{pad}" for i in range(lines)]
            assert [t for t in texts if t.startswith(kind + " ")] == want, f"w{w} pid {pid}: {kind} lines"
            err = [x.replace(kind, kind + "-ERR", 1) for x in want[::10]]
            assert [t for t in texts if t.startswith(kind + "-ERR")] == err, f"w{w} pid {pid}: {kind}-ERR lines"
    assert per_worker == {w: set(range(ranks)) for w in range(workers)}, per_worker


def _project(cli) -> None:
    for p in SCRIPTS.iterdir():
        if p.is_dir():
            shutil.copytree(p, cli.cwd / p.name, dirs_exist_ok=True)
        else:
            shutil.copy(p, cli.cwd / p.name)


def _train(cli, script: str, *extra: str) -> Run:
    return Run(cli, script, "--runtime", "pjrt", "--python", sys.executable, "--env", "PYTHONPATH=tpu_stop", *extra)


def _python_left(emulator, node: str) -> list[str]:
    """Command lines of this Python's processes on the node's workers, but for each worker's init and the
    TPU's watchdog (the VM's own, started at boot: not the job's)."""
    found = []
    for pid in job_pids(emulator, node, sys.executable):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "_worker_init.py" not in cmd and "watchdog.py run" not in cmd:
            found.append(cmd)
    return found


def _no_python_left(emulator, node: str) -> None:
    """Nothing the job started survives tpurun's exit (checked at once: tpurun returns after the agents)."""
    assert _python_left(emulator, node) == []


def _check_one_replica_per_chip(reports, topo, addresses: list[str], what: str) -> None:
    assert len(reports) == topo.chips, f"{what}: {len(reports)} replicas for {topo.chips} chips"
    tasks = set()
    for w in range(topo.hosts):
        mine = [(c, r) for wr, c, r in reports if wr == w]
        assert len(mine) == topo.chips_per_host, what
        assert {r["env"]["TPU_VISIBLE_CHIPS"] for _, r in mine} == {str(i) for i in range(topo.chips_per_host)}, what
        assert len({r["env"]["TPU_PROCESS_PORT"] for _, r in mine}) == topo.chips_per_host, what
        for c, r in mine:
            assert c == int(r["env"]["TPU_VISIBLE_CHIPS"]), f"{what}: chip {r['env']['TPU_VISIBLE_CHIPS']} tagged c{c}"
            assert r["env"]["TPURUN_CORE"] == str(c) and r["env"]["TPURUN_WORKER_ID"] == str(w), what
            assert r["worker_id"] == w and r["chips"] == [c], what
            hosts_named = {a.rsplit(":", 1)[0] for a in r["env"]["TPU_PROCESS_ADDRESSES"].split(",")}
            assert hosts_named == (set(addresses) if topo.multi_host else {"localhost"}), what
            tasks.add(int(r["env"]["CLOUD_TPU_TASK_ID"]))
    assert tasks == set(range(topo.chips)), what


# xmp.spawn's code (torch_xla.launch, outside torchrun, and Lightning make the chip processes through it):
# xmp_spawn.py with two TensorCores per chip (v3) and across two hosts (v4), launch.py on one host of eight
# chips (v6e), Lightning across two hosts (v4; on v6e it took the same branches with other numbers: its device
# count is torch_xla's chips times one device per chip from v4 on, which launch.py's run checks there too). On
# v5e's four hosts, torch_xla's own topology code run for each chip by one process per host (chip_env.py: the
# 16 chip processes cost a minute of a 2-core machine, and their spawning and filing are those of the other
# generations). Every script on every generation cost minutes more of the suite without reaching a path these
# do not. SPMD (one process per host driving all of its chips) on two TensorCores per chip, on two hosts and on
# eight chips; v5e's four hosts add only four more processes of the same path.
XMP, LAUNCH, LIGHTNING, CHIP_ENV, SPMD = "xmp_spawn.py", "launch.py", "lightning_tpu.py", "chip_env.py", "spmd.py"


@pytest.mark.parametrize(
    ("accel", "scripts"),
    [
        ("v3-8", (XMP, SPMD)),
        ("v4-16", (XMP, LIGHTNING, SPMD)),
        ("v5litepod-16", (CHIP_ENV,)),
        ("v6e-8", (LAUNCH, SPMD)),
    ],
)
def test_unmodified_scripts_make_one_replica_per_chip(cli, emulator, accel, scripts):
    topo = parse_accelerator_type(accel)
    name = "l" + accel.replace("-", "")[:8]
    d = create_node(cli, name, accel)
    addresses = [ep["internalIp"] for ep in d["workerEndpoints"]]
    _project(cli)
    for script in scripts:
        if script == CHIP_ENV:
            _check_chip_env(cli, topo, addresses)
            continue
        if script == SPMD:
            _check_spmd(cli, emulator, name, topo)
            continue
        run = _train(cli, script)
        reports = run.wait_reports(topo.chips)
        code = run.interrupt()
        _check_one_replica_per_chip(reports, topo, addresses, f"{script} on {accel}\n{run.context()}")
        assert code == 130, run.context()
        _no_python_left(emulator, name)


def _check_spmd(cli, emulator, name: str, topo) -> None:
    """SPMD: one process per host drives all of its chips."""
    run = _train(cli, SPMD)
    reports = run.wait_reports(topo.hosts)
    code = run.interrupt()
    what = f"{SPMD} on {topo.name}\n{run.context()}"
    assert sorted(w for w, _, _ in reports) == list(range(topo.hosts)), what
    for w, c, r in reports:
        assert c is None, what  # the host process's own lines: [wN]
        assert r["env"]["TPU_VISIBLE_CHIPS"] is None and r["chips"] == list(range(topo.chips_per_host)), what
        assert r["worker_id"] == w and r["env"]["XLA_USE_SPMD"] == "1", what
    assert code == 130, run.context()
    _no_python_left(emulator, name)


# (tagged [wN/cM] once configure_topology gave the process a chip's variables: the hook files it under that chip)
CHIP_ENV_LINE = re.compile(r"^\[w(\d+)(?:/c\d+)?\] CHIP-ENV (\{.*\})$")


def _check_chip_env(cli, topo, addresses: list[str]) -> None:
    """What torch_xla's spawner gives each chip process of every host under a host launch (chip_env.py runs its
    topology code for each), as _check_one_replica_per_chip asks of the processes themselves, and the same as
    tpurun's own chip launch gives them."""
    r = cli("train", CHIP_ENV, "--runtime", "pjrt", "--python", sys.executable, timeout=300)
    assert r.code == 0, r.err[-3000:]
    seen = [(int(m.group(1)), json.loads(m.group(2))) for m in map(CHIP_ENV_LINE.match, r.out.splitlines()) if m]
    what = f"{CHIP_ENV} on {topo.name}\n{r.out[-3000:]}"
    assert len(seen) == topo.chips, what
    plan = json.loads(cli("train", CHIP_ENV, "--runtime", "pjrt", "--launch", "chip", "--dry-run", "--json").out)
    chip_launch = {p["name"]: p["env"] for p in plan["processes"]}
    tasks = set()
    for w in range(topo.hosts):
        mine = [rep for wr, rep in seen if wr == w]
        assert sorted(rep["rank"] for rep in mine) == list(range(topo.chips_per_host)), what
        assert {rep["local"] for rep in mine} == {topo.chips_per_host}, what
        assert len({rep["env"]["TPU_PROCESS_PORT"] for rep in mine}) == topo.chips_per_host, what
        for rep in mine:
            env, c = rep["env"], rep["rank"]
            assert env["TPU_VISIBLE_CHIPS"] == str(c) and rep["worker_id"] == w, what
            hosts_named = {a.rsplit(":", 1)[0] for a in env["TPU_PROCESS_ADDRESSES"].split(",")}
            assert hosts_named == set(addresses) == set(rep["worker_ips"]), what
            tasks.add(int(env["CLOUD_TPU_TASK_ID"]))
            mine_planned = chip_launch[f"w{w}/c{c}"]
            assert {k: mine_planned.get(k) for k in env} == env, (w, c, env, mine_planned)
    assert tasks == set(range(topo.chips)), what


def test_one_chip_and_chip_launch_on_single_hosts(cli, emulator):
    """--core K / --cores 1 restrict what xmp.spawn sees to one chip; --launch chip keeps torchrun-style."""
    name = "onechip"
    create_node(cli, name, "v3-8")
    _project(cli)
    for extra, chip in ((("--core", "5"), 2), (("--cores", "1"), 0)):
        run = _train(cli, "xmp_spawn.py", *extra)
        reports = run.wait_reports(1)
        code = run.interrupt()
        assert [(w, c, r["env"]["TPU_VISIBLE_CHIPS"]) for w, c, r in reports] == [(0, chip, str(chip))], run.context()
        assert reports[0][2]["env"]["TPU_PROCESS_BOUNDS"] == "1,1,1" and code == 130, run.context()
        _no_python_left(emulator, name)
    run = _train(cli, "torchrun_style.py", "--launch", "chip")
    reports = run.wait_reports(4)
    code = run.interrupt()
    assert sorted((c, r["env"]["TPU_VISIBLE_CHIPS"], r["env"]["RANK"]) for _, c, r in reports) == [
        (i, str(i), str(i)) for i in range(4)
    ], run.context()
    assert code == 130
    _no_python_left(emulator, name)
    # whole lines, each tagged with its own process's chip, from every process of a spawner, also those its
    # children print at import (before any knows its rank): torch.multiprocessing.spawn's, then xmp.spawn's
    # (torch_xla starts each child's device before its task runs: there tpu_stop names the child's chip)
    r = cli("train", "print_flood.py", "--runtime", "pjrt", "--python", sys.executable,
            "--env", "FLOOD_SPAWNER=torch", "--env", "FLOOD_PROCS=4", timeout=300)  # fmt: skip
    assert r.code == 0, r.err[-3000:]
    check_flood(r.out, workers=1, ranks=4)
    run = _train(cli, "print_flood.py", "--env", "FLOOD_SPAWNER=xmp")
    run.wait_reports(4)
    code = run.interrupt()
    check_flood("\n".join(run.lines), workers=1, ranks=4, task=False)
    assert code == 130, run.context()
    _no_python_left(emulator, name)


def test_guarantees_hold_for_spawned_chip_processes(cli, emulator):
    """Fail-fast naming the chip, detach and logs, kill-stale, cancel and a lost client, for the
    processes xmp.spawn makes (grandchildren of tpurun's agent)."""
    name = "guard"
    create_node(cli, name, "v3-8")
    _project(cli)
    # fail-fast: chip 2 fails at device start-up; its siblings are stopped at once, it is named
    t0 = time.monotonic()
    r = cli("train", "xmp_spawn.py", "--runtime", "pjrt", "--python", sys.executable,
            "--env", "PYTHONPATH=tpu_stop", "--env", "TPU_STOP_BUSY=2", timeout=300)  # fmt: skip
    assert r.code == 1, r.err
    assert time.monotonic() - t0 < 120
    assert "w0/c2" in r.err and "failed first" in r.err and "TPU is already in use" in r.err, r.err
    assert "kill-stale" in r.err  # the hint
    _no_python_left(emulator, name)

    # detach; `logs` shows every chip's lines under [w0/cM] and the host's under [w0]
    r = cli("train", "xmp_spawn.py", "--runtime", "pjrt", "--python", sys.executable,
            "--env", "PYTHONPATH=tpu_stop", "--detach")  # fmt: skip
    assert r.code == 0, r.err
    job = r.out.strip().splitlines()[-1]
    follow = popen(cli, "logs", job, "--follow")
    try:
        lines = read_until(follow, lambda ls: len([ln for ln in ls if REPORT.match(ln)]) == 4, timeout=120)
        tags = sorted(m.group(2) for m in map(REPORT.match, lines) if m)
        assert tags == ["0", "1", "2", "3"], lines
        # kill-stale frees the chips the spawned processes hold; the job then ends by itself, and its follow with it
        r = cli("kill-stale", "--grace", "1")
        assert r.code == 0, r.err
        finish(follow, timeout=60)
    finally:
        follow.kill()
    deadline = time.monotonic() + 60
    while _python_left(emulator, name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _python_left(emulator, name) == []

    # cancel stops a detached job's spawned process (one chip's: xmp.spawn makes one for --cores 1)
    r = cli("train", "xmp_spawn.py", "--runtime", "pjrt", "--python", sys.executable,
            "--env", "PYTHONPATH=tpu_stop", "--cores", "1", "--detach")  # fmt: skip
    job = r.out.strip().splitlines()[-1]
    follow = popen(cli, "logs", job, "--follow")
    try:
        read_until(follow, lambda ls: any("TPU-START" in ln for ln in ls), timeout=120)
        assert cli("cancel", job).code == 0
        finish(follow, timeout=60)
    finally:
        follow.kill()
    _no_python_left(emulator, name)

    # the attached client killed outright: the agent stops the job on its own
    run = _train(cli, "xmp_spawn.py")
    run.wait_reports(4)
    run.proc.kill()
    run.proc.wait()
    deadline = time.monotonic() + 90
    while _python_left(emulator, name) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _python_left(emulator, name) == []
