"""Length extrapolation at quick scale: a causal LM trained on the synthetic corpus at seq_len L, evaluated
zero-shot at L, 2L, 4L, 10L (mean next-token loss over every token of sequences of that length), plus the
loss per position bucket [kL, (k+1)L) at 10L. RoPE models are also evaluated with YaRN applied at
evaluation time only (factor = eval length / L, original_max_len = L; same weights), as
``poslab.analysis.extrapolation`` does. Results append to results/extrapolation.jsonl.

    python benchmarks/quick_search/extrapolation.py --pos rope --seq-len 64 --steps 1500
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import yaml

import poslab
from poslab.data import build_lm_source

from common import cpu_seconds, fit, model_config, save

DATA = "/work/main/src/poslab/configs/data/lm_quick.yaml"
CACHE = "/tmp/quick_search_cache"


def lm_source(seed: int, seq_len: int):
    opts = yaml.safe_load(open(DATA))
    opts.update(seq_len=seq_len, structure_labels=False, cache_dir=CACHE)
    return build_lm_source(seed, **opts)


@torch.no_grad()
def token_losses(net, source, sequences: int, batch_size: int = 8) -> torch.Tensor:
    """(sequences, seq_len - 1) next-token loss of the first validation sequences (full ones only)."""
    net.eval()
    rows = []
    for batch in source.eval_batches("validation", batch_size):
        logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), batch["labels"][:, 1:], ignore_index=-100,
                               reduction="none")
        full = (batch["labels"][:, 1:] != -100).all(1)
        rows.append(loss[full])
        if sum(len(r) for r in rows) >= sequences:
            break
    net.train()
    return torch.cat(rows)[:sequences]


def with_yarn(net, cfg: dict, factor: float, original: int):
    options = {"scaling": "yarn", "factor": factor, "original_max_len": original}
    scaled = poslab.build_model({**cfg, "positional": {"name": "rope", "options": options}})
    scaled.load_state_dict(net.state_dict())
    return scaled


def extrapolate(net, cfg: dict, seed: int, L: int, multiples: list[int], sequences: int) -> dict:
    out = {}
    for m in multiples:
        src = lm_source(seed, m * L)
        variants = {"plain": net}
        if cfg["positional"]["name"] == "rope" and m > 1:
            variants["yarn"] = with_yarn(net, cfg, float(m), L)
        for name, model in variants.items():
            losses = token_losses(model, src, sequences)
            entry = {"loss": round(float(losses.mean()), 4), "sequences": len(losses)}
            if m == max(multiples):
                buckets = losses[:, : (losses.shape[1] // L) * L].reshape(len(losses), -1, L).mean((0, 2))
                entry["bucket_loss"] = [round(float(b), 4) for b in buckets]
            out[f"{name}@{m}L"] = entry
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--pos", default="rope")
    p.add_argument("--pos-options", default="{}")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 10])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sequences", type=int, default=32)
    p.add_argument("--cpu-limit", type=float, default=None)
    p.add_argument("--tag", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    source = lm_source(a.seed, a.seq_len)
    cfg = model_config(source.vocab_size, a.seq_len * max(a.multiples), d_model=a.width, n_layers=a.layers,
                       n_heads=a.heads, positional=a.pos, pos_options=json.loads(a.pos_options))
    net = poslab.build_model(cfg)
    run = fit(net, source, steps=a.steps, batch_size=a.batch, lr=a.lr, warmup=a.warmup, time_limit_cpu=a.cpu_limit)
    c0 = cpu_seconds()
    results = extrapolate(net, cfg, a.seed, a.seq_len, a.multiples, a.sequences)
    rec = {"pos": a.pos, "pos_options": json.loads(a.pos_options), "seq_len": a.seq_len, "width": a.width,
           "layers": a.layers, "heads": a.heads, "lr": a.lr, "batch": a.batch, "steps": a.steps, "seed": a.seed,
           "threads": a.threads, "params": net.num_parameters(), **run, "eval_cpu_s": round(cpu_seconds() - c0, 1),
           "results": results, "tag": a.tag}
    save("extrapolation", rec)
    print(json.dumps(rec))
    print("RESULT", a.pos, {k: v["loss"] for k, v in results.items()}, "cpu", run["train_cpu_s"])


if __name__ == "__main__":
    main()
