"""Fused PoPE flash attention (``poslab.kernels.pope_flash``) against an fp64 eager reference.

Without a GPU the Triton kernels run through the interpreter (TRITON_INTERPRET=1), which the kernel
meets with 16x16 tiles, so small odd lengths still cross several tiles and ragged tails. Triton reads the
variable when it decorates functions, its own standard library included, at import; other tests in the
same process may have imported triton already, so the interpreter checks run in one child process
(``python tests/test_kernels.py NAME...`` with the variable set), and each pytest test reports one check.
bf16 is checked only on CUDA: the interpreter multiplies bf16 bit patterns in ``tl.dot``
(triton-lang/triton#11584, unsupported upstream). CUDA tests are skipped without a GPU; a slow test
compiles every kernel for sm_90 ahead of time, which needs no GPU.
"""
from __future__ import annotations

import functools
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poslab.errors import ConfigError
from poslab.functional import pope_scores


def _at(value, i: int) -> int:
    return int(value[i]) if isinstance(value, torch.Tensor) else int(value)


def reference(q, k, v, delta=None, *, base=10000.0, causal=False, scale=None, q_start=0, k_start=0,
              seq_lens=None):
    """Eager attention on ``poslab.functional.pope_scores`` in the inputs' dtype (use fp64), with the
    kernel's documented padding rule: with seq_lens a query past the last valid key is zero, and so, with or
    without, is one that sees no key."""
    b, _, nq, d = q.shape
    nk = k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rows = []
    for i in range(b):
        t = _at(q_start, i) + torch.arange(nq)
        s = _at(k_start, i) + torch.arange(nk)
        n_valid = nk if seq_lens is None else int(seq_lens[i])
        a = scale * pope_scores(q[i : i + 1], k[i : i + 1], delta, base, t, s)
        ok = (torch.arange(nk) < n_valid)[None, :].expand(nq, nk)
        if causal:
            ok = ok & (s[None, :] <= t[:, None])
        live = ok.any(-1)
        if seq_lens is not None:
            live = live & (t < _at(k_start, i) + n_valid)
        a = a.masked_fill(~ok, float("-inf")).masked_fill(~live[:, None], 0.0)
        rows.append((a.softmax(-1) @ v[i : i + 1]).masked_fill(~live[:, None], 0.0))
    return torch.cat(rows)


def _inputs(b, h, nq, nk, d, with_delta, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for n in (nq, nk, nk))
    delta = -2 * math.pi * torch.rand(h, d, generator=gen) if with_delta else None  # PoPE's clamp range
    return q, k, v, delta


def _compare(attention, *, dtype=torch.float32, tol=1e-5, b=2, h=2, nq=37, nk=None, d=32, with_delta=True,
             seed=0, device="cpu", interleaved=False, **options):
    """Forward and every gradient (q, k, v, delta) of ``attention`` against the fp64 reference. interleaved:
    q, k, v and the output's gradient are (batch, heads, n, d) views of (batch, n, heads, d) memory, as a
    model's projections give them."""
    q, k, v, delta = _inputs(b, h, nq, nq if nk is None else nk, d, with_delta, seed)
    swap = (lambda x: x.transpose(1, 2)) if interleaved else (lambda x: x)
    ours = [swap(swap(x).to(device, dtype, copy=True).contiguous()).requires_grad_() for x in (q, k, v)]
    if with_delta:
        ours.append(delta.to(device, copy=True).requires_grad_())  # delta stays fp32 (a parameter)
    out = attention(*ours, **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    out.backward(swap(swap(grad).contiguous()))

    exact = [x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v, delta) if x is not None]
    cpu_options = {key: val.cpu() if isinstance(val, torch.Tensor) else val for key, val in options.items()}
    expected = reference(*exact, **cpu_options)
    expected.backward(grad.cpu().double())
    assert out.dtype == dtype and out.shape == expected.shape
    names = ["out", "dq", "dk", "dv", "ddelta"]
    for name, got, want in zip(names, [out] + [x.grad for x in ours], [expected] + [x.grad for x in exact]):
        torch.testing.assert_close(got.detach().cpu().double(), want, atol=tol, rtol=tol,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ----- checks run under the interpreter (in the child process); each takes pope_flash_attention -----

CASES = {
    "bidirectional": dict(causal=False),
    "causal": dict(causal=True),
    "causal-d64-no-delta": dict(causal=True, d=64, nq=29, with_delta=False),
    "bidirectional-d64-padded": dict(causal=False, d=64, nq=33, seq_lens=torch.tensor([33, 20])),
    "causal-padded": dict(causal=True, seq_lens=torch.tensor([37, 11])),
    "causal-decode-chunk": dict(causal=True, nq=5, nk=40, q_start=torch.tensor([35, 18]),
                                seq_lens=torch.tensor([40, 23])),
    "bidirectional-offset-cross": dict(causal=False, nq=16, nk=31, q_start=7, k_start=3, scale=0.3),
    "causal-positions-near-1e6": dict(causal=True, nq=23, q_start=10**6 - 9, k_start=10**6 - 9, base=500.0),
    # starts at opposite ends of the accepted range: their difference passes 2^29 (once 2^31, in int32)
    "causal-queries-after-keys-far-apart": dict(causal=True, nq=9, nk=12, q_start=2**29 - 20,
                                                k_start=-(2**29 - 1), base=500.0),
    "causal-queries-before-keys-far-apart": dict(causal=True, nq=9, nk=12, q_start=-(2**29 - 1),
                                                 k_start=2**29 - 20, base=500.0),
    "bidirectional-queries-after-keys-far-apart": dict(causal=False, nq=9, nk=12, q_start=2**29 - 20,
                                                       k_start=-(2**29 - 1), base=500.0),
    "causal-d128": dict(causal=True, b=1, h=1, nq=21, d=128),
    "fp16-causal": dict(causal=True, nq=26, dtype=torch.float16, tol=5e-3),
    "causal-padded-heads-interleaved": dict(causal=True, nq=23, seq_lens=torch.tensor([23, 14]), interleaved=True),
}
CHECKS = {f"matches-reference-{name}": functools.partial(_compare, **opts) for name, opts in CASES.items()}


def _check(fn):
    CHECKS[fn.__name__.removeprefix("check_").replace("_", "-")] = fn
    return fn


@_check
def check_padding_gives_zero_rows_and_zero_gradients(attention):
    q, k, v, delta = (x.requires_grad_() for x in _inputs(2, 2, 24, 24, 32, True, seed=3))
    out = attention(q, k, v, delta, causal=False, seq_lens=torch.tensor([24, 9]))
    out.sum().backward()
    assert out[1, :, 9:].abs().max() == 0 and out[0].abs().min() > 0
    for grad in (q.grad, k.grad, v.grad):
        assert grad[1, :, 9:].abs().max() == 0 and grad[1, :, :9].abs().max() > 0


@_check
def check_incremental_decoding_matches_full_causal_attention(attention):
    q, k, v, delta = _inputs(1, 2, 19, 19, 32, True, seed=4)
    full = attention(q, k, v, delta, causal=True)
    for t in (0, 7, 18):  # one new query against the cache of keys 0..t
        step = attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], delta, causal=True, q_start=t)
        torch.testing.assert_close(step, full[:, :, t : t + 1], atol=1e-6, rtol=1e-5)


@_check
def check_output_depends_on_relative_positions_only(attention):
    """Shifting every position by one amount changes nothing, far past 1e6 (the phases go through fp64)."""
    q, k, v, delta = _inputs(1, 1, 20, 20, 16, True, seed=5)

    @settings(max_examples=6, deadline=None, database=None)
    @given(shift=st.integers(min_value=0, max_value=2**29 - 20), causal=st.booleans())
    def shifted_equals_unshifted(shift, causal):
        at_zero = attention(q, k, v, delta, causal=causal)
        shifted = attention(q, k, v, delta, causal=causal, q_start=shift, k_start=shift)
        torch.testing.assert_close(shifted, at_zero, atol=2e-5, rtol=1e-4)

    shifted_equals_unshifted()


@_check
def check_saved_tensors_are_linear_in_length(attention):
    """The backward recomputes probabilities: nothing of size n^2 is kept between the passes."""
    n, d = 64, 16
    q, k, v, delta = (x.requires_grad_() for x in _inputs(1, 1, n, n, d, True, seed=6))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.numel()) or x, lambda x: x):
        attention(q, k, v, delta, causal=True)
    assert saved and max(saved) == n * d < n * n


@_check
def check_cuda_tiles_match_reference(attention):
    """The GPU's launch configurations (tiles up to 128 rows, BLOCK_M != BLOCK_N) on lengths that leave
    ragged tails: causal and padded, bidirectional, a decode chunk. The interpreter's own 16x16 tiles
    cover the other cases."""
    import poslab.kernels.pope_flash as module

    interpreter_config = module._launch_config
    module._launch_config = lambda kernel, d: module.CUDA_LAUNCH[kernel, d > 64]
    try:
        for d in (16, 32, 64, 128):
            _compare(attention, b=2, h=1, nq=139, d=d, causal=True, seq_lens=torch.tensor([139, 70]), seed=d)
        for d in (64, 128):
            _compare(attention, b=1, h=1, nq=139, d=d, causal=False, seed=d + 1)
            _compare(attention, b=1, h=1, nq=9, nk=150, d=d, causal=True, q_start=141, seed=d + 2)
    finally:
        module._launch_config = interpreter_config


@_check
def check_atomic_backward_matches_reference(attention):
    """The atomic backward (dq added by the dk/dv kernel) on the interpreter's tiles and on the GPU's own
    "dkdq" tiles: causal with padding, a decode chunk, bidirectional, no delta, fp16."""
    import poslab.kernels.pope_flash as module

    mode = module._backward_mode
    module._backward_mode = lambda d: "atomic"
    try:
        for name in ("causal-padded", "causal-decode-chunk", "bidirectional-d64-padded", "causal-d64-no-delta",
                     "fp16-causal", "causal-positions-near-1e6", "causal-padded-heads-interleaved"):
            _compare(attention, **CASES[name])
        check_cuda_tiles_match_reference(attention)  # with the "dkdq" tiles
    finally:
        module._backward_mode = mode


@_check
def check_training_after_an_inference_mode_call(attention):
    """The phase tables are cached per head dim, base and device; a first call under inference mode must not
    leave tensors there that autograd later refuses to save (a base no other check uses: a fresh entry)."""
    q, k, v, delta = _inputs(1, 1, 17, 17, 16, True, seed=9)
    with torch.inference_mode():
        attention(q, k, v, delta, base=777.0)
    q.requires_grad_()
    attention(q, k, v, delta, base=777.0).sum().backward()
    assert torch.isfinite(q.grad).all()


@_check
def check_second_derivatives_are_refused(attention):
    """The backward kernels are not differentiable: a second derivative (a gradient penalty) must raise,
    not come back partial (the atomic backward's host-side sigmoid alone was differentiated)."""
    import poslab.kernels.pope_flash as module

    mode = module._backward_mode
    q, k, v, delta = (x.requires_grad_() for x in _inputs(1, 1, 17, 17, 16, True, seed=10))
    try:
        for backward in ("split", "atomic"):
            module._backward_mode = lambda d, backward=backward: backward
            dq, = torch.autograd.grad(attention(q, k, v, delta, causal=True).square().sum(), q, create_graph=True)
            with pytest.raises(RuntimeError, match="differentiate twice"):
                dq.sum().backward()
    finally:
        module._backward_mode = mode


@_check
def check_bad_inputs_raise_config_errors(attention):
    q, k, v, delta = _inputs(1, 2, 8, 8, 32, True, seed=7)
    with pytest.raises(ConfigError, match="head dim 48"):
        attention(*(x[..., :24].repeat(1, 1, 1, 2) for x in (q, k, v)))
    with pytest.raises(ConfigError, match="k and v"):
        attention(q, k, v[:, :1])
    with pytest.raises(ConfigError, match="delta"):
        attention(q, k, v, delta[:1])
    with pytest.raises(ConfigError, match="seq_lens"):
        attention(q, k, v, seq_lens=torch.tensor([9]))
    with pytest.raises(ConfigError, match="q_start"):
        attention(q, k, v, q_start=torch.tensor([1.5]))
    with pytest.raises(ConfigError, match=r"k_start must stay below 2\^29 in magnitude"):
        attention(q, k, v, q_start=2**29 - 1, k_start=-(2**29))
    with pytest.raises(ConfigError, match="one dtype"):
        attention(q, k.double(), v)
    with pytest.raises(ConfigError, match="seq_lens must be an int or an integer tensor"):
        attention(q, k, v, seq_lens=torch.tensor([True]))
    for base in (1.0, -5.0, float("nan")):
        with pytest.raises(ConfigError, match="base must be a finite number > 1"):
            attention(q, k, v, base=base)
    wide = torch.zeros(65536, 1, 1, 16)
    with pytest.raises(ConfigError, match="batch x heads = 65536 passes the 65535 programs"):
        attention(wide, wide, wide)
    import poslab.kernels.pope_flash as module

    limit = module.ROW_SPAN_LIMIT
    module.ROW_SPAN_LIMIT = 8 * 32  # the 8 x 32 slices of these inputs span 8 * 32 elements
    try:
        with pytest.raises(ConfigError, match="spans 256 elements, past the fused kernel's 32-bit row offsets"):
            attention(q, k, v)
    finally:
        module.ROW_SPAN_LIMIT = limit


@_check
def check_non_finite_padding_stays_in_padding(attention):
    """Padding rows may hold anything (NaN from an upstream layer's padding): no real row, and not the delta
    every row shares, may see it, in either backward. The dk/dv kernel once read padded keys' magnitudes and
    values into d(delta) (and, atomic, into dq) and padding queries into real keys' gradients."""
    import poslab.kernels.pope_flash as module

    mode = module._backward_mode
    try:
        for backward in ("split", "atomic"):
            module._backward_mode = lambda d, backward=backward: backward
            for causal in (True, False):
                q, k, v, delta = _inputs(2, 2, 21, 21, 16, True, seed=12)
                for x in (q, k, v):
                    x[1, :, 9:] = float("nan")
                q, k, v, delta = (x.requires_grad_() for x in (q, k, v, delta))
                out = attention(q, k, v, delta, causal=causal, seq_lens=torch.tensor([21, 9]))
                grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(13))
                grad[1, :, 9:] = 0.0
                out.backward(grad)
                for name, x in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
                    real = torch.cat([x[0].flatten(), x[1, :, :9].flatten()])
                    assert torch.isfinite(real).all(), f"{backward} backward, causal={causal}: {name} of real rows"
                assert torch.isfinite(delta.grad).all(), f"{backward} backward, causal={causal}: d(delta)"
                assert (k.grad[1, :, 9:] == 0).all() and (v.grad[1, :, 9:] == 0).all()
    finally:
        module._backward_mode = mode


@_check
def check_non_finite_inputs_come_out_non_finite(attention):
    """A NaN in one key, or an inf in one query, reaches exactly the rows that attend to it, as in eager
    attention: the kernel once treated those rows as rows that see no key and returned zeros."""
    q, k, v, delta = _inputs(1, 1, 9, 9, 16, True, seed=11)
    k[0, 0, 2, 3] = float("nan")
    out = attention(q, k, v, delta, causal=True)
    assert torch.isfinite(out[0, 0, :2]).all() and torch.isnan(out[0, 0, 2:]).all()
    q, k, v, delta = _inputs(1, 1, 9, 9, 16, True, seed=11)
    q[0, 0, 4, 0] = float("inf")
    out = attention(q, k, v, delta, causal=True)
    rows = torch.isfinite(out[0, 0]).all(-1)
    assert not rows[4] and rows[torch.arange(9) != 4].all()


def _run_checks(names: list[str]) -> dict:
    from poslab.kernels.pope_flash import pope_flash_attention

    report = {}
    for name in names:
        start = time.perf_counter()
        try:
            CHECKS[name](pope_flash_attention)
            error = None
        except Exception:  # the parent shows the traceback in the failing test
            error = traceback.format_exc()
        report[name] = {"error": error, "seconds": round(time.perf_counter() - start, 2)}
    return report


@_check
def check_a_models_launch_plan_matches_reference(attention):
    """PolarLayer reads a forward's positions and padding once (_launch_plan) and launches past the checks
    (launch_checked): for a right-padded batch at shifted positions the kernel gives the reference's answer."""
    from poslab.kernels.pope_flash import launch_checked
    from poslab.positional.pope import _launch_plan

    positions = torch.arange(5, 5 + 29)[None]
    padding = (torch.arange(29)[None] < torch.tensor([[29], [12]])).long()
    plan = _launch_plan(positions, positions, padding)

    def through_plan(q, k, v, delta, *, causal, **reference_only):
        q_start, k_start = (torch.full((q.shape[0],), start, dtype=torch.int32) for start in plan.starts)
        return launch_checked(q, k, v, delta, base=10000.0, causal=causal, scale=None, q_start=q_start,
                              k_start=k_start, seq_lens=plan.seq_lens)

    for causal in (True, False):
        _compare(through_plan, nq=29, causal=causal, q_start=5, k_start=5, seq_lens=torch.tensor([29, 12]))


# ----- pytest side -----

def _interpreter_run(names: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *names], capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def interpreter_report(request, tmp_path_factory):
    """One child process per test session; under pytest-xdist the first worker runs it, the others
    read its report (every worker collects the same selection)."""
    triton = pytest.importorskip("triton")
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 9):
        # a CUDA machine's torch pins its own Triton: its compiled kernels are what the CUDA tests check there
        pytest.skip(f"the interpreter checks need Triton >= 3.9 (3.6's interpreter fails on the kernels' loops "
                    f"over tensor bounds); this is {triton.__version__}")
    names = [item.callspec.params["name"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_under_interpreter"]
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _interpreter_run(names)
    from filelock import FileLock

    path = tmp_path_factory.getbasetemp().parent / "pope_kernel_interpreter.json"
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            path.write_text(json.dumps(_interpreter_run(names)))
        return json.loads(path.read_text())


@pytest.mark.parametrize("name", list(CHECKS))
def test_under_interpreter(interpreter_report, name):
    error = interpreter_report[name]["error"]
    assert error is None, error


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from poslab.kernels.pope_flash import pope_flash_attention

    q, k, v, _ = _inputs(1, 1, 8, 8, 16, False, seed=8)
    with pytest.raises(ConfigError, match="CUDA"):
        pope_flash_attention(q, k, v)


def test_triton_available_follows_cuda_or_interpreter(monkeypatch):
    pytest.importorskip("triton")
    from poslab.kernels import triton_available

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert triton_available() == torch.cuda.is_available()


def test_inputs_past_the_launch_limits_are_left_to_sdpa(monkeypatch):
    """What pope_flash_attention would refuse (the grid, 32-bit row offsets, start positions) is not offered
    to it: an 'auto' model falls back to SDPA there instead of raising."""
    pytest.importorskip("triton")
    from poslab.kernels import fused_pope_supports

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    small = torch.zeros(2, 2, 8, 16)
    assert fused_pope_supports(small, small, small, starts=(2**29 - 1, -(2**29 - 1)))
    assert not fused_pope_supports(small, starts=(0, 2**29))
    wide = torch.zeros(65536, 1, 1, 16)
    assert not fused_pope_supports(wide, wide, wide)
    long = torch.empty_strided((1, 1, 2**12, 16), (2**32, 2**32, 2**20, 1), device="meta")
    assert not fused_pope_supports(small, long, long)  # a slice spanning 2^31 elements by its strides


def test_deterministic_algorithms_get_the_split_backward(monkeypatch):
    """Atomics add dq's shares in a varying order: a run that asks PyTorch for determinism gets the split
    backward whatever the launch table prefers."""
    pytest.importorskip("triton")
    import poslab.kernels.pope_flash as module

    monkeypatch.setattr(module, "CUDA_BACKWARD", {False: "atomic", True: "atomic"})
    assert module._backward_mode(64) == "atomic"
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert module._backward_mode(64) == module._backward_mode(128) == "split"
    finally:
        torch.use_deterministic_algorithms(deterministic)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv", "dkdq"])
def test_kernels_compile_for_hopper_without_a_gpu(monkeypatch, kernel, d, dtype):
    """Ahead-of-time compile for sm_90 (Triton's bundled ptxas, no GPU needed): catches what the
    interpreter accepts but the compiler rejects, and tiles that overflow shared memory; only the atomic
    backward's kernel adds atomically."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    import triton

    import poslab.kernels.pope_flash as module

    if not isinstance(module._fwd_kernel, triton.runtime.jit.JITFunction):
        pytest.skip("the kernel module was decorated under TRITON_INTERPRET=1 in this process")
    from poslab.kernels.aot import compile_kernel, ptxas_report

    compiled = compile_kernel(kernel, d, module._launch_config(kernel, d), dtype)
    assert 0 < ptxas_report(compiled)["registers"] <= 255  # what benchmarks/pope_kernel_registers.py reads
    # tensor cores on the 16-bit path (wgmma, or mma.sync where a tile is under 64 rows per warpgroup)
    assert "mma" in compiled.asm["ptx"] or dtype == "fp32"
    atomic_adds = re.search(r"\b(red|atom)\.global\.[a-z.]*add\.f32", compiled.asm["ptx"])
    assert (atomic_adds is not None) == (kernel == "dkdq")  # dq's fp32 atomic adds, only there
    assert compiled.metadata.shared <= 227 * 1024  # the most one H100/H200 block may use


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["rowsum", "dqfinish"])
def test_elementwise_backward_kernels_compile_for_hopper(monkeypatch, kernel):
    """The atomic backward's passes before and after its dk/dv kernel, at the GPU's row count: they compile
    for sm_90 without spilling, and add nothing atomically (each writes its own rows)."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    import triton

    import poslab.kernels.pope_flash as module

    if not isinstance(module._fwd_kernel, triton.runtime.jit.JITFunction):
        pytest.skip("the kernel module was decorated under TRITON_INTERPRET=1 in this process")
    from poslab.kernels.aot import compile_kernel, ptxas_report

    for d in (64, 128):
        compiled = compile_kernel(kernel, d, (module._rows_per_program(), 0, 4, 1), "bf16")
        report = ptxas_report(compiled)
        assert 0 < report["registers"] <= 255 and report["spill_bytes"] == 0
        assert re.search(r"\b(red|atom)\.global", compiled.asm["ptx"]) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter tests cover CPU)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 6e-2), (torch.float16, 2e-2)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("backward", ["split", "atomic"])
def test_cuda_matches_reference(dtype, tol, d, backward, monkeypatch):
    pytest.importorskip("triton")
    import poslab.kernels.pope_flash as module
    from poslab.kernels.pope_flash import pope_flash_attention

    monkeypatch.setattr(module, "_backward_mode", lambda d: backward)

    _compare(pope_flash_attention, dtype=dtype, tol=tol, device="cuda", b=2, h=3, nq=333, d=d, causal=True,
             seq_lens=torch.tensor([333, 200], device="cuda"))
    _compare(pope_flash_attention, dtype=dtype, tol=tol, device="cuda", b=1, h=2, nq=7, nk=300, d=d,
             causal=True, q_start=293)
    _compare(pope_flash_attention, dtype=dtype, tol=tol, device="cuda", b=3, h=2, nq=211, d=d, causal=False,
             seq_lens=torch.tensor([211, 1, 0], device="cuda"))


if __name__ == "__main__":  # the child process of interpreter_report
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    print(json.dumps(_run_checks(sys.argv[1:] or list(CHECKS))))
