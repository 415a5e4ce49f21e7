"""Analysis on real (tiny) run directories: capture, every KIND end to end, bad input, RoPE scaling."""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from poslab.analysis import cli
from poslab.analysis.capture import collect, run_with_cache
from poslab.analysis.commands import ap_table
from poslab.analysis.extrapolation import evaluate_lengths, with_context_scaling
from poslab.analysis.runs import Run, by_depth, layer_of, stream_of
from poslab.analysis.similarity import sequence_adjacency
from poslab.errors import CheckpointError, ConfigError, DataError, PoslabError
from poslab.models import ActivationCache, build_model
from poslab.positional import SCHEMES
from poslab.train import RunConfig, train


# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")


def config(positional: str, arch: str = "decoder") -> dict:
    return {
        "seed": 0,
        "model": {"arch": arch, "vocab_size": None, "d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 24,
                  "positional": {"name": positional}},
        "data": {"kind": "task", "name": "addition", "min_len": 3, "max_len": 5, "validation_size": 32,
                 "test_size": 16},
        "train": {"steps": 3, "batch_size": 8, "lr": 1e-2, "warmup_steps": 1, "log_every": 10},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for name in ("rope", "learned", "t5"):
        train(RunConfig.from_dict(config(name)), root / name)
    torch.set_num_threads(threads)
    return root


def analyze(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["analyze", *argv])
    return args.func(args)


# ---- capture ---------------------------------------------------------------------------------------------

def test_run_with_cache_selects_by_glob_and_leaves_the_output_unchanged():
    model = build_model({"arch": "decoder", "vocab_size": 11, "d_model": 16, "n_layers": 3, "n_heads": 2,
                         "positional": {"name": "rope"}}).eval()
    ids = torch.randint(0, 11, (2, 7))
    out, cache = run_with_cache(model, ids, "blocks.*.resid_post")
    assert sorted(cache.keys()) == [f"blocks.{i}.resid_post" for i in range(3)]
    assert cache["blocks.2.resid_post"].shape == (2, 7, 16)
    assert torch.allclose(out.logits, model(ids).logits, atol=1e-6)
    _, probs = run_with_cache(model, ids, ["blocks.0.attn.probs", "embed"])
    assert set(probs.keys()) == {"blocks.0.attn.probs", "embed"}
    assert torch.allclose(probs["blocks.0.attn.probs"].sum(-1), torch.ones(2, 2, 7))


def test_a_name_not_captured_says_why():
    """A typo in a pattern or a layer past the model's read as an empty cache: the KeyError says which it is."""
    model = build_model({"arch": "decoder", "vocab_size": 11, "d_model": 16, "n_layers": 3, "n_heads": 2,
                         "positional": {"name": "nope"}}).eval()
    _, cache = run_with_cache(model, torch.randint(0, 11, (1, 5)), "blocks.*.resid_pots")
    assert len(cache) == 0
    with pytest.raises(KeyError, match=re.escape("'blocks.0.resid_post' was not captured: none of the patterns "
                                                  "['blocks.*.resid_pots'] matches it")):
        cache["blocks.0.resid_post"]
    with pytest.raises(KeyError, match="'blocks.9.resid_post' was not captured: the model records no such "
                                       r"activation; it records blocks.{i}.attn.k, .*, embed, final \(i from 0 to 2\)"):
        cache["blocks.9.resid_post"]
    with pytest.raises(KeyError, match=r"no forward pass has run with this cache \(pass it as capture=\)"):
        ActivationCache("embed")["embed"]


def test_collect_pads_batches_of_different_widths():
    model = build_model({"arch": "decoder", "vocab_size": 11, "d_model": 16, "n_layers": 1, "n_heads": 2,
                         "positional": {"name": "nope"}}).eval()
    batches = [{"input_ids": torch.randint(0, 11, (2, 5)), "labels": torch.full((2, 5), 3)},
               {"input_ids": torch.randint(0, 11, (3, 8)), "labels": torch.full((3, 8), 4)}]
    caps, batch = collect(model, batches, "embed")
    assert caps["embed"].shape == (5, 8, 16)
    assert batch["attention_mask"].sum().item() == 2 * 5 + 3 * 8
    assert batch["labels"][0, 5:].tolist() == [-100] * 3


def test_stream_names_order_by_depth():
    names = ["final", "blocks.10.resid_post", "blocks.2.resid_post.ap", "embed.sem", "blocks.2.attn_out"]
    assert by_depth(names)[:2] == ["embed.sem", "blocks.2.attn_out"] and by_depth(names)[-1] == "final"
    assert [layer_of(n) for n in ("embed", "blocks.0.resid_post", "blocks.10.attn_out")] == [0, 1, 11]
    assert [stream_of(n) for n in ("embed", "blocks.2.resid_post.ap", "blocks.1.attn_out.sem")] == \
        ["resid", "resid.ap", "attn_out.sem"]


def test_nope_adjacency_appears_after_the_first_causal_layer_but_not_bidirectionally():
    # The paper's mechanism at initialisation (width 384, N(0, 0.02)): causal mixing makes neighbours similar.
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (4, 32))
    scores = {}
    for arch in ("decoder", "encoder"):
        model = build_model({"arch": arch, "vocab_size": 50, "d_model": 384, "n_layers": 1, "n_heads": 6,
                             "positional": {"name": "nope"}}).eval()
        _, cache = run_with_cache(model, ids, ["embed", "blocks.0.resid_post"])
        scores[arch] = {k: sequence_adjacency(v).mean().item() for k, v in cache.items()}
    assert abs(scores["decoder"]["embed"] - 0.5) < 0.05
    assert scores["decoder"]["blocks.0.resid_post"] > 0.8
    assert abs(scores["encoder"]["blocks.0.resid_post"] - 0.5) < 0.1


def test_dstg_streams_and_ap_table_are_reachable():
    model = build_model({"arch": "dstg", "vocab_size": 30, "n_layers": 2, "n_heads": 2, "d_ap": 8, "d_sem": 24,
                         "max_seq_len": 16}).eval()
    _, cache = run_with_cache(model, torch.randint(0, 30, (2, 9)), ["blocks.*.resid_post*", "blocks.*.attn.logits.*"])
    assert cache["blocks.1.resid_post.ap"].shape == (2, 9, 8) and cache["blocks.1.resid_post.sem"].shape == (2, 9, 24)
    assert {k.rsplit(".", 1)[-1] for k in cache if ".logits." in k} == {"ap", "sem", "rp"}
    assert ap_table(model).shape[1] == 8


# ---- every KIND on a run ----------------------------------------------------------------------------------

def test_adjacency_variance_probes_write_json_and_figures(runs):
    rope = runs / "rope"
    for kind, extra in (("adjacency", []), ("variance", []), ("probes", ["--probe-steps", "30"])):
        assert analyze(kind, "--run", str(rope), "--sequences", "24", *extra) == 0
        data = json.loads((rope / "analysis" / f"{kind}.json").read_text())
        assert set(data["models"]) == {"trained", "init"}
        assert (data["checkpoint"], data["step"]) == ("checkpoints/best", 3)  # the weights measured
        for fig in data["figures"]:
            assert (rope / "analysis" / fig).read_bytes()[:4] == b"\x89PNG"
    adj = json.loads((rope / "analysis" / "adjacency.json").read_text())["models"]["init"]
    assert {"embed", "blocks.0.resid_post", "blocks.1.attn_out"} <= set(adj)
    assert all(0 <= v["mean"] <= 1 and v["sequences"] == 24 for v in adj.values())
    probes = json.loads((rope / "analysis" / "probes.json").read_text())["models"]["trained"]
    assert set(probes["ridge"]["position"]) == {"embed", "blocks.0.resid_post", "blocks.1.resid_post"}
    assert set(probes["mlp"]) == {"cosine", "variance", "cosine, tokens shuffled (null)"}
    assert "embed" in probes["classification"] and probes["mlp"]["cosine"]["test_tokens"] > 0
    assert not list((rope / "analysis").glob(".*"))  # no temporary files left behind


def test_spectra_heads_frequencies_where_they_apply(runs):
    assert analyze("spectra", "--run", str(runs / "learned")) == 0
    spectra = json.loads((runs / "learned" / "analysis" / "spectra.json").read_text())
    assert spectra["positions"] <= 24 and len(spectra["models"]["trained"]["dct_power"]) == 4
    assert analyze("heads", "--run", str(runs / "t5"), "--sequences", "16") == 0
    heads = json.loads((runs / "t5" / "analysis" / "heads.json").read_text())
    assert heads["terms"] == ["content", "bias"] and len(heads["layers"]["blocks.1"]["labels"]) == 2
    assert analyze("frequencies", "--run", str(runs / "rope"), "--sequences", "16") == 0
    freq = json.loads((runs / "rope" / "analysis" / "frequencies.json").read_text())
    assert len(freq["q"]) == 2 and len(freq["q"][0]) == 8  # 2 layers x head_dim / 2 rotary chunks
    assert freq["layers"] == [1, 2]  # numbered as the heatmap's rows and the other analyses' depths


def test_heads_name_a_cope_bias_contextual(tmp_path, one_thread):
    """CoPE's bias counts gated keys, a position read off content: its heads are not labelled "relative"."""
    cfg = config("cope")
    cfg["model"]["positional"]["options"] = {"init_std": 1.0}  # its zero init would leave the bias without variance
    train(RunConfig.from_dict(cfg), tmp_path / "cope")
    assert analyze("heads", "--run", str(tmp_path / "cope"), "--sequences", "16") == 0
    heads = json.loads((tmp_path / "cope" / "analysis" / "heads.json").read_text())
    labels = {label for layer in heads["layers"].values() for label in layer["labels"]}
    assert "contextual" in labels and labels <= {"contextual", "content", "mixed"}
    assert "bias->contextual" in heads["rule"]


def test_extrapolation_several_runs_with_context_scalings(runs, capsys):
    assert analyze("extrapolation", "--run", str(runs / "rope"), "--compare", str(runs / "learned"),
                   "--sequences", "16", "--factors", "1", "2", "8") == 0
    data = json.loads((runs / "rope" / "analysis" / "extrapolation.json").read_text())["runs"]
    assert set(data["rope"]["curves"]) == {"none", "linear", "ntk", "yarn"}
    assert set(data["learned"]["curves"]) == {"none"}
    assert all("loss" in rec for rec in data["rope"]["curves"]["yarn"])
    # Length 8x needs positions past the learned table (max_seq_len 24): recorded, not a crash.
    assert "error" in data["learned"]["curves"]["none"][-1] and "loss" in data["learned"]["curves"]["none"][0]
    assert "extrapolation: 1 evaluations failed, each recorded with its reason" in capsys.readouterr().err


def test_extrapolation_evaluates_xpos_with_blockwise_attention(runs, tmp_path, one_thread):
    """The default --scalings give each run its own scheme's: RoPE's three, xPos's blockwise attention."""
    train(RunConfig.from_dict(config("xpos")), tmp_path / "xpos")
    assert analyze("extrapolation", "--run", str(tmp_path / "xpos"), "--compare", str(runs / "rope"),
                   "--sequences", "8", "--factors", "1", "4") == 0
    data = json.loads((tmp_path / "xpos" / "analysis" / "extrapolation.json").read_text())["runs"]
    assert set(data["xpos"]["curves"]) == {"none", "blockwise"} and set(data["rope"]["curves"]) == \
        {"none", "linear", "ntk", "yarn"}
    blockwise, none = data["xpos"]["curves"]["blockwise"], data["xpos"]["curves"]["none"]
    # Problems of 5 digits train sequences of up to 12 tokens: blocks of 6 hide no key within that length
    assert blockwise[0]["loss"] == pytest.approx(none[0]["loss"]) and blockwise[1]["loss"] != none[1]["loss"]


def test_compared_runs_are_told_apart_and_named_once(runs, tmp_path):
    """Two runs whose directories share a name (a/seed0, b/seed0): the second's curves replaced the first's,
    under its name."""
    shutil.copytree(runs / "learned", tmp_path / "other" / "rope")
    other = tmp_path / "other" / "rope"
    assert analyze("extrapolation", "--run", str(runs / "rope"), "--compare", str(other), "--sequences", "8",
                   "--factors", "1", "2", "--scalings") == 0
    data = json.loads((runs / "rope" / "analysis" / "extrapolation.json").read_text())["runs"]
    assert {key: run["dir"] for key, run in data.items()} == {str(runs / "rope"): str(runs / "rope"),
                                                              str(other): str(other)}
    assert all(run["step"] == 3 and run["checkpoint"].startswith("checkpoints/") for run in data.values())
    with pytest.raises(ConfigError, match=f"^{re.escape(str(runs / 'rope'))}/? is given more than once; --run and "
                                          "--compare name each run once$"):
        analyze("extrapolation", "--run", str(runs / "rope"), "--compare", str(runs / "rope") + "/")


def test_runs_whose_losses_differ_in_kind_are_not_compared(runs, lm_run):
    """A causal LM's, a masked LM's and a task's losses were drawn on one axis as if comparable."""
    with pytest.raises(ConfigError, match=r"^--compare mixes runs whose losses measure different things "
                                          r"\(causal on lm data, causal on task data\); compare runs of one kind$"):
        analyze("extrapolation", "--run", str(runs / "rope"), "--compare", str(lm_run / "run"))


def test_a_run_that_cannot_go_past_its_training_length_is_refused(runs):
    """A learned position table (max_seq_len 24) cannot be read past it: every longer length failed, yet the
    analysis exited 0 with a one-point figure."""
    before = sorted((runs / "learned" / "analysis").glob("extrapolation*"))
    with pytest.raises(DataError, match=f"^{re.escape(str(runs / 'learned'))} could not be evaluated past its "
                                        r"training length \(\d+\), so nothing was written; the first reason: "
                                        "position .* is beyond the learned position table") as err:
        analyze("extrapolation", "--run", str(runs / "learned"), "--sequences", "8", "--factors", "1", "8")
    _one_line(err.value)
    assert sorted((runs / "learned" / "analysis").glob("extrapolation*")) == before


def test_a_rerun_removes_the_figures_it_no_longer_draws(runs):
    """A rerun that draws fewer figures (probes without its classification panel, say) left the old ones beside
    the new JSON; figures the JSON never listed are not poslab's to remove."""
    folder = runs / "rope" / "analysis"
    folder.mkdir(exist_ok=True)
    (folder / "adjacency.json").write_text(json.dumps({"figures": ["adjacency_old.png", "../config.yaml"]}))
    for name in ("adjacency_old.png", "mine.png"):
        (folder / name).write_bytes(b"\x89PNG")
    assert analyze("adjacency", "--run", str(runs / "rope"), "--sequences", "8") == 0
    assert not (folder / "adjacency_old.png").exists() and (folder / "mine.png").exists()
    assert (runs / "rope" / "config.yaml").exists()
    listed = json.loads((folder / "adjacency.json").read_text())["figures"]
    assert listed and all((folder / name).exists() for name in listed)


def test_an_interrupted_rerun_leaves_the_earlier_analysis_whole(runs, tmp_path, monkeypatch):
    """Figures were drawn before the JSON was written: interrupted between them, a rerun left new figures beside
    the old JSON, which listed them as its own. An analysis now writes into a staging directory that replaces
    the earlier results only when it has finished; interrupted, nothing of it remains."""
    import shutil

    from poslab.analysis import plots

    run = shutil.copytree(runs / "rope", tmp_path / "rope", ignore=shutil.ignore_patterns("analysis"))
    assert analyze("adjacency", "--run", str(run), "--sequences", "8") == 0
    folder = run / "analysis"
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert {"adjacency.json", "adjacency.png"} <= before.keys()

    def interrupted(path, data):
        assert path.parent.name == ".adjacency.partial" and (path.parent / "adjacency.png").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(plots, "write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
        analyze("adjacency", "--run", str(run), "--sequences", "16")
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_analysis_directory_that_cannot_be_written_is_refused_before_measuring(runs, tmp_path, monkeypatch):
    """DIR/analysis a file: the error came after every model was measured, as "File exists: DIR/analysis"."""
    import shutil

    from poslab.analysis import commands
    from poslab.errors import PoslabError

    run = shutil.copytree(runs / "rope", tmp_path / "rope", ignore=shutil.ignore_patterns("analysis"))
    (run / "analysis").write_text("not a directory")
    monkeypatch.setattr(commands, "_models", lambda run: pytest.fail("measured before the output was checked"))
    with pytest.raises(PoslabError, match=rf"^{run / 'analysis'} is a file, not the directory the analysis of {run} is "
                                          r"written to; move it away$"):
        analyze("adjacency", "--run", str(run), "--sequences", "8")
    assert (run / "analysis").read_text() == "not a directory"


@pytest.mark.parametrize("kind, option, users", [
    ("adjacency", ["--compare", "x"], "extrapolation"), ("variance", ["--threshold", "0.9"], "heads"),
    ("spectra", ["--sequences", "8"], "adjacency, variance, probes, heads, attention, frequencies, extrapolation"),
    ("heads", ["--eval-data", "x.yaml"], "extrapolation"), ("extrapolation", ["--split", "test"], None),
    ("probes", ["--factors", "2"], "extrapolation"), ("frequencies", ["--probe-steps", "3"], "probes"),
    ("evaluate", ["--sequences", "8"], "adjacency, variance, probes, heads, attention, frequencies, extrapolation")])
def test_an_option_the_kind_does_not_read_is_refused(kind, option, users, tmp_path):
    """They were dropped without a word: `analyze adjacency --compare B` measured one run and exited 0."""
    name = option[0]
    users = users or "adjacency, variance, probes, heads, attention, frequencies, evaluate"
    with pytest.raises(ConfigError, match=f"^analyze {kind} does not use {name} \\(read by {users}\\); leave it "
                                          "out$"):
        analyze(kind, "--run", str(tmp_path / "nowhere"), *option)


@pytest.mark.parametrize("options,length", [({"max_len": 5}, 5), ({"max_len": 12, "train_max_len": 7}, 7),
                                            ({}, 9), ({"train_max_len": 6}, 6)])
def test_a_task_runs_training_length_takes_the_tasks_defaults(options, length):
    """Addition's default max_len is 9: a run config that leaves it out (the adjacency recipe's) trained at 9, and
    reading 1 there made every factor, the figure's axis and RoPE's scaling factor wrong."""
    from poslab.analysis.extrapolation import training_length

    cfg = config("rope")
    cfg["data"] = {"kind": "task", "name": "addition", **options}
    assert training_length(RunConfig.from_dict(cfg)) == length


def test_rope_scaling_is_the_identity_at_factor_one_and_changes_longer_inputs(runs):
    run = Run.load(runs / "rope")
    ids = torch.randint(0, 10, (2, 40))
    base = run.model(ids).logits
    same = with_context_scaling(run.config, run.model, "linear", 1.0, 24)(ids).logits
    scaled = with_context_scaling(run.config, run.model, "linear", 4.0, 24)(ids).logits
    assert torch.allclose(base, same, atol=1e-5) and not torch.allclose(base, scaled, atol=1e-3)
    with pytest.raises(ConfigError, match="rope models"):
        with_context_scaling(Run.load(runs / "learned").config, run.model, "yarn", 2.0, 24)
    assert evaluate_lengths(run.config, run.model, [5], sequences=8, batch_size=8)[0]["factor"] == 1.0
    # Task problems are drawn at each length and every one of the split is scored: the records say how many.
    records = evaluate_lengths(run.config, run.model, [5, 10], sequences=8, batch_size=8)
    assert [r["sequences"] for r in records] == [r["examples"] for r in records] == [32, 32]


def test_dstg_run_streams_table_and_terms(tmp_path):
    raw = {"seed": 0,
           "model": {"arch": "dstg", "vocab_size": None, "n_layers": 2, "n_heads": 2, "d_ap": 8, "d_sem": 24,
                     "max_seq_len": 32, "position_offset_max": 8},
           "data": {"kind": "mlm", "source": {"type": "synthetic", "documents": 60, "seed": 0},
                    "tokenizer": {"type": "wordpiece", "vocab_size": 200, "train_documents": 40},
                    "validation_documents": 20, "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
           "train": {"steps": 2, "batch_size": 4, "warmup_steps": 0, "eval_batches": 1}}
    train(RunConfig.from_dict(raw), tmp_path / "dstg")
    run = str(tmp_path / "dstg")
    loaded = Run.load(run)
    intact = loaded.batches(8, 4)[0]  # analyses read the text, not the masked training view of it
    mask_id = loaded.config.data.build(0).tokenizer.mask_token_id
    assert "labels" not in intact and not (intact["input_ids"] == mask_id).any()
    assert analyze("probes", "--run", run, "--sequences", "8", "--probe-steps", "5") == 0
    probes = json.loads((tmp_path / "dstg" / "analysis" / "probes.json").read_text())["models"]["trained"]
    assert probes["classification"] == {"skipped": "no task labels (text data)"}
    assert "sentence_index" in probes["ridge"]
    # 8 windows of 32 tokens show few paragraph starts: a within-paragraph label without a token in some split
    # is skipped when every label is probed, and an error when asked for by name.
    assert probes["ridge"]["sentence_in_paragraph"] == {
        "skipped": "probe target 'sentence_in_paragraph' has no labelled token in the training, validation or test "
                   "sequences"}
    with pytest.raises(DataError, match="sentence_in_paragraph' has no labelled token .*analyse more sequences"):
        analyze("probes", "--run", run, "--sequences", "8", "--probe-steps", "5", "--targets", "sentence_in_paragraph")
    assert analyze("adjacency", "--run", run, "--sequences", "8") == 0
    adj = json.loads((tmp_path / "dstg" / "analysis" / "adjacency.json").read_text())["models"]["trained"]
    assert {"embed.ap", "embed.sem", "blocks.1.resid_post.ap", "blocks.1.resid_post.sem"} <= set(adj)
    assert analyze("spectra", "--run", run) == 0
    spectra = json.loads((tmp_path / "dstg" / "analysis" / "spectra.json").read_text())
    # 32-token sequences shifted by up to 8 in training reach 40 rows (the table's first, position 0, is never read)
    assert spectra["models"]["trained"]["dim"] == 8 and spectra["positions"] == 40
    assert analyze("heads", "--run", run, "--sequences", "8") == 0
    heads = json.loads((tmp_path / "dstg" / "analysis" / "heads.json").read_text())
    assert heads["terms"] == ["ap", "sem", "rp"]
    with pytest.raises(ConfigError, match="rotary frequencies"):
        analyze("frequencies", "--run", run, "--sequences", "8")


# ---- bad input: one clear line ------------------------------------------------------------------------------

def _one_line(err: PoslabError) -> str:
    text = str(err)
    assert "\n" not in text and text
    return text


def test_bad_input_errors(runs, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        analyze("adjacency", "--run", str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text((runs / "rope" / "config.yaml").read_text())
    with pytest.raises(CheckpointError, match="no checkpoint.*; train the run \\(or resume it\\) until it saves a "
                                              "checkpoint$") as err:
        analyze("adjacency", "--run", str(empty))
    _one_line(err.value)
    cases = [(("spectra", "--run", str(runs / "rope")), ConfigError, "absolute-position table"),
             (("frequencies", "--run", str(runs / "learned"), "--sequences", "8"), ConfigError,
              r"rotary frequencies \(rope, pope, xpos\)"),  # the schemes found in the registry, not a list kept by hand
             (("heads", "--run", str(runs / "rope"), "--sequences", "8"), ConfigError,
              r"only 'content' \(models with positional "  # the bias-only schemes in the registry, in its order
              + " or ".join(name for name, scheme in SCHEMES.items() if scheme.bias_only)
              + " add 'bias', as do cope and xpos with a block"),
             (("probes", "--run", str(runs / "rope"), "--sequences", "2"), DataError, "too few distinct sequences"),
             (("adjacncy", "--run", str(runs / "rope")), ConfigError, "did you mean 'adjacency'"),
             (("probes", "--run", str(runs / "rope"), "--targets", "sentence_index"), ConfigError, "offers: position"),
             (("adjacency", "--run", str(runs / "rope"), "--sequences", "0"), ConfigError, "--sequences"),
             # one class is no classification: it was taken and reported "(probed: 2..1)"
             (("probes", "--run", str(runs / "rope"), "--max-classes", "1"), ConfigError,
              r"^--max-classes must be >= 2, got 1$"),
             (("adjacency", "--run", str(runs / "rope" / "checkpoints")), CheckpointError,
              r"is not a run directory \(no config.yaml\); pass the --out directory of `poslab train`$"),
             # asked for by name, a scaling that no run can take was dropped without a word
             (("extrapolation", "--run", str(runs / "learned"), "--scalings", "yarn"), ConfigError,
              r"^--scalings yarn apply to none of these runs' schemes \(context scalings by scheme: rope: linear, ntk, "
              r"yarn; xpos: blockwise\): leave --scalings out or name one the runs have$"),
             (("extrapolation", "--run", str(runs / "rope"), "--scalings", "blockwise"), ConfigError,
              r"^--scalings blockwise apply to none")]
    for argv, kind, message in cases:
        with pytest.raises(kind, match=message) as err:
            analyze(*argv)
        _one_line(err.value)
    assert not (runs / "rope" / "analysis" / "spectra.json").exists()


def test_option_refusals_name_their_option(tmp_path, monkeypatch, capsys):
    """Checked before the run is read (so --run need not exist): nan, inf and 1e9 factors were a ValueError,
    an OverflowError and a 16 TiB allocation; 'bogus' and 'meta' devices a RuntimeError; --threshold and
    --factors shared one message."""
    cases = [(("--factors", "nan"), r"--factors must lie in \(0, 64\] \(multiples of the training length\), got nan"),
             (("--factors", "1", "inf"), "--factors must lie in .* got inf"),
             (("--factors", "1e9"), "--factors must lie in .* got 1000000000.0"),
             (("--factors", "0"), "--factors must lie in .* got 0.0"),
             (("--threshold", "2"), r"^--threshold must lie in \(0, 1\], got 2.0$"),
             (("--threshold", "nan"), r"^--threshold must lie in \(0, 1\], got nan$"),
             (("--device", "bogus"), "--device must be cpu, cuda, cuda:N, mps or auto, got 'bogus'"),
             (("--device", "meta"), "--device must be cpu, cuda, cuda:N, mps or auto, got 'meta'")]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    cases += [(("--device", "cuda:0"), "--device cuda:0: no CUDA device here"),
              (("--device", "mps"), "--device mps: no MPS device here")]
    for argv, message in cases:
        with pytest.raises(ConfigError, match=message) as err:
            analyze("extrapolation", "--run", str(tmp_path / "nowhere"), *argv)
        _one_line(err.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="--device cuda:2: this machine has 2 CUDA device"):
        analyze("extrapolation", "--run", str(tmp_path / "nowhere"), "--device", "cuda:2")
    # A file is not a run directory (it was said not to exist); an empty --run is refused by the parser.
    (tmp_path / "run.yaml").write_text("seed: 0\n")
    with pytest.raises(CheckpointError, match="run.yaml is a file, not a run directory; pass the --out directory"):
        analyze("adjacency", "--run", str(tmp_path / "run.yaml"))
    from poslab.cli import main

    monkeypatch.chdir(tmp_path)  # where an empty path leads, should the refusal fail
    assert main(["analyze", "adjacency", "--run", ""]) == 2
    assert "argument --run: the path is empty" in capsys.readouterr().err


# ---- extrapolation on another corpus (eval_data) ------------------------------------------------------------

def lm_config(cache) -> dict:
    return {"seed": 0,
            "model": {"arch": "decoder", "vocab_size": None, "d_model": 32, "n_layers": 1, "n_heads": 2,
                      "max_seq_len": 16, "positional": {"name": "rope"}},
            "data": {"kind": "lm", "source": {"type": "synthetic", "documents": 40, "seed": 0},
                     "tokenizer": {"type": "bpe", "vocab_size": 300, "train_documents": 30,
                                   "special_tokens": {"mask": None}},
                     "validation_documents": 8, "seq_len": 16, "cache_dir": str(cache)},
            "train": {"steps": 2, "batch_size": 4, "warmup_steps": 0, "eval_batches": 1}}


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """A tiny causal LM trained on the synthetic corpus, and a JSONL corpus of other text to evaluate it on."""
    root = tmp_path_factory.mktemp("lm")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    train(RunConfig.from_dict(lm_config(root / "cache")), root / "run")
    torch.set_num_threads(threads)
    words = ["the river", "an old sailor", "a quiet village", "the long winter", "her letters", "the captain"]
    verbs = ["remembered", "crossed", "described", "waited for", "wrote about", "returned to"]
    lines = []
    for d in range(12):  # "books": long paragraphs of one voice, nothing like the synthetic grammar
        paragraphs = ["\n".join(f"{words[(d + s) % 6].capitalize()} {verbs[(d * s + p) % 6]} {words[(s + p) % 6]} "
                                f"in chapter {d + 1}." for s in range(8)) for p in range(5)]
        lines.append(json.dumps({"text": "\n\n".join(paragraphs)}))
    (root / "books.jsonl").write_text("\n".join(lines) + "\n")
    return root


def books(root, documents: int = 6) -> dict:
    return {"source": {"type": "jsonl", "paths": str(root / "books.jsonl")}, "validation_documents": documents}


def test_eval_data_source_without_a_type_reads_over_the_runs_own(lm_run):
    """`source: {seed: 7}` was refused ("data.source must be a mapping with a 'type'"), although the file's
    options lie over the run's: the rest of the run's source is kept."""
    from poslab.analysis.extrapolation import evaluation_config

    run = Run.load(lm_run / "run")
    evaluated = evaluation_config(run.config, {"source": {"seed": 7}, "validation_documents": 4})
    corpus = evaluated.data.build(0).corpus
    assert corpus.manifest["config"]["source"] == {"type": "synthetic", "documents": 40, "seed": 7}
    own = run.config.data.build(0).corpus.directory
    assert corpus.directory != own
    # A run on prepared data (`data: {prepared: DIR}`, as `poslab data prepare` makes it) has its source in
    # DIR/manifest.json: the same file was refused there.
    prepared = dataclasses.replace(run.config, data=dataclasses.replace(
        run.config.data, options={"prepared": str(own), "seq_len": 16, "cache_dir": str(lm_run / "cache")}))
    evaluated = evaluation_config(prepared, {"source": {"seed": 7}, "validation_documents": 4})
    assert evaluated.data.build(0).corpus.directory == corpus.directory


def test_extrapolation_on_another_corpus_uses_the_runs_tokenizer(lm_run):
    from poslab.analysis.extrapolation import evaluation_config
    from poslab.data import PreparedCorpus
    from poslab.data.config import TokenizerConfig
    from poslab.data.tokenizer import train_tokenizer

    run = Run.load(lm_run / "run")
    evaluated = evaluation_config(run.config, books(lm_run))
    assert evaluated.train.eval_split == "validation" and evaluated.data.kind == "lm"
    corpus = PreparedCorpus(evaluated.data.options["prepared"])
    own = run.config.data.build(0).corpus
    assert corpus.directory != own.directory and corpus.manifest["evaluation_only"]
    assert list(corpus.splits) == ["validation"] and corpus.splits["validation"].n_documents == 6
    assert corpus.manifest["documents_read"] == 6  # of 12: nothing past the evaluated documents is read
    # The run's own tokenizer, loaded from its prepared data: same vocabulary, same ids, same special tokens.
    assert str(own.directory / "tokenizer") in corpus.manifest["tokenizer"]["origin"]
    assert corpus.tokenizer.get_vocab() == own.tokenizer.get_vocab()
    assert corpus.vocab_size == run.config.model.vocab_size
    assert corpus.special_ids == own.special_ids and corpus.special_ids["mask"] is None
    text = "The captain waited for her letters in chapter 3."
    assert corpus.tokenizer(text)["input_ids"] == own.tokenizer(text)["input_ids"]
    # What the model reads: the books, tokenised with those ids.
    first = evaluated.data.build(0).sequence_batches("validation", 1)
    assert corpus.tokenizer.decode(next(first)["input_ids"][0, 1:12]).lower().startswith("the river")

    other = evaluate_lengths(run.config, run.model, [16, 32], sequences=4, batch_size=2, eval_data=books(lm_run))
    mine = evaluate_lengths(run.config, run.model, [16, 32], sequences=4, batch_size=2)
    assert [r["factor"] for r in other] == [1.0, 2.0]
    # One text at every length: twice the windows at half the length (each window's first token is <bos>).
    assert [r["sequences"] for r in other + mine] == [8, 4, 8, 4]
    assert all(abs(short["tokens"] - long["tokens"]) <= 8 for short, long in (other, mine))
    # Unpacked text is cut per document: no common text to keep, so as many sequences at every length.
    unpacked = evaluate_lengths(run.config, run.model, [16, 32], sequences=4, batch_size=2, eval_data={"packing": False})
    assert [r["sequences"] for r in unpacked] == [4, 4]
    assert all(math.isfinite(r["loss"]) and r["tokens"] > 0 for r in other + mine)
    assert all(abs(a["loss"] - b["loss"]) > 1e-3 for a, b in zip(other, mine))
    # Past the text's end: an error, not the same short text again under a longer length; and where the text
    # gives fewer windows than asked for, the record counts those read (it once gave the nominal count).
    text = corpus.splits["validation"].n_tokens
    beyond = evaluate_lengths(run.config, run.model, [16, text + 2], sequences=4, batch_size=2, eval_data=books(lm_run))
    assert beyond[0]["sequences"] == math.ceil(text / 15) < math.ceil(4 * (text + 2) / 16)
    assert beyond[1]["error"].startswith(f"the evaluation text holds {text} tokens, too few for one sequence of "
                                         f"{text + 2}")
    # Cached: a second evaluation reads the same prepared corpus, unless its tokenizer is no longer the run's
    # (the run's data prepared again since): then it is prepared again.
    assert evaluation_config(run.config, books(lm_run)).data.options["prepared"] == str(corpus.directory)
    stale = train_tokenizer(TokenizerConfig(type="bpe", vocab_size=270), ["another tokenizer"] * 4)
    stale.save(str(corpus.directory / "tokenizer" / "tokenizer.json"))
    assert PreparedCorpus(corpus.directory).tokenizer.get_vocab() != own.tokenizer.get_vocab()
    assert evaluation_config(run.config, books(lm_run)).data.options["prepared"] == str(corpus.directory)
    assert PreparedCorpus(corpus.directory).tokenizer.get_vocab() == own.tokenizer.get_vocab()
    # A prepared directory is read as it is (its vocabulary has the model's size).
    assert evaluation_config(run.config, {"prepared": str(corpus.directory)}).data.options["prepared"] == \
        str(corpus.directory)


def test_eval_data_refusals_are_one_line(lm_run, runs, tmp_path):
    from poslab.data.config import TokenizerConfig
    from poslab.data.tokenizer import train_tokenizer

    run = Run.load(lm_run / "run")
    tok = train_tokenizer(TokenizerConfig(type="bpe", vocab_size=270), ["a small other vocabulary"] * 4)
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert tok.get_vocab_size() != run.config.model.vocab_size
    cases = [({**books(lm_run), "tokenizer": {"path": str(tmp_path / "tok")}}, ConfigError, "vocabulary but the model"),
             ({**books(lm_run), "validation_documents": 0}, DataError, "validation_documents > 0"),
             ({**books(lm_run), "seq_len": 64}, ConfigError, "cannot set seq_len"),
             ({**books(lm_run), "kind": "mlm"}, ConfigError, "run's data kind 'lm'"),
             ({**books(lm_run), "sorce": {}}, ConfigError, "did you mean 'source'"),
             ({"packin": False}, ConfigError, "did you mean 'packing'"),
             ({"masking": {"style": "bert"}}, ConfigError, "masking applies to masked-LM data")]
    for eval_data, kind, message in cases:
        with pytest.raises(kind, match=message) as err:
            evaluate_lengths(run.config, run.model, [16], sequences=2, batch_size=2, eval_data=eval_data)
        _one_line(err.value)
    with pytest.raises(ConfigError, match="applies to text data") as err:
        evaluate_lengths(Run.load(runs / "rope").config, run.model, [5], eval_data=books(lm_run))
    _one_line(err.value)


def test_extrapolation_cli_eval_data(lm_run, tmp_path, capsys):
    from poslab.cli import main

    good = tmp_path / "books.yaml"
    good.write_text(yaml.safe_dump(books(lm_run, 4)))
    assert analyze("extrapolation", "--run", str(lm_run / "run"), "--eval-data", str(good), "--sequences", "2",
                   "--batch-size", "2", "--factors", "1", "2", "--scalings", "yarn") == 0
    data = json.loads((lm_run / "run" / "analysis" / "extrapolation.json").read_text())
    assert data["eval_data"] == books(lm_run, 4)
    curves = data["runs"]["run"]["curves"]
    assert set(curves) == {"none", "yarn"}
    assert all(math.isfinite(r["loss"]) for records in curves.values() for r in records)
    bad = {"bad.yaml": "source: [unclosed\n", "list.yaml": "- source\n- packing\n", "empty.yaml": ""}
    for name, text in {**bad, "missing.yaml": None}.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        capsys.readouterr()
        assert main(["analyze", "extrapolation", "--run", str(lm_run / "run"),
                     "--eval-data", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert "--eval-data file" in err and err.count("\n") == 1 and name in err


def test_extrapolation_that_evaluates_no_length_writes_nothing(lm_run, tmp_path, capsys):
    """Every length failing is no measurement: one line, exit 2, and the analysis already there is kept."""
    from poslab.cli import main

    good = tmp_path / "books.yaml"
    good.write_text(yaml.safe_dump(books(lm_run, 4)))
    assert analyze("extrapolation", "--run", str(lm_run / "run"), "--eval-data", str(good), "--sequences", "2",
                   "--batch-size", "2", "--factors", "1", "--scalings") == 0
    written = {p.name: p.read_bytes() for p in (lm_run / "run" / "analysis").iterdir()}
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "a b"}) + "\n")
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump({"source": {"type": "jsonl", "paths": str(tmp_path / "short.jsonl")},
                                     "validation_documents": 1}))
    capsys.readouterr()
    assert main(["analyze", "extrapolation", "--run", str(lm_run / "run"), "--eval-data", str(short),
                 "--sequences", "2", "--batch-size", "2", "--factors", "1", "2", "--scalings"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not be evaluated past its training length (16), so nothing was written; " \
        "the first reason: the evaluation text holds" in err, err
    assert {p.name: p.read_bytes() for p in (lm_run / "run" / "analysis").iterdir()} == written


def test_extrapolation_refuses_a_corpus_tokenized_otherwise_than_the_run(lm_run, tmp_path, capsys):
    """Evaluation builds its sources from the run's config; a corpus whose tokenizer is not the run's own
    (DIR/tokenizer; here a copy of the run with two tokens renumbered) is refused in one line."""
    import shutil

    from poslab.cli import main

    run = shutil.copytree(lm_run / "run", tmp_path / "run", ignore=shutil.ignore_patterns("analysis"))
    saved = json.loads((run / "tokenizer/tokenizer.json").read_text())
    a, b = sorted(saved["model"]["vocab"])[-2:]
    saved["model"]["vocab"][a], saved["model"]["vocab"][b] = saved["model"]["vocab"][b], saved["model"]["vocab"][a]
    (run / "tokenizer/tokenizer.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert main(["analyze", "extrapolation", "--run", str(run), "--sequences", "2", "--factors", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot measure {run}: the data's tokenizer is not the one the run" in err, err
    assert not (run / "analysis").exists()


def test_extrapolation_recipe_evaluates_the_paper_scale_on_pg19(tmp_path):
    """The paper's test set at paper scale (checked without downloading); quick and smoke read their own data."""
    from poslab.data.config import DataConfig
    from poslab.experiments import extrapolation as recipe

    paper = recipe.eval_data(recipe.SCALES["paper"])
    assert paper["source"] == {"type": "hf", "name": "emozilla/pg19", "split": "test", "streaming": True,
                               "text_field": "text"}
    assert paper["validation_documents"] == 100 and "tokenizer" not in paper  # the run's own tokenizer
    assert recipe.eval_data(recipe.SCALES["quick"]) is None and recipe.eval_data(recipe.SCALES["smoke"]) is None
    section = recipe.run_config(recipe.SCALES["paper"], "pope", tmp_path)["data"]
    merged = {k: v for k, v in section.items() if k != "kind"} | paper
    assert DataConfig.from_options(merged).source["name"] == "emozilla/pg19"  # valid over the run's data section


def test_a_relative_cache_dir_is_found_from_anywhere_and_never_prepared_in_the_working_directory(tmp_path,
                                                                                                 monkeypatch):
    """Training ran in `project` with cache_dir `data`; analysis from elsewhere used to prepare the corpus again
    under that directory, relative to wherever it ran."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    cfg = lm_config("data")
    train(RunConfig.from_dict(cfg), Path("runs") / "lm")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = Run.load(project / "runs" / "lm")
    assert run.config.data.options["cache_dir"] == str(project / "data")
    assert len(run.batches(4, 4)) == 1 and list(elsewhere.iterdir()) == []
    # The run's own parents come before the working directory, also through a link to the run directory
    decoy = elsewhere / "data" / "other-corpus"
    decoy.mkdir(parents=True)
    (decoy / "manifest.json").write_text("{}")
    (project / "runs" / "lm").rename(tmp_path / "lm")
    (project / "runs" / "lm").symlink_to(tmp_path / "lm")
    assert Run.load(project / "runs" / "lm").config.data.options["cache_dir"] == str(project / "data")
    shutil.rmtree(elsewhere / "data")
    (project / "data").rename(tmp_path / "moved")  # a cache found nowhere is prepared under the run's analysis/
    run = Run.load(project / "runs" / "lm")
    assert run.config.data.options["cache_dir"] == str(project / "runs" / "lm" / "analysis" / "data")


def test_every_series_of_a_figure_has_its_own_look():
    """Past matplotlib's ten colours, series repeated one another (DSTG's adjacency figure drew "trained resid.ap"
    and "init attn_out.sem" alike): "init X" is dashed in the colour of "trained X", and further line styles
    keep any number of series apart."""
    from poslab.analysis.plots import _styles

    names = [f"{model} {stream}" for model in ("trained", "init") for stream in
             ["resid", "attn_out", *[f"resid.s{i}" for i in range(10)]]] + [f"extra {i}" for i in range(25)]
    styles = _styles(names)
    looks = {tuple(styles[n].values()) for n in names}
    assert len(looks) == len(names)
    for stream in ("resid", "resid.s9"):
        trained, init = styles[f"trained {stream}"], styles[f"init {stream}"]
        assert trained["color"] == init["color"] and trained["linestyle"] != init["linestyle"]


def test_head_labels_have_distinct_marks():
    from poslab.analysis.heads import MARKS, TERM_LABELS

    labels = {*TERM_LABELS.values(), "mixed"}
    assert labels <= set(MARKS) and len({MARKS[label] for label in labels}) == len(labels)


# ---- extrapolation's length rules (mutation review) -------------------------------------------------------

def test_a_task_evaluated_at_length_l_draws_problems_of_exactly_l():
    from poslab.analysis.extrapolation import config_at_length

    cfg = config_at_length(RunConfig.from_dict(config("rope")), 7, sequences=8, batch_size=8)
    problems = cfg.data.build(0).examples(cfg.train.eval_split, 32)
    assert {len(prompt) - 1 for prompt, _ in problems} == {7}  # addition's length: the characters before '='


def test_rope_scaling_never_compresses_positions_below_the_training_length(runs):
    """A length shorter than the training length (factor < 1) is evaluated unscaled, as at factor 1."""
    run = Run.load(runs / "rope")
    ids = torch.randint(0, 10, (2, 12))
    base = run.model(ids).logits
    assert torch.allclose(with_context_scaling(run.config, run.model, "linear", 0.5, 24)(ids).logits, base, atol=1e-5)


def test_text_windows_are_counted_up_and_a_text_of_exactly_one_window_is_read(lm_run):
    """sequences x longest / L windows at length L, rounded up (4 x 32 / 24 = 5.3 -> 6); a window of L tokens
    holds <bos> and L - 1 tokens of text, so a text of L - 1 tokens is one window, not an error."""
    from poslab.data import PreparedCorpus
    from poslab.analysis.extrapolation import evaluation_config

    run = Run.load(lm_run / "run")
    records = evaluate_lengths(run.config, run.model, [24, 32], sequences=4, batch_size=1)
    assert [r["sequences"] for r in records] == [6, 4]
    text = PreparedCorpus(evaluation_config(run.config, books(lm_run)).data.options["prepared"]).splits[
        "validation"].n_tokens
    exact = evaluate_lengths(run.config, run.model, [text + 1], sequences=4, batch_size=2, eval_data=books(lm_run))
    assert "error" not in exact[0] and exact[0]["sequences"] == 1


# ---- evaluate --------------------------------------------------------------------------------------------

def test_evaluate_scores_a_split_as_the_training_evaluation_did(runs, capsys):
    """On the split and weights of training's last evaluation, evaluate gives its numbers exactly; on the test
    split it scores every problem (there was no way to score a test split but to train again)."""
    run = runs / "rope"
    final = [{k.removeprefix("eval_"): v for k, v in json.loads(line).items() if k.startswith("eval_")}
             for line in (run / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line][-1]
    capsys.readouterr()
    assert analyze("evaluate", "--run", str(run), "--checkpoint", "last", "--batch-size", "5") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"evaluate: measured {run} (checkpoints/last, step 3); wrote {run / 'analysis' / 'evaluate.json'}"
    assert json.loads(out[1]) == pytest.approx(final, rel=1e-6)
    assert analyze("evaluate", "--run", str(run), "--split", "test") == 0
    saved = json.loads((run / "analysis" / "evaluate.json").read_text())
    assert saved["split"] == "test" and saved["metrics"]["examples"] == 16 and saved["checkpoint"] == "checkpoints/best"
    with pytest.raises(ConfigError, match=r"^unknown --split 'tset'; did you mean 'test'\? \(valid: test, "
                                          r"validation\)$"):
        analyze("evaluate", "--run", str(run), "--split", "tset")


def test_evaluate_runs_in_the_precision_training_evaluated_in(tmp_path):
    """A run trained in bf16 (the default on CUDA) was evaluated in fp32: its numbers differed from the
    training's record. On this CPU bf16 autocast stands in for the GPU's."""
    raw = config("rope")
    raw["train"] |= {"precision": "bf16"}
    train(RunConfig.from_dict(raw), tmp_path / "bf16")
    final = [json.loads(line) for line in (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in line][-1]
    assert analyze("evaluate", "--run", str(tmp_path / "bf16"), "--checkpoint", "last") == 0
    measured = json.loads((tmp_path / "bf16" / "analysis" / "evaluate.json").read_text())["metrics"]
    assert measured["loss"] == pytest.approx(final["eval_loss"], rel=1e-6)
    fp32 = {**raw, "train": {**raw["train"], "precision": "fp32"}}
    assert measured["loss"] != pytest.approx(evaluate_loss_in(fp32, tmp_path / "bf16"), rel=1e-6)


def evaluate_loss_in(raw: dict, run_dir: Path) -> float:
    """The run's evaluation loss under another config's precision (the weights of its last checkpoint)."""
    from poslab.train import evaluation

    run = Run.load(run_dir, "last")
    cfg = RunConfig.from_dict(raw)
    return evaluation.evaluate(run.model, run.source(), cfg, run.device,
                               evaluation.autocast(run.device, cfg.train.precision))["loss"]


def test_evaluate_gives_a_diverged_language_model_an_infinite_perplexity(lm_run, monkeypatch):
    """exp of a loss past 709 raised OverflowError: a traceback, and the measured loss was not written."""
    from poslab.analysis.commands import Options, evaluate
    from poslab.train import evaluation

    monkeypatch.setattr(evaluation, "evaluate", lambda *args: {"loss": 10045.8, "accuracy": 0.0, "tokens": 12})
    run = Run.load(lm_run / "run")
    result = evaluate(run, Options(batch_size=3))
    assert result["metrics"]["loss"] == 10045.8 and result["metrics"]["perplexity"] == math.inf
    assert json.loads((run.out_dir / "evaluate.json").read_text())["metrics"]["loss"] == 10045.8


def test_evaluate_reads_a_whole_text_split_and_gives_perplexity(lm_run):
    """Training evaluated its first train.eval_batches (1 here); evaluate reads every sequence of the split."""
    from poslab.analysis.commands import Options, evaluate
    from poslab.train import evaluation

    run = Run.load(lm_run / "run")
    result = evaluate(run, Options(batch_size=3))
    source = run.source()
    labelled = sum(int((evaluation.targets(b["labels"], True) != -100).sum())
                   for b in source.eval_batches("validation", 3))
    first_batch = int((evaluation.targets(next(source.eval_batches("validation", 4))["labels"], True) != -100).sum())
    assert result["metrics"]["tokens"] == labelled > first_batch
    assert result["metrics"]["perplexity"] == pytest.approx(math.exp(result["metrics"]["loss"]))
    with pytest.raises(ConfigError, match=r"^unknown --split 'test' .*; a prepared corpus holds train and "
                                          r"validation$"):
        evaluate(run, Options(split="test"))
