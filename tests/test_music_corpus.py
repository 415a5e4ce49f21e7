"""The chorale encoding of benchmarks/quick_search/music.py (an exploration whose numbers FINDINGS.md reports),
on stand-ins for music21's scores: the grid, held notes, rests, chords and the four-part rule."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quick_search" / "music.py"


def load_script():
    spec = importlib.util.spec_from_file_location("music_exploration", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def note(offset: float, length: float, *midi: int):
    """A note (one pitch), a chord (several) or a rest (none), as music21's notesAndRests give them."""
    return SimpleNamespace(offset=offset, quarterLength=length, isRest=not midi,
                           pitches=[SimpleNamespace(midi=m) for m in midi])


def score(length: float, *parts):
    flat = [SimpleNamespace(notesAndRests=list(notes)) for notes in parts]
    return SimpleNamespace(duration=SimpleNamespace(quarterLength=length),
                           parts=[SimpleNamespace(flatten=lambda f=f: f) for f in flat])


def test_each_eighth_note_step_lists_the_four_voices_pitches():
    music = load_script()
    chorale = score(2.0,
                    [note(0, 1, 67), note(1, 1, 69)],  # soprano: two quarters
                    [note(0, 0.5, 60), note(0.5, 0.5), note(1, 1, 62, 64)],  # alto: eighth, rest, a chord
                    [note(0, 2, 55)],  # tenor: a half note held over all four steps
                    [note(0, 1.5, 48)])  # bass: stops before the end, which reads as a rest
    assert music.chorale_text(chorale).split() == [
        "s67", "a60", "t55", "b48",
        "s67", "ar", "t55", "b48",
        "s69", "a64", "t55", "b48",  # the chord's top note
        "s69", "a64", "t55", "br"]


def test_a_chorale_without_exactly_four_parts_is_left_out():
    music = load_script()
    assert music.chorale_text(score(1.0, [note(0, 1, 60)], [note(0, 1, 55)], [note(0, 1, 48)])) is None
