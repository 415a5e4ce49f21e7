"""Numerical guards: divergence is caught and named (loss, gradient norm, weights), PoPE stays finite and
accurate in bf16/fp16 for large activations and positions up to 10^6, and a seed fixes a CPU run exactly."""
from __future__ import annotations

import contextlib
import copy
import io
import itertools
import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

import poslab.cli
from poslab.functional import pope_attention, pope_frequencies, pope_polar, pope_scores
from poslab.models import build_model
from poslab.train import checkpoint as ckpt
from poslab.train import trainer as trainer_module

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
TINIEST = {torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}  # smallest subnormals: what underflow loses


# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")


def run_config(path: Path, **train) -> Path:
    raw = {"seed": 0,
           "model": {"arch": "decoder", "vocab_size": None, "d_model": 32, "n_layers": 1, "n_heads": 2,
                     "max_seq_len": 32, "positional": {"name": "pope"}},
           "data": {"kind": "task", "name": "addition", "min_len": 3, "max_len": 5, "train_size": None,
                    "validation_size": 8, "test_size": 8},
           "train": {"steps": 4, "batch_size": 8, "lr": 1e-2, "warmup_steps": 0, "log_every": 1,
                     "checkpoint_every": 1, "device": "cpu", **train}}
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = poslab.cli.main(argv)
    return code, err.getvalue()


# ---- divergence ---------------------------------------------------------------------------------------------

def _poison(monkeypatch, forward: int, kind: str) -> None:
    """The model's `forward`-th training forward (0-based) gets a NaN loss, or a finite loss whose gradient
    is infinite (its logits' gradient is replaced by inf)."""
    def build(cfg):
        model = build_model(cfg)
        calls = itertools.count()

        def hook(module, args, kwargs, out):
            if module.training and next(calls) == forward:
                if kind == "loss":
                    out["loss"] = out.loss * math.nan
                else:
                    out.logits.register_hook(lambda grad: torch.full_like(grad, math.inf))
            return out
        model.register_forward_hook(hook, with_kwargs=True)
        return model
    monkeypatch.setattr(trainer_module, "build_model", build)


@pytest.mark.parametrize("kind,message", [
    ("loss", r"loss is nan at step 3; the last good checkpoint is \S+last \(step 2\)"),
    ("gradient", r"gradient norm is (inf|nan) at step 3; the last good checkpoint is \S+last \(step 2\)"),
])
def test_non_finite_loss_or_gradient_stops_at_the_named_step(tmp_path, monkeypatch, kind, message, reliability):
    _poison(monkeypatch, forward=2, kind=kind)
    code, err = cli(["train", str(run_config(tmp_path / "c.yaml")), "--out", str(tmp_path / "run")])
    assert code == 2 and re.search(f"^poslab: error: training diverged: {message}; lower train.lr", err, re.M), err
    last = ckpt.resolve(tmp_path / "run/checkpoints/last")
    assert all(t.isfinite().all() for t in load_file(last / "model.safetensors").values())
    reliability.record("numerics", f"non-finite {kind} injected at step 3", 1,
                       "stopped with one line naming the step and the last good checkpoint (step 2, finite)")


def test_an_update_that_breaks_the_weights_never_finishes_a_run(tmp_path, reliability, monkeypatch):
    """Step 1's loss is finite, but its update leaves weights that are non-finite (an update that overflows;
    an lr past float32, which once did it, is now refused at config time) or finite and exploded (lr 1e30: the
    logits overflow). Before the guards, a 1-step run finished with exit 0 and a NaN evaluation, its
    checkpoint holding the broken weights. Now: non-finite weights are never saved, and an evaluation (there
    is always a final one) with a non-finite loss stops the run."""
    code, err = cli(["train", str(run_config(tmp_path / "c.yaml", lr=1e308)), "--out", str(tmp_path / "refused")])
    assert code == 2 and "train.lr (1e+308) is too large" in err and not (tmp_path / "refused").exists()
    real_step = torch.optim.AdamW.step

    def overflowing_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        with torch.no_grad():
            self.param_groups[0]["params"][0].mul_(math.inf)  # what an lr of 1e308 did to every weight
        return out

    outcomes: Counter[str] = Counter()
    for lr in ("overflow", 1e30):
        if lr == "overflow":
            monkeypatch.setattr(torch.optim.AdamW, "step", overflowing_step)
        else:
            monkeypatch.undo()
        for steps, eval_every, checkpoint_every in itertools.product((1, 3), (0, 1), (0, 1)):
            out = tmp_path / f"run{sum(outcomes.values())}"
            # Without weight decay: lr x weight_decay >= 1 is refused before training, and this is about what an
            # update that training cannot foresee does
            config = run_config(tmp_path / "c.yaml", lr=1e-2 if lr == "overflow" else lr, grad_clip=0, steps=steps,
                                weight_decay=0.0, eval_every=eval_every,
                                checkpoint_every=checkpoint_every)
            code, err = cli(["train", str(config), "--out", str(out)])
            found = re.search(r"training diverged: (weight \S+ is not finite after step 1|evaluation loss is nan at "
                              r"step 1|loss is nan at step 2); (no checkpoints/last was written yet|the last good checkpoint "
                              r"is \S+ \(step 1\))", err)
            assert code == 2 and found, err
            for name in ("last", "best"):
                if (out / "checkpoints" / name).exists():
                    weights = load_file(ckpt.resolve(out / "checkpoints" / name) / "model.safetensors")
                    assert all(t.isfinite().all() for t in weights.values())
            outcomes[f"{found.group(1).split()[0]} ({found.group(2)[:13]})"] += 1
    # The one case the guards cannot see without an extra forward: finite, exploded weights saved mid-run at a
    # step without evaluation. The next step's loss stops the run and names that checkpoint, as it would for a
    # bad batch; its `previous` holds the weights before the update.
    assert outcomes["loss (the last good)"] == 1 and outcomes["weight (no checkpoint)"] >= 1, outcomes
    reliability.record("numerics", "an update that breaks the weights: non-finite (an overflowing step) or finite but "
                       "exploded (lr 1e30); 1 or 3 steps, with and without evaluation and checkpoints",
                       sum(outcomes.values()), "always exit 2 with one line naming the step, never a finished run; "
                       "no checkpoint holds non-finite weights; " + ", ".join(f"{n}x '{k}'" for k, n in
                                                                             sorted(outcomes.items())))


def test_a_seed_fixes_a_cpu_run_exactly(tmp_path, reliability):
    from poslab.train import RunConfig, train

    raw = yaml.safe_load(run_config(tmp_path / "c.yaml", steps=3, eval_every=1).read_text())
    finals = []
    for name, seed, checkpoint_every in (("a", 0, 1), ("b", 0, 1), ("c", 1, 1), ("d", 0, 0)):
        config = dict(raw, seed=seed, train=dict(raw["train"], checkpoint_every=checkpoint_every))
        final = train(RunConfig.from_dict(config), tmp_path / name)
        records = [{k: v for k, v in json.loads(line).items() if k not in ("tokens_per_s", "data_fraction")}
                   for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        weights = load_file(tmp_path / name / "checkpoints/last/model.safetensors")
        finals.append(({k: v for k, v in final.items() if k not in ("seconds", "tokens_per_s")}, records, weights))
    (fa, ra, wa), (fb, rb, wb), (fc, rc, wc), (fd, rd, wd) = finals
    assert fa == fb and ra == rb and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert ra != rc and not all(torch.equal(wa[k], wc[k]) for k in wa)  # the seed matters: the test can fail
    assert fd == fa and rd == ra and all(torch.equal(wa[k], wd[k]) for k in wa)  # checkpoints change nothing
    reliability.record("numerics", "the same seed twice on CPU (a different seed; no checkpoints)", 3,
                       "identical metrics records, final metrics and weights, bitwise, with or without "
                       "checkpoints; another seed differs")


# ---- PoPE in half precision ------------------------------------------------------------------------------------

POSITIONS = [0, 1, 2, 1000, 65_519, 123_457, 999_999, 1_000_000]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pope_polar_is_finite_and_within_its_bound_at_a_million_positions(device, dtype, reliability):
    """Softplus magnitudes and cos/sin phases for activations up to the dtype's range and positions up to
    10^6, against float64 on the same (rounded) inputs. The bound on each component, mu * (rounding of the
    dtype + |phase| * 2^-24) plus underflow, is what fp32 phases allowed; fp64 phases (see pope_polar) are
    well inside it."""
    g = torch.Generator().manual_seed(0)
    d = 64
    largest = torch.finfo(dtype).max / 2
    x = torch.randn(2, 2, len(POSITIONS), d, generator=g, dtype=torch.float64) * 10
    x[..., :4] = torch.tensor([largest, -largest, 1e4, -1e4], dtype=torch.float64)
    x = x.to(dtype)
    pos = torch.tensor(POSITIONS)
    theta = pope_frequencies(d)
    out = pope_polar(x.to(device), pos.to(device), theta.to(device)).cpu().double()
    phase = pos.double()[:, None] * theta.double()
    mu = F.softplus(x.double())
    reference = torch.cat([mu * torch.cos(phase), mu * torch.sin(phase)], dim=-1)
    mu2, phase2 = torch.cat([mu, mu], -1), torch.cat([phase, phase], -1)
    bound = mu2 * (2 * ROUNDOFF[dtype] + phase2.abs() * 2.0**-24 + 1e-6) + TINIEST[dtype]
    assert out.isfinite().all()
    assert ((out - reference).abs() <= bound).all()
    reliability.record("numerics", f"pope_polar in {str(dtype)[6:]} on {device}: {d}-component activations "
                       f"up to {largest:.1e}, {len(POSITIONS)} positions up to 10^6", x.numel() // d,
                       "finite; every component within mu * (2 roundoff + |phase| 2^-24) of float64")


def test_pope_polar_phases_are_accurate_at_a_million(reliability):
    theta = pope_frequencies(64)
    pos = torch.tensor([999_999, 1_000_000])
    out = pope_polar(torch.full((1, 1, 2, 64), 30.0), pos, theta)  # softplus(30) = 30 to fp32 precision
    reference = 30.0 * torch.cos(pos.double()[:, None] * theta.double())
    error = (out[0, 0, :, :64].double() - reference).abs().max().item()
    assert error < 1e-4
    reliability.record("numerics", "pope_polar phases (fp32 output) at positions 999 999 and 10^6", 1,
                       f"phases formed in fp64, reduced mod 2 pi: max error {error:.1e} on magnitude 30 "
                       "(an fp32 phase product was 0.03 rad off)")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pope_attention_in_half_precision(device, dtype, reliability):
    """Typical activations: close to the float64 formula (pope_scores). Huge ones: still finite, and each
    output a convex combination of the values, as a softmax must give."""
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 1, 2, 48, 32
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for _ in range(3))
    delta = -2 * math.pi * torch.rand(h, d, generator=g, dtype=torch.float64)
    q, k, v, delta = (t.to(dtype) for t in (q, k, v, delta))  # one rounding, shared with the reference
    scores = pope_scores(q.double(), k.double(), delta.double()) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    reference = scores.softmax(-1) @ v.double()
    out = pope_attention(*(t.to(device) for t in (q, k, v, delta)), causal=True).cpu().double()
    assert (out - reference).abs().max() <= 8 * ROUNDOFF[dtype]
    cases = 1
    for scale in (1e2, 1e3, torch.finfo(dtype).max ** 0.5 / 4):
        big = pope_attention(*((t * scale).to(dtype).to(device) for t in (q, k)), v.to(device),
                             delta.to(device), causal=True).cpu().double()
        lo, hi = v.double().amin(-2, keepdim=True), v.double().amax(-2, keepdim=True)
        assert big.isfinite().all() and (big >= lo - 1e-2).all() and (big <= hi + 1e-2).all()
        cases += 1
    reliability.record("numerics", f"pope_attention in {str(dtype)[6:]} on {device}, activations x1 to "
                       f"x{torch.finfo(dtype).max ** 0.5 / 4:.0e}", cases,
                       "within 8 roundoff of float64 at x1; finite convex combinations of v at every scale")


def test_pope_model_at_a_million_positions(reliability):
    """PoPE scores depend on s - t only, so a model's logits at positions 10^6 + i equal those at i: the
    float64 model at offset 0 is the exact reference. Phases are formed in fp64 and reduced mod 2 pi (see
    pope_polar), so each dtype is as accurate at 10^6 as at 0 (within 2x), and float64 stays exact."""
    torch.manual_seed(0)
    model = build_model({"arch": "decoder", "vocab_size": 50, "d_model": 64, "n_layers": 2, "n_heads": 2,
                         "max_seq_len": 64, "positional": {"name": "pope", "options": {"delta_init": "uniform"}}})
    ids = torch.randint(0, 50, (2, 48))

    def logits(dtype, offset):
        pos = (torch.arange(ids.shape[1]) + offset).expand_as(ids)
        with torch.no_grad():
            return copy.deepcopy(model).to(dtype).eval()(input_ids=ids, position_ids=pos).logits.double()

    exact = logits(torch.float64, 0)
    scale = exact.abs().max()
    error = {(dtype, offset): ((logits(dtype, offset) - exact).abs().max() / scale).item()
             for dtype in (torch.bfloat16, torch.float32, torch.float64) for offset in (0, 10**6 - ids.shape[1])}
    assert all(math.isfinite(e) for e in error.values())
    for dtype in (torch.bfloat16, torch.float32):
        assert error[dtype, 10**6 - 48] <= 2 * error[dtype, 0], (dtype, error)
    assert error[torch.float64, 10**6 - 48] < 1e-12
    reliability.record("numerics", "PoPE decoder forward at positions 10^6 - 48 .. 10^6 in bf16, fp32 and fp64", 3,
                       f"finite; max logit error {error[torch.bfloat16, 10**6 - 48]:.1e} in bf16 (at position 0: "
                       f"{error[torch.bfloat16, 0]:.1e}), {error[torch.float32, 10**6 - 48]:.1e} in fp32 (at 0: "
                       f"{error[torch.float32, 0]:.1e}), {error[torch.float64, 10**6 - 48]:.0e} in fp64, relative "
                       "to the exact (float64, translated) logits")
