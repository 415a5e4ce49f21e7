"""Atomic writes: the target holds the old content or the new, never a part, and no temporary file stays."""
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
