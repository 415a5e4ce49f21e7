"""Text data for masked-LM and causal-LM pretraining, with document-structure labels for probes.

Pipeline: source (files, JSONL, Hugging Face datasets, or the synthetic structured-document corpus) ->
paragraphs and sentences -> tokenizer (trained WordPiece/BPE or a local one) with character offsets ->
per-token structure labels -> memory-mapped shards (``poslab data prepare CONFIG --out DIR``) -> batches.

Batch keys (all (batch, seq_len) torch.long):
  input_ids, labels, attention_mask   see ``poslab.batches`` (MLM labels: -100 where not masked;
                                      LM labels: the input ids, unshifted, -100 at padding)
  doc_id                  index of the document in the source (0-based, in source order)
  paragraph_index         paragraph within the document
  sentence_index          sentence within the document
  sentence_in_paragraph   sentence within its paragraph
  pos_in_sentence         token position within its sentence
  pos_in_paragraph        token position within its paragraph
  pos_in_document         token position within its document
  abs_position            position in the sequence (0 = [CLS])
Structure labels are -1 at [CLS], [SEP] and padding (abs_position only at padding); they describe the
original document even when packing cuts it across sequences. ``structure_labels: false`` omits them.
"""
from __future__ import annotations

from typing import Any

from poslab.data.config import DataConfig, MaskingConfig, TokenizerConfig
from poslab.data.preparation import ensure_prepared, prepare, prepare_key
from poslab.data.source import LMSource, MLMSource, TextBatchSource
from poslab.data.store import STRUCTURE_KEYS, PreparedCorpus

__all__ = ["DataConfig", "MaskingConfig", "TokenizerConfig", "PreparedCorpus", "TextBatchSource", "MLMSource",
           "LMSource", "STRUCTURE_KEYS", "prepare", "ensure_prepared", "build_mlm_source", "build_lm_source",
           "data_version"]


# Bump when the batches read from a prepared corpus change (packing, masking, labels), so runs trained on
# the old ones are not reused as if trained on these (poslab.batches.data_version).
BATCH_VERSION = 1


def data_version(**options: Any) -> dict[str, Any]:
    """What, beyond the config, decides a text source's batches: the batch code's version and, for a corpus
    prepared from a source, its cache key (which hashes the grammar's, the tokenizer training's and the
    shard format's versions). A corpus named by ``prepared`` is the user's: its path is in the config.
    Whether token ids still mean what a run learned is checked on the tokenizer itself (train/provenance.py)."""
    config = DataConfig.from_options(options)
    version: dict[str, Any] = {"text_batches": BATCH_VERSION}
    if config.prepared is None:
        version["preparation"] = prepare_key(config)
    return version


def build_mlm_source(seed: int, **options: Any) -> MLMSource:
    """Masked-LM batches from ``prepared: DIR`` or a ``source`` (prepared into ``cache_dir`` on first use).
    Options: the fields of ``DataConfig``."""
    config = DataConfig.from_options(options)
    MLMSource.check(config)  # before preparing anything
    return MLMSource(seed, config, PreparedCorpus(ensure_prepared(config)))


def build_lm_source(seed: int, **options: Any) -> LMSource:
    """Causal-LM batches (next-token labels, unshifted); options as for ``build_mlm_source`` minus masking."""
    config = DataConfig.from_options(options)
    LMSource.check(config)  # before preparing anything
    return LMSource(seed, config, PreparedCorpus(ensure_prepared(config)))
