#!/usr/bin/env python3
"""Round trips counted: where `tpurun exec -- true` on 8 workers behind the latency proxy spends its time,
next to the paramiko floor (launch_bench.py --floor), from every SSH message each sends and receives.

Each contender runs in a child process with paramiko's packet layer wrapped (every message logged with its
time and thread), the real CLI for tpurun. Per run it reports: start-up (process start to the first TCP
connect), handshakes (first connect to the last `userauth-success`), how long the first worker authenticated
waited before opening its channel (a barrier for the slowest handshake shows here), the command (the last
`channel-open` to the last exit status), and the requests per worker that wait for an answer. Needs root
(the emulator). Usage:

    sudo .venv/bin/python scripts/bench/round_trips.py --rtt 50 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402

# what the child runs: paramiko's Packetizer and socket.connect wrapped, then the contender
_CHILD = r"""
import atexit, os, socket, sys, threading, time
t0 = time.perf_counter()
log = []
def note(text):
    log.append((time.perf_counter() - t0, threading.current_thread().name, text))
from paramiko.common import MSG_NAMES
from paramiko.packet import Packetizer
send, read, connect = Packetizer.send_message, Packetizer.read_message, socket.socket.connect
def send_message(self, data):
    note("> " + str(MSG_NAMES.get(data.asbytes()[0])))
    return send(self, data)
def read_message(self):
    cmd, m = read(self)
    note("< " + str(MSG_NAMES.get(cmd, cmd)))
    return cmd, m
def tcp(self, address):
    note("tcp connect")
    return connect(self, address)
Packetizer.send_message, Packetizer.read_message, socket.socket.connect = send_message, read_message, tcp
def dump(code=0):
    with open(os.environ["ROUND_TRIPS_OUT"], "w") as f:
        f.writelines(f"{t * 1000:.3f}\t{th}\t{text}\n" for t, th, text in log + [(time.perf_counter() - t0, "", "exit")])
    os._exit(code or 0)
if sys.argv[1] == "tpurun":
    sys.argv = sys.argv[1:]
    from tpurun.cli import main
    try:
        main()
    except SystemExit as e:
        dump(e.code)
else:
    import launch_bench
    dump(launch_bench.floor_main(*sys.argv[2:5], sys.argv[5:]))
"""


def phases(path: Path) -> dict[str, float]:
    rows = [line.rstrip("\n").split("\t") for line in path.read_text().splitlines()]
    at = [(float(t), text) for t, _, text in rows]

    def times(prefix: str) -> list[float]:
        return [t for t, text in at if text.startswith(prefix)]

    tcp, auth, opened, status = times("tcp"), times("< userauth-success"), times("> channel-open"), []
    status = times("< channel-request")  # the exit status
    waiting = ("> kexinit", "> kex", "> service-request", "> userauth-request", "> channel-open", "> channel-request")
    asked = sum(1 for _, text in at if text.startswith(waiting))
    return {
        "start-up": min(tcp),
        "handshakes": max(auth) - min(tcp),
        "first authenticated waits": min(opened) - min(auth),
        "command": max(status) - max(opened),
        "total": at[-1][0],
        "requests per worker": asked / len(tcp),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt", type=float, default=50, help="round-trip time in ms (default 50)")
    ap.add_argument("--reps", type=int, default=5, help="runs of each (default 5)")
    args = ap.parse_args()
    from tpurun.testing.latency_proxy import ProxyGroup, address_map_env, pin_proxies, proxy_workers

    out = Path(tempfile.mkdtemp(prefix="round-trips-"))
    child = out / "child.py"
    child.write_text(_CHILD)
    got: dict[str, list[dict[str, float]]] = {"tpurun": [], "floor": []}
    with common.bench_emulator() as bench:
        node = bench.create(8)
        group = ProxyGroup(rtt=args.rtt / 1000)
        try:
            mapping = proxy_workers(group, [(a, 22) for a in node.workers])
            pin_proxies(bench.known_hosts, mapping)
            path = os.pathsep.join([str(Path(__file__).resolve().parent), str(common.ROOT)])
            env = dict(bench.env, TPURUN_ADDRESS_MAP=address_map_env(mapping), PYTHONPATH=path)
            floor = ["floor", str(bench.key), str(bench.known_hosts), "root", *(mapping[a] for a in node.workers)]
            for i in range(args.reps):
                for name, argv in [("tpurun", ["tpurun", "exec", "--tpu", node.name, "--", "true"]), ("floor", floor)]:
                    log = out / f"{name}-{i}.tsv"
                    subprocess.run(
                        [sys.executable, str(child), *argv], env=dict(env, ROUND_TRIPS_OUT=str(log)),
                        cwd=bench.home, capture_output=True, check=True,
                    )  # fmt: skip
                    got[name].append(phases(log))
        finally:
            group.close()
            bench.delete(node)
    print(f"8 workers behind the latency proxy at {args.rtt:g} ms RTT, medians of {args.reps} runs (ms):")
    for name, runs in got.items():
        cells = ", ".join(f"{k} {statistics.median(r[k] for r in runs):.1f}" for k in runs[0])
        print(f"  {name}: {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
