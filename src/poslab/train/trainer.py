"""The training loop: one process or many (torchrun), from a RunConfig to a run directory.

    DIR/config.yaml          the resolved run config (vocab size filled in)
    DIR/data.json            the version of the code that made its data   } what its data was:
    DIR/tokenizer/           a text run's tokenizer (AutoTokenizer-loadable) } see provenance.py
    DIR/init.json            a fine-tune's starting weights (train.init_from): checkpoint, step, digest
    DIR/metrics.jsonl        training and evaluation records (see monitor.py)
    DIR/checkpoints/last     written every train.checkpoint_every steps and at the end
    DIR/checkpoints/best     written whenever the evaluation metric train.best_metric improves
                             (each with checksums and the copy it replaced, see checkpoint.py)
    DIR/.lock                held while a process runs in DIR (see lock.py)

Loss normalisation: the loss of a step is the mean over every labelled target of the global batch, however
the batch is split over ranks and accumulation micro-batches. Each micro-batch's mean loss is weighted by
its share of the global target count (reduced over ranks once per step), so 2 ranks x 2 micro-batches
compute the same gradient as one process with the whole batch, up to float rounding.

Resume is exact: batches are a function of (seed, step), and the checkpoint restores weights, AdamW
moments, the schedule position and every RNG, so on CPU the resumed loss sequence is bitwise the same.
A run killed at any point (tests/test_reliability_crash.py kills it mid-step, mid-evaluation and at every
stage of a checkpoint save) resumes with ``--resume`` to the same final weights and metrics: from the newest
intact checkpoint, or from step 0 when it died before its first one. Under ``poslab train`` Ctrl-C and
SIGTERM stop after the step under way and save it (stopping.py). One process at a time owns a run
directory (``DIR/.lock``, see lock.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
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

from poslab.errors import CheckpointError, ConfigError, DataError, InputError, PoslabError, require
from poslab.files import atomic_write_text
from poslab.models import build_model
from poslab.train import checkpoint as ckpt
from poslab.train import evaluation
from poslab.train.config import RunConfig, load_config
from poslab.train.lock import LOCK_FILE, RunLock, RunLocked
from poslab.train.monitor import METRICS_FILE, Monitor, truncate_metrics
from poslab.train.optim import build_optimizer, build_scheduler
from poslab.train.parallel import Parallel, unwrap
from poslab.train.provenance import (DATA_FILE, TOKENIZER_DIR, check_same_tokenizer_on_every_rank, data_difference,
                                     record_data, run_tokenizer, saved_data_version, tokenizer_difference)
from poslab.train.stopping import StopBetweenSteps

CONFIG_FILE = "config.yaml"
# A fine-tune's starting weights (train.init_from): the checkpoint, its step and its weights' digest. The run's
# config names the start by path only, and the run there can be trained again into other weights.
INIT_FILE = "init.json"
# Train settings a resume changed (config.yaml then holds the new ones): one record per such resume, with its step.
RESUMES_FILE = "resumes.jsonl"
# What a run killed before writing config.yaml leaves (data.json, init.json and the tokenizer go just before it).
OWN_TRANSIENTS = {LOCK_FILE, f".{CONFIG_FILE}.tmp", DATA_FILE, f".{DATA_FILE}.tmp", INIT_FILE, f".{INIT_FILE}.tmp",
                  TOKENIZER_DIR, f".{TOKENIZER_DIR}.tmp"}
CHECKPOINTS = "checkpoints"
MODEL_INPUTS = ("input_ids", "attention_mask", "labels")  # other per-token labels are for probes, not the loss
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


class TrainingDiverged(PoslabError):
    """The loss or gradient norm became NaN or infinite; the last good checkpoint is kept."""


def train(config: RunConfig, out_dir: str | Path, resume: bool = False, overwrite: bool = False,
          stop_between_steps: bool = False) -> dict[str, Any]:
    """Train as ``config`` says and write the run directory; returns the final metrics (see ``Trainer.fit``).

    Under torchrun every process calls this; the process group is created (and destroyed) here unless
    the caller already made one. With ``stop_between_steps`` a SIGINT or SIGTERM during the training steps
    saves checkpoints/last after the step under way and then raises KeyboardInterrupt (see stopping.py).
    """
    parallel = Parallel.setup(config.train.device)
    try:
        trainer = Trainer(config, Path(out_dir), parallel, resume, overwrite)
        return trainer.fit(StopBetweenSteps(announce=parallel.is_main) if stop_between_steps else None)
    finally:
        parallel.close()


def load_run(out_dir: str | Path, which: str | None = None) -> tuple[RunConfig, torch.nn.Module]:
    """(config, model in eval mode) of a run directory; ``which`` is 'best' or 'last' (default: best if any)."""
    return load_run_checkpoint(out_dir, which)[:2]


def load_run_checkpoint(out_dir: str | Path, which: str | None = None
                        ) -> tuple[RunConfig, torch.nn.Module, Path]:
    """``load_run`` and the checkpoint directory it loaded (an intact copy where the named one is damaged)."""
    out_dir = Path(out_dir)
    if not (out_dir / CONFIG_FILE).is_file():
        raise CheckpointError(f"{out_dir} is not a run directory (no {CONFIG_FILE})")
    config = load_saved_config(out_dir)
    names = [which] if which else ["best", "last"]
    problems = []
    for name in names:
        try:  # the model alone: a checkpoint that lost its optimizer state still holds the weights
            path = ckpt.resolve(out_dir / CHECKPOINTS / name, model_only=True)
            break
        except CheckpointError as err:
            problems.append(str(err))
    else:
        raise CheckpointError("; ".join(problems))
    if problems and _exists(out_dir / CHECKPOINTS / names[0]):
        ckpt.warn(f"{problems[0]}; using {path}")
    model = build_model(config.model)
    ckpt.load_weights(model, path)
    return config, model.eval(), path


def load_saved_config(run: Path) -> RunConfig:
    """The config.yaml of run directory ``run``. A key it refuses (from another poslab version, an edit) would
    read as an error in the config the user passed, so the message names this file first (errors in reading
    it name it already)."""
    path = run / CONFIG_FILE
    try:
        return load_config(path)
    except ConfigError as err:
        message = str(err)
        raise ConfigError(message if str(path) in message else f"{path}: {message}") from None


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
        require(not (resume and overwrite), "--resume and --overwrite exclude each other; pick one")
        require(not out_dir.exists() or out_dir.is_dir(), f"output path {out_dir} exists and is not a directory")
        self.notes: list[str] = []  # one-line reports for the log, once the monitor exists
        self.monitor = None
        self.lock = RunLock(out_dir) if parallel.is_main else None
        refused = None
        if self.lock is not None:
            try:
                left_by = self.lock.acquire()
            except RunLocked as err:
                refused = str(err)
            else:
                if left_by:
                    self.notes.append(f"took over {self.lock.path} from {left_by}, which is no longer running")
        refused = parallel.broadcast(refused)  # every rank refuses together, none waits at a barrier
        if refused:
            raise RunLocked(refused)
        try:
            self._open(resume, overwrite)
        except BaseException:
            self.close(remove_created=True)  # a refused run leaves nothing behind, not even the directory
            raise

    def _open(self, resume: bool, overwrite: bool) -> None:
        """Everything is checked and built before the run directory is written (rank 0 writes)."""
        config, cfg, parallel, world = self.config, self.cfg, self.parallel, self.parallel.world_size
        _check_out_dir(self.out, config, resume, overwrite)
        changed = _changed_train_settings(load_saved_config(self.out), config) if resume else {}
        parallel.barrier()  # every rank has looked before rank 0 touches the directory

        self.source = config.data.build(config.seed)
        self.tokenizer = run_tokenizer(config, self.source)  # saved with the run and each checkpoint
        check_same_tokenizer_on_every_rank(parallel, self.source)
        if resume and (difference := tokenizer_difference(self.out, self.source)) is not None:
            raise DataError(f"cannot resume: {difference}; the rest of the run would read tokens numbered otherwise "
                            "than its start, so train it again with --overwrite")
        evaluation.check(config, self.source)
        require(config.model.vocab_size >= self.source.vocab_size,
                f"model.vocab_size ({config.model.vocab_size}) is smaller than the data's vocabulary "
                f"({self.source.vocab_size}); set model.vocab_size: null to take it from the data")
        # The widest batch any step can draw, not the first: a task batch is as wide as its longest problem, and
        # a later step's can be wider, which would stop the run there (and max_seq_len cannot change on resume).
        shorter = "" if config.data.kind == "task" else f" or lower data.seq_len (now {self.source.max_train_len})"
        require(self.source.max_train_len <= config.model.max_seq_len,
                f"the data has training sequences of up to {self.source.max_train_len} tokens but model.max_seq_len "
                f"is {config.model.max_seq_len}; raise model.max_seq_len{shorter}")
        # Before the first batch is drawn: a task source draws a batch of 1e11 problems for hours before memory
        # runs out. Sized by the widest batch, which a later step can draw.
        _check_memory(config, parallel, self.source.max_train_len)
        batch = self.source.train_batch(0, cfg.batch_size, parallel.rank, world)
        _seed_everything(config.seed)  # the same initial weights on every rank
        model = build_model(config.model)
        last = self._resume_point() if resume else None
        init = None
        if last is not None:
            state = ckpt.load_resume_state(last)
            require(cfg.steps >= state["step"],
                    f"cannot resume: train.steps ({cfg.steps}) is below the step {last} was saved at "
                    f"({state['step']}); set train.steps to {state['step']} or more")
            ckpt.load_weights(model, last)
        elif cfg.init_from is not None:
            start = _init_point(Path(cfg.init_from))
            ckpt.load_weights(model, start, same_config=False)
            step = ckpt.load_trainer_state(start)["step"]
            init = {"checkpoint": str(start), "step": step, "weights_sha256": ckpt.weights_digest(start)}
            self.notes.append(f"model weights from {start}, saved at step {step} (train.init_from)")
        if model.can_generate():  # saved with each checkpoint: generate and pipelines stop where the data ends
            model.generation_config.update(**self.source.generation_ids)
        _seed_everything(config.seed + parallel.rank)  # independent dropout masks per rank
        model.to(self.device)
        self.autocast = evaluation.autocast(self.device, cfg.precision)
        self._preflight(model, batch)
        if cfg.compile:
            model.compile()
        self.model = parallel.wrap(model, cfg.fsdp)
        self.optimizer = build_optimizer(self.model, cfg, self.device)

        self.step, self.best, self.last_loss, done = 0, None, math.nan, 0
        if last is not None:
            optimizer_state, scheduler_state, rng_states = ckpt.load_states(last)
            _load_moments(self.model, self.optimizer, optimizer_state)
            done = scheduler_state["last_epoch"]
            if parallel.rank < len(rng_states):  # a resume on more ranks keeps the fresh per-rank seeds
                ckpt.set_rng_state(rng_states[parallel.rank], self.device)
            self.step, self.best, self.last_loss = state["step"], state["best"], state["last_loss"]
        self.scheduler = build_scheduler(self.optimizer, cfg, done)
        if resume and _exists(self.out / CHECKPOINTS / "best"):  # best may be newer than last: trust its record
            with contextlib.suppress(CheckpointError):
                self.best = ckpt.load_resume_state(ckpt.resolve(self.out / CHECKPOINTS / "best",
                                                               self.notes.append))["best"]
        if parallel.is_main:
            _init_out_dir(self.out, config, overwrite, self.tokenizer, init, fresh=last is None)
            if resume:
                truncate_metrics(self.out / METRICS_FILE, self.step)
            if changed:
                with open(self.out / RESUMES_FILE, "a") as f:
                    f.write(json.dumps({"step": self.step, "changed": changed}) + "\n")
                listed = ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())
                self.notes.append(f"train settings changed at step {self.step}: {listed} (the learning-rate schedule "
                                  f"follows the new ones from here; {RESUMES_FILE} keeps what config.yaml no longer "
                                  "says)")
            self.monitor = Monitor(self.out, cfg.steps, self.step, resumed=resume)
            for note in self.notes:
                self.monitor.message(note)
            if last is not None:
                self.monitor.message(f"resumed {self.out} at step {self.step} from {last}")
        parallel.barrier()

    def _preflight(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
        """Forward one sequence of the first training batch and the widest of the evaluation, as training and
        evaluation run them (device, precision, padding), before the run directory is touched: what only a
        forward finds must not cost the run that --overwrite would replace, nor a whole run (attn_backend
        'triton' on a device without it; an evaluation split longer than a learned position table, otherwise
        found by the final evaluation). No gradients, eval mode (no dropout draws): the random state is kept."""
        def forward(rows: dict[str, torch.Tensor]) -> None:
            with torch.no_grad(), self.autocast:
                model(**{k: rows[k][:1].to(self.device) for k in MODEL_INPUTS if k in rows})

        widest = max(evaluation.batches(self.config, self.source), key=lambda b: b["input_ids"].shape[1], default=None)
        was_training = model.training
        model.eval()
        try:
            forward(batch)
            if widest is not None:
                try:
                    forward(widest)
                except InputError as err:
                    raise InputError(f"evaluating train.eval_split '{self.cfg.eval_split}' would fail: {err}") from None
        finally:
            model.train(was_training)

    def _resume_point(self) -> Path | None:
        """The checkpoint to resume from, or None when the run died before writing its first one."""
        from poslab import __version__

        last = self.out / CHECKPOINTS / "last"
        if not _exists(last):
            self.notes.append(f"{self.out} has no checkpoint yet (the run stopped before its first one): "
                              "starting from step 0")
            return None
        last = ckpt.resolve(last, self.notes.append)
        writer = ckpt.load_trainer_state(last).get("poslab_version")
        if writer != __version__:
            self.notes.append(f"{last} was written by poslab {writer}; continuing with poslab {__version__}")
        return last

    def close(self, remove_created: bool = False) -> None:
        """Release the run directory (and the monitor's files). Safe to call more than once."""
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None
        if self.lock is not None:
            self.lock.release(remove_created)

    # ---- the loop ---------------------------------------------------------------------------------------

    def fit(self, stop: StopBetweenSteps | None = None) -> dict[str, Any]:
        """Train to train.steps, then release the run directory. Returns step, train_loss (the last measured),
        seconds (this session's wall time), tokens_per_s (over this session's training steps, evaluation and
        checkpoints excluded), the final evaluation as eval_<metric>, and best_step / best_<metric>.
        A stop requested through ``stop`` saves checkpoints/last and raises KeyboardInterrupt."""
        cfg, start_step, started = self.cfg, self.step, time.perf_counter()
        window = {"tokens": 0, "seconds": 0.0, "data_seconds": 0.0}
        tokens_total, step_seconds, evaluated, saved = 0, 0.0, None, None
        try:
            with stop.armed() if stop is not None else contextlib.nullcontext():
                while self.step < cfg.steps:
                    record = self._train_step(self.step)
                    self.step += 1
                    if record["loss"] is not None:
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
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self.step < cfg.steps:
                        saved = self._save("last")
                    if stop is not None and self.step < cfg.steps and self._stop_requested(stop):
                        if saved != self.step:
                            self._save("last")
                        if self.monitor is not None:
                            by = stop.requested or "a signal to another process"
                            self.monitor.message(f"stopped after step {self.step} by {by}; checkpoints/last holds it")
                        raise KeyboardInterrupt
            # The final weights are evaluated before they are saved: a run never ends on a broken checkpoint.
            # Resuming a finished run evaluates again for the summary, but its record is already in metrics.jsonl.
            final = (evaluated if evaluated is not None and evaluated[0] == self.step
                     else self._evaluate(log=self.step > start_step))
            if self.step > start_step and saved != self.step:
                self._save("last")
        finally:
            self.close()
        seconds = time.perf_counter() - started
        out = {"step": self.step, "train_loss": self.last_loss, "seconds": seconds,
               "tokens_per_s": tokens_total / step_seconds if tokens_total else math.nan}
        out.update({f"eval_{k}": v for k, v in final[1].items()})
        if self.best is not None:
            out.update({"best_step": self.best["step"], f"best_{self.best['metric']}": self.best["value"]})
        return out

    def _stop_requested(self, stop: StopBetweenSteps) -> bool:
        """Whether any rank was asked to stop: they all stop after the same step, since the save is collective
        (a signal sent to every rank, as torchrun's agent sends it on, need not reach them within one step)."""
        asked = torch.tensor(float(stop.requested is not None))
        return bool(self.parallel.sum(asked) > 0) if self.parallel.distributed else bool(asked)

    def _train_step(self, step: int) -> dict[str, float]:
        """One optimizer update from the global batch of ``step`` (0-based)."""
        cfg, par, causal = self.cfg, self.parallel, self.config.model.causal
        t0 = time.perf_counter()
        batch = self.source.train_batch(step, cfg.batch_size, par.rank, par.world_size)
        data_seconds = time.perf_counter() - t0
        inputs = {k: batch[k] for k in MODEL_INPUTS if k in batch}
        micro = [dict(zip(inputs, parts)) for parts in zip(*(v.tensor_split(cfg.grad_accum) for v in inputs.values()))]
        counts = [int((evaluation.targets(mb["labels"], causal) != -100).sum()) for mb in micro]
        total = int(par.sum(torch.tensor(sum(counts))))
        if total == 0:
            return self._skip(step, batch, t0, data_seconds)
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
        ckpt.crash_point("step")
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._diverged(f"loss is {loss} at step {step + 1}" if not math.isfinite(loss)
                           else f"gradient norm is {grad_norm} at step {step + 1}")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": batch["input_ids"].numel() * par.world_size,
                "seconds": time.perf_counter() - t0, "data_seconds": data_seconds}

    def _skip(self, step: int, batch: dict[str, torch.Tensor], t0: float, data_seconds: float) -> dict[str, Any]:
        """A global batch without a labelled token (a short masked-LM batch can draw no mask) has no loss and no
        gradient: the step passes without an update. It still counts, so that the schedule and the data stay
        functions of the step; the optimizer steps with every gradient None, which AdamW leaves alone (and a
        checkpoint saved before the first update keeps it so, see _save)."""
        if self.monitor is not None:
            self.monitor.message(f"step {step + 1}: the batch has no labelled token (all labels are -100); no update")
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        tokens = batch["input_ids"].numel() * self.parallel.world_size
        return {"loss": None, "lr": lr, "grad_norm": 0.0, "tokens": tokens, "seconds": time.perf_counter() - t0,
                "data_seconds": data_seconds}

    def _diverged(self, what: str) -> None:
        last = self.out / CHECKPOINTS / "last"
        try:
            kept = f"the last good checkpoint is {last} (step {ckpt.load_trainer_state(ckpt.resolve(last))['step']})"
        except CheckpointError:
            kept = "no checkpoint was written yet"
        raise TrainingDiverged(f"training diverged: {what}; {kept}; lower train.lr or raise train.warmup_steps")

    def _log(self, record: dict[str, float], window: dict[str, float]) -> None:
        if self.monitor is None:
            return
        self.monitor.log_train(self.step, {
            "loss": self.last_loss, "lr": record["lr"], "grad_norm": record["grad_norm"],
            "tokens_per_s": window["tokens"] / window["seconds"],
            "data_fraction": window["data_seconds"] / window["seconds"]})

    def _evaluate(self, log: bool = True) -> tuple[int, dict[str, float]]:
        metrics = evaluation.evaluate(unwrap(self.model), self.source, self.config, self.device, self.autocast)
        # Ranks compute the same numbers, unless a kernel or a mix of GPUs rounds otherwise: then one rank alone
        # would enter the collective _save below and every rank would hang.
        metrics = self.parallel.broadcast(metrics)
        ckpt.crash_point("evaluate")
        if self.monitor is not None and log:
            self.monitor.log_eval(self.step, metrics)
        if metrics.get("tokens") and not math.isfinite(metrics["loss"]):  # finite logits give a finite loss
            self._diverged(f"evaluation loss is {metrics['loss']} at step {self.step}")
        name, mode = self.cfg.best_metric, self.cfg.best_mode
        value = metrics[name]
        # A resume may change the metric or the evaluation set: a best measured otherwise is not comparable.
        # (Records written before the set was recorded count as this one's.)
        on = evaluation.evaluated_set(self.config)
        best = self.best if self.best is not None and self.best["metric"] == name \
            and self.best.get("on", on) == on else None
        if best is None and self.best is not None and self.monitor is not None:
            self.monitor.message(f"the best checkpoint so far (step {self.best['step']}) was chosen by another "
                                 "metric or evaluation set; this evaluation starts the choice again")
        better = math.isfinite(value) and (best is None or (value < best["value"] if mode == "min"
                                                            else value > best["value"]))
        if better:
            self.best = {"metric": name, "value": value, "step": self.step, "on": on}
            self._save("best")
        return self.step, metrics

    def _save(self, name: str) -> int:
        """Write checkpoints/<name> (a collective: every rank must call it). Returns the step saved."""
        untouched = not self.optimizer.state  # every step so far passed without an update (see _skip)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=FULL_STATE)
        if untouched:
            # get_state_dict filled AdamW's state by a step at lr 0, which counted as step 1: the first real
            # update would then use the bias correction of a second one, and the weights would depend on
            # train.checkpoint_every. Zero moments at step 0 are what a first update starts from.
            for state in (*self.optimizer.state.values(), *optimizer_state["state"].values()):
                if torch.is_tensor(state.get("step")):
                    state["step"].zero_()
        # A step's loss is computed before its update, so an update can leave non-finite weights behind a finite
        # loss: never keep them as the last good checkpoint. (Finite but exploded weights are caught by the
        # evaluation, which always precedes the final save, or by the next step's loss.)
        bad = next((k for k, v in model_state.items() if v.is_floating_point() and not v.isfinite().all()), None)
        bad = self.parallel.broadcast(bad)  # rank 0 holds the full state; every rank must stop together
        if bad is not None:
            self._diverged(f"weight {bad} is not finite after step {self.step}")
        rng_states = self.parallel.gather(ckpt.rng_state(self.device))
        if self.parallel.is_main:
            ckpt.save_checkpoint(self.out / CHECKPOINTS / name, unwrap(self.model), model_state, optimizer_state,
                                 self.scheduler.state_dict(), rng_states,
                                 {"step": self.step, "best": self.best, "last_loss": self.last_loss,
                                  "world_size": self.parallel.world_size}, self.tokenizer)
        self.parallel.barrier()
        return self.step



def _check_memory(config: RunConfig, parallel: Parallel, width: int) -> None:
    """Refuse a run whose weights, gradients, AdamW moments and one batch alone exceed the device's memory:
    building it would fail with an allocator error, or swap the machine to a halt. Counted before anything is
    built; ``width`` is the number of tokens in one sequence of the batch."""
    count, weights, buffers = model_sizes(config.model)
    weights /= parallel.world_size if config.train.fsdp else 1
    rows = config.train.batch_size // parallel.world_size
    batch = 3 * 8 * rows * width  # int64 input_ids, labels and attention_mask of this process's share
    # Every process evaluates whole batches of train.eval_batch_size (default: the global batch, undivided by
    # processes or accumulation): at paper scale their logits alone outgrew a GPU, after the whole training
    eval_rows = config.train.eval_batch_size or config.train.batch_size
    evaluation = 3 * 8 * eval_rows * width
    if not config.model.sparse_prediction:
        # float32 logits of one micro-batch, the log-softmax the loss keeps for backward, and their gradient: a
        # batch whose logits alone fit (7.7 of 23 GiB) was killed by the kernel, with no message, in its first step
        batch += 3 * 4 * (rows // config.train.grad_accum) * width * config.model.vocab_size
        evaluation += 3 * 4 * eval_rows * width * config.model.vocab_size  # logits, their float copy, log-softmax
    # Weights and AdamW moments live throughout; the gradients of a step, the batch's activations and an
    # evaluation's peak at different times, so only the largest counts.
    need = 3 * weights + buffers + max(weights, batch, evaluation)
    state = 4 * weights + buffers
    device = parallel.device
    total = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
             else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    if need > total and 3 * weights + buffers + max(weights, batch) <= total:  # only the evaluation does not fit
        now = config.train.eval_batch_size or f"null, so train.batch_size's {config.train.batch_size:,}"
        raise ConfigError(f"an evaluation batch of {eval_rows:,} sequences of {width} tokens (ids; logits, a float "
                          f"copy and their log-softmax: {evaluation / 2**30:,.1f} GiB) beside the model's {count:,} "
                          f"parameters and AdamW moments needs at least {need / 2**30:,.1f} GiB per process, more "
                          f"than the {total / 2**30:,.1f} GiB of {device}; lower train.eval_batch_size (now {now})")
    require(need <= total, f"the model's {count:,} parameters (weights, gradients, AdamW moments: {state / 2**30:,.1f} "
                           f"GiB) and a batch of {rows:,} sequences of {width} tokens (ids; logits, their log-softmax and "
                           f"gradient: "
                           f"{batch / 2**30:,.1f} GiB) need at least {need / 2**30:,.1f} GiB per process, more than "
                           f"the {total / 2**30:,.1f} GiB of {device}; "
                           + ("lower model.d_model, model.n_layers, model.vocab_size or model.max_seq_len"
                              if state >= batch else "lower train.batch_size (or raise train.grad_accum)"))


def model_sizes(model_config: Any) -> tuple[int, int, int]:
    """(parameter count, parameter bytes, buffer bytes) of the model ``model_config`` builds, from copies of
    one and two layers on the meta device: every layer is alike, and building them all, even there, takes
    hours for 1e8 layers."""
    sizes = []
    for layers in (1, 2):
        try:
            with torch.device("meta"):
                model = build_model(dataclasses.replace(model_config, n_layers=layers))
        except (RuntimeError, TypeError) as err:  # sizes past int64 fail even on the meta device
            if "overflow" not in str(err).lower():
                raise
            raise ConfigError(f"the model is too large to build ({str(err).splitlines()[0]}); lower "
                              "model.d_model, model.n_layers, model.vocab_size or model.max_seq_len") from None
        params = list(model.parameters())
        sizes.append((sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params),
                      sum(b.numel() * b.element_size() for b in model.buffers())))
    one, two = sizes
    return tuple(a + (model_config.n_layers - 1) * (b - a) for a, b in zip(one, two))


def _load_moments(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """AdamW's moments and step counts from a checkpoint, under this config's hyperparameters: loading a state
    dict also restores the saved run's lr, weight decay, betas and eps, which a resume may have changed (and
    config.yaml then records)."""
    groups = [{**{k: v for k, v in own.items() if k != "params"}, "params": saved["params"]}
              for own, saved in zip(optimizer.param_groups, state["param_groups"], strict=True)]
    set_optimizer_state_dict(model, optimizer, {**state, "param_groups": groups}, options=FULL_STATE)


def _init_point(path: Path) -> Path:
    """The checkpoint ``train.init_from`` names: itself, or the last checkpoint of a run directory, which must
    have finished (a run still training has a mid-run checkpoint that would be taken for its result)."""
    run = path if (path / CONFIG_FILE).is_file() else None
    if run is not None:
        path = run / CHECKPOINTS / "last"
    if not _exists(path):
        raise CheckpointError(f"train.init_from: {path} does not exist; name a checkpoint directory or a run "
                              "directory written by `poslab train`")
    path = ckpt.resolve(path)
    if run is not None:
        steps, step = load_saved_config(run).train.steps, ckpt.load_trainer_state(path)["step"]
        if step != steps:
            raise CheckpointError(f"train.init_from: {run} stopped at step {step} of {steps}; finish it with "
                                  f"--resume, or name its checkpoint directory ({path}) to start from that step")
    return path


def init_difference(run: Path, config: RunConfig) -> str | None:
    """How the weights ``config``'s train.init_from names now differ from those the run in ``run`` started from
    (its init.json), or None: also when it does not fine-tune, or when the start is not there or not finished
    (nothing to compare yet: it is trained before the fine-tune is)."""
    if config.train.init_from is None:
        return None
    try:
        saved = json.loads((run / INIT_FILE).read_text())["weights_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"initial weights unknown: no readable {INIT_FILE}, as in runs from before poslab recorded it"
    try:
        start = _init_point(Path(config.train.init_from))
        now = ckpt.weights_digest(start)
    except CheckpointError:
        return None
    # In first_difference's words, so that a refusal reads like one for any other setting.
    return None if now == saved else f"the weights of train.init_from {start} (sha256 {saved[:12]} there, {now[:12]} now)"


def _check_out_dir(out: Path, config: RunConfig, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber, and check that a resumed run is the same run (read-only, on every rank)."""
    if resume:
        if not (out / CONFIG_FILE).is_file():
            raise CheckpointError(f"no checkpoint to resume in {out}: it is not a poslab run directory "
                                  f"(no {CONFIG_FILE})")
        saved = load_saved_config(out)
        _check_same_run(saved, config)
        _check_same_start(out, saved, config)
        if saved_data_version(out) is not None and (difference := data_difference(out, config)) is not None:
            raise ConfigError(f"cannot resume: {difference}; this poslab makes other batches than the run started "
                              "on, so train it again with --overwrite")
    elif any(path.name not in OWN_TRANSIENTS for path in _children(out)):
        require(overwrite, f"output directory {out} is not empty; pass --resume to continue the run in it "
                           "or --overwrite to replace it")
        require((out / CONFIG_FILE).is_file(),
                f"--overwrite refuses to delete {out}: it is not a poslab run directory (no {CONFIG_FILE})")


def _init_out_dir(out: Path, config: RunConfig, overwrite: bool, tokenizer: Any = None,
                  init: dict[str, Any] | None = None, fresh: bool = True) -> None:
    """Called once everything is built, so a config error leaves no directory behind (rank 0 only).
    config.yaml goes first: a run killed later is a run directory that --resume recognises."""
    if overwrite:
        for path in _children(out):
            if path.name == LOCK_FILE:  # the lock stays held (and in place) while the old run goes
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    record_data(out, config, tokenizer)
    if init is not None:
        atomic_write_text(out / INIT_FILE, json.dumps(init, sort_keys=True))
    elif fresh:  # left by a fine-tune killed before its config.yaml: this run starts from other weights
        (out / INIT_FILE).unlink(missing_ok=True)
    atomic_write_text(out / CONFIG_FILE, config.to_yaml())
    (out / CHECKPOINTS).mkdir(exist_ok=True)


def _children(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []


def _exists(checkpoint: Path) -> bool:
    """Whether any copy of a checkpoint (intact or not) is on disk: the run got as far as saving it."""
    return any(path.exists() for path in ckpt.candidates(checkpoint))


def _check_same_run(saved: RunConfig, new: RunConfig) -> None:
    """A resumed run may change train settings (e.g. more steps) but not the seed, model (forward-only
    settings aside), data or batch size."""
    old, cur = saved.to_dict(), new.to_dict()
    old["model"], cur["model"] = ckpt.weights_spec(old["model"]), ckpt.weights_spec(cur["model"])
    for section in ("seed", "model", "data"):
        key = ckpt.first_difference(old[section], cur[section], section)
        if key is not None:
            raise ConfigError(f"cannot resume: {key} differs from the run's config.yaml; resume with that config "
                              "(only train settings may change)")
    # Step s reads sequences s * batch_size onwards of the data order: another size would skip or repeat data.
    require(saved.train.batch_size == new.train.batch_size,
            f"cannot resume with train.batch_size {new.train.batch_size}: the run read its data in batches of "
            f"{saved.train.batch_size}, and another size would skip or repeat part of it; keep it, or start a new "
            "run from its weights with --set train.init_from=RUN/checkpoints/last")


def _changed_train_settings(saved: RunConfig, new: RunConfig) -> dict[str, list[Any]]:
    """``{"train.key": [saved value, new value]}`` for each train setting a resume changes."""
    old, cur = saved.to_dict()["train"], new.to_dict()["train"]
    return {f"train.{key}": [old.get(key), cur.get(key)] for key in sorted(old.keys() | cur.keys())
            if old.get(key) != cur.get(key)}


def _check_same_start(out: Path, saved: RunConfig, new: RunConfig) -> None:
    """A resume continues from its checkpoint, never from init_from: a start named or dropped now would stand in
    config.yaml for weights that did not start there. Another path may name the same start (an --out moved):
    then the weights decide (init.json)."""
    start, now = saved.train.init_from, new.train.init_from
    require((start is None) == (now is None), f"cannot resume with train.init_from {now!r}: the run started from "
            f"{start!r}, and a resume continues from its own checkpoint; keep it, or start a new run with "
            "--set train.init_from=...")
    if now is None or Path(now).resolve() == Path(start).resolve() or not (out / INIT_FILE).is_file():
        return
    if (difference := init_difference(out, new)) is not None:
        raise ConfigError(f"cannot resume with another train.init_from: {difference} are not the weights the run "
                          "started from; keep its train.init_from, or start a new run")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
