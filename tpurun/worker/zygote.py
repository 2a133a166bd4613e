"""A relay's zygote: the bundle's agent and sync helper forked on a worker, not started anew.

A relay forks its zygote first thing, while it has no thread (a process with threads must not fork and go on
running Python). Asked to run one of the bundle's PROGRAMS with some arguments and an environment on three
descriptors, the zygote forks: the child takes them as its stdin, stdout and stderr in a session of its own, as
sshd starts a command, the environment as its own, and runs the program's `main`, as `python agent.py ARGS`
would (the relay runs with the same interpreter and flags, so the child's interpreter is the one that command
would have). The zygote loads the programs' modules once, at its first request, and freezes them out of its
collector's reach: every child forked after, and the job's supervisor each agent forks, shares those pages
instead of loading its own, and no interpreter starts. The zygote says each child's pid, then its exit status;
it ends when its relay does, or once, asked for an agent before, it has had no child and no request for
IDLE_SECONDS (a job's start is over: a running job costs its workers less without it; the relay starts any
later program as a program). A job's sync comes before its agents: the zygote outlives it.

A forked agent that claims its worker and starts an attached job leaves its stream to the relay (`stream_claimed`,
a thread of the relay's; the agent ends with AgentExit.RELAY_STREAMS): the job's supervisor keeps that agent's
stdin, whose other end the relay holds, and stops the job at its end. While a relayed job runs, its worker has two
processes of tpurun's, the relay and the job's supervisor (`tpurun-job`): no agent, and the zygote only until idle.

Part of the bundle (stdlib only, Python >= 3.8). The relay's side is `Zygote`; the zygote's own, `_serve`.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# the processes' names (a forked one's command line is the relay's); a job's supervisor's wherever it was forked
ZYGOTE_NAME, AGENT_NAME, SUPERVISOR_NAME = "tpurun-zygote", "tpurun-agent", "tpurun-job"
AGENT, SYNC_HELPER = "agent.py", "sync_helper.py"
PROGRAMS = {AGENT: AGENT_NAME, SYNC_HELPER: "tpurun-sync"}  # the bundle's programs a zygote forks: their names
FORK_SECONDS = 30.0  # a request's answer waited for, at most (the first loads the agent's modules)
IDLE_SECONDS = 2.0  # once asked for an agent, a zygote with no child and no request this long ends
REQUEST_BYTES = 1 << 20  # a request's largest (its arguments and environment); a larger one runs as a program
_FDS = array.array("i", [0, 0, 0]).itemsize * 3


class Forked:
    """A child of the zygote, as the relay holds a subprocess.Popen: its pid, its pipes, and its exit status."""

    def __init__(self, stdin: int, stdout: int, stderr: int) -> None:
        self.stdin = os.fdopen(stdin, "wb", buffering=0)
        self.stdout = os.fdopen(stdout, "rb", buffering=0)
        self.stderr = os.fdopen(stderr, "rb", buffering=0)
        self.pid = 0
        self.returncode: int | None = None
        self.known = threading.Event()  # its pid, or that it did not start
        self.ended = threading.Event()

    def wait(self) -> int:
        self.ended.wait()
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode

    def close(self) -> None:
        for f in (self.stdin, self.stdout, self.stderr):
            f.close()


class Zygote:
    """The relay's side: make it before any thread; `spawn` asks it for a program."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (mine, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, REQUEST_BYTES + 4096)
        self.pid = os.fork()
        if self.pid == 0:
            mine.close()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1):  # the relay's link up is the relay's alone
                os.dup2(null, fd)
            os.close(null)
            code = 1
            try:
                code = _serve(theirs)
            finally:
                os._exit(code)
        theirs.close()
        self.sock = mine
        self.lock = threading.Lock()
        self.number = 0
        self.children: dict[int, Forked] = {}  # request number -> its child
        self.gone = False
        threading.Thread(target=self._hear, name="zygote", daemon=True).start()

    def spawn(self, program: str, args: list[str], env: dict[str, str]) -> Forked | None:
        """PROGRAM (one of PROGRAMS) with ARGS and ENV, forked; None where the zygote cannot (the relay starts it
        as a program)."""
        request = json.dumps({"program": program, "args": args, "env": env}).encode()
        if len(request) > REQUEST_BYTES:
            return None
        theirs_in, mine_in = os.pipe()
        mine_out, theirs_out = os.pipe()
        mine_err, theirs_err = os.pipe()
        child = Forked(mine_in, mine_out, mine_err)
        with self.lock:
            self.number += 1
            number = self.number
            self.children[number] = child
            try:
                if self.gone:
                    raise OSError("the zygote ended")
                fds = array.array("i", [theirs_in, theirs_out, theirs_err])
                self.sock.sendmsg([b"%d " % number + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            except OSError:
                self.children.pop(number, None)
                child.known.set()
        for fd in (theirs_in, theirs_out, theirs_err):
            os.close(fd)
        given_up = not child.known.wait(FORK_SECONDS)
        if given_up:  # a zygote that does not answer is not asked again
            with self.lock:
                self.gone = True
                self.children.pop(number, None)
        if given_up or not child.pid:
            child.close()  # (a child forked after all has its stdin ended: it ends)
            return None
        return child

    def close(self) -> None:
        """The zygote told to end (its children run on: each ends with its own stdin)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # at once, though the thread hearing it is blocked reading it
        except OSError:
            pass

    def _hear(self) -> None:
        """The zygote's answers: `N pid P` once request N's child is forked (P 0: it was not), `N rc R` when it
        ended. At the zygote's end every child not yet heard of is taken as ended (-1)."""
        while True:
            try:
                data = self.sock.recv(256)
            except OSError:
                data = b""
            if not data:
                break
            number, what, value = data.split()
            with self.lock:
                child = self.children.get(int(number))
                if child is not None and what == b"rc":
                    del self.children[int(number)]
            if child is None:
                continue
            if what == b"pid":
                child.pid = int(value)
                child.known.set()
            else:
                child.returncode = int(value)
                child.ended.set()
        try:
            os.waitpid(self.pid, 0)  # it ended (or is ending): reaped, not left a zombie beside the relay
        except ChildProcessError:
            pass
        with self.lock:
            self.gone = True
            left, self.children = list(self.children.values()), {}
        for child in left:
            child.known.set()
            if child.returncode is None:
                child.returncode = -1
            child.ended.set()


def name_self(name: str) -> None:
    """This process's name (what `ps` and `top` show; its command line stays the relay's)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


def _serve(sock: socket.socket) -> int:
    """The zygote: forks a child for each request on SOCK, reaps them, says both; returns at SOCK's end."""
    name_self(ZYGOTE_NAME)
    for sig in (signal.SIGHUP, signal.SIGTERM):  # the relay's handlers: this process ends with its socket
        signal.signal(sig, signal.SIG_DFL)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    numbers: dict[int, int] = {}  # pid -> request number
    loaded = agents = False
    while True:
        ready, _, _ = select.select([sock.fileno(), wake_r], [], [], IDLE_SECONDS if agents and not numbers else None)
        if not ready:
            return 0  # idle: the relay starts what it is asked for from now on
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock, numbers)
        if sock.fileno() not in ready:
            continue
        try:
            data, ancillary, _, _ = sock.recvmsg(REQUEST_BYTES + 64, socket.CMSG_SPACE(_FDS))
        except InterruptedError:
            continue
        if not data:
            return 0
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        number, _, body = data.partition(b" ")
        request = json.loads(body)
        agents = agents or request["program"] == AGENT
        if not loaded:
            _load()
            loaded = True
        settled_r, settled_w = os.pipe()  # its end: the child has its own session (a killpg of it reaches it)
        pid = os.fork() if len(fds) == 3 else -1
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()
            for fd in (wake_r, wake_w, settled_r, settled_w, sock.detach()):
                os.close(fd)
            _become(request, list(fds))
        os.close(settled_w)
        while pid > 0 and os.read(settled_r, 1):
            pass
        os.close(settled_r)
        for fd in fds:
            os.close(fd)
        if pid > 0:
            numbers[pid] = int(number)
        sock.send(b"%s pid %d" % (number, max(pid, 0)))


def _reap(sock: socket.socket, numbers: dict[int, int]) -> None:
    while numbers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        number = numbers.pop(pid, None)
        if number is not None:
            rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            sock.send(b"%d rc %d" % (number, rc))


def _load() -> None:
    """The programs' modules, the job supervisor's with them, loaded here once for every child; then frozen, so
    that neither this process's collector nor a child's writes to the pages they share."""
    import gc

    import agent  # noqa: F401
    import agent_supervisor  # noqa: F401
    import sync_helper  # noqa: F401

    gc.freeze()


def _become(request: dict[str, Any], fds: list[int]) -> None:
    """This child of the zygote made the program the request asks for; it never returns."""
    code = 1
    try:
        name_self(PROGRAMS[request["program"]])
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115 (the process's own, as Python makes it)
        sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
        try:
            code = _run(request["program"], list(request["args"]))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run(program: str, args: list[str]) -> int:
    """PROGRAM's main with ARGS, as `python PROGRAM ARGS` runs it (bundle.RUN)."""
    if program == SYNC_HELPER:
        import sync_helper

        sys.argv = [sync_helper.__file__, *args]
        return sync_helper.main()
    import agent
    import protocol

    if args[:1] == ["--first"] and len(args) >= 3:  # as bundle.RUN does: the input in the environment
        os.environ[protocol.FIRST_INPUT] = args[2]
        args = ["--first", args[1], *args[3:]]
    sys.argv = [agent.__file__, *args]
    agent.RELAY_STREAMS = True  # the relay that asked for this process streams the job it claims and starts
    return agent.main(args)


def claimed_job(args: list[str] | None) -> str:
    """The job an agent's ARGS claim a worker for (`preflight --claim JOB`), or ""."""
    if not args or args[0] != "preflight" or "--claim" not in args[:-1]:
        return ""
    return args[args.index("--claim") + 1]


def stream_claimed(job: str, send: Callable[[bytes, bool], None], lifeline: threading.Event, pace: Any) -> int:
    """JOB's stream, attached, through SEND (its output; True: its errors), in the relay whose forked agent claimed
    and started it and then ended with AgentExit.RELAY_STREAMS (the job's supervisor holds that agent's stdin: at
    its end, the job stops; the stream sends its last records). LIFELINE: set at that end, waking PACE. Returns
    the exit status the agent's own stream would have had."""
    import agent

    class Up:  # agent.stream_job's output: pieces well under a relay frame's largest
        def write(self, data: bytes) -> None:
            for at in range(0, len(data), 1 << 20):
                send(data[at : at + (1 << 20)], False)

        def flush(self) -> None:
            pass

    try:
        return agent.stream_job(job, Up(), pace, follow=True, lifeline=lifeline, offsets={}, held=True)
    except agent.AgentError as e:
        send(f"tpurun agent: {e}\n".encode(), True)
        return e.code
