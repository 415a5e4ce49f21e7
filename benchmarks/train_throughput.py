"""Training throughput: a poslab decoder against the same architecture built with x-transformers.

Part 1 -- model: identical width, depth, heads, sequence length and batch (pre-norm RMSNorm, SwiGLU with
hidden 8/3 d, full-width RoPE, no biases, untied head, SDPA attention), the same training step (forward,
next-token cross-entropy, backward, AdamW) on the same random tokens, same threads. The two models
alternate in rounds so that load from other processes hits both alike; the ratio is the median over
rounds of poslab tokens/s over x-transformers tokens/s (target >= 1.0).

Part 2 -- engine: ``poslab.train.train`` on each example task config (src/poslab/configs/tasks), as
shipped, for a few steps; reports the engine's own tokens/s and the share of step time spent building
batches (``data_fraction`` in metrics.jsonl; target < 5%), over the steps after the first window (the
first batch draws the task's training pool once).

    python benchmarks/train_throughput.py [--d-model 256 --layers 4 --heads 4 --seq-len 256 --batch 16]
        [--rounds 5 --steps 5] [--threads N] [--device cpu|cuda] [--engine-steps 20 (even)] [--skip-engine]
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


import poslab
from poslab.train import load_config, train

TASK_CONFIGS = Path(poslab.__file__).parent / "configs" / "tasks"


def build_pair(args: argparse.Namespace, vocab: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    from x_transformers import Decoder, TransformerWrapper  # checked by main(), after --help could answer
    from x_transformers.x_transformers import GLU

    hidden = int(args.d_model * 8 / 3)  # x-transformers' inner width is int(dim * ff_mult)
    ours = poslab.build_model({
        "arch": "decoder", "vocab_size": vocab, "d_model": args.d_model, "n_layers": args.layers,
        "n_heads": args.heads, "ffn_hidden": hidden, "max_seq_len": args.seq_len, "positional": {"name": "rope"},
        "norm": "rmsnorm", "mlp": "swiglu", "attn_backend": "sdpa"})
    theirs = TransformerWrapper(
        num_tokens=vocab, max_seq_len=args.seq_len, use_abs_pos_emb=False,
        attn_layers=Decoder(dim=args.d_model, depth=args.layers, heads=args.heads, rotary_pos_emb=True,
                            attn_dim_head=args.d_model // args.heads, rotary_emb_dim=args.d_model // args.heads,
                            use_rmsnorm=True, ff_glu=True, ff_swish=True, ff_mult=8 / 3, ff_no_bias=True,
                            attn_flash=True))
    for module in theirs.modules():  # x-transformers' GLU input projection always has a bias; poslab's has none
        if isinstance(module, GLU):
            module.proj.bias = None
    return ours, theirs


def make_step(model: torch.nn.Module, ours: bool, autocast):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=next(model.parameters()).is_cuda)

    def step(ids: torch.Tensor) -> None:
        with autocast():
            if ours:
                loss = model(input_ids=ids, labels=ids).loss
            else:
                logits = model(ids)
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed_steps(step, ids: torch.Tensor, n: int) -> float:
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step(ids)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def model_comparison(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    vocab = 256
    torch.manual_seed(0)
    ours, theirs = (m.to(device).train() for m in build_pair(args, vocab))
    n_ours, n_theirs = (sum(p.numel() for p in m.parameters()) for m in (ours, theirs))
    assert n_ours == n_theirs, f"not the same architecture: {n_ours:,} vs {n_theirs:,} parameters"
    bf16 = device.type == "cuda"
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else (lambda: torch.autocast("cpu", enabled=False))
    steps = {"poslab": make_step(ours, True, autocast), "x-transformers": make_step(theirs, False, autocast)}
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), device=device)
    print(f"model: d_model {args.d_model}, {args.layers} layers, {args.heads} heads, seq {args.seq_len}, "
          f"batch {args.batch}, {'bf16 autocast' if bf16 else 'fp32'}; parameters poslab {n_ours:,}, "
          f"x-transformers {n_theirs:,}")
    for step in steps.values():
        timed_steps(step, ids, args.warmup)
    tokens = args.batch * args.seq_len * args.steps
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            rates[name].append(tokens / timed_steps(step, ids, args.steps))
    ratios = [a / b for a, b in zip(rates["poslab"], rates["x-transformers"])]
    for name, r in rates.items():
        print(f"  {name:<15} {statistics.median(r):>12,.0f} tokens/s (median of {args.rounds} rounds of {args.steps} steps)")
    print(f"  ratio poslab / x-transformers: {statistics.median(ratios):.3f} (rounds: "
          f"{', '.join(f'{r:.3f}' for r in ratios)})")


def engine(args: argparse.Namespace) -> None:
    window = args.engine_steps // 2
    print(f"engine: example task configs as shipped, {args.engine_steps} steps, figures over steps "
          f"{window + 1}-{args.engine_steps}")
    print(f"  {'config':<18} {'tokens/s':>10} {'data %':>7} {'1st window data %':>18}")
    for path in sorted(TASK_CONFIGS.glob("*.yaml")):
        overrides = [f"train.steps={args.engine_steps}", f"train.log_every={window}", "train.warmup_steps=0",
                     "train.eval_every=0", "train.checkpoint_every=0", "data.validation_size=64",
                     "train.eval_batch_size=64", f"train.device={args.device}"]
        config = load_config(path, overrides)
        with tempfile.TemporaryDirectory() as out, contextlib.redirect_stderr(io.StringIO()):  # progress lines
            train(config, Path(out) / "run")
            records = [json.loads(line) for line in (Path(out) / "run/metrics.jsonl").read_text().splitlines()]
        first, steady = [r for r in records if "tokens_per_s" in r][:2]
        print(f"  {path.stem:<18} {steady['tokens_per_s']:>10,.0f} {100 * steady['data_fraction']:>6.2f}% "
              f"{100 * first['data_fraction']:>17.2f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and model")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--engine-steps", type=int, default=20)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    if args.engine_steps < 2 or args.engine_steps % 2:  # metrics.jsonl also records the last step
        parser.error("--engine-steps must be an even number >= 2: two equal windows, the second one measured")
    if importlib.util.find_spec("x_transformers") is None:  # the baseline is an optional extra: say how to get it
        raise SystemExit("benchmarks/train_throughput.py needs x-transformers, the baseline it measures against: "
                         "POSLAB_EXTRAS=dev,bench bash scripts/setup.sh (or pip install -e '.[bench]')")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, device {args.device}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d')}")
    model_comparison(args)
    if not args.skip_engine:
        engine(args)


if __name__ == "__main__":
    main()
