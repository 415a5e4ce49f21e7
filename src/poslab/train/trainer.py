"""The training loop: one process or many (torchrun), from a RunConfig to a run directory.

    DIR/config.yaml          the resolved run config (vocab size filled in)
    DIR/data.json            the version of the code that made its data   } what its data was:
    DIR/tokenizer/           a text run's tokenizer (AutoTokenizer-loadable) } see provenance.py
    DIR/init.json            a fine-tune's starting weights (train.init_from): checkpoint, step, digest
    DIR/metrics.jsonl        training and evaluation records (see monitor.py)
    DIR/resumes.jsonl        the train settings each resume changed
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
directory (``DIR/.lock``, see lock.py); rundir.py checks that a resume continues the same run.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict

from poslab.errors import CheckpointError, DataError, InputError, PoslabError, require
from poslab.models import build_model
from poslab.train import checkpoint as ckpt
from poslab.train import evaluation
from poslab.train.config import RunConfig
from poslab.train.lock import RunLock, RunLocked
from poslab.train.monitor import METRICS_FILE, Monitor, truncate_metrics
from poslab.train.optim import build_optimizer, build_scheduler
from poslab.train.parallel import Parallel, unwrap
from poslab.train.memory import check_memory
from poslab.train.provenance import check_same_tokenizer_on_every_rank, run_tokenizer, tokenizer_difference
from poslab.train.rundir import (CHECKPOINTS, RESUMES_FILE, changed_train_settings, check_out_dir, checkpoint_exists,
                                 init_out_dir, init_point, load_saved_config)
from poslab.train.stopping import StopBetweenSteps

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
        final = trainer.fit(StopBetweenSteps(announce=parallel.is_main) if stop_between_steps else None)
        parallel.leave_together()  # not on an error: a rank failing alone must not wait for the others
        return final
    finally:
        parallel.close()



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
        check_out_dir(self.out, config, resume, overwrite)
        changed = changed_train_settings(load_saved_config(self.out), config) if resume else {}
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
        check_memory(config, parallel, self.source.max_train_len)
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
            start = init_point(Path(cfg.init_from))
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
        if cfg.activation_checkpointing:  # each block's activations are recomputed in the backward pass
            model.activation_checkpointing_enable()
        if cfg.compile:
            model.compile()
        self.model = parallel.wrap(model, cfg.fsdp)
        self.optimizer = build_optimizer(self.model, cfg, self.device)

        self.step, self.best, self.last_loss, done = 0, None, math.nan, 0
        self.recorded_eval: int | None = None  # the step of the last evaluation recorded in metrics.jsonl
        if last is not None:
            optimizer_state, scheduler_state, rng_states = ckpt.load_states(last)
            _load_moments(self.model, self.optimizer, optimizer_state)
            done = scheduler_state["last_epoch"]
            if parallel.rank < len(rng_states):  # a resume on more ranks keeps the fresh per-rank seeds
                ckpt.set_rng_state(rng_states[parallel.rank], self.device)
            self.step, self.best, self.last_loss = state["step"], state["best"], state["last_loss"]
            # Checkpoints from before this key: taken as evaluated at their step, as they were read then
            self.recorded_eval = state.get("evaluated", self.step)
        self.scheduler = build_scheduler(self.optimizer, cfg, done)
        if resume and checkpoint_exists(self.out / CHECKPOINTS / "best"):  # best may be newer than last: trust its record
            with contextlib.suppress(CheckpointError):
                self.best = ckpt.load_resume_state(ckpt.resolve(self.out / CHECKPOINTS / "best",
                                                               self.notes.append))["best"]
        if parallel.is_main:
            init_out_dir(self.out, config, overwrite, self.tokenizer, init, fresh=last is None)
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
        if not checkpoint_exists(last):
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
        cfg, start_step, recorded_before, started = self.cfg, self.step, self.recorded_eval, time.perf_counter()
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
            # Resuming a finished run evaluates again for the summary only: its final evaluation is recorded, and
            # one on another split (a test set) must not choose the best checkpoint. A run stopped between
            # evaluations and resumed at its step (train.steps lowered to it) gets its final evaluation here.
            if evaluated is not None and evaluated[0] == self.step:
                final = evaluated
            else:
                final = self._evaluate(record=self.recorded_eval != self.step)
            if (self.step > start_step and saved != self.step) or self.recorded_eval != recorded_before:
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
            kept = "no checkpoints/last was written yet" + (" (checkpoints/best holds the best so far)" if
                                                            checkpoint_exists(self.out / CHECKPOINTS / "best") else "")
        raise TrainingDiverged(f"training diverged: {what}; {kept}; lower train.lr or raise train.warmup_steps")

    def _log(self, record: dict[str, float], window: dict[str, float]) -> None:
        if self.monitor is None:
            return
        self.monitor.log_train(self.step, {
            "loss": self.last_loss, "lr": record["lr"], "grad_norm": record["grad_norm"],
            "tokens_per_s": window["tokens"] / window["seconds"],
            "data_fraction": window["data_seconds"] / window["seconds"]})

    def _evaluate(self, record: bool = True) -> tuple[int, dict[str, float]]:
        """(step, metrics) of the current weights; ``record``: logged to metrics.jsonl and a candidate for the
        best checkpoint, else only measured (a finished run's summary)."""
        metrics = evaluation.evaluate(unwrap(self.model), self.source, self.config, self.device, self.autocast)
        # Ranks compute the same numbers, unless a kernel or a mix of GPUs rounds otherwise: then one rank alone
        # would enter the collective _save below and every rank would hang.
        metrics = self.parallel.broadcast(metrics)
        ckpt.crash_point("evaluate")
        if self.monitor is not None and record:
            self.monitor.log_eval(self.step, metrics)
        if metrics.get("tokens") and not math.isfinite(metrics["loss"]):  # finite logits give a finite loss
            self._diverged(f"evaluation loss is {metrics['loss']} at step {self.step}")
        if not record:
            return self.step, metrics
        self.recorded_eval = self.step
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
                                  "evaluated": self.recorded_eval, "world_size": self.parallel.world_size},
                                 self.tokenizer)
        self.parallel.barrier()
        return self.step




def _load_moments(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """AdamW's moments and step counts from a checkpoint, under this config's hyperparameters: loading a state
    dict also restores the saved run's lr, weight decay, betas and eps, which a resume may have changed (and
    config.yaml then records)."""
    groups = [{**{k: v for k, v in own.items() if k != "params"}, "params": saved["params"]}
              for own, saved in zip(optimizer.param_groups, state["param_groups"], strict=True)]
    set_optimizer_state_dict(model, optimizer, {**state, "param_groups": groups}, options=FULL_STATE)



def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
