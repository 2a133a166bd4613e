#!/usr/bin/env python3
"""What a running job costs each worker, process by process: tpurun's (relay, agent, supervisor), OpenSSH's (the
sshd of each connection, a relay's `ssh` to its children) and the job's own script, relayed and direct.

Makes one node of WORKERS workers (through the Cloud TPU API, adopted with `tpurun attach`: no watchdog), starts
`tpurun train hold.py --cores 1` (every process prints a line, then sleeps), and once every process has printed
reads every process of the node's workers (their pid namespaces) from /proc: its role (by its command line), its
RSS, PSS and USS (`smaps_rollup`: what it alone holds) and the CPU it used so far; then Ctrl-C. Prints, per
role, how many per worker and what each costs, and the sum per worker.

    sudo .venv/bin/python scripts/bench/worker_cost_bench.py [--workers 8] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402
import relay_bench  # noqa: E402

HOLD = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"
ROLES = ("relay", "zygote", "agent", "supervisor", "script", "sshd", "ssh", "other")
TICK = os.sysconf("SC_CLK_TCK")


def role(pid: int, argv: list[str]) -> str:
    """What PID is to the job, by its name where tpurun gave it one (a relay's zygote, what it forked, a job's
    supervisor: they keep the command line of the process they were forked from), else by its command line."""
    line = " ".join(argv)
    name = os.path.basename(argv[0]) if argv else ""
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        comm = ""
    if comm == "tpurun-zygote":
        return "zygote"
    if comm == "tpurun-job":
        return "supervisor"
    if comm == "tpurun-agent":
        line = "agent.py"
    if name == "ssh":  # a relay's link to a child (its command line holds the child's relay command)
        return "ssh"
    if name in ("sh", "bash"):
        return "other"
    if "hold.py" in line:
        return "script"
    if "relay.py" in line:
        return "relay"
    if "agent.py" in line:
        try:
            daemon = os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"  # the supervisor detached from the channel
        except OSError:
            daemon = False
        return "supervisor" if daemon else "agent"
    if name.startswith("sshd") or line.startswith("sshd"):
        return "sshd"
    return "other"


def cost(pid: int) -> dict[str, float] | None:
    """PID's RSS, PSS and USS (MiB) and CPU so far (s); None where it is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    kb = {}
    for line in rollup.splitlines()[1:]:
        k, _, v = line.partition(":")
        kb[k.strip()] = float(v.split()[0]) if v.split() else 0.0
    fields = stat[stat.rfind(")") + 2 :].split()
    return {
        "rss": kb.get("Rss", 0) / 1024,
        "pss": kb.get("Pss", 0) / 1024,
        "uss": (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) / 1024,
        "cpu": (int(fields[11]) + int(fields[12])) / TICK,
    }


def snapshot(bench: common.Bench, node: common.Node) -> list[dict[str, Any]]:
    """Every process of NODE's workers, with its role and cost."""
    from tpurun.emulator import procs

    hosts = bench.server.emu.hosts
    key = f"projects/{common.PROJECT}/locations/{common.ZONE}/nodes/{node.name}"
    inits = {hosts._worker(key, i).init_pid for i in range(len(node.workers))}
    nss = {hosts._worker(key, i).pid_ns for i in range(len(node.workers))} - {None}
    out = []
    for pid in procs.all_pids():
        if pid in inits or procs.ns(pid) not in nss:
            continue
        argv = procs.cmdline(pid).split()
        c = cost(pid)
        if c is not None:
            out.append({"pid": pid, "role": role(pid, argv), **c})
    return out


def measure(bench: common.Bench, node: common.Node, jobs: Path, relay: str, settle: float) -> dict[str, Any]:
    env = dict(bench.env, TPURUN_RELAY=relay)
    argv = [*common.tpurun_bin(), "--plain", "train", "hold.py", "--tpu", node.name, "--runtime", "cpu",
            "--cores", "1", "--python", common.WORKER_PYTHON, "--grace", "2"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, cwd=jobs, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    up = 0
    while up < len(node.workers):
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"train ended before every process started (exit {proc.wait()})")
        up += line.rstrip().endswith("up")
    time.sleep(settle)  # a job that runs: every reader past its first poll, its start's helpers gone
    procs_ = snapshot(bench, node)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    n = len(node.workers)
    roles: dict[str, Any] = {}
    for r in ROLES:
        mine = [p for p in procs_ if p["role"] == r]
        if mine:
            roles[r] = {
                "per_worker": len(mine) / n,
                **{k: statistics.mean(p[k] for p in mine) for k in ("rss", "pss", "uss")},
                "cpu_ms": 1000 * statistics.mean(p["cpu"] for p in mine),
            }
    tpurun = [p for p in procs_ if p["role"] in ("relay", "zygote", "agent", "supervisor")]
    return {
        "roles": roles,
        "per_worker": {k: sum(p[k] for p in procs_) / n for k in ("pss", "uss")},
        "tpurun_per_worker": {k: sum(p[k] for p in tpurun) / n for k in ("pss", "uss")},
        "tpurun_cpu_ms_per_worker": 1000 * sum(p["cpu"] for p in tpurun) / n,
    }


def table(res: dict[str, Any]) -> str:
    lines = [
        "| path | process | per worker | RSS (MiB) | PSS (MiB) | USS (MiB) | CPU so far (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in res["modes"].items():
        for r, v in m["roles"].items():
            lines.append(f"| {mode} | {r} | {v['per_worker']:.2f} | {v['rss']:.1f} | {v['pss']:.1f} | {v['uss']:.1f} "
                         f"| {v['cpu_ms']:.0f} |")  # fmt: skip
        pw, tp = m["per_worker"], m["tpurun_per_worker"]
        lines.append(f"| {mode} | **all, per worker** | | | {pw['pss']:.1f} | {pw['uss']:.1f} | |")
        lines.append(f"| {mode} | **tpurun's, per worker** | | | {tp['pss']:.1f} | {tp['uss']:.1f} "
                     f"| {m['tpurun_cpu_ms_per_worker']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8, choices=sorted(relay_bench.TYPES))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--settle", type=float, default=12.0,
                    help="seconds the job runs after every process printed, before it is measured (a relay's "
                         "zygote ends 2 s after its last child)")  # fmt: skip
    args = ap.parse_args()
    res: dict[str, Any] = {"machine": common.machine(), "workers": args.workers, "modes": {}}
    with common.bench_emulator() as bench:
        name = f"cost{args.workers}"
        relay_bench.made(bench, name, relay_bench.TYPES[args.workers])
        node = common.Node(name, [str(i) for i in range(args.workers)])
        bench.nodes[name] = node
        jobs = bench.job_dir(hold=HOLD)
        for mode, relay in (("relay", "on"), ("direct", "off")):
            res["modes"][mode] = measure(bench, node, jobs, relay, args.settle)
            print(f"{mode}: {res['modes'][mode]}", flush=True)
    print(common.machine_line(res["machine"]))
    print(table(res))
    if args.json:
        common.write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
