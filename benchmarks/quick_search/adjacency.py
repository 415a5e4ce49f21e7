"""NoPE adjacency at quick scale: adjacency score per layer at initialisation and after short training.

    python benchmarks/quick_search/adjacency.py init --tasks addition reversal indexing ordering
    python benchmarks/quick_search/adjacency.py train --task reversal --steps 1500 --width 128 --layers 2

Scores are ``adjacency_score(cosine_self_similarity(h))`` per validation example over its own real
tokens (<bos> .. last answer token, no padding), averaged over examples. Hidden states measured: the
token embedding (``embed``), the first attention output (``blocks.0.attn_out``) and each block's
residual output (``blocks.{i}.resid_post``). Results append to results/adjacency.jsonl.
"""
from __future__ import annotations

import argparse
import json

import torch

import poslab
from poslab.functional import adjacency_score, cosine_self_similarity
from poslab.models import ActivationCache
from poslab.tasks import build_batch_source

from common import cpu_seconds, model_config, save, train_task

TASKS = ("addition", "reversal", "indexing", "ordering")


@torch.no_grad()
def layer_scores(net, source, examples: int = 64, split: str = "validation") -> dict[str, float]:
    """Mean adjacency score of each captured hidden state over `examples` validation sequences."""
    net.eval()
    batch = next(source.eval_batches(split, examples))
    cap = ActivationCache(["embed", "blocks.0.attn_out", "blocks.*.resid_post"])
    net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], capture=cap)
    lengths = batch["attention_mask"].sum(1).tolist()
    out = {}
    for name, h in cap.items():
        scores = [float(adjacency_score(cosine_self_similarity(h[b, :n]))) for b, n in enumerate(lengths)]
        out[name] = round(sum(scores) / len(scores), 4)
    net.train()
    return out


def nope_model(source, width: int, layers: int, heads: int, **init) -> dict:
    return model_config(source.vocab_size, source.max_seq_len, d_model=width, n_layers=layers, n_heads=heads,
                        positional="nope", **init)


def run_init(a) -> None:
    """Scores at initialisation for every task x init setting x seed (no training)."""
    torch.set_num_threads(a.threads)
    inits = [{"init_std": s, "init_mean": 0.0} for s in (0.002, 0.02, 0.2)]
    inits += [{"init_std": 0.02, "init_mean": m} for m in (4.0, 8.0)]
    for task in a.tasks:
        source = build_batch_source(0, task, validation_size=256)
        for init in inits:
            for seed in range(a.seeds):
                c0 = cpu_seconds()
                torch.manual_seed(seed)
                net = poslab.build_model(nope_model(source, a.width, a.layers, a.heads, **init))
                scores = layer_scores(net, source, a.examples)
                rec = {"kind": "init", "task": task, "seed": seed, "width": a.width, "layers": a.layers,
                       "heads": a.heads, **init, "scores": scores, "cpu_s": round(cpu_seconds() - c0, 2)}
                save("adjacency", rec)
                print(json.dumps(rec), flush=True)


def run_train(a) -> None:
    """Train a NoPE decoder on one task; scores at init and after training, plus accuracy."""
    torch.set_num_threads(a.threads)
    init = {"init_std": a.init_std, "init_mean": a.init_mean}
    model = {"d_model": a.width, "n_layers": a.layers, "n_heads": a.heads, "positional": a.pos, **init}
    source = build_batch_source(a.seed, a.task, validation_size=1000)
    torch.manual_seed(a.seed)
    at_init = layer_scores(poslab.build_model(model_config(source.vocab_size, source.max_seq_len, **model)),
                           source, a.examples)
    rec = train_task(task=a.task, task_options={"validation_size": 1000}, model=model, seed=a.seed, steps=a.steps,
                     batch_size=a.batch, lr=a.lr, warmup=a.warmup, threads=a.threads, eval_every=a.eval_every,
                     final_examples=1000, time_limit_cpu=a.cpu_limit,
                     extra_eval=lambda net, src: layer_scores(net, src, a.examples))
    rec.update(kind="train", scores_init=at_init, scores_trained=rec.pop("extra"), tag=a.tag)
    save("adjacency", rec)
    print(json.dumps({k: rec[k] for k in ("task", "model", "steps", "train_cpu_s", "scores_init", "scores_trained")}))
    print(f"RESULT task={a.task} pos={a.pos} acc={rec['final']['exact_match']:.4f} cpu={rec['train_cpu_s']} "
          f"embed={rec['scores_trained']['embed']} L1={rec['scores_trained']['blocks.0.resid_post']}")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("init", "train"):
        s = sub.add_parser(name)
        s.add_argument("--width", type=int, default=128)
        s.add_argument("--layers", type=int, default=2)
        s.add_argument("--heads", type=int, default=4)
        s.add_argument("--examples", type=int, default=64)
        s.add_argument("--threads", type=int, default=1)
    i = sub.choices["init"]
    i.add_argument("--tasks", nargs="+", default=list(TASKS))
    i.add_argument("--seeds", type=int, default=2)
    t = sub.choices["train"]
    t.add_argument("--task", default="reversal")
    t.add_argument("--pos", default="nope")
    t.add_argument("--init-std", type=float, default=0.02)
    t.add_argument("--init-mean", type=float, default=0.0)
    t.add_argument("--steps", type=int, default=1500)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--cpu-limit", type=float, default=None)
    t.add_argument("--tag", default="")
    a = p.parse_args()
    run_init(a) if a.cmd == "init" else run_train(a)


if __name__ == "__main__":
    main()
