"""Exploration, not a recipe: does PoPE model J. S. Bach's four-part chorales better than RoPE at a CPU's scale?

The PoPE paper reports a lower NLL than RoPE's on symbolic music (JSB Chorales, MAESTRO; papers/pope.md); the
reproduction has no recipe for it, as nothing may be downloaded. music21 ships the chorales, so they can be read
offline. This is our own encoding, not the JSB Chorales dataset's splits or format: each of the 371 chorales
music21 numbers after Riemenschneider that has exactly four parts becomes one document; on an eighth-note grid,
each step lists the pitch sounding in soprano, alto, tenor and bass as words ("s67 a62 t59 b43", "sr" for a
rest, the top note of a chord), so a step is four tokens. The corpus is prepared once by poslab's own LM
pipeline (JSONL source, byte-level BPE whose cap keeps every word whole, packed 128-token windows = 32 steps),
its first 37 chorales held out, and PoPE and RoPE decoders are trained on it by poslab's engine, each with the
same seeds, two side by side (``ensure_runs``).

    pip install music21   # (or POSLAB_EXTRAS=dev,bench bash scripts/setup.sh)
    python benchmarks/quick_search/music.py --out /tmp/music --steps 400 --seeds 0 1

Prints each training's held-out loss (nats per token at the training length; final step) and, per scheme, the
mean over seeds. Reading the chorales takes ~0.15 s each on one core (about a minute).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from poslab.experiments.common import ensure_runs

VOICES = "satb"
STEP = 0.5  # quarter lengths: an eighth note


def chorale_text(score) -> str | None:
    """The four voices as words on the eighth-note grid, or None for a chorale without exactly four parts."""
    if len(score.parts) != 4:
        return None
    steps = int(score.duration.quarterLength / STEP)
    grid = [["r"] * steps for _ in VOICES]
    for voice, part in enumerate(score.parts):
        for note in part.flatten().notesAndRests:
            if note.isRest:
                continue
            midi = max(p.midi for p in note.pitches)  # a chord in one part: its top note
            start = int(round(note.offset / STEP))
            for i in range(start, min(steps, start + max(1, int(round(note.quarterLength / STEP))))):
                grid[voice][i] = str(midi)
    return " ".join(f"{v}{grid[i][t]}" for t in range(steps) for i, v in enumerate(VOICES))


def write_corpus(path: Path) -> int:
    """The chorales as JSON lines {"text": ...} at ``path`` (kept once written); returns their count."""
    if not path.exists():
        from music21 import corpus

        lines = []
        for name in corpus.chorales.Iterator(numberingSystem="riemenschneider", returnType="filename"):
            text = chorale_text(corpus.parse(name))
            if text:
                lines.append(json.dumps({"text": text, "name": name}))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text("\n".join(lines) + "\n")
        path.with_suffix(".tmp").rename(path)
    return sum(1 for _ in path.open())


def run_config(corpus: Path, out: Path, scheme: str, seed: int, steps: int) -> dict:
    return {
        "seed": seed,
        "model": {"arch": "decoder", "vocab_size": None, "max_seq_len": 128, "norm": "rmsnorm", "mlp": "swiglu",
                  "d_model": 128, "n_layers": 2, "n_heads": 4, "positional": {"name": scheme}},
        "data": {"kind": "lm", "cache_dir": str(out / "data"), "source": {"type": "jsonl", "paths": [str(corpus)]},
                 "tokenizer": {"type": "bpe", "vocab_size": 1024, "lowercase": True, "train_documents": 400},
                 "validation_documents": 37, "seq_len": 128, "packing": True},
        "train": {"steps": steps, "batch_size": 32, "lr": 2e-3, "min_lr": 2e-4, "warmup_steps": steps // 10,
                  "eval_every": 0, "eval_batches": None, "log_every": 100},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args()
    corpus = a.out / "chorales.jsonl"
    print(f"{write_corpus(corpus)} chorales in {corpus}")
    runs = {(scheme, seed): (run_config(corpus, a.out, scheme, seed, a.steps), a.out / "runs" / f"{scheme}-s{seed}")
            for seed in a.seeds for scheme in ("pope", "rope")}
    finals = ensure_runs(runs, print, a.jobs)
    print("scheme | seed | held-out loss | train loss | seconds")
    for (scheme, seed), final in finals.items():
        print(f"{scheme} | {seed} | {final['eval_loss']:.4f} | {final['train_loss']:.4f} | {final['seconds']:.0f}")
    for scheme in ("pope", "rope"):
        losses = [finals[scheme, seed]["eval_loss"] for seed in a.seeds]
        spread = f" +- {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
        print(f"{scheme} mean over seeds {a.seeds}: {statistics.fmean(losses):.4f}{spread}")


if __name__ == "__main__":
    main()
