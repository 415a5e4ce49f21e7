"""What each positional scheme costs in one attention layer: forward + backward, as a ratio to RoPE's time
measured in the same run (absolute times on shared machines mean little).

Every registered scheme, built as a model builds it (its input module, if any, then the attention module
that asks its layer module what to do), default options, causal, through the default backend (SDPA on CPU).
Bias schemes cost an extra (heads, n, n) tensor and SDPA's math path (a trained bias needs its gradient);
FIRE also runs its MLP on every query-key pair.

    python benchmarks/schemes.py [--n 512 2048] [--repeats 5] [--rounds 3] [--batch 4 --heads 8 --head-dim 64]
                                 [--schemes cope]
"""
from __future__ import annotations

import argparse
import platform

import torch

from attention import timed  # benchmarks/attention.py: best of repeats after a warm-up
from poslab.attention.module import MultiHeadAttention
from poslab.positional import SCHEMES, AttentionGeometry, PositionalConfig, build_positional


def step_fn(name: str, args, n: int):
    """A closure running one forward + backward of the scheme's attention layer at length n."""
    d_model = args.heads * args.head_dim
    geometry = AttentionGeometry(1, args.heads, args.head_dim, d_model, max(n, 2), causal=True)
    input_pos, layers = build_positional(PositionalConfig(name), geometry)
    attn = MultiHeadAttention(d_model, args.heads, causal=True, positional=layers[0])
    params = list(attn.parameters()) + [p for m in (input_pos, layers[0]) if m is not None for p in m.parameters()]
    x = torch.randn(args.batch, n, d_model, requires_grad=True)
    pos = torch.arange(n)[None]

    def step():
        h = x if input_pos is None else input_pos(x, pos)
        attn(h, pos).sum().backward()
        for p in params + [x]:
            p.grad = None
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; each scheme's best is kept")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--schemes", nargs="+", default=sorted(SCHEMES), choices=sorted(SCHEMES),
                        help="the schemes to time (RoPE, the baseline, always)")
    args = parser.parse_args()
    print(f"# {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; batch {args.batch}, "
          f"{args.heads} heads of {args.head_dim}, causal, forward + backward of one attention layer; best of "
          f"{args.repeats} x {args.rounds} alternating rounds")
    names = ["rope"] + sorted(n for n in set(args.schemes) if n != "rope")
    print("| scheme | " + " | ".join(f"n {n}: ms, / rope" for n in args.n) + " |")
    print("|---|" + "---|" * len(args.n))
    rows = {name: [] for name in names}
    for n in args.n:
        steps = {}
        for name in names:
            torch.manual_seed(0)
            steps[name] = step_fn(name, args, n)
        # Rounds over every scheme in turn, each scheme's best over them: a drift of the machine's speed during
        # the run reaches RoPE's time as it reaches the others' (RoPE timed once, first, was one noisy sample).
        best = dict.fromkeys(names, float("inf"))
        for _ in range(args.rounds):
            for name in names:
                best[name] = min(best[name], timed(steps[name], args.repeats))
        for name in names:
            rows[name].append(f"{best[name] * 1e3:.1f}, {best[name] / best['rope']:.2f}x")
    for name in names:
        print(f"| {name} | " + " | ".join(rows[name]) + " |")


if __name__ == "__main__":
    main()
