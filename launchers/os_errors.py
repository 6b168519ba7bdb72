"""An OS error (a full disk, a refused permission, storage that went away) as one line: what, where, the way on.

A write that fails for lack of space raises `[Errno 28] No space left on device` with no path: the commands say
where they were writing (`where`) and how the same command carries on (`then`), e.g. that `qvl data prepare`
resumes from `OUT.partial/`.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from qvl.foundation.errors import QvlError

FULL_BELOW_BYTES = 1 << 20  # a filesystem with less than this free counts as full
_FULL = "free space there (`df -h {path}`) or write to a larger filesystem"
_GONE = "check that the filesystem is mounted and answers again (`ls {path}`), or write elsewhere"
_DENIED = "make it writable for this user (`ls -ld {path}`) or choose a folder you can write"
_WHAT: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on the device", _FULL),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota (`quota -s`) or write to another filesystem"),
    errno.EACCES: ("permission denied", _DENIED),
    errno.EPERM: ("operation not permitted", _DENIED),
    errno.EROFS: ("read-only filesystem", "choose a folder on a writable filesystem"),
    errno.ESTALE: ("the storage went away (stale file handle)", _GONE),
    errno.ENOTCONN: ("the storage went away (not connected)", _GONE),
    errno.EIO: ("an I/O error on the storage", _GONE),
    errno.ENODEV: ("the storage went away (no such device)", _GONE),
    errno.EHOSTDOWN: ("the storage's host is down", _GONE),
}


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind `error`: itself, one in its cause/context chain, a Ray task's cause, or a rank's failure
    inside torch.distributed.checkpoint's CheckpointException (which wraps each rank's exception)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        failures = getattr(current, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            for failure in failures.values():
                pending += [
                    f for f in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(f, BaseException)
                ]
        pending += [current.__cause__, current.__context__, getattr(current, "cause", None)]
    return None


@contextlib.contextmanager
def os_errors_as(error_type: type[QvlError], *, where: str | Path, then: str) -> Iterator[None]:
    """Turn an OS error raised in the block (or wrapped by Ray or a distributed checkpoint), or any failure while
    the filesystem of `where` is full, into `error_type` with `describe_os_error`'s line; anything else passes
    unchanged."""
    try:
        yield
    except QvlError:
        raise
    except BaseException as error:
        if isinstance(error, (SystemExit, KeyboardInterrupt)):
            raise
        cause = os_error_in(error) or _full_disk(where)
        if cause is None:
            raise
        raise error_type(describe_os_error(cause, where=where, then=then)) from error


def describe_os_error(error: OSError, *, where: str | Path, then: str) -> str:
    """One line for `error`: what the OS refused, on which path (`where` when the error names none), the fix, and
    `then` (how the same command carries on)."""
    path = error.filename or where
    what, fix = _WHAT.get(error.errno, (error.strerror or "an OS error", "fix the path's storage and retry"))
    code = errno.errorcode.get(error.errno, str(error.errno))
    return f"{what} at {path} ({code}); {fix.format(path=_existing(path))}; {then}"


def _full_disk(where: str | Path) -> OSError | None:
    """ENOSPC where the filesystem of `where` has (almost) no space left: torch.save's zip writer reports a full
    disk as `RuntimeError: [enforce fail at inline_container.cc] unexpected pos`, without the OS error."""
    try:
        stats = os.statvfs(_existing(where))
    except OSError:
        return None
    if stats.f_bavail * stats.f_frsize >= FULL_BELOW_BYTES:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _existing(path: str | Path) -> str:
    """The nearest folder of `path` that exists (what `df` or `ls -ld` can be asked about)."""
    for candidate in (Path(path), *Path(path).parents):
        if os.path.exists(candidate):
            return str(candidate)
    return str(path)
