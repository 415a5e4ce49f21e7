"""Reproduction framework: claims computed from values, resumable runner, report, command line."""
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from poslab.cli import main
from poslab.errors import PoslabError
from poslab.experiments import claims, runner
from poslab.experiments.runner import RecipeResult


def test_claims_are_computed_from_the_values():
    assert claims.at_least("c", 1, 0.9, 0.8).held
    assert not claims.at_least("c", 1, 0.7, 0.8).held
    assert not claims.at_least("c", 1, math.nan, 0.8).held
    assert claims.within("c", 0.5, 0.5, 0.4, 0.6).held and not claims.within("c", 0.5, 0.7, 0.4, 0.6).held
    assert claims.exceeds("c", "x", {"a": 0.5, "b": 0.2}, "a", "b", margin=0.2).held
    assert not claims.exceeds("c", "x", {"a": 0.5, "b": 0.4}, "a", "b", margin=0.2).held
    assert claims.all_of("c", "x", {"t1": 0.9, "t2": 0.85}, 0.8).held
    assert not claims.all_of("c", "x", {"t1": 0.9, "t2": 0.75}, 0.8).held
    assert claims.at_most("c", "x", 1.05, 1.1).held and not claims.at_most("c", "x", 1.2, 1.1).held
    # more_than is at_most's complement at the same threshold: no value is both flat and degrading
    assert all(claims.more_than("c", "x", v, 1.1).held != claims.at_most("c", "x", v, 1.1).held
               for v in (1.05, 1.1, 1.2))
    assert not claims.more_than("c", "x", math.nan, 1.1).held
    assert claims.all_within("c", "x", {"a": 0.45, "b": 0.6}, 0.4, 0.6).held
    assert not claims.all_within("c", "x", {"a": 0.45, "b": 0.64}, 0.4, 0.6).held
    assert claims.lowest("c", "x", {"a": 0.3, "b": 0.4, "null": 0.9}, "a").held
    assert not claims.lowest("c", "x", {"a": 0.3, "b": 0.4, "null": 0.3}, "a").held
    assert not claims.lowest("c", "x", {"a": 0.3, "b": math.nan}, "a").held


def test_claims_hold_at_their_bounds_and_need_every_value():
    """The rules say ">=", "<=", "in [low, high]" and "every value": a value at a bound holds, one value out of
    bounds is enough to fail, and a NaN never holds."""
    assert claims.at_least("c", 1, 0.8, 0.8).held and claims.at_most("c", 1, 1.1, 1.1).held
    assert claims.within("c", 0.5, 0.4, 0.4, 0.6).held and claims.within("c", 0.5, 0.6, 0.4, 0.6).held
    assert claims.all_within("c", "x", {"a": 0.4, "b": 0.6}, 0.4, 0.6).held
    assert not claims.all_within("c", "x", {"a": 0.39, "b": 0.5, "c": 0.5}, 0.4, 0.6).held
    assert not claims.all_within("c", "x", {"a": 0.5, "b": math.nan}, 0.4, 0.6).held
    assert claims.all_of("c", "x", {"t1": 0.8, "t2": 0.9}, 0.8).held
    assert claims.all_of("c", "x", {"32": 1.1, "48": 1.05}, 1.1, above=False).held
    assert not claims.all_of("c", "x", {"t1": 0.79, "t2": 0.9, "t3": 0.95}, 0.8).held
    assert not claims.all_of("c", "x", {"32": 1.2, "48": 1.05}, 1.1, above=False).held
    assert not claims.all_of("c", "x", {"t1": math.nan, "t2": 0.9}, 0.8).held
    assert claims.exceeds("c", "x", {"a": 0.9, "b": 0.6}, "a", "b", margin=0.3).held
    pairs = claims.all_exceed("c", "x", {"t1": 0.9, "t2": 0.7}, {"t1": 0.8, "t2": 0.69}, ("first", "last"))
    assert pairs.held and pairs.ours == {"t1 first": 0.9, "t1 last": 0.8, "t2 first": 0.7, "t2 last": 0.69}
    assert not claims.all_exceed("c", "x", {"t1": 0.9, "t2": 0.7}, {"t1": 0.8, "t2": 0.7}, ("a", "b")).held
    assert not claims.all_exceed("c", "x", {"t1": 0.9, "t2": math.nan}, {"t1": 0.8, "t2": 0.7}, ("a", "b")).held


def test_what_was_tried_is_noted_only_for_claims_that_did_not_hold():
    result = [claims.at_least("big", 1, 2.0, 1.5), claims.at_least("huge", 100, 2.0, 50)]
    notes = claims.tried_notes(result, {"big": "tried A.", "hu": "tried B."})
    assert notes == ["Not held: huge. tried B."]
    assert claims.tried_notes(result, {}) == []
    with pytest.raises(ValueError, match="opens 0"):
        claims.tried_notes(result, {"small": "tried C."})


@pytest.fixture
def fake_recipes(monkeypatch):
    calls = []

    def fake(scale, out, log, jobs, device):
        calls.append(out.name)
        out.mkdir(parents=True, exist_ok=True)
        return RecipeResult(out.name, scale, [claims.at_least("value is big", 1.0, 2.0, 1.5),
                                              claims.at_least("value is huge", 100, 2.0, 50)],
                            tables=[{"title": "t", "columns": ["a"], "rows": [[1.0]]}])

    module = type(sys)("fake_recipes")
    module.run = fake
    module.runs = lambda scale, out: {}  # trains nothing
    monkeypatch.setitem(sys.modules, "fake_recipes", module)
    monkeypatch.setattr(runner, "RECIPES", {"one": ("fake_recipes:run", "first"), "two": ("fake_recipes:run", "second")})
    return calls


def test_runner_writes_results_and_report_and_resumes(tmp_path, fake_recipes):
    data = runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    assert fake_recipes == ["one", "two"]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["recipes"]) == {"one", "two"} and results["scale"] == "smoke" and "machine" in results
    claim = results["recipes"]["one"]["claims"][0]
    assert claim == {"claim": "value is big", "paper": 1.0, "ours": 2.0, "held": True, "rule": "ours >= 1.5"}
    report = (tmp_path / "report.md").read_text()
    assert "**2 of 4 claims held.**" in report and "| one | value is huge | 100 | 2 | **no** |" in report
    # What smoke numbers can say, and how each recipe's were made (one --out can hold several invocations').
    assert "**Smoke scale only checks that the recipes run**" in report and "Quick scale" not in report
    threads = torch.get_num_threads()
    assert report.count(f"_code {runner.code_version()}; 1 training job, {threads} torch thread") == 2
    # A second run skips finished recipes; --force redoes them.
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    assert fake_recipes == ["one", "two"]
    runner.reproduce(["two"], "smoke", tmp_path, force=True, log=lambda _: None)
    assert fake_recipes == ["one", "two", "two"]
    assert data["recipes"]["one"]["claims"][1]["held"] is False


def test_a_result_that_other_code_computed_is_redone_and_left_out_until_then(tmp_path, fake_recipes, monkeypatch):
    """A finished recipe's numbers and verdicts come from the code that computed them (its analysis, rules,
    thresholds): after a change they are computed again -- on the finished trainings -- rather than reported
    under today's rules. One not rerun yet is left out of results.json, not merged in."""
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    assert json.loads((tmp_path / "one" / "result.json").read_text())["code"] == runner.code_version()
    monkeypatch.setattr(runner, "code_version", lambda: "another")
    lines = []
    runner.reproduce(["two"], "smoke", tmp_path, log=lines.append)
    assert fake_recipes == ["one", "two", "two"]  # two again, one not asked for
    assert f"[one] {tmp_path / 'one' / 'result.json'} was computed by other poslab code; the recipe counts as not " \
           "finished (its finished trainings are reused when it runs)" in lines
    assert set(json.loads((tmp_path / "results.json").read_text())["recipes"]) == {"two"}
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)  # now both are this code's: skipped
    assert fake_recipes == ["one", "two", "two", "one"]


def test_results_keep_the_date_and_machine_of_their_runs(tmp_path, fake_recipes, monkeypatch):
    """A rerun that only skipped finished recipes stamped results.json (and the README line rendered from it)
    with its own date and load average, as if it had measured something."""
    monkeypatch.setattr(runner, "_now", lambda: "2026-01-01 10:00 UTC")
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    first = json.loads((tmp_path / "results.json").read_text())
    assert first["date"] == "2026-01-01 10:00 UTC" and first["recipes"]["one"]["date"] == first["date"]
    monkeypatch.setattr(runner, "_now", lambda: "2026-02-02 10:00 UTC")
    elsewhere = {**runner.machine(), "cpus": 999}
    monkeypatch.setattr(runner, "machine", lambda jobs=1: elsewhere)
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    assert json.loads((tmp_path / "results.json").read_text()) == first
    runner.reproduce(["two"], "smoke", tmp_path, force=True, log=lambda _: None)  # redone now, on this machine
    again = json.loads((tmp_path / "results.json").read_text())
    assert again["date"] == "2026-02-02 10:00 UTC" and again["machine"] == elsewhere
    assert again["recipes"]["one"]["date"] == "2026-01-01 10:00 UTC"
    assert "## one (0 s, 2026-01-01 10:00 UTC)" in (tmp_path / "report.md").read_text()


def test_another_scale_is_refused_and_keeps_the_results(tmp_path, fake_recipes):
    """The smoke results stay (a quick run discarded them from results.json and report.md), --force or not."""
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    before = {name: (tmp_path / name).read_text() for name in ("results.json", "report.md")}
    for force in (False, True):
        with pytest.raises(PoslabError, match=f"^{re.escape(str(tmp_path))} holds smoke-scale results; one --out "
                                              "holds one scale, so choose another --out for --scale quick$"):
            runner.reproduce(["one"], "quick", tmp_path, force=force, log=lambda _: None)
    assert fake_recipes == ["one", "two"]
    assert {name: (tmp_path / name).read_text() for name in before} == before


def test_a_second_reproduction_into_a_busy_directory_is_refused(tmp_path, fake_recipes):
    """Two reproductions into one --out trained the same runs side by side and raced on results.json."""
    from poslab.train.lock import RunLock, RunLocked

    held = RunLock(tmp_path)
    held.acquire()
    try:
        with pytest.raises(RunLocked, match=f"^{re.escape(str(tmp_path))} is in use by another poslab run \\(pid "):
            runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
        assert fake_recipes == [] and not (tmp_path / "results.json").exists()
    finally:
        held.release()
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)  # free again: runs, and gives the lock back
    assert fake_recipes == ["one", "two"] and not (tmp_path / ".lock").exists()


def interrupt(recipe: str, monkeypatch, error: BaseException = KeyboardInterrupt(), trained: bool = True) -> None:
    """Make a fake recipe stop as a Ctrl-C (or ``error``) would stop it, after its first training wrote a
    checkpoint unless not ``trained``."""
    def boom(scale, out, log, jobs, device):
        (out / "data").mkdir(parents=True)  # as a recipe preparing its corpus
        if trained:
            (out / "runs" / "model" / "checkpoints").mkdir(parents=True)
            (out / "runs" / "model" / "checkpoints" / "step_10.pt").write_bytes(b"weights")
        raise error

    sys.modules["fake_recipes"].boom = boom
    monkeypatch.setitem(runner.RECIPES, recipe, ("fake_recipes:boom", recipe))


@pytest.mark.parametrize("file, folder, message", [
    # `poslab train --out DIR` then `poslab reproduce --out DIR` wrote the report beside the run's checkpoints.
    ("config.yaml", "checkpoints", "is a training run .*; reproduce into another --out"),
    # A prepared corpus (say) named as --out got the report, results.json and recipe directories mixed in.
    ("manifest.json", "train", "holds files but no reproduction .*; reproduce into a new or empty --out"),
])
def test_a_directory_of_other_files_is_refused_as_out(file, folder, message, tmp_path, fake_recipes):
    (tmp_path / file).write_text("seed: 0\n")
    (tmp_path / folder).mkdir()
    with pytest.raises(PoslabError, match=f"^{re.escape(str(tmp_path))} {message}$"):
        runner.reproduce(["one"], "smoke", tmp_path, log=lambda _: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([file, folder]) and fake_recipes == []


def test_a_directory_holding_only_a_lock_is_a_reproduction_s(tmp_path, fake_recipes):
    (tmp_path / ".lock").write_text("")  # what a reproduction killed before its first file leaves
    runner.reproduce(["one"], "smoke", tmp_path, log=lambda _: None)
    assert fake_recipes == ["one"]


def test_another_scale_is_refused_before_any_recipe_finished(tmp_path, fake_recipes, monkeypatch):
    """DIR/scale.json names the scale from the start: a quick run in a directory whose smoke run was stopped in
    its first recipe used to fail later, on the first training, with "cannot resume: model.d_model differs"."""
    interrupt("one", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    assert not (tmp_path / "results.json").exists()
    with pytest.raises(PoslabError, match=f"^{re.escape(str(tmp_path))} holds smoke-scale trainings "
                                          f"\\(see {re.escape(str(tmp_path / 'scale.json'))}\\); one --out holds one "
                                          f"scale, .* or delete {re.escape(str(tmp_path))} to start it over$"):
        runner.reproduce(["one"], "quick", tmp_path, log=lambda _: None)
    runner.reproduce(["two"], "smoke", tmp_path, log=lambda _: None)  # the same scale goes on
    assert fake_recipes == ["two"]
    # A directory recipes wrote before markers existed gets none: what it holds is unknown.
    legacy = tmp_path / "legacy"
    (legacy / "two").mkdir(parents=True)
    runner.reproduce(["two"], "smoke", legacy, log=lambda _: None)
    assert not (legacy / "scale.json").exists()


def test_a_first_reproduction_that_failed_before_writing_anything_leaves_no_marker(tmp_path, fake_recipes,
                                                                                 monkeypatch):
    """A paper-scale run whose corpus could not be reached left scale.json and empty recipe directories: another
    scale was then refused in a directory holding nothing."""
    out = tmp_path / "out"
    interrupt("one", monkeypatch, PoslabError("cannot load Hugging Face dataset 'x'"), trained=False)
    with pytest.raises(PoslabError, match="cannot load"):
        runner.reproduce(["all"], "smoke", out, log=lambda _: None)
    assert [p.name for p in out.iterdir()] == []
    runner.reproduce(["two"], "quick", out, log=lambda _: None)  # another scale is welcome there
    assert json.loads((out / "scale.json").read_text()) == {"scale": "quick"}
    # A marker that an earlier reproduction wrote stays, as does one whose run wrote a file before it failed.
    interrupt("one", monkeypatch, trained=False)
    with pytest.raises(KeyboardInterrupt):
        runner.reproduce(["one"], "quick", out, log=lambda _: None)
    assert (out / "scale.json").exists()
    # A training that got as far as taking its lock is a training begun: kept, and the failure still reported
    locked = tmp_path / "locked"

    def locked_then_failed(scale, out, log, jobs, device):
        (out / "runs" / "model").mkdir(parents=True)
        (out / "runs" / "model" / ".lock").write_text("1")
        raise PoslabError("cannot load")

    monkeypatch.setattr(sys.modules["fake_recipes"], "boom", locked_then_failed)
    with pytest.raises(PoslabError, match="cannot load"):
        runner.reproduce(["one"], "quick", locked, log=lambda _: None)
    assert (locked / "scale.json").exists() and (locked / "one" / "runs" / "model" / ".lock").exists()
    fresh = tmp_path / "fresh"
    interrupt("one", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        runner.reproduce(["one"], "quick", fresh, log=lambda _: None)
    assert (fresh / "scale.json").exists() and (fresh / "one" / "runs" / "model" / "checkpoints").is_dir()


def test_damaged_results_are_rebuilt_or_redone(tmp_path, fake_recipes):
    """results.json is rebuilt from the recipes' result.json (it was a JSONDecodeError or an AttributeError);
    a damaged result.json counts as not finished, says so, and is redone (it was an AttributeError)."""
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    for text in ("{garb", "[1, 2]", '{"scale": "smoke", "recipes": 3}'):
        (tmp_path / "results.json").write_text(text)
        runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
        assert set(json.loads((tmp_path / "results.json").read_text())["recipes"]) == {"one", "two"}
    assert fake_recipes == ["one", "two"]
    for content in (b"[1]", b"{garb", b'{"scale": "smoke"}', b"\xff"):
        (tmp_path / "one" / "result.json").write_bytes(content)
        lines = []
        runner.reproduce(["two"], "smoke", tmp_path, log=lines.append)  # "one" is not redone unless named
        assert "one" not in json.loads((tmp_path / "results.json").read_text())["recipes"]
        runner.reproduce(["all"], "smoke", tmp_path, log=lines.append)
        assert lines[0] == f"[one] {tmp_path / 'one' / 'result.json'} is damaged (not a recipe's result); the " \
                           "recipe counts as not finished"
        assert set(json.loads((tmp_path / "results.json").read_text())["recipes"]) == {"one", "two"}
    assert fake_recipes == ["one", "two"] + ["one"] * 4


def test_interrupted_recipe_leaves_finished_ones(tmp_path, fake_recipes, monkeypatch):
    interrupt("two", monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None)
    assert json.loads((tmp_path / "results.json").read_text())["recipes"].keys() == {"one"}
    assert (tmp_path / "one" / "result.json").exists() and not (tmp_path / "two" / "result.json").exists()


def test_unknown_recipe_lists_valid_ones(capsys):
    assert main(["reproduce", "adjacencyy"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean 'adjacency'" in err and "indirect-indexing" in err
    assert main(["reproduce", "all", "bogus"]) == 2
    assert "'all' runs every recipe, so give it alone" in capsys.readouterr().err


def test_bad_jobs_and_threads_are_refused_with_plan_too(capsys, tmp_path):
    for option in ("--jobs", "--threads"):
        assert main(["reproduce", "frequencies", "--scale", "smoke", "--plan", option, "-2",
                     "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"poslab: error: {option} must be >= 1, got -2\n"
        # 5000 threads on 2 CPUs took 28x as long; 100000 failed with "Cannot allocate memory"
        cpus = len(os.sched_getaffinity(0))
        assert main(["reproduce", "frequencies", "--scale", "smoke", option, str(cpus + 1),
                     "--out", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == f"poslab: error: {option} {cpus + 1} is more than the {cpus} CPUs this " \
                                          f"process may use; give at most {cpus}\n"
    assert not (tmp_path / "out").exists()


def test_unknown_scale_and_missing_name(capsys, tmp_path):
    assert main(["reproduce", "adjacency", "--scale", "huge", "--out", str(tmp_path)]) == 2
    assert "--scale must be one of" in capsys.readouterr().err
    assert main(["reproduce"]) == 2
    assert "name a recipe or 'all'" in capsys.readouterr().err


def test_empty_out_is_refused(capsys, tmp_path, monkeypatch, fake_recipes):
    """An empty --out was the current directory (here a scratch one, should the refusal fail)."""
    monkeypatch.chdir(tmp_path)
    assert main(["reproduce", "one", "--scale", "smoke", "--out", ""]) == 2
    assert "argument --out: the path is empty" in capsys.readouterr().err
    assert not fake_recipes and not list(tmp_path.iterdir())


def test_analysis_device(capsys, tmp_path, monkeypatch, fake_recipes):
    """auto measures on this process's GPU when there is one; cuda without one is one clear line, exit 2,
    before anything is trained or written."""
    from poslab.analysis.runs import analysis_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert analysis_device("auto") == "cpu" and analysis_device("cpu") == "cpu"
    assert main(["reproduce", "all", "--scale", "smoke", "--out", str(tmp_path / "r"), "--analysis-device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and err.count("\n") == 1 and not (tmp_path / "r").exists() and not fake_recipes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert analysis_device("auto") == "cuda:1" and analysis_device("cpu") == "cpu"


def test_recipes_measure_on_the_analysis_device(tmp_path, monkeypatch):
    """The device reaches every Run.load of every recipe at smoke scale ('cpu:0', which only the runner's
    argument can have set)."""
    from poslab.analysis import runs as runs_module

    devices = []
    load = runs_module.Run.load.__func__
    monkeypatch.setattr(runs_module.Run, "load",
                        classmethod(lambda cls, path, checkpoint=None, device="cpu":
                                    devices.append(device) or load(cls, path, checkpoint, device)))
    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None, device="cpu:0")
    assert len(devices) >= 4 and set(devices) == {"cpu:0"}


def test_unwritable_output(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.geteuid() == 0:  # root writes anywhere (CI runs as root): refuse the write as the kernel would a user
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")
        monkeypatch.setattr(runner.tempfile, "NamedTemporaryFile", refuse)
    assert main(["reproduce", "adjacency", "--out", str(locked / "x")]) == 2
    err = capsys.readouterr().err
    assert "cannot write to output directory" in err and "Permission denied" in err and err.count("\n") == 1


def test_output_path_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("not a directory")
    assert main(["reproduce", "adjacency", "--out", str(target)]) == 2
    assert capsys.readouterr().err == f"poslab: error: {target} is a file, not a directory; choose another --out\n"
    assert target.read_text() == "not a directory"


def test_list(capsys):
    assert main(["reproduce", "--list"]) == 0
    names = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert names == ["adjacency", "indirect-indexing", "extrapolation", "frequencies", "pope-ablation", "dstg"]


def test_workers_leave_ctrl_c_to_the_reproduction():
    """A Ctrl-C reaches the whole process group: workers caught by it while still importing printed a traceback
    each (81 lines of stderr). They are spawned ignoring it; the reproduction ends them, its own handler intact."""
    import signal

    from poslab.experiments.common import _submit_deaf_to_interrupts, closing_pool, worker_pool

    before = signal.getsignal(signal.SIGINT)
    with closing_pool(worker_pool(1)) as pool:
        assert _submit_deaf_to_interrupts(pool, signal.getsignal, signal.SIGINT).result(timeout=120) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_every_recipe_runs_end_to_end_at_smoke_scale(tmp_path):
    """Every recipe, through the command line, at the seconds-long smoke scale (its claims mean nothing)."""
    result = subprocess.run([sys.executable, "-m", "poslab", "reproduce", "all", "--scale", "smoke", "--out",
                             str(tmp_path)], capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "results.json").read_text())
    assert list(data["recipes"]) == list(runner.RECIPES)
    for name, record in data["recipes"].items():
        assert record["claims"], name
        for figure in record["figures"]:
            assert (tmp_path / figure).is_file(), figure
    assert (tmp_path / "report.md").read_text().startswith("# poslab reproduction (smoke scale)")
    # The quick scale's notes on failed claims name their claims by opening words, which no scale changes.
    from poslab.experiments import adjacency, dstg, extrapolation, frequencies, indirect_indexing, pope_ablation
    quick_tried = {"adjacency": adjacency.SCALES["quick"]["tried"], "dstg": dstg.SCALES["quick"]["tried"],
                   "indirect-indexing": indirect_indexing.SCALES["quick"]["tried"],
                   "extrapolation": extrapolation.SCALES["quick"]["tried"],
                   "frequencies": frequencies.TRIED["quick"], "pope-ablation": pope_ablation.TRIED["quick"]}
    for name, tried in quick_tried.items():
        claims.tried_notes([claims.Claim(**c) for c in data["recipes"][name]["claims"]], tried)  # raises if unmatched
    details = data["recipes"]["dstg"]["details"]
    assert details["spectra_seeds"] == [0, 1]
    assert {m: len(v) for m, v in details["top2_by_seed"].items()} == {"dstg": 2, "ap_neobert": 2}
    assert set(details["top2_at_width"]) == {"dstg", "ap_neobert"} and details["ap_width"] >= 1
    assert set(details["segment_beyond_position"]) == set(dstg.MODELS)
    lm = [c for c in data["recipes"]["extrapolation"]["claims"] if c["claim"].startswith("PoPE models the text")]
    assert len(lm) == 1 and set(lm[0]["ours"]) == {"32 pope", "32 rope", "48 pope", "48 rope"}
    accuracy = next(t for t in data["recipes"]["adjacency"]["tables"] if t["title"].startswith("Exact-match"))
    assert all(row[3].endswith(" of 40") for row in accuracy["rows"])  # distinct problems of the smoke test set


def test_parallel_runs_equal_sequential_ones_and_skip_finished(tmp_path):
    """Two trainings side by side in worker processes give the metrics they give one after another (CPU
    training is deterministic per seed), write their progress to a log, and are not trained again. A fine-tune
    of one of them in the same call waits for its start instead of racing it in another worker."""
    from poslab.experiments.common import _ahead, ensure_runs
    from poslab.experiments.indirect_indexing import SCALES, run_config

    def runs(root):
        out = {seed: (run_config(SCALES["smoke"], "pope", seed), root / f"s{seed}") for seed in (0, 1)}
        base = out[0][0]
        out["tuned"] = ({**base, "train": {**base["train"], "steps": 2, "init_from": str(root / "s0")}},
                        root / "tuned")
        return out

    lines = []
    parallel = ensure_runs(runs(tmp_path / "par"), lines.append, jobs=2)
    sequential = ensure_runs(runs(tmp_path / "seq"), lambda _: None, jobs=1)
    timing = ("seconds", "tokens_per_s")
    learned = {name: {k: v for k, v in m.items() if k not in timing} for name, m in parallel.items()}
    assert learned == {name: {k: v for k, v in m.items() if k not in timing} for name, m in sequential.items()}
    assert learned[0] != learned[1]
    assert [line for line in lines if "worker processes" in line] == \
           ["training in 2 worker processes (each run's progress: <run directory>.log)"]
    assert "step 3/3" in (tmp_path / "par" / "s0.log").read_text()
    assert not (tmp_path / "par" / "tuned.log").exists() and _ahead == {}
    lines.clear()
    assert ensure_runs(runs(tmp_path / "par"), lines.append, jobs=2) == parallel and lines == []


def test_a_recipes_training_stopped_by_ctrl_c_saves_its_step_and_the_rerun_continues(tmp_path, monkeypatch):
    """A training the reproduction runs in its own process (jobs 1, every one under torchrun) lost the steps
    since its last periodic checkpoint to a Ctrl-C or torchrun's SIGTERM; now it saves the step under way."""
    import signal

    from poslab.experiments.common import ensure_runs
    from poslab.experiments.indirect_indexing import SCALES, run_config
    from poslab.train.checkpoint import saved_step
    from test_train import ask_to_stop_in_step

    config = run_config(SCALES["smoke"], "pope", 0)
    config = {**config, "train": {**config["train"], "checkpoint_every": 100}}
    ask_to_stop_in_step(1, signal.SIGTERM, monkeypatch.setattr)
    with pytest.raises(KeyboardInterrupt):
        ensure_runs({0: (config, tmp_path / "s0")}, lambda _: None, jobs=1)
    assert saved_step(tmp_path / "s0") == 2 and not (tmp_path / "s0" / "final.json").exists()
    monkeypatch.undo()
    assert ensure_runs({0: (config, tmp_path / "s0")}, lambda _: None, jobs=1)[0]["step"] == config["train"]["steps"]


def test_an_interrupted_reproduction_says_the_same_command_resumes(tmp_path, fake_recipes, monkeypatch, capsys):
    interrupt("two", monkeypatch)
    assert main(["reproduce", "all", "--scale", "smoke", "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"poslab: interrupted; the same command resumes: the finished recipes and trainings in {tmp_path} are kept, "
        "and an unfinished training continues from its last checkpoint")


def test_a_later_recipes_stale_run_is_refused_before_anything_trains(tmp_path, fake_recipes):
    """Trainings start ahead of their recipe, so a run trained with other settings in the last recipe stops the
    reproduction at its start, not after the recipes before it have run for an hour."""
    from poslab.experiments.common import ensure_run
    from poslab.experiments.indirect_indexing import SCALES, run_config

    config = run_config(SCALES["smoke"], "pope", 0)
    ensure_run(config, tmp_path / "two" / "s0", lambda _: None)
    changed = {**config, "model": {**config["model"], "init_std": 0.05}}
    sys.modules["fake_recipes"].runs = lambda scale, out: {0: (changed, out / "s0")} if out.name == "two" else {}
    with pytest.raises(PoslabError, match=r"^\[two\] .*s0 was trained with other settings \(run.model.init_std "
                                          r"\(0.02 there, 0.05 now\)\) than this version of the recipe uses; delete"):
        runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None, jobs=2)
    assert fake_recipes == [] and not (tmp_path / "one").exists()


def test_later_recipes_train_while_earlier_ones_are_analysed(tmp_path, monkeypatch):
    """With --jobs 2 the workers train the next recipe's models while this process analyses the last one's, so
    no core idles between recipes; the models are those trained one after another, and a fine-tune waits for
    its recipe, which trains it once its start is there."""
    from poslab.experiments.common import _ahead, ensure_runs
    from poslab.experiments.indirect_indexing import SCALES, run_config

    def trainings(out: Path) -> dict:
        runs = {seed: (run_config(SCALES["smoke"], "pope", seed), out / "runs" / f"s{seed}") for seed in (0, 1)}
        if out.name == "two":
            base = runs[0][0]
            runs["tuned"] = ({**base, "train": {**base["train"], "steps": 2, "init_from": str(runs[0][1])}},
                             out / "runs" / "tuned")
        return runs

    seen = {}

    def analyse(scale, out, log, jobs, device):
        runs = trainings(out)
        seen[out.name] = ensure_runs({k: v for k, v in runs.items() if k != "tuned"}, log, jobs)
        if out.name == "one":  # still analysing "one": "two"'s models train meanwhile
            deadline = time.monotonic() + 120
            while not all((tmp_path / "two" / "runs" / f"s{seed}" / "final.json").exists() for seed in (0, 1)):
                assert time.monotonic() < deadline, "the next recipe's trainings did not start ahead"
                time.sleep(0.2)
            assert not (tmp_path / "two" / "runs" / "tuned").exists()
        else:
            seen["tuned"] = ensure_runs({"tuned": runs["tuned"]}, log, jobs)
        return RecipeResult(out.name, scale, [claims.at_least("value", 1.0, 2.0, 1.5)])

    module = type(sys)("ahead_recipes")
    module.run, module.runs = analyse, lambda scale, out: trainings(out)
    monkeypatch.setitem(sys.modules, "ahead_recipes", module)
    monkeypatch.setattr(runner, "RECIPES", {"one": ("ahead_recipes:run", "first"), "two": ("ahead_recipes:run", "")})
    lines = []
    runner.reproduce(["all"], "smoke", tmp_path, log=lines.append, jobs=2)
    assert sum(line.startswith("training in 2 worker processes") for line in lines) == 1 and _ahead == {}
    timing = ("seconds", "tokens_per_s")
    sequential = ensure_runs(trainings(tmp_path / "seq" / "two"), lambda _: None, jobs=1)
    for name in (0, 1, "tuned"):
        got = seen["tuned"]["tuned"] if name == "tuned" else seen["two"][name]
        assert {k: v for k, v in got.items() if k not in timing} == \
               {k: v for k, v in sequential[name].items() if k not in timing}


def test_readme_section_is_rendered_from_results(tmp_path, fake_recipes):
    import importlib.util

    runner.reproduce(["all"], "smoke", tmp_path, log=lambda _: None, jobs=2)
    spec = importlib.util.spec_from_file_location("readme_results", Path(__file__).parent.parent / "scripts" /
                                                  "readme_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.section(json.loads((tmp_path / "results.json").read_text()), "runs/x")
    assert text.startswith("## Results of a quick run\n") and "--scale smoke --out runs/x" in text
    assert "2 training jobs" in text and "**2 of 4 claims held.**" in text
    assert "| one | value is huge | 100 | 2 | **no** |" in text


def test_reproduce_under_torchrun(tmp_path):
    """Two gloo processes: both train every run (DDP), agree on what to train, and only rank 0 measures and
    writes. A rank that decided on its own whether a run existed used to deadlock the second training."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "poslab",
               "reproduce", "indirect-indexing", "extrapolation", "frequencies", "--scale", "smoke", "--out",
               str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    # torchrun's summary (the tail) names only the signal; the worker's own error line comes earlier.
    causes = [line for line in result.stderr.splitlines()
              if any(word in line for word in ("Error", "error:", "terminate", "what()", "Exception"))]
    assert result.returncode == 0, "\n".join(causes[:20]) + "\n...\n" + result.stderr[-1500:]
    assert result.stdout.count("claims held; report:") == 1
    data = json.loads((tmp_path / "results.json").read_text())
    assert list(data["recipes"]) == ["indirect-indexing", "extrapolation", "frequencies"]
    assert (tmp_path / "extrapolation" / "runs" / "rope" / "final.json").exists()


@pytest.mark.parametrize("name", list(runner.RECIPES))
def test_paper_scale_trainings_are_valid_configs(name, tmp_path):
    """Every paper-scale training validates and builds (on the meta device, with a stand-in vocabulary: the
    real one comes from data prepared on the GPU machine, which nothing here downloads)."""
    import importlib

    import torch

    from poslab.data import DataConfig
    from poslab.models import build_model
    from poslab.train import RunConfig

    module = importlib.import_module(runner.RECIPES[name][0].split(":")[0])
    trainings = module.runs("paper", tmp_path / name)
    assert trainings
    for key, (config, out) in trainings.items():
        cfg = RunConfig.from_dict({**config, "model": {**config["model"], "vocab_size": 1000}})
        sized = name == "adjacency" and all(isinstance(k, int) for k in key)  # (layers, width): 6 x 192 is 2.7M
        with torch.device("meta"):
            assert build_model(cfg.model).num_parameters() > (2_000_000 if sized else 10_000_000), out
        data = dict(config["data"])
        if data.pop("kind") in ("lm", "mlm"):
            assert DataConfig.from_options(data).source["type"] == "hf"  # a corpus by name, streamed


def test_paper_scale_language_models_read_their_corpus_once(tmp_path):
    """The extrapolation models once read 52B tokens from a 4B-token preparation, 13 passes nobody chose. They
    now prepare the whole FineWeb 10B-token sample and read at most that many tokens, as llm.c's GPT-2 runs."""
    from poslab.experiments import extrapolation

    for config, _ in extrapolation.runs("paper", tmp_path).values():
        source, train = config["data"]["source"], config["train"]
        if train.get("init_from"):
            continue  # the YaRN fine-tune: 500 steps, 0.26B tokens
        assert (source["config_name"], source["max_documents"]) == ("sample-10BT", None)
        assert 9e9 < train["steps"] * train["batch_size"] * config["data"]["seq_len"] <= 10e9


@pytest.mark.parametrize("recipe", ["extrapolation", "dstg"])
def test_quick_tokenizers_keep_every_word_whole(recipe, tmp_path):
    """A full vocabulary leaves the last, tied merges to the trainer's per-process hash order: at a
    2,048-token cap the extrapolation corpus split 14 words, which ones changed between runs, and so did
    the recipe's numbers. The quick caps must sit above what the trainer reaches with every word (every
    pre-tokenizer piece it trains on) whole."""
    from poslab.data.config import DataConfig
    from poslab.data.sources import document_text, open_source
    from poslab.data.tokenizer import train_tokenizer
    from poslab.experiments import dstg, extrapolation

    if recipe == "extrapolation":
        section = extrapolation.run_config(extrapolation.SCALES["quick"], "pope", tmp_path)["data"]
    else:
        section = dstg.data_section(dstg.SCALES["quick"], tmp_path)
    section = {k: v for k, v in section.items() if k not in ("kind", "cache_dir", "masking")}
    config = DataConfig(**section)
    skip = config.validation_documents  # the tokenizer trains on the documents after the validation split
    texts = [document_text(d)[0] for d in itertools.islice(open_source(config.source).documents(), skip,
                                                            skip + config.tokenizer.train_documents)]
    tok = train_tokenizer(config.tokenizer, texts)
    vocab = tok.get_vocab()
    words = {w for t in texts for w, _ in tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(t))}
    assert len(vocab) < config.tokenizer.vocab_size
    assert sorted(w for w in words if w not in vocab) == []


def test_dstg_spectra_claims_train_every_seed_of_dstg_and_ap_neobert(tmp_path):
    """The AP table's spectra depend on the initial draw at quick scale: DSTG and AP-NeoBERT train at every
    spectra seed, the other two baselines once, all from the same model and data sections."""
    from poslab.experiments import dstg

    trainings = dstg.runs("quick", tmp_path)
    assert {name: config["seed"] for name, (config, _) in trainings.items()} == {
        "dstg": 0, "dstg-s1": 1, "dstg-s2": 2, "ap_neobert": 0, "ap_neobert-s1": 1, "ap_neobert-s2": 2,
        "rope_neobert": 0, "rp_neobert": 0}
    # Queued longest first, so that the workers finish together: every DSTG seed, then RP-, RoPE-, AP-NeoBERT.
    assert list(trainings) == ["dstg", "dstg-s1", "dstg-s2", "rp_neobert", "rope_neobert", "ap_neobert",
                               "ap_neobert-s1", "ap_neobert-s2"]
    for name in ("dstg-s2", "ap_neobert-s1"):
        config, out = trainings[name]
        first = trainings[name.split("-")[0]][0]
        assert config["model"] == first["model"] and config["data"] == first["data"] and out.name == name


def test_a_finished_run_trained_with_other_settings_is_not_reused(tmp_path):
    """A recipe whose settings changed since its run finished (a new poslab version) must not report the old
    run's numbers under the new settings; paths and bookkeeping may differ (an --out moved elsewhere)."""
    from poslab.experiments.common import ensure_run
    from poslab.experiments.indirect_indexing import SCALES, run_config

    config = run_config(SCALES["smoke"], "pope", 0)
    first = ensure_run(config, tmp_path / "run", lambda _: None)
    bookkeeping = {**config, "train": {**config["train"], "log_every": 7, "checkpoint_every": 1}}
    assert ensure_run(bookkeeping, tmp_path / "run", lambda _: None) == first
    changed = {**config, "model": {**config["model"], "init_std": 0.05}}
    with pytest.raises(PoslabError, match=r"run was trained with other settings \(run.model.init_std \(0.02 there, "
                                          r"0.05 now\)\).*delete it to train it again"):
        ensure_run(changed, tmp_path / "run", lambda _: None)
    # A recipe that now trains fewer steps failed with "set train.steps to 3 or more", which a reproduce user
    # cannot do; one that trains more resumed the finished run under a schedule it did not start with.
    for steps in (2, 5):
        other = {**config, "train": {**config["train"], "steps": steps}}
        with pytest.raises(PoslabError, match=rf"\(run.train.steps \(3 there, {steps} now\)\)"):
            ensure_run(other, tmp_path / "run", lambda _: None)
    (tmp_path / "run" / "final.json").unlink()  # interrupted before its end: refused all the same
    with pytest.raises(PoslabError, match=r"run.model.init_std \(0.02 there, 0.05 now\)"):
        ensure_run(changed, tmp_path / "run", lambda _: None)


def test_a_run_trained_on_data_an_older_poslab_made_is_not_reused(tmp_path, monkeypatch):
    """The config alone does not say what data a run saw: a new task sampler or tokenizer training changes
    the batches of the same config. A run records the data version (data.json) and a recipe refuses one made
    with another, or with none recorded (a run from before the record)."""
    import poslab.tasks
    from poslab.experiments.common import ensure_run, first_trained_otherwise
    from poslab.experiments.indirect_indexing import SCALES, run_config

    config = run_config(SCALES["smoke"], "pope", 0)
    ensure_run(config, tmp_path / "run", lambda _: None)
    assert json.loads((tmp_path / "run" / "data.json").read_text()) == {"task_problems": poslab.tasks.DATA_VERSION}
    assert first_trained_otherwise({"pope": (config, tmp_path / "run")}) is None
    monkeypatch.setattr(poslab.tasks, "DATA_VERSION", poslab.tasks.DATA_VERSION + 1)
    new = poslab.tasks.DATA_VERSION
    stale = rf"run was trained with other settings \(data version.task_problems \({new - 1} there, {new} now\)\)"
    with pytest.raises(PoslabError, match=stale + " than this version of the recipe uses; delete it"):
        ensure_run(config, tmp_path / "run", lambda _: None)
    assert re.search(stale, first_trained_otherwise({"pope": (config, tmp_path / "run")}))
    (tmp_path / "run" / "data.json").unlink()
    with pytest.raises(PoslabError, match=r"\(data version unknown: no readable data.json, as in runs from before"):
        ensure_run(config, tmp_path / "run", lambda _: None)


def test_a_fine_tune_of_a_base_trained_again_into_other_weights_is_not_reused(tmp_path):
    """A fine-tune's config names its start by path: extrapolation's YaRN run kept its numbers after the RoPE
    run under it was deleted and trained again into other weights (another machine rounds otherwise). The run
    records the weights it started from (init.json); the same weights again are reused, other ones refused."""
    from poslab.experiments.common import ensure_run, first_trained_otherwise
    from poslab.experiments.indirect_indexing import SCALES, run_config

    base = run_config(SCALES["smoke"], "rope", 0)
    ensure_run(base, tmp_path / "base", lambda _: None)
    tuned = {**base, "train": {**base["train"], "steps": 2, "init_from": str(tmp_path / "base")}}
    first = ensure_run(tuned, tmp_path / "tuned", lambda _: None)
    record = json.loads((tmp_path / "tuned" / "init.json").read_text())
    assert record["step"] == base["train"]["steps"] and len(record["weights_sha256"]) == 64
    shutil.rmtree(tmp_path / "base")
    ensure_run(base, tmp_path / "base", lambda _: None)  # the same machine and code: the same weights
    assert ensure_run(tuned, tmp_path / "tuned", lambda _: None) == first
    shutil.rmtree(tmp_path / "base")
    assert first_trained_otherwise({"tuned": (tuned, tmp_path / "tuned")}) is None  # no base yet: nothing to compare
    ensure_run({**base, "seed": 1}, tmp_path / "base", lambda _: None)  # other weights under the same path
    stale = (r"tuned was trained with other settings \(the weights of train.init_from .*base\S* \(sha256 [0-9a-f]{12} "
             r"there, [0-9a-f]{12} now\)\)")
    assert re.search(stale, first_trained_otherwise({"tuned": (tuned, tmp_path / "tuned")}))
    with pytest.raises(PoslabError, match=stale + " than this version of the recipe uses"):
        ensure_run(tuned, tmp_path / "tuned", lambda _: None)
    (tmp_path / "tuned" / "init.json").unlink()
    with pytest.raises(PoslabError, match=r"\(initial weights unknown: no readable init.json"):
        ensure_run(tuned, tmp_path / "tuned", lambda _: None)


def test_a_damaged_final_json_is_written_again(tmp_path):
    """A final.json cut short (a full disk, a hand edit) is not a finished run's record: the run resumes from
    its last checkpoint, which is its end, and writes the record again."""
    from poslab.experiments.common import ensure_run
    from poslab.experiments.indirect_indexing import SCALES, run_config

    config = run_config(SCALES["smoke"], "pope", 0)
    first = ensure_run(config, tmp_path / "run", lambda _: None)
    (tmp_path / "run" / "final.json").write_text('{"step": 3, "eval_lo')
    again = ensure_run(config, tmp_path / "run", lambda _: None)
    assert {k: again[k] for k in ("step", "eval_loss", "eval_exact_match")} == \
           {k: first[k] for k in ("step", "eval_loss", "eval_exact_match")}
    assert json.loads((tmp_path / "run" / "final.json").read_text())["eval_loss"] == first["eval_loss"]


def test_a_worker_killed_by_the_system_is_one_error_line(tmp_path, monkeypatch):
    """The kernel's OOM killer ends a worker without an exception of its own: the pool reports itself broken."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from poslab.experiments import common
    from poslab.experiments.indirect_indexing import SCALES, run_config

    class KilledPool:
        def submit(self, *args):
            future = Future()
            future.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
            return future

        def shutdown(self, wait=True, cancel_futures=False):
            pass

    monkeypatch.setattr(common, "worker_pool", lambda workers: KilledPool())
    runs = {seed: (run_config(SCALES["smoke"], "pope", seed), tmp_path / f"s{seed}") for seed in (0, 1)}
    with pytest.raises(PoslabError, match=r"^a training worker process died \(killed by the system: out of "
                                          r"memory\?\); rerun to resume .*lower --jobs"):
        common.ensure_runs(runs, lambda _: None, jobs=2)


def test_a_failure_kills_the_workers_instead_of_waiting_for_them(tmp_path):
    """Trainings ahead keep the workers busy for the whole reproduction: an error or an interrupt in the main
    process used to wait, silently, for the trainings they were in (minutes), and a second interrupt could leave
    the interpreter joining idle workers forever. Their work is killed instead; trainings resume from checkpoints."""
    from poslab.experiments.common import closing_pool, worker_pool

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with closing_pool(worker_pool(1)) as pool:
            busy = pool.submit(time.sleep, 120)
            deadline = time.monotonic() + 60
            while not busy.running():
                assert time.monotonic() < deadline
                time.sleep(0.1)
            processes = list(pool._processes.values())
            raise KeyboardInterrupt
    # Not join + is_alive: the pool's own thread reaps the workers too, and a join that loses that race returns
    # before the exit code is known.
    deadline = time.monotonic() + 30
    while any(process.exitcode is None for process in processes):
        assert time.monotonic() < deadline, "a worker outlived the failure"
        time.sleep(0.1)
    assert time.monotonic() - started < 60


@pytest.mark.slow
@pytest.mark.parametrize("recipe, key", [("indirect_indexing", ("rope-half", 0)), ("indirect_indexing", ("alibi-half", 0)),
                                         ("indirect_indexing", ("pope", 0)), ("adjacency", ("nope", "addition", 0))])
def test_paper_scale_task_trainings_take_steps_on_the_cpu(recipe, key, tmp_path):
    """The paper's own task trainings (their models, data and optimiser), two steps each with smaller evaluation
    splits: what the meta-device check above cannot find (a forward, the data's 1M training problems)."""
    import importlib

    from poslab.train import RunConfig, train

    config, _ = importlib.import_module(f"poslab.experiments.{recipe}").runs("paper", tmp_path)[key]
    config = {**config, "data": {**config["data"], "validation_size": 64, "test_size": 64},
              "train": {**config["train"], "steps": 2, "warmup_steps": 1}}
    final = train(RunConfig.from_dict(config), tmp_path / "run")
    assert final["step"] == 2 and math.isfinite(final["eval_loss"])


def _look_on_two_ranks(rank: int, store: str, results: str) -> None:
    import torch.distributed as dist

    from poslab.experiments.common import _rank_zero_view

    import datetime

    # A rank left waiting (the bug) times out and fails the test instead of hanging it.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))

    def look():
        if rank == 0:
            raise PoslabError("runs/x was trained with other settings")
        return "rank 1 must not look"
    try:
        outcome = f"returned {_rank_zero_view(look)}"
    except PoslabError as err:
        outcome = f"raised {err}"
    finally:
        dist.destroy_process_group()
    Path(results, str(rank)).write_text(outcome)


def test_an_error_in_rank_zeros_look_reaches_every_rank(tmp_path):
    """Under torchrun rank 0 decides whether to train; when its look refuses (a run trained with other
    settings), the other ranks raise the same error instead of waiting for an answer for hours."""
    import torch.multiprocessing as mp

    mp.spawn(_look_on_two_ranks, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    assert [(tmp_path / str(rank)).read_text() for rank in (0, 1)] == ["raised runs/x was trained with other settings"] * 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_the_reproduction_is_killed():
    """SIGTERM to the parent alone (not its process group) skips its pool.shutdown: the workers used to finish
    their training into --out and then idle forever."""
    import select
    import signal
    import time

    script = ("import os, sys, time\n"
              "from poslab.experiments.common import worker_pool\n"
              "pool = worker_pool(1)\n"
              "pool.submit(time.sleep, 120)\n"
              "time.sleep(0.5)\n"
              "print(*pool._processes, flush=True)\n"  # the worker's pid, for the test to watch
              "time.sleep(120)\n")
    # stderr: the killed parent's resource tracker warns of the semaphores it leaves
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    worker = started = None
    try:
        assert select.select([parent.stdout], [], [], 120)[0], "the parent did not start its worker"
        worker = int(parent.stdout.readline())
        started = _start_time(worker)
        parent.send_signal(signal.SIGTERM)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while _start_time(worker) == started and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _start_time(worker) != started, "the worker outlived its parent"
    finally:
        parent.kill()
        if started is not None and _start_time(worker) == started:
            os.kill(worker, signal.SIGKILL)


def _start_time(pid: int) -> str | None:
    """The start time of a running process (another process that took its pid starts at another time), None
    when it is gone or a zombie (exited; init may not have collected it yet)."""
    try:
        state, *fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if state == "Z" else fields[18]  # field 22 of proc(5): starttime


def test_paper_scale_without_cuda_warns(tmp_path, fake_recipes, monkeypatch, capsys):
    """It trained for weeks of CPU time without a word."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["reproduce", "one", "--scale", "paper", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err == ("poslab: warning: --scale paper on a machine without CUDA: its trainings take GPU-days (see "
                   f"'poslab reproduce one --scale paper --plan --out {tmp_path}')\n")


def test_report_keeps_compared_numbers_apart():
    """A held "rope > pope" read "rope: 1, pope: 1" (1.00031 vs 1.00022), and "ours <= 1.1" failed by 1.1004 read
    "1.1": claims kept 4 decimals and the report 4 significant digits."""
    from poslab.experiments.report import summary_rows

    made = [claims.exceeds("gap", "x", {"rope": 1.00031, "pope": 1.00022}, "rope", "pope"),
            claims.at_most("flat", "x", 1.1004, 1.1),
            claims.at_least("plain", "x", 0.123456, 0.5),
            claims.lowest("nan", "x", {"a": 0.25, "b": math.nan, "c": 0.75}, "a")]
    data = {"recipes": {"r": {"claims": [json.loads(json.dumps(c.to_dict())) for c in made]}}}
    ours = [row[3] for row in summary_rows(data)]
    assert ours == ["rope: 1.0003, pope: 1.0002", "1.1004", "0.1235", "a: 0.25, b: nan, c: 0.75"]
    assert [c.held for c in made] == [True, False, False, False]


def test_a_margin_is_reached_at_the_margin():
    """A claim "by >= 10%" failed at a gap of exactly 10 points: the rule was ``pope > rope + 0.1``, and in floats
    0.6 + 0.1 is not above 0.7, nor 0.9 - 0.8 at least 0.1. Without a margin, "above" stays strict."""
    for pope, rope in ((0.7, 0.6), (0.9, 0.8), (0.95, 0.85)):
        claim = claims.exceeds("c", "x", {"pope": pope, "rope": rope}, "pope", "rope", margin=0.1)
        assert claim.held, (pope, rope)
    assert claim.rule == "pope - rope >= 0.1"
    assert not claims.exceeds("c", "x", {"pope": 0.69, "rope": 0.6}, "pope", "rope", margin=0.1).held
    assert not claims.exceeds("c", "x", {"pope": math.nan, "rope": 0.6}, "pope", "rope", margin=0.1).held
    tie = claims.exceeds("c", "x", {"rope": 1.5, "pope": 1.5}, "rope", "pope")
    assert not tie.held and tie.rule == "rope > pope"


def test_report_keeps_each_compared_number_apart_from_its_bound():
    """A rule "every value >= 0.8" failed by 0.79996 read "a: 0.8, b: 0.9" (not held): a single number was kept apart
    from its rule's bounds, the values of a dict only from each other."""
    from poslab.experiments.report import summary_rows

    made = [claims.all_of("every", "x", {"a": 0.79996, "b": 0.9}, 0.8),
            claims.all_of("flat", "x", {"32": 1.10004, "48": 1.05}, 1.1, above=False),
            claims.all_of("plain", "x", {"a": 0.123456, "b": 0.9}, 0.8)]
    data = {"recipes": {"r": {"claims": [c.to_dict() for c in made]}}}
    assert [row[3] for row in summary_rows(data)] == ["a: 0.79996, b: 0.9", "32: 1.10004, 48: 1.05", "a: 0.1235, b: 0.9"]
    assert [c.held for c in made] == [False, False, False]


def test_results_json_keeps_apart_what_a_rule_told_apart_and_a_bound_reached_within_rounding_holds():
    """results.json keeps 6 significant digits, and the report can only show what it keeps: a held "first > last"
    of 0.9000001 and 0.9 was stored as 0.9 and 0.9; "ours >= 0.1" failed at 0.9 - 0.8 (an ulp below 0.1) while
    showing 0.1, where a margin of 0.1 held at the same gap; 0.0999996 fails and must not show as 0.1."""
    from poslab.experiments.report import summary_rows

    made = [claims.exceeds("first", "x", {"first": 0.9000001, "last": 0.9}, "first", "last"),
            claims.all_exceed("each", "x", {"t": 0.90000001}, {"t": 0.9}, ("first", "last")),
            claims.at_least("ulp", "x", 0.9 - 0.8, 0.1),
            claims.at_least("below", "x", 0.0999996, 0.1),
            claims.at_most("ulp above", "x", 0.1 + 0.2, 0.3),
            claims.more_than("ulp above", "x", 0.1 + 0.2, 0.3),
            claims.within("range", "x", 0.6000000000000001, 0.4, 0.6),
            claims.all_of("every", "x", {"a": 0.9 - 0.8, "b": 0.5}, 0.1)]
    stored = [json.loads(json.dumps(c.to_dict())) for c in made]
    assert [c.held for c in made] == [True, True, True, False, True, False, True, True]
    assert [c["ours"] for c in stored[:4]] == [{"first": 0.9000001, "last": 0.9}, {"t first": 0.90000001,
                                                                                   "t last": 0.9}, 0.1, 0.0999996]
    assert [row[3] for row in summary_rows({"recipes": {"r": {"claims": stored}}})][:4] == [
        "first: 0.9000001, last: 0.9", "t first: 0.90000001, t last: 0.9", "0.1", "0.0999996"]
    assert claims.rounded(0.123456789) == 0.123457 and claims.rounded_apart({"a": 1.0, "b": 2}) == {"a": 1.0, "b": 2}


def test_dstg_kept_claim_shows_the_numbers_it_compared():
    """DSTG's "kept in the last layer" claims rounded their R^2 to 4 decimals: a held "dstg > every baseline"
    read "dstg: 0.7149, ap_neobert: 0.7149"."""
    from poslab.experiments.dstg import kept_in_last_layer
    from poslab.experiments.report import summary_rows

    last = {"dstg": 0.714942, "ap_neobert": 0.714861, "rope_neobert": 0.08, "rp_neobert": 0.13}
    claim = kept_in_last_layer("segment-level position", last, best=0.72)
    assert claim.held and claim.claim.startswith("segment-level position kept in DSTG's last layer")
    ours = summary_rows({"recipes": {"dstg": {"claims": [claim.to_dict()]}}})[0][3]
    assert ours.startswith("dstg: 0.71494, ap_neobert: 0.71486,") and ours.endswith("dstg best: 0.72")
    assert not kept_in_last_layer("x", {**last, "rp_neobert": math.nan}, best=0.72).held
    assert not kept_in_last_layer("x", last, best=0.8).held  # 0.715 < 0.9 x 0.8


def test_results_are_strict_json_and_render_the_same_when_rebuilt(tmp_path, fake_recipes, monkeypatch):
    """A NaN or infinite measurement was written as the bare NaN / Infinity that Python reads but JSON has not
    (jq, JSON.parse and other strict readers refused results.json). They are written as strings that
    float() reads back, and the report rebuilt from them reads as the first."""
    def measured(scale, out, log, jobs, device):
        out.mkdir(parents=True, exist_ok=True)
        return RecipeResult(out.name, scale, [claims.at_least("nan", 1.0, math.nan, 0.5),
                                              claims.lowest("inf", "x", {"a": 0.25, "b": math.inf}, "a")],
                            tables=[{"title": "t", "columns": ["a", "b"], "rows": [[-math.inf, 1.5]]}],
                            details={"curve": [1.0, math.nan]})

    sys.modules["fake_recipes"].measured = measured
    monkeypatch.setitem(runner.RECIPES, "one", ("fake_recipes:measured", "first"))

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))

    runner.reproduce(["one"], "smoke", tmp_path, log=lambda _: None)
    report = (tmp_path / "report.md").read_text()
    result = strict((tmp_path / "one" / "result.json").read_text())
    data = strict((tmp_path / "results.json").read_text())
    assert data["recipes"]["one"]["details"] == {"curve": [1.0, "NaN"]}
    assert data["recipes"]["one"]["tables"][0]["rows"] == [["-Infinity", 1.5]] and float("-Infinity") == -math.inf
    assert result["claims"][0]["ours"] == "NaN" and result["claims"][1]["ours"] == {"a": 0.25, "b": "Infinity"}
    assert "| one | inf | x | a: 0.25, b: Infinity | **no** |" in report
    runner.reproduce(["one"], "smoke", tmp_path, log=lambda _: None)  # rebuilt from the recipe's result.json
    assert (tmp_path / "report.md").read_text() == report


def test_a_finished_recipe_whose_trainings_changed_is_refused(tmp_path, fake_recipes, monkeypatch):
    """A recipe that finished under an older version was skipped as finished, its numbers reported as this
    version's, though its trainings differ from what the recipe trains now (which a rerun refuses)."""
    from poslab.experiments.common import ensure_runs
    from poslab.experiments.indirect_indexing import SCALES, run_config

    steps = {"n": 3}

    def trainings(scale, out):
        config = run_config(SCALES["smoke"], "pope", 0)
        return {"pope": ({**config, "train": {**config["train"], "steps": steps["n"]}}, out / "runs" / "pope")}

    def trains(scale, out, log, jobs, device):
        fake_recipes.append(out.name)
        final = ensure_runs(trainings(scale, out), log)["pope"]
        return RecipeResult(out.name, scale, [claims.at_least("accuracy", 1.0, final["eval_exact_match"], 0.0)])

    module = sys.modules["fake_recipes"]
    module.trains, module.trainings = trains, trainings
    monkeypatch.setitem(runner.RECIPES, "one", ("fake_recipes:trains", "first"))
    monkeypatch.setattr(module, "runs", trainings)
    runner.reproduce(["one"], "smoke", tmp_path, log=lambda _: None)
    runner.reproduce(["one"], "smoke", tmp_path, log=lambda _: None)  # unchanged: skipped
    assert fake_recipes == ["one"]
    steps["n"] = 4  # a newer version of the recipe
    for force in (False, True):
        with pytest.raises(PoslabError, match=r"pope was trained with other settings \(run.train.steps \(3 there, "
                                              r"4 now\)\)"):
            runner.reproduce(["one"], "smoke", tmp_path, force=force, log=lambda _: None)


def test_indirect_indexing_chance_levels_match_guessers_on_the_task():
    """The recipe's two baselines, checked by guessing on the task's own test problems: a random letter of
    the string, and a guesser blind to position (the source letter when the shift is 0, else another letter)."""
    import random

    from poslab.experiments.indirect_indexing import SCALES, chance_levels
    from poslab.tasks import build_batch_source

    task = SCALES["quick"]["task"]
    problems = build_batch_source(0, "indirect_indexing", **task, test_size=4000).examples("test", 4000)
    rng, random_hits, blind_hits = random.Random(0), 0, 0
    for prompt, answer in problems:
        letters, source, shift = [part.strip() for part in prompt.split(",")[:3]]
        random_hits += rng.choice(letters) == answer
        blind_hits += (source if int(shift) == 0 else rng.choice(letters.replace(source, ""))) == answer
    chance, blind = chance_levels(task)
    assert abs(random_hits / len(problems) - chance) < 0.02 and abs(blind_hits / len(problems) - blind) < 0.025


def test_dstg_structure_beyond_position_compares_each_models_gain_over_position_alone():
    """Sentence index is mostly told by the token's position: the strict claim judges what the last layer
    adds to a probe of the position alone, not its R^2, which the position inflates for every model."""
    from poslab.experiments.dstg import structure_beyond_position

    def beyond(dstg_both):
        both = {"dstg": dstg_both, "ap_neobert": 0.80, "rope_neobert": 0.79, "rp_neobert": 0.78}
        return {m: {"position alone": 0.77, "last layer + position": v} for m, v in both.items()}

    held = structure_beyond_position(beyond(0.85))
    assert held.held and held.ours["dstg"] == pytest.approx(0.08) and held.ours["position alone"] == 0.77
    assert not structure_beyond_position(beyond(0.799)).held


STEP_FAULTS = """
import resource, sys, torch
from poslab.experiments.common import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
def step():  # a training step's buffers: several sizes, all freed at its end
    kept = [torch.empty(n << 16).fill_(1.0) for n in (1, 3, 8, 20, 40, 5, 64, 2)]
    del kept
step()
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_workers_keep_freed_memory_instead_of_faulting_it_in_every_step(monkeypatch):
    """By default glibc unmaps and trims what a step frees, and the next step faults the same pages in again
    (12-17k page faults per step of the quick LMs); the reproduction's workers keep it."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", STEP_FAULTS, mode], capture_output=True, text=True,
                                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout)
              for mode in ("default", "kept")}
    assert faults["kept"] < 1000 and 10 * faults["kept"] < faults["default"], faults
    from poslab.experiments import common

    calls = []
    monkeypatch.setattr(common, "keep_freed_memory", lambda: calls.append("kept"))
    monkeypatch.setattr(common, "_exit_with_parent", calls.append)
    common._start_worker(7)
    pool = common.worker_pool(1)
    assert calls == ["kept", 7] and pool._initializer is common._start_worker  # what each worker runs first
    pool.shutdown()


# ---- the recipes' claim rules on measurements given to them (mutation review): the trainings and analyses
# are replaced by fixed numbers, so each rule is checked against values computed here by hand -----------------

def test_frequency_claims_read_entropy_and_fastest_quarter_of_layers_after_the_first(tmp_path, monkeypatch):
    from scipy import stats

    from poslab.experiments import frequencies

    rows = {"pope": [[1, 0, 0, 0], [1, 1, 1, 1], [2, 2, 1, 1]], "rope": [[1, 1, 1, 1], [4, 1, 0, 0], [1, 0, 0, 0]]}
    shares = {"pope": {"q": [0.9, 0.3, 0.25], "k": [0.5, 0.1, 0.2]}, "rope": {"q": [0.1, 0.5, 0.4], "k": [0.3, 0.6, 0.5]}}

    def analysis(run, opts):
        q = [[float(v) for v in row] for row in rows[run]]
        k = [[2.0 * v for v in row] for row in q]  # the same profile at another scale: the same entropy
        return {"q": q, "k": k, "figures": [],
                "summary": {w: {"high_frequency_share": shares[run][w]} for w in ("q", "k")}}

    monkeypatch.setattr(frequencies, "ensure_runs", lambda *args, **kwargs: {})
    monkeypatch.setattr(frequencies.Run, "load", staticmethod(lambda path, device=None: path.name))
    monkeypatch.setattr(frequencies, "frequencies_analysis", analysis)
    result = frequencies.run("smoke", tmp_path / "frequencies", log=lambda _: None)
    breadth, high = result.claims

    def entropy(row):  # normalised: 1 for a flat profile, 0 for a single frequency
        return stats.entropy(row) / math.log(len(row))

    expected = {s: (entropy(r[1]) + entropy(r[2])) / 2 for s, r in rows.items()}  # layers 2 and 3 only
    assert breadth.ours == pytest.approx(expected, abs=1e-5)
    assert expected["pope"] - expected["rope"] > 0.05 and breadth.held
    assert high.ours == pytest.approx({"pope": 0.2125, "rope": 0.5}) and not high.held  # q and k, layers 2 and 3
    assert result.tables[0]["rows"][0][1:] == pytest.approx([0.0, 1.0])  # layer 1 shown, not judged
    assert frequencies.spread([3.0, 3.0, 0.0, 0.0]) == pytest.approx(0.5)


@pytest.mark.parametrize("scale", ["smoke", "quick", "paper"])
def test_pope_ablations_change_only_the_schemes_option_and_share_the_full_model(scale, tmp_path):
    """Each ablation is the extrapolation recipe's PoPE language model (at paper scale the 124M) with one PoPE
    option changed, on the data that recipe prepares; "full" is that very run, trained once for both."""
    from poslab.experiments import extrapolation, pope_ablation

    trainings = pope_ablation.runs(scale, tmp_path / "pope-ablation")
    full_config, full_dir = extrapolation.runs(scale, tmp_path / "extrapolation")["pope"]
    assert trainings["full"] == (full_config, full_dir)
    options = {"no softplus": {"magnitude": "identity"}, "relu": {"magnitude": "relu"},
               "no delta": {"learn_delta": False}}
    assert set(trainings) == {"full", *options}
    for name, opts in options.items():
        config, out = trainings[name]
        assert out == tmp_path / "pope-ablation" / "runs" / name.replace(" ", "-")
        assert config["model"].pop("positional") == {"name": "pope", "options": opts}
        assert config == {**full_config, "model": {k: v for k, v in full_config["model"].items() if k != "positional"}}
        assert config["data"]["cache_dir"] == str(tmp_path / "extrapolation" / "data")


def test_pope_ablation_claims_compare_each_ablations_held_out_loss_with_full_popes(tmp_path, monkeypatch):
    from poslab.experiments import pope_ablation

    losses = {"full": 3.0, "no softplus": 3.2, "relu": 2.9, "no delta": 3.0}
    monkeypatch.setattr(pope_ablation, "ensure_runs",
                        lambda runs, *args, **kwargs: {name: {"eval_loss": losses[name], "train_loss": 0.0}
                                                       for name in runs})
    result = pope_ablation.run("smoke", tmp_path / "pope-ablation", log=lambda _: None)
    softplus, relu, delta = result.claims
    assert softplus.ours == {"full": 3.0, "no softplus": 3.2} and softplus.held
    assert relu.ours == {"full": 3.0, "relu": 2.9} and not relu.held
    assert delta.ours == {"full": 3.0, "no delta": 3.0} and not delta.held  # a tie is not better
    assert [c.paper for c in result.claims] == ["perplexity 21.33 vs 21.57", "perplexity 21.33 vs 21.55",
                                                "perplexity 21.33 vs 21.42"]
    rows = {row[0]: row for row in result.tables[0]["rows"]}
    assert rows["relu"][1:4] == ["magnitude: relu", 2.9, pytest.approx(math.exp(2.9))]
    assert rows["no delta"][1] == "learn_delta: false" and rows["full"][1] == "defaults"
    assert (tmp_path / result.figures[0]).is_file()
    assert pope_ablation.perplexity(800.0) == math.inf and math.isnan(pope_ablation.perplexity(math.nan))


def test_indirect_indexing_claims_read_the_mean_over_seeds(tmp_path, monkeypatch):
    from poslab.analysis import plots
    from poslab.experiments import indirect_indexing

    accuracy = {"pope": [0.3, 0.9, 0.6], "rope": [0.5, 0.45, 0.55]}  # seed 0 alone would tell otherwise
    finals = {(s, seed): {"eval_exact_match": v} for s, values in accuracy.items() for seed, v in enumerate(values)}
    monkeypatch.setattr(indirect_indexing, "ensure_runs", lambda *args, **kwargs: finals)
    monkeypatch.setattr(plots, "bars", lambda path, *args, **kwargs: path)
    far, above_chance = indirect_indexing.run("quick", tmp_path / "indirect-indexing", log=lambda _: None).claims
    assert far.ours == pytest.approx({"pope": 0.6, "rope": 0.5}) and far.held  # a gap of exactly the 10% margin
    chance = (1 / 5 + 1 / 6 + 1 / 7 + 1 / 8) / 4  # a random letter of a string of 5-8
    assert above_chance.rule == f"ours >= {3 * chance:g}" and above_chance.ours == pytest.approx(0.6)
    assert above_chance.held


def test_indirect_indexing_compares_pope_with_every_other_scheme_where_the_scale_trains_them(tmp_path, monkeypatch):
    """The paper scale trains every scheme (the quick one only PoPE and RoPE): PoPE must beat each one's mean."""
    from poslab.analysis import plots
    from poslab.experiments import indirect_indexing

    scale = {**indirect_indexing.SCALES["smoke"], "seeds": [0, 1], "other_seeds": [0, 1],
             "others": ("nope", "rope-half")}
    monkeypatch.setitem(indirect_indexing.SCALES, "two-seeds", scale)
    monkeypatch.setattr(plots, "bars", lambda path, *args, **kwargs: path)
    for half, held in [([0.4, 0.5], True), ([0.9, 0.2], False)]:  # rope-half's 0.45, then 0.55: PoPE's, a tie
        accuracy = {"pope": [0.7, 0.4], "rope": [0.1, 0.2], "nope": [0.05, 0.0], "rope-half": half}
        finals = {(s, seed): {"eval_exact_match": v} for s, values in accuracy.items()
                  for seed, v in enumerate(values)}
        monkeypatch.setattr(indirect_indexing, "ensure_runs", lambda *args, **kwargs: finals)
        *_, every = indirect_indexing.run("two-seeds", tmp_path / "indirect-indexing", log=lambda _: None).claims
        assert every.claim.startswith("PoPE above every other positional scheme")
        assert every.ours == pytest.approx({"pope": 0.55, "rope": 0.15, "nope": 0.025, "rope-half": sum(half) / 2})
        assert every.held is held and every.rule == "pope > rope and nope and rope-half"
    monkeypatch.setattr(indirect_indexing, "ensure_runs", lambda *args, **kwargs: {
        (s, seed): {"eval_exact_match": 0.5} for s in ("pope", "rope") for seed in range(3)})
    assert len(indirect_indexing.run("quick", tmp_path / "quick", log=lambda _: None).claims) == 2  # no others


def test_dstg_spectrum_reads_pc1_and_pc2_low_bin_shares():
    """PC1 along DCT-II basis 3 (all power in the first 4 bins), PC2 along basis 4 (none): the mean is 1/2."""
    from types import SimpleNamespace

    from poslab.experiments.dstg import ap_spectrum

    n = 32
    t = torch.arange(n, dtype=torch.float64)
    basis = [torch.cos(math.pi * k * (2 * t + 1) / (2 * n)) for k in (3, 4)]
    axes = torch.linalg.qr(torch.randn(8, 2, dtype=torch.float64))[0].T
    table = torch.stack([3 * basis[0], basis[1]], 1) @ axes
    run = SimpleNamespace(model=SimpleNamespace(ap_table=lambda: torch.cat([table, torch.randn(5, 8)])))
    top2, low = ap_spectrum(run, n)  # the first n rows only: the 5 random rows below them are left out
    assert top2 == pytest.approx(1.0) and low == pytest.approx(0.5)


def test_adjacency_claims_average_seeds_and_judge_every_task_and_the_worse_init(tmp_path, monkeypatch):
    """Every number a claim reads is given: per-seed layer scores (averaged), an ablation whose two small stds
    differ (the claim reads the worse), tasks of which one fails (the "every task" claims fail with it)."""
    from types import SimpleNamespace

    from poslab.analysis import plots
    from poslab.analysis.commands import NULL_FEATURES
    from poslab.experiments import adjacency

    scale = {**adjacency.SCALES["smoke"], "seeds": [0, 1], "init_model": {"d_model": 48, "n_layers": 3, "n_heads": 2}}
    monkeypatch.setitem(adjacency.SCALES, "two-seeds", scale)
    monkeypatch.setitem(adjacency.SIZES, "two-seeds", ((1, 64), (2, 128)))
    first = adjacency.FIRST_LAYER
    # (task, seed) -> (init, trained) scores of the first layer's output; the embedding's come from the seed
    layer = {("addition", 0): (0.9, 0.84), ("addition", 1): (0.9, 0.76),  # trained mean 0.80: holds at the bound
             ("reversal", 0): (0.95, 0.9), ("reversal", 1): (0.85, 0.9),
             ("indexing", 0): (0.8, 0.7), ("indexing", 1): (0.8, 0.72),  # trained 0.71: fails "every task"
             ("ordering", 0): (0.9, 0.95), ("ordering", 1): (0.9, 0.95)}
    embed = {0: (0.45, 0.5), 1: (0.55, 0.62)}  # (init, trained): trained mean 0.56
    shift = {"addition": 0.0, "reversal": -0.1, "indexing": 0.1, "ordering": 0.0}  # init: task means 0.4-0.6

    class FakeRun:
        def __init__(self, *args):
            pass

        @staticmethod
        def load(path, device=None):
            task, seed = path.name.split("-")[1], int(path.name.split("-s")[-1])
            return SimpleNamespace(task=task, seed=seed, out_dir=path, config=SimpleNamespace(
                train=SimpleNamespace(eval_split="test")), source=lambda: SimpleNamespace(distinct=lambda s: (9, 10)))

        def batches(self, *args):
            return []

    # (task, seed) -> the trained last layer's output: reversal ties the first layer's 0.9, which is not above it
    last = {("addition", 0): 0.7, ("addition", 1): 0.8, ("reversal", 0): 1.0, ("reversal", 1): 0.8,
            ("indexing", 0): 0.5, ("indexing", 1): 0.6, ("ordering", 0): 0.9, ("ordering", 1): 0.99}

    def analysis(run, opts):
        scores = {label: {first: {"mean": layer[run.task, run.seed][i]},
                          "blocks.1.attn_out": {"mean": last[run.task, run.seed] if label == "trained" else 1.0},
                          "embed": {"mean": embed[run.seed][i] + (shift[run.task] if label == "init" else 0.0)}}
                  for i, label in enumerate(("init", "trained"))}
        return {"models": scores, "figures": []}

    mlp = {"cosine": {"nrmse": 0.3, "pearson_r": 0.9}, "variance": {"nrmse": 0.5, "pearson_r": 0.8},
           NULL_FEATURES: {"nrmse": 0.9, "pearson_r": 0.1}}
    # (std, mean) -> score at init, the same for every initialisation seed
    ablation = {(0.002, 0.0): 0.9, (0.02, 0.0): 0.78, (0.2, 0.0): 0.6, (0.002, 4.0): 0.85, (0.02, 4.0): 0.82,
                (0.2, 4.0): 0.5, (0.002, 8.0): 0.9, (0.02, 8.0): 0.81, (0.2, 8.0): 0.5}

    built = []

    class FakeModel(SimpleNamespace):
        def eval(self):
            return self

        def double(self):
            return FakeModel(spec=self.spec, dtype=torch.float64)

    def fake_model(spec):
        if isinstance(spec, dict):
            built.append(spec)
        return FakeModel(spec=spec, dtype=torch.float32)

    def scores(model, batches, names=()):
        spec = model.spec
        if spec.get("arch") == "encoder":
            return {first: 0.5}
        # float32's rounding in the forward reorders the cosines of states a large init mean points one way
        assert model.dtype == torch.float64, "the initialisation ablation's models run in float64"
        return {first: ablation[spec["init_std"], spec["init_mean"]]}

    finals = {key: {"eval_exact_match": 0.5} for key in adjacency.runs("two-seeds", tmp_path)}
    monkeypatch.setattr(adjacency, "ensure_runs", lambda *args, **kwargs: finals)
    monkeypatch.setattr(adjacency, "Run", FakeRun)
    monkeypatch.setattr(adjacency, "adjacency_analysis", analysis)
    monkeypatch.setattr(adjacency, "probes_analysis", lambda run, opts: {"models": {"trained": {"mlp": mlp}},
                                                                         "figures": []})
    monkeypatch.setattr(adjacency, "build_model", fake_model)
    monkeypatch.setattr(adjacency, "first_layer_scores", scores)
    monkeypatch.setattr(adjacency, "size_scores", lambda *args: {(1, 64): {"first": 0.85, "last": 0.7},
                                                                 (2, 128): {"first": 0.8, "last": 0.6}})
    monkeypatch.setattr(plots, "heatmap", lambda path, *args, **kwargs: path)
    result = adjacency.run("two-seeds", tmp_path / "adjacency", log=lambda _: None)
    c = {claim.claim.split(" (")[0]: claim for claim in result.claims}
    assert len(c) == len(result.claims) == 12

    embed_init = c["score at the token-embedding layer is ~0.5"]
    assert embed_init.ours == pytest.approx(0.5) and embed_init.held  # mean of the seeds, then of the tasks
    assert result.details["embed"] == pytest.approx({"addition": 0.5, "reversal": 0.4, "indexing": 0.6, "ordering": 0.5})
    embed_trained = c["score at the token-embedding layer stays ~0.5 after training"]
    assert embed_trained.ours == pytest.approx({t: 0.56 for t in adjacency.TASKS}) and embed_trained.held
    at_init = c["score of the first causal attention layer's output >= 0.8 at initialisation"]
    assert at_init.ours == pytest.approx({"addition": 0.9, "reversal": 0.9, "indexing": 0.8, "ordering": 0.9})
    assert at_init.held  # indexing at exactly 0.8
    trained = c["score of the first causal attention layer's output >= 0.8 after training"]
    assert trained.ours == pytest.approx({"addition": 0.8, "reversal": 0.9, "indexing": 0.71, "ordering": 0.95})
    assert not trained.held  # one task below 0.8 is enough
    depth = c["after training, early layers keep the pattern and later ones weaken it: the first attention layer's "
              "output scores above the last's"]
    assert depth.ours == pytest.approx({"addition first": 0.8, "addition last": 0.75, "reversal first": 0.9,
                                        "reversal last": 0.9, "indexing first": 0.71, "indexing last": 0.55,
                                        "ordering first": 0.95, "ordering last": 0.945})
    assert not depth.held and depth.rule == "first > last for each"  # reversal's tie
    assert c["init std 0.2 destroys the pattern"].ours == 0.6 and c["init std 0.2 destroys the pattern"].held
    small_std = c["init std <= 0.02 keeps the pattern"]
    assert small_std.ours == pytest.approx(0.78) and not small_std.held  # the worse of std 0.002 and 0.02
    means = c["a large init mean matters less: mean 0, 4, 8 keeps >= 0.8"]
    assert means.ours == pytest.approx({"mean 0": 0.78, "mean 4": 0.82, "mean 8": 0.81}) and not means.held
    # Drops from mean 0: std 0.002 to mean 4 loses 0.05, the most; std 0.02 gains. To std 0.2: 0.3 and 0.18.
    mean_vs_std = c["a large init mean changes the pattern less than a large std: the largest drop from mean 0 to "
                    "mean 4 or 8"]
    assert mean_vs_std.ours == pytest.approx({"std 0.2 drop": 0.18, "largest mean drop": 0.05}) and mean_vs_std.held
    # The ablation's and the control's untrained models are the scale's init_model, not its trained model.
    assert len(built) == 9 * len(adjacency.INIT_SEEDS) + 1
    assert {(spec["n_layers"], spec["d_model"], spec["n_heads"]) for spec in built} == {(3, 48, 2)}
    sizes = [claim for claim in result.claims if claim.claim.startswith("at initialisation the pattern is stable")][0]
    assert sizes.ours == {"1 x 64": 0.85, "2 x 128": 0.8} and sizes.held
    assert c["bidirectional NoPE control has no adjacency pattern"].held
    assert c["cosine-similarity features predict position better than variance features"].held


def test_extrapolation_claims_read_loss_ratios_to_1x_and_to_the_fine_tune_length(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from poslab.experiments import extrapolation

    def curve(losses, factors=(1, 2, 4)):
        return [{"length": 16 * f, "factor": float(f), "loss": v} for f, v in zip(factors, losses)]

    main = {"pope": {"none": curve([2.0, 2.1, 2.2])},  # 4x / 1x = 1.1: flat at the bound
            "rope": {"none": curve([2.0, 2.5, 3.0]), "yarn": curve([2.0, 2.2, 2.6]), "ntk": curve([2.0, 2.3, 2.7]),
                     "linear": curve([2.0, 2.4, 2.8])}}
    sized = {"pope-48": {"none": curve([2.0, 2.1], (1, 4))}, "rope-48": {"none": curve([2.0, 3.2], (1, 4))}}

    def analysis(run, opts):
        runs = main if run.name == "pope" else sized
        assert tuple(opts.factors) == ((1, 2, 4) if run.name == "pope" else (1, 4))
        return {"runs": {name: {"curves": curves} for name, curves in runs.items()}, "figures": []}

    tuned = [2.4, 2.0, 2.3]  # fine-tuned at 2x: 4x / 2x = 1.15 degrades, though 4x / 1x is below 1
    finals = {"pope": {"eval_loss": 2.0}, "rope": {"eval_loss": 2.1}, "pope-48": {"eval_loss": 1.96},
              "rope-48": {"eval_loss": 1.95}}  # PoPE lower at the base size only: not "at every size"
    monkeypatch.setattr(extrapolation, "ensure_runs", lambda *args, **kwargs: finals)
    monkeypatch.setattr(extrapolation.Run, "load", staticmethod(
        lambda path, device=None: SimpleNamespace(name=path.name, out_dir=path, config=None, model=None,
                                                  source=lambda: None)))
    monkeypatch.setattr(extrapolation, "extrapolation_analysis", analysis)
    monkeypatch.setattr(extrapolation, "evaluate_lengths", lambda config, model, lengths, *args, **kwargs: [
        {"length": length, "factor": 99.0, "loss": loss} for length, loss in zip(lengths, tuned)])
    result = extrapolation.run("smoke", tmp_path / "extrapolation", log=lambda _: None)
    flat, degrades, yarn_past, beats, text, flat_sizes, larger, gap = result.claims
    assert flat.ours == pytest.approx(1.1) and flat.held
    assert degrades.ours == pytest.approx({"rope": 1.5, "pope": 1.1}) and degrades.held
    assert yarn_past.ours == pytest.approx(2.3 / 2.0) and yarn_past.held
    assert beats.ours == pytest.approx({"rope+yarn fine-tuned at 2x": 2.3, "pope": 2.2}) and beats.held
    assert not text.held and text.ours == {"32 pope": 2.0, "32 rope": 2.1, "48 pope": 1.96, "48 rope": 1.95}
    assert flat_sizes.ours == pytest.approx({"32": 1.1, "48": 1.05}) and flat_sizes.held
    assert larger.ours == pytest.approx({"48": 1.6, "32": 1.5}) and larger.held
    assert gap.ours == pytest.approx({"32": 0.1, "48": -0.01}) and not gap.held  # PoPE's lead gone at 48
    assert gap.rule == "32 > 0 and 48 >= 0.9 x 32"


@pytest.mark.parametrize("losses, held", [({"s": (2.0, 2.1), "l": (1.8, 1.91)}, True),  # 0.1 -> 0.11: growing
                                          ({"s": (2.0, 2.1), "l": (1.8, 1.89)}, True),  # 0.1 -> 0.09: at the bound
                                          ({"s": (2.0, 2.1), "l": (1.8, 1.88)}, False),  # a fifth smaller
                                          ({"s": (2.1, 2.0), "l": (1.8, 1.9)}, False),  # PoPE behind at first
                                          ({"s": (2.0, 2.1), "l": (math.nan, 1.9)}, False)])
def test_popes_lead_counts_as_stable_while_it_keeps_nine_tenths(losses, held):
    from poslab.experiments import extrapolation

    held_out = {size: {"pope": pope, "rope": rope} for size, (pope, rope) in losses.items()}
    assert extrapolation.gap_kept(held_out, "s", "l").held is held


def test_dstg_claims_average_spectra_seeds_and_read_the_head_counts_at_their_bounds(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from poslab.analysis import plots
    from poslab.experiments import dstg

    # per run: (top-2 share, low-bin share, top-2 share at DSTG's width); seed 0 alone would fail the first claim
    spectra = {"dstg": (0.65, 0.85, 0.9), "dstg-s1": (0.95, 0.75, 0.9),
               "ap_neobert": (0.5, 0.3, 0.75), "ap_neobert-s1": (0.7, 0.3, 0.65)}
    last = {"position": {"dstg": 0.86, "ap_neobert": 0.8, "rope_neobert": 0.7, "rp_neobert": 0.6},
            "sentence_index": {"dstg": 0.7, "ap_neobert": 0.69, "rope_neobert": 0.5, "rp_neobert": 0.4}}

    def probes(run, opts):
        name, _, seed = run.name.partition("-s")
        # AP-NeoBERT's sentence index at block 0: above its last layer's, but not twice it
        out = {t: {"embed": 0.95 if (t, name) == ("position", "dstg") else 0.1,
                   "blocks.0.resid_post": 0.9 if (t, name) == ("sentence_index", "ap_neobert") else 0.2,
                   "blocks.1.resid_post": last[t][name]} for t in last}
        intra = {"dstg": 0.5, "ap_neobert": 0.6, "rope_neobert": 0.55, "rp_neobert": 0.52}[name]
        out["pos_in_sentence"] = {"embed": 0.1, "blocks.0.resid_post": intra, "blocks.1.resid_post": 0.3}
        if name == "dstg":  # the whole state tells more than the sem stream the claim reads
            out["pos_in_sentence"] = {"embed": 0.1, "blocks.0.resid_post": 0.9, "blocks.1.resid_post": 0.9,
                                      "embed.sem": 0.8, "blocks.0.resid_post.sem": 0.5,
                                      "blocks.1.resid_post.sem": 0.4, "blocks.1.resid_post.ap": 0.1}
            for t in last:
                out[t].update({f"{layer}.{s}": 0.1 for layer in ("embed", "blocks.1.resid_post") for s in ("ap", "sem")})
        gain = 0.1 if name == "dstg" else 0.05
        # seed 1 (DSTG and AP-NeoBERT only) reads 0.02 higher everywhere: the claims read the mean of the two
        shift = 0.02 if seed else 0.0
        return ({t: {layer: r2 + shift for layer, r2 in by_layer.items()} for t, by_layer in out.items()},
                {"position alone": 0.6, "last layer + position": 0.6 + gain})

    def load(path, device=None):
        table = torch.full((40, 16), spectra.get(path.name, (0, 0, 0))[2], dtype=torch.float64)
        model = SimpleNamespace(table=table, config=SimpleNamespace(num_hidden_layers=2), num_parameters=lambda: 1)
        return SimpleNamespace(name=path.name, out_dir=path, model=model)

    monkeypatch.setattr(dstg, "ensure_runs", lambda configs, *args, **kwargs: {name: {} for name in configs})
    monkeypatch.setattr(dstg.Run, "load", staticmethod(load))
    monkeypatch.setattr(dstg, "reached_rows", lambda run, opts: 32)
    monkeypatch.setattr(dstg, "ap_spectrum", lambda run, rows: spectra[run.name][:2])
    monkeypatch.setattr(dstg, "spectra_analysis", lambda run, opts: None)
    monkeypatch.setattr(dstg, "heads_analysis", lambda run, opts: {  # pooled: 16 of 20 heads, at the 80% bound
        "counts": {"structure": 4, "semantic": 4, "mixed": 2} if run.name == "dstg-s1" else
        {"structure": 3, "semantic": 5, "mixed": 2}, "figures": []})
    monkeypatch.setattr(dstg, "structure_probes", probes)
    monkeypatch.setattr(dstg, "ap_table", lambda model: model.table)
    monkeypatch.setattr(dstg, "top2_at_width", lambda table, width: float(table[0, 0]) if width == 16 else math.nan)
    monkeypatch.setattr(plots, "bars", lambda path, *args, **kwargs: path)
    result = dstg.run("smoke", tmp_path / "dstg", log=lambda _: None)
    top2, at_width, low_bins, segment, beyond, lost, token, intra, heads = result.claims
    assert top2.ours == pytest.approx({"dstg": 0.8, "ap_neobert": 0.6}) and top2.held  # means over seeds 0, 1
    assert at_width.ours == pytest.approx({"dstg": 0.9, "ap_neobert at width 16": 0.7}) and at_width.held
    assert low_bins.ours == pytest.approx(0.8) and low_bins.held
    assert segment.ours["dstg best"] == pytest.approx(0.71) and segment.held
    assert segment.ours["ap_neobert"] == pytest.approx(0.70) and segment.ours["rope_neobert"] == 0.5  # seed 0 only
    assert segment.claim.endswith("(linear probe R^2; DSTG and AP-NeoBERT: mean of 2 seeds)")
    assert beyond.ours["dstg"] == pytest.approx(0.1) and beyond.held
    assert lost.ours == pytest.approx({"last layer": 0.70, "best earlier layer": 0.91}) and not lost.held
    by_layer = {"embed": 0.9, "blocks.0.resid_post": 0.5, "blocks.1.resid_post": 0.3, "blocks.2.resid_post": 0.25}
    assert not dstg.lost_by_last_layer(by_layer, 3).held  # 0.25 is half of 0.5: not below it
    assert dstg.lost_by_last_layer({**by_layer, "blocks.2.resid_post": 0.24}, 3).held  # the embedding is not a block
    assert not dstg.lost_by_last_layer({"blocks.0.resid_post": 0.1}, 1).held  # no earlier layer
    assert token.ours["dstg best"] == pytest.approx(0.96) and token.held  # 0.87 >= 0.9 x the embedding's 0.96
    assert intra.ours == pytest.approx({"dstg": 0.51, "ap_neobert": 0.61, "rope_neobert": 0.55, "rp_neobert": 0.52})
    assert intra.held
    assert heads.ours == {"mixed": 4, "semantic": 9, "structure": 7} and heads.held
    assert heads.claim.endswith("no pure RP heads (2 seeds' heads pooled)")
    by_seed = next(t for t in result.tables if t["title"].startswith("DSTG by seed"))
    assert [row[0] for row in by_seed["rows"]] == [0, 1]
    assert by_seed["rows"][1][1:4] == pytest.approx([0.72, 0.72, 1.0])
    assert by_seed["rows"][0][4] == "mixed 2, semantic 5, structure 3"
