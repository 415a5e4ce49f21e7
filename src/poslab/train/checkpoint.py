"""Checkpoint directories: a ``save_pretrained`` model plus everything needed to resume bit-for-bit.

Layout of ``DIR/checkpoints/{last,best}/`` (the file names follow the Hugging Face Trainer's)::

    config.json, model.safetensors    the model, loadable with ``from_pretrained``
    optimizer.pt                       AdamW state, keyed by parameter name (independent of sharding)
    scheduler.pt                       LambdaLR state
    rng_state.pt                       python / numpy / torch (/ CUDA) generator states, one entry per rank
    trainer_state.json                 step (= data position: sources are indexed by step), best metric,
                                       and the checkpoint format, poslab version and model type
    checksums.sha256                   sha256 of every other file (``sha256sum -c checksums.sha256``)
    previous/                          the checkpoint this one replaced, same layout

Integrity: the checksum file is written last and lists every file of the directory, so a torn, truncated
or bit-flipped checkpoint fails ``verify``. ``resolve`` verifies before anything is loaded and falls back
to ``previous`` (reporting why in one line), so one bad checkpoint costs ``checkpoint_every`` steps, not
the run.

Atomicity: a save writes a hidden sibling ``.NAME.tmp`` and fsyncs it, then drops ``NAME/previous``,
moves ``NAME`` aside to ``.NAME.old``, renames the new one in and tucks the old one in as its
``previous``. At every instant one of ``NAME``, ``NAME/previous``, ``.NAME.old`` or a fully written
``.NAME.tmp`` is complete (the last one matters when ``NAME`` was damaged: its ``previous``, the intact copy, is
what the rotation drops), and the next save finishes whatever an interrupted one left.

Test seam: ``crash_point`` lets crash tests kill the process at a named point (see its docstring).
"""
from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import json
import os
import random
import shutil
import signal
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn
from transformers.utils import logging as hf_logging

from poslab.errors import CheckpointError, PoslabError, is_int, shown

FORMAT = 1  # bump when a poslab can no longer resume the checkpoints of the previous format
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng_state.pt"
MANIFEST = "checksums.sha256"
PREVIOUS = "previous"
CRASH_ENV = "POSLAB_CRASH_AT"

_crossed: Counter[str] = Counter()


def crash_point(name: str) -> None:
    """Test seam: die here, as abruptly as under the OOM killer, when ``POSLAB_CRASH_AT`` asks for it.

    ``POSLAB_CRASH_AT=NAME@N`` sends SIGKILL to this process the N-th time (default 1) execution crosses a
    point named NAME or NAME.<anything> (``save@3``: the third point inside any save). Points: ``step``
    (gradients computed, optimizer not yet stepped), ``evaluate`` (metrics computed, not yet logged) and
    ``save.<checkpoint>.<stage>`` (each stage of ``save_checkpoint``, e.g. ``save.last.renamed``). A suffix
    names another signal to send: ``step@3:SIGINT`` is a Ctrl-C in the third step. Unset, as outside crash
    tests, it costs one environment lookup per point, a few per step.
    """
    spec = os.environ.get(CRASH_ENV)
    if not spec:
        return
    spec, _, signal_name = spec.partition(":")
    target, _, count = spec.partition("@")
    if name == target or name.startswith(target + "."):
        _crossed[target] += 1
        if _crossed[target] == int(count or 1):
            os.kill(os.getpid(), signal.Signals[signal_name or "SIGKILL"])


def rng_state(device: torch.device = torch.device("cpu")) -> dict[str, Any]:
    """This process's generator states, as tensors and plain Python values (loadable with weights_only).
    On a GPU, only ``device``'s: the one this rank draws from. (A resume may see fewer GPUs per process, on
    another node or with one GPU per task, and each rank would otherwise overwrite the others' states.)"""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device = torch.device("cpu")) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, list):  # written before 2026-11-30: every visible GPU's state, this rank's at its index
        cuda = cuda[device.index] if device.type == "cuda" and device.index is not None and \
            device.index < len(cuda) else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


def _untied(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` without the later names of a tied parameter (the LM head tied to the embedding). FSDP's full
    state dict gives each name a tensor of its own, and save_pretrained, seeing no shared storage, wrote the
    tied matrix twice: a larger file, whose digest differed from the same weights saved by one process."""
    first: dict[int, str] = {}
    later = set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(parameter), name) != name:
            later.add(name)
    return {name: value for name, value in state.items() if name not in later}


def save_checkpoint(
    path: Path,
    model: nn.Module,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
    rng_states: list[dict[str, Any]],
    trainer_state: dict[str, Any],
    tokenizer: Any = None,
) -> None:
    """Write a checkpoint directory atomically (call on one rank). ``model`` is the Hugging Face model whose
    ``save_pretrained`` writes config and weights; ``model_state`` its full (unsharded) state dict.
    ``trainer_state`` is stored with the checkpoint format, poslab version and model type added. A text run's
    ``tokenizer`` is saved beside the model, so that the directory alone serves ``pipeline(model=...)``."""
    from poslab import __version__  # late: the package imports the training engine

    path = Path(path)
    tmp, old = _aside(path, "tmp"), _aside(path, "old")
    if old.exists():  # a previous save died after moving NAME aside: finish its rotation
        os.rename(old, path / PREVIOUS if path.exists() else path)
    if tmp.exists():
        try:
            verify(tmp)
        except CheckpointError:  # a previous save died while writing
            shutil.rmtree(tmp)
        else:  # or once it had written everything: it may be the only intact copy, so put it in place first
            _rotate(tmp, path, old)
    try:
        with _no_hf_progress_bar():  # a bar per save would bury the training log
            model.save_pretrained(tmp, state_dict=_untied(model, model_state))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        crash_point(f"save.{path.name}.model")
        for name, obj in ((OPTIMIZER_FILE, optimizer_state), (SCHEDULER_FILE, scheduler_state),
                          (RNG_FILE, rng_states)):
            torch.save(obj, tmp / name)
            crash_point(f"save.{path.name}.{name.removesuffix('.pt')}")
        state = {**trainer_state, "format": FORMAT, "poslab_version": __version__,
                 "model_type": model.config.model_type}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")
        crash_point(f"save.{path.name}.state")
        write_manifest(tmp)
        crash_point(f"save.{path.name}.manifest")
        for file in tmp.iterdir():
            _fsync(file)
        _fsync(tmp)
    except Exception as err:  # the checkpoints already there are intact; what this save wrote is worth nothing
        full = _disk_full(err, tmp.parent)  # measured before the partial copy goes and frees its space
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise OSError(errno.ENOSPC, f"no space left on device for checkpoint {path.name} (the last intact one "
                                        "is kept: free space, then resume with --resume)", str(path)) from None
        raise
    _rotate(tmp, path, old)


def _rotate(tmp: Path, path: Path, old: Path) -> None:
    """Put the complete checkpoint ``tmp`` in place of ``path``, which becomes its ``previous`` (moved aside to
    ``old`` meanwhile); the ``previous`` before it goes."""
    if path.exists():
        shutil.rmtree(path / PREVIOUS, ignore_errors=True)
        crash_point(f"save.{path.name}.dropped_previous")
        os.rename(path, old)
        crash_point(f"save.{path.name}.moved_aside")
    os.rename(tmp, path)
    _fsync(path.parent)
    crash_point(f"save.{path.name}.renamed")
    if old.exists():
        os.rename(old, path / PREVIOUS)
        _fsync(path)
        crash_point(f"save.{path.name}.tucked")


def _disk_full(err: BaseException, directory: Path) -> bool:
    """Whether a failed write met a full disk. safetensors says so in its own error type; torch.save only says
    "unexpected pos 576 vs 534" (a short write), so the free space decides."""
    text = str(err)
    if getattr(err, "errno", None) == errno.ENOSPC or "No space left on device" in text or "os error 28" in text:
        return True
    try:
        return shutil.disk_usage(directory).free < 1 << 20
    except OSError:
        return False


def write_manifest(path: Path) -> None:
    """Write ``path/checksums.sha256`` covering every other file of the directory (``sha256sum`` format)."""
    path = Path(path)
    lines = [f"{_sha256(f)}  {f.name}\n" for f in sorted(path.iterdir()) if f.is_file() and f.name != MANIFEST]
    (path / MANIFEST).write_text("".join(lines))


# What only a resume reads: a model is whole without them
RESUME_FILES = frozenset({OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE})


def verify(path: Path, skip: frozenset[str] = frozenset()) -> None:
    """Raise CheckpointError (one line: what is wrong with which file) unless every file of the checkpoint
    at ``path`` is listed in its checksums and matches them; files named in ``skip`` may be missing or
    damaged (``RESUME_FILES``, for a reader of the model alone)."""
    path = Path(path)
    try:
        text = (path / MANIFEST).read_text()
    except (OSError, UnicodeDecodeError):
        raise CheckpointError(f"{path} is incomplete: no readable {MANIFEST} (a damaged copy, or a checkpoint "
                              "from a poslab before checkpoint format 1)") from None
    listed = {}
    for line in text.splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise CheckpointError(f"{path} is corrupt: {MANIFEST} has a malformed line {line[:60]!r}")
        listed[name] = digest
    present = {f.name for f in path.iterdir() if f.is_file() and f.name != MANIFEST}
    listed = {name: digest for name, digest in listed.items() if name not in skip}
    present -= skip
    if missing := sorted(listed.keys() - present):
        raise CheckpointError(f"{path} is incomplete: {missing[0]} is missing")
    if unlisted := sorted(present - listed.keys()):
        raise CheckpointError(f"{path} is corrupt: {unlisted[0]} is not in {MANIFEST} (a damaged list, or a file "
                              "added later)")
    if STATE_FILE not in listed:
        raise CheckpointError(f"{path} is incomplete: no {STATE_FILE}")
    for name, digest in sorted(listed.items()):
        if _sha256(path / name) != digest:
            raise CheckpointError(f"{path} is corrupt: {name} does not match its sha256 in {MANIFEST}")


def resolve(path: Path, log: Callable[[str], None] | None = None, model_only: bool = False) -> Path:
    """The first intact checkpoint among ``path``, ``path/previous``, an interrupted save's moved-aside copy and
    its new one (``model_only``: whose model is intact, the files only a resume reads aside). When a newer one
    was skipped, ``log`` (default: stderr) gets one line saying why and what is used. Raises CheckpointError when
    none is intact, or when the intact one is of another checkpoint format."""
    problems = []
    # Last, a save that died after writing everything but before its rotation: intact only if it did
    for candidate in [*candidates(path), _aside(Path(path), "tmp")]:
        if not candidate.is_dir():
            continue
        try:
            verify(candidate, RESUME_FILES if model_only else frozenset())
        except CheckpointError as err:
            problems.append(str(err))
            continue
        state = load_trainer_state(candidate)
        _check_state(candidate, state)
        if problems:
            (log or warn)(f"{'; '.join(problems)}; using {candidate} (step {state.get('step')})")
        return candidate
    raise CheckpointError(f"no checkpoint at {path}" + (f": {'; '.join(problems)}" if problems else ""))


def saved_step(out: Path, log: Callable[[str], None] | None = None) -> int:
    """The step of run directory ``out``'s last intact checkpoint, 0 when it has none yet (``log``: why a newer
    one was skipped; default stderr)."""
    try:
        return load_trainer_state(resolve(Path(out) / "checkpoints" / "last", log))["step"]
    except CheckpointError:
        return 0


def candidates(path: Path) -> list[Path]:
    """Where the copies of checkpoint ``path`` can be, newest first."""
    path = Path(path)
    return [path, path / PREVIOUS, _aside(path, "old")]


def load_trainer_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {Path(path) / STATE_FILE}: {err}") from None


def load_states(path: Path) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(optimizer state, scheduler state, RNG states per rank) of a checkpoint directory."""
    out = []
    for name in (OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE):
        try:
            out.append(torch.load(Path(path) / name, map_location="cpu", weights_only=True))
        except Exception as err:  # unpickling raises anything from EOFError to UnpicklingError
            raise CheckpointError(f"cannot read {Path(path) / name}: {str(err).splitlines()[0]}") from None
    return tuple(out)


def weights_digest(path: Path) -> str:
    """One sha256 for the model weights of the (verified) checkpoint at ``path``, from its manifest: equal for
    checkpoints whose weight files are equal byte for byte, wherever they lie."""
    listed = sorted(line for line in (Path(path) / MANIFEST).read_text().splitlines()
                    if fnmatch.fnmatch(line.partition("  ")[2], "model*.safetensors"))
    if not listed:
        raise CheckpointError(f"no model*.safetensors in {path}")
    return hashlib.sha256("\n".join(listed).encode()).hexdigest()


def load_weights(model: nn.Module, path: Path, same_config: bool = True) -> None:
    """Load ``save_pretrained`` safetensors weights (one file or shards) into ``model``, in place, after
    checking that they were saved from a model of the same type and configuration (``same_config``; else the
    same up to what a fine-tune may change, ``fine_tune_spec``: e.g. a RoPE scaling and a longer context).

    ``save_pretrained`` stores a tied matrix once, under one of its names, so a name missing from the
    file is fine when another name of the same parameter was loaded.
    """
    check_model(model, path, same_config)
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


# Model settings that change what a forward computes, not the weights: a checkpoint fits either value.
FORWARD_ONLY = ("sparse_prediction",)


def weights_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A model spec without its FORWARD_ONLY settings: what a checkpoint has to agree with."""
    return {key: value for key, value in spec.items() if key not in FORWARD_ONLY}


# What a fine-tune (train.init_from) may change besides those: how far positions go and the options of the
# positional scheme (a RoPE scaling, its fraction), not the scheme itself. A position table or bias whose
# size changes is still refused, by its weights' shapes.
FINE_TUNABLE = ("max_seq_len", "attn_backend")


def fine_tune_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """A model spec without what a fine-tune may change: what its starting checkpoint has to agree with."""
    kept = {key: value for key, value in weights_spec(spec).items() if key not in FINE_TUNABLE}
    if isinstance(kept.get("positional"), dict):
        kept["positional"] = {"name": kept["positional"].get("name")}
    return kept


def check_model(model: nn.Module, path: Path, same_config: bool = True) -> None:
    """Raise CheckpointError naming the first difference unless ``path/config.json`` describes ``model``
    (with ``same_config`` false: up to what a fine-tune may change, ``fine_tune_spec``)."""
    file = Path(path) / "config.json"
    try:
        saved = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from None
    ours = model.config
    if not isinstance(saved, dict) or saved.get("model_type") != ours.model_type:
        kind = saved.get("model_type") if isinstance(saved, dict) else None
        raise CheckpointError(f"{path} does not fit this model: it holds a '{kind}' model, this config builds "
                              f"a '{ours.model_type}' model")
    try:
        spec = type(ours).from_dict(saved).spec.to_dict()
    except (PoslabError, TypeError, ValueError) as err:
        raise CheckpointError(f"{file} is not a valid '{ours.model_type}' config: {err}") from None
    compared = weights_spec if same_config else fine_tune_spec
    difference = first_difference(_plain(compared(spec)), _plain(compared(ours.spec.to_dict())), "model")
    if difference is not None:
        raise CheckpointError(f"{path} does not fit this model: {difference}")


def first_difference(a: Any, b: Any, path: str) -> str | None:
    """'path.key (a's value there, b's value now)' for the first key where nested mappings differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            diff = first_difference(a.get(key), b.get(key), f"{path}.{key}")
            if diff is not None:
                return diff
        return None
    return None if a == b else f"{path} ({shown(a)} there, {shown(b)} now)"


def _check_state(path: Path, state: Any) -> None:
    """CheckpointError unless ``state`` is a mapping of this checkpoint format with a step. Checksums only show
    that the file is as it was written: one written otherwise (by hand, by another tool) failed later with a
    TypeError or AttributeError."""
    file = Path(path) / STATE_FILE
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} is damaged: it holds a JSON {type(state).__name__}, not a mapping; resume "
                              "from another checkpoint or start a new run")
    _check_format(path, state)
    if not (is_int(state.get("step")) and state["step"] >= 0):
        raise CheckpointError(f"{file} is damaged: it needs step (an integer >= 0), got {shown(state.get('step'))}; "
                              "resume from another checkpoint or start a new run")


def load_resume_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path`` (from ``resolve``) with what resuming reads besides the step, or
    CheckpointError: a KeyError or TypeError otherwise."""
    state = load_trainer_state(path)
    best, loss = state.get("best"), state.get("last_loss")
    if not ({"best", "last_loss"} <= state.keys()
            and (best is None or isinstance(best, dict) and {"metric", "value", "step"} <= best.keys())
            and (loss is None or isinstance(loss, (int, float)) and not isinstance(loss, bool))):
        raise CheckpointError(f"{Path(path) / STATE_FILE} is damaged: it needs best (null or a mapping of metric, "
                              "value and step) and last_loss (a number); resume from another checkpoint or start a "
                              "new run")
    return state


def _check_format(path: Path, state: dict[str, Any]) -> None:
    from poslab import __version__

    if state.get("format") != FORMAT:
        writer = state.get("poslab_version", "an older version")
        # A copy edited by hand can name this very version: then only a release that reads its format helps.
        other = f"poslab {writer}" if writer != __version__ else f"a poslab that reads format {state.get('format')}"
        raise CheckpointError(f"{path} was written by poslab {writer} in checkpoint format {state.get('format')}; "
                              f"poslab {__version__} reads format {FORMAT}: continue the run with {other}, "
                              "or start a new run")


def _plain(value: Any) -> Any:
    """JSON's view of a value (tuples become lists), as a config.json read back holds it."""
    return json.loads(json.dumps(value))


def warn(message: str) -> None:
    print(f"poslab: warning: {message}", file=sys.stderr)


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


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
