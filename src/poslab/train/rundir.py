"""A run directory (its layout: trainer.py): how one is read back, and the checks that keep one run per
directory: nothing is clobbered, and a resume continues the same run, from the same start, on the same data."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from poslab.errors import CheckpointError, ConfigError, require
from poslab.files import atomic_write_text
from poslab.models import build_model
from poslab.train import checkpoint as ckpt
from poslab.train.config import RunConfig, load_config
from poslab.train.lock import LOCK_FILE
from poslab.train.provenance import DATA_FILE, TOKENIZER_DIR, data_difference, record_data, saved_data_version

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


def load_run(out_dir: str | Path, which: str | None = None) -> tuple[RunConfig, torch.nn.Module]:
    """(config, model in eval mode) of a run directory; ``which`` is 'best' or 'last' (default: best if any)."""
    return load_run_checkpoint(out_dir, which)[:2]


def load_run_checkpoint(out_dir: str | Path, which: str | None = None
                        ) -> tuple[RunConfig, torch.nn.Module, Path]:
    """``load_run`` and the checkpoint directory it loaded (an intact copy where the named one is damaged)."""
    out_dir = Path(out_dir)
    if not (out_dir / CONFIG_FILE).is_file():
        raise CheckpointError(f"{out_dir} is not a run directory (no {CONFIG_FILE}); pass the --out directory of "
                              "`poslab train`")
    config = load_saved_config(out_dir)
    names = [which] if which else ["best", "last"]
    problems = []
    for name in names:
        try:  # the model alone: a checkpoint that lost its optimizer state still holds the weights
            path = ckpt.resolve(out_dir / CHECKPOINTS / name, model_only=True)
            break
        except CheckpointError as err:
            problems.append(str(err))
    else:  # what each checkpoint lacks, and what to do: a run that never saved one has no weights to read
        raise CheckpointError("; ".join(problems) + "; train the run (or resume it) until it saves a checkpoint")
    if problems and checkpoint_exists(out_dir / CHECKPOINTS / names[0]):
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

def init_point(path: Path) -> Path:
    """The checkpoint ``train.init_from`` names: itself, or the last checkpoint of a run directory, which must
    have finished (a run still training has a mid-run checkpoint that would be taken for its result)."""
    run = path if (path / CONFIG_FILE).is_file() else None
    if run is not None:
        path = run / CHECKPOINTS / "last"
    if not checkpoint_exists(path):
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
        start = init_point(Path(config.train.init_from))
        now = ckpt.weights_digest(start)
    except CheckpointError:
        return None
    # In first_difference's words, so that a refusal reads like one for any other setting.
    return None if now == saved else f"the weights of train.init_from {start} (sha256 {saved[:12]} there, {now[:12]} now)"


def check_out_dir(out: Path, config: RunConfig, resume: bool, overwrite: bool) -> None:
    """Refuse to clobber, and check that a resumed run is the same run (read-only, on every rank)."""
    if resume:
        if not (out / CONFIG_FILE).is_file():
            raise CheckpointError(f"no checkpoint to resume in {out}: it is not a poslab run directory "
                                  f"(no {CONFIG_FILE})")
        saved = load_saved_config(out)
        check_same_run(saved, config)
        check_same_start(out, saved, config)
        if saved_data_version(out) is not None and (difference := data_difference(out, config)) is not None:
            raise ConfigError(f"cannot resume: {difference}; this poslab makes other batches than the run started "
                              "on, so train it again with --overwrite")
    elif any(path.name not in OWN_TRANSIENTS for path in children(out)):
        require(overwrite, f"output directory {out} is not empty; pass --resume to continue the run in it "
                           "or --overwrite to replace it")
        require((out / CONFIG_FILE).is_file(),
                f"--overwrite refuses to delete {out}: it is not a poslab run directory (no {CONFIG_FILE})")


def init_out_dir(out: Path, config: RunConfig, overwrite: bool, tokenizer: Any = None,
                  init: dict[str, Any] | None = None, fresh: bool = True) -> None:
    """Called once everything is built, so a config error leaves no directory behind (rank 0 only).
    config.yaml goes first: a run killed later is a run directory that --resume recognises."""
    if overwrite:
        for path in children(out):
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


def children(directory: Path) -> list[Path]:
    return list(directory.iterdir()) if directory.is_dir() else []


def checkpoint_exists(checkpoint: Path) -> bool:
    """Whether any copy of a checkpoint (intact or not) is on disk: the run got as far as saving it."""
    return any(path.exists() for path in ckpt.candidates(checkpoint))


def check_same_run(saved: RunConfig, new: RunConfig) -> None:
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


def changed_train_settings(saved: RunConfig, new: RunConfig) -> dict[str, list[Any]]:
    """``{"train.key": [saved value, new value]}`` for each train setting a resume changes."""
    old, cur = saved.to_dict()["train"], new.to_dict()["train"]
    return {f"train.{key}": [old.get(key), cur.get(key)] for key in sorted(old.keys() | cur.keys())
            if old.get(key) != cur.get(key)}


def check_same_start(out: Path, saved: RunConfig, new: RunConfig) -> None:
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

