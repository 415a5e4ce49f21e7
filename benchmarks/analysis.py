"""The analysis toolkit's two performance targets (issue 6), with baselines measured in the same run.

1. adjacency_score of one n x n similarity matrix (n = 2048): the O(n^2 log n) count against the
   O(n^3) pair-by-pair count it replaces (``adjacency_row_scores_reference``, vectorised per row).
   Target: <= 1 s and >= 100x faster.
2. Linear (ridge) probes of every layer of a 6-layer model (embeddings + 6 residual streams = 7 feature
   sets) on 10^6 tokens, three targets each, strength chosen on validation sequences: the streamed
   closed form (``ridge_probe``) against ``torch.linalg.lstsq`` on the same layer's training tokens
   (one layer, one target set, no strength search). Target: <= 60 s for all layers.
   Features are synthetic (random states with a weak linear position code) of the model's width.

    python benchmarks/analysis.py [--n 2048] [--tokens 1000000] [--d 384] [--layers 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import time

import torch

from poslab.analysis.probes import RIDGE_ALPHAS, ridge_probe, split_sequences
from poslab.analysis.similarity import adjacency_row_scores_reference, adjacency_score, cosine_self_similarity


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """Best wall-clock and CPU seconds over ``repeats`` calls. The machine is shared: under load the wall
    clock includes waiting for a core, the CPU time (all threads of this process) does not."""
    wall = cpu = math.inf
    out = None
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = min(wall, time.perf_counter() - start), min(cpu, time.process_time() - start_cpu)
    return wall, cpu, out


def bench_adjacency(n: int, repeats: int) -> None:
    torch.manual_seed(0)
    walk = torch.randn(n, 64).cumsum(0)  # a random walk: similarity falls off with distance, with noise
    sim = cosine_self_similarity(walk)
    adjacency_score(sim[:64, :64])  # warm-up
    fast, fast_cpu, score = timed(lambda: adjacency_score(sim), repeats)
    slow, slow_cpu, rows = timed(lambda: adjacency_row_scores_reference(sim), 1)
    ref = rows[2:].mean()
    assert abs(float(score) - float(ref)) < 1e-9, (float(score), float(ref))
    print(f"adjacency n={n}: fast {fast:.3f} s wall / {fast_cpu:.3f} s CPU (best of {repeats}), brute force "
          f"{slow:.1f} s wall / {slow_cpu:.1f} s CPU; ratio {slow / fast:.0f}x wall, {slow_cpu / fast_cpu:.0f}x CPU; "
          f"score {float(score):.4f} (both)")


def synthetic_layer(tokens_per_seq: int, sequences: int, d: int, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(layer)
    x = torch.randn(sequences, tokens_per_seq, d, generator=g)
    pos = torch.arange(tokens_per_seq, dtype=torch.float32) / tokens_per_seq
    x[..., :4] += (layer + 1) * 0.1 * pos[None, :, None]  # a little position information per layer
    return x


def bench_ridge(tokens: int, d: int, layers: int, seq_len: int) -> None:
    sequences = tokens // seq_len
    mask = torch.ones(sequences, seq_len, dtype=torch.bool)
    pos = torch.arange(seq_len)[None].expand(sequences, seq_len)
    targets = torch.stack([pos, pos // 32, pos % 32], -1)  # absolute, segment-level, intra-segment
    split = split_sequences(sequences, seed=0)
    total = total_cpu = made = 0.0
    for layer in range(layers):
        start = time.perf_counter()
        x = synthetic_layer(seq_len, sequences, d, layer)
        made += time.perf_counter() - start
        seconds, cpu, out = timed(lambda: ridge_probe(x, targets, mask, split), 1)
        total, total_cpu = total + seconds, total_cpu + cpu
        print(f"  layer {layer}: ridge {seconds:.1f} s wall / {cpu:.1f} s CPU, R^2 {[round(r, 3) for r in out['r2']]}, "
              f"{out['train_tokens']:,} fit / {out['test_tokens']:,} test tokens")
    print(f"ridge probes: {layers} layers x {sequences * seq_len:,} tokens x d={d}: {total:.1f} s wall, "
          f"{total_cpu:.1f} s CPU "
          f"(target <= 60 s; making the synthetic features took another {made:.1f} s)")
    fit = split.train  # the sequences ridge_probe fits on (validation only chooses its strength)
    xf = x[fit].reshape(-1, d)
    xf = torch.cat([xf, torch.ones(xf.shape[0], 1)], 1)
    yf = targets[fit].reshape(-1, 3).float()
    base, _, _ = timed(lambda: torch.linalg.lstsq(xf, yf).solution, 1)
    print(f"baseline torch.linalg.lstsq, one layer: {base:.1f} s; ridge_probe per layer {total / layers:.1f} s "
          f"(ratio {base / (total / layers):.1f}x; ridge also searches {len(RIDGE_ALPHAS)} strengths and scores the "
          "test split)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=384)
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip", choices=("adjacency", "ridge"), default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, load average {load:.1f} at start")
    if args.skip != "adjacency":
        bench_adjacency(args.n, args.repeats)
    if args.skip != "ridge":
        bench_ridge(args.tokens, args.d, args.layers, args.seq_len)


if __name__ == "__main__":
    main()
