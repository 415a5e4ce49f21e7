"""Task data generation time against the training step of a small poslab decoder, same run, same threads.

For every task (paper options), the time of ``train_batch(step, batch)`` -- drawing fresh problems
(``train_size: null``) and reading a fixed pool (the paper's ``train_size``) -- is compared with one
training step (forward, loss, backward, AdamW) of a 2-layer, width-128, 4-head RoPE decoder on batches
of the same task. Data and model steps alternate so that load from other processes hits both alike;
medians are printed with their ratio (target: data < 5% of a step).

    python benchmarks/task_data.py [--batch 128] [--steps 10] [--threads N]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import poslab
from poslab.tasks import TASKS, build_batch_source


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; batch {args.batch}, {args.steps} alternating steps after "
          f"{args.warmup} warm-up; decoder 2 layers x 128 wide, 4 heads, rope")
    print(f"{'task':<18} {'seq':>4} {'step ms':>8} {'fresh ms':>9} {'fresh %':>8} {'pool ms':>8} {'pool %':>7}")
    worst = 0.0
    for name in TASKS:
        fresh = build_batch_source(0, name, train_size=None)
        pool = build_batch_source(0, name)
        pool.train_batch(0, args.batch)  # builds the pool once, as a training run does before step 1
        torch.manual_seed(0)
        model = poslab.build_model({"arch": "decoder", "vocab_size": fresh.vocab_size, "d_model": 128,
                                    "n_layers": 2, "n_heads": 4, "max_seq_len": fresh.max_seq_len,
                                    "positional": {"name": "rope"}}).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def train_step(batch: dict[str, torch.Tensor]) -> None:
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times: dict[str, list[float]] = {"step": [], "fresh": [], "pool": []}
        for step in range(args.warmup + args.steps):
            batch = fresh.train_batch(step, args.batch)  # drawn outside the step it is compared with
            sample = {"step": timed(lambda: train_step(batch)),
                      "fresh": timed(lambda: fresh.train_batch(10_000 + step, args.batch)),
                      "pool": timed(lambda: pool.train_batch(step, args.batch))}
            if step >= args.warmup:
                for key, value in sample.items():
                    times[key].append(value)
        med = {k: statistics.median(v) for k, v in times.items()}
        width = fresh.train_batch(0, args.batch)["input_ids"].shape[1]
        worst = max(worst, med["fresh"] / med["step"], med["pool"] / med["step"])
        fresh_pct, pool_pct = (100 * med[k] / med["step"] for k in ("fresh", "pool"))
        print(f"{name:<18} {width:>4} {med['step'] * 1e3:>8.1f} {med['fresh'] * 1e3:>9.3f} {fresh_pct:>7.2f}% "
              f"{med['pool'] * 1e3:>8.3f} {pool_pct:>6.2f}%")
    print(f"worst data / step: {100 * worst:.2f}% (target < 5%)")


if __name__ == "__main__":
    main()
