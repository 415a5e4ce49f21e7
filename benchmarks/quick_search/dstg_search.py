"""Quick-scale search for the ``dstg`` reproduction recipe: run the recipe's own code with one variant of
its quick settings and record what each phase costs in process CPU time (all threads), so that numbers
measured on a busy machine translate to an idle one.

A variant is a JSON object over the recipe's quick SCALES entry plus three override sections the recipe
itself does not read (yet):
  data    merged into the recipe's data section (``seq_len``, ``packing``; ``source`` merged one level deeper)
  model   applied to all four model configs (``n_layers``, ``n_heads``, ``max_seq_len``; width keys
          ``d_model`` for the baselines and ``d_ap``/``d_sem`` for DSTG via ``dstg``); DSTG's ffn_hidden is
          then re-matched to RoPE-NeoBERT's parameter count with ``match_ffn_hidden``
  dstg    applied to the DSTG config only (``d_ap``, ``d_sem``, ``position_offset_max``, ...)

    python benchmarks/quick_search/dstg_search.py --tag q2 --out /tmp/dstg_q2 \
        --variant '{"data": {"seq_len": 64}, "train": {"steps": 400}}'

Appends one JSON line (variant, CPU seconds per phase, train steps/CPU-s, claims, tables) to --results.
Measurement code is the recipe's: only the configuration is changed.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import time
from pathlib import Path

import torch

from poslab.data import DataConfig, ensure_prepared
from poslab.experiments import dstg
from poslab.models.dstg import count_parameters, match_ffn_hidden


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variant", default="{}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--results", default="/tmp/dstg_logs/results.jsonl")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variant = json.loads(args.variant)

    scale = copy.deepcopy(dstg.SCALES["quick"])
    for key in ("documents", "tokenizer_documents", "sequences"):
        scale[key] = variant.get(key, scale[key])
    scale["train"].update(variant.get("train", {}))
    dstg.SCALES["search"] = scale
    data_over, model_over, dstg_over = variant.get("data", {}), variant.get("model", {}), variant.get("dstg", {})

    section = dstg.data_section

    def data_section(scale: dict, out: Path) -> dict:
        data = section(scale, out)
        for k, v in data_over.items():
            data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
        return data

    ready = dstg.ready_config

    def ready_config(name: str, scale_name: str) -> dict:
        cfg = {**ready(name, scale_name), **{k: v for k, v in model_over.items() if k != "d_model"}}
        if name == "dstg":
            cfg.update(dstg_over)
            target = count_parameters({**ready("rope_neobert", scale_name),
                                       **model_over, "vocab_size": cfg["vocab_size"]})
            cfg["ffn_hidden"] = match_ffn_hidden(cfg, target)
        elif "d_model" in model_over:
            cfg["d_model"] = model_over["d_model"]
        return cfg

    cpu: dict[str, float] = {}
    ensure = dstg.ensure_run

    def ensure_run(config: dict, out: Path, log):
        c0, w0 = cpu_seconds(), time.perf_counter()
        metrics = ensure(config, out, log)
        cpu[out.name] = cpu_seconds() - c0
        metrics["wall_s"] = time.perf_counter() - w0
        metrics["params"] = count_parameters({**config["model"], "vocab_size": 2048})
        trained[out.name] = metrics
        return metrics

    trained: dict[str, dict] = {}
    dstg.data_section, dstg.ready_config, dstg.ensure_run = data_section, ready_config, ensure_run
    out = Path(args.out)
    c0 = cpu_seconds()
    ensure_prepared(DataConfig.from_options({k: v for k, v in data_section(scale, out).items() if k != "kind"}))
    cpu["data"] = cpu_seconds() - c0
    c0, w0 = cpu_seconds(), time.perf_counter()
    result = dstg.run("search", out, print)
    total = cpu_seconds() - c0
    cpu["analysis"] = total - sum(v for k, v in cpu.items() if k != "data")
    steps = scale["train"]["steps"]
    record = {"tag": args.tag, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "variant": variant,
              "scale": scale, "threads": args.threads, "cpu_s": {k: round(v, 1) for k, v in cpu.items()},
              "cpu_total_s": round(sum(cpu.values()), 1),
              "steps_per_cpu_s": {m: round(steps / cpu[m], 3) for m in dstg.MODELS if cpu.get(m)},
              "train": {m: {k: trained[m].get(k) for k in ("train_loss", "eval_token_accuracy", "params",
                                                          "tokens_per_s", "wall_s")} for m in trained},
              "claims": [{"claim": c.claim[:60], "ours": c.ours, "held": c.held} for c in result.claims],
              "tables": result.tables[:2], "heads": result.details["heads"]}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    with open(args.results, "a") as f:
        f.write(json.dumps(record, default=float) + "\n")
    print(json.dumps(record, indent=1, default=float))


if __name__ == "__main__":
    main()
