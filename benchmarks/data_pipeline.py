"""Data pipeline throughput and training-step wait, against baselines measured in the same run.

1. Preparation: tokenize + sentence/paragraph labels + pack into shards (``poslab.data.prepare`` on a JSONL
   corpus) vs a plain ``datasets`` pipeline with the same fast tokenizer (``load_dataset("json")`` +
   batched ``Dataset.map``), both end to end from the same file. Tokens/s count document tokens only
   (no [CLS]/[SEP]), which both pipelines produce identically. Target ratio >= 1.0. Reported on wall
   time and on process CPU time (all threads): on a machine shared with other jobs the wall ratio drifts
   with the load, CPU time measures the work each pipeline does.
2. Step wait: time to build one MLM batch vs one optimizer step of a small encoder, and the time the loop
   actually blocks in ``train_batch`` when the next step's batch is prefetched (the default).
3. ``--learn-steps N`` (optional): is the synthetic corpus's structure learnable by a small MLM on a CPU?
   Trains a 2-layer encoder for N steps on ``configs/data/mlm_quick.yaml`` data, then classifies masked
   structural cue words by position (first / middle / last paragraph opener, 2nd / 3rd / 4th+ sentence
   opener): the model can only beat the majority class by inferring where the sentence sits.

    python benchmarks/data_pipeline.py [--documents 6000] [--repeats 5] [--batch 32] [--seq-len 128]
                                       [--learn-steps 0]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from poslab.data import DataConfig, build_mlm_source, prepare
from poslab.data.sources import document_text
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


def timed(fn, *args) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tokens) of fn(*args) -> tokens."""
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
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tokenizer))
    shutil.rmtree(cache, ignore_errors=True)
    datasets.disable_progress_bars()
    ds = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    ds = ds.map(lambda b: hf(b["text"], add_special_tokens=False), batched=True, batch_size=1000,
                remove_columns=["text"])
    return sum(len(ids) for ids in ds["input_ids"])


def step_wait(prepared: Path, batch: int, seq_len: int, steps: int) -> dict[str, float]:
    """Mean time to build a batch (prefetch off), mean time the loop blocks on ``train_batch`` with the
    default prefetch, and mean model step time, over ``steps`` steps after two warm-up steps."""
    from poslab.models import build_model

    sources = {p: build_mlm_source(0, prepared=str(prepared), seq_len=seq_len, prefetch=p) for p in (False, True)}
    model = build_model({"arch": "encoder", "vocab_size": sources[True].vocab_size, "d_model": 128, "n_layers": 2,
                         "n_heads": 4, "max_seq_len": seq_len, "positional": {"name": "rope"}})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {"build": [], "wait": [], "step": []}
    for step in range(steps + 2):
        t0 = time.perf_counter()
        sources[False].train_batch(step, batch)
        t1 = time.perf_counter()
        b = sources[True].train_batch(step, batch)
        t2 = time.perf_counter()
        loss = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if step >= 2:
            for name, seconds in (("build", t1 - t0), ("wait", t2 - t1), ("step", t3 - t2)):
                times[name].append(seconds)
    mean = {name: sum(v) / len(v) for name, v in times.items()}
    return {"build_ms": 1e3 * mean["build"], "wait_ms": 1e3 * mean["wait"], "step_ms": 1e3 * mean["step"],
            "build_share": mean["build"] / (mean["build"] + mean["step"]),
            "wait_share": mean["wait"] / (mean["wait"] + mean["step"])}


def learnability(steps: int, root: Path) -> dict[str, float]:
    """Cue-class accuracy of a small MLM after ``steps`` steps vs the majority class (validation split)."""
    from poslab.data.cli import load_data_config
    from poslab.data.synthetic import PARAGRAPH_CUES, SENTENCE_CUES
    from poslab.models import build_model

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
    model = build_model({"arch": "encoder", "vocab_size": source.vocab_size, "d_model": 128, "n_layers": 2,
                         "n_heads": 4, "max_seq_len": source.seq_len, "positional": {"name": "rope"}})
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
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--learn-steps", type=int, default=0, help="also run the learnability check (0: skip)")
    args = parser.parse_args()

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
        assert len(tokens) == 1, (ours, base)  # both pipelines produce the same tokens
        n = tokens.pop()
        wall = sorted(b[0] / o[0] for o, b in zip(ours, base))
        cpu = sorted(b[1] / o[1] for o, b in zip(ours, base))
        wait = step_wait(root / "ours", args.batch, args.seq_len, args.steps)
        print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
              f"{os.getloadavg()[0]:.1f}; corpus {size / 1e6:.1f} MB, {n} tokens, {args.repeats} interleaved pairs")
        print(f"prepare (tokenize + label + pack + write): {n / min(o[0] for o in ours):,.0f} tokens/s wall (best), "
              f"{n / min(o[1] for o in ours):,.0f} tokens/CPU-s")
        print(f"datasets.map baseline (load json + map):   {n / min(b[0] for b in base):,.0f} tokens/s wall (best), "
              f"{n / min(b[1] for b in base):,.0f} tokens/CPU-s")
        print(f"ratio ours / baseline (median of pairs): wall {wall[len(wall) // 2]:.2f}x "
              f"(range {wall[0]:.2f}-{wall[-1]:.2f}), CPU time {cpu[len(cpu) // 2]:.2f}x (range {cpu[0]:.2f}-{cpu[-1]:.2f})")
        print(f"step wait (batch {args.batch} x {args.seq_len}, 2-layer d128 encoder, step {wait['step_ms']:.1f} ms): "
              f"building a batch {wait['build_ms']:.2f} ms ({100 * wait['build_share']:.1f}% of step time if inline); "
              f"blocked with prefetch {wait['wait_ms']:.3f} ms ({100 * wait['wait_share']:.2f}%)")
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
