"""How a job ended: one word for it (`End`), decided from facts in one place (`judge`), told the same by `train`,
`jobs`, `logs`, every `--json` and the exit code; and how many restarts each cause of an end may cost.

| end | what happened | exit code | restart budget (`--restarts`) |
| --- | --- | --- | --- |
| finished | every process exited 0 | 0 | - |
| failed | a process of the job failed on its own (the program) | 1 | program |
| hung | no progress for `--hang-timeout`, stopped (`--on-hang stop`) | 124 | program |
| budget | its `--budget` was spent: its workers' supervisors stopped it (job/spend_limit.py) | 125 | - |
| stopped | the user stopped it (Ctrl-C, SIGTERM, `tpurun cancel`) | 130 | - |
| preempted | its TPU (a slice, a VM of it) was preempted, or is gone | 75 | preempted |
| maintenance | maintenance of a host of it cut it short (the host went, or was announced to go) | 75 | maintenance |
| lost | a worker was lost with no preemption or maintenance to explain it | 75 | infra |

A notice the job received (maintenance or preemption announced for one of its workers) decides before anything
else: the processes it told or stopped exit non-zero or by a signal, which is not the program's failure; whatever
`--on-notice` said, such an end is the notice's. 75 is sysexits' EX_TEMPFAIL: the job was cut short by the
infrastructure and its restart budget did not cover it; running it again is the remedy (docs/train.md).
"""

from __future__ import annotations

import re
import signal
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from tpurun import ui
from tpurun.errors import ExitCode, UsageError
from tpurun.worker.protocol import HOST, Notice, NoticeKind
from tpurun.worker.protocol_calls import ON_FILE, ON_SIGNAL, ON_STOP


class End(str, Enum):
    """How a job ended (the table above)."""

    FINISHED = "finished"
    FAILED = "failed"
    HUNG = "hung"
    BUDGET = "budget"
    STOPPED = "stopped"
    PREEMPTED = "preempted"
    MAINTENANCE = "maintenance"
    LOST = "lost"

    def __str__(self) -> str:
        return self.value

    def describe(self) -> str:
        return _ROWS[self][2]

    @property
    def exit_code(self) -> ExitCode:
        return _ROWS[self][1]

    @property
    def cause(self) -> str:
        """The restart budget an end of this kind draws on (`--restarts` names it; `TPURUN_RESTART_REASON`),
        "" where none may be restarted."""
        return _ROWS[self][0]

    @property
    def cut_short(self) -> bool:
        """Whether the infrastructure, not the program nor the user, ended the job."""
        return self.exit_code is ExitCode.TEMPFAIL

    @classmethod
    def of_notice(cls, kind: NoticeKind) -> End:
        return cls.PREEMPTED if kind is NoticeKind.PREEMPTED else cls.MAINTENANCE

    @classmethod
    def read(cls, word: str) -> End | None:
        """An end as a job's record keeps it; None for "" (not ended, or not known). Records written before the
        ends had one word kept the cause there: read as the end it stood for."""
        if not word:
            return None
        return cls(_OLD.get(word, word))


_ROWS = {  # end: (its restart budget, its exit code, what it means)
    End.FINISHED: ("", ExitCode.OK, "every process exited 0"),
    End.FAILED: ("program", ExitCode.PROGRAM_FAILED, "a process of the job failed"),
    End.HUNG: ("program", ExitCode.HUNG, "it made no progress for --hang-timeout and was stopped"),
    End.BUDGET: ("", ExitCode.BUDGET, "its --budget was spent; it was stopped"),
    End.STOPPED: ("", ExitCode.INTERRUPTED, "stopped by the user"),
    End.PREEMPTED: ("preempted", ExitCode.TEMPFAIL, "its TPU was preempted"),
    End.MAINTENANCE: ("maintenance", ExitCode.TEMPFAIL, "maintenance of a host of its TPU cut it short"),
    End.LOST: ("infra", ExitCode.TEMPFAIL, "a worker was lost (the TPU is neither preempted nor in maintenance)"),
}
_OLD = {"program": "failed", "user": "stopped", "infra": "lost"}
CAUSES = {row[0]: end for end, row in _ROWS.items() if row[0] and end is not End.HUNG}  # program -> FAILED, ...
SHARED = ("preempted", "infra")  # what --max-restarts counts, together
_ITEM = re.compile(r"^\s*([a-z]+)\s*=\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class Facts:
    """What is known of an ended attempt or of a job's states, for `judge`."""

    notice: Notice | None = None  # the first notice of a host event any worker heard of
    user: bool = False  # the user stopped it (Ctrl-C here, or every worker says stopped on request)
    hung: bool = False  # --on-hang stop stopped it
    spent: bool = False  # a worker's supervisor stopped it at its --budget (its part says spent)
    failed: bool = False  # a process failed on its own (its exit code not 0, or it died)
    lost: End | None = None  # a worker was lost (a supervisor, a VM, SSH): what the API says of it (LOST if nothing)
    all_zero: bool = False  # every process exited 0


def judge(f: Facts) -> End:
    """The one end of a job from what is known of it. A stop the user asked for is theirs; a notice decides next
    (a job it cut short is never a program failure, however its script exited; only a job that finished by itself
    after a notice it was merely told of through the file is finished); then a hang, a lost worker (the API's
    word for it: preempted or maintenance outrank a failure its loss caused), a failure. A spent --budget comes
    second: its stop makes the processes end as any stop does."""
    if f.user:
        return End.STOPPED
    if f.spent:
        return End.BUDGET
    if f.notice is not None:
        if f.all_zero and f.lost is None and not f.hung and f.notice.action == ON_FILE:
            return End.FINISHED
        return End.of_notice(f.notice.kind)
    if f.hung:
        return End.HUNG
    if f.lost in (End.PREEMPTED, End.MAINTENANCE):
        return f.lost
    if f.failed:
        return End.FAILED
    if f.lost is not None:
        return f.lost
    return End.FINISHED if f.all_zero else End.STOPPED


@dataclass
class Budgets:
    """How many restarts each cause of an end may cost a job: `--restarts CAUSE=N,...` for a cause on its own, and
    `--max-restarts N` for preemption and infrastructure together (where `--restarts` does not name them)."""

    own: dict[str, int] = field(default_factory=dict)
    shared: int = 0
    used: Counter[str] = field(default_factory=Counter)

    @classmethod
    def parse(cls, text: str, max_restarts: int = 0) -> Budgets:
        """`program=1,preempted=3` (causes: program, preempted, maintenance, infra); UsageError otherwise."""
        own: dict[str, int] = {}
        for item in filter(None, (t.strip() for t in text.split(","))) if text else ():
            m = _ITEM.match(item)
            if not m:
                raise UsageError(f"bad --restarts item {item!r}: expected KIND=N, e.g. preempted=3")
            kind, n = m.group(1), int(m.group(2))
            if kind not in CAUSES:
                raise UsageError(f"unknown kind {kind!r} in --restarts: the kinds are {', '.join(CAUSES)}")
            if n < 0:
                raise UsageError(f"--restarts {kind}={n}: a number of restarts cannot be negative")
            own[kind] = n
        if max_restarts < 0:
            raise UsageError("--max-restarts cannot be negative")
        return cls(own, max_restarts)

    @property
    def total(self) -> int:
        """Restarts of every cause so far (TPURUN_RESTART_COUNT)."""
        return sum(self.used.values())

    def limit(self, end: End) -> int:
        cause = end.cause
        if cause in self.own:
            return self.own[cause]
        return self.shared if cause in SHARED else 0

    def spent(self, end: End) -> int:
        cause = end.cause
        if cause in self.own or cause not in SHARED:
            return self.used[cause]
        return sum(self.used[c] for c in SHARED if c not in self.own)

    def spend(self, end: End) -> bool:
        """Count one restart for END's cause if its budget allows it; False (nothing counted) when it is used up,
        or END is not restarted (finished, stopped)."""
        if not end.cause or self.spent(end) >= self.limit(end):
            return False
        self.used[end.cause] += 1
        return True

    def left(self, end: End) -> str:
        """`1/3`: restarts END's cause has cost of its budget."""
        return f"{self.spent(end)}/{self.limit(end)}"

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {cause: {"used": self.spent(end), "budget": self.limit(end)} for cause, end in CAUSES.items()}


def failure(worker: str, slot: int | None, code: int | None) -> str:
    """Which process failed first and how, as every view names it: `w0/c3: exit code 1` (a host launch's process
    `w0`; a process that died without a code, its name alone)."""
    where = worker if slot is None or slot == HOST else f"{worker}/c{slot}"
    return where + (f": exit code {code}" if code is not None else "")


def hint(end: End) -> str:
    """How to let END's kind of end be restarted."""
    if end.cause in SHARED:
        return f"--max-restarts N (or --restarts {end.cause}=N) relaunches after such an end"
    return f"--restarts {end.cause}=N relaunches after such an end"


def notice_line(notice: Notice, worker: str) -> str:
    """One line on a notice: `maintenance announced for w1 (the host may go in 58 s): SIGTERM to every process`."""
    import time

    when = ""
    if notice.deadline is not None:
        left = notice.deadline - time.time()
        when = f" (the host may go in {ui.age(left)})" if left > 0 else " (the host may go now)"
    action = notice.action or "none"
    told = {ON_FILE: "written to the file in $TPURUN_NOTICE_FILE", ON_STOP: "stopping the job"}.get(action)
    if told is None and action.startswith(ON_SIGNAL):
        told = f"{action[len(ON_SIGNAL) :]} to every process"
    return f"{notice.kind.value} announced for {worker}{when}: {told or action} (--on-notice {action})"


def on_notice(text: str | None, framework: str) -> str:
    """`--on-notice` as the agent takes it: `signal:SIGTERM`, `file` or `stop`; UsageError for anything else. The
    default fits the runtime: a JAX job gets SIGTERM, which is what JAX's preemption sync listens for (its
    notifier is the "sigterm" one); any other job gets the file, which harms no script that does not read it."""
    if text is None:
        return f"{ON_SIGNAL}SIGTERM" if framework == "jax" else ON_FILE
    word = text.strip()
    if word in (ON_FILE, ON_STOP):
        return word
    if word.lower().startswith(ON_SIGNAL):
        name = word[len(ON_SIGNAL) :].strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in signal.Signals.__members__ and name not in ("SIGKILL", "SIGSTOP"):
            return ON_SIGNAL + name
        raise UsageError(
            f"unknown signal {word[len(ON_SIGNAL) :]!r} in --on-notice: e.g. signal:SIGTERM or signal:SIGUSR1"
        )
    raise UsageError(f"bad --on-notice {text!r}: expected signal:SIGNAME, file or stop")
