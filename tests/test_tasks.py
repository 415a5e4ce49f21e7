"""poslab.tasks: formats and semantics, splits, determinism, batches, tokenizer, evaluation, CLI."""
from __future__ import annotations

import argparse
import collections
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from poslab.batches import BatchSource
from poslab.batches import build_batch_source as build_any_source
from poslab.errors import ConfigError, DataError
from poslab.tasks import TASKS, CharTokenizer, build_batch_source, evaluate, exact_match, get_task
from poslab.tasks.base import Ragged
from poslab.tasks.cli import register
from poslab.tasks.source import BUCKETS

SMALL = {"validation_size": 64, "test_size": 64}


# ---- independent checkers: parse the string, recompute the answer, return the problem's length ----

def check_indirect_indexing(prompt: str, answer: str, opts) -> int:
    m = re.fullmatch(r"([^, ]+), ([^, ]), ([+-])(\d+), ", prompt)
    assert m, prompt
    s, source, shift = m[1], m[2], int(m[3] + m[4])
    assert len(set(s)) == len(s) and set(s) <= set(opts.letters), prompt
    assert source in s and opts.min_shift <= shift <= opts.max_shift, prompt
    assert m[4] == str(abs(shift)), prompt  # no leading zeros
    target = s.index(source) + shift
    assert 0 <= target < len(s) and answer == s[target], (prompt, answer)
    return len(s)


def check_addition(prompt: str, answer: str, opts) -> int:
    m = re.fullmatch(r"(0|[1-9]\d*)\+(0|[1-9]\d*)=", prompt)
    assert m and answer == str(int(m[1]) + int(m[2])), (prompt, answer)
    return len(prompt) - 1


def check_reversal(prompt: str, answer: str, opts) -> int:
    m = re.fullmatch(r"rev\((\d+)\)=", prompt)
    assert m and answer == m[1][::-1], (prompt, answer)
    return len(prompt) - 1


def check_indexing(prompt: str, answer: str, opts) -> int:
    m = re.fullmatch(r"wherex\((\d+),(\d)\)=", prompt)
    assert m and answer == str(m[1].index(m[2])), (prompt, answer)
    return len(prompt) - 1


def check_ordering(prompt: str, answer: str, opts) -> int:
    m = re.fullmatch(r"order\((\d+),(\d+)\)=", prompt)
    assert m, prompt
    sequence, permuted = m[1], m[2]
    assert len(set(sequence)) == len(sequence) and sorted(permuted) == sorted(sequence), prompt
    assert answer == "".join(str(sequence.index(c)) for c in permuted), (prompt, answer)
    return len(prompt) - 1


CHECKERS = {"indirect_indexing": check_indirect_indexing, "addition": check_addition,
            "reversal": check_reversal, "indexing": check_indexing, "ordering": check_ordering}

# The papers' examples (ordering: our documented example), split into prompt and answer.
PAPER = {
    "indirect_indexing": ("NZTUIGWkXFrhCJDzscat, N, +4, ", "I"),
    "addition": ("123+456=", "579"),
    "reversal": ("rev(1234)=", "4321"),
    "indexing": ("wherex(134504392,4)=", "2"),
    "ordering": ("order(3829,8293)=", "1230"),
}


def check_source(source, split: str, count: int) -> list[int]:
    """Every example of the split satisfies its task's semantics; returns their lengths."""
    check, opts = CHECKERS[source.task.name], source.options
    lengths = [check(p, a, opts) for p, a in source.examples(split, count)]
    assert all(opts.min_len <= n <= opts.max_len for n in lengths)
    return lengths


def test_registry_names_every_task_and_rejects_unknown_names():
    assert set(TASKS) == set(CHECKERS)
    with pytest.raises(ConfigError, match="did you mean 'addition'.*indexing.*indirect_indexing.*ordering.*reversal"):
        get_task("additon")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_paper_example_and_generated_problems_share_the_format(name):
    source = build_batch_source(0, name, train_size=None, **SMALL)
    prompt, answer = PAPER[name]
    CHECKERS[name](prompt, answer, source.options)  # the paper's example passes the checker ...
    lengths = check_source(source, "train", 300)  # ... and so does every generated problem
    check_source(source, "validation", 64)
    check_source(source, "test", 64)
    assert len(set(lengths)) == len(source.task.lengths())  # every possible length occurs
    for step in range(3):
        assert source.train_batch(step, 64)["input_ids"].shape[1] <= source.max_seq_len
    tokenizer = source.tokenizer
    assert tokenizer.decode(tokenizer.encode(prompt + answer)) == prompt + answer


def test_paper_defaults():
    o = get_task("indirect_indexing").Options()
    assert (o.min_len, o.max_len, o.min_shift, o.max_shift, len(o.letters)) == (20, 40, -15, 15, 52)
    assert (o.train_size, o.validation_size, o.test_size) == (1_000_000, 10_000, 10_000)
    assert {n: get_task(n).Options().max_len for n in ("addition", "reversal", "indexing", "ordering")} == {
        "addition": 9, "reversal": 22, "indexing": 20, "ordering": 18}
    assert all(get_task(n).Options().train_size == 20_000 for n in ("addition", "reversal", "indexing", "ordering"))


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_indirect_indexing_properties(data):
    size = data.draw(st.integers(3, 52), label="alphabet_size")
    max_len = data.draw(st.integers(2, size), label="max_len")
    min_len = data.draw(st.integers(2, max_len), label="min_len")
    min_shift = data.draw(st.integers(-(min_len - 1), min_len - 1), label="min_shift")
    max_shift = data.draw(st.integers(min_shift, min_len - 1), label="max_shift")
    source = build_batch_source(data.draw(st.integers(0, 2**32)), "indirect_indexing", alphabet_size=size,
                                min_len=min_len, max_len=max_len, min_shift=min_shift, max_shift=max_shift,
                                train_size=None, holdout=0.25, **SMALL)
    check_source(source, "train", 50)
    batch = source.train_batch(1, 32)
    assert batch["input_ids"].shape[1] <= source.max_seq_len
    assert ((batch["labels"] != -100).sum(dim=1) == 1).all()  # the target alone


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_adjacency_task_properties(data):
    name = data.draw(st.sampled_from(["addition", "reversal", "indexing", "ordering"]), label="task")
    shortest = get_task(name).Options.shortest
    max_len = data.draw(st.integers(shortest + 1, 28 if name == "ordering" else 40), label="max_len")
    min_len = data.draw(st.integers(shortest, max_len - 1), label="min_len")
    source = build_batch_source(data.draw(st.integers(0, 2**32)), name, min_len=min_len, max_len=max_len,
                                train_size=None, holdout=0.25, **SMALL)
    lengths = check_source(source, "train", 50)
    if name == "ordering":
        assert all(n % 2 == 0 for n in lengths)
    assert source.train_batch(0, 32)["input_ids"].shape[1] <= source.max_seq_len


def test_longest_sequences_reach_max_seq_len():
    for name, longest in (("reversal", 22), ("ordering", 18), ("indirect_indexing", 40), ("addition", 3)):
        source = build_batch_source(0, name, min_len=longest, max_len=longest, train_size=None, **SMALL)
        assert source.train_batch(0, 256)["input_ids"].shape[1] == source.max_seq_len == source.max_train_len, name


@pytest.mark.parametrize("name", ["addition", "reversal", "indexing", "ordering", "indirect_indexing"])
def test_max_train_len_bounds_training_batches_and_test_long_goes_past_it(name):
    """What the trainer checks the model against before step 1: no training batch is wider, and with
    train_max_len the longer problems only reach the test_long split (up to max_seq_len)."""
    # its defaults are the paper's strings of 20-40 letters and shifts up to 15
    lengths = {"min_len": 10, "min_shift": -3, "max_shift": 3} if name == "indirect_indexing" else {}
    source = build_batch_source(0, name, max_len=16, train_max_len=12, train_size=None, **lengths, **SMALL)
    widths = [source.train_batch(step, 64)["input_ids"].shape[1] for step in range(8)]
    assert max(widths) <= source.max_train_len < source.max_seq_len
    longest = max(batch["input_ids"].shape[1] for batch in source.eval_batches("test_long", 64))
    assert source.max_train_len < longest <= source.max_seq_len


def prompts(batches, tokenizer) -> list[str]:
    out = []
    for batch in batches:
        for ids, labels in zip(batch["input_ids"], batch["labels"]):
            out.append(tokenizer.decode(ids[: int(torch.nonzero(labels != -100)[0])]))
    return out


def as_ragged(strings: list[str]) -> Ragged:
    width = max(map(len, strings))
    codes = np.array([list(s.encode().ljust(width, b"\0")) for s in strings], dtype=np.uint8)
    return Ragged(codes, np.array([len(s) for s in strings]))


@pytest.mark.parametrize("train_size", [None, 400])
def test_splits_never_overlap_in_a_small_problem_space(train_size):
    # addition up to length 5 has 11,110 problems
    source = build_batch_source(3, "addition", max_len=5, holdout=0.2, train_size=train_size,
                                validation_size=300, test_size=300)
    tok = source.tokenizer
    validation = set(prompts(source.eval_batches("validation", 128), tok))
    test = set(prompts(source.eval_batches("test", 128), tok))
    train = set(prompts((source.train_batch(step, 128) for step in range(40)), tok))
    assert len(validation) > 100 and len(test) > 100 and len(train) > 300
    assert not validation & test and not train & validation and not train & test


def test_each_problem_has_one_split_and_training_reaches_all_of_its_own():
    # ordering up to length 12 has 190 problems (10 with one digit, 90 x 2 with two): list them all
    source = build_batch_source(3, "ordering", max_len=12, holdout=0.2, train_size=None,
                                validation_size=300, test_size=300)
    everything = [f"order({d},{d})=" for d in "0123456789"] + [
        f"order({a}{b},{p})=" for a in "0123456789" for b in "0123456789" if a != b for p in (a + b, b + a)]
    assert len(set(everything)) == 190
    split = dict(zip(everything, source.split_of(as_ragged(everything)).tolist()))
    tok = source.tokenizer
    train = set(prompts((source.train_batch(step, 128) for step in range(40)), tok))
    assert train == {p for p, s in split.items() if s == 0}  # 5,120 draws reach every training problem
    assert {split[p] for p in prompts(source.eval_batches("validation", 128), tok)} == {1}
    assert {split[p] for p in prompts(source.eval_batches("test", 128), tok)} == {2}


def test_lengths_are_uniform_whatever_share_of_a_length_a_split_holds():
    """A split takes each length equally often (of those it holds problems of), however the hash happens to split
    a short length's few problems: ordering has 10 one-digit problems, so a 5% split holds none, one or a few of
    them, and rejection over all lengths at once weighted each length by that share (one problem was 31% of
    data_seed 0's test split, whose lengths were drawn uniformly over five)."""
    one_digit = as_ragged([f"order({d},{d})=" for d in "0123456789"])
    for data_seed in range(3):
        source = build_batch_source(0, "ordering", data_seed=data_seed, train_size=None, validation_size=3000,
                                    test_size=3000)
        held = source.split_of(one_digit)
        tok = source.tokenizer
        train = [len(p) - 1 for p in prompts((source.train_batch(step, 100) for step in range(30)), tok)]
        for split, lengths in (("train", train), *((s, [len(p) - 1 for p, _ in source.examples(s, 3000)])
                                                   for s in ("validation", "test"))):
            present = ([10] if (held == BUCKETS[split]).any() else []) + [12, 14, 16, 18]
            counts = collections.Counter(lengths)
            assert sorted(counts) == present, (data_seed, split)
            for n in present:  # 3 standard deviations of a binomial share
                assert counts[n] / len(lengths) == pytest.approx(1 / len(present), abs=0.025), (data_seed, split, n)


def test_distinct_counts_the_different_problems_of_an_evaluation_set():
    source = build_batch_source(0, "ordering", train_size=None, validation_size=300, test_size=3000)
    different, size = source.distinct("test")
    assert size == 3000 and different == len(set(prompts(source.eval_batches("test", 500), source.tokenizer)))
    assert different < size  # the shortest lengths have few problems, drawn as often as the longest


def test_length_generalisation_split():
    source = build_batch_source(0, "reversal", max_len=16, train_max_len=10, train_size=None, **SMALL)
    assert source.splits == ("validation", "test", "test_long")
    assert max(check_source(source, "train", 500)) == 10
    assert max(check_source(source, "validation", 64)) <= 10
    assert min(check_source(source, "test_long", 64)) == 11 and max(check_source(source, "test_long", 64)) == 16
    with pytest.raises(ConfigError, match="split of task 'reversal'.*test_long"):
        next(build_batch_source(0, "reversal", **SMALL).eval_batches("test_long", 8))


def test_determinism_and_what_each_seed_controls():
    def make(seed, data_seed=0, train_size=None):
        return build_batch_source(seed, "indexing", data_seed=data_seed, train_size=train_size, **SMALL)

    def same(a, b):
        return all(torch.equal(a[k], b[k]) for k in a) and a.keys() == b.keys()

    a, b = make(1), make(1)
    assert same(a.train_batch(7, 32), b.train_batch(7, 32))
    assert not same(a.train_batch(7, 32), a.train_batch(8, 32))
    assert not same(a.train_batch(7, 32), make(2).train_batch(7, 32))
    assert same(a.train_batch(7, 32), make(1).train_batch(7, 32))  # order of calls does not matter
    evals = [list(s.eval_batches("test", 20)) for s in (a, make(2), make(1, data_seed=5))]
    assert all(same(x, y) for x, y in zip(evals[0], evals[1]))  # the training seed leaves eval sets alone
    assert not same(evals[0][0], evals[2][0])  # data_seed changes them
    p, q = make(1, train_size=100), make(1, train_size=100)
    assert same(p.train_batch(9, 32), q.train_batch(9, 32))


def test_no_two_random_streams_coincide():
    """numpy pads a shorter seed list with zeros: [data_seed, 3] (validation) once seeded the first training
    batch of seed 3 ([data_seed, 3, 0, 0]), whose lengths then equalled the validation set's, row for row."""
    from poslab.tasks.source import STREAMS, stream_rng

    source = build_batch_source(3, "indexing", train_size=None, **SMALL)
    pad = source.tokenizer.pad_id
    first = source.train_batch(0, 64)["input_ids"]
    validation = next(source.eval_batches("validation", 64))["input_ids"]
    assert ((first != pad).sum(1) == (validation != pad).sum(1)).float().mean() < 0.5

    keys = [(stream, *coordinates) for stream in STREAMS
            for coordinates in [(), (0,), (3,), (0, 0), (3, 0), (0, 3, 0), (0, 3), (2**32,), (0, 1), (1, 2**32)]]
    draws = {key: stream_rng(*key).integers(2**63) for key in keys}
    assert len(set(draws.values())) == len({(k[0], *k[1:], *(0,) * (4 - len(k))) for k in keys})
    # a value past 2^64 would take three words: ("order", 2**64, e) would be ("order", 0, 1 + (e << 32))
    for coordinates in [(2**64, 0), (0, -1)]:
        with pytest.raises(ConfigError, match=r"task stream coordinates must lie in \[0, 2\^64\)"):
            stream_rng("order", *coordinates)


@pytest.mark.parametrize("train_size", [None, 50])
def test_rank_slices_concatenate_to_the_global_batch(train_size):
    source = build_batch_source(0, "addition", train_size=train_size, **SMALL)
    for step in (0, 3):
        whole = source.train_batch(step, 24)
        for world in (2, 3, 4):
            parts = [source.train_batch(step, 24, rank, world) for rank in range(world)]
            assert all(p["input_ids"].shape[0] == 24 // world for p in parts)
            for key in whole:
                assert torch.equal(torch.cat([p[key] for p in parts]), whole[key])


def test_training_pool_is_visited_once_per_epoch():
    source = build_batch_source(0, "ordering", train_size=64, **SMALL)

    def texts(step, batch_size):
        return [source.tokenizer.decode(row) for row in source.train_batch(step, batch_size)["input_ids"]]

    epochs = [[t for step in range(4 * e, 4 * e + 4) for t in texts(step, 16)] for e in (0, 1)]
    pool = [p + a for p, a in zip(*(r.strings() for r in source._sets["train"]))]
    assert len(pool) == 64 and sorted(epochs[0]) == sorted(pool) == sorted(epochs[1])
    assert epochs[0] != epochs[1]  # each epoch has its own order
    # the position in the stream, not the batch size, picks the example: step 2 of size 24 holds
    # examples 48..71, the end of epoch 0 and the start of epoch 1
    assert texts(2, 24) == epochs[0][48:] + epochs[1][:8]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_labels_cover_exactly_the_answer_and_its_end_token(name):
    source = build_batch_source(0, name, train_size=None, **SMALL)
    tok = source.tokenizer
    batch = source.train_batch(0, 32)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.dtype == labels.dtype == mask.dtype == torch.long
    examples = source.examples("train", 32)
    for row, (prompt, answer) in enumerate(examples):
        n = int(mask[row].sum())
        assert mask[row, :n].all() and not mask[row, n:].any()  # right padding
        assert (ids[row, n:] == tok.pad_id).all() and ids[row, 0] == tok.bos_id
        real = ids[row, :n].tolist()
        eos = [tok.eos_id] if source.task.end_token else []
        assert real == [tok.bos_id] + tok.encode(prompt + answer) + eos
        labelled = labels[row] != -100
        start = 1 + len(prompt)
        assert labelled.tolist() == [start <= i < n for i in range(ids.shape[1])]
        assert torch.equal(labels[row][labelled], ids[row][labelled])
        assert tok.decode(labels[row][labelled]) == answer


def test_tokenizer_round_trip_and_file(tmp_path):
    tok = build_batch_source(0, "indirect_indexing", train_size=None, **SMALL).tokenizer
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2) and tok.vocab_size == 3 + 52 + 14
    text = "NZTUIGWkXFrhCJDzscat, N, +4, I"
    assert tok.decode(tok.encode(text)) == text
    with_specials = [tok.bos_id, *tok.encode("ab"), tok.eos_id, tok.pad_id]
    assert tok.decode(with_specials, skip_special=False) == "<bos>ab<eos><pad>"
    assert tok.decode(with_specials) == "ab"
    codes = np.frombuffer(text.encode(), dtype=np.uint8)
    assert tok.ids_of_codes(codes).tolist() == tok.encode(text)
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    assert CharTokenizer.load(path) == tok and [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]
    with pytest.raises(DataError, match="not in the tokenizer's vocabulary"):
        tok.encode("a=b")
    with pytest.raises(DataError, match="out of range"):
        tok.decode([tok.vocab_size])
    with pytest.raises(DataError, match="does not exist"):
        CharTokenizer.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not readable JSON"):
        CharTokenizer.load(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"format": "something", "chars": "ab"}')
    with pytest.raises(DataError, match="is not a poslab.CharTokenizer file"):
        CharTokenizer.load(tmp_path / "other.json")
    with pytest.raises(ConfigError, match="distinct"):
        CharTokenizer("abca")


@pytest.mark.parametrize("name, options, message", [
    ("addition", {"max_lenn": 5}, "unknown option for task 'addition' 'max_lenn'; did you mean 'max_len'"),
    ("addition", {"max_len": "9"}, "addition.max_len must be an integer, got '9'"),
    ("addition", {"max_len": True}, "addition.max_len must be an integer, got True"),
    ("addition", {"min_len": 2}, "addition.min_len must be >= 3"),
    ("reversal", {"min_len": 12, "max_len": 10}, r"reversal.max_len \(10\) must be >= min_len \(12\)"),
    ("reversal", {"train_max_len": 22}, r"train_max_len must lie in \[min_len, max_len\)"),
    ("indexing", {"holdout": 0.5}, r"indexing.holdout must lie in \[0.0001, 0.45\]"),
    ("indexing", {"holdout": 1e-12}, r"indexing.holdout must lie in \[0.0001, 0.45\]"),
    ("indexing", {"holdout": float("nan")}, "indexing.holdout must be a finite number"),
    ("indexing", {"data_seed": 2**64}, r"indexing.data_seed must lie in \[0, 2\^64\)"),
    ("indexing", {"test_size": 0}, r"indexing.test_size must lie in \[1, 10,000,000\]"),
    # 10^12 drew problems for over 5 minutes before it was stopped: splits are drawn whole.
    ("reversal", {"validation_size": 10**12}, r"reversal.validation_size must lie in \[1, 10,000,000\]"),
    ("indexing", {"train_size": 10**8}, r"indexing.train_size must lie in \[1, 10,000,000\] \(splits are drawn"),
    # accepted one by one, together a day and a half of drawing
    ("addition", {"holdout": 1e-4, "validation_size": 10**7}, r"addition.validation_size / holdout = 1e\+11 draws "
                                                               r"to fill the split, past 2e\+08"),
    ("indexing", {"train_size": 2.5}, "indexing.train_size must be an integer or null"),
    ("ordering", {"max_len": 30}, "ordering.max_len must be <= 28"),
    # 10^11 asked numpy for 745 GiB (an array of every length); the bound says why it is there.
    ("addition", {"max_len": 10**11}, r"addition.max_len must be <= 512 \(one problem is one sequence"),
    ("reversal", {"max_len": 513}, "reversal.max_len must be <= 512"),
    ("ordering", {"min_len": 11, "max_len": 11}, "task 'ordering' has no problem of length in"),
    ("ordering", {"max_len": 13, "train_max_len": 12}, "no problem longer than train_max_len=12"),
    ("indirect_indexing", {"alphabet_size": 10}, r"max_len \(40\) exceeds the alphabet size \(10\)"),
    ("indirect_indexing", {"alphabet": "ABCA"}, "repeated characters"),
    ("indirect_indexing", {"alphabet": "AB,C"}, "may not contain ','"),
    ("indirect_indexing", {"min_len": 10, "max_len": 20}, r"min_len \(10\) must exceed the largest \|shift\| \(15\)"),
    ("indirect_indexing", {"min_shift": 3, "max_shift": 1}, r"min_shift \(3\) must be <= max_shift \(1\)"),
    ("indirect_indexing", {"alphabet_size": 60}, r"alphabet_size must lie in \[2, 52\]"),
])
def test_bad_options_are_rejected_with_a_clear_message(name, options, message):
    with pytest.raises(ConfigError, match=message):
        build_batch_source(0, name, **options)


def test_bad_batch_requests_are_rejected():
    source = build_batch_source(0, "addition", train_size=None, **SMALL)
    with pytest.raises(ConfigError, match=r"batch_size \(10\) must be divisible by the number of processes \(4\)"):
        source.train_batch(0, 10, 0, 4)
    with pytest.raises(ConfigError, match="0 <= rank < world_size"):
        source.train_batch(0, 8, 2, 2)
    with pytest.raises(ConfigError, match="unknown split of task 'addition' 'valid'; did you mean 'validation'"):
        next(source.eval_batches("valid", 8))
    with pytest.raises(ConfigError, match="seed must be a non-negative integer"):
        build_batch_source(-1, "addition")


def test_a_split_the_problem_space_cannot_fill_raises_data_error():
    # ordering with one digit has 10 problems; pick a data_seed that holds none of them out for validation
    def source(data_seed):
        return build_batch_source(0, "ordering", min_len=10, max_len=10, holdout=0.01, data_seed=data_seed, **SMALL)

    everything = source(0)._draw(np.random.default_rng(0), 500, np.array([10]), None, "all")
    data_seed = next(s for s in range(100) if not (source(s).split_of(everything.prompt) == 1).any())
    with pytest.raises(DataError, match="only 0 of 64 validation problems.*raise holdout or max_len"):
        next(source(data_seed).eval_batches("validation", 8))


def test_built_through_poslab_batches():
    source = build_any_source("task", seed=0, name="reversal", train_size=None, **SMALL)
    assert isinstance(source, BatchSource) and source.vocab_size == source.tokenizer.vocab_size
    with pytest.raises(ConfigError, match=r"needs the task's name \(data.name\): one of indirect_indexing, addition"):
        build_any_source("task", seed=0, max_len=5)


# ---- evaluation: teacher-forced exact match == greedy decoding ----------------------------------

class PartlyRightModel(torch.nn.Module):
    """A causal model: a random GRU, plus a large bonus on the true next answer token for about 4 in 5
    prefixes (chosen by a hash of the prefix), so some answers are right, some wrong at the first
    token and some wrong later."""

    def __init__(self, vocab_size: int, known: dict[tuple[int, ...], int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab_size, 16)
        self.gru = torch.nn.GRU(16, 16, batch_first=True)
        self.head = torch.nn.Linear(16, vocab_size)
        self.known = known

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.gru(self.embed(ids))[0])
        for b in range(ids.shape[0]):
            for i in range(int(mask[b].sum())):
                prefix = tuple(ids[b, : i + 1].tolist())
                if prefix in self.known and hash(prefix) % 5 != 0:
                    logits[b, i, self.known[prefix]] += 100.0
        return logits


def greedy(model, prompt: list[int], steps: int, eos: int) -> list[int]:
    """Explicit greedy decoding, one token at a time on the unpadded sequence, stopping at <eos>."""
    seq = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([seq]), torch.ones(1, len(seq), dtype=torch.long))
        seq.append(int(logits[0, -1].argmax()))
        if seq[-1] == eos:
            break
    return seq[len(prompt):]


@pytest.mark.parametrize("name", ["addition", "indirect_indexing"])
def test_teacher_forced_exact_match_equals_greedy_decoding(name):
    options = {"alphabet_size": 8, "min_len": 6, "max_len": 8, "min_shift": -3, "max_shift": 3} \
        if name == "indirect_indexing" else {"max_len": 7}
    source = build_batch_source(0, name, train_size=None, validation_size=80, test_size=8, **options)
    examples = []  # (prompt ids, answer ids incl. <eos>)
    for batch in source.eval_batches("validation", 16):
        for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            start = int(torch.nonzero(labels != -100)[0])
            examples.append((ids[:start].tolist(), ids[start:int(mask.sum())].tolist()))
    known = {tuple(p + a[:j]): a[j] for p, a in examples for j in range(len(a))}
    model = PartlyRightModel(source.vocab_size, known).eval()

    with torch.no_grad():
        by_greedy = [greedy(model, p, len(a), source.tokenizer.eos_id) == a for p, a in examples]
        first_right = [greedy(model, p, 1, -1) == a[:1] for p, a in examples]
        by_teacher = torch.cat([exact_match(model(b["input_ids"], b["attention_mask"]), b["labels"])
                                for b in source.eval_batches("validation", 16)]).tolist()
        # reference loss and token accuracy, one unpadded example at a time
        nll, hits, tokens = 0.0, 0, 0
        for p, a in examples:
            logits = model(torch.tensor([p + a]), torch.ones(1, len(p + a), dtype=torch.long))[0, len(p) - 1:-1]
            nll += float(F.cross_entropy(logits, torch.tensor(a), reduction="sum"))
            hits += int((logits.argmax(-1) == torch.tensor(a)).sum())
            tokens += len(a)
    assert by_teacher == by_greedy
    assert 0 < sum(by_greedy) < len(examples)  # the comparison is not vacuous ...
    if name == "addition":  # ... and includes answers that go wrong after a right first token
        assert any(f and not g for f, g in zip(first_right, by_greedy))
    metrics = evaluate(lambda ids, mask: model(ids, mask), source, "validation", batch_size=32)
    assert metrics["exact_match"] == pytest.approx(sum(by_greedy) / len(examples))
    assert metrics["examples"] == len(examples) and metrics["tokens"] == tokens
    assert metrics["token_accuracy"] == pytest.approx(hits / tokens)
    assert metrics["loss"] == pytest.approx(nll / tokens, rel=1e-5)
    first = evaluate(lambda ids, mask: model(ids, mask), source, "validation", batch_size=16, max_batches=2)
    assert first["examples"] == 32 and first["exact_match"] == pytest.approx(sum(by_greedy[:32]) / 32)


# ---- command line ---------------------------------------------------------------------------------

def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="poslab")
    register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_list_and_show(capsys):
    assert run_cli(["tasks", "list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in TASKS) and "max_len=9" in listed
    assert run_cli(["tasks", "show", "addition", "-n", "4", "--seed", "2", "--set", "max_len=12",
                    "--set", "train_size=null"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    opts = get_task("addition").Options(max_len=12)
    assert all(check_addition(*line.split("\t"), opts) <= 12 for line in lines)
    assert lines == [f"{p}\t{a}" for p, a in build_batch_source(2, "addition", max_len=12, train_size=None)
                     .examples("train", 4)]
    assert run_cli(["tasks", "show", "reversal", "-n", "2", "--split", "test", "--set", "test_size=5"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    with pytest.raises(ConfigError, match="--set expects key.path=value"):
        run_cli(["tasks", "show", "addition", "--set", "max_len"])
    with pytest.raises(ConfigError, match="unknown split of task 'addition' 'tset'"):
        run_cli(["tasks", "show", "addition", "--split", "tset"])


def test_cli_show_refusals_name_the_option():
    """-n is bounded (10^20 was a ValueError from numpy) and named; a --set value that is not YAML is one line
    (it was a yaml ParserError)."""
    for n in ("0", "100001", "100000000000000000000"):
        with pytest.raises(ConfigError, match=r"^-n must lie in \[1, 100,000\] \(samples to print\), got " + n):
            run_cli(["tasks", "show", "addition", "-n", n])
    with pytest.raises(ConfigError, match=r"--set max_len: value '\[1' is not valid YAML; to give it as a string, "
                                          r"quote it inside the argument: 'max_len=\"\[1\"'$"):
        run_cli(["tasks", "show", "addition", "--set", "max_len=[1"])
    with pytest.raises(ConfigError, match=r"count must lie in \[1, 100,000\]"):
        build_batch_source(0, "addition").examples("train", 10**20)


# ---- the drawn problems' distributions (mutation review: a generator that never draws some admissible case
# still writes correct problems, so the checkers above cannot see it) -----------------------------------------

def _sample(name: str, length: int, count: int, **options) -> list[tuple[str, str]]:
    cls = get_task(name)
    prompt, answer = cls(cls.Options(min_len=length, max_len=length, **options)).sample(
        np.random.default_rng(0), np.full(count, length))
    return list(zip(prompt.strings(), answer.strings()))


def test_addition_first_operand_length_is_uniform_over_every_split():
    """A problem of length 5 has operands of 1+3, 2+2 and 3+1 digits, each a third of the time."""
    counts = collections.Counter(len(p.split("+")[0]) for p, _ in _sample("addition", 5, 3000))
    assert sorted(counts) == [1, 2, 3] and all(abs(c / 3000 - 1 / 3) < 0.04 for c in counts.values())


def test_indexing_query_is_drawn_from_every_position():
    """Two digits: the query is the second digit half the time, and then (unless both digits are equal, 1 in
    10) its first occurrence is position 1: answer "1" with probability 0.45."""
    answers = collections.Counter(a for _, a in _sample("indexing", 12, 3000))
    assert set(answers) == {"0", "1"} and abs(answers["1"] / 3000 - 0.45) < 0.04


def test_indirect_indexing_draws_every_shift_and_every_admissible_source():
    """Strings of 4, shifts -1..1: 10 (shift, source position) pairs are admissible, each drawn about equally
    often within its shift (shift uniform, then source uniform where the target stays inside)."""
    pairs = collections.Counter()
    for prompt, _ in _sample("indirect_indexing", 4, 6000, alphabet_size=8, min_shift=-1, max_shift=1):
        letters, source, shift = [part.strip() for part in prompt.split(",")[:3]]
        pairs[int(shift), letters.index(source)] += 1
    admissible = {(s, i) for s in (-1, 0, 1) for i in range(4) if 0 <= i + s < 4}
    assert set(pairs) == admissible
    for (s, _), count in pairs.items():
        assert abs(count / 6000 - 1 / 3 / (4 - abs(s))) < 0.025
