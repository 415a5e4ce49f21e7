"""Checkpoint integrity and run ownership: corrupt, truncated or foreign checkpoints are caught in one line and
resume falls back to the previous good copy; the run-directory lock refuses a second owner and outlives no one."""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import shutil
import socket
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import poslab
import poslab.cli
import poslab.files
from poslab.errors import CheckpointError
from poslab.models import build_model
from poslab.train import checkpoint as ckpt
from poslab.train import load_run
from poslab.train.lock import RunLock, RunLocked

FILES = ["config.json", "model.safetensors", ckpt.OPTIMIZER_FILE, ckpt.SCHEDULER_FILE, ckpt.RNG_FILE,
         ckpt.STATE_FILE, ckpt.MANIFEST]


# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")


def write_config(path: Path, d_model: int = 32) -> Path:
    raw = {"seed": 0,
           "model": {"arch": "decoder", "vocab_size": None, "d_model": d_model, "n_layers": 1, "n_heads": 2,
                     "max_seq_len": 32, "positional": {"name": "pope"}},
           "data": {"kind": "task", "name": "addition", "min_len": 3, "max_len": 5, "train_size": None,
                    "validation_size": 8, "test_size": 8},
           # a constant schedule: a 3-step run's first steps are those of a 4-step run
           "train": {"steps": 3, "batch_size": 8, "lr": 1e-2, "warmup_steps": 0, "schedule": "constant",
                     "log_every": 1, "eval_every": 1, "checkpoint_every": 1, "device": "cpu"}}
    path.write_text(yaml.safe_dump(raw))
    return path


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = poslab.cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 3-step run (checkpoints every step) and the same run trained to 4 steps without interruption."""
    root = tmp_path_factory.mktemp("runs")
    config = write_config(root / "c.yaml")
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        assert cli("train", str(config), "--out", str(root / "three"))[0] == 0
        assert cli("train", str(config), "--out", str(root / "four"), "--set", "train.steps=4")[0] == 0
    return config, root / "three", root / "four"


def copy_of(run: Path, where: Path) -> Path:
    """A copy of a finished run at ``where``, to damage or resume without touching the shared original."""
    shutil.copytree(run, where)
    return where


def corrupt(file: Path, kind: str, rng: random.Random) -> None:
    data = file.read_bytes()
    if kind == "flip one byte":
        i = rng.randrange(len(data))
        file.write_bytes(data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:])
    elif kind == "truncate to half":
        file.write_bytes(data[: len(data) // 2])
    elif kind == "truncate to zero":
        file.write_bytes(b"")
    elif kind == "delete":
        file.unlink()
    elif kind == "append garbage":
        file.write_bytes(data + b"\x00garbage")
    else:
        raise AssertionError(kind)


KINDS = ["flip one byte", "truncate to half", "truncate to zero", "delete", "append garbage"]


def test_every_kind_of_damage_to_every_file_is_detected_in_one_line(tmp_path, runs, reliability):
    _, three, _ = runs
    rng = random.Random(0)
    cases = 0
    for name in FILES:
        for kind in KINDS:
            for _ in range(3 if kind == "flip one byte" else 1):  # three random bytes per file
                damaged = tmp_path / f"{cases}"
                shutil.copytree(three / "checkpoints/last", damaged)
                corrupt(damaged / name, kind, rng)
                with pytest.raises(CheckpointError) as err:
                    ckpt.verify(damaged)
                message = str(err.value)
                assert "\n" not in message and (name in message or ckpt.MANIFEST in message), message
                cases += 1
    extra = tmp_path / "extra"
    shutil.copytree(three / "checkpoints/last", extra)
    (extra / "notes.txt").write_text("added later")
    with pytest.raises(CheckpointError, match="notes.txt is not in checksums.sha256"):
        ckpt.verify(extra)
    ckpt.verify(three / "checkpoints/last")
    reliability.record("checkpoint", f"damage to each of the {len(FILES)} files of a checkpoint: "
                       f"{', '.join(KINDS)} (3 random bit flips per file); a file added later", cases + 1,
                       "every one detected by its checksums, reported in one line naming the file")


@pytest.mark.parametrize("name,kind", [(name, "flip one byte") for name in FILES]
                         + [("model.safetensors", "truncate to half"), (ckpt.OPTIMIZER_FILE, "delete")])
def test_resume_falls_back_to_the_previous_checkpoint(tmp_path, runs, name, kind, reliability):
    config, three, four = runs
    run = copy_of(three, tmp_path / "run")
    corrupt(run / "checkpoints/last" / name, kind, random.Random(1))
    code, out, err = cli("train", str(config), "--out", str(run), "--resume", "--set", "train.steps=4")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "checkpoints/last" in line and "using" in line]
    assert len(notes) == 1 and f"using {run}/checkpoints/last/previous (step 2)" in notes[0], err
    assert f"resumed {run} at step 2" in err
    a, b = (load_file(r / "checkpoints/last/model.safetensors") for r in (run, four))
    assert all(torch.equal(a[k], b[k]) for k in a)  # two steps later, exactly the uninterrupted run
    final = json.loads((four / "metrics.jsonl").read_text().splitlines()[-1])
    assert json.loads(out)["eval_loss"] == final["eval_loss"]
    reliability.record("checkpoint", "--resume when one file of `last` is damaged: a bit flip in each of its "
                       f"{len(FILES)} files, the weights truncated, the optimizer state deleted", 1,
                       "one-line note, resumed from last/previous (one step back); final weights bitwise equal "
                       "to the uninterrupted run")


def test_no_intact_checkpoint_refuses_and_changes_nothing(tmp_path, runs, reliability):
    config, three, _ = runs
    run = copy_of(three, tmp_path / "run")
    corrupt(run / "checkpoints/last/model.safetensors", "flip one byte", random.Random(2))
    corrupt(run / "checkpoints/last/previous" / ckpt.STATE_FILE, "truncate to half", random.Random(2))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, _, err = cli("train", str(config), "--out", str(run), "--resume")
    assert code == 2 and err.count("\n") == 1
    assert "no checkpoint at" in err and "model.safetensors does not match" in err and ckpt.STATE_FILE in err, err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    reliability.record("checkpoint", "resume when last and its previous are both damaged", 1,
                       "refused in one line naming both problems; the run directory is left byte for byte")


def test_a_damaged_best_checkpoint_falls_back_for_analysis(tmp_path, runs, reliability, capsys):
    _, three, _ = runs
    run = copy_of(three, tmp_path / "run")
    corrupt(run / "checkpoints/best/model.safetensors", "truncate to half", random.Random(3))
    _, model = load_run(run)
    warning = capsys.readouterr().err
    assert warning.count("\n") == 1 and "checkpoints/best is corrupt" in warning and "best/previous" in warning
    previous = load_file(run / "checkpoints/best/previous/model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in previous.items())
    shutil.rmtree(run / "checkpoints/best/previous")
    _, model = load_run(run)  # no intact best at all: the last checkpoint, with a warning
    assert "using" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="best is corrupt"):
        load_run(run, "best")
    reliability.record("checkpoint", "analysis (load_run) of a run whose best checkpoint is damaged", 3,
                       "falls back to best/previous, then to last, each with a one-line warning; asking for best "
                       "explicitly is refused in one line")


def test_analysis_reads_a_checkpoint_whose_resume_state_is_damaged(tmp_path, runs, reliability, capsys):
    """Analysis needs the model alone: a checkpoint that lost optimizer.pt (or whose RNG state is damaged) was
    refused as "incomplete"; a resume still refuses it and falls back to the previous copy."""
    _, three, _ = runs
    run = copy_of(three, tmp_path / "run")
    best = run / "checkpoints" / "best"
    (best / ckpt.OPTIMIZER_FILE).unlink()
    corrupt(best / ckpt.RNG_FILE, "flip one byte", random.Random(4))
    _, model = load_run(run, "best")
    assert capsys.readouterr().err == ""
    weights = load_file(best / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    with pytest.raises(CheckpointError, match=r"incomplete: optimizer.pt is missing"):
        ckpt.verify(best)
    corrupt(best / "model.safetensors", "flip one byte", random.Random(5))  # the model itself is still checked
    load_run(run, "best")
    warning = capsys.readouterr().err
    assert "best is corrupt: model.safetensors does not match" in warning and "best/previous" in warning
    reliability.record("checkpoint", "analysis (load_run) of a checkpoint whose optimizer state is missing and RNG "
                       "state damaged", 2, "loads the intact weights without a word; damaged weights are still "
                       "skipped, with a one-line warning, for the previous copy")


def test_resume_after_a_torn_metrics_line(tmp_path, runs, reliability):
    """SIGKILL cannot tear a line (each record is one write), but a full disk or a power cut can."""
    config, three, _ = runs
    run = copy_of(three, tmp_path / "run")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 2.1, "l')
    code, _, err = cli("train", str(config), "--out", str(run), "--resume", "--set", "train.steps=4")
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 4, steps
    reliability.record("checkpoint", "--resume when metrics.jsonl ends in a torn line (full disk, power cut)", 1,
                       "the torn line is dropped with the records past the checkpoint; the run completes")


# ---- foreign checkpoints ----------------------------------------------------------------------------------------

def _replace_last(run: Path, model: torch.nn.Module) -> None:
    shutil.rmtree(run / "checkpoints/last")
    ckpt.save_checkpoint(run / "checkpoints/last", model, model.state_dict(), {"state": {}, "param_groups": []},
                         {}, [ckpt.rng_state()], {"step": 2, "best": None, "last_loss": 1.0})


def test_a_checkpoint_of_another_model_is_refused(tmp_path, runs, reliability):
    config, three, _ = runs
    cases = {
        "a wider decoder": (build_model({"arch": "decoder", "vocab_size": 14, "d_model": 64, "n_layers": 1,
                                         "n_heads": 2, "max_seq_len": 32, "positional": {"name": "pope"}}),
                            "does not fit this model: model.d_model (64 there, 32 now)"),
        "another positional scheme": (build_model({"arch": "decoder", "vocab_size": 14, "d_model": 32,
                                                   "n_layers": 1, "n_heads": 2, "max_seq_len": 32}),
                                      "does not fit this model: model.positional.name ('rope' there, 'pope' now)"),
        "a DSTG encoder": (build_model({"arch": "dstg", "vocab_size": 14, "n_layers": 1, "n_heads": 2, "d_ap": 8,
                                        "d_sem": 24, "max_seq_len": 32}),
                           "it holds a 'dstg_neobert' model, this config builds a 'poslab' model"),
    }
    for i, (label, (model, message)) in enumerate(cases.items()):
        run = copy_of(three, tmp_path / f"run{i}")
        _replace_last(run, model)
        code, _, err = cli("train", str(config), "--out", str(run), "--resume")
        assert code == 2 and err.count("\n") == 1 and message in err, (label, err)
        with pytest.raises(CheckpointError, match="does not fit this model"):
            load_run(run, "last")
    reliability.record("checkpoint", f"resume and load_run from a checkpoint of another model ({', '.join(cases)})",
                       2 * len(cases), "refused in one line naming the first differing setting or model type")


def _rewrite_state(checkpoint: Path, **changes) -> None:
    state = json.loads((checkpoint / ckpt.STATE_FILE).read_text())
    state.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del state[key]
    (checkpoint / ckpt.STATE_FILE).write_text(json.dumps(state))
    ckpt.write_manifest(checkpoint)  # an intact checkpoint, as that other version wrote it


def test_checkpoints_of_other_poslab_versions(tmp_path, runs, reliability):
    config, three, _ = runs
    # A newer format: refused, naming both versions.
    run = copy_of(three, tmp_path / "newer")
    _rewrite_state(run / "checkpoints/last", format=ckpt.FORMAT + 1, poslab_version="9.0.0")
    code, _, err = cli("train", str(config), "--out", str(run), "--resume")
    assert code == 2 and err.count("\n") == 1, err
    assert (f"was written by poslab 9.0.0 in checkpoint format {ckpt.FORMAT + 1}; poslab {poslab.__version__} "
            f"reads format {ckpt.FORMAT}: continue the run with poslab 9.0.0") in err
    # A copy edited to another format under this very version: not "continue with" the version that refuses.
    _rewrite_state(run / "checkpoints/last", poslab_version=poslab.__version__)
    code, _, err = cli("train", str(config), "--out", str(run), "--resume")
    assert code == 2 and f"continue the run with a poslab that reads format {ckpt.FORMAT + 1}, or start" in err, err
    # Another version writing the same format: resumed, with a note.
    run = copy_of(three, tmp_path / "older")
    _rewrite_state(run / "checkpoints/last", poslab_version="0.0.9")
    code, _, err = cli("train", str(config), "--out", str(run), "--resume", "--set", "train.steps=4")
    assert code == 0 and f"was written by poslab 0.0.9; continuing with poslab {poslab.__version__}" in err, err
    # From before checksums: no manifest and no format, in last and in its previous.
    run = copy_of(three, tmp_path / "legacy")
    for checkpoint in (run / "checkpoints/last", run / "checkpoints/last/previous"):
        (checkpoint / ckpt.MANIFEST).unlink()
    code, _, err = cli("train", str(config), "--out", str(run), "--resume")
    assert code == 2 and err.count("\n") == 1 and "from a poslab before checkpoint format 1" in err, err
    state = json.loads((three / "checkpoints/last" / ckpt.STATE_FILE).read_text())
    assert state["format"] == ckpt.FORMAT and state["poslab_version"] == poslab.__version__
    assert state["model_type"] == "poslab"
    reliability.record("checkpoint", "resume from checkpoints of other poslab versions (newer format, same format, "
                       "pre-checksum)", 3, "newer format and pre-checksum refused in one line naming the versions; "
                       "same format resumed with a one-line note")


# ---- the run-directory lock -----------------------------------------------------------------------------------

def test_a_held_lock_refuses_a_run_before_it_writes_anything(tmp_path, reliability):
    config = write_config(tmp_path / "c.yaml")
    out = tmp_path / "run"
    holder = RunLock(out)
    holder.acquire()
    try:
        code, _, err = cli("train", str(config), "--out", str(out))
        assert code == 2 and err.count("\n") == 1
        assert f"{out} is in use by another poslab run (pid {os.getpid()} on " in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        holder.release(remove_created=True)
    assert not out.exists()
    assert cli("train", str(config), "--out", str(out), "--set", "train.steps=1")[0] == 0
    assert not (out / ".lock").exists()
    reliability.record("lock", "`poslab train` on a directory whose lock another process holds", 1,
                       "refused in one line naming the holder; nothing written; runs once the lock is released")


def test_a_held_reproduction_directory_refuses_a_second_reproduction(tmp_path, reliability):
    out = tmp_path / "repro"
    holder = RunLock(out)
    holder.acquire()
    try:
        code, _, err = cli("reproduce", "indirect-indexing", "--scale", "smoke", "--out", str(out), "--jobs", "1")
        assert code == 2 and err.count("\n") == 1
        assert f"{out} is in use by another poslab run (pid {os.getpid()} on " in err
        assert sorted(p.name for p in out.iterdir()) == [".lock"]
    finally:
        holder.release()
    reliability.record("lock", "second `poslab reproduce` into an --out a live reproduction holds", 1,
                       "refused in one line naming the holder, exit 2; nothing written")


def test_a_run_resumes_only_on_data_this_poslab_makes_alike(runs, tmp_path, monkeypatch, reliability):
    import poslab.tasks

    config, three, _ = runs
    run = copy_of(three, tmp_path / "run")
    before = (run / "config.yaml").read_bytes(), (run / "data.json").read_bytes()
    monkeypatch.setattr(poslab.tasks, "DATA_VERSION", poslab.tasks.DATA_VERSION + 1)
    code, _, err = cli("train", str(config), "--out", str(run), "--resume", "--set", "train.steps=4")
    assert code == 2 and err.count("\n") == 1 and "cannot resume: data version.task_problems (" in err, err
    assert ((run / "config.yaml").read_bytes(), (run / "data.json").read_bytes()) == before
    reliability.record("checkpoint", "--resume of a run whose data this poslab makes otherwise (a data version bump: "
                       "new task sampler, tokenizer training)", 1,
                       "refused in one line naming the version entry, exit 2; the run directory untouched")


def test_lock_left_by_a_dead_owner_and_the_unlink_race(tmp_path, monkeypatch, reliability):
    directory = tmp_path / "a" / "b"
    first = RunLock(directory)
    assert first.acquire() is None and directory.is_dir()
    first.release(remove_created=True)
    assert not (tmp_path / "a").exists()  # the directories it made, gone with it

    directory.mkdir(parents=True)
    (directory / ".lock").write_text("pid 999999 on elsewhere\n")  # a crashed owner's file, no flock held
    stale = RunLock(directory)
    assert stale.acquire() == "pid 999999 on elsewhere"
    assert (directory / ".lock").read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    with pytest.raises(RunLocked, match=f"pid {os.getpid()}"):
        RunLock(directory).acquire()
    stale.release()
    assert not (directory / ".lock").exists()

    # The holder unlinks its file as it releases: a newcomer that opened the old file just before must not end
    # up locking a file nobody else will ever see.
    real_flock, calls = poslab.files.fcntl.flock, []

    def flock_after_the_holder_left(fd, operation):
        calls.append(fd)
        if len(calls) == 1:
            (directory / ".lock").unlink()
        return real_flock(fd, operation)

    monkeypatch.setattr(poslab.files.fcntl, "flock", flock_after_the_holder_left)
    racer = RunLock(directory)
    racer.acquire()
    assert len(calls) == 2 and os.path.samestat(os.fstat(racer.fd), os.stat(directory / ".lock"))
    racer.release()
    reliability.record("lock", "lock file left by a dead owner; the holder unlinking it mid-acquire", 2,
                       "taken over (the dead owner named); the race retried onto the live file")
