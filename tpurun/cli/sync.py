"""`tpurun sync` and `tpurun download`: the command lines around tpurun.sync.sender and tpurun.sync.download
(options, progress bar, summary, exit code)."""

from __future__ import annotations

import os
import shlex
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated, TypeVar

import typer

from tpurun import ignore, settings, ui
from tpurun.cli import grouped
from tpurun.cli.options import JsonOpt, LocalOpt, ProjectOpt, RelayOpt, TpuOpt, ViaOpt, WorkerOpt, ZoneOpt, relay_flag
from tpurun.cli.output import stop_on_signals
from tpurun.errors import ExitCode, UsageError
from tpurun.naming import EACH_UP_TO, each_or_by_reason, listed, which
from tpurun.sync import download, report
from tpurun.sync.sender import default_dest, sync_dir
from tpurun.sync.stream import Counters, Interrupted, WorkerStats
from tpurun.worker.sync_helper import ErrorKind

T = TypeVar("T")


class _Bar:
    """A rich progress bar (bytes and files) fed from the sending threads' counters."""

    def __init__(self, progress: Counters, label: str = "sync") -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeElapsedColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as RichProgress

        self.counters = progress
        self.bar = RichProgress(
            TextColumn(label),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[files]}"),
            TimeElapsedColumn(),
            console=ui.err(),
            transient=True,
        )
        self.task = self.bar.add_task(label, total=None, files="")
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(0.1):
            c = self.counters
            self.bar.update(
                self.task,
                total=c.bytes_total or None,
                completed=c.bytes_done,
                files=f"{c.files_done}/{c.files_total} files",
            )

    def __enter__(self) -> _Bar:
        self.bar.start()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.bar.stop()


def _report(stats: list[WorkerStats], dest: str, json_out: bool, elapsed: float, manifest_info: dict) -> None:
    if json_out:
        ui.print_json(
            {
                "dest": dest,
                **manifest_info,
                "seconds": round(elapsed, 3),
                "workers": [s.to_json() for s in stats],
            }
        )
    else:
        _synced(stats, dest)
        if any(not s.error for s in stats):
            ui.info(f"synced {manifest_info['src']} to {dest} in {elapsed:.1f} s: {report.totals(stats).line()}")
    said = []
    for s in stats:
        label = f"{s.name} ({s.address})"
        if s.error:
            said.append((s.name, f"{label}: {s.error}" if not s.unreachable else s.error))
        if s.errors:
            path, kind, message = s.errors[0]
            where = f"{s.dest}/{path}" if s.dest else path
            verbs = {ErrorKind.WRITE: "cannot write", ErrorKind.VERIFY: "verification failed for"}
            verb = {**verbs, ErrorKind.DELETE: "cannot delete"}.get(kind, "cannot sync")
            more = f" (and {len(s.errors) - 1} more files)" if len(s.errors) > 1 else ""
            said.append((s.name, f"{label}: {verb} {where}: {message}{more}"))
    for line in each_or_by_reason(said, len(stats)):
        ui.err().print(f"error: {line}", markup=False)


def _synced(stats: list[WorkerStats], dest: str) -> None:
    """What each worker was sent: a line (piped) or a row each for a few workers, else one per outcome with
    its folded workers."""
    ended = []
    for s in stats:
        status = "failed" if s.error or s.errors else "ok"
        ended.append((s, (status, f"{s.files_sent}/{s.files_total}", ui.size(s.bytes_sent), s.deleted, s.dest or dest)))
    if len(stats) > EACH_UP_TO:
        groups = [
            (k, [s.name for s in members], [s.seconds for s in members]) for k, members in grouped.by_outcome(ended)
        ]
    else:
        groups = [(k, [s.name], [s.seconds]) for s, k in ended]
    if ui.is_plain():
        for (status, files, size, deleted, where), names, times in groups:
            print(
                f"[{which(names)}] {status}: sent {files} files, {size}, deleted {deleted}, {grouped.span(times)} -> {where}",
                flush=True,
            )
        return
    columns = ["worker", "files sent", "bytes", "deleted", "time", "result"]
    if len(stats) > EACH_UP_TO:
        columns = ["workers", *columns]
    rows = []
    for (status, files, size, deleted, _), names, times in groups:
        many = [f"{len(names):,}"] if len(stats) > EACH_UP_TO else []
        rows.append((*many, which(names), files, size, deleted, grouped.span(times), status))
    ui.table(f"synced to {dest}", columns, rows)


def _named_tpu_or_local(
    tpu: str | None,
    project: str | None,
    zone: str | None,
    local: bool,
    what: str,
    relay: bool | None,
    via: str | None = None,
) -> settings.Settings:
    """The settings, refused when they name no TPU and --local was not given: sync and download would
    otherwise copy on this machine without being asked to."""
    s = settings.resolve({"tpu": tpu, "project": project, "zone": zone, "relay": relay_flag(relay), "via": via})
    if not local and not s.tpu.value:
        raise UsageError(
            f"no TPU named: {what}; name one with --tpu NAME (or TPURUN_TPU, or tpu in tpurun.toml), or pass "
            "--local to copy on this machine"
        )
    return s


def sync_cmd(
    src: Annotated[
        str, typer.Argument(metavar="[SRC]", help="The directory to copy (default: the current one).")
    ] = ".",
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    dest: Annotated[
        str | None,
        typer.Option("--dest", "-d", help="Where on each worker (default ~/<name of SRC>; relative = under ~)."),
    ] = None,
    exclude: Annotated[
        list[str] | None, typer.Option("--exclude", "-x", help="Also skip this gitignore-style pattern (repeatable).")
    ] = None,
    delete: Annotated[
        bool, typer.Option("--delete", help="Remove files in dest that SRC no longer has (ignored files are kept).")
    ] = False,
    worker: WorkerOpt = "all",
    json_out: JsonOpt = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Incremental, content-checked copy of a directory to every selected worker at once."""
    source = Path(src).expanduser()
    if not source.is_dir():
        raise UsageError(f"{src} is not a directory: sync copies a directory (e.g. `tpurun sync .`)")
    source = source.resolve()
    destination = dest or default_dest(source)
    s = _named_tpu_or_local(tpu, project, zone, local, "sync copies a directory to a TPU's workers", relay, via)
    started = time.monotonic()
    stop = threading.Event()
    progress = Counters()
    with stop_on_signals(stop) as seen:
        pushed = _transfer(
            lambda: sync_dir(
                s, source, destination, local=local, worker_spec=worker, announce=ui.info, excludes=exclude or [],
                delete=delete, progress=progress, stop=stop, warn=ui.warn,
            ),
            progress, "sync", json_out, seen, "nothing half-written is left on the workers",
        )  # fmt: skip
        elapsed = time.monotonic() - started
    m = pushed.manifest
    info = {"src": str(source), "files": len(m.files) + len(m.links), "bytes": m.total_bytes, "hashed": m.hashed}
    _report(pushed.stats, pushed.dest, json_out, elapsed, info)
    raise typer.Exit(pushed.exit_code)


def _transfer(
    run: Callable[[], T], progress: Counters, label: str, json_out: bool, seen: dict[str, bool], left: str
) -> T:
    """RUN (a sync or download) under a progress bar on a terminal; Ctrl-C ends the command with exit 130,
    saying what is LEFT of the copy."""
    show_bar = not json_out and not ui.is_plain()
    result: T | None = None
    try:
        with _Bar(progress, label) if show_bar else nullcontext():
            result = run()
    except Interrupted:
        seen["interrupted"] = True
    if seen["interrupted"] or result is None:
        ui.err().print(f"interrupted: {left}", markup=False)
        raise typer.Exit(ExitCode.INTERRUPTED)
    return result


def download_cmd(
    path: Annotated[
        str, typer.Argument(metavar="PATH", help="A file or directory on the workers (relative: under the home).")
    ],
    dest: Annotated[
        str,
        typer.Argument(
            metavar="[DEST]", help="Where on this machine (default: here); from several workers, DEST/<worker>."
        ),
    ] = ".",
    tpu: TpuOpt = None,
    local: LocalOpt = False,
    project: ProjectOpt = None,
    zone: ZoneOpt = None,
    worker: WorkerOpt = "all",
    outside_home: Annotated[
        bool, typer.Option("--outside-home", help="Allow a PATH outside the worker's home directory.")
    ] = False,
    json_out: JsonOpt = False,
    relay: RelayOpt = None,
    via: ViaOpt = None,
) -> None:
    """Copy a file or directory (checkpoints, outputs) from every selected worker to this machine, only the
    files that changed since the last download."""
    s = _named_tpu_or_local(tpu, project, zone, local, "download copies from a TPU's workers", relay, via)
    into = Path(dest).expanduser()
    if into.exists() and not into.is_dir():
        raise UsageError(f"{dest} is not a directory: download puts what it copies into a directory")
    started = time.monotonic()
    stop = threading.Event()
    progress = Counters()
    with stop_on_signals(stop) as seen:
        got = _transfer(
            lambda: download.download_from(
                s, path, into, local=local, worker_spec=worker, announce=ui.info, outside_home=outside_home,
                progress=progress, stop=stop, here=Path.cwd(),
            ),
            progress, "download", json_out, seen, "no half-written file is left here",
        )  # fmt: skip
    _report_download(got.workers, json_out, time.monotonic() - started, into)
    _say_where(got)
    raise typer.Exit(got.exit_code)


def _shown(path: str | Path) -> str:
    """PATH relative to the current directory when it is under it, else as it is."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def _say_where(done: download.Downloaded) -> None:
    """One line on what the download means for git and the next sync: the directory it made and left out of
    both, or what it put here that the next `train` from here would send."""
    marked = sorted({g.marked for g in done.workers if g.marked})
    if marked:
        where = listed([_shown(m) + "/" for m in marked])
        it, its = ("it", "its") if len(marked) == 1 else ("them", "each one's")
        ui.info(
            f"{where}: made by this download, so git and `tpurun sync`/`train` leave {it} out "
            f"({its} .gitignore says so; delete that file to include {it})"
        )
    sent = done.sent
    if sent:
        rules = " ".join(shlex.quote(ignore.pattern(p)) for p in sent)
        ui.warn(
            f"{listed(sent)}: in this directory, so the next `tpurun train` or `tpurun sync` from here sends it "
            f"to every worker; to keep it here: printf '%s\\n' {rules} >> .tpurunignore"
        )


def _report_download(got: list[download.Fetched], json_out: bool, elapsed: float, into: Path) -> None:
    if json_out:
        ui.print_json({"seconds": round(elapsed, 3), "workers": [g.to_json() for g in got]})
    else:
        _fetched(got, into)
    said = []
    for g in got:
        if g.error:
            label = "" if g.unreachable else f"{g.name} ({g.address}): "
            said.append((g.name, f"{label}{g.error}"))
        for rel, message in g.errors[:3]:
            said.append((g.name, f"{g.name}: {rel}: {message}"))
        if len(g.errors) > 3:
            said.append((g.name, f"{g.name}: and {len(g.errors) - 3} more files"))
    for line in each_or_by_reason(said, len(got)):
        ui.err().print(f"error: {line}", markup=False)
    if any(g.outside_home for g in got):
        ui.err().print("hint: pass --outside-home to download a path outside the workers' home", markup=False)


def _fetched(got: list[download.Fetched], into: Path) -> None:
    """What came from each worker: a line each for a few workers, else one per outcome with its folded
    workers (each worker's own directory under INTO written DEST/<worker>); the symlinks left out alike."""
    done = [g for g in got if not g.error]
    many = len(got) > EACH_UP_TO
    ended = []
    for g in done:
        local = g.local.replace(str(into / g.name), str(into / "<worker>"), 1) if many else g.local
        ended.append((g, (g.files_fetched, g.files_total, ui.size(g.bytes_fetched), g.remote, local)))
    groups = grouped.by_outcome(ended) if many else [(k, [g]) for g, k in ended]
    for (fetched, total, size, remote, local), members in groups:
        names = [g.name for g in members]
        print(
            f"[{which(names)}] {fetched} of {total} files changed, {size}, "
            f"{grouped.span([g.seconds for g in members])}: {remote} -> {local}",
            flush=True,
        )
    skipped = [(g.name, f"{g.name}: {rel}: {why}") for g in done for rel, why in g.skipped]
    for line in each_or_by_reason(skipped, len(got)):
        ui.warn(line)
