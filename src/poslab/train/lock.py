"""One run per output directory: ``DIR/.lock``, held with ``flock`` for as long as the run's process lives.

The kernel drops an flock when its process dies, however it dies (SIGKILL, the OOM killer, a power cut of
the node), so a lock never outlives a crashed owner: its file stays behind, holding the dead owner's pid,
and the next run takes it over. A run that finds the lock held refuses in one line naming the holder.
(On NFS, Linux maps flock to POSIX byte-range locks, which NFSv4 servers honour across nodes.)
"""
from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

from poslab.errors import PoslabError
from poslab.files import make_dirs, release_lock, remove_made_dirs, take_lock

LOCK_FILE = ".lock"


class RunLocked(PoslabError):
    """Another live process is running in this output directory."""


class RunLock:
    """``acquire`` creates the directory when needed and takes the lock; ``release`` gives both back."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []  # directories acquire made, outermost first

    def acquire(self) -> str | None:
        """Take the lock or raise RunLocked. Returns the owner a crashed run left in the file (its pid and
        host), or None when the file was new or released cleanly."""
        self.created = make_dirs(self.directory)
        fd = take_lock(self.path)
        if fd is None:
            owner = ""
            with contextlib.suppress(OSError):
                owner = self.path.read_text(encoding="utf-8", errors="replace").strip()[:256]
            raise RunLocked(f"{self.directory} is in use by another poslab run ({owner or 'owner still starting'}); "
                            "wait for it to finish or choose another output directory")
        left_by = _read(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self.fd = fd
        return left_by or None

    def release(self, remove_created: bool = False) -> None:
        """Give the lock back. With ``remove_created``, also remove the directories ``acquire`` made, if nothing else was written there."""
        if self.fd is None:
            return
        release_lock(self.path, self.fd)
        self.fd = None
        if remove_created:  # a directory the run wrote something into stays
            remove_made_dirs(self.created)


def _read(fd: int) -> str:
    return os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
