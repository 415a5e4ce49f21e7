"""Launch configurations of the fused PoPE kernels on CUDA: each candidate timed and checked, the fastest kept.

For each head dim, on one bf16 causal problem (default n 4096, 16384 tokens, d_model 2048), each kernel's
candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) are tried in turn -- forward first, timed alone;
then the dq and dk/dv kernels, timed as forward+backward with the forward at its fastest -- each with
the other kernels at their best so far; last the dk/dv kernel of the atomic backward ("dkdq", which
also adds dq), and the faster of the two backward passes wins ("bwd"). Every candidate's output and all
four gradients are compared with PoPE materialised to 2d + SDPA (relative error of the whole tensor), so
a tile that computes wrong results cannot win. Candidates that fail to compile (shared memory) are reported and skipped.
Prints one line per candidate and the winners; --out writes them as JSON for
``benchmarks/pope_kernel.py --configs``. The defaults, ``poslab.kernels.pope_flash.CUDA_LAUNCH``, come
from this sweep (BENCHMARKS.md).

    python benchmarks/pope_kernel_configs.py [--n 4096] [--head-dims 64 128] [--out configs.json]
"""
from __future__ import annotations

import argparse
import json

import torch

from pope_kernel import attention_inputs, pope2d_attention, use_configs  # benchmarks/ is the script's directory
from poslab.kernels import triton_available

# The candidates of the 2026-11-30 sweep (BENCHMARKS.md has its timings; its winners are now CUDA_LAUNCH): that
# day's defaults first, then neighbours and part of the first sweep's field. Spills alone do not decide: several
# winners spill a few hundred bytes per thread; the neighbours that ptxas (sm_90a) reports with over 4 KB of
# spills are left out (benchmarks/pope_kernel_registers.py prints the reports). At d 128 that day's dk/dv
# default, (32, 32, 4, 2), runs on mma.sync, not wgmma (its key tile has 32 rows, wgmma needs 64); the sweep
# chose the wgmma tile (16, 64, 4, 2). "dkdq", the atomic backward's kernel, had never been timed before that
# sweep: its candidates are the tiles with the fewest spills at each size.
CANDIDATES = {
    64: {"fwd": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 32, 8, 3), (64, 64, 4, 3)],
         "dq": [(128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 8, 2), (64, 32, 4, 2), (64, 64, 8, 2)],
         "dkdv": [(32, 128, 8, 2), (64, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 2), (64, 64, 8, 2)],
         "dkdq": [(32, 128, 8, 2), (32, 64, 8, 2), (64, 64, 8, 2), (64, 128, 8, 2), (32, 128, 8, 3)]},
    128: {"fwd": [(64, 32, 4, 2), (32, 32, 4, 2), (64, 16, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2)],
          "dq": [(64, 16, 4, 2), (64, 16, 8, 2), (64, 16, 4, 3), (64, 32, 4, 2), (64, 32, 8, 2)],
          "dkdv": [(32, 32, 4, 2), (16, 64, 4, 2), (32, 32, 4, 3), (16, 32, 8, 2), (16, 32, 4, 2), (16, 64, 8, 2),
                   (32, 64, 8, 2)],
          "dkdq": [(16, 64, 8, 2), (16, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2), (32, 32, 4, 2)]},
}


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    return [((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--tol", type=float, default=2e-2, help="largest relative error accepted (bf16)")
    parser.add_argument("--out", help="write the winners here as JSON")
    args = parser.parse_args()
    if not torch.cuda.is_available() or not triton_available():
        print(f"pope_kernel_configs: no CUDA device with Triton here (torch {torch.__version__}); nothing measured")
        return 0
    from triton.testing import do_bench

    from poslab.kernels.pope_flash import pope_flash_attention

    dev, n = torch.device("cuda"), args.n
    winners = {}
    print(f"# {torch.cuda.get_device_name()}, bf16, causal, n {n}, tokens {args.tokens}, d_model {args.d_model}")
    for d in args.head_dims:
        b, h = max(1, args.tokens // n), args.d_model // d
        q, k, v, delta, do = attention_inputs(b, h, n, d, dev)
        leaves = (q, k, v, delta)
        ref_out = pope2d_attention(q, k, v, delta, True)
        reference = [ref_out, *torch.autograd.grad(ref_out, leaves, do)]
        chosen: dict = {}
        fastest = {}  # backward pass -> best forward+backward ms
        for kernel in ("fwd", "dq", "dkdv", "dkdq"):
            best = None
            mode = "atomic" if kernel == "dkdq" else "split"
            for config in CANDIDATES[d][kernel]:
                use_configs({**chosen, kernel: config, "bwd": mode})
                try:
                    out = pope_flash_attention(q, k, v, delta, causal=True)
                    errors = relative_errors([out, *torch.autograd.grad(out, leaves, do)], reference)
                    fn = lambda: pope_flash_attention(q, k, v, delta, causal=True)  # noqa: E731
                    ms = do_bench(fn if kernel == "fwd" else lambda: torch.autograd.grad(fn(), leaves, do),
                                  warmup=10, rep=50)
                except Exception as error:  # a tile that does not compile or launch (shared memory)
                    print(f"d {d:>3} {kernel:>4} {config}: failed: {str(error).splitlines()[0][:120]}")
                    continue
                ok = max(errors) <= args.tol
                print(f"d {d:>3} {kernel:>4} {config}: {ms:8.3f} ms ({'fwd' if kernel == 'fwd' else 'fwd+bwd'}) "
                      f"max rel err {max(errors):.1e} {'ok' if ok else 'WRONG'}", flush=True)
                if ok and (best is None or ms < best[0]):
                    best = (ms, config)
            if best is not None:
                chosen[kernel] = best[1]
                fastest[mode] = best[0]
        if fastest:
            chosen["bwd"] = min(fastest, key=fastest.get)
            print(f"d {d:>3} backward: " + ", ".join(f"{m} {ms:.3f} ms" for m, ms in fastest.items()))
        winners[d] = chosen
        print(f"d {d:>3} winners: {chosen}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({str(d): {k: c if isinstance(c, str) else list(c) for k, c in w.items()}
                       for d, w in winners.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
