"""What a run's data was, kept with the run so that no later code reads other data as if it were the same.

    DIR/data.json     the version of the code that made the run's batches (``poslab.batches.data_version``):
                      the same config gives other batches once that code changes (a new task sampler, a new
                      tokenizer training), so resume refuses another version and ``poslab reproduce`` does
                      not reuse the run as if trained on today's data
    DIR/tokenizer/    a text run's tokenizer, AutoTokenizer-loadable: a trained model is only usable with the
                      tokenizer its ids came from, and a corpus prepared again can number tokens otherwise
                      (where merges tie, the trainers' choice changes from process to process), which resume
                      and analysis check

Every rank of a distributed run checks that it reads a corpus tokenized as rank 0's is.
"""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

from tokenizers import processors

from poslab.batches import data_version
from poslab.errors import DataError
from poslab.files import atomic_write_text
from poslab.train.checkpoint import first_difference
from poslab.train.config import RunConfig
from poslab.train.parallel import Parallel

DATA_FILE = "data.json"
TOKENIZER_DIR = "tokenizer"


def record_data(out: Path, config: RunConfig, tokenizer: Any = None) -> None:
    """Write DIR/data.json and, for a text run, DIR/tokenizer (``run_tokenizer``; kept when there: a resumed
    run checked it). A run from before data.json that resumes records today's version: it is the data the run
    goes on with."""
    atomic_write_text(out / DATA_FILE, json.dumps(run_data_version(config), sort_keys=True))
    if tokenizer is not None and not (out / TOKENIZER_DIR).is_dir():
        tmp = out / f".{TOKENIZER_DIR}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out / TOKENIZER_DIR)


def run_tokenizer(config: RunConfig, source: Any) -> Any:
    """The tokenizer a text run saves beside its model (DIR/tokenizer and each checkpoint, so that a checkpoint
    alone serves Hugging Face pipelines), or None for a task: a causal LM's frames a prompt as its data does
    (``prompting``) and names the data's start and end tokens as bos and eos, as its generation_config does;
    every one knows the model's longest sequence."""
    tokenizer = hf_tokenizer(source)
    if tokenizer is None:
        return None
    tokenizer = copy.deepcopy(prompting(tokenizer) if config.model.causal else tokenizer)
    if config.model.causal and tokenizer.cls_token is not None and tokenizer.sep_token is not None:
        tokenizer.bos_token, tokenizer.eos_token = tokenizer.cls_token, tokenizer.sep_token
    tokenizer.model_max_length = config.model.max_seq_len
    return tokenizer


def prompting(tokenizer: Any) -> Any:
    """A copy of ``tokenizer`` that encodes a text as a causal LM's prompt: [CLS] text, the way each window of
    its training data starts, not [CLS] text [SEP]: the data's [SEP] ends a document, after which the model
    starts another instead of continuing the prompt."""
    cls, sep = tokenizer.cls_token, tokenizer.sep_token
    if cls is None or sep is None:
        return tokenizer
    prompt = copy.deepcopy(tokenizer)
    prompt.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A", pair=f"{cls} $A {sep} $B",
        special_tokens=[(t, prompt.convert_tokens_to_ids(t)) for t in (cls, sep)])
    return prompt


def run_data_version(config: RunConfig) -> dict[str, Any]:
    """The data version ``config`` trains on with this poslab (see poslab.batches.data_version)."""
    return json.loads(json.dumps(data_version(config.data.kind, **config.data.options)))


def saved_data_version(run: Path) -> Any:
    """What DIR/data.json of run directory ``run`` records (None when absent or unreadable)."""
    try:
        return json.loads((run / DATA_FILE).read_text())
    except (OSError, ValueError):
        return None


def data_difference(run: Path, config: RunConfig) -> str | None:
    """How the data ``config`` gives now differs from the data the run in ``run`` was trained on, or None."""
    saved = saved_data_version(run)
    if saved is None:
        return f"data version unknown: no readable {DATA_FILE}, as in runs from before poslab recorded it"
    return first_difference(saved, run_data_version(config), "data version")


def hf_tokenizer(source: Any) -> Any:
    """The transformers tokenizer a source's token ids come from (text corpora), else None (tasks)."""
    tokenizer = getattr(source, "tokenizer", None)
    return tokenizer if hasattr(tokenizer, "save_pretrained") and hasattr(tokenizer, "backend_tokenizer") else None


def check_same_tokenizer_on_every_rank(parallel: Parallel, source: Any) -> None:
    """Refuse (on every rank together) when ranks read corpora whose tokenizers differ: nodes that prepare their
    own cache (no shared filesystem) train their own tokenizers, which can number tokens otherwise where merges
    tie, and DDP would then average gradients of token ids that mean other tokens on each node."""
    if not parallel.distributed:
        return
    tokenizer = hf_tokenizer(source)
    mine = None if tokenizer is None else json.dumps(json.loads(tokenizer.backend_tokenizer.to_str()), sort_keys=True)
    seen = parallel.gather(mine)
    problem = None
    if parallel.is_main and (others := [rank for rank, theirs in enumerate(seen) if theirs != seen[0]]):
        problem = (f"rank(s) {', '.join(map(str, others))} read a corpus whose tokenizer differs from rank 0's (each "
                   "node prepared its own); prepare it once where every node reads it (data.prepared, or a "
                   "data.cache_dir on a shared filesystem)")
    problem = parallel.broadcast(problem)
    if problem:
        raise DataError(problem)


def tokenizer_difference(run: Path, source: Any) -> str | None:
    """Why ``source``'s tokenizer is not the one the run in ``run`` trained with (DIR/tokenizer), or None; also
    None when either has none. A corpus prepared again under the same settings can differ: where merges tie,
    the trainers' choice changes from process to process (poslab.data.tokenizer)."""
    saved, tokenizer = run / TOKENIZER_DIR / "tokenizer.json", hf_tokenizer(source)
    if tokenizer is None or not saved.is_file():
        return None
    try:
        # How a text is framed (prompting) is no difference in the ids the data holds.
        same = _vocabulary(json.loads(saved.read_text())) == _vocabulary(json.loads(tokenizer.backend_tokenizer.to_str()))
    except (OSError, ValueError) as err:
        return f"{saved} is unreadable ({err})"
    return None if same else f"the data's tokenizer is not the one the run trained with ({saved})"


def _vocabulary(tokenizer_json: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in tokenizer_json.items() if key != "post_processor"}
