"""Why a job ended, decided from facts, and how many restarts each kind of end may cost.

Every end of a job that did not finish is one of five kinds (docs/maintenance.md has the table and the facts
behind each row):

* program      a process of the job failed, or hung, on its own
* preempted    its TPU (a slice of it, a VM of it) was preempted, or is gone
* maintenance  a host of it went for maintenance
* infra        a worker was lost, SSH went, the TPU is unhealthy, with no preemption or maintenance to explain it
* user         the user stopped it (Ctrl-C, SIGTERM, `tpurun cancel`)

A notice the job received (maintenance or preemption announced for one of its workers) decides the kind before
anything else: the processes it stopped exit non-zero or by a signal, which is not the program's failure.
"""

from __future__ import annotations

import re
import signal
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from tpurun import ui
from tpurun.errors import UsageError
from tpurun.worker.protocol import Notice
from tpurun.worker.protocol_calls import ON_FILE, ON_SIGNAL, ON_STOP


class EndKind(str, Enum):
    PROGRAM = "program"
    PREEMPTED = "preempted"
    MAINTENANCE = "maintenance"
    INFRA = "infra"
    USER = "user"

    def describe(self) -> str:
        return _DESCRIBE[self]


_DESCRIBE = {
    EndKind.PROGRAM: "a process of the job failed",
    EndKind.PREEMPTED: "its TPU was preempted",
    EndKind.MAINTENANCE: "a host of its TPU went for maintenance",
    EndKind.INFRA: "a worker was lost (the TPU is neither preempted nor in maintenance)",
    EndKind.USER: "stopped by the user",
}
RESTARTABLE = (EndKind.PROGRAM, EndKind.PREEMPTED, EndKind.MAINTENANCE, EndKind.INFRA)
SHARED = (EndKind.PREEMPTED, EndKind.INFRA)  # what --max-restarts counts, together
_ITEM = re.compile(r"^\s*([a-z]+)\s*=\s*(-?\d+)\s*$")


@dataclass
class Budgets:
    """How many restarts each kind of end may cost a job: `--restarts KIND=N,...` for a kind on its own, and
    `--max-restarts N` for preemption and infrastructure together (where `--restarts` does not name them)."""

    own: dict[EndKind, int] = field(default_factory=dict)
    shared: int = 0
    used: Counter[EndKind] = field(default_factory=Counter)

    @classmethod
    def parse(cls, text: str, max_restarts: int = 0) -> Budgets:
        """`program=1,preempted=3` (kinds: program, preempted, maintenance, infra); UsageError otherwise."""
        own: dict[EndKind, int] = {}
        for item in filter(None, (t.strip() for t in text.split(","))) if text else ():
            m = _ITEM.match(item)
            if not m:
                raise UsageError(f"bad --restarts item {item!r}: expected KIND=N, e.g. preempted=3")
            kind, n = m.group(1), int(m.group(2))
            if kind not in {k.value for k in RESTARTABLE}:
                known = ", ".join(k.value for k in RESTARTABLE)
                raise UsageError(f"unknown kind {kind!r} in --restarts: the kinds are {known}")
            if n < 0:
                raise UsageError(f"--restarts {kind}={n}: a number of restarts cannot be negative")
            own[EndKind(kind)] = n
        if max_restarts < 0:
            raise UsageError("--max-restarts cannot be negative")
        return cls(own, max_restarts)

    @property
    def total(self) -> int:
        """Restarts of every kind so far (TPURUN_RESTART_COUNT)."""
        return sum(self.used.values())

    def limit(self, kind: EndKind) -> int:
        if kind in self.own:
            return self.own[kind]
        return self.shared if kind in SHARED else 0

    def spent(self, kind: EndKind) -> int:
        if kind in self.own or kind not in SHARED:
            return self.used[kind]
        return sum(self.used[k] for k in SHARED if k not in self.own)

    def spend(self, kind: EndKind) -> bool:
        """Count one restart for KIND if its budget allows it; False (nothing counted) when it is used up."""
        if kind not in RESTARTABLE or self.spent(kind) >= self.limit(kind):
            return False
        self.used[kind] += 1
        return True

    def left(self, kind: EndKind) -> str:
        """`1/3`: restarts KIND has cost of its budget."""
        return f"{self.spent(kind)}/{self.limit(kind)}"

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {k.value: {"used": self.spent(k), "budget": self.limit(k)} for k in RESTARTABLE}


def hint(kind: EndKind) -> str:
    """How to let KIND's ends be restarted."""
    if kind in SHARED:
        return f"--max-restarts N (or --restarts {kind.value}=N) relaunches after such an end"
    return f"--restarts {kind.value}=N relaunches after such an end"


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
