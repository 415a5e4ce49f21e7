"""Ctrl-C or SIGTERM during ``poslab train`` ends training at the next step boundary with a checkpoint.

Without this an interrupt lost every step since the last periodic checkpoint (up to train.checkpoint_every
of them, which at paper scale is GPU-hours), and stopping in the middle of an optimizer step can leave the
weights half-updated. A second Ctrl-C stops at once, for a user who cannot wait for the step; a SIGTERM
never does (a scheduler's or a user's repeated SIGTERM would cut short the save it waits for; its SIGKILL
after a grace period is the hard stop). torchrun's agent passes the signal it gets on to its workers and
kills them after ``--shutdown-timeout`` (30 s by default): give a run whose step and save take longer more.

Python runs a signal handler only between bytecodes, so during a long step (a big matmul) a second Ctrl-C
merges into the first before the handler sees either; the signal wakeup fd, written by the C-level handler
once per signal, counts them all.

Only the CLI asks for this (``poslab train``, and the trainings ``poslab reproduce`` runs in its own
process): a library caller, or a reproduction's worker process (which must stay deaf to SIGINT, see
experiments/common.py), keeps Python's own handling.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator


class StopBetweenSteps:
    """Within ``armed()``, the first SIGINT or SIGTERM sets ``requested`` (the signal's name) instead of raising;
    the loop reads it after each step. A Ctrl-C after that, or two at once, raises KeyboardInterrupt."""

    def __init__(self, announce: bool = True) -> None:
        self.requested: str | None = None
        self.announce = announce  # one line per job, not per torchrun process
        self._wakeups: int | None = None  # the read end of the wakeup pipe: one byte (the signal number) a signal
        self._interrupts = self._interrupt_bytes = 0  # SIGINT handler calls; SIGINT bytes read from the pipe

    @contextlib.contextmanager
    def armed(self) -> Iterator[StopBetweenSteps]:
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            yield self
            return
        self._wakeups, write = os.pipe()
        for fd in (self._wakeups, write):
            os.set_blocking(fd, False)
        previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            signal.set_wakeup_fd(previous_fd)
            os.close(write)
            os.close(self._wakeups)
            self._wakeups = None

    def _handle(self, signum: int, frame: object) -> None:
        # Ctrl-Cs so far: handler calls undercount merged ones, bytes lag when the C-level handler ran on another
        # thread and has not written its byte yet; neither overcounts
        self._interrupt_bytes += self._arrived().count(signal.SIGINT)
        self._interrupts += signum == signal.SIGINT
        again = self.requested is not None or max(self._interrupts, self._interrupt_bytes) >= 2
        if signum == signal.SIGINT and again:
            raise KeyboardInterrupt
        if self.requested is None:
            self.requested = signal.Signals(signum).name
            if self.announce:
                print(f"poslab: {self.requested}: stopping after the step under way and saving a checkpoint (a Ctrl-C "
                      "now stops at once, losing the steps since the last checkpoint)", file=sys.stderr, flush=True)

    def _arrived(self) -> bytes:
        """The signal numbers the C-level handler recorded since the last call."""
        if self._wakeups is None:
            return b""
        try:
            return os.read(self._wakeups, 4096)
        except BlockingIOError:
            return b""


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (what batch schedulers and torchrun send) ends a command as Ctrl-C does, saying where it stands,
    instead of killing it without a word."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
