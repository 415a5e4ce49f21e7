"""Markdown tables of everything in results/*.jsonl (the tables in FINDINGS.md are pasted from this).

    python benchmarks/quick_search/summarize.py [indirect_indexing|adjacency|extrapolation]
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict

from common import RESULTS


def rows(name: str) -> list[dict]:
    path = RESULTS / f"{name}.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def table(header: list[str], body: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in body]
    return "\n".join(lines)


def indirect_indexing() -> str:
    body = []
    for r in rows("indirect_indexing"):
        t, m = r["task_options"], r["model"]
        curve = " ".join(f"{c['step']}:{c.get('acc_nonzero_shift', c['acc']):.2f}" for c in r["curve"][:-1])
        body.append([r.get("tag", ""), m["positional"], t["alphabet_size"], f"{t['min_len']}-{t['max_len']}",
                     f"±{t['max_shift']}", f"{m['n_layers']}x{m['d_model']}/{m['n_heads']}h", r["batch_size"], r["lr"],
                     r["stopped_at"] or r["steps"], r["seed"], r["threads"], r["train_cpu_s"], r["steps_per_cpu_s"],
                     f"{r['by_shift']['acc']:.3f}", f"{r['by_shift']['acc_nonzero_shift']:.3f}", curve])
    return table(["tag", "pos", "alph", "len", "shift", "model", "batch", "lr", "steps", "seed", "thr", "train CPU s",
                  "steps/CPU s", "acc", "acc shift≠0", "curve step:acc shift≠0"], body)


def adjacency() -> str:
    init = defaultdict(list)
    trained = []
    for r in rows("adjacency"):
        if r["kind"] == "init":
            key = (r["layers"], r["width"], r["task"], r["init_std"], r["init_mean"])
            init[key].append(r["scores"])
        else:
            trained.append(r)
    body = []
    for (layers, width, task, std, mean), scores in sorted(init.items()):
        avg = lambda k: sum(s[k] for s in scores) / len(scores)
        body.append([f"{layers}x{width}", task, std, mean, len(scores), f"{avg('embed'):.3f}",
                     f"{avg('blocks.0.attn_out'):.3f}", f"{avg('blocks.0.resid_post'):.3f}",
                     f"{avg(f'blocks.{layers - 1}.resid_post'):.3f}"])
    out = "### At initialisation (mean over seeds)\n\n" + table(
        ["model", "task", "init std", "init mean", "seeds", "embed", "L1 attn_out", "L1 resid_post", "last resid_post"],
        body)
    body = []
    for r in trained:
        m, si, st = r["model"], r["scores_init"], r["scores_trained"]
        L = m["n_layers"]
        body.append([r["task"], m["positional"], f"{L}x{m['d_model']}", m.get("init_std", 0.02), r["batch_size"], r["lr"],
                     r["stopped_at"] or r["steps"], r["seed"], r["train_cpu_s"], f"{r['final']['exact_match']:.3f}",
                     f"{si['embed']:.2f}/{st['embed']:.2f}", f"{si['blocks.0.attn_out']:.2f}/{st['blocks.0.attn_out']:.2f}",
                     f"{si['blocks.0.resid_post']:.2f}/{st['blocks.0.resid_post']:.2f}",
                     " ".join(f"{st[f'blocks.{i}.resid_post']:.2f}" for i in range(L))])
    out += "\n\n### After training (init/trained)\n\n" + table(
        ["task", "pos", "model", "std", "batch", "lr", "steps", "seed", "train CPU s", "exact match", "embed",
         "L1 attn_out", "L1 resid_post", "trained resid_post per layer"], body)
    return out


def extrapolation() -> str:
    body = []
    for r in rows("extrapolation"):
        res = r["results"]
        losses = " ".join(f"{k}={v['loss']:.2f}" for k, v in res.items())
        buckets = next((v["bucket_loss"] for k, v in res.items() if k.startswith("plain") and "bucket_loss" in v), [])
        body.append([r.get("tag", ""), r["pos"], r["seq_len"], f"{r['layers']}x{r['width']}", r["batch"], r["lr"],
                     r["stopped_at"] or r["steps"], r["seed"], r["train_cpu_s"], losses,
                     " ".join(f"{b:.2f}" for b in buckets)])
    return table(["tag", "pos", "L", "model", "batch", "lr", "steps", "seed", "train CPU s", "loss at length",
                  "plain loss per L-bucket at 10L"], body)


if __name__ == "__main__":
    names = sys.argv[1:] or ["indirect_indexing", "adjacency", "extrapolation"]
    for name in names:
        print(f"## {name}\n\n{globals()[name]()}\n")
