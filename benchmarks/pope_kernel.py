"""Fused PoPE flash attention (Triton) against RoPE through SDPA flash and PoPE materialised to 2d + SDPA.

On a CUDA GPU, for each head dim and length, on the same bf16 inputs, four paths:
  rope    RoPE (rotate-half in fp32, cos/sin tables cached, as poslab's RoPE layer does it) + SDPA on its
          flash backend: what a model with RoPE runs
  attn    SDPA flash alone on q, k, v (no positional transform): the attention inside rope, without the
          rotation's elementwise passes, which dominate rope's time at short lengths
  pope2d  poslab.functional.pope_polar to 2d-wide q/k, v zero-padded to 2d (SDPA's fused kernels need one
          head dim), SDPA on flash or memory-efficient, output sliced back to d: what the authors ran
  fused   poslab.kernels.pope_flash.pope_flash_attention: polar transform inside the kernel
Each gets forward and forward+backward time (median of triton.testing.do_bench), TFLOP/s and the peak
memory of one forward+backward above the inputs. PoPE gradients include d(delta). FLOPs count the matmuls
as FlashAttention-2 does, the backward's recomputation of the scores included: RoPE 4 b h n^2 d forward and
10 backward (2.5x), PoPE 6 forward and 16 backward (q.k, dq and dk are 2d wide); causal halves all. Printed
ratios: fused/rope, fused/attn and fused/pope2d. Issue 7's targets on H100/H200: fused forward+backward
<= 1.5x rope at n >= 4k, peak memory <= 1.1x rope, faster than pope2d (the matmuls alone make PoPE's
forward+backward 22/14 = 1.57x attention's at equal efficiency). Without CUDA (or Triton) it prints one
line and exits 0.

    python benchmarks/pope_kernel.py [--n 1024 2048 4096 8192 16384] [--head-dims 64 128]
                                     [--tokens 16384] [--d-model 2048] [--bidirectional]
                                     [--breakdown] [--configs FILE (launch configurations from pope_kernel_configs.py)]
                                     [--backward split|atomic (the fused backward pass; default: the module's)]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from poslab.functional import pope_frequencies, pope_polar
from poslab.kernels import triton_available


def rope_tables(n: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE cos/sin (n, d) in fp32, as the models cache them."""
    inv = 10000.0 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    ang = torch.arange(n, device=device, dtype=torch.float32)[:, None] * inv
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rope_attention(q, k, v, cos, sin, causal):
    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=causal)


def sdpa_attention(q, k, v, causal):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def pope2d_attention(q, k, v, delta, causal):
    d = q.shape[-1]
    theta = pope_frequencies(d, device=q.device)
    pos = torch.arange(q.shape[-2], device=q.device)
    q2, k2 = pope_polar(q, pos, theta), pope_polar(k, pos, theta, delta)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = F.scaled_dot_product_attention(q2, k2, F.pad(v, (0, d)), is_causal=causal, scale=1 / math.sqrt(d))
    return out[..., :d]


def attention_inputs(b: int, h: int, n: int, d: int, device) -> tuple[torch.Tensor, ...]:
    """Seeded bf16 q, k, v and an upstream gradient (b, h, n, d), and a PoPE delta (h, d) in its clamp
    range; q, k, v and delta require grad."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    delta = (-2 * math.pi * torch.rand(h, d, device=device, generator=gen)).requires_grad_()
    do = torch.randn(b, h, n, d, device=device, generator=gen, dtype=torch.bfloat16)
    return q, k, v, delta, do


def use_configs(chosen: dict) -> None:
    """Make the kernels launch with ``chosen[kernel]`` where given and the backward pass run as
    ``chosen["bwd"]`` ("split" or "atomic") if given (the module's defaults elsewhere)."""
    import poslab.kernels.pope_flash as module

    defaults = getattr(module, "_defaults", None) or (module._launch_config, module._backward_mode)
    module._defaults = defaults
    module._launch_config = lambda kernel, d: tuple(chosen[kernel]) if kernel in chosen else defaults[0](kernel, d)
    module._backward_mode = lambda d: chosen.get("bwd") or defaults[1](d)


def kernel_breakdown(fn, leaves, do, reps: int = 5) -> dict[str, float]:
    """GPU ms per forward+backward call, by kernel: the fused kernels and everything else (the
    softplus passes, d(delta)'s reduction), from the PyTorch profiler's device times."""
    from torch.profiler import ProfilerActivity, profile

    torch.autograd.grad(fn(), leaves, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            torch.autograd.grad(fn(), leaves, do)
        torch.cuda.synchronize()
    parts = dict.fromkeys(("_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "other"), 0.0)
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:  # CPU-side ops carry their kernels' time too
            continue
        name = next((k for k in parts if k in event.key), "other")
        parts[name] += getattr(event, "device_time_total", 0.0) / 1e3 / reps
    return parts


def measure(fn, leaves, do):
    """(forward ms, forward+backward ms, peak MiB of one forward+backward above what is allocated now)."""
    from triton.testing import do_bench

    fwd = do_bench(fn, return_mode="median")
    fwd_bwd = do_bench(lambda: torch.autograd.grad(fn(), leaves, do), return_mode="median")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(fn(), leaves, do)
    torch.cuda.synchronize()
    return fwd, fwd_bwd, (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=16384, help="batch * n, kept fixed across n")
    parser.add_argument("--d-model", type=int, default=2048, help="heads = d_model / head dim")
    parser.add_argument("--bidirectional", action="store_true", help="no causal mask")
    parser.add_argument("--breakdown", action="store_true", help="also the fused path's GPU time by kernel")
    parser.add_argument("--configs", help="JSON of launch configurations per head dim (pope_kernel_configs.py --out)")
    parser.add_argument("--backward", choices=["split", "atomic"], help="force the fused path's backward pass")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not triton_available():
        print(f"pope_kernel benchmark: no CUDA device with Triton here (torch {torch.__version__}); nothing measured")
        return 0
    from poslab.kernels.pope_flash import pope_flash_attention

    causal = not args.bidirectional
    dev = torch.device("cuda")
    import triton

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"{datetime.date.today()}, bf16, causal {causal}, tokens {args.tokens}, d_model {args.d_model}")
    print(f"{'d':>4} {'n':>6} {'b':>3} {'h':>3} | fwd ms rope/attn/pope2d/fused | "
          f"fwd+bwd ms rope/attn/pope2d/fused | TFLOP/s fwd+bwd rope/attn/pope2d/fused | "
          f"peak MiB rope/attn/pope2d/fused | fused/rope t, mem | fused/attn t | fused/pope2d t | max|fused-pope2d|")
    configs = json.load(open(args.configs)) if args.configs else {}
    if configs:
        print(f"# launch configurations: {configs}")
    import poslab.kernels.pope_flash as pope_flash

    for d in args.head_dims:
        use_configs({**configs.get(str(d), {}), **({"bwd": args.backward} if args.backward else {})})
        print(f"# d {d}: fused backward {pope_flash._backward_mode(d)}")  # --backward, else --configs, else the default
        for n in args.n:
            b, h = max(1, args.tokens // n), args.d_model // d
            q, k, v, delta, do = attention_inputs(b, h, n, d, dev)
            cos, sin = rope_tables(n, d, dev)
            paths = {
                "rope": (lambda: rope_attention(q, k, v, cos, sin, causal), (q, k, v)),
                "attn": (lambda: sdpa_attention(q, k, v, causal), (q, k, v)),
                "pope2d": (lambda: pope2d_attention(q, k, v, delta, causal), (q, k, v, delta)),
                "fused": (lambda: pope_flash_attention(q, k, v, delta, causal=causal), (q, k, v, delta)),
            }
            with torch.no_grad():
                gap = (pope_flash_attention(q, k, v, delta, causal=causal).float()
                       - pope2d_attention(q, k, v, delta, causal).float()).abs().max().item()
            res = {}
            for name, (fn, leaves) in paths.items():
                try:
                    res[name] = measure(fn, leaves, do)
                except torch.cuda.OutOfMemoryError:
                    res[name] = (math.nan, math.nan, math.nan)
                torch.cuda.empty_cache()
            half = 0.5 if causal else 1.0
            flops = {"rope": 14 * b * h * n * n * d * half, "pope2d": 22 * b * h * n * n * d * half}
            flops["attn"], flops["fused"] = flops["rope"], flops["pope2d"]
            tflops = {name: flops[name] / (res[name][1] * 1e-3) / 1e12 for name in res}
            r, a, p, f = res["rope"], res["attn"], res["pope2d"], res["fused"]
            print(f"{d:>4} {n:>6} {b:>3} {h:>3} | {r[0]:7.3f} {a[0]:7.3f} {p[0]:7.3f} {f[0]:7.3f} | "
                  f"{r[1]:7.3f} {a[1]:7.3f} {p[1]:7.3f} {f[1]:7.3f} | "
                  + " ".join(f"{tflops[name]:6.1f}" for name in paths)
                  + f" | {r[2]:7.0f} {a[2]:7.0f} {p[2]:7.0f} {f[2]:7.0f} | {f[1] / r[1]:5.2f}x {f[2] / r[2]:5.2f}x | "
                  f"{f[1] / a[1]:5.2f}x | {f[1] / p[1]:5.2f}x | {gap:.2e}")
            if args.breakdown:
                parts = kernel_breakdown(*paths["fused"], do)
                print("       fused fwd+bwd by kernel, ms: "
                      + ", ".join(f"{k.strip('_')} {ms:.3f}" for k, ms in parts.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
