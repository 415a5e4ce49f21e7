"""Registers, spills and shared memory of every fused PoPE launch candidate, compiled for sm_90a without a GPU.

For each head dim, kernel and candidate of benchmarks/pope_kernel_configs.py (the defaults,
``poslab.kernels.pope_flash.CUDA_LAUNCH``, among them): ptxas's registers per thread and spill-store
bytes, Triton's shared memory per block, and which tensor-core instructions the PTX uses (Hopper's
wgmma needs 64-row tiles; smaller ones fall back to the older mma.sync), bf16, causal, with a
delta. A CPU-only guide to which tiles are worth timing on a GPU; it measures no time.

    python benchmarks/pope_kernel_registers.py [--head-dims 64 128] [--kernels fwd dq dkdv dkdq]
"""
from __future__ import annotations

import argparse
import os

os.environ.pop("TRITON_INTERPRET", None)  # the interpreter would replace the kernels
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from pope_kernel_configs import CANDIDATES  # noqa: E402  (benchmarks/ is the script's directory)

from poslab.kernels.aot import compile_kernel, ptxas_report  # noqa: E402
from poslab.kernels.pope_flash import CUDA_LAUNCH  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kernels", nargs="+", default=["fwd", "dq", "dkdv", "dkdq"])
    args = parser.parse_args()
    print("   d kernel (BLOCK_M, BLOCK_N, warps, stages) | registers | spill bytes | shared KiB | tensor cores "
          "| default")
    for d in args.head_dims:
        for kernel in args.kernels:
            default = CUDA_LAUNCH[kernel, d > 64]
            for launch in dict.fromkeys([default, *CANDIDATES[d][kernel]]):
                try:
                    compiled = compile_kernel(kernel, d, launch)
                    report = ptxas_report(compiled)
                except Exception as error:  # a tile over the shared-memory limit, say
                    print(f"{d:>4} {kernel:>6} {str(launch):>16} | failed: {str(error).splitlines()[0][:100]}")
                    continue
                ptx = compiled.asm["ptx"]
                cores = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
                print(f"{d:>4} {kernel:>6} {str(launch):>16} | {report['registers']:>9} | {report['spill_bytes']:>11} "
                      f"| {compiled.metadata.shared / 1024:>10.1f} | {cores:>12} | {'yes' if launch == default else ''}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
