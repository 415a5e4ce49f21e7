"""Indirect indexing at quick scale: one training run per call, appended to results/indirect_indexing.jsonl.

    python benchmarks/quick_search/indirect_indexing.py --pos pope --alphabet 24 --min-len 10 --max-len 20 \
        --shift 4 --layers 2 --width 128 --heads 4 --lr 1e-3 --batch 128 --steps 3000 --seed 0

Chance level is 1 / (string length) at best (the target is one of the string's characters).
"""
from __future__ import annotations

import argparse
import json

import torch

from common import save, train_task
from poslab.tasks.evaluate import exact_match


@torch.no_grad()
def by_shift(net, source, examples: int = 2000, batch_size: int = 500) -> dict:
    """Validation exact match overall, without shift 0 (copying the source character is a trivial
    partial solution worth 1/(2K+1) of the examples), and per shift."""
    net.eval()
    hits: dict[int, list[bool]] = {}
    for i, batch in enumerate(source.eval_batches("validation", batch_size)):
        if i * batch_size >= examples:
            break
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ok = exact_match(logits, batch["labels"]).tolist()
        for ids, hit in zip(batch["input_ids"].tolist(), ok):
            shift = int(source.tokenizer.decode(ids).split(", ")[2])
            hits.setdefault(shift, []).append(hit)
    net.train()
    flat = [h for hs in hits.values() for h in hs]
    nonzero = [h for s, hs in hits.items() if s != 0 for h in hs] or [False]
    return {"acc": sum(flat) / len(flat), "acc_nonzero_shift": sum(nonzero) / len(nonzero),
            "per_shift": {s: round(sum(hs) / len(hs), 3) for s, hs in sorted(hits.items())}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pos", default="pope")
    p.add_argument("--pos-options", default="{}", help="JSON")
    p.add_argument("--alphabet", type=int, default=24)
    p.add_argument("--min-len", type=int, default=10)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--shift", type=int, default=4, help="shifts in [-shift, shift] (or [min-shift, shift])")
    p.add_argument("--min-shift", type=int, default=None)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--norm", default=None)
    p.add_argument("--mlp", default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--cpu-limit", type=float, default=None)
    p.add_argument("--tag", default="")
    p.add_argument("--out", default="indirect_indexing")
    a = p.parse_args()
    task_options = {"alphabet_size": a.alphabet, "min_len": a.min_len, "max_len": a.max_len,
                    "min_shift": -a.shift if a.min_shift is None else a.min_shift, "max_shift": a.shift, "train_size": None,
                    "validation_size": 2000, "test_size": 2000}
    model = {"d_model": a.width, "n_layers": a.layers, "n_heads": a.heads, "positional": a.pos,
             "pos_options": json.loads(a.pos_options)}
    if a.norm:
        model["norm"] = a.norm
    if a.mlp:
        model["mlp"] = a.mlp
    rec = train_task(task="indirect_indexing", task_options=task_options, model=model, seed=a.seed,
                     steps=a.steps, batch_size=a.batch, lr=a.lr, warmup=a.warmup, threads=a.threads,
                     eval_every=a.eval_every, time_limit_cpu=a.cpu_limit, extra_eval=by_shift,
                     curve_eval=lambda n, s: {k: round(v, 4) for k, v in by_shift(n, s, 1000).items() if k != 'per_shift'})
    rec["by_shift"] = rec.pop("extra")
    rec["tag"] = a.tag
    save(a.out, rec)
    print(json.dumps({k: rec[k] for k in ("model", "task_options", "seed", "steps", "train_cpu_s",
                                          "steps_per_cpu_s")}))
    print(f"RESULT pos={a.pos} acc={rec['final']['exact_match']:.4f} "
          f"acc_nonzero={rec['by_shift']['acc_nonzero_shift']:.4f} per_shift={rec['by_shift']['per_shift']} loss={rec['final']['loss']:.3f} "
          f"cpu={rec['train_cpu_s']} steps/cpu_s={rec['steps_per_cpu_s']}")


if __name__ == "__main__":
    main()
