"""A task's ``BatchSource`` (see ``poslab.batches``): deterministic batches of token ids.

Sequence layout: ``<bos> prompt answer [<eos>] <pad> ...`` (right padding). ``labels`` hold the token
ids of the answer and its <eos> (the targets of exact match) and -100 everywhere else, unshifted:
a causal model predicts labels[i] from positions < i, as Hugging Face models do.

Splits never overlap. A problem's split is a function of the problem itself: a 64-bit hash of its
prompt, salted with ``data_seed``, maps it to u in [0, 1); u < holdout is validation, u < 2 holdout
test, the rest train. Evaluation sets are i.i.d. draws restricted to their part of the problem space, at
lengths drawn uniformly (a choice: papers/adjacency.md gives set sizes, not how lengths are drawn), so the
few problems of the shortest lengths repeat (``distinct`` counts them), and training draws reject the
held-out parts, so no training batch ever holds a validation or test problem. ``test_long`` draws
only lengths above ``train_max_len``, which training never draws.

Determinism: evaluation sets and a fixed training pool depend on (options, data_seed) only; the
training batch of a step depends on (options, data_seed, seed, step, global batch size) only, so a
resumed run and every data-parallel rank rebuild it without coordination.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from poslab.data.rng import mix64
from poslab.errors import ConfigError, DataError, require, unknown_key_message
from poslab.tasks.base import Ragged, Task, concat, stack
from poslab.tasks.tokenizer import CharTokenizer

# Separate random streams; the numbers only have to differ.
STREAMS = {"train": 0, "pool": 1, "order": 2, "validation": 3, "test": 4, "test_long": 5}
COORDINATES = 3  # the most a stream is keyed by: (data_seed, seed, step)
BUCKETS = {"train": 0, "validation": 1, "test": 2}
MAX_CHUNK = 1 << 16  # problems drawn at once when filling a split; bounds memory
MAX_EXAMPLES = 100_000  # examples() returns problems to read; more would only cost memory (`tasks show -n`)


class Problems(NamedTuple):
    prompt: Ragged
    answer: Ragged

    def take(self, rows: np.ndarray) -> Problems:
        return Problems(self.prompt.take(rows), self.answer.take(rows))

    def __len__(self) -> int:
        return len(self.prompt.lens)


def stream_rng(stream: str, *coordinates: int) -> np.random.Generator:
    """The generator of one of STREAMS at its coordinates (seeds, a step, an epoch: each in [0, 2^64)).

    numpy's seed lists pad a shorter list with zero words and split an int past 2^32 into several words, so
    [data_seed, 3] and [data_seed, 3, 0, 0] seed one stream (validation and the first training batch of seed
    3). Every key here is eight 32-bit words, the stream's number first, so distinct keys are distinct streams.
    """
    # A value past 2^64 would take more than two words and meet another key's
    require(all(0 <= value < 2**64 for value in coordinates),
            f"task stream coordinates must lie in [0, 2^64), got {coordinates}")
    values = (STREAMS[stream], *coordinates, *(0,) * (COORDINATES - len(coordinates)))
    return np.random.default_rng([word for value in values for word in (value & 0xFFFFFFFF, value >> 32)])


def problem_hash(prompt: Ragged, salt: int) -> np.ndarray:
    """(batch,) uint64 hash of each prompt's characters, independent of the padding width."""
    width = prompt.codes.shape[1]
    cols = np.arange(width, dtype=np.uint64)
    salted = mix64(np.full(1, salt, dtype=np.uint64))
    # (position, character) pairs are distinct integers, and mix64 keeps them distinct.
    terms = mix64(((cols << np.uint64(8)) | prompt.codes.astype(np.uint64)) ^ salted)
    terms = np.where(np.arange(width) < prompt.lens[:, None], terms, np.uint64(0))
    return mix64(terms.sum(axis=1, dtype=np.uint64) ^ prompt.lens.astype(np.uint64))


class TaskSource:
    """Batches of one task for training and evaluation (implements ``poslab.batches.BatchSource``).

    ``max_seq_len`` is the longest sequence any split can produce (<bos> and <eos> included),
    ``max_train_len`` the longest a training batch can hold (shorter when ``train_max_len`` holds long
    problems out for ``test_long``).
    """

    def __init__(self, task: Task, seed: int) -> None:
        require(isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0,
                f"seed must be a non-negative integer, got {seed!r}")
        self.task, self.options, self.seed = task, task.options, seed
        self.tokenizer = CharTokenizer("".join(sorted(set(task.alphabet()))))
        self.vocab_size = self.tokenizer.vocab_size
        tok = self.tokenizer
        self.generation_ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id if task.end_token else None,
                               "pad_token_id": tok.pad_id}
        o = self.options
        possible = task.lengths()
        cut = o.max_len if o.train_max_len is None else o.train_max_len
        self.max_seq_len = 1 + task.max_chars(o.max_len) + int(task.end_token)
        self.max_train_len = 1 + task.max_chars(cut) + int(task.end_token)
        self._lengths = {"train": possible[possible <= cut], "test_long": possible[possible > cut]}
        lengths = ", ".join(map(str, possible)) or "none"
        require(len(self._lengths["train"]) > 0,
                f"task '{task.name}' has no problem of length in [{o.min_len}, {cut}] (lengths in "
                f"[min_len, max_len]: {lengths}); widen the range")
        require(o.train_max_len is None or len(self._lengths["test_long"]) > 0,
                f"task '{task.name}' has no problem longer than train_max_len={cut} up to max_len={o.max_len} "
                f"(lengths: {lengths}); raise max_len or lower train_max_len")
        self._sets: dict[str, Problems] = {}
        self._orders: dict[int, np.ndarray] = {}

    @property
    def splits(self) -> tuple[str, ...]:
        """The evaluation splits, in order."""
        return ("validation", "test") + (("test_long",) if self.options.train_max_len is not None else ())

    # ---- drawing problems -------------------------------------------------------------------

    def split_of(self, prompt: Ragged) -> np.ndarray:
        """(batch,) 0 = train, 1 = validation, 2 = test, from the prompt alone."""
        u = (problem_hash(prompt, self.options.data_seed) >> np.uint64(11)).astype(np.float64) * 2.0**-53
        h = self.options.holdout
        return np.where(u < h, BUCKETS["validation"], np.where(u < 2 * h, BUCKETS["test"], BUCKETS["train"]))

    def _draw(self, rng: np.random.Generator, count: int, lengths: np.ndarray, bucket: int | None,
              what: str) -> Problems:
        """count problems that hash into `bucket` (None: any), i.i.d.: a length uniform over those of `lengths`
        that the bucket holds problems of, then a problem of that length as the task samples them, restricted
        to the bucket.

        Each slot's length is drawn first and filled by rejection among problems of that length: rejecting over
        all lengths at once weights a length by its share in the bucket, which for a short length is luck (of
        ordering's 10 one-digit problems a 5% split holds none, one or a few; one problem was 31% of a test
        split drawn over five lengths). A length with no find in `empty_after` draws holds none, and its slots
        draw their lengths again from the others.
        """
        h = self.options.holdout
        rate = 1.0 if bucket is None else (1 - 2 * h if bucket == BUCKETS["train"] else h)
        reps = max(1, round(1 / rate))  # candidates per open slot and round: about 1 - 1/e of the slots fill
        empty_after = 20 / rate + 100_000
        live = np.unique(lengths)
        wanted = rng.choice(live, size=count)
        tried, found = dict.fromkeys(live.tolist(), 0), dict.fromkeys(live.tolist(), 0)
        rows = np.full(count, -1)  # slot -> row of the concatenated parts
        parts, kept = [], 0
        while (rows < 0).any():
            batch_slots = np.flatnonzero(rows < 0)[: max(1, MAX_CHUNK // reps)]
            candidates = np.repeat(wanted[batch_slots], reps)
            problems = Problems(*self.task.sample(rng, candidates))
            hit = np.ones(len(candidates), bool) if bucket is None else self.split_of(problems.prompt) == bucket
            take, into = [], []
            for n in np.unique(candidates).tolist():
                slots = batch_slots[wanted[batch_slots] == n]
                got = np.flatnonzero(hit & (candidates == n))[: len(slots)]
                take.append(got)
                into.append(slots[: len(got)])
                tried[n] += int((candidates == n).sum())
                found[n] += len(got)
            take, into = np.concatenate(take), np.concatenate(into)
            parts.append(problems.take(take))
            rows[into] = kept + np.arange(len(take))
            kept += len(take)
            empty = [n for n in live.tolist() if found[n] == 0 and tried[n] >= empty_after]
            if empty:
                live = live[~np.isin(live, empty)]
                if len(live) == 0:
                    raise DataError(
                        f"task '{self.task.name}': only 0 of {count} {what} problems among {sum(tried.values())} "
                        f"draws; the problem space is too small for this split: raise holdout or max_len, or lower "
                        f"the size")
                moved = np.flatnonzero((rows < 0) & np.isin(wanted, empty))
                wanted[moved] = rng.choice(live, size=len(moved))
        merged = Problems(stack([p.prompt for p in parts]), stack([p.answer for p in parts]))
        return merged.take(rows)

    def _eval_set(self, split: str) -> Problems:
        if split not in self.splits:
            raise ConfigError(unknown_key_message(f"split of task '{self.task.name}'", split, self.splits))
        if split not in self._sets:
            o = self.options
            size = o.validation_size if split == "validation" else o.test_size
            rng = stream_rng(split, o.data_seed)
            lengths = self._lengths["test_long" if split == "test_long" else "train"]
            self._sets[split] = self._draw(rng, size, lengths, BUCKETS.get(split), split)
        return self._sets[split]

    def distinct(self, split: str) -> tuple[int, int]:
        """How many different problems the evaluation set ``split`` holds (short lengths repeat theirs), and
        its size."""
        problems = self._eval_set(split)
        return len(np.unique(problem_hash(problems.prompt, 0))), len(problems)

    def _order(self, epoch: int) -> np.ndarray:
        """The order in which epoch `epoch` visits the training pool; the last two are kept."""
        if epoch not in self._orders:
            rng = stream_rng("order", self.seed, epoch)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = rng.permutation(self.options.train_size)
        return self._orders[epoch]

    def _train_problems(self, step: int, batch_size: int) -> Problems:
        o = self.options
        if o.train_size is None:
            rng = stream_rng("train", o.data_seed, self.seed, step)
            return self._draw(rng, batch_size, self._lengths["train"], BUCKETS["train"], "train")
        if "train" not in self._sets:
            rng = stream_rng("pool", o.data_seed)
            self._sets["train"] = self._draw(rng, o.train_size, self._lengths["train"], BUCKETS["train"], "train")
        index = np.arange(step * batch_size, (step + 1) * batch_size)
        epoch, position = np.divmod(index, o.train_size)
        rows = np.empty(batch_size, dtype=np.int64)
        for e in np.unique(epoch):
            rows[epoch == e] = self._order(int(e))[position[epoch == e]]
        return self._sets["train"].take(rows)

    # ---- batches ------------------------------------------------------------------------------

    def to_batch(self, problems: Problems) -> dict[str, torch.Tensor]:
        """Problems -> input_ids, labels, attention_mask, each (batch, longest sequence) int64."""
        tok, batch = self.tokenizer, len(problems)
        one = np.ones(batch, dtype=np.int64)
        parts = [Ragged(np.full((batch, 1), tok.bos_id), one),
                 Ragged(tok.ids_of_codes(problems.prompt.codes), problems.prompt.lens),
                 Ragged(tok.ids_of_codes(problems.answer.codes), problems.answer.lens)]
        if self.task.end_token:
            parts.append(Ragged(np.full((batch, 1), tok.eos_id), one))
        seq = concat(*parts)
        cols = np.arange(seq.codes.shape[1])
        answer = (cols >= 1 + problems.prompt.lens[:, None]) & (cols < seq.lens[:, None])
        return {
            "input_ids": torch.from_numpy(seq.codes),
            "labels": torch.from_numpy(np.where(answer, seq.codes, -100)),
            "attention_mask": torch.from_numpy((cols < seq.lens[:, None]).astype(np.int64)),
        }

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """Rank `rank`'s batch_size // world_size rows of the global batch of `step`.

        Every rank pads to the global batch's longest sequence, so the ranks' slices concatenate to
        exactly the batch that one process gets with world_size=1.
        """
        require(step >= 0, f"step must be >= 0, got {step}")
        require(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}")
        require(world_size >= 1 and 0 <= rank < world_size, f"need 0 <= rank < world_size, got {rank}, {world_size}")
        require(batch_size % world_size == 0,
                f"the global batch_size ({batch_size}) must be divisible by the number of processes ({world_size})")
        per_rank = batch_size // world_size
        batch = self.to_batch(self._train_problems(step, batch_size))
        return {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}

    def eval_batches(self, split: str, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Every problem of `split` in order, batch_size at a time (the last batch may be smaller)."""
        require(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}")
        problems = self._eval_set(split)
        for start in range(0, len(problems), batch_size):
            yield self.to_batch(problems.take(np.arange(start, min(start + batch_size, len(problems)))))

    def sequence_batches(self, split: str, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """What analyses read: the evaluation batches, labels included (a task never corrupts its input)."""
        return self.eval_batches(split, batch_size)

    def examples(self, split: str, count: int) -> list[tuple[str, str]]:
        """The first `count` (prompt, answer) strings of a split ('train' = the batch of step 0)."""
        require(1 <= count <= MAX_EXAMPLES, f"count must lie in [1, {MAX_EXAMPLES:,}], got {count}")
        if split not in ("train", *self.splits):
            raise ConfigError(unknown_key_message(f"split of task '{self.task.name}'", split, ("train", *self.splits)))
        problems = self._train_problems(0, count) if split == "train" else self._eval_set(split)
        problems = problems.take(np.arange(min(count, len(problems))))
        return list(zip(problems.prompt.strings(), problems.answer.strings()))
