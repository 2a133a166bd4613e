"""The exceptions tpurun raises on purpose, each carrying its exit code (the README lists them)."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """tpurun's exit codes, each with one meaning (docs/contract.md lists them)."""

    OK = 0
    PROGRAM_FAILED = 1  # the user's program (or its --setup) failed
    USAGE = 2  # bad usage or input: nothing was created or started
    API = 3  # the Cloud API refused or failed; or no such TPU
    UNREACHABLE = 4  # a worker could not be reached
    INTERNAL = 70  # a bug in tpurun: an exception it did not expect (sysexits' EX_SOFTWARE)
    TEMPFAIL = 75  # a job cut short by preemption, maintenance or a lost worker, no restart left (sysexits' EX_TEMPFAIL)
    HUNG = 124  # `train --on-hang stop`: stopped after --hang-timeout without progress (as timeout(1) exits)
    BUDGET = 125  # `train --budget`: stopped before its cost passed the budget
    INTERRUPTED = 130


class TpurunError(Exception):
    """An error meant for the user: one line saying what is wrong and what to do."""

    exit_code: int = ExitCode.USAGE

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        if not self.hint:
            return self.message
        # after lines quoted on their own (a log's tail), the hint is a line of its own too
        return f"{self.message}\n{self.hint}" if "\n" in self.message else f"{self.message} ({self.hint})"


class UsageError(TpurunError):
    exit_code = ExitCode.USAGE


class ApiError(TpurunError):
    exit_code = ExitCode.API


class NoSuchTpu(ApiError):
    """The TPU named does not exist (any more): one wording and one exit code for every command."""


class TpuBusy(UsageError):
    """Another job runs on the TPU: nothing was started, synced or recorded."""


class UnreachableError(TpurunError):
    exit_code = ExitCode.UNREACHABLE


class Preempted(UnreachableError):
    """The TPU was preempted: its workers are gone (`train --max-restarts` makes it again)."""

    def __init__(self, message: str, *, tpu: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.tpu = tpu


class ProgramFailed(TpurunError):
    exit_code = ExitCode.PROGRAM_FAILED
