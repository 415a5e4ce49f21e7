"""Paragraph and sentence segmentation of real text (rule-based, no dependency).

Paragraphs end at blank lines. Sentences end at ``.``, ``!``, ``?``, an ellipsis (``...`` or ``…``) or a
run of them, plus any closing quotes/brackets, when whitespace follows and the next word (after opening
quotes/brackets) starts with an upper-case letter or a digit. Exceptions that keep a sentence going:
  - a period after a known abbreviation (``Mr.``, ``Dr.``, ``e.g.``, ``etc.``, ``Fig.``, ``No.`` ...), after
    a single letter (initials: ``J. R. R. Tolkien``) or after a dotted acronym (``U.S.``, ``a.m.``);
  - no whitespace after the mark (decimals ``3.14``, ``example.com``, ``1.2.3``);
  - a lower-case next word (``"Stop!" he said.``, ``wait... and then``).
CJK full stops (。！？) end a sentence with or without whitespace.

Why rule-based: pySBD/spaCy/NLTK would add a dependency (and for NLTK a model download) for a label whose
errors only blur probe targets slightly; the rules run at regex speed, which keeps preparation as fast as
plain tokenisation (see benchmarks/data_pipeline.py).

Known failure cases (tests pin them so changes are deliberate):
  - an abbreviation or acronym that really ends a sentence: ``... in the U.S. Then it ...`` stays one;
  - a sentence starting lower-case (``iPhone sales rose.``, code, chat text) is merged with the previous;
  - unknown abbreviations followed by a capitalised name (``Brig. Smith``) split wrongly;
  - headings and list items without final punctuation merge with the next line of the same paragraph;
  - scripts without case (Arabic, Hebrew, Devanagari ...) split at every . ! ? followed by whitespace,
    since "next word is not lower-case" holds trivially.
"""
from __future__ import annotations

import re

ABBREVIATIONS = frozenset("""
mr mrs ms dr prof sr jr st mt ft vs etc al approx dept est inc ltd co corp jan feb mar apr jun jul aug sep
sept oct nov dec fig figs eq eqs no nos vol vols pp ed eds rev gen col lt sgt capt cmdr adm gov sen rep
univ assn bros ca cf ibid op cit resp viz
""".split())

_OPENERS = "\"'“‘«([{¿¡"
_CLOSERS = "\"'”’»)]}"
# A terminal mark, then further marks or closing quotes/brackets, then the space before the next word (text
# is whitespace-normalised first). Starting with a character class keeps the scan at C speed; an
# alternation of mark kinds here made segmentation a third of preparation time.
_CANDIDATE = re.compile(r"[.!?…][.!?…\"'”’»)\]}]* (?=\S)")
_CJK = re.compile(r"[。！？]+[」』”’）)]*")
_PARAGRAPH = re.compile(r"\n[ \t\r\f\v]*\n\s*")
_ACRONYM = re.compile(r"^(?:[A-Za-z]\.)+[A-Za-z]$")


def split_paragraphs(text: str) -> list[str]:
    """Non-empty paragraphs of ``text`` (blank-line separated), inner whitespace left as is."""
    return [p.strip() for p in _PARAGRAPH.split(text) if p.strip()]


def _keeps_going(text: str, start: int, end: int) -> bool:
    """True when the candidate ``text[start:end]`` (marks, closers, a space) is not a sentence end."""
    nxt = text[end]  # the candidate pattern ends before a non-space character
    if nxt in _OPENERS:
        nxt = text[end:end + 16].lstrip(_OPENERS)[:1]
        if not nxt:
            return False
    if nxt.islower():
        return True
    # A lone mark (most candidates) is checked without slicing.
    if text[start] != "." or end - start > 2 and text[start:end - 1].rstrip(_CLOSERS) != ".":
        return False
    word = text[text.rfind(" ", 0, start) + 1:start].lstrip(_OPENERS)
    return (len(word) == 1 and word.isalpha() or word.lower() in ABBREVIATIONS
            or "." in word and _ACRONYM.match(word) is not None)


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph, whitespace-normalised (runs of whitespace become one space)."""
    # Every whitespace character but " " is non-printable, so this finds all irregular whitespace (and
    # normalises a few texts needlessly, which changes no sentence) three times faster than a regex.
    regular = "  " not in paragraph and paragraph.isprintable()
    text = paragraph if regular else " ".join(paragraph.split())
    ends = [m.end() - 1 for m in _CANDIDATE.finditer(text) if not _keeps_going(text, m.start(), m.end())]
    if "。" in text or "！" in text or "？" in text:
        ends = sorted(ends + [m.end() for m in _CJK.finditer(text)])
    sentences, start = [], 0
    for end in ends + [len(text)]:
        piece = text[start:end].strip()
        if piece:
            sentences.append(piece)
        start = end
    return sentences


def segment(text: str) -> list[list[str]]:
    """A document as paragraphs of sentences; empty paragraphs dropped."""
    return [s for s in (split_sentences(p) for p in split_paragraphs(text)) if s]
