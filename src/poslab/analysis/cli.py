"""``poslab analyze KIND --run DIR [...]``: measure a trained run; writes DIR/analysis/<kind>.json and PNGs.

KIND: adjacency, variance, probes, spectra, heads, attention, frequencies, extrapolation, evaluate (see
``poslab.analysis.commands``). An option the KIND does not use is refused.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from poslab.arguments import path_argument, read_yaml
from poslab.errors import ConfigError, unknown_key_message

# Evaluating at a length costs memory in proportion to it (and attention to its square): past 64x the
# training length a factor is a typo, not an experiment (1e9 asked for 16 TiB).
MAX_FACTOR = 64


def register(subparsers: argparse._SubParsersAction) -> None:
    from poslab.analysis.commands import ANALYSES, Options
    from poslab.analysis.extrapolation import CONTEXT_SCALINGS

    defaults = Options()
    p = subparsers.add_parser("analyze", help="measure a trained run (adjacency, probes, spectra, ...)",
                              description="Measure a trained run; writes DIR/analysis/KIND.json and PNG figures.")
    p.add_argument("kind", metavar="KIND", help=f"one of: {', '.join(ANALYSES)}")
    p.add_argument("--run", required=True, metavar="DIR", type=path_argument,
                   help="run directory written by `poslab train`")
    p.add_argument("--checkpoint", choices=("best", "last"), default=None, help="default: best if present, else last")
    p.add_argument("--sequences", type=int, default=defaults.sequences,
                   help="evaluation sequences to analyse (extrapolation: at the longest length; text reads the same "
                        "tokens at every length, in more, shorter windows; a task scores every problem of the split)")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--split", default=None, help="evaluation split (default: the run's train.eval_split); "
                   "evaluate scores the whole split")
    p.add_argument("--device", default=defaults.device,
                   help=f"cpu, cuda, cuda:N, mps, or auto: CUDA if there is one (default {defaults.device})")
    p.add_argument("--targets", nargs="+", default=None, help="probes: targets (default: position + every "
                   "structure label of the data)")
    p.add_argument("--probe-steps", type=int, default=defaults.probe_steps, help="probes: MLP/classifier steps")
    p.add_argument("--max-classes", type=int, default=defaults.max_classes,
                   help="probes: classify task labels only when they have at most this many classes")
    p.add_argument("--threshold", type=float, default=defaults.threshold,
                   help="heads: share a term needs to name a head")
    p.add_argument("--factors", type=float, nargs="+", default=list(defaults.factors),
                   help="extrapolation: evaluation lengths as multiples of the training length, each in "
                        f"(0, {MAX_FACTOR}]")
    p.add_argument("--scalings", nargs="*", default=list(defaults.scalings), choices=list(CONTEXT_SCALINGS),
                   help="extrapolation: context scalings applied at evaluation to the runs whose scheme has them "
                        "(rope: linear, ntk, yarn; xpos: blockwise attention)")
    p.add_argument("--compare", nargs="*", default=[], metavar="DIR", help="extrapolation: more runs on the figure")
    p.add_argument("--eval-data", default=None, metavar="FILE.yaml",
                   help="extrapolation: evaluate on another corpus: a YAML mapping of data options over the run's "
                        "(e.g. src/poslab/configs/data/pg19_eval.yaml; a source without a type changes options of "
                        "the run's own), prepared with the run's own tokenizer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from poslab.analysis.commands import ANALYSES, READS, Options
    from poslab.analysis.runs import Run, analysis_device

    if args.kind not in ANALYSES:
        raise ConfigError(unknown_key_message("analysis KIND", args.kind, ANALYSES))
    for name in ("sequences", "batch_size", "probe_steps"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_classes < 2:  # a classification needs two classes
        raise ConfigError(f"--max-classes must be >= 2, got {args.max_classes}")
    if not 0 < args.threshold <= 1:  # nan too
        raise ConfigError(f"--threshold must lie in (0, 1], got {args.threshold}")
    for factor in args.factors:
        if not 0 < factor <= MAX_FACTOR:  # nan and inf too
            raise ConfigError(f"--factors must lie in (0, {MAX_FACTOR}] (multiples of the training length), "
                              f"got {factor}")
    check_used(args, READS)
    device = analysis_device(args.device, "--device")
    eval_data = load_eval_data(args.eval_data) if args.eval_data else None
    opts = Options(sequences=args.sequences, batch_size=args.batch_size, split=args.split,
                   probe_steps=args.probe_steps, max_classes=args.max_classes, threshold=args.threshold,
                   factors=tuple(args.factors), scalings=tuple(args.scalings), compare=tuple(args.compare),
                   checkpoint=args.checkpoint, device=device,
                   targets=tuple(args.targets) if args.targets else None, eval_data=eval_data)
    run_ = Run.load(args.run, args.checkpoint, device)
    result = ANALYSES[args.kind](run_, opts)
    figures = f" and {', '.join(result['figures'])}" if result["figures"] else ""
    measured = f" ({result['checkpoint']}, step {result['step']})" if result.get("checkpoint") else ""
    print(f"{args.kind}: measured {run_.dir}{measured}; wrote {run_.out_dir / (args.kind + '.json')}{figures}")
    if "metrics" in result:  # a handful of numbers (evaluate): on stdout too, for scripts
        print(json.dumps(result["metrics"]))
    failed = [rec["error"] for r in result.get("runs", {}).values() for curve in r.get("curves", {}).values()
              for rec in curve if "error" in rec]
    if failed:  # extrapolation records a length it cannot evaluate instead of stopping: say so where it is seen
        print(f"{args.kind}: {len(failed)} evaluations failed, each recorded with its reason; the first: {failed[0]}",
              file=sys.stderr)
    return 0


def check_used(args: argparse.Namespace, reads: dict[str, set[str]]) -> None:
    """ConfigError (one line) for an option set away from its default that ``args.kind`` does not read."""
    from poslab.analysis.commands import Options

    defaults = Options()
    for name in ("sequences", "batch_size", "split", "targets", "probe_steps", "max_classes", "threshold",
                 "factors", "scalings", "compare", "eval_data"):
        value, unset = getattr(args, name), getattr(defaults, name)
        if name not in reads[args.kind] and value is not None and value != (list(unset) if isinstance(unset, tuple)
                                                                            else unset):
            users = [kind for kind, used in reads.items() if name in used]
            raise ConfigError(f"analyze {args.kind} does not use --{name.replace('_', '-')} (read by "
                              f"{', '.join(users)}); leave it out")


def load_eval_data(path: str) -> dict[str, Any]:
    """The mapping in ``--eval-data FILE``; ConfigError (one line) for a missing, unreadable or invalid file."""
    raw = read_yaml(path, "--eval-data file")
    if not isinstance(raw, dict) or not raw:
        got = "an empty mapping" if isinstance(raw, dict) else "nothing" if raw is None else f"a {type(raw).__name__}"
        raise ConfigError(f"--eval-data file {path} must hold a mapping of data options (e.g. source, "
                          f"validation_documents), got {got}")
    return raw
