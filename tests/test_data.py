"""Prepared text data: structure labels aligned to tokens, packing, masking, determinism, bad input."""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poslab.batches import BatchSource, build_batch_source
from poslab.data import DataConfig, PreparedCorpus, build_lm_source, build_mlm_source, prepare
from poslab.data.cli import load_data_config, register, run_prepare
from poslab.data.rng import permute
from poslab.data.synthetic import SyntheticCorpus
from poslab.data.tokenizer import load_tokenizer
from poslab.errors import ConfigError, DataError, PoslabError

SYNTH = {"type": "synthetic", "documents": 120, "seed": 1, "paragraphs": [1, 4], "sentences": [1, 4]}
TOKENIZER = {"vocab_size": 600, "train_documents": 120}


def _config(**overrides) -> DataConfig:
    options = {"source": SYNTH, "tokenizer": TOKENIZER, "validation_documents": 10, "shard_tokens": 3000,
               "batch_documents": 8}  # batches straddle the validation/train cut and shard ends
    return DataConfig.from_options({**options, **overrides})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "prepared"
    prepare(_config(), out)
    return out


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir()) if path.parent.exists() else []


# -- preparation -----------------------------------------------------------------------------------------


def test_manifest_and_shards(prepared):
    manifest = json.loads((prepared / "manifest.json").read_text())
    train, validation = manifest["splits"]["train"], manifest["splits"]["validation"]
    assert validation["documents"] == 10 and train["documents"] == 110
    assert len(train["shards"]) > 3  # small shard_tokens forces several shards (and windows across them)
    assert all(s["tokens"] >= 3000 for s in train["shards"][:-1])
    assert manifest["tokenizer"]["vocab_size"] == 600 and manifest["token_dtype"] == "uint16"
    tokens = np.load(prepared / "train" / f"{train['shards'][0]['name']}.tokens.npy", mmap_mode="r")
    assert len(tokens) == train["shards"][0]["tokens"]
    assert [p.name for p in prepared.parent.iterdir()] == ["prepared"]  # no temporary directory left


def test_every_token_of_sentence_k_has_sentence_index_k(prepared):
    """Labels come from character offsets; check them against each sentence tokenized on its own."""
    corpus = PreparedCorpus(prepared)
    tok = load_tokenizer(prepared / "tokenizer")
    synthetic = SyntheticCorpus(**{k: v for k, v in SYNTH.items() if k != "type"})
    for split in ("train", "validation"):
        data = corpus.split(split)
        positions = np.arange(data.n_tokens)
        labels, ids = data.structure(positions), data.tokens(positions)
        for doc_id in np.unique(labels["doc_id"][labels["doc_id"] >= 0])[:40]:
            doc = synthetic.document(int(doc_id))
            in_doc = labels["doc_id"] == doc_id
            np.testing.assert_array_equal(labels["pos_in_document"][in_doc], np.arange(in_doc.sum()))
            k = 0
            for p, paragraph in enumerate(doc):
                par_tokens = 0
                for s, sentence in enumerate(paragraph):
                    sel = in_doc & (labels["sentence_index"] == k)
                    assert ids[sel].tolist() == tok.encode(sentence, add_special_tokens=False).ids
                    assert set(labels["paragraph_index"][sel]) == {p}
                    assert set(labels["sentence_in_paragraph"][sel]) == {s}
                    np.testing.assert_array_equal(labels["pos_in_sentence"][sel], np.arange(sel.sum()))
                    np.testing.assert_array_equal(labels["pos_in_paragraph"][sel], par_tokens + np.arange(sel.sum()))
                    par_tokens += sel.sum()
                    k += 1
            # The document's tokens are followed by exactly one [SEP] with no labels.
            after = np.flatnonzero(in_doc)[-1] + 1
            assert ids[after] == corpus.special_ids["sep"] and labels["doc_id"][after] == -1


@given(seq_len=st.integers(3, 90), packing=st.booleans(), batch_size=st.integers(1, 9))
@settings(max_examples=12, deadline=None)
def test_every_token_exactly_once_per_epoch(prepared, seq_len, packing, batch_size):
    source = build_mlm_source(0, prepared=str(prepared), seq_len=seq_len, packing=packing)
    data = source.corpus.split("validation")
    seen = []
    for batch in source.eval_batches("validation", batch_size):
        real = batch["doc_id"] >= 0
        assert (batch["input_ids"][:, 0] == source.cls_id).all()
        seen += list(zip(batch["doc_id"][real].tolist(), batch["pos_in_document"][real].tolist()))
        if not packing:  # one document per row, closed by [SEP]
            for i, length in enumerate(batch["attention_mask"].sum(1)):
                assert len(set(batch["doc_id"][i][batch["doc_id"][i] >= 0].tolist())) == 1
                assert batch["input_ids"][i, length - 1] == source.sep_id
    labels = data.structure(np.arange(data.n_tokens))
    expected = set(zip(labels["doc_id"][labels["doc_id"] >= 0].tolist(),
                       labels["pos_in_document"][labels["doc_id"] >= 0].tolist()))
    assert len(seen) == len(set(seen)) == len(expected) and set(seen) == expected


def test_packed_sequences_are_the_stream(prepared):
    """Packing: row i is [CLS] + the next L-1 stream tokens (documents separated by [SEP]), across shards."""
    source = build_lm_source(0, prepared=str(prepared), seq_len=50)
    data = source.corpus.split("train")
    stream = data.tokens(np.arange(data.n_tokens))
    rows = torch.cat([b["input_ids"][:, 1:] for b in source.eval_batches("train", 16)])
    masks = torch.cat([b["attention_mask"][:, 1:] for b in source.eval_batches("train", 16)])
    np.testing.assert_array_equal(rows[masks == 1].numpy(), stream)
    assert source.num_sequences("train") == -(-data.n_tokens // 49)


def test_train_order_is_a_permutation_each_epoch(prepared):
    source = build_lm_source(5, prepared=str(prepared), seq_len=64, packing=False)
    n = source.num_sequences("train")
    starts = []
    for step in range(n):  # batch size 1: step s reads sequence permute(s)
        batch = source.train_batch(step, 1)
        starts.append((batch["doc_id"][0, 1].item(), batch["pos_in_document"][0, 1].item()))
    assert len(set(starts)) == n


def test_each_epoch_reads_every_sequence_once_in_a_fresh_order(prepared):
    """With a batch of all n sequences, step e is exactly epoch e: each reads every sequence once, and the
    permutation is drawn per epoch and per seed (the same order every epoch would repeat the batches'
    composition; the same for every seed would make seeds differ only in their masks)."""
    source = build_lm_source(5, prepared=str(prepared), seq_len=64, packing=False, prefetch=False)
    n = source.num_sequences("train")
    orders = []
    for epoch in range(3):
        batch = source.train_batch(epoch, n)
        orders.append(list(zip(batch["doc_id"][:, 1].tolist(), batch["pos_in_document"][:, 1].tolist())))
    assert all(len(set(order)) == n for order in orders) and set(orders[0]) == set(orders[1]) == set(orders[2])
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    other = build_lm_source(6, prepared=str(prepared), seq_len=64, packing=False, prefetch=False).train_batch(0, n)
    other_order = list(zip(other["doc_id"][:, 1].tolist(), other["pos_in_document"][:, 1].tolist()))
    assert set(other_order) == set(orders[0]) and other_order != orders[0]  # the seed chooses the order too


@pytest.mark.parametrize("n", [1000, 1500, 4096, 5000])
def test_permute_mixes_every_bit(n):
    """The Feistel halves cover all of index's bits, so no bit passes through unmixed: the first half of
    an epoch reads about half of its sequences from the second half of the corpus (with a bit left out of
    the rounds, indices below 2^(bits-1) would stay there and the epoch would read the corpus's first
    half first)."""
    for key in range(5):
        out = permute(np.arange(n // 2), n, key, 0)
        assert 0.4 < (out >= n // 2).mean() < 0.6


def test_hash_keys_is_splitmix64_chained_over_the_keys():
    """hash_keys against a pure-Python splitmix64 chain h <- mix(h * golden + k + 1): every coordinate counts,
    a leading zero included (without the + 1, hash_keys(0, k) would equal hash_keys(k) and seed 0 would drop
    out of the keys), and uniform takes the top 53 bits."""
    from poslab.data.rng import hash_keys, uniform

    m = (1 << 64) - 1

    def mix(x):
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    def reference(*keys):
        h = 0
        for k in keys:
            h = mix((h * 0x9E3779B97F4A7C15 + (k & m) + 1) & m)
        return h

    for keys in [(0,), (5,), (0, 5), (0, 0, 5), (3, 1, 7, 2), (2**40, 9), (-1, 4)]:
        assert int(hash_keys(*keys)) == reference(*keys)
        assert float(uniform(*keys)) == (reference(*keys) >> 11) / 2**53
    assert int(hash_keys(0, 5)) != int(hash_keys(5))


@given(st.integers(1, 5000), st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_permute_is_a_bijection(n, key):
    out = permute(np.arange(n), n, key, 0)
    assert sorted(out.tolist()) == list(range(n))


# -- masking and labels ----------------------------------------------------------------------------------


@pytest.mark.parametrize("style, rate, mask_share, random_share", [("neobert", 0.20, 1.0, 0.0),
                                                                   ("bert", 0.15, 0.8, 0.1)])
def test_masking_rates_and_specials(prepared, style, rate, mask_share, random_share):
    source = build_mlm_source(0, prepared=str(prepared), seq_len=64, packing=False, masking={"style": style})
    assert isinstance(source, BatchSource)
    clean = build_lm_source(0, prepared=str(prepared), seq_len=64, packing=False)
    chosen = maskable = as_mask = as_random = 0
    for step in range(20):
        batch, original = source.train_batch(step, 32), clean.train_batch(step, 32)["input_ids"]
        special = torch.isin(original, torch.tensor([source.cls_id, source.sep_id, source.pad_token_id]))
        picked = batch["labels"] != -100
        assert not (picked & special).any()  # special tokens are never masked ...
        assert torch.equal(batch["input_ids"][special], original[special])  # ... nor changed
        assert torch.equal(batch["labels"][picked], original[picked])
        assert torch.equal(batch["input_ids"][~picked], original[~picked])
        chosen += picked.sum().item()
        maskable += (~special).sum().item()
        as_mask += (batch["input_ids"][picked] == source.mask_token_id).sum().item()
        as_random += (batch["input_ids"][picked] != original[picked]).sum().item() - \
            (batch["input_ids"][picked] == source.mask_token_id).sum().item()
    assert maskable > 20000
    assert abs(chosen / maskable - rate) < 0.01
    assert abs(as_mask / chosen - mask_share) < 0.03
    assert abs(as_random / chosen - random_share) < 0.03


def test_random_replacements_are_never_special_tokens(prepared):
    """BERT-style masking's random replacements are drawn from the content vocabulary only: with a 0.9 rate
    some thousand replacements are drawn, and none is [CLS], [SEP], [PAD] or [UNK]."""
    source = build_mlm_source(0, prepared=str(prepared), masking={"style": "bert", "rate": 0.9})
    clean = build_lm_source(0, prepared=str(prepared))
    special = torch.tensor([i for role, i in source.corpus.special_ids.items() if i is not None and role != "mask"])
    replaced = 0
    for step in range(3):
        batch, original = source.train_batch(step, 64), clean.train_batch(step, 64)["input_ids"]
        changed = batch["input_ids"] != original
        drawn = batch["input_ids"][changed & (batch["input_ids"] != source.mask_token_id)]
        assert not torch.isin(drawn, special).any()
        replaced += len(drawn)
    assert replaced > 1000


def test_evaluation_masks_of_different_splits_are_drawn_independently(prepared):
    """Evaluation masks are keyed by the split as well as the sequence: sequence i of validation and
    sequence i of train (both packed, so every content slot is maskable text or [SEP]) share about a
    rate's share of their masked positions, not all of them."""
    source = build_mlm_source(0, prepared=str(prepared), seq_len=64)
    picks = {split: next(iter(source.eval_batches(split, 16)))["labels"] != -100 for split in ("train", "validation")}
    both = (picks["train"] & picks["validation"]).sum().item()
    assert both < 0.5 * min(p.sum().item() for p in picks.values())


def test_masking_rate_is_configurable(prepared):
    source = build_mlm_source(0, prepared=str(prepared), masking={"style": "bert", "rate": 0.4})
    batch = source.train_batch(0, 64)
    real = batch["doc_id"] >= 0
    assert abs((batch["labels"][real] != -100).float().mean().item() - 0.4) < 0.02


def test_batches_are_a_function_of_seed_and_step(prepared):
    a = build_mlm_source(3, prepared=str(prepared), seq_len=48)
    b = build_mlm_source(3, prepared=str(prepared), seq_len=48)  # a resumed run builds a fresh source
    x, y = a.train_batch(7, 8), b.train_batch(7, 8)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert not torch.equal(a.train_batch(8, 8)["labels"], x["labels"])
    assert not torch.equal(build_mlm_source(4, prepared=str(prepared), seq_len=48).train_batch(7, 8)["input_ids"],
                           x["input_ids"])
    # Data-parallel ranks' shares concatenate to the single-process batch.
    shares = [a.train_batch(7, 8, rank=r, world_size=4) for r in range(4)]
    assert all(torch.equal(torch.cat([s[k] for s in shares]), x[k]) for k in x)
    # Prefetching the next step in a background thread changes nothing.
    eager = build_mlm_source(3, prepared=str(prepared), seq_len=48, prefetch=False)
    for step in (0, 1, 2, 5, 6):
        x, y = a.train_batch(step, 8), eager.train_batch(step, 8)
        assert all(torch.equal(x[k], y[k]) for k in x)
    # Evaluation masks do not depend on the batch size; unmasked sequences are the same text.
    e1 = torch.cat([bt["labels"] for bt in a.eval_batches("validation", 3)])
    e2 = torch.cat([bt["labels"] for bt in a.eval_batches("validation", 5)])
    assert torch.equal(e1, e2)
    masked = torch.cat([bt["input_ids"] for bt in a.eval_batches("validation", 4)])
    intact = list(a.sequence_batches("validation", 4))
    assert "labels" not in intact[0] and "sentence_index" in intact[0]
    intact = torch.cat([bt["input_ids"] for bt in intact])
    assert torch.equal(torch.where(e1 != -100, e1, masked), intact) and (intact != a.mask_token_id).all()


def test_lm_labels_and_batch_keys(prepared):
    source = build_batch_source("lm", seed=0, prepared=str(prepared), seq_len=40, packing=False)
    batch = source.train_batch(0, 6)
    assert set(batch) == {"input_ids", "labels", "attention_mask", "doc_id", "paragraph_index", "sentence_index",
                          "sentence_in_paragraph", "pos_in_sentence", "pos_in_paragraph", "pos_in_document",
                          "abs_position"}
    assert all(v.shape == (6, 40) and v.dtype == torch.long for v in batch.values())
    real = batch["attention_mask"] == 1
    assert torch.equal(batch["labels"][real], batch["input_ids"][real]) and (batch["labels"][~real] == -100).all()
    assert (batch["input_ids"][~real] == source.pad_token_id).all()
    assert torch.equal(batch["abs_position"][real], torch.arange(40).expand(6, 40)[real])
    assert source.vocab_size == 600 == len(source.tokenizer)
    lean = build_lm_source(0, prepared=str(prepared), seq_len=40, structure_labels=False).train_batch(0, 2)
    assert set(lean) == {"input_ids", "labels", "attention_mask"}


def test_lm_labels_are_minus_100_exactly_at_padding(prepared):
    """Every sequence of a split, one document per row (so short chunks are padded): LM labels are the input
    ids on real tokens and -100 on every pad, and the pads lie after the real tokens (right padding)."""
    source = build_lm_source(0, prepared=str(prepared), seq_len=40, packing=False)
    batches = list(source.eval_batches("validation", 16)) + [source.train_batch(0, 64)]
    pads = 0
    for batch in batches:
        real = batch["attention_mask"] == 1
        assert torch.equal(batch["labels"][real], batch["input_ids"][real])
        assert (batch["labels"][~real] == -100).all() and (batch["input_ids"][~real] == source.pad_token_id).all()
        assert torch.equal(real, torch.arange(40) < real.sum(1, keepdim=True))  # real tokens first
        pads += (~real).sum().item()
    assert pads > 100  # the check above is not vacuous


# -- tokenizers --------------------------------------------------------------------------------------------


def test_bpe_labels_align(tmp_path):
    out = tmp_path / "bpe"
    prepare(_config(tokenizer={"type": "bpe", "vocab_size": 400, "train_documents": 50, "lowercase": False}, validation_documents=0), out)
    source = build_mlm_source(0, prepared=str(out), seq_len=64)
    data, tok = source.corpus.split("train"), source.tokenizer
    labels, ids = data.structure(np.arange(data.n_tokens)), data.tokens(np.arange(data.n_tokens))
    synthetic = SyntheticCorpus(**{k: v for k, v in SYNTH.items() if k != "type"})
    paragraphs_seen = 0
    for doc_id in range(6):
        doc = synthetic.document(doc_id)
        paragraphs_seen += len(doc) - 1
        # Byte-level BPE keeps whitespace: the separator before a sentence belongs to it, exactly.
        expected = [("" if p == s == 0 else " " if s else "\n\n") + sentence
                    for p, paragraph in enumerate(doc) for s, sentence in enumerate(paragraph)]
        for k, sentence in enumerate(expected):
            in_sentence = (labels["doc_id"] == doc_id) & (labels["sentence_index"] == k)
            assert tok.decode(ids[in_sentence].tolist()) == sentence
    assert paragraphs_seen > 3


def test_a_sentence_without_tokens_is_not_counted(tmp_path):
    """A paragraph of control characters (which the WordPiece normaliser drops) is a sentence without
    tokens: the model never sees it, so it is not counted, and the sentence after it is sentence 1 of paragraph 1
    (it was 2 of 2: a label no model could read off its input). A document of nothing else has no tokens and is
    dropped (its id unused, no lone [SEP]); a tokenless sentence closing the last document is no error."""
    corpus = tmp_path / "c.jsonl"
    docs = [f"Plain words in document {i}.\n\n\u0001\u0002\n\nBye now, friend." for i in range(30)]
    docs[5] = "\u0001\u0002"
    docs[29] += "\n\n\u0003"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "p"
    prepare(_config(source={"type": "jsonl", "paths": str(corpus)}, tokenizer={**TOKENIZER, "vocab_size": 200},
                    validation_documents=0), out)
    data, tok = PreparedCorpus(out).split("train"), load_tokenizer(out / "tokenizer")
    labels, ids = data.structure(np.arange(data.n_tokens)), data.tokens(np.arange(data.n_tokens))
    assert data.n_documents == 29 and set(labels["sentence_index"].tolist()) == {-1, 0, 1}
    assert set(labels["doc_id"].tolist()) == set(range(30)) - {5} | {-1}
    assert (ids == PreparedCorpus(out).special_ids["sep"]).sum() == 29  # one [SEP] per kept document
    for doc_id in set(range(30)) - {5}:
        in_doc = labels["doc_id"] == doc_id
        np.testing.assert_array_equal(labels["pos_in_document"][in_doc], np.arange(in_doc.sum()))
        last = in_doc & (labels["sentence_index"] == 1)
        assert ids[last].tolist() == tok.encode("Bye now, friend.", add_special_tokens=False).ids
        assert set(labels["paragraph_index"][last]) == {1} and set(labels["sentence_in_paragraph"][last]) == {0}
        np.testing.assert_array_equal(labels["pos_in_sentence"][last], np.arange(last.sum()))
        np.testing.assert_array_equal(labels["pos_in_paragraph"][last], np.arange(last.sum()))


def test_special_token_strings_in_the_text_are_text(tmp_path):
    """"[SEP]" written in a document was encoded as the separator (a document boundary mid-document), "[MASK]" as
    a mask the masking never chose and [PAD] as padding the model attends to. They are text now; the saved
    tokenizer still reads them as special tokens, as its users expect."""
    corpus = tmp_path / "c.jsonl"
    docs = [f"Plain words {i} here. The model reads [MASK] and [SEP] and [CLS] and [PAD] too." for i in range(12)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "p"
    prepare(_config(source={"type": "jsonl", "paths": str(corpus)}, tokenizer={**TOKENIZER, "vocab_size": 120},
                    validation_documents=0), out)
    corpus_ = PreparedCorpus(out)
    data = corpus_.split("train")
    ids = data.tokens(np.arange(data.n_tokens))
    special = corpus_.special_ids
    assert (ids == special["sep"]).sum() == 12 and not np.isin(ids, [special[r] for r in ("cls", "pad", "mask")]).any()
    labels = data.structure(np.arange(data.n_tokens))
    np.testing.assert_array_equal(labels["doc_id"][ids == special["sep"]], -1)
    assert corpus_.tokenizer("[SEP]", add_special_tokens=False)["input_ids"] == [special["sep"]]


def test_a_hub_tokenizer_leaves_the_corpus_files_checked():
    """A tokenizer named by hub id (bert-base-uncased) has no local files: the corpus files went unrecorded with
    it, so an edited corpus was read from a stale cache entry."""
    from poslab.data.preparation import _local_files

    config = _config(source={"type": "text", "paths": str(Path(__file__))}, tokenizer={"path": "no-such-org/tok"})
    assert list(_local_files(config)) == [str(Path(__file__).resolve())]


def test_special_tokens_keep_their_ids_and_no_content_token_shares_one(prepared):
    """Canonical numbering moves only content tokens: the special tokens keep the first ids, in the
    configured order, as the trainer gave them; each is the id the tokenizer adds it with, and no content
    token holds a special token's id (or any id twice)."""
    assert PreparedCorpus(prepared).special_ids == {"cls": 0, "sep": 1, "pad": 2, "mask": 3, "unk": 4}
    data = json.loads(load_tokenizer(prepared / "tokenizer").to_str())
    vocab, added = data["model"]["vocab"], {t["content"]: t["id"] for t in data["added_tokens"]}
    assert added and all(vocab[token] == i for token, i in added.items())
    assert len(set(vocab.values())) == len(vocab) == 600
    specials = {i for i in PreparedCorpus(prepared).special_ids.values() if i is not None}
    assert specials == set(added.values())
    assert specials.isdisjoint(i for token, i in vocab.items() if token not in added)


def test_saved_tokenizer_adds_cls_and_sep_like_the_pipeline(prepared):
    """The transformers tokenizer saved with the data encodes a text as [CLS] + its tokens + [SEP], as the
    sequences the models train on begin with [CLS] and close documents with [SEP]."""
    corpus = PreparedCorpus(prepared)
    text = "Initially, the model reads a sentence."
    plain = load_tokenizer(prepared / "tokenizer").encode(text, add_special_tokens=False).ids
    ids = corpus.special_ids
    assert corpus.tokenizer(text)["input_ids"] == [ids["cls"]] + plain + [ids["sep"]]


def test_local_tokenizer_directory_and_missing_specials(prepared, tmp_path):
    out = tmp_path / "reuse"
    manifest = prepare(_config(tokenizer={"path": str(prepared / "tokenizer")}), out)
    assert manifest["tokenizer"]["vocab_size"] == 600
    assert (np.load(out / "train" / "00000.tokens.npy") == np.load(prepared / "train" / "00000.tokens.npy")).all()
    # A tokenizer lacking [MASK] is rejected before anything is written.
    from tokenizers import Tokenizer, models, pre_tokenizers

    bare = Tokenizer(models.WordLevel({"[CLS]": 0, "[SEP]": 1, "[PAD]": 2, "[UNK]": 3, "a": 4}, unk_token="[UNK]"))
    bare.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "bare").mkdir()
    bare.save(str(tmp_path / "bare" / "tokenizer.json"))
    with pytest.raises(DataError, match=r"no mask token '\[MASK\]'"):
        prepare(_config(tokenizer={"path": str(tmp_path / "bare")}), tmp_path / "x")
    assert not (tmp_path / "x").exists()
    # ... unless the data is for a causal LM and says so.
    prepare(_config(tokenizer={"path": str(tmp_path / "bare"), "special_tokens": {"mask": None}}), tmp_path / "y")
    with pytest.raises(DataError, match="no mask token"):
        build_mlm_source(0, prepared=str(tmp_path / "y"))
    with pytest.raises(DataError, match="no tokenizer at"):
        prepare(_config(tokenizer={"path": str(tmp_path / "nothing")}), tmp_path / "z")
    # A bert-base-uncased-style directory (vocab.txt + tokenizer_config.json, no tokenizer.json) loads too.
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to", "."]))
    (tmp_path / "bert" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    manifest = prepare(_config(tokenizer={"path": str(tmp_path / "bert")}), tmp_path / "b")
    assert manifest["tokenizer"]["vocab_size"] == 7 and manifest["tokenizer"]["special_ids"]["mask"] == 4


def test_a_tokenizer_named_as_on_the_hugging_face_hub(tmp_path, monkeypatch):
    """The DSTG paper's bert-base-uncased could be used only from a directory downloaded by hand: a hub name
    loads as datasets load by name, through the hub's cache (a cache the test makes; tests run offline)."""
    import huggingface_hub

    snapshot = tmp_path / "hub" / "models--tests--tiny-bert" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to", "."]))
    (snapshot / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    (snapshot / "config.json").write_text(json.dumps({"model_type": "bert"}))  # a model repository's, as the hub's
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)  # no local directory of that name
    manifest = prepare(_config(tokenizer={"path": "tests/tiny-bert"}), tmp_path / "b")
    assert manifest["tokenizer"]["vocab_size"] == 7 and manifest["tokenizer"]["special_ids"]["mask"] == 4
    with pytest.raises(DataError, match=r"^cannot load tokenizer 'tests/no-such-bert': no local directory, and from "
                                        r"the Hugging Face hub: "):
        load_tokenizer("tests/no-such-bert")


def test_a_hub_tokenizer_is_read_from_the_cache_first_and_hub_retries_stay_quiet(tmp_path, monkeypatch, caplog):
    """Offline without HF_HUB_OFFLINE the hub's client retried a minute, a warning line per retry, before falling
    back to its cache; "data/tok" where ./data exists is a mistyped local path, and is never looked up."""
    import logging

    import transformers

    real, calls = transformers.AutoTokenizer.from_pretrained, []

    def spy(name, **kwargs):
        calls.append((name, kwargs.get("local_files_only", False)))
        if name == "cached/bert":
            return real(str(tmp_path / "bert"))
        if not kwargs.get("local_files_only"):
            logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "to"]))
    (tmp_path / "bert" / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    monkeypatch.chdir(tmp_path)
    assert load_tokenizer("cached/bert").get_vocab_size() == 6 and calls == [("cached/bert", True)]
    (tmp_path / "data").mkdir()
    calls.clear()
    with pytest.raises(DataError, match=r"^no tokenizer at data/tok: expected a directory"):
        load_tokenizer("data/tok")
    assert calls == []
    level = logging.getLogger("huggingface_hub").level
    with caplog.at_level(logging.WARNING), pytest.raises(DataError, match=r"'no/such': no local directory, and from "
                                                                         r"the Hugging Face hub: We couldn't connect"):
        load_tokenizer("no/such")
    assert calls == [("no/such", True), ("no/such", False)] and not caplog.records
    assert logging.getLogger("huggingface_hub").level == level  # as it was


@pytest.mark.parametrize("network", ["no name resolution", "proxy", "resolves"])
def test_a_hub_tokenizer_fails_at_once_where_the_hub_cannot_be_reached(network, tmp_path, monkeypatch):
    """Offline without HF_HUB_OFFLINE, a hub name that is not in the cache waited 55 s for the hub client's
    retries before its one-line error. A hub whose host name does not resolve is now known unreachable without
    asking it; behind a proxy (which resolves names itself), or where the name resolves, the hub is asked."""
    import socket

    import huggingface_hub
    import transformers

    from poslab.data import sources

    calls, lookups = [], []

    def spy(name, **kwargs):
        calls.append((name, kwargs.get("local_files_only", False)))
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.")

    def lookup(host, port, *args):
        lookups.append(host)
        if network == "no name resolution":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", port))]

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", spy)
    monkeypatch.setattr(sources.socket, "getaddrinfo", lookup)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub.example.org")
    for name in sources.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if network == "proxy":
        monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example.org:3128")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as err:
        load_tokenizer("no/such")
    if network == "no name resolution":
        assert calls == [("no/such", True)] and lookups == ["hub.example.org"]
        assert str(err.value) == ("cannot load tokenizer 'no/such': no local directory, not in the Hugging Face "
                                  "cache, and the hub (hub.example.org) cannot be reached: its name does not resolve; "
                                  "use a local tokenizer directory, or fetch it where there is internet")
    else:
        assert calls == [("no/such", True), ("no/such", False)] and "We couldn't connect" in str(err.value)
        assert lookups == ([] if network == "proxy" else ["hub.example.org"])


def test_local_tokenizer_truncation_and_padding_are_ignored(prepared, tmp_path):
    """A tokenizer.json may be saved with truncation and padding on (sentence-transformers models ship
    them): applied to whole documents, they cut each to max_length tokens and wrote [PAD]s into the stream."""
    tok = load_tokenizer(prepared / "tokenizer")
    tok.enable_truncation(max_length=8)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]"), pad_token="[PAD]")  # to the batch's longest document
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    out = tmp_path / "reuse"
    prepare(_config(tokenizer={"path": str(tmp_path / "tok")}), out)
    for split in ("train", "validation"):
        ours, reference = PreparedCorpus(out).split(split), PreparedCorpus(prepared).split(split)
        assert ours.n_tokens == reference.n_tokens
        np.testing.assert_array_equal(ours.tokens(np.arange(ours.n_tokens)),
                                      reference.tokens(np.arange(reference.n_tokens)))
    assert json.loads((out / "tokenizer" / "tokenizer.json").read_text())["truncation"] is None


# -- bad input ---------------------------------------------------------------------------------------------


def test_bad_input_leaves_nothing_behind(tmp_path):
    out = tmp_path / "out" / "data"
    with pytest.raises(DataError, match="no such file"):
        prepare(_config(source={"type": "text", "paths": str(tmp_path / "missing.txt")}), out)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    with pytest.raises(DataError, match="corpus is empty"):
        prepare(_config(source={"type": "text", "paths": str(empty)}), out)
    # Failure after shards were written (a broken line late in the file) removes the partial directory.
    broken = tmp_path / "c.jsonl"
    broken.write_text("".join(json.dumps({"text": f"Doc number {i}. Ends here."}) + "\n" for i in range(300)) + "{oops\n")
    with pytest.raises(DataError, match="c.jsonl:301: invalid JSON"):
        prepare(_config(source={"type": "jsonl", "paths": str(broken)}, tokenizer={**TOKENIZER, "train_documents": 5},
                        batch_documents=16, shard_tokens=50), out)
    assert _siblings(out) == []
    with pytest.raises(DataError, match="validation_documents takes 10"):
        prepare(_config(source={**SYNTH, "documents": 10}), out)
    assert _siblings(out) == []


def test_tokenizer_never_learns_from_the_validation_documents(tmp_path):
    """A word only the validation documents use stays out of a trained vocabulary; the same word in the
    training documents gets in. Too few documents to train on is one clear error."""
    corpus = tmp_path / "c.jsonl"

    def write(unique_in_validation: bool) -> None:
        docs = [f"Plain words in document {i}. Nothing rare here." for i in range(40)]
        where = range(10) if unique_in_validation else range(10, 20)
        for i in where:
            docs[i] = "Quizzaciously quizzaciously quizzaciously. " + docs[i]
        corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))

    for unique_in_validation, learned in ((True, False), (False, True)):
        write(unique_in_validation)
        out = tmp_path / f"p{int(unique_in_validation)}"
        prepare(_config(source={"type": "jsonl", "paths": str(corpus)}, tokenizer={**TOKENIZER, "vocab_size": 200}), out)
        assert ("quizzaciously" in load_tokenizer(out / "tokenizer").get_vocab()) is learned
    with pytest.raises(DataError, match="no documents to train the tokenizer on: validation_documents takes 40"):
        prepare(_config(source={"type": "jsonl", "paths": str(corpus)}, validation_documents=40), tmp_path / "none")
    assert not (tmp_path / "none").exists()
    # --out's parents that the preparation made go too; one that existed stays
    with pytest.raises(DataError, match="validation_documents takes 40"):
        prepare(_config(source={"type": "jsonl", "paths": str(corpus)}, validation_documents=40),
                tmp_path / "new" / "nested" / "out")
    assert not (tmp_path / "new").exists()


def test_existing_output_needs_force(prepared, tmp_path):
    out = tmp_path / "d"
    prepare(_config(source={**SYNTH, "documents": 30}), out)
    with pytest.raises(DataError, match="already exists"):
        prepare(_config(), out)
    prepare(_config(source={**SYNTH, "documents": 40}), out, force=True)
    assert json.loads((out / "manifest.json").read_text())["documents_read"] == 40
    assert _siblings(out) == ["d"]
    # A preparation that fails keeps the prepared directory it would have replaced.
    with pytest.raises(DataError, match="validation_documents takes 10"):
        prepare(_config(source={**SYNTH, "documents": 10}), out, force=True)
    assert json.loads((out / "manifest.json").read_text())["documents_read"] == 40 and _siblings(out) == ["d"]


def test_a_force_that_fails_at_its_last_rename_keeps_the_old_copy(tmp_path, monkeypatch):
    """--force moves the old directory aside, then renames the new one into place: an interrupt between the two
    left neither (the old one under a hidden name, the new one deleted)."""
    out = tmp_path / "d"
    prepare(_config(source={**SYNTH, "documents": 30}), out)
    rename = Path.rename

    def interrupted(self, target):
        if self.name.startswith(".d.tmp-"):
            raise KeyboardInterrupt
        return rename(self, target)
    monkeypatch.setattr(Path, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(_config(source={**SYNTH, "documents": 40}), out, force=True)
    assert json.loads((out / "manifest.json").read_text())["documents_read"] == 30 and _siblings(out) == ["d"]


def test_force_replaces_only_an_empty_or_prepared_directory(tmp_path):
    """A mistyped --out with --force is refused before anything is read or written, not deleted."""
    (tmp_path / "notes.txt").write_text("keep me")
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "main.py").write_text("keep me too")
    for name, what in (("notes.txt", "is not a directory"), ("project", "is a directory of other files")):
        with pytest.raises(DataError, match=f"--force replaces only an empty or a prepared data directory.*{what}"):
            prepare(_config(), tmp_path / name, force=True)
    assert (tmp_path / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "project" / "main.py").read_text() == "keep me too"
    assert _siblings(tmp_path / "notes.txt") == ["notes.txt", "project"]
    (tmp_path / "empty").mkdir()
    prepare(_config(source={**SYNTH, "documents": 30}), tmp_path / "empty", force=True)
    assert (tmp_path / "empty" / "manifest.json").is_file()


@pytest.mark.parametrize("options, message", [
    ({"seq_len": 1}, "seq_len must be an integer >= 2"),
    ({"seq_len": 2, "packing": False}, "seq_len must be >= 3 with packing: false"),
    ({"masking": {"style": "bret"}}, "did you mean 'bert'"),
    ({"masking": {"rate": 1.5}}, r"masking.rate must lie in \(0, 1\)"),
    ({"seqlen": 5}, "did you mean 'seq_len'"),
    ({"tokenizer": {"type": "sentencepiece"}}, "unknown tokenizer type"),
    # Unhashable names from YAML are refused as unknown, not as a TypeError from `name in registry`.
    ({"tokenizer": {"type": []}}, "unknown tokenizer type"),
    ({"masking": {"style": {}}}, "unknown masking style"),
    ({"source": {"type": ["jsonl"]}}, "unknown source type"),
    # Every typed field is checked against its annotation when the config is built.
    ({"tokenizer": {"lowercase": "no"}}, "tokenizer.lowercase must be true or false, got 'no'"),
    ({"tokenizer": {"vocab_size": True}}, "tokenizer.vocab_size must be an integer, got True"),
    ({"tokenizer": {"lowercas": True}}, "unknown data.tokenizer key 'lowercas'; did you mean 'lowercase'"),
    ({"tokenizer": "bert"}, "data.tokenizer must be a mapping, got str"),
    ({"masking": {"rate": float("nan")}}, "masking.rate must be a finite number"),
    ({"seq_len": 16.0}, "seq_len must be an integer, got 16.0"),
    ({"prefetch": "yes"}, "prefetch must be true or false, got 'yes'"),
    ({"cache_dir": 3}, "cache_dir must be a string or null, got 3"),
    # A trained WordPiece encodes any unseen character as unk: without one, preparation died with a traceback
    # at the first such character, possibly hours in.
    ({"tokenizer": {"special_tokens": {"unk": None}}}, "a trained wordpiece tokenizer needs an unk token"),
    # Were tracebacks from the trainer (5, [1]), or accepted: one id for [CLS] and [SEP], an empty token.
    ({"tokenizer": {"special_tokens": {"cls": 5}}}, "special_tokens.cls must be a token .* got 5"),
    ({"tokenizer": {"special_tokens": {"cls": [1]}}}, "special_tokens.cls must be a token"),
    ({"tokenizer": {"special_tokens": {"cls": ""}}}, "special_tokens.cls must be a token"),
    # a space split the post-processor's template: a ValueError after the tokenizer had trained
    ({"tokenizer": {"special_tokens": {"cls": "a b"}}}, "special_tokens.cls must be a token \\(a non-empty string "
                                                          "without spaces\\) or null, got 'a b'"),
    ({"source": {"type": "text", "paths": ".", "glob": "/tmp/*.txt"}}, "text source glob must be a pattern inside"),
    ({"source": {"type": "jsonl", "paths": ".", "glob": "../*.jsonl"}}, "jsonl source glob must be a pattern inside"),
    ({"source": {**SYNTH, "seed": 1.5}}, "synthetic seed must be an integer, got 1.5"),
    ({"tokenizer": {"special_tokens": {"cls": "[X]", "sep": "[X]"}}}, "gives '\\[X\\]' more than one role"),
])
def test_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        _config(**options)


def test_prepare_dict_is_the_preparation_fields():
    config = _config(seq_len=16, packing=False)
    assert list(config.prepare_dict()) == ["source", "tokenizer", "validation_documents", "shard_tokens"]
    assert config.prepare_dict() == _config(seq_len=64).prepare_dict()  # reading options do not re-prepare
    assert config.prepare_dict()["tokenizer"]["vocab_size"] == 600


def test_sources_declare_their_splits(prepared):
    """What a run may name as train.eval_split, known before training starts."""
    assert build_mlm_source(0, prepared=str(prepared)).splits == ("train", "validation")
    assert build_lm_source(0, prepared=str(prepared)).splits == ("train", "validation")


def test_source_level_errors(prepared):
    with pytest.raises(ConfigError, match="masking applies to masked-LM data"):
        build_lm_source(0, prepared=str(prepared), masking={"style": "bert"})
    with pytest.raises(DataError, match="not a prepared data directory"):
        build_mlm_source(0, prepared=str(prepared / "train"))
    with pytest.raises(DataError, match="unknown split"):
        next(build_mlm_source(0, prepared=str(prepared)).eval_batches("test", 4))
    with pytest.raises(ConfigError, match="multiple of world_size"):
        build_mlm_source(0, prepared=str(prepared)).train_batch(0, 6, rank=0, world_size=4)


def test_a_damaged_prepared_directory_is_one_line(prepared, tmp_path):
    """A prepared directory whose manifest lacks a key, or whose tokenizer is gone or garbage, was a KeyError,
    ValueError or JSONDecodeError traceback; a tokenizer.path naming a file that is no tokenizer, likewise."""
    import shutil

    manifest = json.loads((prepared / "manifest.json").read_text())
    for name, change in [("no_splits", lambda m: m.pop("splits")), ("no_vocab", lambda m: m["tokenizer"].pop("vocab_size"))]:
        copy = tmp_path / name
        shutil.copytree(prepared, copy)
        broken = json.loads(json.dumps(manifest))
        change(broken)
        (copy / "manifest.json").write_text(json.dumps(broken))
        with pytest.raises(DataError, match=rf"^{copy}/manifest.json is corrupt \(KeyError: .*\); prepare the data again$"):
            PreparedCorpus(copy)
    for name, damage in [("gone", lambda d: [f.unlink() for f in d.iterdir()]),
                         ("garbage", lambda d: (d / "tokenizer.json").write_text("{not json"))]:
        copy = tmp_path / name
        shutil.copytree(prepared, copy)
        damage(copy / manifest["tokenizer"]["directory"])
        with pytest.raises(DataError, match=rf"^cannot load the tokenizer saved in {copy}/.*; prepare the data again$"):
            PreparedCorpus(copy).tokenizer
    copy = tmp_path / "truncated"  # a truncated document table was numpy's ValueError, read only when first needed
    shutil.copytree(prepared, copy)
    table = next((copy / "train").glob("*.documents.npy"))
    table.write_bytes(table.read_bytes()[:20])
    with pytest.raises(DataError, match=rf"^cannot read {table}: .*; prepare the data again$"):
        PreparedCorpus(copy).split("train").documents
    (tmp_path / "notes.txt").write_text("not a tokenizer\n")
    with pytest.raises(DataError, match=r"^cannot load tokenizer from .*notes.txt: .*\(not a tokenizers tokenizer.json\)$"):
        load_tokenizer(tmp_path / "notes.txt")


def test_on_the_fly_preparation_is_cached(tmp_path):
    options = {"source": {**SYNTH, "documents": 20}, "tokenizer": TOKENIZER, "cache_dir": str(tmp_path), "seq_len": 32}
    first = build_mlm_source(0, **options)
    entries = list(tmp_path.iterdir())
    assert len(entries) == 1 and (entries[0] / "manifest.json").is_file()
    stamp = os.stat(entries[0] / "manifest.json").st_mtime_ns
    second = build_lm_source(1, **options)  # same preparation settings: same cache entry, not prepared again
    assert os.stat(entries[0] / "manifest.json").st_mtime_ns == stamp and list(tmp_path.iterdir()) == entries
    assert first.vocab_size == second.vocab_size


LOCAL_SOURCES = {  # a source naming one local file, and how that file holds a text
    "text": ({"type": "text", "paths": "corpus.txt"}, "corpus.txt", lambda text: text + "\n"),
    "hf": ({"type": "hf", "name": "json", "data_files": "corpus.jsonl", "streaming": False}, "corpus.jsonl",
           lambda text: json.dumps({"text": text}) + "\n"),
}


@pytest.mark.parametrize("kind", sorted(LOCAL_SOURCES))
def test_cache_entry_of_local_files_is_theirs(tmp_path, monkeypatch, kind):
    """A relative corpus path read from another directory is another corpus: another cache entry. A corpus
    edited in place after its preparation is refused in one line (runs trained on the old one may still read
    that entry); a corpus deleted after its preparation leaves the entry usable. (An hf source's local
    data_files once went into neither the key nor the check: another project's corpus trained silently on the
    first one's prepared data.)"""
    source, name, holding = LOCAL_SOURCES[kind]
    corpus = tmp_path / "a" / name
    corpus.parent.mkdir()
    corpus.write_text(holding("The first corpus. It is short."))
    monkeypatch.chdir(tmp_path / "a")
    options = {"source": source, "tokenizer": {**TOKENIZER, "min_frequency": 1}, "cache_dir": str(tmp_path / "cache")}
    tokens = lambda: build_lm_source(0, **options).corpus.split("train").n_tokens  # noqa: E731
    first = tokens()
    assert tokens() == first and len(list((tmp_path / "cache").iterdir())) == 1  # unchanged: reused

    (tmp_path / "b").mkdir()
    (tmp_path / "b" / name).write_text(holding("Another project's corpus. Only its name is that of the first."))
    monkeypatch.chdir(tmp_path / "b")
    assert tokens() != first and len(list((tmp_path / "cache").iterdir())) == 2

    monkeypatch.chdir(tmp_path / "a")
    corpus.write_text(holding("The edited corpus. It is longer now, by a few words."))
    with pytest.raises(DataError, match=rf"^{corpus} changed \(size or modification time\) since it was prepared "
                                        r"into .*; delete that directory to prepare the corpus again$"):
        tokens()
    corpus.unlink()
    assert tokens() == first


def test_concurrent_preparers_keep_the_first_copy(tmp_path, monkeypatch):
    """Where the cache's lock cannot serialise them (a file system without flock), preparers of one cache
    entry race. The first copy renamed into place is the one every rank reads: a later preparer must discard
    its own copy, never swap the first one out from under a rank already reading it (its tokenizer may number
    tokens differently)."""
    import poslab.data.preparation as preparation

    options = {"source": {**SYNTH, "documents": 20}, "tokenizer": TOKENIZER, "cache_dir": str(tmp_path)}
    config = DataConfig.from_options(options)
    path = tmp_path / preparation.prepare_key(config)
    target, write = [path], preparation._write

    def another_rank_finishes_first(config, root, log, evaluation_only=False):
        manifest = write(config, root, log, evaluation_only)
        shutil.copytree(root, target[0])  # the other rank's copy, renamed in while this one was writing
        (target[0] / "first").write_text("")
        return manifest

    monkeypatch.setattr(preparation, "_write", another_rank_finishes_first)
    assert preparation.ensure_prepared(config) == path
    assert (path / "first").is_file() and _siblings(path) == [path.name]
    target[0] = tmp_path / "out"
    with pytest.raises(DataError, match="appeared while"):
        prepare(config, tmp_path / "out")
    assert (tmp_path / "out" / "first").is_file() and _siblings(tmp_path / "out") == [path.name, "out"]


# -- command line ------------------------------------------------------------------------------------------


def test_one_process_prepares_a_cache_entry_while_the_others_wait(tmp_path, monkeypatch):
    """Every torchrun rank builds its source, so each would stream and tokenize the whole corpus: the cache
    entry's lock lets one prepare while the others wait and then read its copy."""
    import threading

    import poslab.data.preparation as preparation

    config = DataConfig.from_options({"source": {**SYNTH, "documents": 20}, "tokenizer": TOKENIZER,
                                      "cache_dir": str(tmp_path)})
    writing, release, write, calls = threading.Event(), threading.Event(), preparation._write, []

    def slow_write(*args, **kwargs):
        calls.append(threading.current_thread().name)
        writing.set()
        release.wait(10)
        return write(*args, **kwargs)

    monkeypatch.setattr(preparation, "_write", slow_write)
    results, logs = {}, []
    ranks = [threading.Thread(target=lambda r=r: results.update({r: preparation.ensure_prepared(config, logs.append)}),
                              name=f"rank{r}") for r in range(3)]
    ranks[0].start()
    assert writing.wait(10)
    for rank in ranks[1:]:
        rank.start()
    deadline = time.monotonic() + 10
    while sum(line.startswith("waiting for another process") for line in logs) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    for rank in ranks:
        rank.join(30)
    assert calls == ["rank0"] and len(set(results.values())) == 1 and len(results) == 3
    assert (results[0] / "manifest.json").is_file()



def test_cli_prepare(tmp_path, capsys):
    import argparse

    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"First sentence here. Second \xff one.\n\nNew paragraph.\n")
    config = tmp_path / "run.yaml"
    config.write_text(f"seed: 0\ndata:\n  kind: mlm\n  source: {{type: text, paths: {bad}}}\n"
                      "  tokenizer: {vocab_size: 300, min_frequency: 1}\n")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    # A run config's keys as `poslab train --set` names them (data.x) or relative to its data section (x)
    args = parser.parse_args(["data", "prepare", str(config), "--out", str(tmp_path / "o"),
                              "--set", "data.tokenizer.type=bpe", "--set", "seq_len=16"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "train: 1 documents, 3 sentences" in out and "replaced 1 invalid UTF-8" in err
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["invalid_utf8_replaced"] == 1
    with pytest.raises(PoslabError, match="cannot read config .*none.yaml: No such file"):
        load_data_config(str(tmp_path / "none.yaml"), [])
    with pytest.raises(ConfigError, match="seq_len must be an integer >= 2"):
        run_prepare(parser.parse_args(["data", "prepare", str(config), "--out", str(tmp_path / "p"),
                                       "--set", "seq_len=1"]))
    assert not (tmp_path / "p").exists()
    # data.masking=null is a data setting (no masking), not a run config's section dropped whole
    assert load_data_config(str(config), ["data.masking=null"]).masking is None
    task = tmp_path / "task.yaml"
    task.write_text("data: {kind: task, name: addition}\n")
    with pytest.raises(ConfigError, match="is a task .kind: task., whose problems are drawn as it trains: there is "
                                          "nothing to prepare"):
        load_data_config(str(task), [])


def test_cli_an_unreachable_corpus_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    """The tokenizer's progress line used to come first, said before the corpus was reached."""
    import datasets

    from poslab.cli import main

    def offline(*args, **kwargs):
        raise OSError("Couldn't reach 'org/books' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    config = tmp_path / "books.yaml"
    config.write_text("source: {type: hf, name: org/books, streaming: true}\n")
    assert main(["data", "prepare", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == "poslab: error: cannot load Hugging Face dataset 'org/books': Couldn't reach 'org/books' on the " \
                  "Hub (LocalEntryNotFoundError)\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["books.yaml"]


def test_cli_bad_config_files_and_overrides_are_one_line(tmp_path, capsys, monkeypatch):
    """Read as `train` reads a run config: a binary or UTF-16 file, a --set value that is not YAML and an
    empty path each get one line (they were a UnicodeDecodeError, a yaml ParserError, 'Is a directory')."""
    from poslab.cli import main

    monkeypatch.chdir(tmp_path)  # where an empty path leads, should the refusal fail
    text = "source: {type: synthetic, documents: 20}\n"
    files = {"binary.yaml": b"v\x14\xe4\x01{\xa8", "utf16.yaml": text.encode("utf-16"), "good.yaml": text.encode()}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    cases = [([str(tmp_path / "binary.yaml")], "binary.yaml is not UTF-8 text"),
             ([str(tmp_path / "utf16.yaml")], "utf16.yaml is not UTF-8 text"),
             ([str(tmp_path / "good.yaml"), "--set", "source.documents=[1"], "--set source.documents: value '\\[1'"),
             ([""], "the config path is empty"),
             ([str(tmp_path / "good.yaml"), "--out", ""], "argument --out: the path is empty")]
    for argv, message in cases:
        out = ["--out", str(tmp_path / "out")] if "--out" not in argv else []
        assert main(["data", "prepare", *argv, *out]) == 2
        err = capsys.readouterr().err
        assert err.startswith("poslab: error: ") and err.count("\n") == 1 and re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)


def test_shipped_data_configs_validate():
    configs = Path(__file__).resolve().parents[1] / "src" / "poslab" / "configs" / "data"
    names = sorted(p.name for p in configs.glob("*.yaml"))
    assert {"mlm_quick.yaml", "mlm_paper.yaml", "lm_quick.yaml"} <= set(names)
    for name in names:
        config = load_data_config(str(configs / name), [])
        assert config.source is not None
    paper = load_data_config(str(configs / "mlm_paper.yaml"), [])
    assert paper.source["name"] == "HuggingFaceFW/fineweb" and paper.source["streaming"] is True
    assert paper.tokenizer.vocab_size == 30522 and paper.masking.rate == 0.2


@pytest.mark.parametrize("kind", ["wordpiece", "bpe"])
def test_trained_tokenizer_ids_depend_only_on_the_vocabulary(kind):
    """The trainers number tokens partly in hash-map order, which differs between processes (21 of 2,048
    WordPiece ids moved between two preparations of one corpus). Canonical ids depend on the vocabulary
    alone: any other numbering of the same tokens comes back to the same tokenizer, ids sorted by (length,
    text) after the special tokens. Which tokens make the vocabulary can itself change between processes
    where merges tie in count (the trainers offer no seed); that is not something ids can fix."""
    import random

    from tokenizers import Tokenizer

    from poslab.data.config import TokenizerConfig
    from poslab.data.tokenizer import _canonical_ids, train_tokenizer

    texts = [" ".join(s for p in d for s in p) for d in SyntheticCorpus(documents=100).documents()]
    trained = train_tokenizer(TokenizerConfig(type=kind, vocab_size=4000), texts)
    data = json.loads(trained.to_str())
    vocab, added = data["model"]["vocab"], {t["content"] for t in data["added_tokens"]}
    tokens = [t for t in vocab if t not in added]
    slots = [vocab[t] for t in tokens]
    random.Random(0).shuffle(slots)
    vocab.update(zip(tokens, slots))
    assert _canonical_ids(Tokenizer.from_str(json.dumps(data))).to_str() == trained.to_str()
    prefix = data["model"].get("continuing_subword_prefix") or ""
    canonical = json.loads(trained.to_str())["model"]["vocab"]
    body = [t.removeprefix(prefix) for t in sorted(canonical, key=canonical.get) if t not in added]
    assert [len(b) for b in body] == sorted(len(b) for b in body) and len(body) > 100


def test_a_byte_level_cap_below_its_bytes_is_refused():
    """Byte-level BPE starts from 256 bytes and the special tokens: vocab_size 16 gave a vocabulary of 261 without
    a word."""
    from poslab.data.config import TokenizerConfig

    with pytest.raises(ConfigError, match=r"^tokenizer.vocab_size 16 is below what byte-level BPE starts from \(256 "
                                          r"bytes and 5 special tokens\); give at least 261$"):
        TokenizerConfig(type="bpe", vocab_size=16)
    assert TokenizerConfig(type="bpe", vocab_size=261).vocab_size == 261
    assert TokenizerConfig(type="wordpiece", vocab_size=16).vocab_size == 16  # its alphabet comes from the text


def test_a_full_disk_while_preparing_names_it(tmp_path, monkeypatch, capsys):
    """numpy reports a short write as "26219 requested and 20416 written", which was the whole error line."""
    import yaml

    from poslab.cli import main
    from poslab.data import preparation

    def short(path, array):
        raise OSError("26219 requested and 20416 written")

    monkeypatch.setattr(preparation.np, "save", short)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"source": SYNTH, "tokenizer": TOKENIZER, "validation_documents": 10}))
    assert main(["data", "prepare", str(config), "--out", str(tmp_path / "out")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the preparation's progress lines
    assert re.fullmatch(r"poslab: error: writing stopped short \(26219 requested and 20416 written\), as on a full "
                        r"disk: .*/train/00000\.tokens\.npy", last), last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


def test_a_prepared_path_that_does_not_exist_says_so(tmp_path, monkeypatch):
    """It read as "not a prepared data directory (no manifest.json)", and a relative path gave no hint that it
    is read from the current directory (not the run config's)."""
    from poslab.data.preparation import ensure_prepared

    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=rf"^data.prepared data/my does not exist \(relative to the current "
                                        rf"directory, {re.escape(str(tmp_path))}\); give the --out directory of "
                                        r"'poslab data prepare'$"):
        ensure_prepared(DataConfig.from_options({"prepared": "data/my"}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"^empty is not a prepared data directory \(no manifest.json\)"):
        ensure_prepared(DataConfig.from_options({"prepared": "empty"}))


def test_prepare_says_which_settings_wait_for_training(tmp_path, capsys):
    """seq_len in a data config was checked by `data prepare` and then dropped: training cut 128-token
    sequences, and refused a model of max_seq_len 64, with no word of why."""
    import yaml

    from poslab.cli import main

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"source": {**SYNTH, "documents": 30}, "tokenizer": TOKENIZER,
                                      "validation_documents": 5, "seq_len": 64}))
    assert main(["data", "prepare", str(config), "--out", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"note: seq_len is applied when training: set it in the run config's data section, beside prepared: "
        f"{tmp_path / 'out'}")


def test_prepare_reads_a_run_configs_data_section_from_its_file(tmp_path):
    """A run config whose data section names a file was read as a data config ("unknown data key 'seed'")."""
    import yaml

    from poslab.data.cli import load_data_config

    (tmp_path / "data.yaml").write_text(yaml.safe_dump({"kind": "mlm", "source": SYNTH, "tokenizer": TOKENIZER,
                                                        "validation_documents": 7}))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"seed": 0, "data": "data.yaml", "train": {"steps": 1}}))
    config = load_data_config(str(tmp_path / "run.yaml"), ["data.validation_documents=9"])
    assert config.validation_documents == 9 and config.source == SYNTH
