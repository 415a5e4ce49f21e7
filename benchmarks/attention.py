"""PoPE attention vs RoPE attention, forward + backward, on this machine (issue 2's benchmark).

Both run through the fastest path poslab has here: on CPU, PoPE in its Cartesian 2d form through SDPA
(v zero-padded to 2d so the fused kernel stays in use) and RoPE through SDPA; on CUDA with Triton,
PoPE through the fused kernel. Also reports the alternatives we rejected, so the choice stays
measured: PoPE with unpadded v (SDPA's math fallback). Prints ratios to RoPE measured in the same run.
Last, a trained additive bias (DSTG's and T5's relative biases need its gradient): poslab's ``attend``
against SDPA called with the same bias, which on the CPU takes its math path (``attention.core._sdpa_math``).

    python benchmarks/attention.py [--n 512 2048] [--repeats 5]
"""
from __future__ import annotations

import argparse
import math
import platform
import time

import torch
import torch.nn.functional as F

from poslab.attention import attend
from poslab.functional import pope_attention, pope_frequencies, pope_polar
from poslab.positional.rope import RoPEOptions, RotaryLayer


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()  # CUDA launches return before the kernels finish
        best = min(best, time.perf_counter() - start)
    return best


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def inputs(b, h, n, d, device):
    return [torch.randn(b, h, n, d, device=device, requires_grad=True) for _ in range(3)]


def rope_step(q, k, v, rope, pos, causal):
    q2, k2 = rope.transform_qk(q, k, pos, pos)
    out, _, _ = attend({"c": (q2, k2)}, v, scale=1 / math.sqrt(q.shape[-1]), causal=causal)
    out.sum().backward()


def pope_step(q, k, v, delta, causal):
    pope_attention(q, k, v, delta, causal=causal).sum().backward()


def pope_unpadded_step(q, k, v, delta, causal):
    theta = pope_frequencies(q.shape[-1], device=q.device)
    pos = torch.arange(q.shape[-2], device=q.device)
    q2, k2 = pope_polar(q, pos, theta), pope_polar(k, pos, theta, delta)
    F.scaled_dot_product_attention(q2, k2, v, is_causal=causal, scale=1 / math.sqrt(q.shape[-1])).sum().backward()


def biased_step(q, k, v, bias, ours):
    scale = 1 / math.sqrt(q.shape[-1])
    if ours:
        out, _, _ = attend({"c": (q, k)}, v, scale=scale, causal=False, biases={"rp": bias})
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    out.sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, device {device}, batch {args.batch}, heads {args.heads}, head dim {args.head_dim}, "
          f"causal {args.causal}")
    print("n      rope_s   pope_s   pope/rope   pope_unpadded/rope")
    rope = RotaryLayer(RoPEOptions(), args.head_dim, 4096).to(device)
    delta = -torch.rand(args.heads, args.head_dim, device=device)
    for n in args.n:
        q, k, v = inputs(args.batch, args.heads, n, args.head_dim, device)
        pos = torch.arange(n, device=device)[None]
        t_rope = timed(lambda: rope_step(q, k, v, rope, pos, args.causal), args.repeats)
        t_pope = timed(lambda: pope_step(q, k, v, delta, args.causal), args.repeats)
        t_unpadded = timed(lambda: pope_unpadded_step(q, k, v, delta, args.causal), args.repeats)
        print(f"{n:<6d} {t_rope:7.3f}  {t_pope:7.3f}  {t_pope / t_rope:9.2f}x  {t_unpadded / t_rope:9.2f}x")
    print("n      sdpa_s   ours_s   ours/sdpa   (trained bias, bidirectional)")
    for n in args.n:
        q, k, v = inputs(args.batch, args.heads, n, args.head_dim, device)
        bias = torch.randn(1, args.heads, n, n, device=device, requires_grad=True)
        t_sdpa = timed(lambda: biased_step(q, k, v, bias, False), args.repeats)
        t_ours = timed(lambda: biased_step(q, k, v, bias, True), args.repeats)
        print(f"{n:<6d} {t_sdpa:7.3f}  {t_ours:7.3f}  {t_ours / t_sdpa:9.2f}x")


if __name__ == "__main__":
    main()
