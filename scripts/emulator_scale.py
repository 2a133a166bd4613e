#!/usr/bin/env python3
"""How many workers the emulator holds on this machine, how fast it boots them, and what they cost.

Through the real google-cloud-tpu client, boots a 32-worker node (v4-256) and keeps it; then, beside it, pods
of 256 workers (v4-2048), 1,024 (v5p-8192) and 2,048 (v5p-12288, the largest accelerator type, 1,536 hosts,
plus a v5p-4096's 512: no type has 2,048 hosts), one size at a time. Every worker runs a startup script that
writes a guest attribute through its metadata server. For each size: CREATE -> READY and -> every startup script
done, the memory of the emulator (its own process, every process of its workers' namespaces, and the machine's
kernel memory grown since the start: slab, page tables, kernel stacks, shmem), per idle worker, a sample of 64
workers whose sshd answers, and the delete. Writes the table into docs/benchmarks.md (between the
`emulator-scale:begin` / `emulator-scale:end` markers). Needs root, like the emulator. Usage:

    sudo python scripts/emulator_scale.py [--sizes 256,1024,2048] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
STARTUP = """#!/bin/bash
curl -s -X PUT -H 'Metadata-Flavor: Google' --data "$(hostname)" \\
  http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/scale/up
"""
PODS = {256: ["v4-2048"], 1024: ["v5p-8192"], 2048: ["v5p-12288", "v5p-4096"]}
KERNEL = ("Slab", "KernelStack", "PageTables", "Shmem")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0])
    return out


def pss_kib(pid: int | str) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return next((int(ln.split()[1]) for ln in text.splitlines() if ln.startswith("Pss:")), 0)


def workers_pss_kib(state_dir: Path, namespaces: set[str]) -> tuple[int, int]:
    """PSS of every process in the workers' PID namespaces and of their `unshare` parents; how many processes."""
    total = count = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            ns = os.readlink(f"/proc/{name}/ns/pid")
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
        except OSError:
            continue
        if ns in namespaces or (cmd.startswith(b"unshare\0") and str(state_dir).encode() in cmd):
            total += pss_kib(name)
            count += 1
    return total, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,1024,2048", help="pod sizes in workers, of 256, 1024, 2048")
    ap.add_argument("--no-write", action="store_true", help="print the results, leave docs/benchmarks.md alone")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import tpu_v2

    from tpurun.emulator.api import EmulatorServer
    from tpurun.emulator.cli import leftovers
    from tpurun.emulator.hosts import WorkerHosts
    from tpurun.emulator.model import LARGEST_SLICE_WORKERS, Delays, EmulatorConfig
    from tpurun.emulator.pytest_plugin import fast_polling, host_problem
    from tpurun.emulator.state import Emulator

    problem = host_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    state_dir = Path(tempfile.mkdtemp(prefix="tpurun-scale-")).resolve()
    start_mem = meminfo()
    hosts = WorkerHosts(state_dir)
    config = EmulatorConfig(
        state_dir=state_dir, delays=Delays(0, 0, 0, 0, 0, 0), max_workers_per_node=LARGEST_SLICE_WORKERS
    )
    emu = Emulator(hosts, config)
    server = EmulatorServer(emu)
    server.start_thread()
    client = tpu_v2.TpuClient(
        transport="rest", client_options={"api_endpoint": server.endpoint}, credentials=AnonymousCredentials()
    )
    parent = "projects/scale/locations/us-central2-b"
    polling = fast_polling().with_timeout(1800)

    def create(accels: list[str]) -> tuple[list[str], float, float]:
        """Create ACCELS at once; their names, seconds to every one READY and to every startup script done."""
        t0 = time.monotonic()
        ops = [
            client.create_node(
                parent=parent,
                node_id=a.replace("-", "x"),
                node=tpu_v2.Node(
                    accelerator_type=a,
                    runtime_version="tpu-ubuntu2204-base",
                    metadata={"startup-script": STARTUP},
                    network_config=tpu_v2.NetworkConfig(enable_external_ips=True),  # its sshd is asked from here
                ),
            )
            for a in accels
        ]
        names = [op.result(polling=polling).name for op in ops]
        t_ready = time.monotonic() - t0
        while not all(w["startupExitCode"] is not None for n in names for w in emu.node_info(n)["workers"]):
            time.sleep(0.2)
        return names, t_ready, time.monotonic() - t0

    def check(name: str) -> None:
        """Every worker ran its startup script (its guest attribute is there); a sample's sshd answers."""
        ga = client.get_guest_attributes(request={"name": name, "query_path": "scale/up"})
        workers = emu.node_info(name)["workers"]
        done = sum(1 for e in ga.guest_attributes if e.query_value.items)
        if done != len(workers):
            raise RuntimeError(f"{name}: {done}/{len(workers)} startup scripts reported")
        for w in workers[:: max(1, len(workers) // 64)]:
            with socket.create_connection((w["address"], w["sshPort"]), timeout=30) as s:
                s.settimeout(30)
                if not s.recv(4).startswith(b"SSH-"):
                    raise RuntimeError(f"{name}: worker {w['index']} does not answer ssh")

    def memory() -> tuple[float, float, float]:
        """MiB: the emulator's process, its workers' processes, the kernel memory grown since the start."""
        namespaces = {os.readlink(f"/proc/{p}/ns/pid") for p in emu_init_pids() if os.path.exists(f"/proc/{p}")}
        procs, _ = workers_pss_kib(state_dir, namespaces)
        now = meminfo()
        kernel = sum(now[k] - start_mem[k] for k in KERNEL)
        return pss_kib("self") / 1024, procs / 1024, max(kernel, 0) / 1024

    def emu_init_pids() -> list[int]:
        return [w.init_pid for key in hosts.node_keys() for w in hosts.workers(key) if w.init_pid]

    rows: list[str] = []
    reached = "none"
    try:
        side, _, t_side = create(["v4-256"])
        check(side[0])
        time.sleep(1)
        base = memory()
        print(f"v4-256 (32 workers) beside: startup done in {t_side:.1f}s; memory {sum(base):.0f} MiB", flush=True)
        for size in [int(s) for s in args.sizes.split(",")]:
            accels = PODS[size]
            try:
                names, t_ready, t_done = create(accels)
                for n in names:
                    check(n)
            except Exception as e:  # the machine could not hold it: say so, stop growing
                print(f"{size} workers ({' + '.join(accels)}): failed: {type(e).__name__}: {e}", file=sys.stderr)
                rows.append(f"| {size} | {' + '.join(accels)} | not reached: {type(e).__name__} | | | | | | |")
                break
            time.sleep(2)  # idle: the startup scripts' curls are gone
            emu_mib, procs_mib, kernel_mib = memory()
            total = emu_mib + procs_mib + kernel_mib
            per = (total - sum(base)) / size
            t1 = time.monotonic()
            ops = [client.delete_node(request={"name": n}) for n in names]
            for op in ops:
                op.result(polling=polling)
            t_delete = time.monotonic() - t1
            line = (
                f"| {size} | {' + '.join(accels)} | {t_ready:.1f} | {t_done:.1f} | {t_done / size * 1000:.0f} | "
                f"{t_delete:.1f} | {emu_mib:.0f} / {procs_mib:.0f} / {kernel_mib:.0f} | {total:.0f} | {per:.2f} |"
            )
            print(line, flush=True)
            rows.append(line)
            reached = f"{size} workers ({' + '.join(accels)}) beside the 32-worker node"
    finally:
        server.stop()
        left = leftovers(state_dir)
        if not left:
            shutil.rmtree(state_dir, ignore_errors=True)
    if left:
        print(f"warning: left behind: {left}", file=sys.stderr)

    mem_gib = meminfo()["MemTotal"] // 1024 // 1024
    table = [
        "<!-- emulator-scale:begin (written by scripts/emulator_scale.py) -->",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.system()} {platform.release()}, {os.cpu_count()} CPUs, "
        f"{mem_gib} GiB RAM, beside a 32-worker v4-256 that stays up (create delay 0; times from the create "
        "calls; memory when every worker is idle, its startup script done).",
        "",
        "| workers | pods | READY (s) | every startup script done (s) | per worker (ms) | delete (s) | "
        "memory (MiB): emulator / workers' processes / kernel | total (MiB) | per idle worker (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Most this machine held: {reached}.",
        "<!-- emulator-scale:end -->",
    ]
    text = "\n".join(table)
    print(text)
    if not args.no_write and DOC.exists():
        doc = DOC.read_text()
        DOC.write_text(
            re.sub(r"<!-- emulator-scale:begin.*?<!-- emulator-scale:end -->", lambda _: text, doc, flags=re.S)
        )
        print(f"wrote {DOC}")
    return 0 if rows and "not reached" not in rows[-1] else 1


if __name__ == "__main__":
    sys.exit(main())
