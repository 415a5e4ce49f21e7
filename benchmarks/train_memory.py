"""Training on the CPU with glibc's defaults vs with freed memory kept (``experiments.common.keep_freed_memory``,
what the reproduction's workers do): time, system time, minor page faults and peak memory of one run, A/B in
alternating processes, and whether the trained weights are the same bit for bit.

    python benchmarks/train_memory.py runs/quick/dstg/runs/dstg/config.yaml --steps 200
    python benchmarks/train_memory.py runs/quick/extrapolation/runs/pope/config.yaml --steps 150 --profile

CONFIG is a run's config.yaml (relative paths in it, such as its data's cache_dir, are read from the current
directory, as `poslab train` reads them). Each measurement trains the run from scratch for --steps steps in a
fresh single-threaded process (setup and the final evaluation included). --profile also prints torch.profiler's
ops by self CPU time over one more run with glibc's defaults (outside the comparison).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(config_path: str, steps: int, kept: bool, profile: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    from poslab.experiments.common import keep_freed_memory
    from poslab.train import train
    from poslab.train.config import load_config

    if kept and not keep_freed_memory():
        raise SystemExit("this C library has no mallopt (not glibc): nothing to compare")
    config = load_config(config_path, [f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0",
                                       f"train.warmup_steps={min(steps, 10)}"])
    with tempfile.TemporaryDirectory() as tmp:
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        if profile:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                train(config, Path(tmp) / "run")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), file=sys.stderr)
        else:
            train(config, Path(tmp) / "run")
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        weights = hashlib.sha256((Path(tmp) / "run" / "checkpoints" / "last" / "model.safetensors").read_bytes())
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime,
            "minor_faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
            "peak_rss_mib": after.ru_maxrss / 1024,
            "weights": weights.hexdigest()[:16]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=str(Path(__file__).parent.parent / "src/poslab/configs/tasks/"
                                                                                  "addition.yaml"),
                        help="a run config (default: the packaged addition task's)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=2, help="alternating default / kept pairs")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--child", choices=("default", "kept"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.config, args.steps, args.child == "kept", args.profile)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def measure(mode: str, *extra: str) -> dict:
        argv = [sys.executable, __file__, args.config, "--steps", str(args.steps), "--child", mode, *extra]
        done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True, check=True)
        return {"mode": mode, **json.loads(done.stdout.strip().splitlines()[-1])}

    if args.profile:  # a run of its own: the profiler's overhead stays out of the comparison
        measure("default", "--profile")
    rows = [measure(mode) for _ in range(args.rounds) for mode in ("default", "kept")]
    print(f"{'mode':<8} {'wall s':>7} {'user s':>7} {'sys s':>6} {'faults/step':>12} {'peak MiB':>9}  weights")
    for r in rows:
        print(f"{r['mode']:<8} {r['wall_s']:7.1f} {r['user_s']:7.1f} {r['sys_s']:6.2f} "
              f"{r['minor_faults_per_step']:12.0f} {r['peak_rss_mib']:9.0f}  {r['weights']}")
    for i in range(args.rounds):
        default, kept = rows[2 * i], rows[2 * i + 1]
        print(f"round {i + 1}: kept / default wall {kept['wall_s'] / default['wall_s']:.3f}, "
              f"CPU {(kept['user_s'] + kept['sys_s']) / (default['user_s'] + default['sys_s']):.3f}")
    print("weights identical" if len({r["weights"] for r in rows}) == 1 else "weights DIFFER")


if __name__ == "__main__":
    main()
