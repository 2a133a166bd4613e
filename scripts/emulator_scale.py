#!/usr/bin/env python3
"""How big a pod the emulator holds on this machine, and how fast it boots one.

Boots, through the real google-cloud-tpu client, a v4-64 (8 workers), a v4-256 (32 workers) and
then the largest of v4-1024 (128 workers) / v4-512 (64) that comes up, each with a startup script
that writes a guest attribute; times CREATE -> READY and READY -> every startup script done, checks
every worker's sshd answers, and writes the numbers into docs/emulator.md (between the
`scale:begin` / `scale:end` markers). Needs root, like the emulator. Usage:

    sudo python scripts/emulator_scale.py [--no-write]
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
DOC = ROOT / "docs" / "emulator.md"
STARTUP = """#!/bin/bash
curl -s -X PUT -H 'Metadata-Flavor: Google' --data "$(hostname)" \\
  http://metadata.google.internal/computeMetadata/v1/instance/guest-attributes/scale/up
"""


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true", help="print the results, leave docs/emulator.md alone")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import tpu_v2

    from tpurun.emulator.api import EmulatorServer
    from tpurun.emulator.cli import leftovers
    from tpurun.emulator.hosts import WorkerHosts
    from tpurun.emulator.model import Delays, EmulatorConfig
    from tpurun.emulator.pytest_plugin import fast_polling, host_problem
    from tpurun.emulator.state import Emulator

    problem = host_problem()
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    state_dir = Path(tempfile.mkdtemp(prefix="tpurun-scale-")).resolve()
    hosts = WorkerHosts(state_dir)
    emu = Emulator(hosts, EmulatorConfig(state_dir=state_dir, delays=Delays(0, 0, 0, 0, 0, 0)))
    server = EmulatorServer(emu)
    server.start_thread()
    client = tpu_v2.TpuClient(
        transport="rest", client_options={"api_endpoint": server.endpoint}, credentials=AnonymousCredentials()
    )
    parent = "projects/scale/locations/us-central2-b"
    rows: list[tuple[str, int, str, str, str, str]] = []
    largest = ""

    def run(accel: str) -> bool:
        nonlocal largest
        node_id = accel.replace("-", "x")
        mem0 = mem_available_mib()
        t0 = time.monotonic()
        try:
            op = client.create_node(
                parent=parent,
                node_id=node_id,
                node=tpu_v2.Node(
                    accelerator_type=accel, runtime_version="tpu-ubuntu2204-base", metadata={"startup-script": STARTUP}
                ),
            )
            node = op.result(polling=fast_polling().with_timeout(900))
            t_ready = time.monotonic() - t0
            name = node.name
            while True:
                workers = emu.node_info(name)["workers"]
                if all(w["startupExitCode"] is not None for w in workers):
                    break
                time.sleep(0.05)
            t_startup = time.monotonic() - t0
            for w in workers:  # every sshd answers
                with socket.create_connection((w["address"], w["sshPort"]), timeout=5) as s:
                    assert s.recv(4).startswith(b"SSH-")
            ga = client.get_guest_attributes(request={"name": name, "query_path": "scale/up"})
            ok = sum(1 for e in ga.guest_attributes if e.query_value.items)
            mem_used = mem0 - mem_available_mib()
            t1 = time.monotonic()
            client.delete_node(request={"name": name}).result(polling=fast_polling().with_timeout(900))
            t_delete = time.monotonic() - t1
        except Exception as e:
            print(f"{accel}: failed: {type(e).__name__}: {e}", file=sys.stderr)
            try:
                client.delete_node(request={"name": f"{parent}/nodes/{node_id}"}).result(polling=fast_polling())
            except Exception:
                pass
            return False
        n = len(workers)
        print(
            f"{accel}: {n} workers READY in {t_ready:.1f}s, startup done in {t_startup:.1f}s, "
            f"{ok}/{n} guest attributes, ~{mem_used} MiB, deleted in {t_delete:.1f}s",
            flush=True,
        )
        rows.append((accel, n, f"{t_ready:.1f}", f"{t_startup:.1f}", f"{t_delete:.1f}", f"{max(mem_used, 0)}"))
        largest = f"{accel} ({n} workers)"
        return ok == n

    try:
        run("v4-64")
        run("v4-256")
        if not run("v4-1024"):
            run("v4-512")
    finally:
        server.stop()
        left = leftovers(state_dir)
        if not left:
            shutil.rmtree(state_dir, ignore_errors=True)
    if left:
        print(f"warning: left behind: {left}", file=sys.stderr)

    cpu = os.cpu_count()
    mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024 // 1024
    table = [
        "<!-- scale:begin (written by scripts/emulator_scale.py) -->",
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.system()} {platform.release()}, {cpu} CPUs, "
        f"{mem} GiB RAM (create delay 0; times from the create call).",
        "",
        "| node | workers | READY (s) | every startup script done (s) | delete (s) | memory (MiB) |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} |" for r in rows],
        "",
        f"Largest node this machine held: {largest or 'none'}.",
        "<!-- scale:end -->",
    ]
    text = "\n".join(table)
    print(text)
    if not args.no_write and DOC.exists():
        doc = DOC.read_text()
        new = re.sub(r"<!-- scale:begin.*?<!-- scale:end -->", lambda _: text, doc, flags=re.S)
        DOC.write_text(new)
        print(f"wrote {DOC}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
