"""Data pipeline throughput and training-step wait, against baselines measured in the same run.

1. Preparation: tokenize + sentence/paragraph labels + pack into shards (``poslab.data.prepare`` on a JSONL
   corpus) vs a plain ``datasets`` pipeline with the same fast tokenizer (``load_dataset("json")`` +
   batched ``Dataset.map``), both end to end from the same file. Tokens/s count document tokens only
   (no [CLS]/[SEP]), which both pipelines produce identically. Target ratio >= 1.0. Reported on wall
   time and on process CPU time (all threads): on a machine shared with other jobs the wall ratio drifts
   with the load, CPU time measures the work each pipeline does.
   Tokens/s are medians over the repeats; ratios are medians of interleaved (baseline, ours) pairs. Then
   each stage of ours alone (read and segment, join, tokenise, label): where its time goes.
2. Training wait: the fraction of step time a training loop (small encoder, AdamW) blocks in
   ``train_batch`` waiting for its batch when the next step's batch is prefetched (the default), and for
   comparison the time building a batch inline would take.
3. ``--learn-steps N`` (optional): is the synthetic corpus's structure learnable by a small MLM on a CPU?
   Trains a 2-layer encoder for N steps on ``configs/data/mlm_quick.yaml`` data, then classifies masked
   structural cue words by position (first / middle / last paragraph opener, 2nd / 3rd / 4th+ sentence
   opener): the model can only beat the majority class by inferring where the sentence sits.

    OMP_NUM_THREADS=1 python benchmarks/data_pipeline.py [--documents 6000] [--repeats 7] [--batch 32]
                                                         [--seq-len 128] [--steps 20] [--learn-steps 0]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from poslab.data import DataConfig, build_mlm_source, prepare
from poslab.data.sources import document_text, open_source
from poslab.data.synthetic import SyntheticCorpus


def write_corpus(path: Path, documents: int) -> int:
    """A JSONL corpus of synthetic documents rendered as text (paragraphs separated by blank lines)."""
    with open(path, "w") as f:
        for doc in SyntheticCorpus(documents=documents, seed=7).documents():
            f.write(json.dumps({"text": document_text(doc)[0]}) + "\n")
    return path.stat().st_size


def cpu_seconds() -> float:
    """CPU time of this process, all threads (the tokenizer's Rust threads included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn, *args) -> tuple[float, float, Any]:
    """(wall seconds, CPU seconds, value) of fn(*args) -> value (a pipeline's tokens).

    Collects garbage first: objects left over from earlier runs otherwise trigger a full collection of
    this process's heap (torch, transformers and datasets: ~0.2 s) inside every other run, charged to
    whichever pipeline happens to run then."""
    gc.collect()
    wall, cpu = time.perf_counter(), cpu_seconds()
    tokens = fn(*args)
    return time.perf_counter() - wall, cpu_seconds() - cpu, tokens


def run_ours(corpus: Path, tokenizer: Path, out: Path) -> int:
    config = DataConfig.from_options({"source": {"type": "jsonl", "paths": str(corpus)},
                                      "tokenizer": {"path": str(tokenizer)}})
    shutil.rmtree(out, ignore_errors=True)
    train = prepare(config, out)["splits"]["train"]
    return train["tokens"] - train["documents"]  # minus one [SEP] per document


def run_datasets(corpus: Path, tokenizer: Path, cache: Path) -> int:
    import datasets
    import pyarrow.compute as pc
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tokenizer))
    shutil.rmtree(cache, ignore_errors=True)
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    # input_ids only, as prepare() keeps: the attention mask and token type ids would be Arrow columns ours
    # never builds (11% of the baseline's wall time).
    ds = ds.map(lambda b: hf(b["text"], add_special_tokens=False, return_attention_mask=False,
                             return_token_type_ids=False), batched=True, batch_size=1000, remove_columns=["text"])
    # Counted in Arrow: converting the column to Python lists would charge the baseline for work that
    # is no part of its pipeline.
    return pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py()


def same_tokens(prepared: Path, corpus: Path, tokenizer: Path, cache: Path) -> bool:
    """Untimed: each document's tokens in the prepared shards equal what datasets.map gives that document."""
    import datasets
    import numpy as np
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tokenizer))
    shutil.rmtree(cache, ignore_errors=True)
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    ids = ds.map(lambda b: hf(b["text"], add_special_tokens=False), batched=True, remove_columns=["text"])["input_ids"]
    seen = 0
    for shard in sorted((prepared / "train").glob("*.documents.npy"), key=lambda p: int(p.name.split(".")[0])):
        tokens = np.load(shard.with_name(shard.name.replace("documents", "tokens")))
        for doc, start, length in np.load(shard):
            if tokens[start:start + length].tolist() != ids[doc]:
                return False
            seen += 1
    return seen == len(ids)


def stages(corpus: Path, tokenizer: Path) -> dict[str, tuple[float, float]]:
    """(wall, CPU) seconds of each stage of ``prepare``, run alone over the whole corpus in prepare's batches:
    where its time goes, and which stage the baseline shares (tokenisation)."""
    from poslab.data.preparation import label_documents
    from poslab.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    tok.encode_special_tokens = True  # as prepare sets it
    config = DataConfig.from_options({"source": {"type": "jsonl", "paths": str(corpus)}})
    source, size = open_source(config.source), config.batch_documents
    times = {}

    def stage(name: str, fn):
        wall, cpu, value = timed(fn)
        times[name] = (wall, cpu)
        return value

    docs = stage("read + segment into sentences", lambda: list(source.documents()))
    laid = stage("join sentences into text", lambda: [document_text(d) for d in docs])
    batches = [laid[i:i + size] for i in range(0, len(laid), size)]
    encoded = stage("tokenize (encode_batch)", lambda: [tok.encode_batch([text for text, _, _ in b],
                                                                          add_special_tokens=False) for b in batches])
    stage("label sentences", lambda: [label_documents(b, e, 0) for b, e in zip(batches, encoded)])
    return times


def _encoder(vocab_size: int, seq_len: int) -> torch.nn.Module:
    from poslab.models import build_model

    return build_model({"arch": "encoder", "vocab_size": vocab_size, "d_model": 128, "n_layers": 2, "n_heads": 4,
                        "max_seq_len": seq_len, "positional": {"name": "rope"}})


def step_wait(prepared: Path, batch: int, seq_len: int, steps: int) -> dict[str, float]:
    """Training loop with the default prefetch: per step, the time ``train_batch`` blocks (wait) and the
    model step (forward, backward, AdamW), over ``steps`` steps after two warm-up steps (step 0's batch
    is always built inline). Then, without a model, the time to build the same batches inline."""
    source = build_mlm_source(0, prepared=str(prepared), seq_len=seq_len, prefetch=True)
    model = _encoder(source.vocab_size, seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wait, work = [], []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        b = source.train_batch(step, batch)
        t1 = time.perf_counter()
        loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:
            wait.append(t1 - t0)
            work.append(time.perf_counter() - t1)
    inline = build_mlm_source(0, prepared=str(prepared), seq_len=seq_len, prefetch=False)
    build = []
    for step in range(2, steps + 2):
        t0 = time.perf_counter()
        inline.train_batch(step, batch)
        build.append(time.perf_counter() - t0)
    step_s, wait_s, build_s = sum(work) / steps, sum(wait) / steps, sum(build) / steps
    return {"steps": steps, "step_ms": 1e3 * step_s, "wait_ms": 1e3 * wait_s, "wait_max_ms": 1e3 * max(wait),
            "wait_fraction": sum(wait) / (sum(wait) + sum(work)),
            "build_ms": 1e3 * build_s, "build_fraction": build_s / (build_s + step_s)}


def learnability(steps: int, root: Path) -> dict[str, float]:
    """Cue-class accuracy of a small MLM after ``steps`` steps vs the majority class (validation split)."""
    from poslab.data.cli import load_data_config
    from poslab.data.synthetic import PARAGRAPH_CUES, SENTENCE_CUES

    config = Path(__file__).resolve().parents[1] / "src" / "poslab" / "configs" / "data" / "mlm_quick.yaml"
    options = {**load_data_config(str(config), []).__dict__, "cache_dir": str(root / "cache")}
    source = build_mlm_source(0, **options)
    tok = source.tokenizer
    # Cue words grouped by the structural position they mark (each cue is one word, one token).
    classes = {f"paragraph {where}": words for where, words in PARAGRAPH_CUES.items()}
    classes.update({f"sentence {i + 2}": words for i, words in enumerate(SENTENCE_CUES)})
    cue_ids = {tok.convert_tokens_to_ids(w): c for c, words in enumerate(classes.values()) for w in words}
    assert len(cue_ids) == sum(map(len, classes.values())) and tok.unk_token_id not in cue_ids  # whole tokens
    candidates = torch.tensor(sorted(cue_ids))
    class_of = torch.tensor([cue_ids[i] for i in sorted(cue_ids)])
    model = _encoder(source.vocab_size, source.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    start = time.perf_counter()
    for step in range(steps):
        b = source.train_batch(step, 32)
        for group in optimizer.param_groups:
            group["lr"] = 2e-3 * min(1.0, (step + 1) / 100)  # linear warm-up, then constant
        loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    model.eval()
    truth, guess = [], []
    with torch.no_grad():
        for b in source.eval_batches("validation", 64):
            target = b["labels"]
            is_cue = torch.isin(target, candidates)
            if not is_cue.any():
                continue
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[is_cue]
            guess.append(class_of[logits[:, candidates].argmax(-1)])
            truth.append(class_of[torch.searchsorted(candidates, target[is_cue])])
    truth, guess = torch.cat(truth), torch.cat(guess)
    opens_paragraph = len(PARAGRAPH_CUES)  # classes below this index are paragraph openers
    is_par, said_par = truth < opens_paragraph, guess < opens_paragraph
    return {"steps": steps, "seconds": seconds, "cues": len(truth), "loss": loss.item(),
            "accuracy": (truth == guess).float().mean().item(),
            "majority": torch.bincount(truth).max().item() / len(truth),
            "boundary_accuracy": (is_par == said_par).float().mean().item(),
            "boundary_majority": max(is_par.float().mean().item(), 1 - is_par.float().mean().item())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--learn-steps", type=int, default=0, help="also run the learnability check (0: skip)")
    args = parser.parse_args()

    load = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="poslab-bench-"))
    try:
        corpus = root / "corpus.jsonl"
        size = write_corpus(corpus, args.documents)
        # Train the shared tokenizer once (not timed) by preparing a small slice.
        prepare(DataConfig.from_options({"source": {"type": "jsonl", "paths": str(corpus), "max_documents": 1000},
                                         "tokenizer": {"vocab_size": 2048, "train_documents": 1000}}), root / "tok")
        tokenizer = root / "tok" / "tokenizer"
        run_datasets(corpus, tokenizer, root / "hf-cache")  # untimed warm-up of both: imports, first-call setup
        run_ours(corpus, tokenizer, root / "ours")
        ours, base = [], []
        for _ in range(args.repeats):  # interleaved pairs: on a shared machine load drifts between runs
            base.append(timed(run_datasets, corpus, tokenizer, root / "hf-cache"))
            ours.append(timed(run_ours, corpus, tokenizer, root / "ours"))
        tokens = {n for _, _, n in ours + base}
        assert len(tokens) == 1, (ours, base)  # as many tokens from both pipelines, every run
        assert same_tokens(root / "ours", corpus, tokenizer, root / "hf-cache"), "the pipelines tokenized differently"
        n = tokens.pop()
        wait = step_wait(root / "ours", args.batch, args.seq_len, args.steps)
        parts = stages(corpus, tokenizer)
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average (1 min) "
              f"{load:.1f} at start, {os.getloadavg()[0]:.1f} at end; corpus {size / 1e6:.1f} MB, {n} tokens, "
              f"{args.repeats} interleaved pairs")
        for name, runs in (("prepare (tokenize + label + pack + write)", ours),
                           ("datasets.map baseline (load json + map)", base)):
            print(f"{name:42s} {n / median(r[0] for r in runs):>10,.0f} tokens/s wall, "
                  f"{n / median(r[1] for r in runs):>10,.0f} tokens/CPU-s (median)")
        for name, column in (("wall", 0), ("CPU time", 1)):
            ratios = sorted(b[column] / o[column] for o, b in zip(ours, base))
            print(f"ratio ours / baseline, {name:8s}: {median(ratios):.2f}x median of pairs "
                  f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}; target >= 1.0)")
        print("stages of prepare, each alone (wall s, CPU s): " + ", ".join(
            f"{name} {wall:.2f}, {cpu:.2f}" for name, (wall, cpu) in parts.items()))
        print(f"training wait: {100 * wait['wait_fraction']:.2f}% of step time blocked on the next batch with prefetch "
              f"(mean {wait['wait_ms']:.2f} ms, max {wait['wait_max_ms']:.2f} ms per {wait['step_ms']:.0f} ms step, "
              f"{wait['steps']} steps, batch {args.batch} x {args.seq_len}, 2-layer d128 encoder); building inline "
              f"would take {wait['build_ms']:.2f} ms per batch ({100 * wait['build_fraction']:.2f}%)")
        if args.learn_steps:
            r = learnability(args.learn_steps, root)
            print(f"learnability: {r['steps']} steps ({r['seconds']:.0f} s), final MLM loss {r['loss']:.2f}; "
                  f"{r['cues']} masked structural cues: paragraph opener vs later sentence "
                  f"{100 * r['boundary_accuracy']:.1f}% (majority {100 * r['boundary_majority']:.1f}%), "
                  f"all 6 position classes {100 * r['accuracy']:.1f}% (majority {100 * r['majority']:.1f}%)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
