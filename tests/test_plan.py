"""``poslab reproduce --plan``: what the recipes would train, counted without training or writing anything."""
import json
from pathlib import Path

import pytest
import yaml

from poslab.cli import main
from poslab.experiments import plan as planning
from poslab.models import build_model


@pytest.mark.parametrize("scheme, attention", [("nope", 12), ("rope", 12), ("alibi", 12), ("t5", 12),
                                               # PoPE's q.k is 2d wide, and SDPA pads v to 2d to match
                                               ("pope", 24)])
def test_flops_are_the_standard_count(scheme, attention):
    """Counted on the meta device, training FLOPs per sequence of n tokens are 6 n M + c L n^2 d, M the
    matmul weights (every 2-D weight but the input embedding, a lookup): Kaplan et al.'s 6N plus attention's
    scores and weighted sum, forward and backward (c = 12 for d-wide q.k, 24 for PoPE on SDPA)."""
    layers, width, n = 2, 64, 24
    config = {"arch": "decoder", "vocab_size": 100, "d_model": width, "n_layers": layers, "n_heads": 4,
              "max_seq_len": 64, "mlp": "swiglu", "positional": {"name": scheme}}
    model = build_model(config)
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name != "model.embed.weight"
                 and "positional" not in name)
    parameters, flops = planning._count(json.dumps(config, sort_keys=True), n)
    assert parameters == model.num_parameters()
    assert flops == 6 * n * matmul + attention * layers * n * n * width


def test_flops_of_a_scheme_that_reads_positions_are_counted():
    """RoPE's dynamic scaling reads the longest position to stretch its base: on the meta device there is none,
    and counting a model that uses it stopped the plan with 'Tensor.item() cannot be called on meta tensors'."""
    config = {"arch": "decoder", "vocab_size": 30, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
              "positional": {"name": "rope", "options": {"scaling": "dynamic", "factor": 2.0}}}
    plain = {**config, "positional": {"name": "rope"}}
    assert planning._count(json.dumps(config), 16) == planning._count(json.dumps(plain), 16)


def test_plan_lists_each_training_once_with_its_progress(tmp_path):
    """Runs two recipes share are listed once; a finished run is done, an interrupted one shows its step."""
    from poslab.experiments import extrapolation, indirect_indexing
    from poslab.experiments.common import ensure_run
    from poslab.train import RunConfig, train

    runs = indirect_indexing.runs("smoke", tmp_path / "indirect-indexing")
    (done_config, done_dir), (part_config, part_dir) = runs["pope", 0], runs["rope", 0]
    ensure_run(done_config, done_dir, lambda _: None)
    train(RunConfig.from_dict({**part_config, "train": {**part_config["train"], "steps": 2}}), part_dir)
    # As if the 3-step run had stopped after step 2: its config.yaml names the 3 steps it set out to train.
    saved = yaml.safe_load((part_dir / "config.yaml").read_text())
    saved["train"]["steps"] = 3
    (part_dir / "config.yaml").write_text(yaml.safe_dump(saved))

    trainings = planning.plan(["indirect-indexing", "extrapolation", "frequencies"], "smoke", tmp_path)
    by_dir = {t.directory: t for t in trainings}
    assert len(by_dir) == len(trainings) == len(runs) + len(extrapolation.runs("smoke", tmp_path))
    assert by_dir["indirect-indexing/runs/pope-s0"].status == "done"
    assert by_dir["indirect-indexing/runs/rope-s0"].status == "step 2 of 3"
    assert by_dir["extrapolation/runs/pope"].recipes == ("extrapolation", "frequencies")
    assert by_dir["extrapolation/runs/pope"].status == "not started"
    assert by_dir["extrapolation/runs/rope-yarn"].recipes == ("extrapolation",)
    pope = by_dir["indirect-indexing/runs/pope-s0"]
    assert pope.model == "decoder, pope, 1 x 32" and pope.tokens == 3 * 8 * pope.sequence
    text = planning.render(trainings, "smoke")
    assert "| indirect-indexing | indirect-indexing/runs/rope-s0 | decoder, rope, 1 x 32 |" in text
    total = sum(t.flops for t in trainings)
    part = by_dir["indirect-indexing/runs/rope-s0"]
    assert part.left == pytest.approx(part.flops / 3)  # 2 of its 3 steps are trained
    left = total - by_dir["indirect-indexing/runs/pope-s0"].flops - 2 * part.flops / 3
    assert f"| total | {len(trainings)} | {total:.3g} | {left:.3g} |" in text


def test_paper_plan_from_the_command_line_writes_nothing(tmp_path, capsys):
    """The paper scale is listed without downloading or preparing a corpus, and --out is not created. The
    sizes are the papers': the adjacency paper's 10.6M model, GPT-2's 124M, the issue's ~5e16 FLOPs of one
    indirect-indexing run."""
    out = tmp_path / "paper"
    assert main(["reproduce", "all", "--scale", "paper", "--plan", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    rows = {cells[1]: cells for cells in ([c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines()
                                          if line.startswith("| ") and "/runs/" in line)}
    assert rows["adjacency/runs/nope-addition-s0"][3] == "10.6M"
    assert rows["extrapolation/runs/pope"][0] == "extrapolation, frequencies, pope-ablation"
    # the paper's ablations are of its 124M model; sized at its tokenizer's cap, which a FineWeb BPE reaches
    assert rows["pope-ablation/runs/no-delta"][3] == "<= 123.6M"
    assert rows["extrapolation/runs/pope"][3] == "<= 123.6M" and rows["extrapolation/runs/pope"][6].startswith("<= ")
    assert "<=: a text run whose tokenizer is not trained yet is sized at its vocabulary cap" in text
    assert not rows["adjacency/runs/nope-addition-s0"][6].startswith("<=")  # a task's vocabulary is known
    assert not rows["dstg/runs/dstg"][3].startswith("<=")  # so is a ready tokenizer's (bert-base-uncased)
    assert rows["indirect-indexing/runs/rope-half-s0"][2] == "decoder, rope (fraction=0.5), 8 x 512"
    assert 4e16 < float(rows["indirect-indexing/runs/rope-s0"][6]) < 6e16
    assert all(cells[-1] == "not started" for cells in rows.values())
    # The README quotes this plan's totals.
    total = next(line for line in text.splitlines() if line.startswith("| total |")).split(" | ")
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert f"counts {total[1]} trainings and {total[2].replace('+', '')} FLOPs" in readme


def test_under_torchrun_rank_0_alone_prints_the_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert main(["reproduce", "adjacency", "--scale", "smoke", "--plan", "--out", str(tmp_path / "p")]) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["reproduce", "adjacency", "--scale", "smoke", "--plan", "--out", str(tmp_path / "p")]) == 0
    assert "| total |" in capsys.readouterr().out


def test_plan_refuses_an_unknown_scale_or_recipe(tmp_path, capsys):
    assert main(["reproduce", "all", "--scale", "huge", "--plan", "--out", str(tmp_path / "x")]) == 2
    assert "--scale must be one of" in capsys.readouterr().err
    assert main(["reproduce", "dstgg", "--plan", "--out", str(tmp_path / "x")]) == 2
    assert "did you mean 'dstg'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_plan_refuses_another_scales_directory(tmp_path, capsys):
    """As the run would: --plan read a smoke directory's checkpoints as paper progress ("step 3 of 100,000")
    and counted the paper models with the smoke run's vocabulary."""
    (tmp_path / "scale.json").write_text('{"scale": "smoke"}')  # what a smoke run writes when it starts
    assert main(["reproduce", "frequencies", "--scale", "paper", "--plan", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"poslab: error: {tmp_path} holds smoke-scale trainings") and err.count("\n") == 1


def test_plan_counts_a_started_runs_model_with_the_vocabulary_it_reached(tmp_path):
    """A corpus's tokenizer size is only a cap; a run that has started saved the vocabulary it reached in
    its config.yaml, and the plan counts that model's parameters and FLOPs."""
    from poslab.experiments import indirect_indexing
    from poslab.train import RunConfig

    config, run_dir = indirect_indexing.runs("smoke", tmp_path / "indirect-indexing")["pope", 0]
    fresh = planning._training(("indirect-indexing",), config, run_dir, tmp_path)
    saved = RunConfig.from_dict(config).to_dict()
    saved["model"]["vocab_size"] += 7
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    reached = planning._training(("indirect-indexing",), config, run_dir, tmp_path)
    assert reached.parameters == build_model(saved["model"]).num_parameters() != fresh.parameters


def test_render_counts_a_shared_training_once_with_its_first_recipe():
    """The per-recipe totals: a training two recipes read counts with the first of them only, and the total
    row adds every training once."""
    def training(recipes, flops, left):
        return planning.Training(recipes=recipes, directory=f"{recipes[0]}/runs/{flops:g}", model="m", parameters=1,
                                 sequence=8, tokens=80, flops=flops, status="s", left=left)

    trainings = [training(("a",), 1e3, 1e3), training(("b", "c"), 2e3, 0.0), training(("c",), 4e3, 1e3)]
    lines = planning.render(trainings, "smoke").splitlines()
    assert "| a | 1 | 1e+03 | 1e+03 |" in lines
    assert "| b | 1 | 2e+03 | 0 |" in lines
    assert "| c | 1 | 4e+03 | 1e+03 |" in lines
    assert "| total | 3 | 7e+03 | 2e+03 |" in lines


def test_every_paper_scale_training_fits_8_gpus_of_80_gib(tmp_path, monkeypatch):
    """The memory check run on every paper-scale training as torchrun on 8 GPUs of 80 GiB would see it, each
    sized at its tokenizer's cap: the language models' final evaluation asked for 147 GiB or more per GPU (a whole
    512 x 1024 batch of logits) and would have failed after their whole training."""
    import importlib
    import types

    import torch

    from poslab.experiments.runner import RECIPES
    from poslab.train import RunConfig
    from poslab.train import memory

    gpu = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    parallel = types.SimpleNamespace(world_size=8, device=torch.device("cuda", 0))
    checked = 0
    for name, (where, _) in RECIPES.items():
        for config, _ in importlib.import_module(where.split(":")[0]).runs("paper", tmp_path / name).values():
            vocab, sequence, _ = planning.data_shape(config["data"], config.get("seed", 0))
            cfg = RunConfig.from_dict({**config, "model": {**config["model"], "vocab_size": vocab}})
            memory.check_memory(cfg, parallel, sequence)
            checked += 1
    assert checked >= 60
