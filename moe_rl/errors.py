"""Errors a user can act on: the console commands print their message as one line, without a traceback."""

from __future__ import annotations

import errno
import warnings

DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
"""OSError numbers that mean "the disk is full or not writable": reported in one line, not a traceback."""


class RunError(RuntimeError):
    """A run cannot go on for a reason outside the code (a corrupt checkpoint, a refused resume, an
    unusable cache); the message says what to do."""


class LaunchError(RunError, ValueError):
    """A configuration that the processes launched cannot run (too many for rollout.overlap, a world size a
    batch or an engine cannot split), known only once they exist: one line, as a config error."""


def one_line(err: BaseException) -> str | None:
    """The one-line message of a user-actionable error, or None for a bug (which keeps its traceback)."""
    if isinstance(err, RunError):
        return str(err)
    if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
        where = f" ({err.filename})" if err.filename else ""
        return f"cannot write{where}: {err.strerror or err}"
    return None


def one_line_warnings(program: str) -> None:
    """Print every warning as one line a user reads ("program: RuntimeWarning: ..."), without Python's
    source location and source line."""

    def formatted(message, category, filename, lineno, line=None) -> str:
        return f"{program}: {category.__name__}: {message}\n"

    warnings.formatwarning = formatted
