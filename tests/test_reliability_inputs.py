"""Hostile inputs through the real command line (``poslab.cli.main``, in-process): fuzzed run configs and
argument lists, odd corpora for ``poslab data prepare``, every task's options at their limits.

The contract (README, "Bad input"): exit 0 with a complete run, or exit 2 with one ``poslab: error:`` line on stderr;
never a traceback; never a half-written output directory. A run that starts training and then fails (it
diverged) exits 2 and leaves a consistent, resumable directory: config.yaml and intact checkpoints only.

Sizes are fuzzed within what a 2-core CI machine survives: keys that set compute (steps, batch, layers,
lengths) draw small, zero, negative or mistyped values; the keys that set tensor sizes also draw absurd
ones (2^40 and up), which the trainer must refuse before allocating anything.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import string
import tempfile
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import poslab.cli
from poslab.positional import SCHEMES
from poslab.tasks import TASKS
from poslab.train import checkpoint as ckpt
from poslab.train import load_config

# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")

EXAMPLES = int(os.environ.get("POSLAB_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

BASE = {"seed": 0,
        "model": {"arch": "decoder", "vocab_size": None, "d_model": 32, "n_layers": 1, "n_heads": 2,
                  "max_seq_len": 32, "positional": {"name": "pope"}},
        "data": {"kind": "task", "name": "addition", "min_len": 3, "max_len": 5, "train_size": None,
                 "validation_size": 8, "test_size": 8},
        "train": {"steps": 2, "batch_size": 4, "warmup_steps": 0, "eval_every": 1, "checkpoint_every": 1,
                  "log_every": 1, "device": "cpu"}}

# Keys that set how much is computed: small values only (a huge step count is a valid, endless run).
COMPUTE_KEYS = ["model.n_layers", "model.n_heads", "data.min_len", "data.max_len", "data.train_max_len",
                "data.train_size", "data.validation_size", "data.test_size", "train.steps", "train.batch_size",
                "train.grad_accum", "train.eval_batch_size", "train.eval_batches", "train.eval_every",
                "train.checkpoint_every", "train.log_every", "train.warmup_steps"]
# Keys that set tensor sizes: absurd values too, refused before anything is allocated.
SIZE_KEYS = ["model.vocab_size", "model.d_model", "model.ffn_hidden", "model.max_seq_len"]
VALUE_KEYS = ["seed", "model.arch", "model.positional", "model.positional.name", "model.positional.options",
              "model.positional.options.base", "model.norm", "model.mlp", "model.norm_eps", "model.init_mean",
              "model.init_std", "model.tie_embeddings", "model.attn_backend", "model.pad_token_id", "data.kind",
              "data.name", "data.holdout", "data.data_seed", "train.lr", "train.min_lr", "train.schedule",
              "train.weight_decay", "train.betas", "train.eps", "train.grad_clip", "train.eval_split",
              "train.best_metric", "train.best_mode", "train.precision", "train.fsdp", "train.device"]
SECTIONS = ["model", "data", "train"]
# Valid alternatives, so that fuzzed runs also train other schemes, architectures and settings.
PLAUSIBLE = {"model.positional.name": sorted(SCHEMES), "model.arch": ["decoder", "encoder"],
             "model.norm": ["rmsnorm", "layernorm"], "model.mlp": ["swiglu", "gelu"],
             "model.tie_embeddings": [True, False], "model.attn_backend": ["auto", "sdpa", "eager", "triton"],
             "model.d_model": [8, 16, 64], "model.n_heads": [1, 4], "data.name": sorted(TASKS),
             "train.precision": ["fp32", "bf16"], "train.schedule": ["cosine", "constant"],
             "train.best_metric": ["loss", "token_accuracy", "exact_match"], "train.best_mode": ["min", "max"],
             "train.grad_accum": [1, 2, 4], "train.eval_every": [0, 1, 2], "train.checkpoint_every": [0, 1, 2],
             "train.steps": [1, 3], "train.grad_clip": [0, 0.5], "train.lr": [1e-4, 1.0], "seed": [1, 2**62]}

key_text = st.text(string.ascii_letters + "_.-0123456789", min_size=1, max_size=12)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.sampled_from(["", "nan", "inf", "-1", "1e-3", "yes", "~", "[", "{a", "\x00", "é" * 50, "a" * 5000,
                     "decoder", "dstg", "encoder", "rope", "pope", "nope", "t5", "alibi", "learned", "cpu", "cuda",
                     "bf16", "loss", "exact_match", "max", "constant", "validation", "test", "test_long"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(key_text, inner, max_size=3),
                      max_leaves=6)
small_ints = st.integers(-3, 12) | st.sampled_from([16, 24, 32])
compute_values = st.one_of(small_ints, st.none(), st.booleans(), st.floats(-1, 40), st.text(max_size=6),
                           st.lists(small_ints, max_size=2))
size_values = st.one_of(small_ints, st.sampled_from([64, 2**40, 2**48, 2**62, 2**63, 2**64, 2**100]), st.none(),
                        st.floats(allow_nan=True), st.text(max_size=6))
# `compile: true` is valid but compiles for minutes: only invalid spellings are drawn for it.
compile_values = st.one_of(st.none(), st.integers(), st.text(max_size=6), st.lists(st.booleans(), max_size=2))


@st.composite
def mutation(draw):
    """(dotted path, value) to set, or (path, None-marker) to delete."""
    kind = draw(st.sampled_from(["plausible"] * 4 + ["compute", "size", "value", "value", "compile", "unknown",
                                                      "delete", "section"]))
    if kind == "plausible":
        path = draw(st.sampled_from(sorted(PLAUSIBLE)))
        return path, draw(st.sampled_from(PLAUSIBLE[path]))
    if kind == "compute":
        return draw(st.sampled_from(COMPUTE_KEYS)), draw(compute_values)
    if kind == "size":
        return draw(st.sampled_from(SIZE_KEYS)), draw(size_values)
    if kind == "value":
        return draw(st.sampled_from(VALUE_KEYS)), draw(values)
    if kind == "compile":
        return "train.compile", draw(compile_values)
    if kind == "unknown":
        parent = draw(st.sampled_from(["", "model.", "data.", "train.", "model.positional.options."]))
        return parent + draw(key_text), draw(values)
    if kind == "delete":
        return draw(st.sampled_from(COMPUTE_KEYS + SIZE_KEYS + VALUE_KEYS + SECTIONS)), DELETE
    return draw(st.sampled_from(SECTIONS)), draw(scalars | st.lists(scalars, max_size=2))


DELETE = object()


def mutate(raw: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    node = raw
    for part in parents:
        if not isinstance(node.get(part), dict):
            if value is DELETE:
                return
            node[part] = {}
        node = node[part]
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value


def as_override(path: str, value) -> str:
    """`--set path=value` with the value written as YAML flow text (what a user would type)."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**9).strip()
    return f"{path}={text.removesuffix('...').strip()}"


@st.composite
def hostile_run(draw):
    """(config file bytes, --set overrides, extra flags)."""
    raw = json.loads(json.dumps(BASE))
    sets = []
    for path, value in draw(st.lists(mutation(), min_size=1, max_size=3)):
        if value is not DELETE and draw(st.booleans()) and draw(st.booleans()):
            sets.append(as_override(path, value))
        else:
            mutate(raw, path, value)
    form = draw(st.sampled_from(["yaml"] * 8 + ["garbage", "scalar"]))
    if form == "yaml":
        text = yaml.safe_dump(raw, allow_unicode=True).encode()
    elif form == "garbage":
        text = draw(st.binary(max_size=200))
    else:
        text = yaml.safe_dump(draw(scalars | st.lists(scalars, max_size=3))).encode()
    if draw(st.integers(0, 9)) == 0:
        sets.append(draw(st.text(max_size=20)))  # not even key=value
    flags = draw(st.sampled_from([[], [], [], ["--resume"], ["--overwrite"], ["--resume", "--overwrite"]]))
    return text, sets, flags


# Inputs the fuzz found escaping poslab.cli.main as an exception (a traceback), each since fixed where it was
# raised; kept as ordinary cases so that the record shows them. name -> [(--set overrides or the config file's
# bytes, what the one error line says)]
FORMER_ESCAPES: dict[str, list[tuple[list[str] | bytes, str]]] = {
    "registry lookup of a non-string name": [
        (["data.kind=[]"], "unknown data kind '[]'"), (["model.arch=[]"], "unknown model.arch '[]'"),
        (["data.name=[]"], "unknown task '[]'"), (["model.positional.name=[1]"], "unknown positional scheme '[1]'")],
    "unknown_key_message with a null name": [(["model.positional.name=null"], "unknown positional scheme 'None'")],
    "model.positional not a mapping": [(["model.positional=[]"], "positional must be a mapping")],
    "model.positional.options not a mapping": [(["model.positional.options=[1]"],
                                                "positional options must be a mapping")],
    "positional option of the wrong type": [(["model.positional.options.base=[1]"], "pope.base must be a number")],
    "null for a non-optional model number": [(["model.init_std=null"], "model.init_std must be a number")],
    "non-finite number (nan, inf)": [
        (["train.lr=.nan"], "train.lr must be a finite number"),
        (["model.init_std=.inf"], "model.init_std must be a finite number"),
        (["model.positional.options.base=-.inf"], "pope.base must be a finite number")],
    "data_seed of 2^64 or more": [(["data.data_seed=18446744073709551616"], "data_seed must lie in [0, 2^64)")],
    "config file that is not UTF-8": [(b"v\x14\xe4\x01{\xa8", "is not UTF-8 text")],
}


def invoke(argv: list[str]) -> tuple[int, str, str]:
    """poslab.cli.main(argv) with stdout and stderr captured; an exception escaping it fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = poslab.cli.main(argv)
        except BaseException:  # noqa: BLE001  the contract: nothing escapes, not even SystemExit
            pytest.fail(f"poslab {argv} raised instead of exiting:\n{traceback.format_exc()}\n{err.getvalue()}")
    return code, out.getvalue(), err.getvalue()


def check_exit(code: int, err: str) -> str:
    """Exit 0, or exit 2 with exactly one error line, last; never a traceback. Returns the error line."""
    assert "Traceback" not in err, err
    if code == 0:
        return ""
    assert code == 2, (code, err)
    lines = err.rstrip("\n").split("\n")  # not splitlines(): a \x1e in an echoed argument is no line break
    errors = [line for line in lines if line.startswith("poslab: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def check_run_dir(out: Path, complete: bool) -> str:
    """'absent', 'complete' or 'resumable'; fails on anything half-written."""
    if not out.exists():
        assert not complete
        return "absent"
    names = {p.name for p in out.iterdir()}
    assert ".lock" not in names and ".config.yaml.tmp" not in names, names
    config = load_config(out / "config.yaml")  # a run directory always has a valid config
    for line in (out / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    steps = {}
    for name in ("last", "best"):
        path = out / "checkpoints" / name
        assert not path.with_name(f".{name}.tmp").exists() and not path.with_name(f".{name}.old").exists()
        if path.exists():
            ckpt.verify(path)
            steps[name] = ckpt.load_trainer_state(path)["step"]
    if complete:
        assert steps.get("last") == config.train.steps
        return "complete"
    return "resumable"


@pytest.fixture
def workdir():
    """Fuzz examples run in a scratch working directory (an odd --out must not land in the repository)."""
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(cwd)


def test_fuzzed_run_configs_exit_cleanly(workdir, reliability):
    outcomes: Counter[str] = Counter()
    errors: Counter[str] = Counter()

    @FUZZ
    @given(hostile_run())
    def check(case):
        text, sets, flags = case
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            config, out = Path(tmp) / "run.yaml", Path(tmp) / "run"
            config.write_bytes(text)
            argv = ["train", str(config), "--out", str(out), *flags]
            for item in sets:
                argv += ["--set", item]
            code, _, err = invoke(argv)
            error = check_exit(code, err)
            state = check_run_dir(out, complete=code == 0)
            outcomes[f"exit {code}, {state} directory"] += 1
            if error:
                errors[error.split(":")[2][:40]] += 1

    check()
    cases = sum(outcomes.values())
    assert outcomes["exit 0, complete directory"] > 0 and outcomes["exit 2, absent directory"] > 0
    reliability.record("fuzz", "hypothesis-fuzzed run configs through `poslab train` (random keys, types, "
                       "values, sizes, sections; YAML, --set overrides, garbage bytes; --resume/--overwrite)",
                       cases, "; ".join(f"{n} {k}" for k, n in sorted(outcomes.items())) + f" ({len(errors)} "
                       "distinct error lines); no traceback, nothing half-written")


TOKENS = ["train", "data", "prepare", "tasks", "list", "show", "addition", "--out", "--resume", "--overwrite",
          "--set", "--force", "=", "train.lr=", "x=y", "train.steps=1", "-", "--", "@CONFIG", "@DATA", "@MISSING",
          "@DIR", "@BINARY", "@OUT"]
# Valid command lines that random tokens are spliced into: otherwise nearly every list is refused at parsing.
TEMPLATES = [[], ["train", "@CONFIG", "--out", "@OUT"], ["data", "prepare", "@DATA", "--out", "@OUT"],
             ["tasks", "list"], ["train", "@CONFIG", "--out", "@OUT", "--set", "train.steps=1"]]


def _not_help(token: str) -> bool:
    """argparse expands unambiguous prefixes ('--he' is --help), and help and version exit 0 by design."""
    return not (token.startswith("-h")
                or len(token) > 2 and any(flag.startswith(token) for flag in ("--help", "--version")))


def test_fuzzed_command_lines_exit_cleanly(workdir, reliability):
    (workdir / "run.yaml").write_text(yaml.safe_dump(BASE))
    corpus = workdir / "corpus.txt"
    corpus.write_text("One sentence here. Another one there.\n\nA new paragraph starts. It ends.\n")
    (workdir / "data.yaml").write_text(yaml.safe_dump(
        {"source": {"type": "text", "paths": str(corpus)}, "seq_len": 16,
         "tokenizer": {"vocab_size": 64, "min_frequency": 1, "train_documents": 10}}))
    (workdir / "binary").write_bytes(bytes(range(256)) * 4)
    (workdir / "dir").mkdir()
    paths = {"@CONFIG": "run.yaml", "@DATA": "data.yaml", "@MISSING": "missing.yaml", "@DIR": "dir",
             "@BINARY": "binary"}
    codes: Counter[int] = Counter()
    token = st.sampled_from(TOKENS) | st.text(max_size=10).filter(_not_help)

    @FUZZ
    @given(st.sampled_from(TEMPLATES), st.lists(st.tuples(st.integers(0, 6), token), max_size=4))
    def check(template, insertions):
        tokens = list(template)
        for where, item in insertions:
            tokens.insert(min(where, len(tokens)), item)
        with tempfile.TemporaryDirectory(dir=workdir) as tmp:
            argv = [str(Path(tmp) / "out") if t == "@OUT" else paths.get(t, t) for t in tokens]
            code, _, err = invoke(argv)
            check_exit(code, err)
            codes[code] += 1

    check()
    assert codes[0] > 0 and codes[2] > 0
    reliability.record("fuzz", "hypothesis-fuzzed argument lists (valid command lines with random tokens spliced "
                       "in: subcommands, flags, configs, missing files, directories, binary files, random text)",
                       sum(codes.values()), f"{codes[0]} exit 0, {codes[2]} exit 2 with one error line; no traceback")


# ---- corpora ------------------------------------------------------------------------------------------------

CORPORA = {
    "invalid UTF-8": b"Good text here. More good text.\n\nBad \xff\xfe\xc3( bytes in \x80 this sentence.\n",
    "only empty lines": b"\n" * 1000,
    "only whitespace": b" \t \n\r\n \n" * 100,
    "empty file": b"",
    "one huge line (2 MB of words)": b"lorem ipsum dolor sit amet " * 80_000,
    "one huge word (20 kB, no spaces)": b"x" * 20_000,
    "binary (random bytes, NULs)": bytes(torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0))
                                         .to(torch.uint8).tolist()),
    "CRLF and lone CR line ends": b"First line.\r\nSecond line.\r\rThird paragraph.\r\n",
}


def prepare_config(tmp: Path, corpus: bytes, **source) -> Path:
    (tmp / "corpus.txt").write_bytes(corpus)
    path = tmp / "data.yaml"
    path.write_text(yaml.safe_dump({"source": {"type": "text", "paths": str(tmp / "corpus.txt"), **source},
                                    "seq_len": 16, "tokenizer": {"vocab_size": 128, "min_frequency": 1,
                                                                 "train_documents": 10}}))
    return path


@pytest.mark.parametrize("kind", list(CORPORA))
def test_odd_corpora_prepare_or_refuse_cleanly(tmp_path, kind, reliability):
    config = prepare_config(tmp_path, CORPORA[kind])
    out = tmp_path / "prepared"
    code, stdout, err = invoke(["data", "prepare", str(config), "--out", str(out)])
    error = check_exit(code, err)
    if code == 0:
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["splits"]["train"]["tokens"] > 0
        outcome = f"prepared ({manifest['splits']['train']['tokens']} tokens"
        replaced = manifest["invalid_utf8_replaced"]
        outcome += f", {replaced} invalid bytes replaced by U+FFFD and reported)" if replaced else ")"
        assert ("replaced" in err) == bool(replaced)
    else:
        assert not out.exists() and not any(p.name.startswith(".") for p in tmp_path.iterdir()), \
            list(tmp_path.iterdir())
        outcome = f"refused: {error.removeprefix('poslab: error: ')}"
    reliability.record("corpus", f"`poslab data prepare` on a corpus of {kind}", 1, outcome)


def test_prepared_binary_corpus_trains(tmp_path, reliability):
    config = prepare_config(tmp_path, CORPORA["binary (random bytes, NULs)"])
    assert invoke(["data", "prepare", str(config), "--out", str(tmp_path / "prepared")])[0] == 0
    run = dict(BASE, data={"kind": "lm", "prepared": str(tmp_path / "prepared"), "seq_len": 16})
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"),
                           "--set", "train.eval_batches=1", "--set", "train.eval_split=train"])
    check_exit(code, err)
    assert code == 0, err
    check_run_dir(tmp_path / "run", complete=True)
    reliability.record("corpus", "causal-LM training on the prepared binary corpus", 1, "trains to a complete run")


@pytest.mark.slow
def test_tokenizer_training_time_is_linear_in_word_length(tmp_path, reliability):
    """A 1 MB word took 843 s to prepare on the CI machine before train_tokenizer left words over 100
    characters out of the trainer's input (the trainers are quadratic in a word's length)."""
    import time

    seconds = {}
    for size in (10_000, 80_000):
        config = prepare_config(tmp_path, b"x" * size)
        started = time.perf_counter()
        code, _, err = invoke(["data", "prepare", str(config), "--out", str(tmp_path / f"out{size}")])
        seconds[size] = time.perf_counter() - started
        assert code == 0, err
    assert seconds[80_000] < 16 * seconds[10_000] + 1.0, seconds  # 8x the data: linear plus slack, not 64x
    reliability.record("corpus", "`poslab data prepare` on a corpus holding one very long word (10 k and 80 k "
                       "characters)", 2, f"{seconds[10_000]:.2f} s and {seconds[80_000]:.2f} s: words over 100 "
                       "characters are left out of tokenizer training (the trainers are quadratic in a word's length)")


# ---- task options at their limits ------------------------------------------------------------------------------

def task_limits(name: str) -> list[tuple[str, dict]]:
    options = TASKS[name].Options
    shortest = options.shortest
    return [
        ("shortest problems only", {"min_len": shortest, "max_len": shortest}),
        ("below the shortest length", {"min_len": shortest - 1, "max_len": shortest}),
        ("empty length range", {"min_len": shortest + 1, "max_len": shortest}),
        ("train_max_len at max_len - 1", {"min_len": shortest, "max_len": shortest + 1,
                                          "train_max_len": shortest}),
        ("one training problem", {"train_size": 1, "validation_size": 1, "test_size": 1}),
        ("holdout 1e-4", {"holdout": 1e-4}),
        ("holdout 0.45", {"holdout": 0.45}),
        ("largest data_seed", {"data_seed": 2**63 - 1}),
        ("lengths far beyond the model", {"max_len": 10_000}),
    ]


LIMIT_CASES = [(name, label, options) for name in sorted(TASKS) for label, options in task_limits(name)]


def test_task_options_at_their_limits(tmp_path, reliability):
    outcomes: Counter[str] = Counter()
    for i, (name, label, options) in enumerate(LIMIT_CASES):
        raw = json.loads(json.dumps(BASE))
        raw["data"] = {"kind": "task", "name": name, "train_size": 64, "validation_size": 8, "test_size": 8,
                       **options}
        raw["model"]["max_seq_len"] = 256
        raw["train"]["steps"] = 1
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
        out = tmp_path / f"run{i}"
        code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(out)])
        check_exit(code, err)
        check_run_dir(out, complete=code == 0)
        outcomes[f"exit {code}"] += 1
    reliability.record("task limits", f"every task ({len(TASKS)}) with options at their limits: shortest and "
                       "empty length ranges, one-problem splits, holdout at its bounds 1e-4 and 0.45, largest data "
                       "seed, lengths beyond max_seq_len", len(LIMIT_CASES),
                       ", ".join(f"{n} {k}" for k, n in sorted(outcomes.items()))
                       + "; each a complete run or one error line")


@pytest.mark.parametrize("name", list(FORMER_ESCAPES))
def test_inputs_that_once_escaped_exit_2_in_one_line(tmp_path, name, reliability):
    cases = FORMER_ESCAPES[name]
    errors = []
    for i, (case, message) in enumerate(cases):
        config, out = tmp_path / f"run{i}.yaml", tmp_path / f"run{i}"
        config.write_bytes(case if isinstance(case, bytes) else yaml.safe_dump(BASE).encode())
        sets = [] if isinstance(case, bytes) else [arg for item in case for arg in ("--set", item)]
        code, _, err = invoke(["train", str(config), "--out", str(out), *sets])
        errors.append(check_exit(code, err).removeprefix("poslab: error: ").replace(str(tmp_path), "TMP"))
        assert code == 2 and message in errors[-1], err
        assert not out.exists()
    shown = "; ".join(repr(given) if isinstance(given, bytes) else " ".join(given) for given, _ in cases)
    reliability.record("fuzz", f"found by the fuzz escaping as a traceback, now fixed: {name} (`poslab train` with "
                       f"{shown})", len(cases), f"exit 2 with one error line, no output directory: {errors[0]}")


def test_error_line_with_a_line_break(tmp_path, reliability):
    reliability.record("fuzz", "an argument holding a line break, echoed in an error", 1,
                       "one line: poslab.cli.main escapes line breaks")
    code, _, err = invoke(["train", str(tmp_path / "no\nsuch.yaml"), "--out", str(tmp_path / "run")])
    check_exit(code, err)


def alias_bomb(levels: int = 6) -> list:
    """9^levels strings from a few hundred bytes of YAML: every level repeats one list object, which
    yaml.safe_dump writes once with an anchor and then as aliases."""
    bomb = ["lol"] * 9
    for _ in range(levels - 1):
        bomb = [bomb] * 9
    return bomb


@pytest.mark.parametrize("key,message", [
    ("seed", "seed must be a number, got [[["), ("model.d_model", "model.d_model must be a number, got [[["),
    ("model.norm", "model.norm must be a string, got [[["), ("train.betas", "train.betas must be a list"),
    ("data.kind", "unknown data kind '[[["), ("model.positional", "positional must be a mapping"),
    ("model.positional.name", "unknown positional scheme '[[["), ("data.name", "unknown task '[[[")])
def test_a_huge_bad_value_is_shown_cut(tmp_path, key, message, reliability):
    """A YAML alias bomb under a key once made a 39 MB error line (the whole repr of 531,441 strings)."""
    raw = json.loads(json.dumps(BASE))
    mutate(raw, key, alias_bomb())
    text = yaml.safe_dump(raw)
    assert len(text) < 2000
    (tmp_path / "run.yaml").write_text(text)
    code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")])
    error = check_exit(code, err)
    assert code == 2 and message in error and len(error) < 600, error[:1000]
    assert not (tmp_path / "run").exists()
    reliability.record("fuzz", f"a YAML alias bomb (531,441 strings in {len(text)} bytes) as {key}", 1,
                       f"one error line of {len(error)} characters")


@pytest.mark.parametrize("source,given,message", [
    ("file", "seed: 2001-13-01", "holds a value YAML cannot read: month must be in 1..12"),
    ("file", "seed: " + "1" * 5000, "holds a value YAML cannot read: Exceeds the limit (4300 digits)"),
    ("--set", "seed=2001-13-01", "--set seed: value '2001-13-01' is not valid YAML"),
    ("--set", "seed=" + "1" * 5000, "--set seed: value '111"),
])
def test_a_value_yaml_cannot_convert_is_one_line(tmp_path, source, given, message):
    """YAML reads these as a date and an int, whose constructors raise ValueError, not YAMLError."""
    raw = {k: v for k, v in BASE.items() if k != "seed"}
    text = yaml.safe_dump(raw) + (given + "\n" if source == "file" else "")
    (tmp_path / "run.yaml").write_text(text)
    sets = ["--set", given] if source == "--set" else []
    code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"), *sets])
    error = check_exit(code, err)
    assert code == 2 and message in error and len(error) < 600, error[:1000]


def test_a_refused_overwrite_or_resume_keeps_the_old_run(tmp_path, reliability):
    """Checks that need a forward (attn_backend) or the checkpoint (train.steps) run before --overwrite deletes
    the old run or --resume rewrites its config.yaml."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    run = ["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")]
    assert invoke(run)[0] == 0
    before = {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()}
    refusals = [(["--overwrite", "--set", "train.best_metric=exact_macth"], "unknown train.best_metric"),
                (["--resume", "--set", "train.steps=1"], "cannot resume: train.steps (1) is below the step")]
    if not torch.cuda.is_available():
        refusals.append((["--overwrite", "--set", "model.attn_backend=triton"], "attn_backend 'triton' needs a CUDA"))
    for flags, message in refusals:
        code, _, err = invoke(run + flags)
        assert code == 2 and message in check_exit(code, err), err
        assert {p: p.read_bytes() for p in sorted((tmp_path / "run").rglob("*")) if p.is_file()} == before, flags
    reliability.record("run directory", "a refused --overwrite or --resume of a finished run (" + "; ".join(
        " ".join(flags) for flags, _ in refusals) + ")", len(refusals), "exit 2 in one line; every file of the old "
        "run byte-identical")


@pytest.mark.parametrize("library, allocation, message", [
    # numpy's _ArrayMemoryError is a MemoryError; torch's CPU allocator raises a plain RuntimeError
    ("numpy", lambda: __import__("numpy").empty(2**62, dtype="uint8"), "Unable to allocate"),
    ("torch", lambda: __import__("torch").empty(2**60, dtype=__import__("torch").uint8), "DefaultCPUAllocator"),
])
def test_out_of_memory_is_one_line(library, allocation, message, tmp_path, monkeypatch):
    import poslab.train.cli

    monkeypatch.setattr(poslab.train.cli, "train", lambda *_args, **_kwargs: allocation())
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")])
    error = check_exit(code, err)
    assert code == 2 and error.startswith("poslab: error: out of memory (") and message in error and "lower" in error


def test_other_runtime_errors_are_not_called_out_of_memory(tmp_path, monkeypatch):
    """A RuntimeError that is not a failed allocation is a bug: it keeps its traceback."""
    import poslab.train.cli

    def fail(*_args, **_kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    monkeypatch.setattr(poslab.train.cli, "train", fail)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        poslab.cli.main(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")])


class StillRunning(Exception):
    """Raised by a timer inside a call that should have returned (not an OSError: main would catch that)."""


@contextlib.contextmanager
def within(seconds: int):
    """Raise StillRunning in the block after ``seconds`` (SIGALRM)."""
    import signal

    def give_up(*_):
        raise StillRunning(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, give_up)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("override,message", [
    ("model.n_layers=100000000", "lower model.d_model, model.n_layers"),
    ("train.batch_size=100000000000", "lower train.batch_size"),
])
def test_absurd_sizes_are_refused_before_anything_is_built(tmp_path, override, message, reliability):
    """The memory check used to build every layer on the meta device (1e8 layers: hours), and ran after the
    first batch was drawn (a task drew 1e11 problems until memory ran out)."""
    import time

    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    started = time.perf_counter()
    with within(30):
        code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"), "--set", override])
    error = check_exit(code, err)
    assert code == 2 and "need at least" in error and message in error, err
    assert not (tmp_path / "run").exists()
    reliability.record("sizes", f"--set {override}", 1, f"refused in {time.perf_counter() - started:.2f} s: "
                       + error.removeprefix("poslab: error: "))


@pytest.mark.slow
@pytest.mark.parametrize("holdout", [1e-12, 0.4999999])
def test_an_extreme_holdout_is_refused_quickly(tmp_path, holdout, reliability):
    """Splits are drawn by rejection; before holdout was bounded to HOLDOUT_RANGE, these drew problems for hours
    (a give-up limit of 20 x count / share + 100000 draws: 1.6e14 for 1e-12)."""
    import time

    raw = json.loads(json.dumps(BASE))
    raw["data"]["holdout"] = holdout
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    started = time.perf_counter()
    with within(30):
        code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")])
    seconds = time.perf_counter() - started
    error = check_exit(code, err)
    assert code == 2 and "holdout must lie in" in error, err
    reliability.record("task limits", f"a task with holdout {holdout}", 1,
                       f"refused in {seconds:.2f} s: {error.removeprefix('poslab: error: ')}")


def test_ctrl_c_while_poslab_imports_is_one_line(monkeypatch, capsys):
    """The installed command starts from poslab_launcher, outside the package: a Ctrl-C while torch and
    transformers import (seconds) is one line and exit 130, not a KeyboardInterrupt traceback. (Sending a
    real SIGINT races the import, which a warm cache finishes in under half a second.)"""
    import builtins
    from importlib.metadata import entry_points

    import poslab_launcher

    (command,) = entry_points(group="console_scripts", name="poslab")
    assert command.value == "poslab_launcher:main"
    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "poslab.cli":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", interrupted)
    assert poslab_launcher.main() == 130
    assert capsys.readouterr().err == "poslab: interrupted\n"


def test_a_closed_output_pipe_stops_quietly():
    """`poslab ... | head -1`: the reader leaves early. It was "poslab: error: Broken pipe" with exit 2 (or a
    traceback at exit); now nothing on stderr and 141, as for any tool that SIGPIPE stops."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "poslab", "tasks", "show", "addition", "-n", "20000"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout.readline()
        process.stdout.close()
        err = process.stderr.read()
    assert process.returncode == 141 and err == b"", err


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_an_error_with_stdout_closed_is_one_line(tmp_path, world_size):
    """Started with descriptor 1 closed, Python's sys.stdout is None: flushing it on the way out raised an
    AttributeError, a second traceback and exit 1, alone and under torchrun's leaving path (WORLD_SIZE > 1)."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "poslab", "data", "prepare", str(tmp_path / "missing.yaml"), "--out",
               str(tmp_path / "out")]
    done = subprocess.run(command, stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1),
                          env={**os.environ, "WORLD_SIZE": world_size})
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_another_broken_pipe_is_an_error(monkeypatch, capsys):
    """Only stdout's reader leaving is quiet: a pipe to a worker or a socket that breaks is reported."""
    import argparse

    def broken(_):
        raise BrokenPipeError(32, "Broken pipe")

    class Parser:
        def parse_known_args(self, argv):
            return argparse.Namespace(func=broken), []
    monkeypatch.setattr(poslab.cli, "build_parser", Parser)
    assert poslab.cli.main([]) == 2
    assert capsys.readouterr().err == "poslab: error: Broken pipe\n"


@pytest.mark.parametrize("overrides", [["train.lr=1e39"], ["train.lr=1e300", "train.schedule=constant"],
                                       ["train.lr=1e37", "train.betas=[0.99, 0.999]"]])
def test_a_learning_rate_past_float32_is_refused_before_training(tmp_path, overrides):
    """AdamW's first update moves a weight by lr / (1 - beta1) as a float32: past its range torch raised
    'value cannot be converted to type float without overflow' from optimizer.step, a traceback."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    sets = [arg for item in overrides for arg in ("--set", item)]
    code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"), *sets])
    error = check_exit(code, err)
    assert code == 2 and "train.lr" in error and "float32" in error, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("option,flag", [("name=reversal", "NAME"), ("seed=3", "--seed")])
def test_tasks_show_refuses_name_or_seed_as_a_task_option(option, flag):
    """They are build_batch_source's own arguments: --set name=... raised "got multiple values for argument"."""
    code, _, err = invoke(["tasks", "show", "addition", "-n", "2", "--set", option])
    error = check_exit(code, err)
    assert code == 2 and flag in error, err


@pytest.mark.parametrize("override,message", [
    ("tokenizer.vocab_size=99999999999999999999", "tokenizer.vocab_size must be an integer in [16, 16,777,216]"),
    ("tokenizer.vocab_size=2147483648", "tokenizer.vocab_size must be an integer in [16, 16,777,216]"),
    ("tokenizer.min_frequency=99999999999999999999", "tokenizer.min_frequency must be an integer in [1, 2^63)"),
    ("tokenizer.train_documents=99999999999999999999", "tokenizer.train_documents must be an integer in [1, 2^63)"),
])
def test_tokenizer_sizes_past_the_trainer_are_refused(tmp_path, override, message):
    """The tokenizers trainer takes these as 64-bit integers and reserves vocab_size entries up front: 2^31
    aborted the process (Rust's 'memory allocation of 141733920784 bytes failed' and a 60-line backtrace,
    exit 134), 2^66 raised OverflowError and train_documents past sys.maxsize a ValueError from islice."""
    config = prepare_config(tmp_path, CORPORA["CRLF and lone CR line ends"])
    out = tmp_path / "prepared"
    code, _, err = invoke(["data", "prepare", str(config), "--out", str(out), "--set", override])
    error = check_exit(code, err)
    assert code == 2 and message in error, err
    assert not out.exists()


@pytest.mark.parametrize("damage,message", [
    (lambda state: [1, 2], "holds a JSON list"),
    (lambda state: state | {"step": "abc"}, "needs step (an integer >= 0)"),
    (lambda state: {k: v for k, v in state.items() if k != "best"}, "needs best (null or a mapping"),
    (lambda state: state | {"best": {"metric": "loss"}}, "needs best (null or a mapping"),
])
def test_resume_refuses_a_trainer_state_of_the_wrong_shape(tmp_path, damage, message):
    """A trainer_state.json written otherwise than by poslab's save (by hand, by another tool) passes its checksums:
    --resume raised a TypeError, KeyError or AttributeError where it read the state."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    run = ["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")]
    assert invoke(run)[0] == 0
    last = tmp_path / "run" / "checkpoints" / "last"
    (last / "trainer_state.json").write_text(json.dumps(damage(ckpt.load_trainer_state(last))))
    ckpt.write_manifest(last)
    code, _, err = invoke(run + ["--resume", "--set", "train.steps=3"])
    error = check_exit(code, err)
    assert code == 2 and "trainer_state.json is damaged" in error and message in error, err


@pytest.mark.parametrize("source,text,message", [
    ("file", "seed: 0\nseed: 1\n", "line 2 is not valid YAML: duplicate key 'seed' (first on line 1)"),
    ("file", "train: {steps: 1}\nseed: 0\ntrain: {lr: 1.0e-3}\n", "line 3 is not valid YAML: duplicate key 'train'"),
    ("--set", "model.positional={name: rope, name: pope}", "--set model.positional: value '{name: rope, name: pope}' "
                                                            "is not valid YAML"),
])
def test_a_duplicate_key_is_refused(tmp_path, source, text, message):
    """PyYAML keeps the last of two equal keys: a config with two train sections silently lost the first."""
    base = {k: v for k, v in BASE.items() if k not in ("seed", "train")} if source == "file" else BASE
    (tmp_path / "run.yaml").write_text((text if source == "file" else "") + yaml.safe_dump(base))
    sets = ["--set", text] if source == "--set" else []
    code, _, err = invoke(["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run"), *sets])
    error = check_exit(code, err)
    assert code == 2 and message in error, err
    assert not (tmp_path / "run").exists()


def test_yaml_merge_keys_still_override():
    from poslab.arguments import load_yaml_text

    assert load_yaml_text("base: &b {a: 1, b: 2}\nrun: {<<: *b, b: 3}\n")["run"] == {"a": 1, "b": 3}


@pytest.mark.parametrize("command", [["train", "@CONFIG"], ["data", "prepare", "@DATA"]])
@pytest.mark.parametrize("link", ["dangling", "loop"])
def test_an_output_path_that_is_a_broken_link_is_refused_first(tmp_path, command, link):
    """A symbolic link to nothing (or to itself) is no directory and no free path: `data prepare` trained its
    tokenizer and then failed naming its temporary directory ('Not a directory: .out.tmp-...'), `train` said only
    'File exists'."""
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "missing" if link == "dangling" else out)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    data = prepare_config(tmp_path, CORPORA["CRLF and lone CR line ends"])
    paths = {"@CONFIG": str(tmp_path / "run.yaml"), "@DATA": str(data)}
    code, _, err = invoke([paths.get(t, t) for t in command] + ["--out", str(out)])
    error = check_exit(code, err)
    assert code == 2 and f"cannot create {out} (a symbolic link to a missing target" in error, err
    assert out.is_symlink() and not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "corpus.txt", "data.yaml", "out", "run.yaml"]


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_an_endless_config_file_is_refused_without_filling_memory(tmp_path, device):
    """`poslab train /dev/zero` read until memory ran out (the whole machine's, without a limit) and then blamed
    the config's model sizes. Run under a 6 GB address-space limit, so that the old behaviour fails safely."""
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    result = subprocess.run([sys.executable, "-m", "poslab", "train", device, "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, preexec_fn=limit, timeout=120)
    error = check_exit(result.returncode, result.stderr)
    assert result.returncode == 2 and f"config {device} is larger than 16 MiB" in error, result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["resume", "analyze", "init_from"])
def test_an_invalid_saved_config_is_named(tmp_path, command):
    """A run's config.yaml that this poslab refuses (written by another version, edited) was reported as
    'unknown train key ...', which reads as an error in the config the user passed."""
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(BASE))
    run = ["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "run")]
    assert invoke(run)[0] == 0
    saved = tmp_path / "run" / "config.yaml"
    saved.write_text(saved.read_text().replace("train:\n", "train:\n  newer_option: 1\n"))
    argv = {"resume": run + ["--resume", "--set", "train.steps=3"],
            "analyze": ["analyze", "adjacency", "--run", str(tmp_path / "run"), "--sequences", "2"],
            "init_from": ["train", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "tuned"),
                          "--set", f"train.init_from={tmp_path / 'run'}"]}[command]
    code, _, err = invoke(argv)
    error = check_exit(code, err)
    assert code == 2 and f"{saved}: unknown train key 'newer_option'" in error, err
