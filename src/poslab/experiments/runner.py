"""Runs reproduction recipes, keeps what finished, and writes results.json and report.md.

Each recipe writes into DIR/<recipe>/ and ends with DIR/<recipe>/result.json; a rerun skips recipes
whose result exists, so an interrupted ``reproduce all`` resumes instead of redoing work -- unless other
poslab code computed it (``code_version``): then its analysis runs again on its finished trainings. Those results
are the source of truth: results.json and report.md are rebuilt from them (atomically) after every
recipe, so a damaged results.json is simply rewritten, and a damaged result.json counts as not finished.
One DIR holds one scale: a run at another scale is refused (it would resume the other scale's trainings
and drop its results from results.json). DIR/scale.json names it from the start, so the refusal holds before
any recipe has finished too. One reproduction at a time holds DIR/.lock (see poslab.train.lock).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import hashlib
import importlib
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from poslab.errors import ConfigError, PoslabError, unknown_key_message
from poslab.experiments.claims import Claim
from poslab.experiments.common import ensure_runs, first_trained_otherwise, train_ahead
from poslab.files import atomic_write_text
from poslab.train.lock import LOCK_FILE, RunLock
from poslab.train.parallel import Parallel, launched_as_rank_zero

SCALES = ("quick", "paper", "smoke")  # smoke: seconds-long runs that exercise a recipe in tests
SCALE_FILE = "scale.json"

# name -> ("module:function", one-line description). The function takes (scale, out_dir, log).
RECIPES: dict[str, tuple[str, str]] = {
    "adjacency": ("poslab.experiments.adjacency:run",
                  "NoPE decoders: adjacency score per layer, init ablation, bidirectional control, probes"),
    "indirect-indexing": ("poslab.experiments.indirect_indexing:run",
                          "PoPE vs RoPE (and other schemes) on the indirect-indexing diagnostic"),
    "extrapolation": ("poslab.experiments.extrapolation:run",
                      "train at length L, evaluate to 10L: PoPE vs RoPE vs RoPE+YaRN"),
    "frequencies": ("poslab.experiments.frequencies:run", "frequency-usage heatmaps, RoPE vs PoPE"),
    "pope-ablation": ("poslab.experiments.pope_ablation:run",
                      "PoPE's language model without softplus, with ReLU, without delta"),
    "dstg": ("poslab.experiments.dstg:run",
             "MLM pretraining of DSTG and its baselines: AP spectra, head taxonomy, structure probes"),
}


@dataclass
class RecipeResult:
    name: str
    scale: str
    claims: list[Claim]
    seconds: float = 0.0
    figures: list[str] = field(default_factory=list)  # paths relative to the reproduction directory
    tables: list[dict[str, Any]] = field(default_factory=list)  # {"title", "columns", "rows"}
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"claims": [c.to_dict() for c in self.claims], "seconds": round(self.seconds, 1),
                "scale": self.scale, "figures": self.figures, "tables": self.tables, "notes": self.notes,
                "details": self.details}


def machine(jobs: int = 1) -> dict[str, Any]:
    """What the timings depend on. The 15-minute load average, read as results are written, says how much
    else was running (on a shared machine the seconds mean little without it)."""
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "jobs": jobs,
            "torch": torch.__version__, "python": platform.python_version()}
    if hasattr(os, "getloadavg"):
        info["load_average_15min"] = round(os.getloadavg()[2], 2)
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def check_scale(scale: str) -> str:
    if scale not in SCALES:
        raise ConfigError(f"--scale must be one of {', '.join(SCALES)}, got '{scale}'")
    return scale


def resolve(names: list[str]) -> list[str]:
    if names == ["all"]:
        return list(RECIPES)
    if "all" in names:
        others = ", ".join(n for n in names if n != "all")
        raise ConfigError(f"'all' runs every recipe, so give it alone, not with {others}")
    for name in names:
        if name not in RECIPES:
            raise ConfigError(unknown_key_message("recipe", name, list(RECIPES) + ["all"]))
    return names


def write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(json_ready(data), indent=2, default=str, allow_nan=False))


def json_ready(data: Any) -> Any:
    """``data`` with each NaN or infinite float as the string float() reads back ("NaN", "Infinity",
    "-Infinity"): JSON has no such numbers, and strict readers (jq, JSON.parse) refuse Python's bare NaN."""
    if isinstance(data, float) and not math.isfinite(data):
        return "NaN" if math.isnan(data) else "Infinity" if data > 0 else "-Infinity"
    if isinstance(data, dict):
        return {key: json_ready(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [json_ready(value) for value in data]
    return data


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A digest of poslab's own files (.py, .yaml): the code that computes a recipe's result. Its trainings carry
    their own record (DIR/data.json, the config), but a result's analysis, rules and thresholds live only in
    the code: a result computed by other code would keep its old numbers and verdicts under today's report."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts):
        digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def load_finished(out: Path, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """The results of the recipes that finished in ``out`` with this code, by name. A result.json that is not
    JSON or not a recipe's result (a hand edit, a copy gone wrong) is logged and counts as not finished; so
    does one that other poslab code computed (its finished trainings are reused when it runs again)."""
    finished = {}
    for name in RECIPES:
        path = out / name / "result.json"
        if not path.exists():
            continue
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if not _is_result(data):
            log(f"[{name}] {path} is damaged (not a recipe's result); the recipe counts as not finished")
        elif data.get("code") != code_version():
            log(f"[{name}] {path} was computed by other poslab code; the recipe counts as not finished (its "
                "finished trainings are reused when it runs)")
        else:
            finished[name] = data
    return finished


def _is_result(data: Any) -> bool:
    """Whether ``data`` holds what a rerun, results.json and report.md read of a RecipeResult.to_dict()."""
    if not (isinstance(data, dict) and isinstance(data.get("scale"), str) and isinstance(data.get("claims"), list)):
        return False
    seconds, tables = data.get("seconds"), data.get("tables", [])
    claim_keys = {f.name for f in dataclasses.fields(Claim)}
    return (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
            and all(isinstance(claim, dict) and claim_keys <= claim.keys() for claim in data["claims"])
            and isinstance(tables, list)
            and all(isinstance(table, dict) and {"title", "columns", "rows"} <= table.keys() for table in tables)
            and all(isinstance(data.get(key, []), list) for key in ("figures", "notes")))


def check_writable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise PoslabError(f"{out} is a file, not a directory; choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-")
        probe.close()
    except OSError as err:
        raise PoslabError(f"cannot write to output directory {out}: {err.strerror}; choose another --out") from None


def reproduce(names: list[str], scale: str, out: str | Path, force: bool = False,
              log: Callable[[str], None] = print, jobs: int = 1, device: str = "cpu") -> dict[str, Any]:
    """Run recipes into ``out``, training up to ``jobs`` independent models of a recipe at a time and
    measuring the trained models on ``device``. Under torchrun every process runs the recipes (training is
    data-parallel across them); only rank 0 measures, logs and writes results.json and report.md."""
    check_scale(scale)
    names = resolve(names)
    out = Path(out)
    if not launched_as_rank_zero():
        log = lambda _: None  # noqa: E731  (other ranks stay silent)
    check_writable(out)
    if (out / "config.yaml").is_file() and (out / "checkpoints").is_dir():
        raise PoslabError(f"{out} is a training run (poslab train wrote its config.yaml and checkpoints); reproduce "
                          "into another --out")
    if _holds_other_files(out):
        raise PoslabError(f"{out} holds files but no reproduction (no {SCALE_FILE}, results.json or recipe "
                          "directory), and the report would mix with them; reproduce into a new or empty --out")
    # Two reproductions into one DIR would train the same runs side by side and overwrite each other's
    # results.json; rank 0 holds DIR/.lock for the whole reproduction (torchrun stops the other ranks if it
    # refuses).
    lock = RunLock(out) if launched_as_rank_zero() else None
    if lock is not None:
        left_by = lock.acquire()
        if left_by:
            log(f"took over {lock.path} from {left_by}, which is no longer running")
    # Under torchrun, one process group for the whole reproduction: the trainings and the ranks' agreement
    # on what to train (common.ensure_run) share it. The other ranks wait in that agreement while rank 0
    # analyses the previous recipe, which at paper scale can outlast the default 30-minute timeout. Their
    # trainings are data-parallel, never side by side.
    parallel = None
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            parallel, jobs = Parallel.setup(timeout=datetime.timedelta(hours=12)), 1
        recipes = _run_recipes(names, scale, out, force, log, jobs, device)
        if parallel is not None:
            # Leave together: a rank that tore its gloo group down while rank 0 was still analysing the
            # last recipe aborted now and then ("terminate called without an active exception").
            parallel.leave_together()
    finally:
        if parallel is not None:
            parallel.close()
        if lock is not None:
            lock.release()
    return {"recipes": recipes, "scale": scale}


def _holds_other_files(out: Path) -> bool:
    """Whether ``out`` holds visible files yet nothing a reproduction writes (a prepared corpus, say)."""
    names = {path.name for path in out.iterdir() if not path.name.startswith(".")}
    return bool(names) and not names & {SCALE_FILE, "results.json", "report.md", *RECIPES}


def finished_at_scale(out: Path, scale: str, log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """``load_finished``, refusing ``scale`` where ``out`` holds another scale's finished recipes or, before
    any finished, its trainings (named by DIR/scale.json)."""
    recipes = load_finished(out, log)
    other = sorted({result["scale"] for result in recipes.values()} - {scale})
    if other:
        raise PoslabError(f"{out} holds {' and '.join(other)}-scale results; one --out holds one scale, so choose "
                          f"another --out for --scale {scale}")
    try:
        marked = json.loads((out / SCALE_FILE).read_text()).get("scale")
    except (OSError, ValueError, AttributeError):  # none yet (or damaged): the finished results decide
        marked = None
    if marked in SCALES and marked != scale:
        raise PoslabError(f"{out} holds {marked}-scale trainings (see {out / SCALE_FILE}); one --out holds one "
                          f"scale, so choose another --out for --scale {scale}, or delete {out} to start it over")
    return recipes


def _mark_scale(out: Path, scale: str) -> bool:
    """Name the scale of the trainings about to start in a fresh ``out``; whether it did. Not in a directory
    that recipes wrote before the marker existed: what it holds is unknown, and a wrong marker would lock it."""
    if launched_as_rank_zero() and not (out / SCALE_FILE).exists() and not any((out / name).exists() for name in RECIPES):
        write_json(out / SCALE_FILE, {"scale": scale})
        return True
    return False


def _unmark_if_empty(out: Path) -> None:
    """Undo a fresh ``out``'s marker and empty recipe directories when its first reproduction failed before
    writing a file (a corpus that cannot be reached, say): the marker alone would refuse another scale there."""
    # A training's own .lock counts: its directory is a training begun, and rmdir would fail over the lock
    written = [path for path in out.rglob("*") if path.is_file() and path not in (out / SCALE_FILE, out / LOCK_FILE)]
    if written:
        return
    for folder in sorted((path for path in out.rglob("*") if path.is_dir()), key=lambda p: len(p.parts),
                         reverse=True):
        folder.rmdir()
    (out / SCALE_FILE).unlink(missing_ok=True)


def _run_recipes(names: list[str], scale: str, out: Path, force: bool, log: Callable[[str], None],
                 jobs: int, device: str) -> dict[str, Any]:
    recipes = finished_at_scale(out, scale, log)
    modules = {name: importlib.import_module(RECIPES[name][0].split(":")[0]) for name in names}
    todo = [name for name in names if force or name not in recipes]
    runs = {name: modules[name].runs(scale, out / name) for name in names}
    for name in names:
        # A run trained with other settings is refused before anything trains: in a finished recipe its numbers
        # would be reported as this version's; in one to run, training would stop there (every rank reads the
        # same files, so under torchrun all refuse together).
        stale = first_trained_otherwise(runs[name])
        if stale is not None and name not in todo:
            raise PoslabError(f"[{name}] finished in {out}, but {stale} than this version of the recipe uses; "
                              f"delete {out / name} to reproduce it again, or reproduce into another --out")
        if stale is not None:
            raise PoslabError(f"[{name}] {stale} than this version of the recipe uses; delete it to train it again, "
                              "or reproduce into another --out")
    marked = bool(todo) and _mark_scale(out, scale)
    # While one recipe is analysed, worker processes train the next ones' models (each recipe's seconds are then
    # the wall time of its turn, whose trainings may have started during the turns before it).
    try:
        with train_ahead([runs[name] for name in todo], jobs, log):
            for name in names:
                if name in todo:
                    _run_recipe(name, modules[name], recipes, scale, out, log, jobs, device)
                else:
                    log(f"[{name}] already finished ({recipes[name]['seconds']:.0f} s); skipping (use --force to "
                        "redo)")
    except BaseException:
        if marked:
            _unmark_if_empty(out)
        raise
    if launched_as_rank_zero():
        _write_all(out, scale, recipes, jobs)
    return recipes


def _run_recipe(name: str, module: Any, recipes: dict[str, Any], scale: str, out: Path, log: Callable[[str], None],
                jobs: int, device: str) -> None:
    """Run recipe ``name`` (its ``module``) and record its result in ``recipes``, result.json and the report."""
    fn = RECIPES[name][0].split(":")[1]
    log(f"[{name}] running at {scale} scale: {RECIPES[name][1]}")
    if not launched_as_rank_zero():  # the other ranks only train (data-parallel with rank 0); rank 0 analyses and writes
        ensure_runs(module.runs(scale, out / name), log)
        return
    start = time.perf_counter()
    result: RecipeResult = getattr(module, fn)(scale, out / name, log, jobs, device)
    result.seconds = time.perf_counter() - start
    # When and where it ran, kept with it: results.json, rebuilt by later runs, reports these, not theirs.
    # As a rerun reads it back from result.json, so that report.md renders the same either way.
    recipes[name] = json_ready({**result.to_dict(), "date": _now(), "machine": machine(jobs),
                                "code": code_version()})
    write_json(out / name / "result.json", recipes[name])
    held = sum(c.held for c in result.claims)
    log(f"[{name}] done in {result.seconds:.0f} s: {held}/{len(result.claims)} claims held")
    _write_all(out, scale, recipes, jobs)


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _write_all(out: Path, scale: str, recipes: dict[str, Any], jobs: int) -> None:
    from poslab.experiments.report import render_report

    order = [n for n in RECIPES if n in recipes]
    # The date and machine of the recipe that finished last; a result from before recipes kept theirs has none.
    dated = [recipes[n] for n in order if isinstance(recipes[n].get("date"), str)]
    last = max(dated, key=lambda r: r["date"]) if dated else {}
    data = {"recipes": {n: recipes[n] for n in order}, "scale": scale,
            "machine": last["machine"] if isinstance(last.get("machine"), dict) else machine(jobs),
            "seconds": round(sum(recipes[n]["seconds"] for n in order), 1), "date": last.get("date", _now())}
    write_json(out / "results.json", data)
    atomic_write_text(out / "report.md", render_report(data))
