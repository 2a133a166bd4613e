"""The exceptions tpurun raises on purpose, each carrying its exit code (the README lists them)."""

from __future__ import annotations


class ExitCode:
    OK = 0
    PROGRAM_FAILED = 1
    USAGE = 2
    API = 3
    UNREACHABLE = 4
    INTERRUPTED = 130


class TpurunError(Exception):
    """An error meant for the user: one line saying what is wrong and what to do."""

    exit_code = ExitCode.USAGE

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class UsageError(TpurunError):
    exit_code = ExitCode.USAGE


class ApiError(TpurunError):
    exit_code = ExitCode.API


class UnreachableError(TpurunError):
    exit_code = ExitCode.UNREACHABLE


class ProgramFailed(TpurunError):
    exit_code = ExitCode.PROGRAM_FAILED
