"""The analyses behind ``poslab analyze KIND --run DIR``.

Each one measures a run (and, where the papers compare against it, the same architecture at random
initialisation), writes DIR/analysis/<kind>.json and <kind>*.png, and returns the numbers. ANALYSES
maps KIND to its function; a KIND that does not apply to the model (spectra without an AP table,
frequencies without rotary frequencies, heads with a single logit term) raises ConfigError.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from poslab.analysis import plots
from poslab.analysis.attention import add_sums, attention_means, attention_sums
from poslab.analysis.capture import collect, iterate_captures
from poslab.analysis.extrapolation import (CONTEXT_SCALINGS, evaluate_lengths, evaluation_config, scaled_lengths,
                                           training_length, training_tokens)
from poslab.analysis.frequencies import frequency_sums, usage_summary
from poslab.analysis.heads import MARKS, allowed_keys, label_heads, term_variances, variance_shares
from poslab.analysis.probes import (COSINE_LAGS, absolute_positions, classification_probe, cosine_features,
                                    mlp_probe, ridge_probe, shuffle_tokens, split_sequences, valid_targets,
                                    variance_features, window_labels)
from poslab.analysis.runs import Run, by_depth, layer_of, stream_of
from poslab.analysis.similarity import cosine_self_similarity, sequence_adjacency
from poslab.analysis.spectra import pca, spectrum_summary
from poslab.analysis.variance import variance_profile, variance_trend
from poslab.errors import ConfigError, DataError
from poslab.positional import SCHEMES, AttentionGeometry, InputPositional, LayerPositional
from poslab.train import evaluation as training_evaluation

STREAMS = ["embed", "embed.*", "blocks.*.resid_post", "blocks.*.resid_post.*"]
ATTN_OUT = ["blocks.*.attn_out", "blocks.*.attn_out.*"]
# abs_position is the data's count of positions, which on text batches (right-padded) is "position" again
NOT_TARGETS = ("input_ids", "labels", "attention_mask", "doc_id", "abs_position")
NULL_FEATURES = "cosine, tokens shuffled (null)"


@dataclass
class Options:
    """What the command line sets; each KIND reads the fields it needs (see ``cli.py`` for their help)."""

    sequences: int = 64
    batch_size: int = 16
    split: str | None = None
    probe_steps: int = 500
    max_classes: int = 64
    threshold: float = 0.5
    factors: tuple[float, ...] = (1, 2, 3, 4, 6, 8, 10)
    scalings: tuple[str, ...] = CONTEXT_SCALINGS
    compare: tuple[str, ...] = ()
    checkpoint: str | None = None
    device: str = "cpu"
    targets: tuple[str, ...] | None = None
    eval_data: dict | None = None  # extrapolation: data overrides evaluated instead of the run's own data


def _models(run: Run) -> list[tuple[str, nn.Module]]:
    return [("trained", run.model), ("init", run.control())]


def staged(analysis: Callable[[Run, Options], dict]) -> Callable[[Run, Options], dict]:
    """The analysis, writing into a staging directory that replaces its earlier results only once it has
    finished (``Run.staged``); the KIND is the function's name."""
    @functools.wraps(analysis)
    def run_staged(run: Run, opts: Options) -> dict:
        with run.staged(analysis.__name__):
            return analysis(run, opts)

    return run_staged


def _finish(run: Run, kind: str, data: dict, figures: list) -> dict:
    """Write <kind>.json, saying which weights it measured and which figures it drew."""
    data = {**run.measured(), **data, "figures": [str(p.name) for p in figures]}
    plots.write_json(run.out_dir / f"{kind}.json", data)
    return data


def _nanstats(values: torch.Tensor) -> dict:
    keep = values[torch.isfinite(values)]
    return {"mean": float(keep.mean()) if keep.numel() else math.nan,
            "std": float(keep.std(unbiased=False)) if keep.numel() else math.nan, "sequences": int(keep.numel())}


# ---------------------------------------------------------------------------------------------- adjacency

@staged
def adjacency(run: Run, opts: Options) -> dict:
    """Adjacency score per layer and stream, trained vs initialisation; similarity matrices of one sequence."""
    batches = run.batches(opts.sequences, opts.batch_size, opts.split)
    data: dict = {"run": str(run.dir), "causal": run.causal, "models": {}}
    series, mats = {}, {}
    for label, model in _models(run):
        caps, batch = collect(model, batches, STREAMS + ATTN_OUT)
        mask = batch["attention_mask"].bool()
        scores = {}
        for name in by_depth(caps):
            scores[name] = {"layer": layer_of(name), "stream": stream_of(name),
                            **_nanstats(sequence_adjacency(caps[name], mask))}
            key = f"{label} {stream_of(name)}"
            series.setdefault(key, ([], []))
            series[key][0].append(layer_of(name))
            series[key][1].append(scores[name]["mean"])
            if label == "trained" and stream_of(name) == "resid":
                real = mask[0]
                mats[name] = cosine_self_similarity(caps[name][0][real]).numpy()
        data["models"][label] = scores
    figures = [
        plots.lines(run.out_dir / "adjacency.png", series, f"Adjacency score by layer ({run.name})",
                    "layer (0 = embeddings)", "adjacency probability score", hline=0.5),
        plots.matrices(run.out_dir / "adjacency_similarity.png", mats,
                       f"Cosine self-similarity of the trained model's states, position x position, first sequence "
                       f"({run.name})"),
    ]
    return _finish(run, "adjacency", data, figures)


# ----------------------------------------------------------------------------------------------- variance

@staged
def variance(run: Run, opts: Options) -> dict:
    """Per-position variance across hidden dimensions of attention outputs and residual streams."""
    batches = run.batches(opts.sequences, opts.batch_size, opts.split)
    data: dict = {"run": str(run.dir), "models": {}}
    figures = []
    for label, model in _models(run):
        caps, batch = collect(model, batches, ATTN_OUT + STREAMS)
        mask = batch["attention_mask"].bool()
        entry = {}
        for name in by_depth(caps):
            profile = variance_profile(caps[name], mask)
            entry[name] = {"profile": profile.tolist(), **variance_trend(profile)}
        data["models"][label] = entry
        if label == "trained":
            for kind in ("attn_out", "resid_post"):
                names = [n for n in by_depth(entry) if f".{kind}" in n or kind == "resid_post" and layer_of(n) == 0]
                series = {n: (list(range(len(entry[n]["profile"]))), entry[n]["profile"]) for n in names}
                if series:
                    figures.append(plots.lines(run.out_dir / f"variance_{kind}.png", series,
                                               f"Variance across hidden dims: {kind}, trained model ({run.name})",
                                               "position", "variance"))
    return _finish(run, "variance", data, figures)


# ------------------------------------------------------------------------------------------------- probes

def _task_targets(labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """The label each state is asked to predict: labels[i + 1] for a causal model, labels[i] otherwise."""
    if not causal:
        return labels
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)


def _probe_targets(batch: dict, mask: torch.Tensor, wanted: tuple[str, ...] | None) -> dict[str, torch.Tensor]:
    targets = {"position": absolute_positions(mask)}
    targets.update({k: v for k, v in batch.items() if k not in NOT_TARGETS and v.dim() == 2})
    if "doc_id" in batch:  # a packed window or a long document's later chunk starts mid-document
        targets.update(window_labels(batch))
    if wanted is None:
        return targets
    for name in wanted:
        if name not in targets:
            raise ConfigError(f"unknown probe target '{name}'; this run's data offers: {', '.join(targets)}")
    return {k: targets[k] for k in wanted}


@staged
def probes(run: Run, opts: Options) -> dict:
    """Linear (ridge) probes of every layer for position and structure labels; 4-layer MLP probes of
    position from cosine-similarity vs variance features; classification of task labels; trained vs init."""
    batches = run.batches(opts.sequences, opts.batch_size, opts.split)
    data: dict = {"run": str(run.dir), "models": {}}
    ridge_series, class_series, mlp_groups = {}, {}, {}
    for label, model in _models(run):
        caps, batch = collect(model, batches, STREAMS + ATTN_OUT)
        mask = batch["attention_mask"].bool()
        split = split_sequences(mask.shape[0], seed=run.config.seed, same=batch["input_ids"])
        targets = _probe_targets(batch, mask, opts.targets)
        streams = [n for n in by_depth(caps) if not stream_of(n).startswith("attn_out")]
        entry: dict = {"ridge": {}, "mlp": {}, "classification": {}}
        for target, y in targets.items():
            labelled = valid_targets(y, mask)
            if not all(labelled[rows].any() for rows in (split.train, split.val, split.test)):
                missing = (f"probe target '{target}' has no labelled token in the training, validation or test "
                           "sequences")
                if opts.targets:  # asked for by name
                    raise DataError(f"{missing}; analyse more sequences (--sequences)")
                # Within-paragraph labels exist only where a paragraph starts in view: few in short windows.
                entry["ridge"][target] = {"skipped": missing}
                continue
            entry["ridge"][target] = {}
            for name in streams:
                r2 = ridge_probe(caps[name], y, mask, split)["r2"][0]
                entry["ridge"][target][name] = r2
                key = f"{label} {stream_of(name)}"
                panel = ridge_series.setdefault(target, {}).setdefault(key, ([], []))
                panel[0].append(layer_of(name))
                panel[1].append(r2)
        whole = [n for n in streams if stream_of(n) == "resid" and not n.startswith("embed")]
        attn = [n for n in by_depth(caps) if stream_of(n) == "attn_out"]
        shuffled = {n: shuffle_tokens(caps[n], mask, seed=run.config.seed) for n in whole}
        cosine = [cosine_features(caps[n], mask, causal=run.causal) for n in whole]
        probed = mask & cosine[0][1]  # tokens with every cosine feature; both kinds probe the same ones
        # Each hypothesis read where it is stated: the adjacency pattern in the residual stream, the variance in
        # the attention outputs (causal attention averages fewer values at early positions).
        features = {"cosine": torch.cat([f for f, _ in cosine], -1),
                    "variance": torch.cat([variance_features(caps[n]) for n in attn], -1),
                    NULL_FEATURES: torch.cat([cosine_features(shuffled[n], mask, causal=run.causal)[0]
                                              for n in whole], -1)}
        if all(probed[rows].any() for rows in (split.train, split.val, split.test)):
            for kind, x in features.items():
                entry["mlp"][kind] = mlp_probe(x, targets.get("position", absolute_positions(mask)), probed, split,
                                               steps=opts.probe_steps, seed=run.config.seed)
            mlp_groups[label] = {f"{k} R": v["pearson_r"] for k, v in entry["mlp"].items()}
            mlp_groups[label].update({f"{k} NRMSE": v["nrmse"] for k, v in entry["mlp"].items()})
        else:  # more sequences of the same length cannot help: say so, and keep the other probes
            around = "back" if run.causal else "back and ahead"
            entry["mlp"] = {"skipped": f"no token of some split has every cosine feature: each needs real tokens "
                                       f"{max(COSINE_LAGS)} positions {around}, longer than these sequences"}
        # Text sources hand analyses intact text without labels; only task problems have classes to probe.
        task = _task_targets(batch["labels"], run.causal) if "labels" in batch else None
        classes = torch.unique(task[valid_targets(task, mask)]).numel() if task is not None else 0
        if 2 <= classes <= opts.max_classes:
            for name in streams:
                result = classification_probe(caps[name], task, mask, split, steps=opts.probe_steps,
                                              seed=run.config.seed)
                entry["classification"][name] = result
                key = f"{label} {stream_of(name)}"
                class_series.setdefault(key, ([], []))
                class_series[key][0].append(layer_of(name))
                class_series[key][1].append(result["accuracy"])
        elif task is None:
            entry["classification"] = {"skipped": "no task labels (text data)"}
        else:
            entry["classification"] = {"skipped": f"task labels have {classes} classes (probed: 2..{opts.max_classes})"}
        data["models"][label] = entry
    figures = [plots.line_panels(run.out_dir / "probes_ridge.png", ridge_series,
                                 f"Linear probes, test R^2 ({run.name})", "layer (0 = embeddings)", "R^2")]
    if mlp_groups:
        figures.append(plots.bars(run.out_dir / "probes_mlp.png", mlp_groups,
                                  f"4-layer MLP probe of position ({run.name})",
                                  "Pearson R (higher is better), NRMSE (lower)"))
    if class_series:
        figures.append(plots.lines(run.out_dir / "probes_classification.png", class_series,
                                   f"Probes of the next answer token (the task's labels; {run.name})",
                                   "layer (0 = embeddings)", "classification accuracy", ylim=(0, 1)))
    return _finish(run, "probes", data, figures)


# ------------------------------------------------------------------------------------------------ spectra

def ap_table(model: nn.Module) -> torch.Tensor | None:
    """The learned absolute-position table (positions, d) of a model, or None: a model's own
    ``ap_table()`` (DSTG), else the 2-D weight of its input positional module (learned absolute)."""
    if callable(getattr(model, "ap_table", None)):
        return model.ap_table()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, InputPositional) and isinstance(weight, nn.Parameter) and weight.dim() == 2:
            return weight
    return None


@staged
def spectra(run: Run, opts: Options) -> dict:
    """PCA and DCT-II spectra of the learned AP table over the positions training reached."""
    tables = {label: ap_table(model) for label, model in _models(run)}
    if tables["trained"] is None:
        raise ConfigError(f"spectra needs a learned absolute-position table; the model of {run.dir} has none "
                          "(use a run with positional 'learned' or arch 'dstg' with d_ap > 0)")
    # a DSTG model shifts each training sequence by up to position_offset_max: those rows were trained too
    reached = int(training_tokens(run.config)) + getattr(run.config.model, "position_offset_max", 0)
    rows = min(reached, tables["trained"].shape[0])
    data: dict = {"run": str(run.dir), "positions": rows, "models": {}}
    for label, table in tables.items():
        data["models"][label] = spectrum_summary(table.detach()[:rows].cpu())
    trained = data["models"]["trained"]
    k = min(16, len(trained["explained_variance_ratio"]))
    series = {label: (list(range(1, k + 1)), m["explained_variance_ratio"][:k]) for label, m in data["models"].items()}
    bins = min(32, rows)
    figures = [
        plots.lines(run.out_dir / "spectra_pca.png", series, f"AP table PCA ({run.name})", "component",
                    "explained variance ratio"),
        plots.lines(run.out_dir / "spectra_components.png",
                    {f"PC{i + 1}": (list(range(rows)), c)
                     for i, c in enumerate(spectrum_scores(tables["trained"], rows))},
                    f"Top principal components of the AP table along positions ({run.name})", "position", "score"),
        plots.heatmap(run.out_dir / "spectra_dct.png", [p[:bins] for p in trained["dct_power"]],
                      f"DCT-II power of the top principal components ({run.name}; bins 0-{bins - 1} of {rows})",
                      "DCT bin", "component",
                      yticklabels=[f"PC{i + 1}" for i in range(len(trained["dct_power"]))]),
    ]
    return _finish(run, "spectra", data, figures)


def spectrum_scores(table: torch.Tensor, rows: int, components: int = 4) -> list[list[float]]:
    return pca(table.detach()[:rows].cpu())[1][:components].tolist()


# -------------------------------------------------------------------------------------------------- heads

@staged
def heads(run: Run, opts: Options) -> dict:
    """Per head, the share of within-row logit variance from each additive term, and a label."""
    batches = run.batches(opts.sequences, opts.batch_size, opts.split)
    sums: dict[int, dict[str, torch.Tensor]] = {}
    rows: dict[int, torch.Tensor] = {}
    for batch, cache in iterate_captures(run.model, batches, "blocks.*.attn.logits.*"):
        n = batch["input_ids"].shape[1]
        allowed = allowed_keys(n, run.causal, batch.get("attention_mask"))
        for layer in sorted({layer_of(name) - 1 for name in cache}):
            prefix = f"blocks.{layer}.attn.logits."
            terms = {name[len(prefix):]: cache[name].cpu() for name in cache if name.startswith(prefix)}
            s, r = term_variances(terms, allowed)
            acc = sums.setdefault(layer, {t: 0 for t in terms})
            for term, value in zip(terms, s):
                acc[term] = acc[term] + value
            rows[layer] = rows.get(layer, 0) + r
    if not sums:
        raise ConfigError(f"heads needs attention logit terms, and the model of {run.dir} records none")
    names = list(next(iter(sums.values())))
    if len(names) < 2:
        raise ConfigError(f"heads compares additive logit terms, but this model has only '{names[0]}' "
                          f"(models with positional {' or '.join(n for n, c in SCHEMES.items() if c.bias_only)} "
                          "add 'bias', as do cope and xpos with a block; arch dstg has ap/sem/rp)")
    layers = sorted(sums)
    shares = torch.stack([variance_shares(torch.stack([sums[i][t] for t in names])) for i in layers])  # (L, T, H)
    bias_label = run.scheme.bias_label
    labels = [label_heads(shares[i], names, opts.threshold, bias_label) for i in range(len(layers))]
    data = {"run": str(run.dir), "terms": names, "threshold": opts.threshold,
            "rule": "label = the term with the largest share of within-row logit variance when >= threshold, "
                    f"else 'mixed' (ap->structure, sem->semantic, rp->relative, bias->{bias_label}, content->content)",
            "layers": {f"blocks.{i}": {"shares": {t: shares[j, k].tolist() for k, t in enumerate(names)},
                                       "mean_variance": {t: (sums[i][t] / rows[i].clamp(min=1)).tolist()
                                                         for t in names},
                                       "labels": labels[j]} for j, i in enumerate(layers)},
            "counts": {lab: sum(row.count(lab) for row in labels) for lab in sorted({x for r in labels for x in r})}}
    heads_n = shares.shape[-1]
    marks = {lab: MARKS.get(lab, lab[:2]) for row in labels for lab in row}
    key = ", ".join(f"{mark} {lab}" for lab, mark in sorted(marks.items()))
    figures = [plots.heatmap(run.out_dir / f"heads_{t}.png", shares[:, k].tolist(),
                             f"share of logit variance: {t} ({run.name})\nhead labels: {key}", "head",
                             "layer (1 = first block)", yticklabels=[str(i + 1) for i in layers], xticklabels=[str(h) for h in range(heads_n)],
                             vmin=0, vmax=1, annotations=[[marks[lab] for lab in row] for row in labels])
               for k, t in enumerate(names)]
    return _finish(run, "heads", data, figures)


# ---------------------------------------------------------------------------------------------- attention

PROFILE_NOTE = ("profile[h][j]: the mean attention probability at offset offsets[j] = query - key over the queries "
                "that see a key there; a mean per offset, not a distribution (it does not sum to 1)")


@staged
def attention(run: Run, opts: Options) -> dict:
    """Per layer and head, how far attention looks (``poslab.analysis.attention``), trained vs init."""
    batches = run.batches(opts.sequences, opts.batch_size, opts.split)
    data: dict = {"run": str(run.dir), "causal": run.causal, "profile_note": PROFILE_NOTE, "models": {}}
    means = {}
    for label, model in _models(run):
        sums: dict[int, dict[str, torch.Tensor]] = {}
        # The bias term too: keys it puts at -inf (xPos's blocks) are not visible, for the baselines either
        for batch, cache in iterate_captures(model, batches, ["blocks.*.attn.probs", "blocks.*.attn.logits.bias"]):
            for name in [name for name in cache if name.endswith(".probs")]:
                layer = layer_of(name) - 1
                bias = f"blocks.{layer}.attn.logits.bias"
                hidden = torch.isneginf(cache[bias].cpu()).all(1, keepdim=True) if bias in cache else None
                sums[layer] = add_sums(sums.get(layer), attention_sums(cache[name].cpu(), run.causal,
                                                                       batch.get("attention_mask"), hidden))
        if not sums:
            raise ConfigError(f"attention needs attention probabilities, and the model of {run.dir} records none")
        means[label] = {i: attention_means(sums[i]) for i in sorted(sums)}
        data["queries"] = int(sums[min(sums)]["queries"])  # counted per head and layer; the same in each
        data["models"][label] = {f"blocks.{i}": {k: v.tolist() for k, v in m.items()
                                                 if k not in ("offsets", "uniform_distance")}
                                 for i, m in means[label].items()}
    first = next(iter(means["trained"].values()))
    offsets = first["offsets"].tolist()
    # The baseline depends on the masks alone, the same for every head, layer and model
    data.update({"uniform_distance": float(first["uniform_distance"]), "sequence_length": offsets[-1] + 1,
                 "offsets": offsets})
    trained = means["trained"]
    layers = list(trained)
    heads_n = len(first["mean_distance"])
    ratio = [trained[i]["distance_ratio"].tolist() for i in layers]
    curves = [trained[i]["profile"] for i in layers]
    positive = torch.cat([c[c > 0].flatten() for c in curves])  # NaN (no query there) fails > 0 too
    # Probabilities fall off over orders of magnitude with distance (ALiBi's exponentially): a log axis shows
    # them, but not a zero (a probability that underflowed), which is left out as a gap and counted in the title.
    logy = positive.numel() > 0 and bool(positive.max() > 10 * positive.min())
    hidden = sum(int((c == 0).sum()) for c in curves) if logy else 0
    profiles = {f"layer {i + 1}": {f"head {h}": (offsets, [v if v > 0 or not logy else None for v in c[h].tolist()])
                                   for h in range(heads_n)} for i, c in zip(layers, curves)}
    figures = [
        plots.heatmap(run.out_dir / "attention_distance.png", ratio,
                      f"mean attention distance / uniform attention's ({run.name}, trained)\n"
                      "< 1: local head, > 1: looks further than uniform", "head", "layer (1 = first block)",
                      yticklabels=[str(i + 1) for i in layers], xticklabels=[str(h) for h in range(heads_n)], vmin=0,
                      annotations=[[f"{v:.2f}" for v in row] for row in ratio]),
        plots.line_panels(run.out_dir / "attention_profile.png", profiles,
                          f"mean attention probability by offset ({run.name}, trained)"
                          + (f"; {hidden} zeros not drawn on the log axis" if hidden else ""),
                          "offset (query - key)", "mean probability", logy=logy),
    ]
    return _finish(run, "attention", data, figures)


# -------------------------------------------------------------------------------------------- frequencies

@staged
def frequencies(run: Run, opts: Options) -> dict:
    """Layer x frequency heatmaps of mean q and k norms per frequency."""
    batches = run.batches(opts.sequences, opts.batch_size, opts.split)
    totals: dict[str, torch.Tensor] = {}
    counts: dict[str, float] = {}
    for batch, cache in iterate_captures(run.model, batches, "blocks.*.attn.freq_norms.*"):
        for name, norms in cache.items():
            total, count = frequency_sums(norms.cpu(), batch.get("attention_mask"))
            totals[name] = totals.get(name, 0) + total
            counts[name] = counts.get(name, 0.0) + count
    if not totals:
        raise ConfigError(f"frequencies needs a positional scheme with rotary frequencies "
                          f"({', '.join(_frequency_schemes())}); the model of {run.dir} reports none")
    layers = sorted({layer_of(n) - 1 for n in totals})
    mean = {w: torch.stack([totals[f"blocks.{i}.attn.freq_norms.{w}"] / counts[f"blocks.{i}.attn.freq_norms.{w}"]
                            for i in layers]) for w in ("q", "k")}
    # "layers" counts blocks from 1, as the figures and the other analyses' depths (poslab.analysis.runs.layer_of) do
    data = {"run": str(run.dir), "layers": [i + 1 for i in layers], "q": mean["q"].tolist(), "k": mean["k"].tolist(),
            "summary": usage_summary(mean["q"], mean["k"])}
    figures = [plots.heatmap(run.out_dir / f"frequencies_{w}.png", mean[w].tolist(),
                             f"mean {w} norm per frequency ({run.name})", "frequency index (fastest first)",
                             "layer (1 = first block)", yticklabels=[str(i + 1) for i in layers]) for w in ("q", "k")]
    return _finish(run, "frequencies", data, figures)


# --------------------------------------------------------------------------------------------- evaluate

@staged
def evaluate(run: Run, opts: Options) -> dict:
    """The run's metrics on a whole evaluation split (default: the one training evaluated on), computed as
    training computes them: loss and token accuracy, exact match for a decoder on a task, perplexity for a
    causal LM on text. Read-only: a test split is scored once, after training chose its checkpoints on another."""
    source = run.source()
    split = run.split(source, opts.split)
    train = dataclasses.replace(run.config.train, eval_split=split, eval_batches=None, eval_batch_size=opts.batch_size)
    config = dataclasses.replace(run.config, train=train)
    autocast = training_evaluation.autocast(run.device, config.train.precision)  # bf16 where training used it
    metrics = training_evaluation.evaluate(run.model, source, config, run.device, autocast)
    if not (metrics.get("tokens") or metrics.get("examples")):
        raise DataError(f"the {split} split of {run.dir} holds no labelled token to score, so nothing was written")
    if run.causal and config.data.kind == "lm":
        metrics["perplexity"] = training_evaluation.perplexity(metrics["loss"])
    return _finish(run, "evaluate", {"split": split, "metrics": metrics}, [])


def _frequency_schemes() -> list[str]:
    """The registered schemes whose layers report per-frequency q/k norms (LayerPositional.qk_frequency_norms)."""
    geometry = AttentionGeometry(n_layers=1, n_heads=1, head_dim=8, d_model=8, max_seq_len=8, causal=True)
    found = []
    for name, scheme in SCHEMES.items():
        _, layers = scheme.build(scheme.Options(), geometry)
        if any(type(layer).qk_frequency_norms is not LayerPositional.qk_frequency_norms
               for layer in layers if layer is not None):
            found.append(name)
    return found


# ------------------------------------------------------------------------------------------ extrapolation

@staged
def extrapolation(run: Run, opts: Options) -> dict:
    """Loss and accuracy against evaluation length for this run and --compare runs; runs also with their
    scheme's context scalings at evaluation (RoPE: linear / NTK / YaRN; xPos: blockwise attention). --eval-data
    evaluates every run on that corpus instead of its own data, with the run's own tokenizer
    (``poslab.analysis.extrapolation.evaluation_config``)."""
    runs = [run] + [Run.load(path, opts.checkpoint, opts.device) for path in opts.compare]
    dirs = [r.dir.resolve() for r in runs]
    for r, resolved in zip(runs, dirs):
        if dirs.count(resolved) > 1:
            raise ConfigError(f"{r.dir} is given more than once; --run and --compare name each run once")
    # By directory, which the check above made unique: the scalings asked for that each run's scheme has.
    scaled = {r.dir: [s for s in opts.scalings if s in r.scheme.context_scalings] for r in runs}
    if not any(scaled.values()) and opts.scalings and tuple(opts.scalings) != Options().scalings:  # asked for, would be dropped
        able = "; ".join(f"{name}: {', '.join(scheme.context_scalings)}" for name, scheme in SCHEMES.items()
                         if scheme.context_scalings)
        raise ConfigError(f"--scalings {' '.join(opts.scalings)} apply to none of these runs' schemes (context "
                          f"scalings by scheme: {able}): leave --scalings out or name one the runs have")
    kinds = {(r.causal, r.config.data.kind) for r in runs}
    if len(kinds) > 1:  # a causal LM's next-token loss, a masked LM's and a task's answer loss are not comparable
        described = sorted(f"{'causal' if causal else 'bidirectional'} on {kind} data" for causal, kind in kinds)
        raise ConfigError(f"--compare mixes runs whose losses measure different things ({', '.join(described)}); "
                          "compare runs of one kind")
    # Runs are named by their directory's name, by the path given where two share one (a/seed0, b/seed0)
    names = [r.name for r in runs]
    data: dict = {"factors": list(opts.factors), "eval_data": opts.eval_data, "runs": {}}
    loss, acc = {}, {}
    for r in runs:
        label = r.name if names.count(r.name) == 1 else str(r.dir)
        base = training_length(r.config)
        lengths = [max(1, round(f * base)) for f in opts.factors]
        r.source()  # evaluation builds its sources from the config: refuse here a corpus tokenized otherwise
        evaluated = evaluation_config(r.config, opts.eval_data)  # prepared and checked once, not per curve
        curves = {"none": evaluate_lengths(evaluated, r.model, lengths, opts.sequences, opts.batch_size)}
        beyond = [rec for rec in curves["none"] if rec["factor"] > 1]
        if beyond and all("error" in rec for rec in beyond):
            # An extrapolation that reaches no length past training measures nothing of what it is for
            raise DataError(f"{r.dir} could not be evaluated past its training length ({base}), so nothing was "
                            f"written; the first reason: {beyond[0]['error']}")
        for scaling in scaled[r.dir]:
            curves[scaling] = scaled_lengths(evaluated, r.model, lengths, scaling, opts.sequences, opts.batch_size)
        data["runs"][label] = {"dir": str(r.dir), **r.measured(), "training_length": base, "curves": curves}
        for scaling, records in curves.items():
            key = label if scaling == "none" else f"{label} +{scaling}"
            x = [rec["factor"] for rec in records]
            loss[key] = (x, [rec.get("loss") for rec in records])
            metric = "exact_match" if any("exact_match" in rec for rec in records) else "token_accuracy"
            acc[key] = (x, [rec.get(metric) for rec in records])
    records = [rec for r in data["runs"].values() for curve in r["curves"].values() for rec in curve]
    if all("error" in rec for rec in records):  # a result of failures only must not replace a measured one
        raise DataError(f"no evaluation length could be evaluated, so nothing was written; the first reason: "
                        f"{records[0]['error']}")
    named = f" ({run.name})" if len(runs) == 1 else ""  # several runs: the legend names them
    figures = [plots.lines(run.out_dir / "extrapolation_loss.png", loss, f"Loss against evaluation length{named}",
                           "evaluation length / training length", "loss"),
               plots.lines(run.out_dir / "extrapolation_accuracy.png", acc,
                           f"Accuracy against evaluation length{named}",
                           "evaluation length / training length", "accuracy (exact match for tasks)", ylim=(0, 1))]
    return _finish(run, "extrapolation", data, figures)


ANALYSES: dict[str, Callable[[Run, Options], dict]] = {
    "adjacency": adjacency,
    "variance": variance,
    "probes": probes,
    "spectra": spectra,
    "heads": heads,
    "attention": attention,
    "frequencies": frequencies,
    "extrapolation": extrapolation,
    "evaluate": evaluate,
}

# The options (Options fields) each KIND reads besides the checkpoint and device; the command line refuses the
# others, which would otherwise be dropped without a word.
_BATCHES = {"sequences", "batch_size", "split"}
READS: dict[str, set[str]] = {
    "adjacency": _BATCHES,
    "variance": _BATCHES,
    "probes": _BATCHES | {"targets", "probe_steps", "max_classes"},
    "spectra": set(),
    "heads": _BATCHES | {"threshold"},
    "attention": _BATCHES,
    "frequencies": _BATCHES,
    "extrapolation": {"sequences", "batch_size", "factors", "scalings", "compare", "eval_data"},
    "evaluate": {"batch_size", "split"},
}
