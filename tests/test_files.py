"""Atomic writes: the target holds the old content or the new, never a part, and no temporary file stays."""
import os
import stat

import pytest

from poslab.files import atomic_write, atomic_write_text


def test_atomic_write_text_replaces_whole_and_leaves_nothing_behind(tmp_path):
    target = tmp_path / "sub" / "report.md"
    atomic_write_text(target, "first\n")
    atomic_write_text(target, "second\n")
    assert target.read_text() == "second\n"
    assert [p.name for p in target.parent.iterdir()] == ["report.md"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")

    def half_then_fail(tmp):
        tmp.write_text("half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_written_file_has_the_mode_a_plain_write_would_have(tmp_path, monkeypatch, umask):
    """Every config.yaml and analysis file came out 0600 (mkstemp's mode) whatever the umask: colleagues and
    services running as another user could not read a run directory."""
    import poslab.files

    monkeypatch.setattr(poslab.files, "UMASK", umask)
    plain = tmp_path / "plain"
    old = os.umask(umask)
    try:
        plain.write_text("x")
    finally:
        os.umask(old)
    written = atomic_write_text(tmp_path / "config.yaml", "seed: 0\n")
    assert stat.S_IMODE(written.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~umask


def test_a_wait_for_a_lock_that_is_interrupted_closes_its_descriptor(tmp_path):
    """Ctrl-C while blocked in take_lock's flock left the lock file's descriptor open for good (a long-lived
    process using the library collects them)."""
    import signal

    from poslab.files import release_lock, take_lock

    path = tmp_path / "lock"
    holder = take_lock(path)

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGALRM, interrupt)
    before = sorted(os.listdir("/proc/self/fd"))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            take_lock(path, waiting=lambda: None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert sorted(os.listdir("/proc/self/fd")) == before
    release_lock(path, holder)
