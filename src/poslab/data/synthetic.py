"""The synthetic structured-document corpus: the offline default, with exact sentence/paragraph boundaries.

Documents are paragraphs of sentences drawn from a seeded probabilistic grammar over a pseudo-word
lexicon. Structure is signalled the way real prose signals it (cue words, punctuation, topic shifts),
the DSTG probes (does the encoder still know sentence / paragraph position?) have an exact ground truth,
and a small MLM picks the signals up on a CPU: measured with ``benchmarks/data_pipeline.py --learn-steps``,
a 2-layer d=128 encoder tells masked paragraph openers from later-sentence openers after ~500 steps of
32 x 128 tokens; the ordinal sentence cues (which need counting sentences) take longer than 1000 steps.

  sentence-initial cues   the first sentence of a paragraph opens with a cue word for where the paragraph
                          sits in the document (first / middle / last: "initially", "furthermore",
                          "finally"); later sentences open with an ordinal cue for their index in the
                          paragraph (second: "then", third: "also", fourth and later: "so"), so sentence
                          position can be read by counting from the paragraph opener; each cue appears
                          with probability ``cue_prob``;
  punctuation             the last sentence of a paragraph ends in "!" (``mark_paragraph_ends``), the
                          others in "." or, for questions (which open with "does"/"do"), "?"; a second
                          clause follows a comma and a conjunction;
  topic words             each paragraph draws its nouns and adjectives from one topic (with probability
                          ``topic_prob``), and consecutive paragraphs change topic, so a paragraph boundary
                          is visible as a vocabulary shift even where no cue word marks it;
  agreement               determiners, nouns and verbs agree in number ("a bado tamiks" / "some bados
                          tamik"), a local syntactic regularity to learn alongside structure.

Every document is generated from its own generator seeded by (seed, index), so document i is the same
whatever ``documents`` is, and lengths (paragraphs per document, sentences per paragraph, phrases per
clause, adjectives per noun phrase) are configurable ranges.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from poslab.data.config import _int_range, from_dict
from poslab.errors import check_fields, require

GRAMMAR_VERSION = 3  # bump when generation changes: cached preparations are keyed by it

# Cue words by structural position: one word each (a masked cue is one token), sets disjoint.
PARAGRAPH_CUES = {"first": ["initially", "firstly", "originally"],
                  "middle": ["furthermore", "moreover", "additionally"],
                  "last": ["finally", "lastly", "ultimately"]}
SENTENCE_CUES = [["then", "next"], ["also", "besides"], ["so", "thus", "hence"]]  # 2nd, 3rd, 4th+ sentence
DETERMINERS = {False: ["the", "a", "this", "every"], True: ["the", "some", "these", "many"]}  # by plural
PREPOSITIONS = ["in", "on", "with", "under", "near", "from", "behind", "over"]
CONJUNCTIONS = ["and", "but", "while", "because"]
_CONSONANTS = "bdfgklmnprtvz"
_VOWELS = "aeiou"


@dataclass
class SyntheticOptions:
    documents: int = 10_000
    seed: int = 0
    lexicon_seed: int = 0
    paragraphs: Any = (2, 5)
    sentences: Any = (2, 6)
    phrases: Any = (0, 2)
    adjectives: Any = (0, 2)
    topics: int = 16
    topic_nouns: int = 24
    topic_adjectives: int = 8
    general_nouns: int = 48
    verbs: int = 64
    topic_prob: float = 0.8
    cue_prob: float = 0.8
    question_prob: float = 0.1
    mark_paragraph_ends: bool = True
    clause_prob: float = 0.3

    def __post_init__(self) -> None:
        check_fields(self, "synthetic ")  # a seed of 1.5 or "0" (another cache key, the same documents) passed
        require(isinstance(self.documents, int) and self.documents >= 1,
                f"synthetic documents must be a positive integer, got {self.documents!r}")
        self.paragraphs = _int_range(self.paragraphs, "synthetic paragraphs", 1)
        self.sentences = _int_range(self.sentences, "synthetic sentences", 1)
        self.phrases = _int_range(self.phrases, "synthetic phrases", 0)
        self.adjectives = _int_range(self.adjectives, "synthetic adjectives", 0)
        for name in ("topics", "topic_nouns", "topic_adjectives", "general_nouns", "verbs"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"synthetic {name} must be a positive integer, got {value!r}")
        require(self.topics >= 2, "synthetic topics must be >= 2 (consecutive paragraphs change topic)")
        for name in ("topic_prob", "cue_prob", "question_prob", "clause_prob"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and 0.0 <= value <= 1.0,
                    f"synthetic {name} must lie in [0, 1], got {value!r}")
        require(isinstance(self.mark_paragraph_ends, bool),
                f"synthetic mark_paragraph_ends must be true or false, got {self.mark_paragraph_ends!r}")


class Lexicon:
    """Pseudo-words (2-3 consonant-vowel syllables, all distinct) split into word classes."""

    def __init__(self, opts: SyntheticOptions) -> None:
        rng = random.Random(f"poslab-lexicon:{opts.lexicon_seed}")
        need = (opts.topics * (opts.topic_nouns + opts.topic_adjectives) + opts.general_nouns
                + opts.verbs + opts.general_nouns // 2)
        syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
        require(need <= len(syllables) ** 3 // 4, f"synthetic lexicon too large ({need} words); use fewer topics/words")
        words: list[str] = []
        seen: set[str] = set()
        while len(words) < need:
            w = "".join(_pick(rng, syllables) for _ in range(rng.randint(2, 3)))
            if w not in seen:
                seen.add(w)
                words.append(w)
        it = iter(words)
        take = lambda n: [next(it) for _ in range(n)]  # noqa: E731  (consume the shuffled pool in order)
        self.topic_nouns = [take(opts.topic_nouns) for _ in range(opts.topics)]
        self.topic_adjectives = [take(opts.topic_adjectives) for _ in range(opts.topics)]
        self.nouns = take(opts.general_nouns)
        self.adjectives = take(opts.general_nouns // 2)
        self.verbs = take(opts.verbs)


def _pick(rng: random.Random, items: list):
    # random() indexing instead of rng.choice: same distribution, a third of the cost (generation speed
    # matters because the synthetic corpus is regenerated on every preparation).
    return items[int(rng.random() * len(items))]


def _count(rng: random.Random, bounds: tuple[int, int]) -> int:
    return bounds[0] + int(rng.random() * (bounds[1] - bounds[0] + 1))


def _position(i: int, n: int) -> str:
    return "first" if i == 0 else "last" if i == n - 1 else "middle"


class SyntheticCorpus:
    """Iterable source of documents: each a list of paragraphs, each a list of sentence strings."""

    def __init__(self, **options: Any) -> None:
        self.opts: SyntheticOptions = from_dict(SyntheticOptions, options, "synthetic source")
        self.lexicon = Lexicon(self.opts)

    def documents(self) -> Iterator[list[list[str]]]:
        for i in range(self.opts.documents):
            yield self.document(i)

    def document(self, index: int) -> list[list[str]]:
        o = self.opts
        rng = random.Random(f"poslab-doc:{o.seed}:{index}")
        n_par = _count(rng, o.paragraphs)
        topic, paragraphs = -1, []
        for p in range(n_par):
            topic = _pick(rng, [t for t in range(o.topics) if t != topic])
            n_sent = _count(rng, o.sentences)
            paragraphs.append([self._sentence(rng, topic, _position(p, n_par), s, s == n_sent - 1)
                               for s in range(n_sent)])
        return paragraphs

    def _noun_phrase(self, rng: random.Random, topic: int, plural: bool) -> list[str]:
        o, lex = self.opts, self.lexicon
        on_topic = lambda: rng.random() < o.topic_prob  # noqa: E731
        words = [_pick(rng, DETERMINERS[plural])]
        for _ in range(_count(rng, o.adjectives)):
            words.append(_pick(rng, lex.topic_adjectives[topic] if on_topic() else lex.adjectives))
        noun = _pick(rng, lex.topic_nouns[topic] if on_topic() else lex.nouns)
        return words + [noun + "s" if plural else noun]

    def _clause(self, rng: random.Random, topic: int, question: bool) -> list[str]:
        o = self.opts
        plural = rng.random() < 0.5
        subject = self._noun_phrase(rng, topic, plural)
        verb = _pick(rng, self.lexicon.verbs)
        # Agreement: singular subjects take verb+"s" in statements and "does" + base verb in questions.
        head = (["do" if plural else "does"] + subject + [verb]) if question else subject + [verb if plural else verb + "s"]
        words = head + self._noun_phrase(rng, topic, rng.random() < 0.5)
        for _ in range(_count(rng, o.phrases)):
            words += [_pick(rng, PREPOSITIONS)] + self._noun_phrase(rng, topic, rng.random() < 0.5)
        return words

    def _sentence(self, rng: random.Random, topic: int, par_pos: str, s: int, last: bool) -> str:
        o = self.opts
        question = rng.random() < o.question_prob
        mark = "!" if last and o.mark_paragraph_ends else "?" if question else "."
        words: list[str] = []
        if rng.random() < o.cue_prob:
            cues = PARAGRAPH_CUES[par_pos] if s == 0 else SENTENCE_CUES[min(s, len(SENTENCE_CUES)) - 1]
            words += [_pick(rng, cues), ","]
        words += self._clause(rng, topic, question)
        if rng.random() < o.clause_prob:
            words += [",", _pick(rng, CONJUNCTIONS)] + self._clause(rng, topic, False)
        text = " ".join(words + [mark]).replace(" ,", ",").replace(" " + mark, mark)
        return text[0].upper() + text[1:]
