"""What every recipe needs: train a run unless it already finished, and read its numbers back."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from poslab.train import RunConfig, train
from poslab.train.checkpoint import first_difference, saved_step, weights_spec
from poslab.train.parallel import launched_as_rank_zero
from poslab.train.provenance import data_difference
from poslab.train.rundir import init_difference, load_saved_config
from poslab.errors import PoslabError

FINAL = "final.json"
# Settings a finished run may differ in and still be reused: paths (an --out moved elsewhere) and bookkeeping.
REUSABLE = {"data": ("cache_dir",), "train": ("init_from", "log_every", "checkpoint_every", "device", "compile")}


def rel(path: Path | str, recipe_dir: Path) -> str:
    """A figure's path relative to the reproduction directory (the parent of a recipe's directory)."""
    return os.path.relpath(path, recipe_dir.parent)


def finished(cfg: RunConfig, out: Path) -> dict[str, Any] | None:
    """The final metrics of a run in ``out`` that trained all of ``cfg``'s steps, else None. A run trained
    under other settings, finished or not, is refused (PoslabError): reused, its numbers would be reported as
    this config's; resumed, it would go on under a schedule it did not start with (or fail to: a recipe that
    now trains fewer steps than the run has)."""
    if (out / "config.yaml").exists() and (difference := trained_otherwise(cfg, out)) is not None:
        raise PoslabError(f"{_stale(out, difference)} than this version of the recipe uses; delete it to train it "
                          "again, or reproduce into another --out")
    final = out / FINAL
    if final.exists():
        try:
            metrics = json.loads(final.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # damaged: a resume from the run's last checkpoint writes it again
        if isinstance(metrics, dict) and metrics.get("step") == cfg.train.steps:
            return metrics
    return None


def trained_otherwise(cfg: RunConfig, out: Path) -> str | None:
    """The first setting where the run in ``out`` (its config.yaml) differs from ``cfg``, or where the data it
    was trained on (its data.json) differs from what ``cfg`` gives with this poslab, or where the weights it
    fine-tuned from (its init.json) differ from those its train.init_from holds now, or None."""
    def comparable(config: RunConfig) -> dict[str, Any]:
        raw = config.to_dict()
        raw["model"] = weights_spec(raw["model"])
        for section, keys in REUSABLE.items():
            raw[section] = {k: v for k, v in raw[section].items() if k not in keys}
        return raw
    difference = first_difference(comparable(load_saved_config(out)), comparable(cfg), "run")
    return difference or data_difference(out, cfg) or init_difference(out, cfg)


def first_trained_otherwise(runs: dict[Any, tuple[dict[str, Any], Path]]) -> str | None:
    """Why the first of ``runs`` (name -> (config, out)) that was trained with other settings cannot be reused
    ("out (setting ...)"), or None. Reads only the runs' config.yaml files: a vocabulary the config leaves to
    the data is the one the run's own tokenizer reached, so no corpus is prepared."""
    for config, out in runs.values():
        if not (out / "config.yaml").is_file():
            continue
        model = config["model"]
        if model.get("vocab_size") is None:
            model = {**model, "vocab_size": load_saved_config(out).model.vocab_size}
        if (difference := trained_otherwise(RunConfig.from_dict({**config, "model": model}), out)) is not None:
            return _stale(out, difference)
    return None


def _stale(out: Path, difference: str) -> str:
    return f"{out} was trained with other settings ({difference})"


def ensure_run(config: dict[str, Any], out: Path, log: Callable[[str], None],
               stop_between_steps: bool = False) -> dict[str, Any]:
    """Train ``config`` into ``out`` and return its final metrics. A finished run is not trained again
    (its metrics come from out/final.json); an interrupted one resumes from its last checkpoint.
    ``stop_between_steps``: Ctrl-C or SIGTERM saves the step under way first (poslab.train.stopping); not in
    a worker process, which must stay deaf to the terminal's Ctrl-C."""
    cfg = RunConfig.from_dict(config)
    metrics, resume, exists = _rank_zero_view(lambda: _state(cfg, out))
    if metrics is not None:
        return metrics
    log(f"  training {out.name}: {cfg.model.to_dict().get('positional', {}).get('name', cfg.model.to_dict()['arch'])}"
        f", {cfg.train.steps} steps")
    metrics = train(cfg, out, resume=resume, overwrite=not resume and exists, stop_between_steps=stop_between_steps)
    if launched_as_rank_zero():  # under torchrun, one writer
        tmp = out / f".{FINAL}.tmp"
        tmp.write_text(json.dumps(metrics, default=float))
        tmp.replace(out / FINAL)
    return metrics


def _state(cfg: RunConfig, out: Path) -> tuple[dict[str, Any] | None, bool, bool]:
    """(final metrics if finished, whether a checkpoint to resume exists, whether ``out`` exists)."""
    return finished(cfg, out), saved_step(out) > 0, out.exists()


def _rank_zero_view(look: Callable[[], Any]) -> Any:
    """``look()`` as rank 0 sees it, on every rank. Under torchrun the ranks must agree on whether to train
    and how (a rank looking after rank 0 created the directory would see another state and deadlock). A
    PoslabError in rank 0's look is raised on every rank: the others would otherwise wait for its answer."""
    if not (dist.is_available() and dist.is_initialized()):
        return look()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", look())]
        except PoslabError as err:
            box = [("error", str(err))]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise PoslabError(value)
    return value


def ensure_runs(runs: dict[Any, tuple[dict[str, Any], Path]], log: Callable[[str], None],
                jobs: int = 1) -> dict[Any, dict[str, Any]]:
    """``ensure_run`` for each named (config, out), up to ``jobs`` at a time, and their final metrics by name.

    Small CPU models gain little from intra-op threads, so independent trainings side by side, each in its
    own process with a share of this process's torch threads, use the cores better than one after another:
    with ``jobs`` > 1 the runs train ahead (``train_ahead``) and this waits for them; runs that an enclosing
    ``train_ahead`` started are waited for, not trained again. Fine-tunes, and every run under torchrun (where
    all ranks train each run together), train here, one after another, once the others are done.
    """
    with train_ahead([runs], jobs, log), _worker_death_explained():
        done = {name: _ahead[key].result() for name, (_, out) in runs.items() if (key := out.resolve()) in _ahead}
    return {name: done[name] if name in done else ensure_run(config, out, log, stop_between_steps=True)
            for name, (config, out) in runs.items()}


# Trainings started ahead of their recipe, by resolved run directory (see train_ahead): recipes can share one.
_ahead: dict[Path, Future] = {}


@contextlib.contextmanager
def train_ahead(recipes: list[dict[Any, tuple[dict[str, Any], Path]]], jobs: int, log: Callable[[str], None]):
    """Within the block, ``jobs`` worker processes train every unfinished run of ``recipes`` (each recipe's runs,
    name -> (config, out)), in the order given; ``ensure_runs`` then waits for a recipe's runs instead of
    training them. So while this process analyses one recipe's models, the workers train the next recipe's,
    and no core idles between recipes. Fine-tunes (train.init_from) are left to their recipe, which trains
    them once their start is there. Nothing starts ahead with ``jobs`` 1 or under torchrun. A run's progress
    goes to its directory + ".log" (interleaved bars would be unreadable).

    A recipe's corpus is prepared here, in this process, once the runs before it are queued: while the
    workers already train those. (RunConfig.from_dict prepares it when the vocabulary comes from the data, so
    a corpus that runs share is prepared once, before a worker needs it.)"""
    if jobs <= 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        yield
        return
    threads = max(1, torch.get_num_threads() // jobs)
    started = []
    try:
        with closing_pool(worker_pool(jobs)) as pool:
            with _worker_death_explained():
                for runs in recipes:
                    for config, out in runs.values():
                        if out.resolve() in _ahead or config["train"].get("init_from") or \
                                finished(RunConfig.from_dict(config), out) is not None:
                            continue
                        if not started:
                            log(f"training in {jobs} worker processes (each run's progress: <run directory>.log)")
                        _ahead[out.resolve()] = _submit_deaf_to_interrupts(pool, _ensure_run_in_worker, config,
                                                                           out, threads)
                        started.append(out.resolve())
            yield
    finally:
        for out in started:
            _ahead.pop(out, None)


@contextlib.contextmanager
def closing_pool(pool: ProcessPoolExecutor):
    """``pool`` for the block; then shut down. After a failure or an interrupt its workers are killed, not
    waited for: they may be minutes into trainings that nothing will read now (an interrupted training resumes
    from its last checkpoint), and a worker still waiting for work when the interpreter exits would hang it."""
    try:
        yield pool
    except BaseException:
        for process in list((getattr(pool, "_processes", None) or {}).values()):  # no public API before 3.14
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


@contextlib.contextmanager
def _worker_death_explained():
    try:
        yield
    except BrokenProcessPool:
        raise PoslabError("a training worker process died (killed by the system: out of memory?); rerun to resume "
                          "the unfinished trainings, with a lower --jobs if memory ran out") from None


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """Spawned workers that exit with this process. A reproduction killed alone (SIGTERM to its pid, not its
    process group) never reaches its ``pool.shutdown``: its workers went on training into --out and then
    idled forever."""
    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(os.getpid(),))


def _submit_deaf_to_interrupts(pool: ProcessPoolExecutor, *task: Any) -> Future:
    """``pool.submit(*task)`` with SIGINT ignored while the submission may spawn a worker: an ignored signal stays
    ignored across exec, so the Ctrl-C that reaches the whole process group stops only this process, which
    then ends the workers (``closing_pool``). Workers caught by it while still importing printed a traceback
    each."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return pool.submit(*task)
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_worker(parent: int) -> None:
    keep_freed_memory()
    _exit_with_parent(parent)


# glibc's mallopt parameters (malloc.h) and the values the workers use: blocks up to 32 MiB come from the heap,
# which keeps up to 1 GiB of freed memory and grows 64 MiB at a time.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
KEPT_MEMORY = ((M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20))


def keep_freed_memory() -> bool:
    """Make glibc keep what a training step frees for the next step, where by default it unmaps large blocks
    and trims the heap, and every step faults the same pages in again: 15-16k page faults per step of the quick
    PoPE LM, ~3k of DSTG's (benchmarks/train_memory.py, BENCHMARKS.md). The trained numbers do not change. For
    processes that train small models one step after another (the reproduction's workers); False where the C
    library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return all(mallopt(option, value) == 1 for option, value in KEPT_MEMORY)


def _exit_with_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:  # an orphan is adopted by init (or a subreaper): another parent
            time.sleep(0.5)
        os._exit(1)  # at once: what the worker was writing is a checkpoint in progress, which resume handles
    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _ensure_run_in_worker(config: dict[str, Any], out: Path, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{out}.log", "a") as stream, contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        return ensure_run(config, out, print)
