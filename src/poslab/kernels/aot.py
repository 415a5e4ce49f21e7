"""Ahead-of-time compilation of the fused PoPE kernels for a CUDA target, without a GPU.

Triton compiles for any target given its name and bundles ptxas, so a machine without a GPU can still
check that a kernel and launch configuration compile (shared memory, unsupported ops) and read ptxas's
register and spill report: the register file is what limits these kernels' tiles, and spills are the
first suspect when a tile is slow. Timing still needs the GPU (benchmarks/pope_kernel_configs.py).
Must be imported in a process where TRITON_INTERPRET is unset: the interpreter replaces the kernels.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from poslab.kernels import pope_flash

# "dkdq" is the dk/dv kernel with ATOMIC_DQ, the atomic backward's main kernel; "rowsum" and "dqfinish" are
# its elementwise passes before and after
KERNELS = {"fwd": pope_flash._fwd_kernel, "dq": pope_flash._bwd_dq_kernel, "dkdv": pope_flash._bwd_dkdv_kernel,
           "dkdq": pope_flash._bwd_dkdv_kernel, "rowsum": pope_flash._bwd_rowsum_kernel,
           "dqfinish": pope_flash._dq_finish_kernel}
_POINTERS = {"LSE": "*fp32", "DSUM": "*fp32", "DELTA": "*fp32", "DDELTA": "*fp32", "TURNS32": "*fp32", "DQACC": "*fp32",
             "TURNS": "*fp64", "QSTART": "*i32", "KSTART": "*i32", "KLEN": "*i32", "QLEN": "*i32"}
_TENSORS = ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV", "MQ", "MK")  # in the inputs' dtype


def compile_kernel(kernel: str, d: int, launch: tuple[int, int, int, int], dtype: str = "bf16",
                   capability: int = 90, causal: bool = True):
    """Compile one kernel (a key of KERNELS) for head dim d, launch (BLOCK_M, BLOCK_N, warps, stages; BLOCK_N
    unused by the elementwise kernels) and inputs of dtype ("bf16", "fp16", "fp32") for compute capability
    ``capability``, with a delta. Returns Triton's compiled kernel (``asm["ptx"]``, ``metadata.shared`` in
    bytes)."""
    fn = KERNELS[kernel]
    if not isinstance(fn, triton.runtime.jit.JITFunction):
        raise RuntimeError("poslab.kernels.pope_flash was imported under TRITON_INTERPRET=1 in this process")
    block_m, block_n, warps, stages = launch
    constants = dict(D=d, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, HAS_DELTA=True,
                     PRECISION="ieee" if dtype == "fp32" else "tf32")
    constants["ATOMIC_DQ"] = kernel == "dkdq"
    constants = {name: value for name, value in constants.items() if name in fn.arg_names}
    kinds = {**_POINTERS, **{name: f"*{dtype}" for name in _TENSORS}, "qk_scale": "fp32", "scale": "fp32"}
    signature = {name: "constexpr" if name in constants else kinds.get(name, "i32") for name in fn.arg_names}
    return triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", capability, 32),
                          options={"num_warps": warps, "num_stages": stages})


def ptxas_report(compiled, arch: str = "sm_90a") -> dict[str, int]:
    """Registers per thread and spill bytes (stores) of a compiled kernel, from Triton's bundled ptxas -v."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "kernel.ptx")
        with open(source, "w") as f:
            f.write(compiled.asm["ptx"])
        # Triton may bundle two; the older one refuses the newer PTX versions Triton emits
        for name in ("ptxas", "ptxas-blackwell"):
            ptxas = os.path.join(bin_dir, name)
            if not os.path.isfile(ptxas):
                continue
            done = subprocess.run([ptxas, "-v", f"-arch={arch}", source, "-o", os.path.join(tmp, "kernel.o")],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                text = done.stdout + done.stderr
                return {"registers": int(re.search(r"Used (\d+) registers", text).group(1)),
                        "spill_bytes": int(re.search(r"(\d+) bytes spill stores", text).group(1))}
    raise RuntimeError(f"no ptxas in {bin_dir} assembles this kernel for {arch}")
