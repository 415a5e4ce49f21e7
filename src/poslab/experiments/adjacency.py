"""Position without positional encodings (papers/adjacency.md): NoPE decoders on the four tasks.

Measures the adjacency probability score per layer at initialisation and after training, the
initialisation ablation (std and mean), a bidirectional NoPE control, MLP probes of position from
cosine-similarity vs variance features, and task accuracy of NoPE against RoPE.
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

import torch

from poslab.analysis import plots
from poslab.analysis.capture import collect
from poslab.analysis.commands import NULL_FEATURES, Options, adjacency as adjacency_analysis, probes as probes_analysis
from poslab.analysis.runs import Run
from poslab.analysis.similarity import sequence_adjacency
from poslab.experiments import claims
from poslab.experiments.common import ensure_runs, rel
from poslab.experiments.runner import RecipeResult
from poslab.models import build_model
from poslab.train import RunConfig

TASKS = ("addition", "reversal", "indexing", "ordering")
# The claims read the output of the first causal attention layer: the convex mix of earlier embeddings
# that the paper's mechanism is about. The residual stream after layer 1 (which adds each token's own
# embedding back) is reported beside it in the tables.
FIRST_LAYER = "blocks.0.attn_out"

# The paper's model (6 x 384, 10.6M parameters). Its initialisation ablation is measured on this model at every
# scale but smoke: untrained models cost one forward each.
PAPER_MODEL = {"d_model": 384, "n_layers": 6, "n_heads": 6}
SCALES = {
    "quick": {"model": {"d_model": 128, "n_layers": 2, "n_heads": 4}, "init_model": PAPER_MODEL,
              "train": {"steps": 300, "batch_size": 64, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 30},
              "data": {"train_size": 20000, "validation_size": 500, "test_size": 500},
              "sequences": 64, "probe_task": "reversal", "probe_steps": 300, "seeds": [0],
              # What the search tried for a claim (by its opening words) that does not hold: shown only then.
              "tried": {"score of the first causal attention layer's output >= 0.8 after":
                            "The search (benchmarks/quick_search/FINDINGS.md, adjacency_recipe.py) trained 5x longer "
                            "(1,500 steps: 0.75-0.78 in every task) and 3x wider (2 x 384 with 6 heads, 300 steps: "
                            "0.72-0.92): at these sizes training lowers the score, and longer training lowers it "
                            "further. At the paper's size (6 x 384) it fell from 0.996 at init to 0.535 on indexing "
                            "and 0.730 on ordering after 4,000 steps (one seed, lr 6e-4 to 6e-5 over those steps, weight decay "
                            "0.01: the paper scale's optimiser before it took nanoGPT's character-level one).",
                        "after training, early layers keep the pattern":
                            "Nothing was searched for it: the quick models have two layers, the paper's six. In the "
                            "paper-size runs above (FINDINGS.md, sixth session) only the residual streams were recorded "
                            "beyond the first layer: after the last layer against after the first, 0.493 vs 0.451 on "
                            "indexing and 0.640 vs 0.709 on ordering."}},
    # A few steps of everything: exercises the whole recipe in tests; its claims mean nothing.
    "smoke": {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2},
              "init_model": {"d_model": 32, "n_layers": 2, "n_heads": 2},
              "train": {"steps": 3, "batch_size": 8, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1},
              "data": {"train_size": 200, "validation_size": 40, "test_size": 40},
              "sequences": 24, "probe_task": "reversal", "probe_steps": 5, "seeds": [0]},
    # The paper states the model (6 x 384, 10.6M parameters: nanoGPT's character-level shape) and the data,
    # not the optimiser or the steps: these are that nanoGPT configuration's (shakespeare_char: 5,000 steps of
    # 64, lr 1e-3 to 1e-4, weight decay 0.1, beta2 0.99; its 100 warm-up steps made 200, as the task configs'),
    # without its dropout, which the paper does not name. A checkpoint every 1,000 steps, to resume from.
    "paper": {"model": PAPER_MODEL, "init_model": PAPER_MODEL,
              "train": {"steps": 5000, "batch_size": 64, "lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 200,
                        "weight_decay": 0.1, "betas": [0.9, 0.99], "checkpoint_every": 1000},
              "data": {"train_size": 20000, "validation_size": 2000, "test_size": 20000},
              "sequences": 512, "probe_task": "reversal", "probe_steps": 2000, "seeds": [0, 1, 2, 3, 4]},
}
INIT_STDS = (0.002, 0.02, 0.2)
INIT_MEANS = (0.0, 4.0, 8.0)
# Untrained models are cheap, so the ablation averages several initialisations: with one, the mean-8 score
# moved by 0.045 when only the 64 sequences it reads changed, across the claim's threshold.
INIT_SEEDS = (0, 1, 2)
# The paper's model sizes (layers, width), measured at initialisation (untrained models cost one forward
# each; the smoke scale uses two small ones). Heads are 64 wide, as nanoGPT's.
SIZES = {"smoke": ((1, 64), (2, 128)),
         "quick": tuple((layers, width) for layers in (6, 12, 24) for width in (192, 384, 768))}
SIZES["paper"] = SIZES["quick"]
# Scales that also train NoPE at every size (the paper finds the pattern stable across sizes after training
# too): on the first task, first seed; the scale's own model is the main runs'. Too slow for quick.
TRAINED_SIZES = ("smoke", "paper")


def run_config(scale: dict, task: str, scheme: str, seed: int) -> dict:
    return {
        "seed": seed,
        "model": {"arch": "decoder", "vocab_size": None, "max_seq_len": 64, "positional": {"name": scheme},
                  **scale["model"]},
        "data": {"kind": "task", "name": task, **scale["data"]},
        # Accuracy on the test split, as the paper reports it (20,000 problems at paper scale).
        "train": {"eval_every": 0, "log_every": 50, "best_metric": "exact_match",
                  "eval_split": "test", "eval_batch_size": 250, **scale["train"]},
    }


def first_layer_scores(model: torch.nn.Module, batches: list[dict], names: tuple[str, ...] = ()) -> dict[str, float]:
    """Mean adjacency score of the embeddings, the first layer's outputs and the streams ``names``."""
    caps, batch = collect(model, batches, ["embed", FIRST_LAYER, "blocks.0.resid_post", *names])
    mask = batch["attention_mask"].bool()
    return {name: float(sequence_adjacency(caps[name], mask).nanmean()) for name in caps}


def size_scores(base: dict, sizes: tuple[tuple[int, int], ...], batches: list[dict]) -> dict[tuple[int, int], dict]:
    """(layers, width) -> scores at initialisation of the first and the last attention layer's output."""
    scores = {}
    for layers, width in sizes:
        torch.manual_seed(0)
        model = build_model({**base, "n_layers": layers, "d_model": width, "n_heads": width // 64}).eval()
        last = f"blocks.{layers - 1}.attn_out"
        found = first_layer_scores(model, batches, (last,))
        scores[layers, width] = {"first": found[FIRST_LAYER], "last": found[last]}
    return scores


def runs(scale_name: str, out: Path) -> dict:
    """The trainings: (scheme, task, seed) -> (run config, run directory); NoPE, and RoPE for comparison; then
    (layers, width) -> NoPE on the first task at each further model size, where the scale trains sizes."""
    scale = SCALES[scale_name]
    trainings = {(scheme, task, seed): (run_config(scale, task, scheme, seed), out / "runs" / f"{scheme}-{task}-s{seed}")
                 for task in TASKS for seed in scale["seeds"] for scheme in ("nope", "rope")}
    for layers, width in sized_runs(scale_name):
        # Wider than the scale's model, a smaller learning rate (in proportion, as GPT-2's widths take 6e-4 at
        # 768 where nanoGPT's 384 takes 1e-3): the 768-wide 24-layer model at 1e-3 risks diverging.
        shrink = min(1.0, scale["model"]["d_model"] / width)
        train = {**scale["train"], "lr": scale["train"]["lr"] * shrink, "min_lr": scale["train"]["min_lr"] * shrink}
        sized = {**scale, "model": {"d_model": width, "n_layers": layers, "n_heads": width // 64}, "train": train}
        trainings[layers, width] = (run_config(sized, TASKS[0], "nope", scale["seeds"][0]),
                                    out / "runs" / f"nope-{TASKS[0]}-{layers}x{width}-s{scale['seeds'][0]}")
    return trainings


def sized_runs(scale_name: str) -> tuple[tuple[int, int], ...]:
    """The (layers, width) the scale trains besides its own model."""
    own = (SCALES[scale_name]["model"]["n_layers"], SCALES[scale_name]["model"]["d_model"])
    return tuple(size for size in SIZES[scale_name] if size != own) if scale_name in TRAINED_SIZES else ()


def run(scale_name: str, out: Path, log: Callable[[str], None], jobs: int = 1, device: str = "cpu") -> RecipeResult:
    scale = SCALES[scale_name]
    table, trained_scores, init_scores, embed_scores, trained_embed, trained_last = [], {}, {}, {}, {}, {}
    accuracy: dict[str, dict[str, float]] = {"nope": {}, "rope": {}}
    distinct: dict[str, str] = {}
    probe_result = None
    figures = []
    finals = ensure_runs(runs(scale_name, out), log, jobs)
    for task in TASKS:
        for scheme in ("nope", "rope"):
            accuracy[scheme][task] = statistics.fmean(finals[scheme, task, seed]["eval_exact_match"]
                                                      for seed in scale["seeds"])
        first = Run.load(out / "runs" / f"nope-{task}-s{scale['seeds'][0]}", device=device)
        different, size = first.source().distinct(first.config.train.eval_split)
        distinct[task] = f"{different:,} of {size:,}"
        # Scores are means over the seeds; the figures and the probe are the first seed's.
        scores: dict[str, dict[str, list[float]]] = {"trained": {}, "init": {}}
        for seed in scale["seeds"]:
            analysed = Run.load(out / "runs" / f"nope-{task}-s{seed}", device=device)
            data = adjacency_analysis(analysed, Options(sequences=scale["sequences"], batch_size=32))
            for label, layers in scores.items():
                for name, score in data["models"][label].items():
                    layers.setdefault(name, []).append(score["mean"])
            if seed != scale["seeds"][0]:
                continue
            figures += [rel(analysed.out_dir / f, out) for f in data["figures"]]
            if task == scale["probe_task"]:
                probe_result = probes_analysis(analysed, Options(sequences=scale["sequences"], batch_size=32,
                                                                 probe_steps=scale["probe_steps"],
                                                                 targets=("position",)))
                figures += [rel(analysed.out_dir / f, out) for f in probe_result["figures"]]
        trained = {name: statistics.fmean(v) for name, v in scores["trained"].items()}
        init = {name: statistics.fmean(v) for name, v in scores["init"].items()}
        trained_scores[task], init_scores[task] = trained[FIRST_LAYER], init[FIRST_LAYER]
        trained_last[task] = trained[f"blocks.{scale['model']['n_layers'] - 1}.attn_out"]
        embed_scores[task], trained_embed[task] = init["embed"], trained["embed"]
        for name in trained:
            table.append([task, name, init[name], trained[name]])

    # Initialisation ablation and the bidirectional control, at initialisation on one task's sequences, with
    # the scale's init_model (the paper's model but at smoke scale).
    base = RunConfig.from_dict(run_config(scale, TASKS[0], "nope", 0))
    batches = Run(out, base, build_model(base.model)).batches(scale["sequences"], 32)
    untrained = {**base.model.to_dict(), **scale["init_model"]}
    ablation = {}
    for std in INIT_STDS:
        for mean in INIT_MEANS:
            scores = []
            for seed in INIT_SEEDS:
                torch.manual_seed(seed)
                # In float64: a large mean points every state nearly one way, and float32's rounding in the
                # forward reordered their cosines (scores of means 4 and 8 apart by up to 0.03 where they are
                # equal); the cosines themselves are float64 anyway (similarity.cosine_self_similarity).
                model = build_model({**untrained, "init_std": std, "init_mean": mean}).double().eval()
                scores.append(first_layer_scores(model, batches)[FIRST_LAYER])
            ablation[(std, mean)] = statistics.fmean(scores)
    at_init = f"{untrained['n_layers']} x {untrained['d_model']} model at init"
    small_stds = INIT_STDS[:-1]
    # The seed's words, "a large mean has a smaller effect on the pattern" (than a large std): each std's drop
    # from mean 0, the largest over the large means against the smallest drop to std 0.2.
    mean_drop = max(ablation[(s, 0.0)] - ablation[(s, m)] for s in small_stds for m in INIT_MEANS[1:])
    std_drop = min(ablation[(s, 0.0)] - ablation[(INIT_STDS[-1], 0.0)] for s in small_stds)
    sizes = size_scores(base.model.to_dict(), SIZES[scale_name], batches)
    trained_sizes = {}
    if sized_runs(scale_name):
        all_runs = runs(scale_name, out)
        for layers, width in SIZES[scale_name]:  # at the scale's own size, its first run on the first task
            _, run_dir = all_runs.get((layers, width)) or all_runs["nope", TASKS[0], scale["seeds"][0]]
            last = f"blocks.{layers - 1}.attn_out"
            found = first_layer_scores(Run.load(run_dir, device=device).model, batches, (last,))
            trained_sizes[layers, width] = {"first": found[FIRST_LAYER], "last": found[last]}
    torch.manual_seed(0)
    encoder = build_model({**untrained, "arch": "encoder"}).eval()
    bidirectional = first_layer_scores(encoder, batches)[FIRST_LAYER]
    figures.append(rel(plots.heatmap(out / "init_ablation.png",
                                     [[ablation[(s, m)] for m in INIT_MEANS] for s in INIT_STDS],
                                     "adjacency after layer 1 at initialisation", "init mean", "init std",
                                     yticklabels=[str(s) for s in INIT_STDS],
                                     xticklabels=[f"{m:g}" for m in INIT_MEANS]), out))

    mlp = probe_result["models"]["trained"]["mlp"]
    by_size = {f"{layers} x {width}": s["first"] for (layers, width), s in sizes.items()}
    result_claims = [
        claims.within("score at the token-embedding layer is ~0.5 (mean over tasks, init)", "~0.5",
                      statistics.fmean(embed_scores.values()), 0.4, 0.6),
        # The paper finds the pattern "stable before and after training": the embedding layer's ~0.5 too.
        claims.all_within("score at the token-embedding layer stays ~0.5 after training (every task)", "~0.5",
                          trained_embed, 0.4, 0.6),
        claims.all_of("score of the first causal attention layer's output >= 0.8 at initialisation (every task)", "0.8-1.0",
                      init_scores, 0.8),
        claims.all_of("score of the first causal attention layer's output >= 0.8 after training (every task)", "0.8-1.0",
                      trained_scores, 0.8),
        # "Trained models: early layers keep a strong pattern, later layers weaken" (papers/adjacency.md).
        claims.all_exceed("after training, early layers keep the pattern and later ones weaken it: the first "
                          "attention layer's output scores above the last's (every task)", "early strong, later weaker",
                          trained_scores, trained_last, ("first", "last")),
        claims.at_most(f"init std 0.2 destroys the pattern (first attention layer's output, init mean 0; {at_init})",
                       "disappears", ablation[(0.2, 0.0)], 0.65),
        claims.at_least("init std <= 0.02 keeps the pattern (first attention layer's output; lowest of std 0.002, 0.02; "
                        f"mean 0; {at_init})", ">= 0.8", min(ablation[(s, 0.0)] for s in small_stds), 0.8),
        # At both stds the pattern survives with mean 0 (the claim above), not at the more favourable one alone.
        claims.all_of("a large init mean matters less: mean 0, 4, 8 keeps >= 0.8 (lowest of std 0.002, 0.02; "
                      f"{at_init})",
                      "matters less", {f"mean {m:g}": min(ablation[(s, m)] for s in small_stds) for m in INIT_MEANS},
                      0.8),
        claims.exceeds("a large init mean changes the pattern less than a large std: the largest drop from mean 0 to "
                       "mean 4 or 8 (std 0.002, 0.02) below the smaller drop from std 0.002 or 0.02 to 0.2 (mean 0; "
                       f"{at_init})", "a large mean has a smaller effect",
                       {"std 0.2 drop": std_drop, "largest mean drop": mean_drop},
                       larger="std 0.2 drop", smaller="largest mean drop"),
        claims.all_of("at initialisation the pattern is stable across model sizes: first attention layer's output "
                      f">= 0.8 at every size (layers x width: {', '.join(by_size)})", "stable across sizes",
                      by_size, 0.8),
        *([claims.all_of("after training the pattern is stable across model sizes too: first attention layer's "
                         f"output >= 0.8 at every size ({TASKS[0]}, seed {scale['seeds'][0]}; layers x width: "
                         f"{', '.join(f'{l} x {w}' for l, w in trained_sizes)})", "stable across sizes",
                         {f"{l} x {w}": s["first"] for (l, w), s in trained_sizes.items()}, 0.8)]
          if trained_sizes else []),
        claims.within("bidirectional NoPE control has no adjacency pattern (first attention layer's output; "
                      f"{at_init})", "~0.5", bidirectional, 0.4, 0.6),
        claims.lowest("cosine-similarity features predict position better than variance features "
                      f"(MLP probe NRMSE, lower is better; {scale['probe_task']}; null: the cosine features of "
                      "the same states with their tokens shuffled)", "cosine beats variance",
                      {"cosine NRMSE": mlp["cosine"]["nrmse"], "variance NRMSE": mlp["variance"]["nrmse"],
                       "null NRMSE": mlp[NULL_FEATURES]["nrmse"]}, best="cosine NRMSE"),
    ]
    tables = [
        {"title": f"Adjacency score by layer (NoPE decoders, mean over seeds {scale['seeds']})",
         "columns": ["task", "hidden state", "init", "trained"], "rows": table},
        {"title": f"Initialisation ablation: score after layer 1 at init, mean of {len(INIT_SEEDS)} initialisations of "
                  f"the {at_init} (rows std, columns mean)",
         "columns": ["std \\ mean", *[f"{m:g}" for m in INIT_MEANS]],
         "rows": [[s, *[ablation[(s, m)] for m in INIT_MEANS]] for s in INIT_STDS]},
        {"title": f"Model sizes at initialisation ({TASKS[0]} sequences): score of the first and the last attention "
                  "layer's output" + (f"; after training on {TASKS[0]} too (seed {scale['seeds'][0]})"
                                      if trained_sizes else ""),
         "columns": ["layers", "width", "first layer", "last layer",
                     *(["first layer, trained", "last layer, trained"] if trained_sizes else [])],
         "rows": [[layers, width, s["first"], s["last"],
                   *([trained_sizes[layers, width]["first"], trained_sizes[layers, width]["last"]]
                     if trained_sizes else [])] for (layers, width), s in sizes.items()]},
        {"title": f"MLP probe of absolute position ({scale['probe_task']}, trained NoPE)",
         "columns": ["features", "NRMSE", "Pearson R"],
         "rows": [[k, v["nrmse"], v["pearson_r"]] for k, v in mlp.items()]},
        {"title": f"Exact-match accuracy after {scale['train']['steps']} steps (mean over seeds {scale['seeds']})",
         "columns": ["task", "NoPE", "RoPE", "distinct problems in the evaluated set"],
         "rows": [[t, accuracy["nope"][t], accuracy["rope"][t], distinct[t]] for t in TASKS]},
    ]
    notes = [f"Bidirectional NoPE control, score after layer 1 at init: {bidirectional:.3f}. "
             "Task accuracy is context, not a claim: the paper reports that neither adjacency nor variance explains "
             "all of task performance.", *claims.tried_notes(result_claims, scale.get("tried", {}))]
    return RecipeResult("adjacency", scale_name, result_claims, figures=figures, tables=tables, notes=notes,
                        details={"trained_first_layer": trained_scores, "trained_last_layer": trained_last,
                                 "init_first_layer": init_scores,
                                 "embed": embed_scores, "trained_embed": trained_embed, "accuracy": accuracy,
                                 "bidirectional": bidirectional,
                                 "ablation": {f"std={s},mean={m}": v for (s, m), v in ablation.items()},
                                 "sizes": {f"{layers}x{width}": s for (layers, width), s in sizes.items()},
                                 "trained_sizes": {f"{layers}x{width}": s
                                                   for (layers, width), s in trained_sizes.items()}})

