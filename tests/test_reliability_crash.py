"""Crash safety: `poslab train` killed with SIGKILL at many points resumes to the same run; one run per directory.

Each run is a child process forked from a server that has already imported poslab (multiprocessing's
forkserver), so a kill costs a fork instead of a 5-20 s interpreter start on a loaded CI machine. A child
runs exactly what the console script runs, ``poslab.cli.main(argv)``, and dies by SIGKILL: no finally
block, no flush, no atexit. Kill points come from the ``POSLAB_CRASH_AT`` seam (poslab.train.checkpoint.
crash_point): mid-step, mid-evaluation and every stage of a checkpoint save; the slow tests add kills at
seeded random wall-clock offsets.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from poslab.train import checkpoint as ckpt

SAVE_STAGES = ["model", "optimizer", "scheduler", "rng_state", "state", "manifest", "dropped_previous",
               "moved_aside", "renamed", "tucked"]
TIMING_KEYS = {"seconds", "tokens_per_s", "data_fraction"}  # wall-clock measurements: differ run to run
CHILD_TIMEOUT = 120


def _cli(argv: list[str], crash_at: str | None, log: str) -> None:
    """A child: `poslab ARGV` with stdout and stderr in `log`, exit code as the console script's."""
    if crash_at:
        os.environ[ckpt.CRASH_ENV] = crash_at
    else:
        os.environ.pop(ckpt.CRASH_ENV, None)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(1)
    import poslab.cli

    sys.exit(poslab.cli.main(argv))


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["poslab.cli", "poslab.train", __name__])
    return ctx


def start(argv: list[str], log: Path, crash_at: str | None = None) -> multiprocessing.Process:
    child = _context().Process(target=_cli, args=(["train", *argv], crash_at, str(log)), daemon=True)
    child.start()
    return child


def finish(child: multiprocessing.Process, log: Path, timeout: float = CHILD_TIMEOUT) -> int:
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail(f"poslab train did not finish within {timeout} s; its log:\n{log.read_text()}")
    return child.exitcode


def run(argv: list[str], log: Path, crash_at: str | None = None) -> int:
    return finish(start(argv, log, crash_at), log)


def tiny_config(path: Path, steps: int = 6, **train) -> Path:
    """A 1-layer, width-32 PoPE decoder on short additions; evaluation, best and last every step."""
    raw = {"seed": 0,
           "model": {"arch": "decoder", "vocab_size": None, "d_model": 32, "n_layers": 1, "n_heads": 2,
                     "max_seq_len": 32, "positional": {"name": "pope"}},
           "data": {"kind": "task", "name": "addition", "min_len": 3, "max_len": 5, "train_size": None,
                    "validation_size": 8, "test_size": 8},
           "train": {"steps": steps, "batch_size": 8, "lr": 1e-2, "warmup_steps": 1, "log_every": 1,
                     "eval_every": 1, "checkpoint_every": 1, "device": "cpu", **train}}
    path.write_text(yaml.safe_dump(raw))
    return path


def summary(log: Path) -> dict:
    """The final metrics line a finished run prints, without wall-clock measurements."""
    final = json.loads([line for line in log.read_text().splitlines() if line.startswith("{")][-1])
    return {k: v for k, v in final.items() if k not in TIMING_KEYS}


def records(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    out = dict(load_file(checkpoint / "model.safetensors"))
    optimizer = torch.load(checkpoint / ckpt.OPTIMIZER_FILE, weights_only=True)
    for name, state in optimizer["state"].items():
        out.update({f"optimizer.{name}.{k}": v for k, v in state.items() if torch.is_tensor(v)})
    return out


def assert_same_run(run_dir: Path, reference: Path, log: Path, reference_log: Path) -> None:
    """Bitwise: metrics records, final summary, weights and AdamW moments of last and best."""
    assert records(run_dir) == records(reference)
    assert summary(log) == summary(reference_log)
    for name in ("last", "best"):
        a, b = tensors(run_dir / "checkpoints" / name), tensors(reference / "checkpoints" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def assert_not_torn(run_dir: Path) -> int:
    """Whatever the kill interrupted, `last` and `best` are intact where they exist, and the newest intact
    copy of each can be found. Returns the step a resume would start from (0: no checkpoint yet)."""
    steps = {}
    for name in ("last", "best"):
        path = run_dir / "checkpoints" / name
        if path.exists():
            ckpt.verify(path)
        if any(p.exists() for p in ckpt.candidates(path)):
            steps[name] = ckpt.load_trainer_state(ckpt.resolve(path, log=lambda line: None))["step"]
    return steps.get("last", 0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every crashed run must reproduce (and how long it took, in seconds)."""
    root = tmp_path_factory.mktemp("reference")
    config = tiny_config(root / "c.yaml")
    log = root / "log"
    warm_fork_server(log)
    started = time.monotonic()
    assert run([str(config), "--out", str(root / "run")], log) == 0, log.read_text()
    return config, root / "run", log, time.monotonic() - started


def warm_fork_server(log: Path) -> None:
    """Start the fork server (it imports poslab once), so that timings of children leave that out."""
    warm = _context().Process(target=_cli, args=(["--version"], None, str(log)))
    warm.start()
    assert finish(warm, log) == 0


def crash_and_resume(tmp_path: Path, config: Path, schedule: list[str]) -> tuple[Path, Path]:
    """Run, killing at each point of `schedule` in turn (each leg resumes the last), then finish."""
    out, argv = tmp_path / "run", [str(config), "--out", str(tmp_path / "run")]
    resumable = 0
    for i, point in enumerate(schedule):
        log = tmp_path / f"leg{i}.log"
        code = run(argv + (["--resume"] if i else []), log, crash_at=point)
        assert code == -signal.SIGKILL, f"leg {i} ({point}) was not killed (exit {code}):\n{log.read_text()}"
        step = assert_not_torn(out)
        assert step >= resumable, f"the kill at {point} lost the checkpoint of step {resumable}"
        resumable = step
    log = tmp_path / "final.log"
    assert run(argv + ["--resume"], log) == 0, log.read_text()
    return out, log


# One chain through every kind of kill point, each leg resuming the previous one's wreck: mid-step, mid-evaluation,
# every stage of saving `last`, the commit stages of saving `best`.
CHAIN = (["step@2", "evaluate@2"] + [f"save.last.{stage}@1" for stage in SAVE_STAGES]
         + ["save.best.moved_aside@1", "save.best.renamed@1", "step@1"])


def test_killed_at_every_kind_of_point_resumes_to_the_same_run(tmp_path, reference, reliability):
    config, ref_dir, ref_log, _ = reference
    out, log = crash_and_resume(tmp_path, config, CHAIN)
    assert_same_run(out, ref_dir, log, ref_log)
    assert not (out / ".lock").exists()  # released by the finished run, though 15 owners died holding it
    again = tmp_path / "again.log"  # resuming a finished run changes nothing and reports the same
    assert run([str(config), "--out", str(out), "--resume"], again) == 0
    assert_same_run(out, ref_dir, again, ref_log)
    kinds = {point.split("@")[0] for point in CHAIN}
    reliability.record("crash", "SIGKILL of `poslab train` mid-step, mid-evaluation and at each of the "
                       f"{len(SAVE_STAGES)} stages of a checkpoint save, chained (each leg resumes the last)",
                       len(CHAIN), f"{len(kinds)} distinct kill points; after every kill the latest checkpoint is "
                       "intact and no committed step is lost; the resumed run is bitwise equal to the "
                       "uninterrupted one (metrics, weights, AdamW state)")


def test_a_damaged_last_and_a_kill_in_the_next_save_keep_the_run(tmp_path, reference, reliability):
    """A damaged `last` makes a resume start from `last/previous`, the only intact copy, which the next save's
    rotation drops before putting its new one in place: killed there, no intact checkpoint was left ("no
    checkpoint at ... last is corrupt"). The fully written new one is now found, and the run ends as if never
    interrupted."""
    config, ref_dir, ref_log, _ = reference
    out, argv = tmp_path / "run", [str(config), "--out", str(tmp_path / "run")]
    assert run(argv, tmp_path / "leg0.log", crash_at="step@4") == -signal.SIGKILL  # last: step 3, previous: 2
    model = out / "checkpoints" / "last" / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-5] ^= 1
    model.write_bytes(bytes(data))
    leg1 = tmp_path / "leg1.log"
    assert run(argv + ["--resume"], leg1, crash_at="save.last.dropped_previous@1") == -signal.SIGKILL
    assert "using " + str(out / "checkpoints" / "last" / "previous") in leg1.read_text()
    log = tmp_path / "final.log"
    assert run(argv + ["--resume"], log) == 0, log.read_text()
    assert "using " + str(out / "checkpoints" / ".last.tmp") in log.read_text()
    assert_same_run(out, ref_dir, log, ref_log)
    reliability.record("crash", "a bit flipped in `last`, then SIGKILL in the next save's rotation after it dropped "
                       "`last/previous` (the only intact copy)", 1,
                       "the fully written new checkpoint is found; the resumed run is bitwise equal to the "
                       "uninterrupted one")


def test_killed_before_the_first_checkpoint_starts_over(tmp_path, reference, reliability):
    config, ref_dir, ref_log, _ = reference
    out, log = crash_and_resume(tmp_path, config, ["step@1", "evaluate@1", "save.best.model@1"])
    assert_same_run(out, ref_dir, log, ref_log)
    assert "has no checkpoint yet" in (tmp_path / "leg1.log").read_text()
    reliability.record("crash", "SIGKILL before the first checkpoint exists, then --resume", 3,
                       "restarts from step 0 with a one-line note; bitwise equal final run")


# Ctrl-C or SIGTERM in a step, in an evaluation, and in a periodic save (run of 6 steps, evaluated every 2):
# (kill point, the step the run must be saved at).
INTERRUPTS = [("step@3:SIGINT", 3), ("step@3:SIGTERM", 3), ("evaluate@1:SIGINT", 2), ("save.last.model@1:SIGINT", 4)]


def test_an_interrupt_saves_the_step_it_stopped_after(tmp_path, reliability):
    """Ctrl-C lost every step since the last periodic checkpoint (up to train.checkpoint_every of them). Now the
    step under way finishes, is saved, and --resume continues to the run that was never interrupted."""
    config = tiny_config(tmp_path / "c.yaml", eval_every=2, checkpoint_every=4)
    warm_fork_server(tmp_path / "warm.log")
    assert run([str(config), "--out", str(tmp_path / "whole")], tmp_path / "whole.log") == 0
    for i, (point, saved) in enumerate(INTERRUPTS):
        out, log = tmp_path / f"run{i}", tmp_path / f"run{i}.log"
        assert run([str(config), "--out", str(out)], log, crash_at=point) == 130, log.read_text()
        assert assert_not_torn(out) == saved, point
        assert f"poslab: {point.split(':')[1]}: stopping after the step under way" in log.read_text(), point
        assert log.read_text().splitlines()[-1] == (f"poslab: interrupted; the run in {out} resumes from its "
                                                    f"checkpoint at step {saved} with --resume"), point
        assert run([str(config), "--out", str(out), "--resume"], tmp_path / f"final{i}.log") == 0
        assert_same_run(out, tmp_path / "whole", tmp_path / f"final{i}.log", tmp_path / "whole.log")
    reliability.record("crash", "Ctrl-C (SIGINT) or SIGTERM of `poslab train` mid-step, mid-evaluation and "
                       "mid-save, between periodic checkpoints, then --resume", len(INTERRUPTS),
                       "exit 130 naming the step to resume from: the step under way finishes and is saved "
                       "(no step lost); the resumed run is bitwise equal to the uninterrupted one")


@pytest.mark.slow
@pytest.mark.parametrize("point", [f"save.{name}.{stage}@{n}" for name in ("last", "best") for stage in SAVE_STAGES
                                   for n in (1, 2)]
                         + [f"{p}@{n}" for p in ("step", "evaluate") for n in (1, 2, 3, 4)])
def test_every_kill_point_alone(tmp_path, reference, point, reliability):
    config, ref_dir, ref_log, _ = reference
    out, log = crash_and_resume(tmp_path, config, [point])
    assert_same_run(out, ref_dir, log, ref_log)
    reliability.record("crash", "SIGKILL at one point per run, then --resume: every save stage of last and of best "
                       "(their 1st and 2nd save), the 1st to 4th step and evaluation", 1,
                       "latest checkpoint intact; resumed run bitwise equal to the uninterrupted one")


@pytest.mark.slow
def test_kills_at_random_wall_clock_offsets(tmp_path, reliability):
    """Kills wherever the clock lands: seeded offsets within the first half of an uninterrupted 24-step run's
    duration, each leg resuming the last, until a leg finishes."""
    config = tiny_config(tmp_path / "c.yaml", steps=24)
    warm_fork_server(tmp_path / "warm.log")
    started = time.monotonic()
    assert run([str(config), "--out", str(tmp_path / "reference")], tmp_path / "reference.log") == 0
    duration = time.monotonic() - started
    rng = random.Random(20240611)
    out, argv = tmp_path / "run", [str(config), "--out", str(tmp_path / "run")]
    kills = resumable = 0
    for i in range(12):
        log = tmp_path / f"leg{i}.log"
        child = start(argv + (["--resume"] if i else []), log)
        time.sleep(rng.uniform(0.05, 0.5) * duration)
        if child.is_alive():
            os.kill(child.pid, signal.SIGKILL)
        code = finish(child, log)
        assert code in (0, -signal.SIGKILL), log.read_text()
        if code == 0:
            break
        kills += 1
        step = assert_not_torn(out)
        assert step >= resumable, f"a kill lost the checkpoint of step {resumable}"
        resumable = step
    else:
        log = tmp_path / "final.log"
        assert run(argv + ["--resume"], log) == 0, log.read_text()
    assert kills > 1
    assert_same_run(out, tmp_path / "reference", log, tmp_path / "reference.log")
    reliability.record("crash", f"SIGKILL at seeded random wall-clock offsets (5-50% of a {duration:.1f} s, 24-step "
                       "run), each leg resuming the last", kills, "latest checkpoint intact and no committed step "
                       "lost after every kill; final run bitwise equal")


# ---- one run per output directory ---------------------------------------------------------------------------

def test_second_run_on_a_live_directory_refuses_and_a_dead_owner_is_taken_over(tmp_path, reliability, capsys):
    import poslab.cli

    config = tiny_config(tmp_path / "c.yaml", steps=10**6)  # runs until killed
    out = tmp_path / "run"
    first = start([str(config), "--out", str(out)], tmp_path / "first.log")
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not (out / "checkpoints" / "last" / ckpt.STATE_FILE).exists():  # alive and past its first save
        assert first.is_alive() and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
        time.sleep(0.05)
    argv = ["train", str(config), "--out", str(out)]
    refusals = 0
    for extra in ([], ["--resume"], ["--overwrite"]):
        assert poslab.cli.main(argv + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"is in use by another poslab run (pid {first.pid} on" in err, err
        refusals += 1
    assert first.is_alive()  # the refused runs touched nothing of the live one

    os.kill(first.pid, signal.SIGKILL)
    assert finish(first, tmp_path / "first.log") == -signal.SIGKILL
    assert f"pid {first.pid}" in (out / ".lock").read_text()  # the dead owner's file is still there
    step = ckpt.load_trainer_state(ckpt.resolve(out / "checkpoints" / "last"))["step"]
    assert poslab.cli.main(argv + ["--resume", "--set", f"train.steps={step + 1}"]) == 0
    captured = capsys.readouterr()
    assert f"took over {out / '.lock'} from pid {first.pid}" in captured.err
    assert json.loads(captured.out)["step"] == step + 1 and not (out / ".lock").exists()
    reliability.record("lock", "second `poslab train` (fresh, --resume, --overwrite) on a directory a live run "
                       "holds", refusals, "refused with one stderr line naming the owner's pid, exit 2; the "
                       "live run untouched")
    reliability.record("lock", "lock file left by a SIGKILLed owner", 1,
                       "taken over by the next --resume (noted in its log), released at the end")
