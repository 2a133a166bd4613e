"""A job's lines on their way into its slots' files: a process's output read whole lines at a time (`pump`),
and the own channel of each Python process of the job the agent did not start itself (`Channel`). Part of the
agent bundle (stdlib only, Python >= 3.8).

Every process the agent starts writes into pipes of its own. Every other Python process of the job (a
spawner's child, a helper the script runs) gets channels of its own from the hook at its start, before any
import of the script's: no two processes' bytes meet in one line, and each channel is cut into lines on its
own. A channel is filed under the slot its process inherited (a chip's, or the host's). The child of a
spawner (a multiprocessing child of the host's tree: it may yet be given a chip) has its lines held until
the hook names its chip, then filed under that chip, in order, with the time each was read. A line waits
`HOLD` seconds at most (or until `HOLD_BYTES` wait): then, and at the channel's end, the held lines and
those after are filed under the host's slot, each starting with `[pid N] `, until the process names its
chip."""

from __future__ import annotations

import os
import threading

from agent_files import MAX_LINE, now

# seconds a spawner's child's line waits for its chip: a child imports torch (and torch_xla or torch_tpu)
# before it learns its rank, which 8 children at once on 2 busy cores took 40 s to do
HOLD = 120.0
HOLD_BYTES = 4 << 20  # what a child may print before its chip is known before its lines go out untagged
STDIO = "TPURUN_STDIO"  # the job's channels (dev:ino, comma-separated) a Python process replaces with its own


def stdio_id(fd: int) -> str:
    """The identity the hook compares a process's fd 1 and 2 with (`STDIO`): dev:ino of the pipe or socket."""
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"


def spawned_child(pid: int) -> bool:
    """Whether PID is a child multiprocessing started by running Python anew (what torch.multiprocessing.spawn,
    xmp.spawn and Lightning's spawners make): it may yet be given a chip."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"\0--multiprocessing-fork" in f.read()
    except OSError:
        return False


def pump(pipe, write) -> None:
    """Read PIPE until its end, WRITE(lines) for every complete line it holds (then at once: no line waits
    in a buffer for more output; a flood costs one write per chunk, not per line), the partial last line at
    the end."""
    read = pipe.read1 if hasattr(pipe, "read1") else pipe.read
    rest = b""
    try:
        while True:
            try:
                chunk = read(1 << 16)
            except OSError:  # a process's socket, reset as it died
                chunk = b""
            if not chunk:
                break
            data = rest + chunk
            cut = data.rfind(b"\n") + 1
            if cut == 0 and len(data) < MAX_LINE:
                rest = data
                continue
            if cut == 0:  # an endless line: cut it into records rather than hold it all
                lines, rest = [data], b""
            else:
                lines = [line + b"\n" for line in data[:cut].split(b"\n")[:-1]]
                rest = data[cut:]
            write(lines)
        if rest:
            write([rest])  # the partial last line, at the end
    finally:
        pipe.close()


class Channel:
    """One Python process's own stdout or stderr, filed under SLOT (an object with `write_lines(source,
    lines, t)`), or held there for its chip (HOLD)."""

    def __init__(self, pid: int, source, slot, hold: bool) -> None:
        self.pid = pid
        self.source = source
        self.slot = slot
        self.lock = threading.Lock()
        self.held: list | None = [] if hold else None  # (time read, lines) while its chip is not known
        self.since = 0.0  # when its first held line was read
        self.size = 0
        self.mark = b""  # each line's start while it is filed as its pid's
        self.thread: threading.Thread | None = None

    def write(self, lines: list) -> None:
        """The pump's lines: filed, or held."""
        with self.lock:
            if self.held is None:
                self.slot.write_lines(self.source, [self.mark + x for x in lines] if self.mark else lines)
                return
            t = now()
            if not self.held:
                self.since = t
            self.held.append((t, lines))
            self.size += sum(len(x) for x in lines)
            if self.size > HOLD_BYTES:
                self._release()

    def bind(self, slot) -> None:
        """Its process named its chip (SLOT): what it held, then what follows, is that chip's."""
        with self.lock:
            self.slot, self.mark = slot, b""
            for t, lines in self.held or ():
                slot.write_lines(self.source, lines, t)
            self.held = None

    def overdue(self) -> bool:
        return bool(self.held) and now() - self.since > HOLD

    def release(self) -> None:
        """No chip in time (or the channel ended): its lines, held and to come, are its pid's."""
        with self.lock:
            self._release()

    def _release(self) -> None:
        if self.held is None:
            return
        self.mark = b"[pid %d] " % self.pid
        for t, lines in self.held:
            self.slot.write_lines(self.source, [self.mark + x for x in lines], t)
        self.held = None

    def follow(self, pipe, done) -> threading.Thread:
        """Pump PIPE into this channel on a thread of its own; DONE(self) once it ended (its lines filed)."""

        def run() -> None:
            try:
                pump(pipe, self.write)
            finally:
                self.release()
                done(self)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        return self.thread


class Channels:
    """The own channels of the job's processes, by pid, while they last."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_pid: dict[int, list[Channel]] = {}

    def add(self, ch: Channel) -> None:
        with self.lock:
            self.by_pid.setdefault(ch.pid, []).append(ch)

    def of(self, pid: int) -> list[Channel]:
        with self.lock:
            return list(self.by_pid.get(pid, ()))

    def ended(self, ch: Channel) -> None:
        with self.lock:
            left = [x for x in self.by_pid.get(ch.pid, ()) if x is not ch]
            if left:
                self.by_pid[ch.pid] = left
            else:
                self.by_pid.pop(ch.pid, None)

    def every(self) -> list[Channel]:
        with self.lock:
            return [ch for chs in self.by_pid.values() for ch in chs]

    def release_overdue(self) -> None:
        """Held lines that waited their time for a chip go out as their pid's."""
        for ch in self.every():
            if ch.overdue():
                ch.release()

    def drain(self, timeout: float) -> None:
        """The job is over: the last bytes of its processes, still in their channels, filed (TIMEOUT at most)."""
        deadline = now() + timeout
        for ch in self.every():
            if ch.thread is not None:
                ch.thread.join(max(0.0, deadline - now()))
            ch.release()
