"""The training engine: config validation, AdamW groups, schedule, checkpoints, resume, divergence, CLI."""
from __future__ import annotations

import argparse
import io
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from torch import nn

import poslab.cli
from poslab.errors import CheckpointError, ConfigError, PoslabError
from poslab.models import ARCHS, build_model
import poslab.train
from poslab.train import RunConfig, TrainConfig, TrainingDiverged, load_config, load_run, train
from poslab.train import checkpoint as ckpt
from poslab.train import memory
from poslab.train import trainer as trainer_module
from poslab.train.cli import register
from poslab.train.evaluation import evaluate, metrics
from poslab.train.monitor import Monitor
from poslab.train.optim import lr_factor, param_groups


# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**train) -> dict:
    """A 2-layer decoder on short additions (answers of 1-3 digits + <eos>: a varying target count)."""
    return {
        "seed": 0,
        "model": {"arch": "decoder", "vocab_size": None, "d_model": 32, "n_layers": 2, "n_heads": 2,
                  "max_seq_len": 32, "positional": {"name": "rope"}},
        "data": {"kind": "task", "name": "addition", "min_len": 3, "max_len": 5, "train_size": None,
                 "validation_size": 16, "test_size": 16},
        "train": {"steps": 4, "batch_size": 8, "lr": 1e-2, "warmup_steps": 1, "log_every": 1, **train},
    }


def write_config(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


# ---- config ------------------------------------------------------------------------------------------------

def test_config_fills_vocab_from_data_and_round_trips(tmp_path):
    config = load_config(write_config(tmp_path / "c.yaml", tiny_config()))
    source = config.data.build(config.seed)
    assert config.model.vocab_size == source.vocab_size
    assert RunConfig.from_dict(yaml.safe_load(config.to_yaml())) == config


def test_yaml_exponent_numbers_and_overrides(tmp_path):
    raw = tiny_config()
    raw["train"]["lr"] = "3e-4"  # what YAML 1.1 makes of `lr: 3e-4`
    path = write_config(tmp_path / "c.yaml", raw)
    assert load_config(path).train.lr == 3e-4
    config = load_config(path, ["train.lr=1e-3", "model.positional.name=pope", "train.betas=[0.8, 0.9]",
                                "model.positional.options.base=500"])
    assert config.train.lr == 1e-3 and config.train.betas == (0.8, 0.9)
    assert config.model.positional.name == "pope" and config.model.positional.options == {"base": 500}


@pytest.mark.parametrize("section,key,suggestion", [
    (None, "trian", "train"), ("train", "lrr", "lr"), ("model", "d_modle", "d_model"), ("train", "warmup", "warmup_steps"),
])
def test_unknown_keys_name_the_closest_valid_key(tmp_path, section, key, suggestion):
    raw = tiny_config()
    (raw if section is None else raw[section])[key] = 1
    with pytest.raises(ConfigError, match=f"'{key}'; did you mean '{suggestion}'"):
        load_config(write_config(tmp_path / "c.yaml", raw))


@pytest.mark.parametrize("override,message", [
    ("train.lr=-1", "train.lr must be a positive"),
    ("train.grad_accum=3", "train.grad_accum .3. must divide train.batch_size"),
    ("train.precision=fp16", "train.precision must be one of auto, fp32, bf16"),
    ("train.betas=[0.9]", "train.betas must be a list of 2"),
    ("train.steps=many", "train.steps must be a number"),
    ("train.steps=2.5", "train.steps must be an integer"),
    ("train.compile=yes please", "train.compile must be true or false"),
    ("train.warmup_steps=10", r"warmup_steps .10. must not exceed train.steps .4.; shortening a run, set both .e.g. "
                              r"--set train.steps=4 --set train.warmup_steps=0.$"),
    ("data.kind=text", "unknown data kind 'text'"),
    ("data.seed=3", "data.seed is not an option: the run's top-level 'seed' seeds its data"),
    ("model.n_heads=3", "n_heads .3. must divide d_model"),
    ("train=3", "train must be a mapping"),
    ("train=null", "--set train=null would drop the config's whole 'train' section; set its keys instead"),
    ("train.lr", "--set expects key.path=value"),
])
def test_invalid_values_raise_one_line_config_errors(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(write_config(tmp_path / "c.yaml", tiny_config()), [override])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("values,message", [
    ({"compile": "yes"}, "train.compile must be true or false, got 'yes'"),
    ({"fsdp": 1}, "train.fsdp must be true or false, got 1"),
    ({"eps": math.inf}, "train.eps must be a finite number, got inf"),
    ({"weight_decay": math.inf}, "train.weight_decay must be a finite number, got inf"),
    # ended as "training diverged ... lower train.lr or raise train.warmup_steps": the decay flipped every weight
    ({"weight_decay": 1e300}, "train.lr x train.weight_decay must be below 1 (AdamW scales the weights by 1 - their "
                              "product each step), got 0.0003 x 1e+300; lower either"),
    ({"grad_clip": math.inf}, "train.grad_clip must be a finite number, got inf"),
    ({"lr": "fast"}, "train.lr must be a number, got 'fast'"),
    ({"steps": 2.0}, "train.steps must be an integer, got 2.0"),
    ({"eval_batches": True}, "train.eval_batches must be an integer or null, got True"),
    ({"best_metric": None}, "train.best_metric must be a string, got None"),
    ({"betas": (0.9, "x")}, "train.betas[1] must be a number, got 'x'"),
    ({"betas": 0.9}, "train.betas must be two numbers in [0, 1), got 0.9"),
])
def test_train_config_checks_types_when_built(values, message):
    """TrainConfig refuses bad values itself, not only when read from YAML (which converts '3e-4' first)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig(**values)


@pytest.mark.parametrize("values,message", [
    ({"lr": 1e-3, "min_lr": 1e-3}, None),  # a constant tail
    ({"lr": 1e-3, "min_lr": 2e-3}, "train.min_lr must lie in [0, train.lr=0.001], got 0.002"),
    ({"min_lr": -1e-6}, "train.min_lr must lie in [0, train.lr=0.0003], got -1e-06"),
    ({"grad_clip": 0.0}, None),  # 0 disables clipping
    ({"grad_clip": -1.0}, "train.grad_clip must be >= 0 (0 disables clipping), got -1.0"),
    ({"steps": 5, "warmup_steps": 5}, None),
    ({"weight_decay": 0.0, "eval_every": 0, "checkpoint_every": 0, "warmup_steps": 0}, None),
    ({"checkpoint_every": -1}, "train.checkpoint_every must be >= 0 (0 disables it), got -1"),
    ({"batch_size": 6, "grad_accum": 4}, "train.grad_accum (4) must divide train.batch_size (6)"),
])
def test_train_config_boundaries(values, message):
    """The edge of each range is accepted, the first value past it refused."""
    if message is None:
        TrainConfig(**values)
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            TrainConfig(**values)


@pytest.mark.parametrize("seed,message", [
    (-1, "seed must be an integer in [0, 2^63), got -1"),
    (2**63, "seed must be an integer in [0, 2^63), got 9223372036854775808"),
    ("0", "seed must be an integer, got '0'"),
    (True, "seed must be an integer, got True"),
])
def test_run_config_checks_the_seed_when_built(seed, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig(seed=seed)
    if isinstance(seed, int) and not isinstance(seed, bool):  # from YAML too, before the data source is built
        with pytest.raises(ConfigError, match=re.escape(message)):
            RunConfig.from_dict(tiny_config() | {"seed": seed})


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("seed: 0\ntrain:\n  steps: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: line 4 is not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")


# ---- optimizer and schedule -----------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme,tie", [("pope", False), ("learned", True), ("t5", False), ("alibi", True)])
def test_weight_decay_only_on_linear_weights(scheme, tie):
    model = build_model({"arch": "decoder", "vocab_size": 40, "d_model": 32, "n_layers": 2, "n_heads": 2,
                         "max_seq_len": 16, "positional": {"name": scheme}, "tie_embeddings": tie,
                         "norm": "rmsnorm"})
    decay, no_decay = (set(map(id, g["params"])) for g in param_groups(model, 0.1))
    assert not decay & no_decay and decay | no_decay == {id(p) for p in model.parameters()}
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    assert decay == linear - embeddings and decay
    norms = {id(p) for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for p in m.parameters()}
    biases = {id(p) for name, p in model.named_parameters() if name.endswith("bias")}
    assert norms and embeddings and (norms | embeddings | biases) <= no_decay
    assert (id(model.get_output_embeddings().weight) in decay) == (not tie)
    assert [g["weight_decay"] for g in param_groups(model, 0.1)] == [0.1, 0.0]  # the decayed group does decay


def test_warmup_then_cosine_to_min_lr():
    cfg = TrainConfig(steps=20, lr=1e-3, min_lr=1e-4, warmup_steps=4)
    lrs = [cfg.lr * lr_factor(cfg)(t) for t in range(cfg.steps)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in itertools.pairwise(lrs[3:]))
    constant = TrainConfig(steps=20, lr=1e-3, warmup_steps=0, schedule="constant")
    assert {lr_factor(constant)(t) for t in range(20)} == {1.0}


@settings(max_examples=50, deadline=None)
@given(steps=st.integers(1, 300), warmup=st.integers(0, 300), floor=st.floats(0, 1))
def test_schedule_shape_for_any_lengths(steps, warmup, floor):
    warmup = min(warmup, steps)
    cfg = TrainConfig(steps=steps, lr=1.0, min_lr=floor, warmup_steps=warmup)
    factors = [lr_factor(cfg)(t) for t in range(steps)]
    peak = max(warmup - 1, 0)
    assert all(floor - 1e-12 <= f <= 1 + 1e-12 for f in factors[peak:]) and factors[peak] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(factors[:peak + 1]))  # warmup rises
    assert all(a >= b - 1e-12 for a, b in itertools.pairwise(factors[peak:]))  # then never rises
    if steps - 1 > peak:  # the last update uses min_lr
        assert factors[-1] == pytest.approx(floor, abs=1e-12)


def test_cosine_matches_torch_cosine_annealing():
    """After a warmup of one step (the full lr at step 0) the schedule is torch's CosineAnnealingLR down to
    min_lr at the last step: a cosine, not another curve through the same end points."""
    cfg = TrainConfig(steps=13, lr=2e-3, min_lr=2e-4, warmup_steps=1)
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.steps - 1, eta_min=cfg.min_lr)
    expected = []
    for _ in range(cfg.steps):
        expected.append(reference.get_last_lr()[0])
        optimizer.step()
        reference.step()
    assert [cfg.lr * lr_factor(cfg)(t) for t in range(cfg.steps)] == pytest.approx(expected, rel=1e-12)


# ---- checkpoints --------------------------------------------------------------------------------------------

def _save(path: Path, model: nn.Module, step: int) -> None:
    ckpt.save_checkpoint(path, model, model.state_dict(), {"state": {}}, {"last_epoch": step}, [ckpt.rng_state()],
                         {"step": step})


def test_checkpoint_swap_survives_an_interrupted_save(tmp_path):
    model = build_model({"arch": "decoder", "vocab_size": 20, "d_model": 16, "n_layers": 1, "n_heads": 2,
                         "tie_embeddings": True})
    path = tmp_path / "last"
    _save(path, model, 1)
    _save(path, model, 2)
    assert ckpt.load_trainer_state(ckpt.resolve(path))["step"] == 2
    _save(path, model, 3)
    _save(path, model, 2)
    # One copy back, not a chain of every save: previous holds the one replaced, without its own previous.
    assert ckpt.load_trainer_state(path / "previous")["step"] == 3 and not (path / "previous/previous").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]  # nothing left aside
    # A crash between "move the old one aside" and "rename the new one in" leaves only the old copy.
    path.rename(tmp_path / ".last.old")
    (tmp_path / ".last.tmp").mkdir()  # and a half-written new one
    assert ckpt.load_trainer_state(ckpt.resolve(path))["step"] == 2
    _save(path, model, 3)
    assert ckpt.load_trainer_state(ckpt.resolve(path))["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]
    fresh = build_model(model.config.spec)
    ckpt.load_weights(fresh, path)  # tied weights: stored once, loaded into both names
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        ckpt.load_weights(build_model({"arch": "decoder", "vocab_size": 20, "d_model": 32, "n_layers": 1}), path)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        ckpt.resolve(tmp_path / "best")


def test_rng_state_round_trip():
    import random

    import numpy as np
    state = ckpt.rng_state()
    first = (random.random(), np.random.rand(), torch.rand(3))
    ckpt.set_rng_state(state)
    second = (random.random(), np.random.rand(), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])


def test_rng_state_keeps_only_this_ranks_gpu(monkeypatch):
    """Every visible GPU's state was saved and restored by index: a resume that saw fewer GPUs per process
    (another node, one GPU per task) raised IndexError, and each rank overwrote the other GPUs' states."""
    saved, restored = {}, []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: saved.setdefault(device, torch.tensor([device.index])))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state.item(), device.index)))
    state = ckpt.rng_state(torch.device("cuda", 3))
    assert list(saved) == [torch.device("cuda", 3)] and state["cuda"].item() == 3
    ckpt.set_rng_state(state, torch.device("cuda", 0))  # resumed as the only GPU of its process
    old = {**state, "cuda": [torch.tensor([10]), torch.tensor([11])]}  # an older checkpoint's list
    ckpt.set_rng_state(old, torch.device("cuda", 1))
    ckpt.set_rng_state(old, torch.device("cuda", 2))  # no state at that index: the fresh seed stays
    ckpt.set_rng_state(old, torch.device("cpu"))
    assert restored == [(3, 0), (11, 1)]
    assert "cuda" not in ckpt.rng_state(torch.device("cpu"))


# ---- training -----------------------------------------------------------------------------------------------

def test_resume_continues_bitwise(tmp_path, monkeypatch):
    config = RunConfig.from_dict(tiny_config(steps=6, checkpoint_every=2, eval_every=3))
    whole = train(config, tmp_path / "whole")

    real_step = trainer_module.Trainer._train_step

    def crash_at_step_5(self, step):
        if step == 4:  # the fifth update (steps count from 0 here)
            raise KeyboardInterrupt  # the process dies after the step-4 checkpoint
        return real_step(self, step)

    monkeypatch.setattr(trainer_module.Trainer, "_train_step", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "cut")
    monkeypatch.undo()
    assert ckpt.load_trainer_state(tmp_path / "cut/checkpoints/last")["step"] == 4
    resumed = train(config, tmp_path / "cut", resume=True)

    assert losses(tmp_path / "cut") == losses(tmp_path / "whole") and len(losses(tmp_path / "whole")) == 6
    assert ckpt.load_trainer_state(tmp_path / "cut/checkpoints/last/previous")["last_loss"] == losses(tmp_path / "cut")[3]
    a, b = (load_file(tmp_path / run / "checkpoints/last/model.safetensors") for run in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {k: resumed[k] for k in ("train_loss", "eval_loss", "best_step")} == \
           {k: whole[k] for k in ("train_loss", "eval_loss", "best_step")}
    config_back, model = load_run(tmp_path / "cut", "last")
    assert config_back == config and not model.training
    assert all(torch.equal(model.state_dict()[k], v) for k, v in a.items())


def test_activation_checkpointing_trains_the_same_model(tmp_path, monkeypatch):
    """train.activation_checkpointing: every block runs again in each backward pass, and the run is the same."""
    from poslab.models.blocks import Block

    forward, calls = Block.forward, []

    def counted(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Block, "forward", counted)
    train(RunConfig.from_dict(tiny_config(steps=3)), tmp_path / "kept")
    kept = calls.count(True)
    calls.clear()
    train(RunConfig.from_dict(tiny_config(steps=3, activation_checkpointing=True)), tmp_path / "recomputed")
    assert calls.count(True) == kept + 3 * 2  # 3 steps x 2 blocks, once more each
    assert losses(tmp_path / "recomputed") == losses(tmp_path / "kept")
    kept_weights = load_file(str(tmp_path / "kept" / "checkpoints" / "last" / "model.safetensors"))
    weights = load_file(str(tmp_path / "recomputed" / "checkpoints" / "last" / "model.safetensors"))
    assert all(torch.equal(weights[name], value) for name, value in kept_weights.items())


def test_a_resume_continues_every_random_stream(tmp_path, monkeypatch):
    """The models here draw no random numbers while training, so the bitwise resume above holds without the
    checkpoint's RNG states. Dropout would: a step drawing from torch, numpy and random draws after a resume
    what it drew in the uninterrupted run."""
    import random

    import numpy as np
    config = RunConfig.from_dict(tiny_config(steps=4, checkpoint_every=2))
    real_step, draws, crash_at = trainer_module.Trainer._train_step, [], [None]

    def drawing_step(self, step):
        if step == crash_at[0]:
            raise KeyboardInterrupt  # after the step-2 checkpoint
        draws.append((step, torch.rand(1).item(), np.random.rand(), random.random()))
        return real_step(self, step)
    monkeypatch.setattr(trainer_module.Trainer, "_train_step", drawing_step)
    train(config, tmp_path / "whole")
    whole, draws[:], crash_at[0] = draws[:], [], 3
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "cut")
    crash_at[0] = None
    random.seed(1), np.random.seed(1), torch.manual_seed(1)  # whatever ran in between
    train(config, tmp_path / "cut", resume=True)
    assert [d[0] for d in draws] == [0, 1, 2, 2, 3] and draws[3:] == whole[2:]


def test_a_resume_trains_with_its_own_optimizer_settings(tmp_path):
    """The checkpoint gives the AdamW moments and the schedule's position; lr, min_lr, weight decay, betas
    and eps are the resumed config's (the one config.yaml then records), as on a run started with them."""
    train(RunConfig.from_dict(tiny_config(steps=2, checkpoint_every=1)), tmp_path / "run")
    changed = {"steps": 6, "lr": 1e-3, "min_lr": 1e-4, "weight_decay": 0.0, "betas": [0.8, 0.9], "eps": 1e-6}
    train(RunConfig.from_dict(tiny_config(**changed)), tmp_path / "run", resume=True)
    cfg = RunConfig.from_dict(tiny_config(**changed)).train
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines()) if "lr" in r]
    assert lrs[2:] == [cfg.lr * lr_factor(cfg)(t) for t in range(2, 6)]
    groups = torch.load(tmp_path / "run/checkpoints/last/optimizer.pt", weights_only=True)["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"]), g["eps"], g["initial_lr"]) for g in groups] == \
           [(0.0, (0.8, 0.9), 1e-6, 1e-3)] * 2


@pytest.mark.parametrize("kind", ["decoder", "sparse masked LM"])
def test_gradient_accumulation_matches_one_big_batch(kind, tmp_path):
    """Micro-batches hold different numbers of labelled tokens (masked LM: some may hold none)."""
    def config(**train):
        return tiny_config(**train) if kind == "decoder" else tiny_mlm_config(tmp_path / "cache", **train)
    one = train(RunConfig.from_dict(config(steps=3)), tmp_path / "one")
    two = train(RunConfig.from_dict(config(steps=3, grad_accum=4)), tmp_path / "two")
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("grad_clip", [0.0, 1e-3])
def test_each_update_gets_the_scheduled_lr_and_the_clipped_whole_batch_gradient(grad_clip, tmp_path, monkeypatch):
    """What AdamW is handed at each step, computed independently: the lr of the hand-derived schedule for that
    step (warmup 1/3, 2/3, 1, then a cosine over 3 steps to min_lr), not the next step's; and the gradient of
    the mean cross-entropy over every labelled target of the whole batch (one forward, here trained as 4
    micro-batches), scaled to norm grad_clip when it is longer, untouched with grad_clip 0."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    built, seen = {}, []
    build_optimizer = trainer_module.build_optimizer
    monkeypatch.setattr(trainer_module, "build_optimizer",
                        lambda model, *a: build_optimizer(built.setdefault("model", model), *a))

    def before_update(optimizer, args, kwargs):
        model = built["model"]
        seen.append(([g["lr"] for g in optimizer.param_groups], {k: v.clone() for k, v in model.state_dict().items()},
                     {k: p.grad.clone() for k, p in model.named_parameters()}))
    handle = register_optimizer_step_pre_hook(before_update)
    try:
        config = RunConfig.from_dict(tiny_config(steps=6, warmup_steps=3, lr=1e-2, min_lr=1e-3, grad_accum=4,
                                                 grad_clip=grad_clip))
        train(config, tmp_path / "run")
    finally:
        handle.remove()
    records = [r for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines()) if "lr" in r]
    factors = [1 / 3, 2 / 3, 1, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.25, 0.1]
    assert [lr for lrs, _, _ in seen for lr in lrs] == pytest.approx([1e-2 * f for f in factors for _ in "ab"], rel=1e-12)
    assert [r["lr"] for r in records] == pytest.approx([1e-2 * f for f in factors], rel=1e-12)
    source, model = config.data.build(config.seed), build_model(config.model)
    for step, ((_, weights, grads), record) in enumerate(zip(seen, records, strict=True)):
        model.load_state_dict(weights)
        model.zero_grad()
        batch = source.train_batch(step, config.train.batch_size)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100).backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
        assert record["grad_norm"] == pytest.approx(norm, rel=1e-4)  # measured before clipping
        scale = min(1.0, grad_clip / (norm + 1e-6)) if grad_clip else 1.0
        assert grad_clip == 0 or scale < 0.1  # the clip bites
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad * scale, rtol=1e-4, atol=1e-7 * max(scale, 1e-3))
    # And the updates are AdamW's (torch's single-tensor implementation), decaying linear maps only.
    model.load_state_dict(seen[0][1])
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)} - embedded
    cfg = config.train
    reference = torch.optim.AdamW([{"params": [p for p in model.parameters() if id(p) in linear]},
                                   {"params": [p for p in model.parameters() if id(p) not in linear],
                                    "weight_decay": 0.0}],
                                  lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False)
    final = load_file(tmp_path / "run/checkpoints/last/model.safetensors")
    for step, (_, _, grads) in enumerate(seen):
        for name, p in model.named_parameters():
            p.grad = grads[name]
        for group in reference.param_groups:
            group["lr"] = cfg.lr * factors[step]
        reference.step()
        after = seen[step + 1][1] if step + 1 < len(seen) else final
        for name, p in model.named_parameters():
            if name in after:
                torch.testing.assert_close(after[name], p.detach(), rtol=1e-5, atol=1e-7)


def test_log_eval_and_checkpoint_cadence(tmp_path):
    """Steps are counted from 1: a train record every log_every steps and at the last, an evaluation every
    eval_every steps and at the last, a checkpoint every checkpoint_every steps and at the last (the one it
    replaced kept as previous)."""
    train(RunConfig.from_dict(tiny_config(steps=5, log_every=2, eval_every=2, checkpoint_every=3)), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4, 5]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]
    last = tmp_path / "run/checkpoints/last"
    assert [ckpt.load_trainer_state(p)["step"] for p in (last, last / "previous")] == [5, 3]


def test_a_run_resumes_with_sparse_prediction_switched(tmp_path):
    """Sparse prediction only changes which logits are computed: a run resumes across the switch, as runs
    started before the ready configs turned it on must."""
    train(RunConfig.from_dict(tiny_mlm_config(tmp_path / "cache", sparse=False, steps=2)), tmp_path / "run")
    final = train(RunConfig.from_dict(tiny_mlm_config(tmp_path / "cache", steps=3)), tmp_path / "run", resume=True)
    assert final["step"] == 3 and len(losses(tmp_path / "run")) == 3
    with pytest.raises(ConfigError, match="cannot resume: model.d_ap"):
        changed = tiny_mlm_config(tmp_path / "cache", steps=4)
        changed["model"]["d_ap"] = 16
        train(RunConfig.from_dict(changed), tmp_path / "run", resume=True)


def test_init_from_fine_tunes_under_another_rope_scaling(tmp_path):
    """A fine-tune starts from another run's weights with a fresh optimizer, schedule and step count, under a
    model config that differs only in what a fine-tune may change (YaRN scaling, a longer context). A run that
    has not finished, a model whose weights differ (another scheme, tied embeddings, another width) or a path
    without a checkpoint is refused before the run directory exists."""
    train(RunConfig.from_dict(tiny_config(steps=3)), tmp_path / "base")
    base = load_file(tmp_path / "base" / "checkpoints" / "last" / "model.safetensors")

    def tuned(**changes) -> dict:
        raw = tiny_config(steps=1, warmup_steps=0, lr=1e-12, min_lr=0.0, init_from=str(tmp_path / "base"))
        raw["model"].update(max_seq_len=64, positional={
            "name": "rope", "options": {"scaling": "yarn", "factor": 2.0, "original_max_len": 32}})
        raw["model"].update(changes)
        return raw

    final = train(RunConfig.from_dict(tuned()), tmp_path / "tuned")
    assert final["step"] == 1 and len(losses(tmp_path / "tuned")) == 1
    # One step at lr 1e-12 leaves the base run's weights; a fresh initialisation is far from them.
    _, model = load_run(tmp_path / "tuned", "last")
    assert model.config.spec.positional.options["scaling"] == "yarn"
    assert all(torch.allclose(model.state_dict()[k], v, atol=1e-6) for k, v in base.items())
    fresh = build_model(RunConfig.from_dict(tuned()).model)
    assert not all(torch.allclose(fresh.state_dict()[k], v, atol=1e-3) for k, v in base.items())

    refusals = {"nope": ({"positional": {"name": "nope"}}, "model.positional.name"),
                "tied": ({"tie_embeddings": True}, "model.tie_embeddings"),
                "wider": ({"d_model": 64}, "model.d_model")}
    for name, (changes, message) in refusals.items():
        with pytest.raises(CheckpointError, match=f"does not fit this model: {message}"):
            train(RunConfig.from_dict(tuned(**changes)), tmp_path / name)
    with pytest.raises(CheckpointError, match="train.init_from: .*nowhere does not exist"):
        train(RunConfig.from_dict(tiny_config(steps=2, init_from=str(tmp_path / "nowhere"))), tmp_path / "none")
    train(RunConfig.from_dict(tiny_config(steps=2)), tmp_path / "half")
    raw = tuned()
    raw["train"]["init_from"] = str(tmp_path / "half")
    half = RunConfig.from_dict(raw)
    half_config = yaml.safe_load((tmp_path / "half" / "config.yaml").read_text())
    half_config["train"]["steps"] = 4  # as if the run were still training
    (tmp_path / "half" / "config.yaml").write_text(yaml.safe_dump(half_config))
    with pytest.raises(CheckpointError, match="stopped at step 2 of 4; finish it with --resume"):
        train(half, tmp_path / "from-half")
    assert not any((tmp_path / name).exists() for name in (*refusals, "none", "from-half"))
    # A fine-tune killed before its config.yaml leaves its init.json; a run started there from scratch drops it.
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "init.json").write_text('{"weights_sha256": "0"}')
    train(RunConfig.from_dict(tiny_config(steps=1)), tmp_path / "killed")
    assert not (tmp_path / "killed" / "init.json").exists()


def _poison_third_forward(monkeypatch):
    """Make the model's third training forward return a NaN loss (a diverging step 3); the trainer's
    pre-flight forward runs in eval mode."""
    def build(cfg):
        model = build_model(cfg)
        calls = itertools.count()

        def hook(module, args, kwargs, out):
            if module.training and next(calls) == 2:
                out["loss"] = out.loss * math.nan
            return out
        model.register_forward_hook(hook, with_kwargs=True)
        return model
    monkeypatch.setattr(trainer_module, "build_model", build)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    _poison_third_forward(monkeypatch)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 3; the last good checkpoint is .*last \(step 2\)"):
        train(RunConfig.from_dict(tiny_config(steps=5, checkpoint_every=2)), tmp_path / "run")
    last = tmp_path / "run/checkpoints/last"
    assert ckpt.load_trainer_state(last)["step"] == 2
    assert all(torch.isfinite(t).all() for t in load_file(last / "model.safetensors").values())
    assert len(losses(tmp_path / "run")) == 2


def _blank_batch(monkeypatch, blank: int) -> None:
    """Task training batches as drawn, but the one of step ``blank`` (0-based) without a labelled token."""
    from poslab.tasks.source import TaskSource

    drawn = TaskSource.train_batch

    def train_batch(self, step, *args, **kwargs):
        batch = drawn(self, step, *args, **kwargs)
        return {**batch, "labels": torch.full_like(batch["labels"], -100)} if step == blank else batch
    monkeypatch.setattr(TaskSource, "train_batch", train_batch)


def flat(state) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, in key order (AdamW's step counts are tensors too)."""
    if torch.is_tensor(state):
        return [state]
    return [t for key in sorted(state) for t in flat(state[key])] if isinstance(state, dict) else []


def test_a_batch_without_labelled_tokens_passes_without_an_update(tmp_path, monkeypatch, capsys):
    """A short masked-LM batch can draw no mask at all; the run used to stop there. The step now passes: no
    update (the weights and AdamW moments are those of the step before), the schedule and the data go on, the
    log says so, and the loss logged is the last one measured."""
    _blank_batch(monkeypatch, 1)
    constant = {"schedule": "constant", "warmup_steps": 0, "checkpoint_every": 1}
    final = train(RunConfig.from_dict(tiny_config(steps=2, **constant)), tmp_path / "skipped")
    assert final["step"] == 2 and "step 2: the batch has no labelled token" in capsys.readouterr().err
    assert losses(tmp_path / "skipped") == [final["train_loss"]] * 2
    monkeypatch.undo()
    train(RunConfig.from_dict(tiny_config(steps=1, **constant)), tmp_path / "one")
    for name in ("model.safetensors", ckpt.OPTIMIZER_FILE):
        state = [load_file(f) if name.endswith(".safetensors") else torch.load(f, weights_only=True)["state"]
                 for f in (tmp_path / run / "checkpoints/last" / name for run in ("skipped", "one"))]
        assert all(torch.equal(a, b) for a, b in zip(flat(state[0]), flat(state[1]), strict=True))


def test_a_step_without_an_update_still_advances_the_schedule(tmp_path, monkeypatch):
    """The lr stays a function of the step: after a step that passed without an update, the next one takes
    the lr of its own step, not of the one skipped."""
    _blank_batch(monkeypatch, 1)
    train(RunConfig.from_dict(tiny_config(steps=4, warmup_steps=2, min_lr=1e-3)), tmp_path / "run")
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "run/metrics.jsonl").read_text().splitlines()) if "lr" in r]
    assert lrs == pytest.approx([5e-3, 1e-2, 1e-3 + 9e-3 * 0.5, 1e-3], rel=1e-12)  # a cosine over 2 steps: 1, 1/2, 0


def test_a_checkpoint_before_the_first_update_leaves_the_run_as_it_was(tmp_path, monkeypatch):
    """Saving AdamW's state before any update makes torch fill it by a step at lr 0, counted as step 1: with the
    first batch blank, a checkpoint after it shifted the first real update's bias correction, and the weights
    depended on train.checkpoint_every. They no longer do, resumed or not."""
    _blank_batch(monkeypatch, 0)
    for every in (1, 0):
        train(RunConfig.from_dict(tiny_config(steps=3, checkpoint_every=every)), tmp_path / f"every{every}")
    train(RunConfig.from_dict(tiny_config(steps=1, checkpoint_every=1)), tmp_path / "resumed")
    train(RunConfig.from_dict(tiny_config(steps=3, checkpoint_every=1)), tmp_path / "resumed", resume=True)
    weights = [load_file(tmp_path / run / "checkpoints/last/model.safetensors") for run in ("every1", "every0", "resumed")]
    for other in weights[1:]:
        assert all(torch.equal(weights[0][k], other[k]) for k in weights[0])


def test_output_directory_rules(tmp_path):
    config = RunConfig.from_dict(tiny_config(steps=2))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes/keep.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not empty; pass --resume .* or --overwrite"):
        train(config, tmp_path / "notes")
    with pytest.raises(ConfigError, match="refuses to delete .*not a poslab run directory"):
        train(config, tmp_path / "notes", overwrite=True)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        train(config, tmp_path / "notes", resume=True)
    assert (tmp_path / "notes/keep.txt").read_text() == "mine"

    train(config, tmp_path / "run")
    other = RunConfig.from_dict(tiny_config(steps=2) | {"seed": 1})
    with pytest.raises(ConfigError, match=r"cannot resume: seed \(0 there, 1 now\)"):
        train(other, tmp_path / "run", resume=True)
    more = RunConfig.from_dict(tiny_config(steps=3))  # train settings may change on resume
    assert train(more, tmp_path / "run", resume=True)["step"] == 3
    assert train(other, tmp_path / "run", overwrite=True)["step"] == 2
    assert load_config(tmp_path / "run/config.yaml").seed == 1


def test_a_run_resumes_only_on_the_data_it_started_on(tmp_path, monkeypatch):
    """The same config gives other batches once the code that makes them changes (a version bump): the rest
    of a resumed run would train on other data than its start. A run from before data.json resumes and
    records today's version."""
    import poslab.tasks

    run = tmp_path / "run"
    train(RunConfig.from_dict(tiny_config(steps=2)), run)
    assert json.loads((run / "data.json").read_text()) == {"task_problems": poslab.tasks.DATA_VERSION}
    monkeypatch.setattr(poslab.tasks, "DATA_VERSION", poslab.tasks.DATA_VERSION + 1)
    more = RunConfig.from_dict(tiny_config(steps=3))
    with pytest.raises(ConfigError, match=r"^cannot resume: data version.task_problems \(\d+ there, \d+ now\); this poslab "
                                          r"makes other batches than the run started on, so train it again with "
                                          r"--overwrite$"):
        train(more, run, resume=True)
    (run / "data.json").unlink()
    assert train(more, run, resume=True)["step"] == 3
    assert json.loads((run / "data.json").read_text()) == {"task_problems": poslab.tasks.DATA_VERSION}


def test_a_text_run_records_its_preparation(tmp_path, monkeypatch):
    """A corpus prepared from a source is keyed by the versions of the grammar, the tokenizer training and the
    shard format: a new tokenizer training is another data version. A prepared directory is the user's."""
    import poslab.data.preparation
    from poslab.batches import data_version

    options = {"source": {"type": "synthetic", "documents": 50}, "tokenizer": {"vocab_size": 300}}
    before = data_version("lm", **options)
    assert set(before) == {"text_batches", "preparation"}
    monkeypatch.setattr(poslab.data.preparation, "TRAINING_VERSION", 99)
    assert data_version("lm", **options)["preparation"] != before["preparation"]
    assert data_version("mlm", prepared=str(tmp_path)) == {"text_batches": 1}


def test_a_text_run_keeps_its_tokenizer_and_refuses_another(tmp_path):
    """A trained text model is only usable with the tokenizer its ids came from: the run keeps it (loadable with
    AutoTokenizer). A corpus prepared again can number tokens otherwise (tied merges): resuming or measuring
    the run on such a corpus is refused. Task runs have no tokenizer to keep."""
    from transformers import AutoTokenizer

    from poslab.analysis.runs import Run
    from poslab.errors import DataError

    run = tmp_path / "run"
    config = RunConfig.from_dict(tiny_mlm_config(tmp_path / "cache", steps=1))
    train(config, run)
    source = config.data.build(config.seed)
    assert AutoTokenizer.from_pretrained(run / "tokenizer").get_vocab() == source.tokenizer.get_vocab()
    assert len(Run.load(run).batches(2, 2)) == 1
    saved = json.loads((run / "tokenizer/tokenizer.json").read_text())
    vocab = saved["model"]["vocab"]
    a, b = sorted(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens numbered otherwise
    (run / "tokenizer/tokenizer.json").write_text(json.dumps(saved))
    with pytest.raises(DataError, match=r"^cannot resume: the data's tokenizer is not the one the run trained with "
                                        rf"\({re.escape(str(run / 'tokenizer/tokenizer.json'))}\); the rest"):
        train(RunConfig.from_dict(tiny_mlm_config(tmp_path / "cache", steps=2)), run, resume=True)
    for measure in (lambda r: r.batches(2, 2), lambda r: r.source()):
        with pytest.raises(DataError, match=rf"^cannot measure {re.escape(str(run))}: the data's tokenizer is not "):
            measure(Run.load(run))
    train(RunConfig.from_dict(tiny_config(steps=1)), tmp_path / "task")
    assert not (tmp_path / "task" / "tokenizer").exists()


def tiny_lm_config(cache: Path) -> dict:
    """tiny_mlm_config's corpus read by a 1-layer decoder as a causal LM (one step)."""
    lm = tiny_mlm_config(cache, steps=1)
    lm["model"] = {"arch": "decoder", "vocab_size": None, "d_model": 32, "n_layers": 1, "n_heads": 2,
                   "max_seq_len": 32}
    lm["data"] = {key: value for key, value in lm["data"].items() if key != "masking"} | {"kind": "lm"}
    return lm


def test_a_causal_lm_runs_tokenizer_encodes_a_prompt_that_continues(tmp_path):
    """A text becomes [CLS] text: the start of a training window. It was [CLS] text [SEP], and the model took the
    [SEP] for a document's end, so generate() began a new document instead of continuing the prompt. Encoders
    keep [CLS] text [SEP]; a resume still recognises the data's tokenizer."""
    from transformers import AutoTokenizer

    lm = tiny_lm_config(tmp_path / "cache")
    train(RunConfig.from_dict(lm), tmp_path / "lm")
    train(RunConfig.from_dict(tiny_mlm_config(tmp_path / "cache", steps=1)), tmp_path / "mlm")
    for run, last in (("lm", "the"), ("mlm", "[SEP]")):
        tok = AutoTokenizer.from_pretrained(tmp_path / run / "tokenizer")
        ids = tok("the quiet river and the")["input_ids"]
        assert tok.convert_ids_to_tokens(ids)[0] == "[CLS]" and tok.convert_ids_to_tokens(ids)[-1] == last
    assert train(RunConfig.from_dict({**lm, "train": {**lm["train"], "steps": 2}}), tmp_path / "lm",
                 resume=True)["step"] == 2


def test_a_decoders_checkpoint_says_where_generation_stops(tmp_path):
    """generate() and pipeline("text-generation") ran every text to max_new_tokens: the checkpoints named no
    eos_token_id. A text decoder's documents end at [SEP]; a task's answer at <eos>."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = tiny_lm_config(tmp_path / "cache")
    train(RunConfig.from_dict(lm), tmp_path / "lm")
    train(RunConfig.from_dict(tiny_config(steps=1)), tmp_path / "task")
    tok = AutoTokenizer.from_pretrained(tmp_path / "lm" / "tokenizer")
    expected = {"lm": (tok.cls_token_id, tok.sep_token_id, tok.pad_token_id), "task": (1, 2, 0)}
    for run, ids in expected.items():
        model = AutoModelForCausalLM.from_pretrained(tmp_path / run / "checkpoints" / "last")
        config = model.generation_config
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == ids
    # generation stops there: a text whose next token is the end stops after one
    from transformers import LogitsProcessorList

    def the_end(ids, scores):
        return torch.where(torch.arange(scores.shape[-1]) == tok.sep_token_id, 0.0, -math.inf).expand_as(scores)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "lm" / "checkpoints" / "last")
    prompt = tok("the quiet river", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=10, do_sample=False, logits_processor=LogitsProcessorList([the_end]))
    assert out.shape[1] == prompt["input_ids"].shape[1] + 1 and out[0, -1] == tok.sep_token_id


def test_a_text_checkpoint_alone_serves_a_pipeline(tmp_path):
    """pipeline("text-generation", model=CHECKPOINT) failed with transformers' "install sentencepiece or
    tiktoken": the tokenizer was only in DIR/tokenizer. It is saved in each checkpoint too, naming the start and
    end tokens its generation_config names, and the model's longest sequence; the checkpoint still verifies."""
    from transformers import AutoTokenizer, pipeline

    lm = tiny_lm_config(tmp_path / "cache")
    train(RunConfig.from_dict(lm), tmp_path / "lm")
    last = tmp_path / "lm" / "checkpoints" / "last"
    ckpt.verify(last)
    generate = pipeline("text-generation", model=str(last))
    tok = generate.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id) == (generate.model.generation_config.bos_token_id,
                                                    generate.model.generation_config.eos_token_id)
    assert tok.model_max_length == lm["model"]["max_seq_len"]
    out = generate("the quiet river", max_new_tokens=3, do_sample=False)[0]["generated_text"]
    assert out.startswith("the quiet river")
    assert AutoTokenizer.from_pretrained(last).get_vocab() == AutoTokenizer.from_pretrained(
        tmp_path / "lm" / "tokenizer").get_vocab()


def test_a_text_corpus_prepared_by_another_version_is_judged_by_its_tokenizer(tmp_path, monkeypatch):
    """A new tokenizer training prepares the run's corpus afresh under another key. Training on it is refused
    (its batches may differ); measuring is refused only where the tokenizer differs from the run's own
    (test_a_text_run_keeps_its_tokenizer_and_refuses_another), not for the key alone: here the retrained
    tokenizer is the same, so the run's token ids still mean what it learned."""
    import poslab.data.preparation
    from poslab.analysis.runs import Run

    # Training a WordPiece tokenizer twice on the same text can number (and merge) tokens otherwise: its "##"
    # tokens get ids in hash-map order (huggingface/tokenizers#1794). The preparation under the new key reuses
    # the first training's tokenizer, so that only the key changes, as when a shard format or grammar moves on.
    real, trained = poslab.data.preparation._trained_tokenizer, []
    monkeypatch.setattr(poslab.data.preparation, "_trained_tokenizer",
                        lambda *args: trained[0] if trained else trained.append(real(*args)) or trained[0])
    run = tmp_path / "run"
    train(RunConfig.from_dict(tiny_mlm_config(tmp_path / "cache", steps=1)), run)
    before = Run.load(run).batches(2, 2)
    monkeypatch.setattr(poslab.data.preparation, "TRAINING_VERSION", 99)
    with pytest.raises(ConfigError, match=r"^cannot resume: data version.preparation \(.* there, .* now\)"):
        train(RunConfig.from_dict(tiny_mlm_config(tmp_path / "cache", steps=2)), run, resume=True)
    after = Run.load(run).batches(2, 2)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before, after) for k in a)


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_refused_run_leaves_the_old_run_byte_identical(tmp_path):
    """Every check that needs no training step runs before the run directory is touched: a refused --overwrite
    deletes nothing, a refused --resume rewrites no config.yaml, a refused new run leaves no directory."""
    train(RunConfig.from_dict(tiny_config(steps=2, checkpoint_every=1)), tmp_path / "run")
    before = files(tmp_path / "run")
    longer = tiny_config(steps=2, eval_split="test_long")  # longer than the learned table: found by a forward
    longer["model"].update(positional={"name": "learned"}, max_seq_len=10)
    longer["data"].update(max_len=8, train_max_len=4)
    refusals = [(tiny_config(best_metric="exact_macth"), {"overwrite": True}, "unknown train.best_metric"),
                (tiny_config(steps=1), {"resume": True},
                 r"cannot resume: train.steps \(1\) is below the step .*last was saved at \(2\); set train.steps to 2"),
                (longer, {"overwrite": True}, "evaluating train.eval_split 'test_long' would fail: position 16 is "
                                              "beyond the learned position table")]
    if not torch.cuda.is_available():  # only a forward finds that the fused kernel cannot run here
        triton = tiny_config(steps=2)
        triton["model"].update(positional={"name": "pope"}, attn_backend="triton")
        refusals.append((triton, {"overwrite": True}, "attn_backend 'triton' needs a CUDA GPU"))
    for raw, mode, message in refusals:
        if "overwrite" in mode:  # the same config as a new run
            with pytest.raises(PoslabError, match=message):
                train(RunConfig.from_dict(raw), tmp_path / "new")
            assert not (tmp_path / "new").exists()
        with pytest.raises(PoslabError, match=message):
            train(RunConfig.from_dict(raw), tmp_path / "run", **mode)
        assert files(tmp_path / "run") == before, mode


def test_resuming_a_finished_run_prints_strict_json(tmp_path, capsys):
    """No step is left to train, so there is no throughput: null, not NaN (which is not JSON)."""
    path = write_config(tmp_path / "c.yaml", tiny_config(steps=2))
    assert poslab.cli.main(["train", str(path), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert poslab.cli.main(["train", str(path), "--out", str(tmp_path / "run"), "--resume"]) == 0

    def not_json(constant):
        raise AssertionError(f"{constant} in the summary line")
    final = json.loads(capsys.readouterr().out, parse_constant=not_json)
    assert final["step"] == 2 and final["tokens_per_s"] is None and math.isfinite(final["eval_loss"])


DSTG_MODEL = {"arch": "dstg", "vocab_size": None, "n_layers": 1, "n_heads": 2, "d_ap": 8, "d_sem": 24,
              "max_seq_len": 32}


@pytest.mark.parametrize("arch,kind,message", [
    ("encoder", "lm", "model.arch 'encoder' does not learn from data.kind 'lm': its labels are its input tokens, "
                      "which a bidirectional model sees and copies; use model.arch decoder, or data.kind mlm"),
    ("encoder", "task", "model.arch 'encoder' does not learn from data.kind 'task'"),
    ("dstg", "task", "model.arch 'dstg' does not learn from data.kind 'task'"),
    ("dstg", "lm", "model.arch 'dstg' does not learn from data.kind 'lm'"),
    ("decoder", "mlm", "model.arch 'decoder' does not learn from data.kind 'mlm': its labels are masked tokens, "
                       "which a decoder cannot fill in from the tokens after them; use model.arch encoder or dstg, "
                       "or data.kind lm or task"),
])
def test_a_model_that_cannot_learn_from_the_data_is_refused(arch, kind, message):
    """An encoder given an lm or task source sees each label as its own input and learns to copy it."""
    raw = tiny_config()
    raw["model"] = DSTG_MODEL if arch == "dstg" else raw["model"] | {"arch": arch}
    raw["data"] = {"kind": kind}  # refused before the source is built
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig.from_dict(raw)


@pytest.mark.parametrize("model", [
    {"arch": "decoder", "positional": {"name": "pope"}, "n_layers": 5},
    {"arch": "encoder", "positional": {"name": "t5"}, "n_layers": 3},
    {"arch": "decoder", "positional": {"name": "learned"}, "tie_embeddings": True, "n_layers": 4},
    {"arch": "decoder", "positional": {"name": "alibi"}, "n_layers": 1},
    DSTG_MODEL | {"vocab_size": 30, "n_layers": 3},
])
def test_the_memory_check_counts_the_model_from_two_layers(model):
    """The count the memory check extrapolates from one and two layers is the built model's."""
    config_cls, _ = ARCHS[model["arch"]]
    config = config_cls.from_dict({"vocab_size": 30, **model})
    with torch.device("meta"):
        built = build_model(config)
    params = list(built.parameters())
    assert memory.model_sizes(config) == (
        sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
        sum(b.numel() * b.element_size() for b in built.buffers()))


def test_a_task_whose_later_batches_outgrow_the_model_is_refused_before_step_one(tmp_path):
    """Task batches are as wide as their longest problem: reversal up to 22 characters gives batches of 8
    from 36 to 42 tokens. A model of 40 positions fits the first batch and would stop at a later one, with a
    max_seq_len that a resume cannot change: refused from the widest batch any step can draw."""
    raw = tiny_config(steps=30)
    raw["data"] = {**raw["data"], "name": "reversal", "min_len": 6, "max_len": 22}
    raw["model"]["max_seq_len"] = 40
    config = RunConfig.from_dict(raw)
    assert config.data.build(0).train_batch(0, 8)["input_ids"].shape[1] <= 40  # the first batch fits
    with pytest.raises(ConfigError, match=r"^the data has training sequences of up to 42 tokens but "
                                          r"model.max_seq_len is 40; raise model.max_seq_len$"):
        train(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_best_mode_follows_the_metric_and_a_contradiction_is_refused():
    assert TrainConfig().best_mode == "min"
    assert TrainConfig(best_metric="token_accuracy").best_mode == "max"
    assert TrainConfig(best_metric="exact_match").best_mode == "max"
    with pytest.raises(ConfigError, match=r"^train.best_mode min would keep the checkpoint with the lowest "
                                          r"exact_match; use max, or leave best_mode out$"):
        TrainConfig(best_metric="exact_match", best_mode="min")
    with pytest.raises(ConfigError, match="highest loss; use min"):
        TrainConfig(best_mode="max")


def test_a_saved_config_names_no_mode_so_it_takes_another_best_metric(tmp_path):
    """A run's config.yaml is a starting point for the next run: the mode its metric implied must not stay
    behind to refuse another metric."""
    saved = load_config(write_config(tmp_path / "c.yaml", tiny_config())).to_yaml()
    assert yaml.safe_load(saved)["train"]["best_mode"] is None
    (tmp_path / "saved.yaml").write_text(saved)
    assert load_config(tmp_path / "saved.yaml", ["train.best_metric=token_accuracy"]).train.best_mode == "max"
    assert load_config(tmp_path / "saved.yaml").train.best_mode == "min"


def test_every_rank_keeps_the_best_checkpoint_by_rank_zero_s_numbers(tmp_path, monkeypatch):
    """Ranks evaluate alone; a rank whose numbers differ in the last bit must not decide alone to save (a
    collective): the trainer takes rank 0's numbers. Here "rank 0" (the broadcast) reports a loss that only
    falls, this process's evaluation one that only rises: the best checkpoint follows the broadcast."""
    real_evaluate = trainer_module.evaluation.evaluate
    calls = []

    def rising(*args, **kwargs):
        metrics = real_evaluate(*args, **kwargs)
        calls.append(None)
        return {**metrics, "loss": float(len(calls))}

    monkeypatch.setattr(trainer_module.evaluation, "evaluate", rising)
    monkeypatch.setattr(trainer_module.Parallel, "broadcast",
                        lambda self, obj: {**obj, "loss": -obj["loss"]} if isinstance(obj, dict) and "loss" in obj
                        else obj)
    train(RunConfig.from_dict(tiny_config(steps=3, eval_every=1)), tmp_path / "run")
    best = json.loads((tmp_path / "run" / "checkpoints" / "best" / "trainer_state.json").read_text())["best"]
    assert {k: best[k] for k in ("metric", "value", "step")} == {"metric": "loss", "value": -3.0, "step": 3}


@pytest.mark.parametrize("metric,values,best", [
    ("loss", [3.0, 2.0, 2.0, 2.5, 2.1], (2.0, 2)),  # a tie is no improvement
    ("token_accuracy", [0.5, 0.7, 0.7, math.nan, 0.6], (0.7, 2)),  # nor is NaN
])
def test_the_best_checkpoint_is_the_first_strict_improvement(metric, values, best, tmp_path, monkeypatch):
    real_evaluate, calls = trainer_module.evaluation.evaluate, []

    def scripted(*args, **kwargs):
        metrics = real_evaluate(*args, **kwargs)
        calls.append(None)
        return {**metrics, "loss": 1.0, metric: values[len(calls) - 1]}
    monkeypatch.setattr(trainer_module.evaluation, "evaluate", scripted)
    result = train(RunConfig.from_dict(tiny_config(steps=5, eval_every=1, best_metric=metric)), tmp_path / "run")
    state = ckpt.load_trainer_state(tmp_path / "run/checkpoints/best")
    assert (state["best"]["value"], state["best"]["step"], state["step"]) == (*best, best[1])
    assert (result[f"best_{metric}"], result["best_step"]) == best


def test_bad_vocab_sequence_length_and_lone_fsdp_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="train.fsdp shards the model over several processes"):
        train(RunConfig.from_dict(tiny_config(fsdp=True)), tmp_path / "c")
    raw = tiny_config()
    raw["model"]["vocab_size"] = 5
    with pytest.raises(ConfigError, match=r"model.vocab_size \(5\) is smaller than the data's vocabulary"):
        train(RunConfig.from_dict(raw), tmp_path / "a")
    raw = tiny_config()
    raw["model"]["max_seq_len"] = 4
    with pytest.raises(ConfigError, match="raise model.max_seq_len"):
        train(RunConfig.from_dict(raw), tmp_path / "b")
    assert not any((tmp_path / name).exists() for name in "abc")  # refused before writing anything


@pytest.mark.parametrize("kind,train_options,message", [
    ("task", {"best_metric": "exact_macth"},
     "unknown train.best_metric 'exact_macth'; did you mean 'exact_match'? (valid: exact_match, loss, token_accuracy)"),
    ("task", {"best_metric": "tokens"}, "unknown train.best_metric 'tokens'"),  # counts, not metrics
    ("task", {"best_metric": "examples"}, "unknown train.best_metric 'examples'"),
    ("mlm", {"best_metric": "exact_match"},  # only a decoder on a task scores whole answers
     "unknown train.best_metric 'exact_match' (valid: loss, token_accuracy)"),
    ("task", {"eval_split": "valid"},
     "unknown train.eval_split 'valid'; did you mean 'validation'? (valid: test, validation)"),
    ("task", {"eval_split": "test_long"}, "unknown train.eval_split 'test_long'"),  # only with data.train_max_len
])
def test_bad_evaluation_names_are_refused_before_the_first_step(tmp_path, monkeypatch, kind, train_options, message):
    """With eval_every 0 the first evaluation is the final one: a name it cannot find must not cost the run."""
    monkeypatch.setattr(trainer_module.Trainer, "_train_step", lambda self, step: pytest.fail("a step ran"))
    options = {"eval_every": 0, "checkpoint_every": 1, **train_options}
    raw = tiny_config(**options) if kind == "task" else tiny_encoder_config(tmp_path / "cache", **options)
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(RunConfig.from_dict(raw), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before writing anything


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_best_metric_choices_are_what_the_evaluation_reports(arch, tmp_path):
    config = RunConfig.from_dict(tiny_config() if arch == "decoder" else tiny_encoder_config(tmp_path / "cache"))
    reported = evaluate(build_model(config.model), config.data.build(config.seed), config, torch.device("cpu"),
                        torch.autocast("cpu", enabled=False))
    assert set(metrics(config)) <= set(reported) and set(reported) - set(metrics(config)) <= {"tokens", "examples"}
    assert ("exact_match" in metrics(config)) == (arch == "decoder")


def test_cli_writes_run_and_plain_progress_lines(tmp_path, capsys):
    path = write_config(tmp_path / "c.yaml", tiny_config())
    parser = argparse.ArgumentParser(prog="poslab")
    register(parser.add_subparsers())
    args = parser.parse_args(["train", str(path), "--out", str(tmp_path / "run"), "--set", "train.steps=2",
                              "--set", "train.eval_every=1"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    final = json.loads(out)
    assert final["step"] == 2 and set(final) >= {"train_loss", "eval_loss", "eval_exact_match", "tokens_per_s"}
    assert "step 1/2  loss" in err and "eval at step 2: loss" in err
    records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 2, 2]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "data_fraction"} <= set(records[0])
    assert {"eval_loss", "eval_token_accuracy", "eval_exact_match"} <= set(records[1])
    assert load_config(tmp_path / "run/config.yaml").train.steps == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["train", str(path), "--out", "x", "--resume", "--overwrite"])
    with pytest.raises(PoslabError):
        args.func(args)  # the run exists: refused without --resume/--overwrite


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    path = write_config(tmp_path / "c.yaml", tiny_config(steps=1))
    (tmp_path / "bad.yaml").write_text("train: {steps: [1\n")
    cases = [
        [str(tmp_path / "bad.yaml"), "--out", str(tmp_path / "a")],
        [str(path), "--out", str(tmp_path / "b"), "--set", "train.lrr=1"],
        [str(path), "--out", str(tmp_path / "c"), "--resume"],
        [str(path), "--out", str(tmp_path / "d"), "--resume", "--overwrite"],
        [str(path), "--out", str(tmp_path / "e"), "--set", "train.best_metric=exact_macth"],
        ["", "--out", str(tmp_path / "f")],  # an empty path is the current directory, not a config
        [str(path), "--out", ""],
    ]
    monkeypatch.chdir(tmp_path)  # were --out "" taken as the current directory, it would be this one
    for argv in cases:
        assert poslab.cli.main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("poslab") and err.count("\n") == 1, err
    assert not any((tmp_path / name).exists() for name in "abcdef")  # nothing written on error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "c.yaml"]
    assert poslab.cli.main(["train", str(path), "--out", str(tmp_path / "ok")]) == 0


def test_an_output_that_cannot_be_created_is_refused_before_any_work(tmp_path, capsys):
    """It failed only when first written: `data prepare` after training its tokenizer, naming a temporary
    file; `train` with a bare "No such file or directory"."""
    path = write_config(tmp_path / "c.yaml", tiny_config(steps=1))
    under_a_file = tmp_path / "c.yaml" / "run"
    for command in ("train", "data prepare"):
        assert poslab.cli.main([*command.split(), str(path), "--out", str(under_a_file)]) == 2
        assert capsys.readouterr().err == (
            f"poslab: error: argument --out: cannot create {under_a_file} ({path}: Not a directory); "
            f"choose another directory (see 'poslab {command} --help')\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize("argv,help_of", [
    (["analyze", "adjacency", "--run", "x", "--bogus"], "poslab analyze"),
    (["tasks", "show", "addition", "--count", "3"], "poslab tasks show"),
    (["train", "c.yaml", "--out", "y", "--frob"], "poslab train"),
    (["reproduce", "all", "--fast"], "poslab reproduce"),
])
def test_an_unknown_option_names_the_help_of_its_command(argv, help_of, capsys):
    """argparse reports arguments no subcommand knew from the top parser, whose help ('poslab --help') does not
    list the subcommand's options."""
    assert poslab.cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("poslab: error: unrecognized arguments: ") and err.endswith(f" (see '{help_of} --help')\n")


def test_an_empty_config_says_so(tmp_path, capsys):
    """It said "a task source needs the task's name (data.name)", the first default that failed."""
    for text in ("# nothing yet\n", "{}\n"):
        (tmp_path / "empty.yaml").write_text(text)
        assert poslab.cli.main(["train", str(tmp_path / "empty.yaml"), "--out", str(tmp_path / "run")]) == 2
        assert capsys.readouterr().err == (f"poslab: error: {tmp_path / 'empty.yaml'} is empty: a run config holds "
                                           "seed, model, data and train (examples: src/poslab/configs/tasks/*.yaml)\n")
    assert not (tmp_path / "run").exists()


def test_progress_bar_on_a_terminal(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    monitor = Monitor(tmp_path, total_steps=4, start_step=0, stream=stream)
    monitor.step(1)
    monitor.log_train(2, {"loss": 1.25, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1234.0, "data_fraction": 0.01})
    monitor.log_eval(2, {"loss": 1.5, "token_accuracy": 0.25})
    monitor.close()
    text = stream.getvalue()
    assert "loss 1.2500" in text and "1,234 tok/s" in text and "2/4" in text and "eval at step 2" in text
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [2, 2]


def test_bf16_autocast_trains(tmp_path):
    final = train(RunConfig.from_dict(tiny_config(steps=2, precision="bf16")), tmp_path / "run")
    assert math.isfinite(final["train_loss"]) and math.isfinite(final["eval_loss"])
    weights = load_file(tmp_path / "run/checkpoints/last/model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}  # autocast: fp32 master weights


@pytest.mark.slow  # inductor compiles for each new sequence width: minutes on two cores
def test_compiled_model_trains_like_the_eager_one(tmp_path):
    train(RunConfig.from_dict(tiny_config(steps=3)), tmp_path / "eager")
    train(RunConfig.from_dict(tiny_config(steps=3, compile=True)), tmp_path / "compiled")
    assert losses(tmp_path / "compiled") == pytest.approx(losses(tmp_path / "eager"), rel=1e-4)


TASK_CONFIGS = Path(poslab.train.__file__).parent.parent / "configs" / "tasks"


@pytest.mark.parametrize("name", ["indirect_indexing", "addition", "reversal", "indexing", "ordering"])
def test_example_task_configs_are_valid_and_train(tmp_path, name):
    config = load_config(TASK_CONFIGS / f"{name}.yaml")
    assert config.model.arch == "decoder" and config.data.options["name"] == name
    small = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "train.steps=1", "train.batch_size=4",
             "train.warmup_steps=0", "train.eval_batch_size=8", "data.train_size=null", "data.validation_size=8"]
    final = train(load_config(TASK_CONFIGS / f"{name}.yaml", small), tmp_path / name)
    assert math.isfinite(final["train_loss"]) and 0 <= final["eval_exact_match"] <= 1


def tiny_mlm_config(cache: Path, sparse: bool = True, **train) -> dict:
    """A 1-layer DSTG masked LM on a few synthetic documents (prepared once into ``cache``)."""
    return {"seed": 0,
            "model": {"arch": "dstg", "vocab_size": None, "n_layers": 1, "n_heads": 2, "d_ap": 8, "d_sem": 24,
                      "max_seq_len": 32, "sparse_prediction": sparse},
            "data": {"kind": "mlm", "source": {"type": "synthetic", "documents": 40, "seed": 0},
                     "tokenizer": {"type": "wordpiece", "vocab_size": 200, "train_documents": 40},
                     "validation_documents": 4, "seq_len": 32, "masking": {"style": "neobert"},
                     "cache_dir": str(cache)},
            "train": {"steps": 2, "batch_size": 4, "warmup_steps": 0, "eval_batches": 2, "log_every": 1, **train}}


def tiny_encoder_config(cache: Path, **train) -> dict:
    """tiny_mlm_config with a 1-layer NeoBERT-style encoder in place of DSTG."""
    return tiny_mlm_config(cache, **train) | {
        "model": {"arch": "encoder", "vocab_size": None, "d_model": 32, "n_layers": 1, "n_heads": 2,
                  "max_seq_len": 32, "sparse_prediction": True}}


def test_a_section_can_name_a_yaml_file_or_a_ready_model(tmp_path, monkeypatch):
    """A run config could not share a model file (the DSTG ready configs were copied into each run config):
    a section given as a string names a YAML file, relative to the run config; --set changes its values."""
    from poslab.models.dstg import ready_config

    (tmp_path / "configs" / "models").mkdir(parents=True)
    raw = tiny_config(steps=1)
    (tmp_path / "configs" / "models" / "small.yaml").write_text(yaml.safe_dump(raw["model"]))
    path = write_config(tmp_path / "configs" / "run.yaml", raw | {"model": "models/small.yaml"})
    monkeypatch.chdir(tmp_path)  # the file is found beside the run config, not in the current directory
    config = load_config(path, ["model.n_layers=3"])
    assert config.model.to_dict() == RunConfig.from_dict(raw).model.to_dict() | {"n_layers": 3}
    train(config, tmp_path / "run")
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["model"]["n_layers"] == 3
    mlm = tiny_mlm_config(tmp_path / "cache")
    dstg = load_config(write_config(tmp_path / "mlm.yaml", mlm | {"model": "paper/dstg"}), ["model.n_layers=2"])
    assert dstg.model.to_dict() == load_config(write_config(tmp_path / "whole.yaml", mlm | {
        "model": ready_config("dstg", "paper") | {"n_layers": 2}})).model.to_dict()
    assert load_config(path, ["model=paper/rope_neobert", "model.n_layers=2", "data.kind=mlm"] + [
        f"data.{k}={json.dumps(v)}" for k, v in mlm["data"].items() if k != "kind"]).model.n_layers == 2
    with pytest.raises(ConfigError, match=r"^model: 'models/big.yaml' is neither a mapping of model keys nor a YAML "
                                          r"file \(looked for .*configs/models/big.yaml and models/big.yaml\), nor "
                                          r"a ready config \(quick/dstg, "):
        load_config(write_config(tmp_path / "configs" / "bad.yaml", raw | {"model": "models/big.yaml"}))
    (tmp_path / "configs" / "list.yaml").write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match=r"^train file .*list.yaml must hold a mapping of train keys, got list$"):
        load_config(write_config(tmp_path / "configs" / "bad.yaml", raw | {"train": "list.yaml"}))


def test_dstg_masked_lm_run_on_a_text_source(tmp_path):
    config = RunConfig.from_dict(tiny_mlm_config(tmp_path / "cache"))
    assert config.model.vocab_size == config.data.build(0).vocab_size and not config.model.causal
    final = train(config, tmp_path / "run")
    assert math.isfinite(final["train_loss"]) and final["eval_tokens"] > 0 and 0 <= final["eval_token_accuracy"] <= 1
    _, model = load_run(tmp_path / "run")
    assert type(model).__name__ == "DSTGNeoBertForMaskedLM"


def test_the_readme_text_run_config_trains_on_a_prepared_corpus(tmp_path, monkeypatch):
    """README's run config for text, as written, on a small corpus prepared where it names one."""
    from poslab.data.config import DataConfig
    from poslab.data.preparation import prepare

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "prepared:" in b)
    raw = yaml.safe_load(block)
    monkeypatch.chdir(tmp_path)
    data = tiny_mlm_config(tmp_path / "cache")["data"]
    options = {k: v for k, v in data.items() if k not in ("kind", "masking", "cache_dir")}
    prepare(DataConfig.from_options(options), raw["data"]["prepared"])
    raw["train"] |= {"steps": 2, "warmup_steps": 0, "batch_size": 4, "eval_every": 0}
    final = train(RunConfig.from_dict(raw), tmp_path / "run")
    assert math.isfinite(final["train_loss"]) and load_config(tmp_path / "run" / "config.yaml").model.causal


class _FixedSource:
    """A minimal BatchSource: three fixed evaluation batches, the last without a labelled token (a short
    masked-LM batch can draw no mask): it adds nothing, where its mean loss would be NaN."""
    vocab_size = 11

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.batches = [{"input_ids": torch.randint(0, 11, (3, 7), generator=g),
                         "labels": torch.randint(0, 11, (3, 7), generator=g)} for _ in range(2)]
        self.batches[1]["labels"][:, ::2] = -100
        self.batches.append({"input_ids": self.batches[0]["input_ids"], "labels": torch.full((3, 7), -100)})

    def eval_batches(self, split, batch_size):
        return iter(self.batches)


def test_generic_evaluation_reads_eval_batches_batches():
    raw = tiny_config(eval_batches=1)
    raw["model"].update(vocab_size=11)
    raw["data"] = {"kind": "lm"}
    config, source = RunConfig.from_dict(raw), _FixedSource()
    metrics = evaluate(build_model(config.model), source, config, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    assert metrics["tokens"] == int((source.batches[0]["labels"][:, 1:] != -100).sum())


@pytest.mark.parametrize("arch", ["decoder", "encoder", "sparse encoder"])
def test_generic_evaluation_is_loss_and_accuracy_on_labelled_tokens(arch):
    raw = tiny_config()
    raw["model"].update(arch=arch.split()[-1], vocab_size=11, sparse_prediction="sparse" in arch)
    raw["data"] = {"kind": "lm" if arch == "decoder" else "mlm"}  # not a task source: the generic path
    config = RunConfig.from_dict(raw)
    model, source = build_model(config.model).train(), _FixedSource()
    metrics = evaluate(model, source, config, torch.device("cpu"), torch.autocast("cpu", enabled=False))
    logits = torch.cat([model(input_ids=b["input_ids"]).logits for b in source.batches])
    labels = torch.cat([b["labels"] for b in source.batches])
    if arch == "decoder":
        logits, labels = logits[:, :-1], labels[:, 1:]
    keep = labels != -100
    expected = nn.functional.cross_entropy(logits[keep], labels[keep]).detach()
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["token_accuracy"] == pytest.approx(float((logits.argmax(-1)[keep] == labels[keep]).float().mean()))
    assert metrics["tokens"] == int(keep.sum()) and model.training


def test_a_resume_on_another_evaluation_set_chooses_the_best_checkpoint_again(tmp_path):
    """The best record held only the metric: after a resume with another eval_split or eval_batches, new
    evaluations were compared with a value measured on other data."""
    run = tmp_path / "run"
    first = train(RunConfig.from_dict(tiny_config(steps=4, eval_every=2)), run)
    huge = {"metric": "loss", "value": -1.0, "step": first["best_step"]}  # unbeatable on the same set
    for which in ("last", "best"):
        state_file = run / "checkpoints" / which / ckpt.STATE_FILE
        state = json.loads(state_file.read_text())
        state["best"] = {**huge, "on": state["best"]["on"]}
        state_file.write_text(json.dumps(state))
        ckpt.write_manifest(run / "checkpoints" / which)
    same = train(RunConfig.from_dict(tiny_config(steps=6, eval_every=2)), run, resume=True)
    assert same["best_step"] == first["best_step"]
    # A task's answers are scored on the whole split: the batch settings do not change the set.
    batches = train(RunConfig.from_dict(tiny_config(steps=8, eval_every=2, eval_batches=1, eval_batch_size=3)), run,
                    resume=True)
    assert batches["best_step"] == first["best_step"]
    other = train(RunConfig.from_dict(tiny_config(steps=10, eval_every=2, eval_split="test")), run, resume=True)
    assert other["best_step"] == 10 and other["best_loss"] > 0


@pytest.mark.parametrize("crash_at", [3, 1])
def test_tensorboard_forgets_the_steps_a_resume_redoes(tmp_path, monkeypatch, crash_at):
    """metrics.jsonl is cut back to the checkpoint a crashed run resumes from; TensorBoard's curves must drop
    the abandoned steps too, or they show two values at each redone step. Crashing at 3 resumes from the
    step-2 checkpoint; crashing at 1, before any checkpoint, resumes from step 0."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = RunConfig.from_dict(tiny_config(steps=6, checkpoint_every=2))
    real_step = trainer_module.Trainer._train_step

    def crash(self, step):
        if step == crash_at:
            raise KeyboardInterrupt  # steps logged after the last checkpoint are lost
        return real_step(self, step)

    monkeypatch.setattr(trainer_module.Trainer, "_train_step", crash)
    with pytest.raises(KeyboardInterrupt):
        train(config, tmp_path / "run")
    monkeypatch.undo()
    train(config, tmp_path / "run", resume=True)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == sorted(set(steps)) == list(range(1, 7))


def test_a_finished_run_evaluated_on_another_split_keeps_its_best_checkpoint(tmp_path):
    """Resumed with no step left only to evaluate on the test split, a finished run started the best choice
    again on that split: its final weights replaced checkpoints/best, chosen on the test set, with no record of
    that evaluation in metrics.jsonl. The summary evaluation now only measures."""
    run = tmp_path / "run"
    first = train(RunConfig.from_dict(tiny_config(steps=4, eval_every=1)), run)
    best, records = ckpt.load_trainer_state(run / "checkpoints/best")["best"], (run / "metrics.jsonl").read_text()
    summary = train(RunConfig.from_dict(tiny_config(steps=4, eval_every=1, eval_split="test")), run, resume=True)
    assert ckpt.load_trainer_state(run / "checkpoints/best")["best"] == best
    assert (run / "metrics.jsonl").read_text() == records
    assert summary["best_step"] == first["best_step"] == best["step"]
    assert summary["eval_loss"] != first["eval_loss"]  # measured on the test split


def test_a_run_stopped_between_evaluations_and_ended_at_its_step_gets_its_final_evaluation(tmp_path, monkeypatch):
    """Stopped after step 4 of an evaluation every 3 steps, then resumed with train.steps 4 (as the refusal of a
    lower train.steps says to): its final evaluation was measured but never recorded, while it could still
    choose checkpoints/best. It is recorded now, once: a second resume only measures."""
    run = tmp_path / "run"
    real_step = trainer_module.Trainer._train_step

    def stop(self, step):
        if step == 4:  # the fifth update (steps count from 0 here)
            raise KeyboardInterrupt
        return real_step(self, step)

    monkeypatch.setattr(trainer_module.Trainer, "_train_step", stop)
    with pytest.raises(KeyboardInterrupt):
        train(RunConfig.from_dict(tiny_config(steps=6, eval_every=3, checkpoint_every=1)), run)
    monkeypatch.undo()
    assert ckpt.load_trainer_state(run / "checkpoints/last")["step"] == 4
    ended = RunConfig.from_dict(tiny_config(steps=4, eval_every=3, checkpoint_every=1))
    summary = train(ended, run, resume=True)
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 4] and evals[-1]["eval_loss"] == summary["eval_loss"]
    assert ckpt.load_trainer_state(run / "checkpoints/last")["evaluated"] == 4
    best = ckpt.load_trainer_state(run / "checkpoints/best")["best"]
    assert best["step"] == summary["best_step"] and best["value"] == min(r["eval_loss"] for r in evals)
    records = (run / "metrics.jsonl").read_text()
    train(ended, run, resume=True)
    assert (run / "metrics.jsonl").read_text() == records


def test_a_resume_keeps_the_batch_size(tmp_path):
    """Step s reads the data order from sequence s * batch_size: a resume with another batch size would skip
    or repeat data (a fixed task pool, a text corpus read once), so it is refused in one line."""
    train(RunConfig.from_dict(tiny_config(steps=2, checkpoint_every=1)), tmp_path / "run")
    with pytest.raises(PoslabError, match=r"^cannot resume with train.batch_size 16: the run read its data in "
                                          r"batches of 8, .*--set train.init_from=RUN/checkpoints/last$"):
        train(RunConfig.from_dict(tiny_config(steps=4, batch_size=16)), tmp_path / "run", resume=True)
    assert ckpt.load_trainer_state(tmp_path / "run/checkpoints/last")["step"] == 2


def test_a_resume_keeps_its_start(tmp_path):
    """A resume continues from its checkpoint: a changed init_from was accepted and written to config.yaml,
    which then said the run had been fine-tuned from somewhere it had not."""
    train(RunConfig.from_dict(tiny_config(steps=2, checkpoint_every=1)), tmp_path / "run")
    with pytest.raises(PoslabError, match=r"^cannot resume with train.init_from '.*run': the run started from None"):
        train(RunConfig.from_dict(tiny_config(steps=4, init_from=str(tmp_path / "run"))), tmp_path / "run", resume=True)
    assert "init_from: null" in (tmp_path / "run" / "config.yaml").read_text()
    # A fine-tune resumes from another path to the same weights (an --out moved), not from other weights.
    import shutil

    train(RunConfig.from_dict(tiny_config(steps=2, init_from=str(tmp_path / "run"), checkpoint_every=1)),
          tmp_path / "tuned")
    shutil.copytree(tmp_path / "run", tmp_path / "moved")
    assert train(RunConfig.from_dict(tiny_config(steps=3, init_from=str(tmp_path / "moved"))), tmp_path / "tuned",
                 resume=True)["step"] == 3
    train(RunConfig.from_dict(tiny_config(steps=1) | {"seed": 5}), tmp_path / "other")
    with pytest.raises(PoslabError, match=r"^cannot resume with another train.init_from: the weights of "
                                          r"train.init_from .*other.* are not the weights the run started from"):
        train(RunConfig.from_dict(tiny_config(steps=4, init_from=str(tmp_path / "other"))), tmp_path / "tuned",
              resume=True)


def test_a_terminated_training_says_where_it_can_resume(tmp_path):
    """SIGTERM (batch schedulers, torchrun) killed a run without a word (exit 143), and Ctrl-C said only
    "interrupted": which step the run resumes from, and how, is what the user needs next."""
    import signal
    import subprocess

    config = write_config(tmp_path / "c.yaml", tiny_config(steps=100000, checkpoint_every=2, eval_every=100000,
                                                           log_every=100000))
    out = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-m", "poslab", "train", str(config), "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "last" / "checksums.sha256").exists():
            assert time.monotonic() < deadline and child.poll() is None, child.stderr.read() if child.poll() else ""
            time.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    from poslab.train.checkpoint import saved_step

    step = saved_step(out, log=lambda _: None)  # the intact one, should the signal have met a save
    assert child.returncode == 130 and step > 0
    assert err.splitlines()[-1] == (f"poslab: interrupted; the run in {out} resumes from its checkpoint at step "
                                    f"{step} with --resume")


def ask_to_stop_in_step(number: int, signum: int, patch: Callable[[Any, str, Any], None] = setattr) -> None:
    """From now on, the trainer's stop handler receives ``signum`` inside step ``number`` (0-based), as a signal
    arriving mid-step would. ``patch``: monkeypatch.setattr in a test, setattr in a process of its own."""
    stops, real_step = [], trainer_module.Trainer._train_step

    class Kept(trainer_module.StopBetweenSteps):
        def __init__(self, announce: bool) -> None:
            super().__init__(announce)
            stops.append(self)

    def step(self, step: int):
        if step == number:
            stops[-1]._handle(signum, None)
        return real_step(self, step)

    patch(trainer_module, "StopBetweenSteps", Kept)
    patch(trainer_module.Trainer, "_train_step", step)


def test_a_stop_between_steps_resumes_to_the_run_that_never_stopped(tmp_path, monkeypatch):
    """Stopped after step 3 of 6 and resumed, a run ends on the weights and losses of one trained straight
    through; the stop is requested as the signal handler requests it, in the middle of a step."""
    import signal

    raw = tiny_config(steps=6, checkpoint_every=100, eval_every=100)
    train(RunConfig.from_dict(raw), tmp_path / "straight")
    ask_to_stop_in_step(2, signal.SIGINT, monkeypatch.setattr)
    with pytest.raises(KeyboardInterrupt):
        train(RunConfig.from_dict(raw), tmp_path / "stopped", stop_between_steps=True)
    assert ckpt.saved_step(tmp_path / "stopped", log=lambda _: None) == 3
    assert not (tmp_path / "stopped" / ".lock").exists()
    monkeypatch.undo()
    train(RunConfig.from_dict(raw), tmp_path / "stopped", resume=True)
    assert losses(tmp_path / "stopped") == losses(tmp_path / "straight")
    stopped, straight = (load_file(tmp_path / r / "checkpoints/last/model.safetensors") for r in ("stopped", "straight"))
    assert all(torch.equal(stopped[k], straight[k]) for k in straight)


def test_a_second_ctrl_c_stops_at_once_and_sigterm_meanwhile_is_ignored():
    """A SIGTERM while stopping (a scheduler's, repeated) must not cut the save short; a user pressing Ctrl-C
    again means it."""
    import signal

    from poslab.train.stopping import StopBetweenSteps

    stop = StopBetweenSteps(announce=False)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with stop.armed():
        assert signal.getsignal(signal.SIGINT) == stop._handle == signal.getsignal(signal.SIGTERM)
        stop._handle(signal.SIGTERM, None)
        assert stop.requested == "SIGTERM"
        stop._handle(signal.SIGTERM, None)
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_two_ctrl_cs_in_one_long_step_stop_at_once():
    """Python runs the handler once a long C++ call returns, by when two Ctrl-Cs have merged into one call: the
    second was lost and the step finished anyway. The C-level handler's wakeup bytes (one per signal) count them.
    Here the bytes are written as that handler writes them, and the merged call is made."""
    import os
    import signal

    from poslab.train.stopping import StopBetweenSteps

    outside = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(outside)
    stop = StopBetweenSteps(announce=False)
    with stop.armed():
        wakeup = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup)
        os.write(wakeup, bytes([signal.SIGINT, signal.SIGINT]))
        with pytest.raises(KeyboardInterrupt):
            stop._handle(signal.SIGINT, None)
    again = StopBetweenSteps(announce=False)
    with again.armed():
        wakeup = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup)
        os.write(wakeup, bytes([signal.SIGINT, signal.SIGTERM]))  # a scheduler's SIGTERM right after a Ctrl-C
        again._handle(signal.SIGINT, None)
        again._handle(signal.SIGTERM, None)
        assert again.requested == "SIGINT"
    late = StopBetweenSteps(announce=False)
    with late.armed():  # a Ctrl-C handled before its C-level handler wrote its byte (it ran on another thread)
        late._handle(signal.SIGINT, None)
        wakeup = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(wakeup)
        os.write(wakeup, bytes([signal.SIGINT]))
        late._handle(signal.SIGTERM, None)  # reads the late byte: still the one Ctrl-C, and a SIGTERM never raises
        assert late.requested == "SIGINT"
    assert signal.set_wakeup_fd(outside) == outside  # restored


def test_text_sequences_longer_than_the_model_name_both_settings(tmp_path):
    """A prepared corpus keeps no seq_len of its own, so a text run's data.seq_len defaults to 128 when the run
    config sets none: the refusal said only to raise model.max_seq_len."""
    raw = tiny_mlm_config(tmp_path / "cache")
    raw["model"]["max_seq_len"] = 16
    with pytest.raises(ConfigError, match=r"model.max_seq_len is 16; raise model.max_seq_len or lower data.seq_len "
                                          r"\(now 32\)$"):
        train(RunConfig.from_dict(raw), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_resume_that_changes_train_settings_keeps_their_history(tmp_path, capsys):
    """More steps on resume stretch the cosine schedule from there on, and config.yaml then names only the new
    count: nothing said so, and nothing kept what the first steps ran under."""
    out = tmp_path / "run"
    train(RunConfig.from_dict(tiny_config(steps=4)), out)
    assert not (out / "resumes.jsonl").exists()
    train(RunConfig.from_dict(tiny_config(steps=6)), out, resume=True)
    assert [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()] == [
        {"step": 4, "changed": {"train.steps": [4, 6]}}]
    assert "train settings changed at step 4: train.steps 4 -> 6 (the learning-rate schedule follows the new " \
           "ones from here; resumes.jsonl keeps what config.yaml no longer says)" in capsys.readouterr().err
    train(RunConfig.from_dict(tiny_config(steps=6)), out, resume=True)  # nothing changed: nothing recorded
    assert len((out / "resumes.jsonl").read_text().splitlines()) == 1


def test_the_memory_check_counts_what_the_loss_keeps_of_the_logits(monkeypatch):
    """A batch whose float32 logits alone fit (7.7 of 23 GiB) was killed by the kernel in its first step, with no
    message: the loss keeps their log-softmax for backward, and backward makes their gradient."""
    import types


    raw = tiny_config(batch_size=1000)
    raw["model"]["vocab_size"] = 30000
    config = RunConfig.from_dict(raw)
    logits = 4 * 1000 * 64 * 30000
    process = types.SimpleNamespace(world_size=1, device=torch.device("cpu"))
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(memory.os, "sysconf", lambda name: pages.get(name, int(2.5 * logits) // 4096))
    with pytest.raises(ConfigError, match=r"sequences of 64 tokens \(ids; logits, their log-softmax and gradient: "
                                          r"21\.5 GiB\) need at least .* lower train.batch_size"):
        memory.check_memory(config, process, 64)
    monkeypatch.setattr(memory.os, "sysconf", lambda name: pages.get(name, 4 * logits // 4096))
    memory.check_memory(config, process, 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two torchrun processes on this node: half the memory each
    with pytest.raises(ConfigError, match=r"GiB of cpu \(a share of the node's memory among its 2 processes\)"):
        memory.check_memory(config, process, 64)


def test_the_memory_check_counts_a_whole_evaluation_batch(monkeypatch):
    """Accumulation shrinks a training micro-batch, but every process evaluates whole batches of
    train.eval_batch_size (the global batch by default): at paper scale (512 x 1024 tokens, 50257 words) their
    logits take 147 GiB or more, and the run would have died at its final evaluation, before saving its last steps."""
    import types


    raw = tiny_config(batch_size=1000, grad_accum=8)
    raw["model"]["vocab_size"] = 30000
    logits = 4 * 1000 * 64 * 30000
    process = types.SimpleNamespace(world_size=1, device=torch.device("cpu"))
    pages = {"SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(memory.os, "sysconf", lambda name: pages.get(name, int(2.5 * logits) // 4096))
    memory.check_memory(RunConfig.from_dict(raw | {"train": {**raw["train"], "eval_batch_size": 100}}), process, 64)
    with pytest.raises(ConfigError, match=r"^an evaluation batch of 1,000 sequences of 64 tokens \(ids; logits, a float "
                                          r"copy and their log-softmax: 21\.5 GiB\) .* lower train.eval_batch_size "
                                          r"\(now null, so train.batch_size's 1,000\)$"):
        memory.check_memory(RunConfig.from_dict(raw), process, 64)


def test_a_full_disk_during_a_save_is_one_line_and_leaves_no_half_checkpoint(tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own SafetensorError: the run ended in a traceback and left
    checkpoints/.best.tmp holding only config.json."""
    import shutil

    real_save, real_usage = torch.save, shutil.disk_usage

    def full(obj, f, *args, **kwargs):  # what torch.save raises on a full disk: a short write, no errno
        if "optimizer" in str(f):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(ckpt.torch, "save", full)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: real_usage(path)._replace(free=4096))
    config = write_config(tmp_path / "c.yaml", tiny_config(steps=2))
    assert poslab.cli.main(["train", str(config), "--out", str(tmp_path / "run")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the training's progress lines
    assert last.startswith("poslab: error: no space left on device for checkpoint best (the last intact one is "
                           "kept: free space, then resume with --resume): ")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == []
    # safetensors names the disk in its own error type; with space left, another failure is not called a full disk
    monkeypatch.setattr(ckpt.shutil, "disk_usage", real_usage)
    assert ckpt._disk_full(RuntimeError('IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                                        'device" })'), tmp_path)
    assert not ckpt._disk_full(RuntimeError("unexpected pos 576 vs 534"), tmp_path)
