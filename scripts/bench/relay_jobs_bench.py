#!/usr/bin/env python3
"""Jobs through relays: what `train` and `sync` cost this machine as the pod grows, relayed against direct.

For each pod size (one node each, made through the Cloud TPU API and adopted with `tpurun attach`, in one
in-process emulator), runs interleaved between `TPURUN_RELAY=on` and `off`:

* start    `tpurun train start.py --cores 1` (every process prints its time first): invocation to the last
           process's first line; beside it `tpurun exec -- python3 -c pass`, the floor the goal is set against
* chatty   `tpurun train lines.py 200 --cores 1` (200 lines per host): the client's CPU, peak RSS, threads
           and sockets; every line checked by content (lost, duplicated, mangled)
* logs     `tpurun train lines.py N --cores 4`: lines per second at this machine (first line to last, and the
           whole command), every line checked
* stop     SIGINT to tpurun once every process of `train stopme.py --cores 1` runs: to the last process gone
           from every worker's pid namespace, and to tpurun's exit
* sync     a first `tpurun sync` of a 100-file tree into a new directory, then a no-op one: the bytes this
           machine sent (the kernel's counters of tpurun's TCP connections, read with `ss`)

    sudo .venv/bin/python scripts/bench/relay_jobs_bench.py [--sizes 32,256,512] [--reps 2] [--modes relay] [--write]

A 1,024-host job (`--sizes 32,1024 --only chatty --modes relay`) needs about 20 GiB for its workers' processes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402
import relay_bench  # noqa: E402
import run_all  # noqa: E402
import sync_bench  # noqa: E402

MODES = {"relay": "on", "direct": "off"}
TREE_FILES, TREE_MB = 100, 10
CHATTY_LINES = 200
# From 1,024 hosts on, or 1,024 processes printing at once (`logs` at 256 × 4), every emulated worker's processes
# share this machine's two cores: a relay or a worker's sshd starved past the default 15 s of silence is this
# machine's, not a pod's (each VM its own cores; at 256 × 4 two runs in four lost a root relay so). Set for those
# rows alone, and recorded in them (`env`).
STARVED = 1024
STARVED_ENV = {"TPURUN_RELAY_TIMEOUT": "60", "TPURUN_KEEPALIVE_TIMEOUT": "60"}


def _growth(f: Any) -> tuple[threading.Event, list[float]]:
    """Watch file F grow (every 10 ms) until the event is set: [when it first grew, when it last did]."""
    done, seen = threading.Event(), []

    def poll() -> None:
        size = 0
        while not done.wait(0.01):
            now = os.fstat(f.fileno()).st_size
            if now != size:
                size = now
                seen[:] = [seen[0] if seen else time.monotonic(), time.monotonic()]

    threading.Thread(target=poll, daemon=True).start()
    return done, seen


class Jobs:
    """The measurements on one node, each in both modes (the mode is the `TPURUN_RELAY` of the bench's env)."""

    def __init__(self, bench: common.Bench, run: run_all.Run, node: common.Node, reps: int, modes: list[str]) -> None:
        self.bench, self.run, self.node, self.reps, self.modes = bench, run, node, reps, modes
        self.hosts = len(node.workers)

    def _modes(self, rnd: int) -> list[str]:
        return list(self.modes) if rnd % 2 else list(reversed(self.modes))

    def _set(self, mode: str) -> None:
        self.bench.env["TPURUN_RELAY"] = MODES[mode]

    def start(self) -> dict[str, Any]:
        """Invocation to every process started (train), against `exec -- python3 -c pass`, per mode."""
        out: dict[str, dict[str, list[float]]] = {m: {"train": [], "python": []} for m in self.modes}
        floor = [*common.tpurun_bin(), "exec", "--tpu", self.node.name, "--", common.WORKER_PYTHON, "-c", "pass"]
        for rnd in range(self.reps + 1):
            for mode in self._modes(rnd):
                self._set(mode)
                s, t0, starts = self.run.start_times(self.node)
                py = relay_bench.measured(floor, self.bench.env)
                ok = s.code == 0 and len(starts) == self.hosts and py["code"] == 0
                print(f"  {self.hosts} start {mode}: train {max(starts, default=t0) - t0:.2f}s "
                      f"({len(starts)}/{self.hosts}, exit {s.code}); python {py['wall']:.2f}s", flush=True)  # fmt: skip
                if rnd and ok:
                    out[mode]["train"].append(max(starts) - t0)
                    out[mode]["python"].append(py["wall"])
        return {m: {k: statistics.median(v) if v else None for k, v in r.items()} for m, r in out.items()}

    def chatty(self) -> dict[str, Any]:
        """A job whose hosts print 200 lines each: the client's cost, every line checked."""
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in self.modes}
        argv = self.run.train_argv(self.node, "lines.py", str(CHATTY_LINES))
        for rnd in range(self.reps + 1):
            for mode in self._modes(rnd):
                self._set(mode)
                with tempfile.TemporaryFile("w+") as f:
                    got = relay_bench.measured(argv, self.bench.env, self.run.jobs, f)
                    f.seek(0)
                    got |= run_all.check_lines(f.read(), self.hosts, 1, CHATTY_LINES)
                print(f"  {self.hosts} chatty {mode}: {got}", flush=True)
                if rnd:
                    runs[mode].append(got)
        keys = ("wall", "cpu", "rss", "threads", "sockets")
        return {
            m: {k: statistics.median(r[k] for r in rs) for k in keys}
            | {k: max(r[k] for r in rs) for k in ("lost", "duplicated", "mangled", "out_of_order")}
            | {"failures": sum(r["code"] != 0 for r in rs)}
            for m, rs in runs.items()
        }

    def logs(self, lines: int, cores: int = 4) -> dict[str, Any]:
        """Every process prints LINES lines at once: lines per second at this machine from the first line's
        arrival to the last's (the job's start on this 2-core machine is not the client's throughput), and
        over the whole command; every line checked."""
        out: dict[str, Any] = {}
        argv = self.run.train_argv(self.node, "lines.py", str(lines), cores=cores)
        starved = STARVED_ENV if self.hosts * cores >= STARVED else {}
        for mode in self._modes(1):
            self._set(mode)
            path = self.run.work / "logs.out"
            with path.open("w+") as f:
                done, seen = _growth(f)
                got = relay_bench.measured(argv, self.bench.env | starved, self.run.jobs, f)
                done.set()
                f.seek(0)
                checked = run_all.check_lines(f.read(), self.hosts, cores, lines)
            path.unlink()
            span = seen[1] - seen[0] if len(seen) == 2 and seen[1] > seen[0] else float("nan")
            out[mode] = got | checked | {"expected": self.hosts * cores * lines, "span": span,
                                         "lines_per_s": checked["delivered"] / span,
                                         "lines_per_s_wall": checked["delivered"] / got["wall"]}  # fmt: skip
            if starved:
                out[mode]["env"] = starved
            print(f"  {self.hosts} logs {mode}: {out[mode]}", flush=True)
        return out

    def stop(self, cores: int = 1) -> dict[str, Any]:
        """SIGINT once every process runs: to the last process gone, and to tpurun's exit (medians)."""
        out = {}
        for mode in self._modes(1):
            self._set(mode)
            runs = [r for r in (self.run.stop_once(self.node, "sigint", cores) for _ in range(self.reps)) if r]
            out[mode] = {"cores": cores, "runs": len(runs), "tried": self.reps,
                         "gone": statistics.median(r["gone"] for r in runs) if runs else None,
                         "exit": statistics.median(r["exit"] for r in runs) if runs else None,
                         "left": max((int(r["left_after_exit"]) for r in runs), default=0),
                         "codes": sorted({int(r["code"]) for r in runs})}  # fmt: skip
            print(f"  {self.hosts} stop {mode}: {out[mode]}", flush=True)
        return out

    def sync(self, tree: Path) -> dict[str, Any]:
        """A first sync into a directory of its own on every worker, then a no-op one: the bytes this machine sent."""
        out: dict[str, dict[str, list[dict[str, Any]]]] = {m: {"first": [], "no-op": []} for m in self.modes}
        cache = Path(self.bench.env["TPURUN_HOME"]) / "sync-cache"
        for rnd in range(self.reps):
            for mode in self._modes(rnd):
                self._set(mode)
                shutil.rmtree(cache, ignore_errors=True)
                argv = [*common.tpurun_bin(), "--plain", "sync", "--tpu", self.node.name,
                        "--dest", f"/root/tree-{mode}-{rnd}"]  # fmt: skip
                for phase in ("first", "no-op"):
                    got = relay_bench.measured(argv, self.bench.env, tree, tcp=True)
                    print(f"  {self.hosts} sync {mode} {phase}: {got}", flush=True)
                    out[mode][phase].append(got)
        self.bench.tpurun("exec", "--tpu", self.node.name, "--", "sh", "-c", "rm -rf /root/tree-*", check=False)
        keys = ("wall", "cpu", "rss", "sent")
        return {
            m: {ph: {k: statistics.median(r[k] for r in rs) for k in keys} | {"failures": sum(r["code"] != 0 for r in rs)}
                for ph, rs in phases.items()}
            for m, phases in out.items()
        }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="32,256,512")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--only", default="start,chatty,logs,stop,sync")
    ap.add_argument("--log-lines", type=int, default=0, help="lines per core for `logs` (default: 4 M lines in all)")
    ap.add_argument("--modes", default="relay,direct", help="relay, direct or both (a 1,024-host pod: relay alone)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    only = set(args.only.split(","))
    res: dict[str, Any] = {"machine": common.machine(), "commands": [], "sizes": {}}
    saved = common.BENCH_DOCS / "relay-jobs.json"
    if args.write and saved.exists():  # a run adds its sizes and measures to the last run's
        res = json.loads(saved.read_text()) | {"machine": res["machine"]}
    res["commands"].append(" ".join(sys.argv[1:]))
    with common.bench_emulator() as bench:
        bench.server.emu.config.max_workers_per_node = max(sizes)
        run = run_all.Run(bench, argparse.Namespace(reps=args.reps))  # its helpers only, not its own rounds
        tree = bench.state_dir / "tree"
        tree.mkdir()
        sync_bench.make_tree(tree, TREE_FILES, TREE_MB)
        for size in sizes:
            node = common.Node(f"jobs{size}", [])
            t0 = time.monotonic()
            relay_bench.made(bench, node.name, relay_bench.TYPES[size])
            node.workers = [str(i) for i in range(size)]  # their number is what the measurements read
            bench.nodes[node.name] = node
            print(f"created {node.name} ({size} workers) in {time.monotonic() - t0:.1f}s", flush=True)
            jobs = Jobs(bench, run, node, args.reps, [m for m in MODES if m in args.modes.split(",")])
            row: dict[str, Any] = {}
            for k, v in STARVED_ENV.items():
                if size >= STARVED:
                    bench.env[k] = row.setdefault("env", {})[k] = v
                else:
                    bench.env.pop(k, None)
            if "start" in only:
                row["start"] = jobs.start()
            if "chatty" in only:
                row["chatty"] = jobs.chatty()
            if "logs" in only:
                row["logs"] = jobs.logs(args.log_lines or max(1000, 4_000_000 // (size * 4)))
            if "stop" in only:
                row["stop"] = jobs.stop()
            if "sync" in only:
                row["sync"] = jobs.sync(tree)
            res["sizes"][str(size)] = merged(res["sizes"].get(str(size), {}), row)
            res["sizes"] = dict(sorted(res["sizes"].items(), key=lambda kv: int(kv[0])))
            if args.write:
                common.write_json(saved, res)  # kept as it goes: a later size may not fit this machine
            bench.delete(node)
    common.publish(res, table(res), "relay-jobs", "## Relays: jobs and sync as the pod grows (#42)", write=args.write)
    return 0


def merged(before: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """A size's ROW of measures over what an earlier run wrote BEFORE, path by path: a run of one path (`--modes
    relay`) keeps the other's."""
    out = dict(before)
    for measure, got in row.items():
        old = out.get(measure)
        both = isinstance(old, dict) and isinstance(got, dict) and set(got) <= set(MODES)
        out[measure] = {**old, **got} if both else got
    return out


def _cell(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def _section(caption: str, columns: list[str]) -> list[str]:
    """A table's caption and head."""
    return ["", caption, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def table(res: dict[str, Any]) -> str:
    sizes = res["sizes"]
    lines = [
        common.machine_line(res["machine"]),
        "",
        "Commands: " + "; ".join(f"`sudo .venv/bin/python scripts/bench/relay_jobs_bench.py {c}`" for c in res["commands"]) + ". Medians of interleaved runs.",
    ]  # fmt: skip
    if any("start" in r for r in sizes.values()):
        lines += _section(
            "`train start.py --cores 1`: invocation to every process started, against `exec -- python3 -c pass` (goal: at most 1.5×).",
            ["workers", "path", "train: every process started (s)", "exec python3 -c pass (s)", "ratio"],
        )  # fmt: skip
        for size, r in sizes.items():
            for mode, m in r.get("start", {}).items():
                ratio = m["train"] / m["python"] if m["train"] and m["python"] else None
                lines.append(
                    f"| {size} | {mode} | {_cell(m['train'])} | {_cell(m['python'])} | {_cell(ratio, '{:.2f}×')} |"
                )
    if any("chatty" in r for r in sizes.values()):
        lines += _section(
            f"`train lines.py {CHATTY_LINES} --cores 1` ({CHATTY_LINES} lines per host): this machine's cost (goal: at most 2× from the smallest pod to the largest, relayed).",
            ["workers", "path", "wall (s)", "client CPU (s)", "client peak RSS (MiB)", "peak threads", "peak sockets", "lost / duplicated / mangled / out of order"],
        )  # fmt: skip
        for size, r in sizes.items():
            for mode, m in r.get("chatty", {}).items():
                bad = f" ({m['failures']} failed)" if m["failures"] else ""
                lines.append(f"| {size} | {mode}{bad} | {m['wall']:.2f} | {m['cpu']:.2f} | {m['rss']:.0f} | {m['threads']:.0f} | "
                             f"{m['sockets']:.0f} | {m['lost']} / {m['duplicated']} / {m['mangled']} / {m['out_of_order']} |")  # fmt: skip
    if any("logs" in r for r in sizes.values()):
        lines += _section(
            "`train lines.py N --cores 4`: lines per second at this machine, from the first line's arrival to the last's, and over the whole command (its start included; goal: 200,000 or more, none lost).",
            ["workers × cores", "path", "exit", "lines delivered / expected", "lines/s, first to last", "lines/s, whole command", "lost / duplicated / mangled", "client CPU (s)", "client peak RSS (MiB)"],
        )  # fmt: skip
        for size, r in sizes.items():
            for mode, m in r.get("logs", {}).items():
                timeouts = " (60 s timeouts)" if m.get("env") else ""
                lines.append(f"| {size} × 4 | {mode}{timeouts} | {m['code']} | {m['delivered']:,} / {m['expected']:,} | {m['lines_per_s']:,.0f} | "
                             f"{m['lines_per_s_wall']:,.0f} | {m['lost']:,} / {m['duplicated']} / {m['mangled']} | {m['cpu']:.1f} | {m['rss']:.0f} |")  # fmt: skip
    if any("stop" in r for r in sizes.values()):
        lines += _section(
            "SIGINT to `train stopme.py` once every process runs: to the last process gone from every worker, and to tpurun's exit (medians).",
            ["workers × cores", "path", "runs (of tried)", "gone (ms)", "exit (ms)", "exit codes", "processes left at exit"],
        )  # fmt: skip
        for size, r in sizes.items():
            for mode, m in r.get("stop", {}).items():
                lines.append(f"| {size} × {m['cores']} | {mode} | {m['runs']} ({m['tried']}) | {_cell(m['gone'] and m['gone'] * 1000, '{:.0f}')} | "
                             f"{_cell(m['exit'] and m['exit'] * 1000, '{:.0f}')} | {', '.join(map(str, m['codes']))} | {m['left']} |")  # fmt: skip
    if any("sync" in r for r in sizes.values()):
        lines += _section(
            f"`sync` of a {TREE_FILES}-file {TREE_MB} MB tree: the bytes this machine sent over TCP (SSH's framing included; a tree's worth per root is about {TREE_MB * 4} MB).",
            ["workers", "path", "sync", "wall (s)", "client CPU (s)", "client peak RSS (MiB)", "bytes sent (MB)", "per worker (MB)"],
        )  # fmt: skip
        for size, r in sizes.items():
            for mode, phases in r.get("sync", {}).items():
                for ph, m in phases.items():
                    bad = f" ({m['failures']} failed)" if m["failures"] else ""
                    lines.append(f"| {size} | {mode}{bad} | {ph} | {m['wall']:.2f} | {m['cpu']:.2f} | {m['rss']:.0f} | "
                                 f"{m['sent'] / 1e6:.1f} | {m['sent'] / 1e6 / int(size):.2f} |")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
