"""Writing a file so that no reader, and no crash, ever sees half of it; making directories that a failure
can take back; locks that processes of one job (torchrun's ranks) or of several take turns with.

The content goes to a temporary file in the same directory (a rename is atomic only within one file
system), is flushed to disk, and is then renamed over the target; on any failure the temporary file is
removed and the target is left as it was.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Read once, at import: setting the umask to read it would race with files other threads create meanwhile.
UMASK = _umask()


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """Call ``write(tmp)`` to fill a temporary sibling of ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        # mkstemp makes the file 0600; a file written in place would have the umask's mode, readable by the
        # colleagues and services it is meant for
        os.chmod(tmp, 0o666 & ~UMASK)
        with open(tmp, "rb+") as f:  # the rename must not reach the disk before the content does
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``path`` holds ``text`` (UTF-8), whole or not at all."""
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def make_dirs(directory: str | os.PathLike) -> list[Path]:
    """Create ``directory`` with its missing parents; returns the directories made, outermost first."""
    directory = Path(directory)
    missing = []
    while not directory.exists():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    missing.reverse()
    if missing:
        missing[-1].mkdir(parents=True, exist_ok=True)
    return missing


def remove_made_dirs(made: list[Path]) -> None:
    """Take back what ``make_dirs`` made, innermost first, stopping at the first directory something was
    written into meanwhile (that one stays, with its parents)."""
    for directory in reversed(made):
        try:
            directory.rmdir()
        except OSError:
            break


def take_lock(path: Path, waiting: Callable[[], object] | None = None) -> int | None:
    """An exclusive ``flock`` on the file ``path`` (created when missing); returns its descriptor. When another
    process holds it: None without ``waiting``, else ``waiting()`` is called once and this blocks until the
    holder lets go. The kernel drops a lock when its process dies, however it dies."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is None:
                os.close(fd)
                return None
            say, waiting = waiting, (lambda: None)  # said once
            try:
                say()
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:  # interrupted while waiting (Ctrl-C): the descriptor is no one's
                os.close(fd)
                raise
        # The previous holder unlinks the file as it releases: if that happened before our flock (the path is
        # gone or is a new file), we hold a lock on a file no one else will open, so start again on the new one.
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return fd
        os.close(fd)


def release_lock(path: Path, fd: int) -> None:
    """Give back what ``take_lock`` took, unlinking the file first so no one locks a file that is going away."""
    path.unlink(missing_ok=True)
    os.close(fd)
