"""Batch sources over a prepared directory: sequences cut from the token stream, MLM masking or LM labels.

Two layouts (``packing``), both keeping every token of a split exactly once per epoch:
  packing: true   sequence i = [CLS] + stream[i*(L-1) : (i+1)*(L-1)]; documents inside a sequence are
                  separated by the [SEP] stored after each; the last sequence is padded;
  packing: false  one document per sequence: [CLS] + document chunk + [SEP] + [PAD]...; a document longer
                  than L-2 tokens continues in the next sequence(s) rather than being truncated.

Training order: the global batch row g of step s reads sequence permute((s*B + g) mod N) with a fresh
pseudo-random permutation per epoch (Feistel, ``poslab.data.rng``): a pure function of (seed, step), so a
resumed run and every data-parallel rank see exactly the batches an uninterrupted single process would.
"""
from __future__ import annotations

import abc
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from poslab.data.config import DataConfig, MaskingConfig
from poslab.data.masking import mask_tokens
from poslab.data.rng import hash_keys, permute
from poslab.data.store import STRUCTURE_KEYS, PreparedCorpus, Split
from poslab.errors import ConfigError, DataError, require

_TRAIN, _EVAL = 0, 1  # key domains: training masks never coincide with evaluation masks


class TextBatchSource(abc.ABC):
    """A ``poslab.batches.BatchSource`` over a prepared corpus; ``MLMSource`` and ``LMSource`` label it.

    Attributes: ``vocab_size``, ``tokenizer`` (transformers PreTrainedTokenizerFast), ``pad_token_id``,
    ``seq_len`` (also ``max_train_len``: no batch is wider), ``corpus`` (PreparedCorpus), ``splits``.
    """

    def __init__(self, seed: int, config: DataConfig, corpus: PreparedCorpus) -> None:
        self.seed, self.config, self.corpus = int(seed), config, corpus
        self.seq_len = self.max_train_len = config.seq_len
        self.vocab_size = corpus.vocab_size
        ids = corpus.special_ids
        self.cls_id, self.sep_id, self.pad_token_id = ids["cls"], ids["sep"], ids["pad"]
        # Sequences start with [CLS] and a document ends at [SEP]: a decoder's generation stops there
        self.generation_ids = {"bos_token_id": self.cls_id, "eos_token_id": self.sep_id,
                               "pad_token_id": self.pad_token_id}
        self._layouts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[tuple[int, int, int, int], Future] | None = None  # (step key, batch being built)

    @property
    def tokenizer(self):
        return self.corpus.tokenizer

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits ``eval_batches`` reads: every prepared one, train included."""
        return tuple(self.corpus.splits)

    # -- layout -------------------------------------------------------------------------------------
    def _chunks(self, split: str) -> tuple[np.ndarray, np.ndarray]:
        """One-document layout: (cumulative chunk counts (d,), document table (d, 2)), computed once per
        split (a per-instance cache: functools.cache on a method would keep every source alive)."""
        if split not in self._layouts:
            docs = self.corpus.split(split).documents
            self._layouts[split] = np.cumsum(-(-docs[:, 1] // (self.seq_len - 2))), docs
        return self._layouts[split]

    def num_sequences(self, split: str) -> int:
        if self.config.packing:
            return -(-self.corpus.split(split).n_tokens // (self.seq_len - 1))
        return int(self._chunks(split)[0][-1])

    def _windows(self, split: str, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stream [begin, end) (each (b,)) of the content of sequences ``index`` (b,)."""
        if self.config.packing:
            width = self.seq_len - 1
            begin = index * width
            return begin, np.minimum(begin + width, self.corpus.split(split).n_tokens)
        cum, docs = self._chunks(split)
        doc = np.searchsorted(cum, index, side="right")
        first_chunk = cum[doc] - -(-docs[doc, 1] // (self.seq_len - 2))
        begin = docs[doc, 0] + (index - first_chunk) * (self.seq_len - 2)
        return begin, np.minimum(begin + self.seq_len - 2, docs[doc, 0] + docs[doc, 1])

    def _sequences(self, split: str, index: np.ndarray) -> dict[str, np.ndarray]:
        """input_ids, attention_mask and structure labels (b, L) of sequences ``index`` (b,), unlabelled."""
        data: Split = self.corpus.split(split)
        begin, end = self._windows(split, index)
        b, L = len(index), self.seq_len
        offset = np.arange(L - 1)[None, :]
        valid = offset < (end - begin)[:, None]  # (b, L-1): content slots after [CLS]
        positions = np.where(valid, begin[:, None] + offset, begin[:, None])
        ids = np.full((b, L), self.pad_token_id, dtype=np.int64)
        ids[:, 0] = self.cls_id
        ids[:, 1:][valid] = data.tokens(positions)[valid]
        length = 1 + valid.sum(axis=1)
        if not self.config.packing:  # close the document chunk
            ids[np.arange(b), length] = self.sep_id
            length += 1
        attention = (np.arange(L)[None, :] < length[:, None]).astype(np.int64)
        out = {"input_ids": ids, "attention_mask": attention}
        if self.config.structure_labels:
            labels = data.structure(positions)
            for key in STRUCTURE_KEYS:
                full = np.full((b, L), -1, dtype=np.int64)
                full[:, 1:][valid] = labels[key][valid]
                out[key] = full
            out["abs_position"] = np.where(attention == 1, np.arange(L)[None, :], -1)
        return out

    # -- BatchSource --------------------------------------------------------------------------------
    @abc.abstractmethod
    def _label(self, batch: dict[str, np.ndarray], keys: tuple) -> dict[str, np.ndarray]:
        """Add ``labels`` (and for MLM mask ``input_ids``); ``keys`` (seed, domain, ..., rows (b, 1)) seed
        the randomness of each row."""

    def train_batch(self, step: int, batch_size: int, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
        """Rank ``rank``'s rows of the global batch of ``step``. With ``prefetch`` the batch of step + 1 is
        built in a background thread meanwhile (numpy and torch release the GIL), so a training loop
        asking for consecutive steps does not wait; the batch is the same either way."""
        require(batch_size >= 1 and world_size >= 1 and batch_size % world_size == 0,
                f"batch_size ({batch_size}) must be a positive multiple of world_size ({world_size})")
        require(0 <= rank < world_size, f"rank {rank} outside world_size {world_size}")
        require(step >= 0, f"step must be >= 0, got {step}")
        key = (step, batch_size, rank, world_size)
        ahead, self._ahead = self._ahead, None
        batch = ahead[1].result() if ahead is not None and ahead[0] == key else self._train_batch(*key)
        if self.config.prefetch:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="poslab-data")
            following = (step + 1, batch_size, rank, world_size)
            self._ahead = (following, self._pool.submit(self._train_batch, *following))
        return batch

    def _train_batch(self, step: int, batch_size: int, rank: int, world_size: int) -> dict[str, torch.Tensor]:
        n = self.num_sequences("train")
        per_rank = batch_size // world_size
        rows = np.arange(rank * per_rank, (rank + 1) * per_rank, dtype=np.int64)
        flat = step * batch_size + rows
        epochs = flat // n
        index = np.empty_like(flat)
        for epoch in np.unique(epochs):  # a batch straddles at most a few epoch boundaries
            sel = epochs == epoch
            index[sel] = permute(flat[sel] % n, n, self.seed, int(epoch))
        batch = self._sequences("train", index)
        return _tensors(self._label(batch, (self.seed, _TRAIN, step, rows[:, None])))

    def eval_batches(self, split: str, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Every sequence of ``split`` in order, labelled (MLM masks depend on the sequence, not the batch)."""
        split_key = int(hash_keys(*split.encode()) % np.uint64(1 << 62))
        for index, batch in self._in_order(split, batch_size):
            yield _tensors(self._label(batch, (self.seed, _EVAL, split_key, index[:, None])))

    def sequence_batches(self, split: str, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Every sequence of ``split`` in order, unmasked and without ``labels``: input_ids, attention_mask
        and the structure labels, for probing representations of intact text."""
        for _, batch in self._in_order(split, batch_size):
            yield _tensors(batch)

    def _in_order(self, split: str, batch_size: int) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
        require(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}")
        n = self.num_sequences(split)
        for start in range(0, n, batch_size):
            index = np.arange(start, min(start + batch_size, n), dtype=np.int64)
            yield index, self._sequences(split, index)


class MLMSource(TextBatchSource):
    """Masked-LM batches: labels hold the original id at masked positions, -100 elsewhere."""

    def __init__(self, seed: int, config: DataConfig, corpus: PreparedCorpus) -> None:
        self.check(config)
        super().__init__(seed, config, corpus)
        mask_id = corpus.special_ids.get("mask")
        if mask_id is None:
            raise DataError(f"the tokenizer of {corpus.directory} has no mask token; masked-LM data needs one "
                            "(set tokenizer.special_tokens.mask and prepare again)")
        self.mask_token_id = mask_id
        self.masking = (config.masking or MaskingConfig()).resolved
        specials = [i for i in corpus.special_ids.values() if i is not None]
        self._random_ids = np.setdiff1d(np.arange(self.vocab_size), specials)
        self._special = np.array(sorted(set(specials)), dtype=np.int64)

    @staticmethod
    def check(config: DataConfig) -> None:
        if config.source is not None and config.tokenizer.special_tokens["mask"] is None:
            raise ConfigError("masked-LM data needs a mask token; set tokenizer.special_tokens.mask (e.g. '[MASK]')")

    def _label(self, batch, keys):
        maskable = ~np.isin(batch["input_ids"], self._special)
        batch["input_ids"], batch["labels"] = mask_tokens(batch["input_ids"], maskable, self.masking,
                                                          self.mask_token_id, self._random_ids, keys)
        return batch


class LMSource(TextBatchSource):
    """Causal-LM batches: labels are the input ids (unshifted; the model shifts) with -100 at padding."""

    def __init__(self, seed: int, config: DataConfig, corpus: PreparedCorpus) -> None:
        self.check(config)
        super().__init__(seed, config, corpus)

    @staticmethod
    def check(config: DataConfig) -> None:
        if config.masking is not None:
            raise ConfigError("masking applies to masked-LM data (kind: mlm); remove it from this causal-LM data config")

    def _label(self, batch, keys):
        batch["labels"] = np.where(batch["attention_mask"] == 1, batch["input_ids"], -100)
        return batch


def _tensors(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64)) for k, v in batch.items()}
