"""Checkpoint directories: a ``save_pretrained`` model plus everything needed to resume bit-for-bit.

Layout of ``DIR/checkpoints/{last,best}/`` (the file names follow the Hugging Face Trainer's)::

    config.json, model.safetensors    the model, loadable with ``from_pretrained``
    optimizer.pt                       AdamW state, keyed by parameter name (independent of sharding)
    scheduler.pt                       LambdaLR state
    rng_state.pt                       python / numpy / torch (/ CUDA) generator states, one entry per rank
    trainer_state.json                 step (= data position: sources are indexed by step), best metric

Writes are atomic: everything goes to a hidden sibling directory, is fsynced, and is then renamed into
place; the previous checkpoint is moved aside first and deleted only once the new one is in place. If a
crash lands between the two renames, ``resolve`` finds the moved-aside copy.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from transformers.utils import logging as hf_logging

from poslab.errors import CheckpointError

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pt"


def rng_state() -> dict[str, Any]:
    """This process's generator states, as tensors and plain Python values (loadable with weights_only)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    path: Path,
    model: nn.Module,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    rng_states: list[dict[str, Any]],
    trainer_state: dict[str, Any],
) -> None:
    """Write a checkpoint directory atomically (call on one rank). ``model`` is the Hugging Face model whose
    ``save_pretrained`` writes config and weights; ``model_state`` its full (unsharded) state dict."""
    path = Path(path)
    tmp, old = _aside(path, "tmp"), _aside(path, "old")
    if not path.exists() and old.exists():  # a previous save died between its renames: restore that copy
        os.rename(old, path)
    if tmp.exists():  # a previous save died while writing
        shutil.rmtree(tmp)
    with _no_hf_progress_bar():  # a bar per save would bury the training log
        model.save_pretrained(tmp, state_dict=model_state)
    torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
    torch.save(scheduler_state, tmp / SCHEDULER_FILE)
    torch.save(rng_states, tmp / RNG_FILE)
    (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
    for file in tmp.iterdir():
        _fsync(file)
    _fsync(tmp)
    if path.exists():
        if old.exists():
            shutil.rmtree(old)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def resolve(path: Path) -> Path:
    """The complete checkpoint at ``path`` (or its moved-aside copy after an interrupted save)."""
    path = Path(path)
    for candidate in (path, _aside(path, "old")):
        if (candidate / STATE_FILE).is_file():
            return candidate
    raise CheckpointError(f"no checkpoint at {path} (missing {STATE_FILE})")


def load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {Path(path) / STATE_FILE}: {err}") from None


def load_states(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(optimizer state, scheduler state, RNG states per rank) of a checkpoint directory."""
    out = []
    for name in (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE):
        try:
            out.append(torch.load(Path(path) / name, map_location="cpu", weights_only=True))
        except (OSError, RuntimeError, EOFError) as err:
            raise CheckpointError(f"cannot read {Path(path) / name}: {err}") from None
    return tuple(out)


def load_weights(model: nn.Module, path: Path) -> None:
    """Load ``save_pretrained`` safetensors weights (one file or shards) into ``model``, in place.

    ``save_pretrained`` stores a tied matrix once, under one of its names, so a name missing from the
    file is fine when another name of the same parameter was loaded.
    """
    files = sorted(Path(path).glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"no model*.safetensors in {path}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as err:  # safetensors raises its own (unexported) error type for corrupt files
            raise CheckpointError(f"cannot read {file}: {err}") from None
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shape mismatch: the checkpoint belongs to another model
        raise CheckpointError(f"{path} does not fit this model: {str(err).splitlines()[-1].strip()}") from None
    names = defaultdict(set)
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].add(name)
    by_name = {name: group for group in names.values() for name in group}
    missing = [k for k in missing if not (by_name.get(k, set()) & state.keys())]
    if missing or unexpected:
        raise CheckpointError(f"{path} does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")


@contextlib.contextmanager
def _no_hf_progress_bar():
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _aside(path: Path, tag: str) -> Path:
    return path.with_name(f".{path.name}.{tag}")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
