"""The training loop: one process or many (torchrun), from a RunConfig to a run directory.

    DIR/config.yaml          the resolved run config (vocab size filled in)
    DIR/metrics.jsonl        training and evaluation records (see monitor.py)
    DIR/checkpoints/last     written every train.checkpoint_every steps and at the end
    DIR/checkpoints/best     written whenever the evaluation metric train.best_metric improves

Loss normalisation: the loss of a step is the mean over every labelled target of the global batch, however
the batch is split over ranks and accumulation micro-batches. Each micro-batch's mean loss is weighted by
its share of the global target count (reduced over ranks once per step), so 2 ranks x 2 micro-batches
compute the same gradient as one process with the whole batch, up to float rounding.

Resume is exact: batches are a function of (seed, step), and the checkpoint restores weights, AdamW
moments, the schedule position and every RNG, so on CPU the resumed loss sequence is bitwise the same.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict

from poslab.errors import CheckpointError, ConfigError, DataError, PoslabError, require
from poslab.models import build_model
from poslab.train import checkpoint as ckpt
from poslab.train.config import RunConfig, load_config
from poslab.train.evaluation import evaluate, targets
from poslab.train.monitor import METRICS_FILE, Monitor, truncate_metrics
from poslab.train.optim import build_optimizer, build_scheduler
from poslab.train.parallel import Parallel, unwrap

CONFIG_FILE = "config.yaml"
CHECKPOINTS = "checkpoints"
MODEL_INPUTS = ("input_ids", "attention_mask", "labels")  # other per-token labels are for probes, not the loss
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class TrainingDiverged(PoslabError):
    """The loss or gradient norm became NaN or infinite; the last good checkpoint is kept."""


def train(config: RunConfig, out_dir: str | Path, resume: bool = False, overwrite: bool = False) -> dict[str, Any]:
    """Train as ``config`` says and write the run directory; returns the final metrics (see ``Trainer.fit``).

    Under torchrun every process calls this; the process group is created (and destroyed) here unless
    the caller already made one.
    """
    parallel = Parallel.setup(config.train.device)
    try:
        return Trainer(config, Path(out_dir), parallel, resume, overwrite).fit()
    finally:
        parallel.close()


def load_run(out_dir: str | Path, which: str | None = None) -> tuple[RunConfig, torch.nn.Module]:
    """(config, model in eval mode) of a run directory; ``which`` is 'best' or 'last' (default: best if any)."""
    out_dir = Path(out_dir)
    if not (out_dir / CONFIG_FILE).is_file():
        raise CheckpointError(f"{out_dir} is not a run directory (no {CONFIG_FILE})")
    config = load_config(out_dir / CONFIG_FILE)
    names = [which] if which else ["best", "last"]
    for name in names:
        with contextlib.suppress(CheckpointError):
            path = ckpt.resolve(out_dir / CHECKPOINTS / name)
            break
    else:
        raise CheckpointError(f"no checkpoint {' or '.join(names)} in {out_dir / CHECKPOINTS}")
    model = build_model(config.model)
    ckpt.load_weights(model, path)
    return config, model.eval()


class Trainer:
    def __init__(self, config: RunConfig, out_dir: Path, parallel: Parallel, resume: bool, overwrite: bool) -> None:
        cfg = config.train
        self.config, self.cfg, self.out, self.parallel = config, cfg, out_dir, parallel
        self.device = parallel.device
        world = parallel.world_size
        require(cfg.batch_size % (world * cfg.grad_accum) == 0,
                f"train.batch_size ({cfg.batch_size}) must be divisible by processes x train.grad_accum "
                f"({world} x {cfg.grad_accum})")
        require(world > 1 or not cfg.fsdp, "train.fsdp shards the model over several processes: launch with "
                                           "torchrun --nproc_per_node N, or set train.fsdp: false")
        _check_out_dir(out_dir, config, resume, overwrite)
        parallel.barrier()  # every rank has looked before rank 0 touches the directory

        self.source = config.data.build(config.seed)
        require(config.model.vocab_size >= self.source.vocab_size,
                f"model.vocab_size ({config.model.vocab_size}) is smaller than the data's vocabulary "
                f"({self.source.vocab_size}); set model.vocab_size: null to take it from the data")
        self._check_width(self.source.train_batch(0, cfg.batch_size, parallel.rank, world))  # before writing
        _seed_everything(config.seed)  # the same initial weights on every rank
        model = build_model(config.model)
        last = self.out / CHECKPOINTS / "last"
        state = None
        if resume:
            last = ckpt.resolve(last)
            state = ckpt.load_trainer_state(last)
            ckpt.load_weights(model, last)
        _seed_everything(config.seed + parallel.rank)  # independent dropout masks per rank
        model.to(self.device)
        if cfg.compile:
            model.compile()
        self.model = parallel.wrap(model, cfg.fsdp)
        self.optimizer = build_optimizer(self.model, cfg, self.device)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        precision = {"auto": "bf16" if self.device.type == "cuda" else "fp32"}.get(cfg.precision, cfg.precision)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if precision == "bf16"
                         else contextlib.nullcontext())

        self.step, self.best, self.last_loss = 0, None, math.nan
        if state is not None:
            optimizer_state, scheduler_state, rng_states = ckpt.load_states(last)
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=FULL_STATE)
            self.scheduler.load_state_dict(scheduler_state)
            if parallel.rank < len(rng_states):  # a resume on more ranks keeps the fresh per-rank seeds
                ckpt.set_rng_state(rng_states[parallel.rank])
            self.step, self.best, self.last_loss = state["step"], state["best"], state["last_loss"]
            with contextlib.suppress(CheckpointError):  # best may be newer than last: trust its own record
                self.best = ckpt.load_trainer_state(ckpt.resolve(self.out / CHECKPOINTS / "best"))["best"]
        self.monitor = None
        if parallel.is_main:
            _init_out_dir(out_dir, config, overwrite)
            if resume:
                truncate_metrics(self.out / METRICS_FILE, self.step)
            self.monitor = Monitor(self.out, cfg.steps, self.step)
            if resume:
                self.monitor.message(f"resumed {self.out} at step {self.step} from {last}")
        parallel.barrier()

    # ---- the loop ---------------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train to train.steps. Returns step, train_loss (of the last step), seconds (this session's wall time),
        tokens_per_s (over this session's training steps, evaluation and checkpoints excluded), the final
        evaluation as eval_<metric>, and best_step / best_<metric>."""
        cfg, start_step, started = self.cfg, self.step, time.perf_counter()
        window = {"tokens": 0, "seconds": 0.0, "data_seconds": 0.0}
        tokens_total, step_seconds, evaluated, saved = 0, 0.0, None, None
        try:
            while self.step < cfg.steps:
                record = self._train_step(self.step)
                self.step += 1
                self.last_loss = record["loss"]
                tokens_total += record["tokens"]
                step_seconds += record["seconds"]
                for key in window:
                    window[key] += record[key]
                if self.monitor is not None:
                    self.monitor.step(self.step)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    self._log(record, window)
                    window = dict.fromkeys(window, 0)
                if cfg.eval_every and self.step % cfg.eval_every == 0:
                    evaluated = self._evaluate()
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    saved = self._save("last")
            final = evaluated if evaluated is not None and evaluated[0] == self.step else self._evaluate()
            if self.step > start_step and saved != self.step:
                self._save("last")
        finally:
            if self.monitor is not None:
                self.monitor.close()
        seconds = time.perf_counter() - started
        out = {"step": self.step, "train_loss": self.last_loss, "seconds": seconds,
               "tokens_per_s": tokens_total / step_seconds if tokens_total else math.nan}
        out.update({f"eval_{k}": v for k, v in final[1].items()})
        if self.best is not None:
            out.update({"best_step": self.best["step"], f"best_{self.best['metric']}": self.best["value"]})
        return out

    def _train_step(self, step: int) -> dict[str, float]:
        """One optimizer update from the global batch of ``step`` (0-based)."""
        cfg, par, causal = self.cfg, self.parallel, self.config.model.causal
        t0 = time.perf_counter()
        batch = self.source.train_batch(step, cfg.batch_size, par.rank, par.world_size)
        data_seconds = time.perf_counter() - t0
        self._check_width(batch)
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        micro = [dict(zip(inputs, parts)) for parts in zip(*(v.tensor_split(cfg.grad_accum) for v in inputs.values()))]
        counts = [int((targets(mb["labels"], causal) != -100).sum()) for mb in micro]
        total = int(par.sum(torch.tensor(sum(counts))))
        if total == 0:
            raise DataError(f"the training batch of step {step + 1} has no labelled token (all labels are -100)")
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, mb in enumerate(micro):
            mb = {k: v.to(self.device, non_blocking=True) for k, v in mb.items()}
            with par.accumulate(self.model, sync=i == len(micro) - 1):
                with self.autocast:
                    out = self.model(**mb)
                # A micro-batch without targets has a NaN mean loss; it still joins the backward so that
                # DDP/FSDP see the same collectives on every rank.
                share = counts[i] * par.world_size / total
                (out.loss * share if counts[i] else out.logits.sum() * 0.0).backward()
            if counts[i]:
                loss_sum += out.loss.detach().double() * counts[i]
        loss = float(par.sum(loss_sum)) / total
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf  # inf: measure the norm, scale by exactly 1
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._diverged(step + 1, "loss" if not math.isfinite(loss) else "gradient norm",
                           loss if not math.isfinite(loss) else grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": batch["input_ids"].numel() * par.world_size,
                "seconds": time.perf_counter() - t0, "data_seconds": data_seconds}

    def _check_width(self, batch: dict[str, torch.Tensor]) -> None:
        width = batch["input_ids"].shape[1]
        if width > self.config.model.max_seq_len:
            raise ConfigError(f"the data has sequences of {width} tokens but model.max_seq_len is "
                              f"{self.config.model.max_seq_len}; raise model.max_seq_len")

    def _diverged(self, step: int, what: str, value: float) -> None:
        last = self.out / CHECKPOINTS / "last"
        try:
            kept = f"the last good checkpoint is {last} (step {ckpt.load_trainer_state(ckpt.resolve(last))['step']})"
        except CheckpointError:
            kept = "no checkpoint was written yet"
        raise TrainingDiverged(f"training diverged: {what} is {value} at step {step}; {kept}; "
                               "lower train.lr or raise train.warmup_steps")

    def _log(self, record: dict[str, float], window: dict[str, float]) -> None:
        if self.monitor is None:
            return
        self.monitor.log_train(self.step, {
            "loss": record["loss"], "lr": record["lr"], "grad_norm": record["grad_norm"],
            "tokens_per_s": window["tokens"] / window["seconds"],
            "data_fraction": window["data_seconds"] / window["seconds"]})

    def _evaluate(self) -> tuple[int, dict[str, float]]:
        metrics = evaluate(unwrap(self.model), self.source, self.config, self.device, self.autocast)
        if self.monitor is not None:
            self.monitor.log_eval(self.step, metrics)
        name, mode = self.cfg.best_metric, self.cfg.best_mode
        if name not in metrics:
            raise ConfigError(f"train.best_metric '{name}' is not an evaluation metric here "
                              f"(available: {', '.join(metrics)})")
        value = metrics[name]
        best = self.best if self.best is not None and self.best["metric"] == name else None  # metric changed
        better = math.isfinite(value) and (best is None or (value < best["value"] if mode == "min"
                                                            else value > best["value"]))
        if better:
            self.best = {"metric": name, "value": value, "step": self.step}
            self._save("best")
        return self.step, metrics

    def _save(self, name: str) -> int:
        """Write checkpoints/<name> (a collective: every rank must call it). Returns the step saved."""
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=FULL_STATE)
        rng_states = self.parallel.gather(ckpt.rng_state())
        if self.parallel.is_main:
            ckpt.save_checkpoint(self.out / CHECKPOINTS / name, unwrap(self.model), model_state, optimizer_state,
                                 self.scheduler.state_dict(), rng_states,
                                 {"step": self.step, "best": self.best, "last_loss": self.last_loss,
                                  "world_size": self.parallel.world_size})
        self.parallel.barrier()
        return self.step



def _check_out_dir(out: Path, config: RunConfig, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber, and check that a resumed run is the same run (read-only, on every rank)."""
    require(not (resume and overwrite), "--resume and --overwrite exclude each other; pick one")
    require(not out.exists() or out.is_dir(), f"output path {out} exists and is not a directory")
    if resume:
        ckpt.resolve(out / CHECKPOINTS / "last")
        _check_same_run(load_config(out / CONFIG_FILE), config)
    elif out.exists() and any(out.iterdir()):
        require(overwrite, f"output directory {out} is not empty; pass --resume to continue the run in it "
                           "or --overwrite to replace it")
        require((out / CONFIG_FILE).is_file(),
                f"--overwrite refuses to delete {out}: it is not a poslab run directory (no {CONFIG_FILE})")


def _init_out_dir(out: Path, config: RunConfig, overwrite: bool) -> None:
    """Called once everything is built, so a config error leaves no directory behind (rank 0 only)."""
    if overwrite and out.exists():
        shutil.rmtree(out)
    (out / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    tmp = out / f".{CONFIG_FILE}.tmp"
    tmp.write_text(config.to_yaml())
    os.replace(tmp, out / CONFIG_FILE)


def _check_same_run(saved: RunConfig, new: RunConfig) -> None:
    """A resumed run may change train settings (e.g. more steps) but not the seed, model or data."""
    old, cur = saved.to_dict(), new.to_dict()
    for section in ("seed", "model", "data"):
        key = _first_difference(old[section], cur[section], section)
        if key is not None:
            raise ConfigError(f"cannot resume: {key} differs from the run's config.yaml; resume with that config "
                              "(only train settings may change)")


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            diff = _first_difference(a.get(key), b.get(key), f"{path}.{key}")
            if diff is not None:
                return diff
        return None
    return None if a == b else f"{path} ({a!r} there, {b!r} now)"


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
