"""DSTG-NeoBERT training step time against RoPE-NeoBERT at matched parameter count, same run, same threads.

A step is forward + MLM loss + backward + AdamW update on a random batch (20% of tokens labelled, as
in NeoBERT's masking). The two models alternate step by step after a warm-up, so load from other
processes hits both alike; the ratio of median step times is printed (target: DSTG / RoPE <= 1.25).
Both also run with a dense MLM head (``sparse_prediction: false``: logits at every position) to show
what scoring only the masked tokens saves.

    python benchmarks/dstg_step.py [--scale quick|paper] [--batch 16] [--seq 128] [--steps 20]
        [--recipe --ragged]   # the dstg recipe's quick models (2 x 64) on right-padded rows, as it trains
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import poslab
from poslab.experiments import dstg
from poslab.models.dstg import count_parameters, ready_config


def make_step(values: dict, batch: int, seq: int, seed: int, ragged: bool):
    torch.manual_seed(seed)
    model = poslab.build_model(values).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, values["vocab_size"], (batch, seq), generator=gen)
    lengths = torch.randint(seq // 2, seq + 1, (batch, 1), generator=gen) if ragged else torch.full((batch, 1), seq)
    mask = (torch.arange(seq)[None] < lengths).long()
    labels = torch.where((torch.rand(batch, seq, generator=gen) < 0.2) & mask.bool(), ids, torch.full_like(ids, -100))

    def step() -> float:
        start = time.perf_counter()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=("quick", "paper"), default="quick")
    parser.add_argument("--batch", type=int, help="default 16, or the recipe's batch with --recipe")
    parser.add_argument("--seq", type=int, help="default 128, or the recipe's sequence length with --recipe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--recipe", action="store_true", help="the dstg recipe's models at --scale (vocabulary 2048)")
    parser.add_argument("--ragged", action="store_true", help="right-padded rows of seq/2 to seq real tokens")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.recipe:
        scale = dstg.SCALES[args.scale]
        sections = dstg.model_sections(scale)
        configs = {name: {**sections[name], "vocab_size": 2048} for name in ("dstg", "rope_neobert")}
        args.batch = args.batch or scale["train"]["batch_size"]
        args.seq = args.seq or configs["dstg"]["max_seq_len"]
    else:
        configs = {name: ready_config(name, args.scale) for name in ("dstg", "rope_neobert")}
    args.batch, args.seq = args.batch or 16, args.seq or 128
    configs.update({f"{name} dense": {**configs[name], "sparse_prediction": False} for name in list(configs)})
    steps = {name: make_step(values, args.batch, args.seq, 0, args.ragged) for name, values in configs.items()}
    for _ in range(args.warmup):
        for step in steps.values():
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            times[name].append(step())

    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {'recipe' if args.recipe else 'ready'} models at scale {args.scale}, "
          f"{'ragged ' if args.ragged else ''}batch {args.batch} x seq {args.seq}, "
          f"{args.steps} alternating steps after {args.warmup} warm-up")
    for name, values in configs.items():
        t = times[name]
        print(f"  {name:<18} {count_parameters(values):>12,d} params  median {statistics.median(t) * 1e3:8.1f} ms"
              f"  (min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f})")
    ratio = statistics.median(times["dstg"]) / statistics.median(times["rope_neobert"])
    print(f"DSTG / RoPE-NeoBERT step time: {ratio:.3f}x (target <= 1.25x)")
    for name in ("dstg", "rope_neobert"):
        speedup = statistics.median(times[f"{name} dense"]) / statistics.median(times[name])
        print(f"{name}: dense-head / sparse-prediction step time: {speedup:.2f}x")


if __name__ == "__main__":
    main()
