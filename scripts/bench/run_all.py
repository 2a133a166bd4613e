#!/usr/bin/env python3
"""Every tpurun benchmark in one run: launch, train start-up, client cost, WAN, sync, logs, stop latency.

Run through `scripts/bench/run [--quick]` (root: the emulator needs it). One in-process emulator, one
node per worker count, every benchmark on that node before the next size; contenders interleaved run
by run (A B A B ..., order rotated each round, one unmeasured warm-up round), median and min-max.

* launch   `tpurun exec -- true` vs `pdsh -R ssh` vs `parallel-ssh` vs the paramiko floor (launch_bench.py)
* train    `tpurun train start.py --runtime cpu --cores 1`: invocation -> every core's first line
           (each core prints time.time() first; workers share this machine's clock)
* client   CPU seconds (user+sys) and peak RSS of the tpurun process (GNU time), from the runs above
* wan      8 workers behind tpurun.testing.latency_proxy at 0/25/50/100 ms RTT: exec, the floor, and a
           one-file `tpurun sync` (the file changes every run); round trips = (t - t at 0 ms) / RTT
* sync     first / no-op / one-changed-file of a FILES-file, MB tree vs parallel `rsync -a -e ssh`
* logs     `tpurun train` of a script printing N lines per core, 8 workers x 4 cores; lines/s at the
           client, lost and duplicated lines counted by content (each line carries worker/core/seq)
* stop     core failure -> last remote process gone, and SIGINT -> last process gone (p50/p95), the
           worker process tables polled every 10 ms through the emulator (each worker's pid namespace)
* relays   (only when asked, `--only relays`: about 90 minutes) relay_bench.py: exec and kill-stale at 32, 256
           and 1,024 workers relayed against direct, the WAN rows, and a v5p-8192 made by `tpurun create`;
           relay_jobs_bench.py: train's start, a chatty job, log throughput, stop and sync at 32, 256 and 512

Writes docs/bench/results.json, docs/bench/*.png and the generated sections of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import common  # noqa: E402
import launch_bench  # noqa: E402

RTTS_MS = [0, 25, 50, 100]
LINE_RE = re.compile(r"^\[w(\d+)/c(\d+)\] L (\d+) (\d+) (\d+)$")

START_PY = """import os, sys, time
print("S", repr(time.time()), os.environ["TPURUN_WORKER_ID"], os.environ["TPURUN_CORE"], flush=True)
"""
LINES_PY = """import os, sys
w, c, n = os.environ["TPURUN_WORKER_ID"], os.environ["TPURUN_CORE"], int(sys.argv[1])
out = sys.stdout
for i in range(n):
    out.write(f"L {w} {c} {i}\\n")
out.flush()
"""
STOP_PY = """import os, sys, time
w, c = os.environ["TPURUN_WORKER_ID"], os.environ["TPURUN_CORE"]
print("S", w, c, flush=True)
if sys.argv[1] == "fail" and w == "1" and c == "0":
    time.sleep(1.0)
    print("F", repr(time.time()), flush=True)
    os._exit(3)
time.sleep(600)
"""


def check_lines(text: str, hosts: int, cores: int, lines: int) -> dict[str, int]:
    """Every `L w c i` line of a job's output, checked: delivered, lost, duplicated, mangled, out of order."""
    seen: dict[tuple[int, int], list[int]] = {}
    mangled = 0
    for line in text.splitlines():
        m = LINE_RE.match(line)
        if not m:
            mangled += line.startswith("[w") and " L " in line  # a line of ours, split/merged/mis-prefixed
            continue
        w, c, w2, c2, i = (int(x) for x in m.groups())
        if (w, c) != (w2, c2):
            mangled += 1
            continue
        seen.setdefault((w, c), []).append(i)
    want = set(range(lines))
    return {
        "delivered": sum(len(v) for v in seen.values()),
        "lost": sum(lines - len(set(seen.get((w, c), [])) & want) for w in range(hosts) for c in range(cores)),
        "duplicated": sum(len(v) - len(set(v)) for v in seen.values()),
        "mangled": mangled,
        "out_of_order": sum(v != sorted(v) for v in seen.values()),
    }


def pct(values: list[float], q: float) -> float:
    v = sorted(values)
    if not v:
        return float("nan")
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stats(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "median": statistics.median(values) if values else float("nan"),
        "min": min(values, default=float("nan")),
        "max": max(values, default=float("nan")),
        "p95": pct(values, 0.95),
        "samples": [round(x, 4) for x in values],
    }


class Run:
    def __init__(self, bench: common.Bench, args: argparse.Namespace) -> None:
        self.bench = bench
        self.args = args
        self.c = launch_bench.Contenders(bench)
        self.work = bench.state_dir / "work"
        self.work.mkdir()
        self.jobs = self.work / "jobs"
        self.jobs.mkdir()
        (self.jobs / "start.py").write_text(START_PY)
        (self.jobs / "lines.py").write_text(LINES_PY)
        (self.jobs / "stopme.py").write_text(STOP_PY)

    # ------------------------------------------------------------------ helpers

    def train_argv(self, node: common.Node, script: str, *extra: str, cores: int = 1) -> list[str]:
        return [
            *common.tpurun_bin(), "--plain", "train", script, *extra, "--tpu", node.name,
            "--runtime", "cpu", "--cores", str(cores), "--python", common.WORKER_PYTHON, "--grace", "2",
        ]  # fmt: skip

    def worker_pids(self, node: common.Node, needle: str) -> list[int]:
        """Pids of processes whose command line holds NEEDLE in any of NODE's workers' pid namespaces."""
        from tpurun.emulator import procs

        hosts = self.bench.server.emu.hosts
        key = f"projects/{common.PROJECT}/locations/{common.ZONE}/nodes/{node.name}"
        nss = {hosts._worker(key, i).pid_ns for i in range(len(node.workers))} - {None}
        found = []
        for pid in procs.all_pids():
            if needle in procs.cmdline(pid) and procs.ns(pid) in nss:
                found.append(pid)
        return found

    # ------------------------------------------------------------------ train start-up

    def start_times(self, node: common.Node) -> tuple[common.Sample, float, list[float]]:
        """`train start.py` once: its sample, when it was invoked, and when each process started (its first line)."""
        t0 = time.time()
        with tempfile.TemporaryFile("w+") as f:
            s = common.timed_to(self.train_argv(node, "start.py"), f, self.bench.env, self.jobs)
            f.seek(0)
            return s, t0, [float(m.group(1)) for m in re.finditer(r"\] S (\S+) \d+ \d+", f.read())]

    def train_start(self, node: common.Node) -> dict[str, Any]:
        n = len(node.workers)
        out: list[float] = []
        walls: list[common.Sample] = []
        for rnd in range(1 + self.args.reps):
            s, t0, starts = self.start_times(node)
            if len(starts) != n or s.code:
                print(f"  ! train start: {len(starts)}/{n} cores reported, exit {s.code}", file=sys.stderr)
                continue
            if rnd:
                out.append(max(starts) - t0)
                walls.append(s)
        r = {"all_cores_started": stats(out), "exit": common.summary(walls) if walls else None}
        print(
            f"  {n:>3} workers train: all cores started median {r['all_cores_started']['median'] * 1000:.0f} ms"
            f" [{r['all_cores_started']['min'] * 1000:.0f}-{r['all_cores_started']['max'] * 1000:.0f}]",
            flush=True,
        )
        return r

    # ------------------------------------------------------------------ logs

    def logs(self, node: common.Node, lines: int, cores: int = 4) -> dict[str, Any]:
        runs = []
        for _ in range(self.args.log_reps):
            out = self.work / "logs.out"
            with out.open("w+") as f:
                s = common.timed_to(
                    self.train_argv(node, "lines.py", str(lines), cores=cores), f, self.bench.env, self.jobs
                )
            c = check_lines(out.read_text(), len(node.workers), cores, lines)
            in_order, got = not c.pop("out_of_order"), c["delivered"]
            r = {
                "workers": len(node.workers), "cores": cores, "lines_per_core": lines,
                "expected": len(node.workers) * cores * lines, **c, "in_order_per_core": in_order,
                "wall": s.wall, "lines_per_s": got / s.wall, "cpu": s.cpu, "rss_mib": s.rss_mib, "exit": s.code,
            }  # fmt: skip
            print(
                f"  logs: {got}/{r['expected']} lines in {s.wall:.1f}s = {got / s.wall:,.0f} lines/s, lost {c['lost']}, "
                f"dup {c['duplicated']}, mangled {c['mangled']}, ordered {in_order}, client cpu {s.cpu:.1f}s",
                flush=True,
            )
            runs.append(r)
            out.unlink()
        best = max(runs, key=lambda r: r["lines_per_s"])
        return {"runs": runs, "lines_per_s_median": statistics.median(r["lines_per_s"] for r in runs), "best": best}

    # ------------------------------------------------------------------ stop latency

    def stop_once(self, node: common.Node, mode: str, cores: int) -> dict[str, float] | None:
        n = len(node.workers) * cores
        proc = subprocess.Popen(
            self.train_argv(node, "stopme.py", mode, cores=cores),
            env=self.bench.env, cwd=self.jobs, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        started = 0
        t_event = None
        lines: list[str] = []
        done = threading.Event()

        def reader() -> None:
            nonlocal started, t_event
            assert proc.stdout
            for line in proc.stdout:
                lines.append(line)
                if "] S " in line:
                    started += 1
                elif "] F " in line:
                    t_event = float(line.split()[-1])
            done.set()

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.time() + 120
        while started < n and time.time() < deadline and proc.poll() is None:
            time.sleep(0.01)
        if started < n:
            proc.kill()
            print(f"  ! stop {mode}: only {started}/{n} cores started", file=sys.stderr)
            return None
        from tpurun.emulator import procs

        running = self.worker_pids(node, "stopme.py")
        if mode == "sigint":
            time.sleep(0.2)
            t_event = time.time()
            os.kill(proc.pid, signal.SIGINT)
        else:
            while t_event is None and time.time() < deadline:
                time.sleep(0.005)
        # the last remote process gone: each of those seen running, polled by pid (a scan of every worker's
        # process table each 10 ms would itself take a core from the stop it measures at hundreds of workers)
        t_gone = None
        while time.time() < deadline:
            running = [p for p in running if procs.cmdline(p)]  # (a zombie's is empty: it is gone)
            if not running:
                t_gone = time.time()
                break
            time.sleep(0.01)
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            print(f"  ! stop {mode}: tpurun did not exit within 60 s", file=sys.stderr)
            return None
        t_exit = time.time()
        done.wait(5)
        if t_event is None or t_gone is None:
            return None
        still = self.worker_pids(node, "stopme.py")
        return {"gone": t_gone - t_event, "exit": t_exit - t_event, "code": code, "left_after_exit": len(still)}

    def stop(self, node: common.Node, cores: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        got: dict[str, list[dict[str, float]]] = {"failure": [], "sigint": []}
        for rnd in range(self.args.stop_reps):
            for mode in ["failure", "sigint"] if rnd % 2 == 0 else ["sigint", "failure"]:
                r = self.stop_once(node, "fail" if mode == "failure" else "sigint", cores)
                if r:
                    got[mode].append(r)
        for mode, rs in got.items():
            out[mode] = {
                "gone": stats([r["gone"] for r in rs]),
                "exit": stats([r["exit"] for r in rs]),
                "exit_codes": sorted({int(r["code"]) for r in rs}),
                "left_after_exit": max((int(r["left_after_exit"]) for r in rs), default=0),
                "cores": cores, "workers": len(node.workers),
            }  # fmt: skip
            g, e = out[mode]["gone"], out[mode]["exit"]
            print(
                f"  stop after {mode}: last process gone p50 {g['median'] * 1000:.0f} ms p95 {g['p95'] * 1000:.0f} ms;"
                f" tpurun exit p50 {e['median'] * 1000:.0f} ms p95 {e['p95'] * 1000:.0f} ms; exit codes "
                f"{out[mode]['exit_codes']}; left after exit {out[mode]['left_after_exit']}",
                flush=True,
            )
        return out

    # ------------------------------------------------------------------ sync

    def sync(self, node: common.Node, files: int, mb: int) -> dict[str, Any]:
        import sync_bench

        tree = self.work / "tree"
        if not tree.exists():
            t0 = time.monotonic()
            tree.mkdir()
            sync_bench.make_tree(tree, files, mb)
            print(f"  built a {files}-file {mb} MB tree in {time.monotonic() - t0:.1f}s", flush=True)
        b = self.bench
        ssh_e = "ssh " + shlex.join(b.ssh_options())
        victim = sorted(tree.rglob("*.dat"))[0]
        original = victim.read_bytes()

        # Every round syncs to destinations of its own instead of wiping the last round's: on a file
        # system without a journal (this VM's ext4) creating files within a minute of deleting tens of
        # thousands costs ~3x more CPU (ext4 skips recently freed inodes one by one), which charged
        # whichever contender ran first after a wipe. Everything is removed once, after the last round.
        rnd_dest = [0]

        def tpurun_sync() -> common.Sample:
            dest = f"/root/tree-r{rnd_dest[0]}"
            return common.timed(
                [*common.tpurun_bin(), "--plain", "sync", "--tpu", node.name, "--dest", dest], b.env, tree
            )

        def rsync_all() -> common.Sample:
            t0 = time.perf_counter()
            procs = [
                subprocess.Popen(
                    [
                        "/usr/bin/time",
                        "-q",
                        "-f",
                        "%U %S %M",
                        "-o",
                        f"{self.work}/rs{i}.time",
                        "rsync",
                        "-a",
                        "-e",
                        ssh_e,
                        f"{tree}/",
                        f"root@{a}:/root/rsync-tree-r{rnd_dest[0]}/",
                    ],
                    env=b.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )  # fmt: skip
                for i, a in enumerate(node.workers)
            ]
            code = 0
            for p in procs:
                _, err = p.communicate()
                if p.returncode:
                    print(f"  ! rsync: {err.decode()[-300:]}", file=sys.stderr)
                    code = p.returncode
            wall = time.perf_counter() - t0
            cpu, rss = 0.0, 0.0
            for i in range(len(procs)):
                u, s_, m = Path(f"{self.work}/rs{i}.time").read_text().split()[-3:]
                cpu += float(u) + float(s_)
                rss = max(rss, int(m) / 1024)
            return common.Sample(wall, cpu, rss, code)

        def wipe() -> None:
            r = subprocess.run(
                [*common.tpurun_bin(), "exec", "--tpu", node.name, "--", "sh", "-c", "rm -rf /root/tree-r* /root/rsync-tree-r*"],
                env=b.env, cwd=b.home, capture_output=True, check=False,
            )  # fmt: skip
            if r.returncode:
                print(f"  ! wipe failed: {r.stderr[-300:]!r}", file=sys.stderr)
            shutil.rmtree(Path(b.env["TPURUN_HOME"]) / "sync-cache", ignore_errors=True)

        def change(on: bool) -> None:
            victim.write_bytes(original[::-1] if on else original)
            t = time.time_ns() - (10 if on else 3600) * 10**9
            os.utime(victim, ns=(t, t))

        got: dict[str, dict[str, list[common.Sample]]] = {
            name: {"first": [], "no-op": [], "one file": []} for name in ("tpurun", "rsync")
        }
        fns = {"tpurun": tpurun_sync, "rsync": rsync_all}
        rounds = self.args.sync_reps
        need = rounds * 2 * len(node.workers) * mb * 1_000_000 * 1.3
        free = shutil.disk_usage(b.state_dir).free
        if free < need:
            rounds = max(1, int(free / (need / rounds)))
            print(f"  ! {free / 1e9:.0f} GB free, {need / 1e9:.0f} GB wanted: {rounds} sync rounds", flush=True)
        wipe()
        for rnd in range(rounds):
            rnd_dest[0] = rnd
            shutil.rmtree(Path(b.env["TPURUN_HOME"]) / "sync-cache", ignore_errors=True)  # a first sync hashes too
            order = ["tpurun", "rsync"] if rnd % 2 == 0 else ["rsync", "tpurun"]
            for phase in ("first", "no-op", "one file"):
                if phase == "one file":
                    change(True)
                for name in order:  # A B within each phase: same tree state for both
                    got[name][phase].append(fns[name]())
            change(False)
        wipe()
        out: dict[str, Any] = {"files": files, "mb": mb, "workers": len(node.workers), "rounds": rounds}
        for name, phases in got.items():
            out[name] = {ph: common.summary(s) for ph, s in phases.items()}
        for ph in ("first", "no-op", "one file"):
            t, r = out["tpurun"][ph], out["rsync"][ph]
            print(
                f"  sync {len(node.workers):>3} workers {ph:>8}: tpurun {t['median']:.2f}s [{t['min']:.2f}-{t['max']:.2f}]"
                f" cpu {t['cpu_median']:.2f}s | rsync x{len(node.workers)} {r['median']:.2f}s [{r['min']:.2f}-{r['max']:.2f}]"
                f" cpu {r['cpu_median']:.2f}s | ratio {t['median'] / r['median']:.2f}",
                flush=True,
            )
        return out

    # ------------------------------------------------------------------ WAN

    def wan(self, node: common.Node) -> dict[str, Any]:
        from tpurun.testing.latency_proxy import ProxyGroup

        b = self.bench
        group = ProxyGroup(rtt=0.0)
        one = self.work / "onefile"
        one.mkdir(exist_ok=True)
        counter = [0]
        out: dict[str, Any] = {}
        try:
            env, proxied = b.behind(group, node)

            def sync_one() -> common.Sample:
                counter[0] += 1
                (one / "a.txt").write_text(f"version {counter[0]}\n")
                t = time.time_ns() - 10 * 10**9
                os.utime(one / "a.txt", ns=(t, t))
                return common.timed([*common.tpurun_bin(), "--plain", "sync", "--tpu", node.name], env, one)

            sync_one()  # the directory exists on every worker: later runs send the one changed file
            for rtt_ms in self.args.rtts:
                group.set_rtt(rtt_ms / 1000)
                out[str(rtt_ms)] = common.interleave(
                    {
                        "tpurun exec": lambda: self.c.tpurun(node, env),
                        "floor": lambda: self.c.floor(proxied),
                        "tpurun sync 1 file": sync_one,
                    },
                    self.args.reps,
                    label=f"{rtt_ms:>3} ms RTT ",
                )
        finally:
            group.close()
        base = out[str(RTTS_MS[0])]
        for rtt_ms in self.args.rtts[1:]:
            row = out[str(rtt_ms)]
            f = row["floor"]["median"]
            for name, r in row.items():
                r["round_trips"] = (r["median"] - base[name]["median"]) / (rtt_ms / 1000)
            for name, r in row.items():
                if name != "floor":
                    r["beyond_floor_rtt"] = (r["median"] - f) / (rtt_ms / 1000)
                    r["beyond_floor_rtt_net"] = r["round_trips"] - row["floor"]["round_trips"]
        return out


# ---------------------------------------------------------------------- report


def plots(res: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    launch_bench.plots({"launch": res["launch"], "wan": None})  # launch_vs_workers.png
    w = res.get("wan")
    if w:
        rtts = sorted(int(r) for r in w)
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name, style in [("tpurun exec", "o-"), ("floor", "k:"), ("tpurun sync 1 file", "s-")]:
            ax.plot(rtts, [w[str(r)][name]["median"] * 1000 for r in rtts], style, label=name)
        ax.plot(
            rtts,
            [w[str(r)]["floor"]["median"] * 1000 + r for r in rtts],
            "g--",
            alpha=0.6,
            label="floor + 1 RTT (exec target)",
        )
        ax.set(
            xlabel="RTT (ms)",
            ylabel="wall time (ms), median",
            title=f"{res['wan_workers']} workers behind the latency proxy",
        )
        ax.set_xticks(rtts)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(common.BENCH_DOCS / "rtt.png", dpi=110)
        plt.close(fig)
    s = res.get("sync")
    if s:
        phases = ["first", "no-op", "one file"]
        sizes = sorted(s, key=int)
        fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
        for ax, n in zip(axes[0], sizes, strict=True):
            x = range(len(phases))
            for k, (name, color) in enumerate([("tpurun", "C0"), ("rsync", "C1")]):
                med = [s[n][name][p]["median"] for p in phases]
                lo = [m - s[n][name][p]["min"] for m, p in zip(med, phases, strict=True)]
                hi = [s[n][name][p]["max"] - m for m, p in zip(med, phases, strict=True)]
                label = "tpurun sync" if name == "tpurun" else f"rsync -a -e ssh x{n}"
                ax.bar([i + (k - 0.5) * 0.38 for i in x], med, 0.38, yerr=[lo, hi], capsize=3, color=color, label=label)
            ax.set_xticks(list(x), phases)
            ax.set(ylabel="seconds (median, min-max)", title=f"{s[n]['files']} files, {s[n]['mb']} MB to {n} workers")
            ax.grid(alpha=0.3, axis="y")
            ax.legend()
        fig.tight_layout()
        fig.savefig(common.BENCH_DOCS / "sync.png", dpi=110)
        plt.close(fig)


def ms(x: float) -> str:
    return f"{x * 1000:.0f}"


def tables(res: dict[str, Any]) -> str:
    m = res["machine"]
    L = [
        f"Measured {m['date']} on {common.machine_line(m)}; load average (1/5/15 min) {res['load_before']} "
        f"before and {res['load_after']} after; {res['reps']} interleaved repetitions after one warm-up round; "
        f"`{res['command']}` ({res['seconds']:.0f} s).",
        "",
        "### Launch: `true` on every worker",
        "",
        *launch_bench.launch_rows(res["launch"]),
    ]
    L += ["", "![launch time vs workers](bench/launch_vs_workers.png)", ""]
    if res.get("train"):
        L += [
            "### `tpurun train`: invocation to every core started",
            "",
            f"`tpurun --plain train start.py --runtime cpu --cores 1 --python {common.WORKER_PYTHON}` (one core per worker; the "
            "script's first statement prints `time.time()`; includes the code sync, agent upload and start).",
            "",
            "| workers | all cores started, median (ms) | min-max (ms) | tpurun exit, median (ms) | client CPU (ms) | client peak RSS (MiB) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for n, r in sorted(res["train"].items(), key=lambda kv: int(kv[0])):
            a, e = r["all_cores_started"], r["exit"] or {}
            L.append(
                f"| {n} | {ms(a['median'])} | {ms(a['min'])}-{ms(a['max'])} | {ms(e.get('median', float('nan')))} "
                f"| {ms(e.get('cpu_median', float('nan')))} | {e.get('rss_mib_max', float('nan')):.0f} |"
            )
        L.append("")
    w = res.get("wan")
    if w:
        L += [
            f"### WAN: {res['wan_workers']} workers behind the latency proxy",
            "",
            "Round trips = (median − median at 0 ms) / RTT. “Beyond floor” = (median − floor's median) / RTT; "
            "“net” subtracts the floor's own round trips (so fixed CPU cost cancels). The API call is not behind the proxy.",
            "",
            "| RTT (ms) | contender | median (ms) | min-max (ms) | round trips vs 0 ms | beyond floor (RTTs) | net beyond floor (RTTs) |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for rtt, row in sorted(w.items(), key=lambda kv: int(kv[0])):
            for name, r in row.items():
                f = {
                    k: f"{r[k]:.1f}" if k in r else ""
                    for k in ("round_trips", "beyond_floor_rtt", "beyond_floor_rtt_net")
                }
                L.append(
                    f"| {rtt} | {name} | {ms(r['median'])} | {ms(r['min'])}-{ms(r['max'])} | {f['round_trips']} "
                    f"| {f['beyond_floor_rtt']} | {f['beyond_floor_rtt_net']} |"
                )
        L += ["", "![launch time vs RTT](bench/rtt.png)", ""]
    s = res.get("sync")
    if s:
        L += [
            "### Sync: `tpurun sync` vs parallel `rsync -a -e ssh`",
            "",
            "| workers | tree | phase | tpurun median (s) | min-max | rsync median (s) | min-max | tpurun / rsync | tpurun CPU (s) | rsync CPU, all (s) |",
            "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for n, r in sorted(s.items(), key=lambda kv: int(kv[0])):
            for ph in ("first", "no-op", "one file"):
                t, q = r["tpurun"][ph], r["rsync"][ph]
                L.append(
                    f"| {n} | {r['files']} files, {r['mb']} MB | {ph} | {t['median']:.2f} | {t['min']:.2f}-{t['max']:.2f} "
                    f"| {q['median']:.2f} | {q['min']:.2f}-{q['max']:.2f} | {t['median'] / q['median']:.2f}× "
                    f"| {t['cpu_median']:.2f} | {q['cpu_median']:.2f} |"
                )
        L += ["", "![sync times](bench/sync.png)", ""]
    lg = res.get("logs")
    if lg:
        b = lg["best"]
        L += [
            "### Logs: lines delivered from every core",
            "",
            f"`tpurun --plain train lines.py {b['lines_per_core']} --runtime cpu --cores {b['cores']} --python {common.WORKER_PYTHON}` "
            f"on {b['workers']} workers × {b['cores']} cores, stdout to a file, every line checked by content.",
            "",
            "| run | lines delivered / expected | wall (s) | lines/s | lost | duplicated | mangled | in order per core | client CPU (s) | peak RSS (MiB) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
        ]
        for i, r in enumerate(lg["runs"], 1):
            L.append(
                f"| {i} | {r['delivered']:,} / {r['expected']:,} | {r['wall']:.1f} | {r['lines_per_s']:,.0f} | {r['lost']} "
                f"| {r['duplicated']} | {r['mangled']} | {r['in_order_per_core']} | {r['cpu']:.1f} | {r['rss_mib']:.0f} |"
            )
        L.append("")
    st = res.get("stop")
    if st:
        L += [
            "### Stop latency",
            "",
            "“Gone”: from the event to the moment no process of the job is left in any worker's pid namespace "
            "(polled every 10 ms through the emulator); “exit”: to tpurun's exit. Failure: core 0 of worker 1 "
            "prints its time and exits 3 one second after start; SIGINT: sent to tpurun once every core runs.",
            "",
            "| event | workers × cores | runs | gone p50 (ms) | gone p95 (ms) | gone max (ms) | exit p50 (ms) | exit p95 (ms) | exit codes | processes left at exit |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
        ]
        for mode, r in st.items():
            g, e = r["gone"], r["exit"]
            L.append(
                f"| {mode} | {r['workers']} × {r['cores']} | {g['n']} | {ms(g['median'])} | {ms(g['p95'])} | {ms(g['max'])} "
                f"| {ms(e['median'])} | {ms(e['p95'])} | {', '.join(map(str, r['exit_codes']))} | {r['left_after_exit']} |"
            )
        L.append("")
    return "\n".join(L)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick", action="store_true",
        help="8 and 32 workers, 3 repetitions; sync of a 1,000-file 20 MB tree to 8 workers; WAN at 0 and 50 ms",
    )  # fmt: skip
    ap.add_argument("--sizes", help="comma-separated worker counts (default 8,32,64,128; --quick 8,32)")
    ap.add_argument("--reps", type=int, help="repetitions (default 3 quick, 5 full)")
    ap.add_argument(
        "--only", help="comma-separated subset of launch,train,wan,sync,logs,stop; or relays (not by default)"
    )
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = ap.parse_args()
    q = args.quick
    args.sizes = [int(x) for x in args.sizes.split(",")] if args.sizes else ([8, 32] if q else [8, 32, 64, 128])
    args.reps = args.reps or (3 if q else 5)
    args.sync_reps = 2 if q else 3
    args.stop_reps = 3 if q else 10
    args.rtts = [0, 50] if q else RTTS_MS  # --quick: the target's RTT only
    args.log_reps = 1 if q else 2
    lines = 5_000 if q else 100_000
    files, mb = (1000, 20) if q else (5000, 100)
    sync_sizes = {8} if q else {8, 32}
    only = set(args.only.split(",")) if args.only else {"launch", "train", "wan", "sync", "logs", "stop"}
    command = "sudo scripts/bench/run " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    res: dict[str, Any] = {
        "machine": common.machine(),
        "load_before": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "reps": args.reps,
        "command": command.strip(),
        "quick": q,
        "launch": {},
        "train": {},
        "sync": {},
    }
    t0 = time.monotonic()
    if "relays" in only:  # its own emulator and pods, up to 1,024 workers
        relay_argv = ["--sizes", "32,256,1024", "--reps", str(min(args.reps, 2)), "--wan", "--created"]
        here = Path(__file__).resolve().parent
        write = [] if args.no_write else ["--write"]
        subprocess.run([sys.executable, str(here / "relay_bench.py"), *relay_argv, *write])
        jobs_argv = ["--reps", str(min(args.reps, 2))]
        subprocess.run([sys.executable, str(here / "relay_jobs_bench.py"), "--sizes", "32,256", *jobs_argv, *write])
        subprocess.run([sys.executable, str(here / "relay_jobs_bench.py"), "--sizes", "512", "--reps", "1", *write])
        only.discard("relays")
        if not only:
            return 0
    with common.bench_emulator() as bench:
        run = Run(bench, args)
        c = run.c
        for n in args.sizes:
            node = bench.create(n)
            if "launch" in only:
                res["launch"][str(n)] = common.interleave(
                    {
                        "tpurun": lambda node=node: c.tpurun(node),
                        "pdsh": lambda h=node.workers: c.pdsh(h),
                        "parallel-ssh": lambda h=node.workers: c.pssh(h),
                        "floor": lambda h=node.workers: c.floor(h),
                    },
                    args.reps,
                    label=f"{n:>3} workers ",
                )
            if "train" in only and n in (8, 32):
                res["train"][str(n)] = run.train_start(node)
            if "sync" in only and n in sync_sizes:
                res["sync"][str(n)] = run.sync(node, files, mb)
            if n == 8:
                if "logs" in only:
                    res["logs"] = run.logs(node, lines)
                if "stop" in only:
                    res["stop"] = run.stop(node, cores=4)
                if "wan" in only:
                    res["wan"] = run.wan(node)
                    res["wan_workers"] = n
            bench.delete(node)
    res["seconds"] = round(time.monotonic() - t0, 1)
    res["load_after"] = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"done in {res['seconds']:.0f}s (load {res['load_before']} -> {res['load_after']})")
    if args.no_write:
        print(tables(res))
        return 0
    name = "results-quick.json" if q else "results.json"
    common.write_json(common.BENCH_DOCS / name, res)
    plots(res)
    common.replace_section(common.DOCS / "benchmarks.md", "results", tables(res), "## Results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
