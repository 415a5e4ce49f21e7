"""Shared pieces of the quick-scale search: a small AdamW + warmup/cosine loop over a poslab task, with
process-CPU-time accounting so that numbers measured on a busy machine translate to an idle one.

The loop follows the training engine (AdamW on linear weights only via ``poslab.train.optim.param_groups``,
linear warmup then cosine to lr/10, grad clip 1.0), with two differences the recorded results keep: its
cosine runs one step ahead of ``poslab.train.optim.lr_factor`` (at step 4 of 10 with 2 warm-up steps,
0.94 of the peak here against 0.83 there), and its default betas are (0.9, 0.99) where the engine's are
(0.9, 0.95). The recipes' configurations were confirmed through ``poslab reproduce`` itself.

Every ``train_task`` call returns a JSON-able dict: the config, train CPU seconds (process time, all
threads), wall seconds, steps/s per CPU second, and a learning curve of validation exact match.
"""
from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

import poslab
from poslab.tasks import build_batch_source, evaluate
from poslab.train.optim import param_groups

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def lr_at(step: int, steps: int, warmup: int, lr: float, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup - 1)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def model_config(vocab: int, max_len: int, *, d_model: int, n_layers: int, n_heads: int, positional: str,
                 pos_options: dict | None = None, **extra: Any) -> dict:
    return {"arch": "decoder", "vocab_size": vocab, "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads,
            "max_seq_len": max_len, "positional": {"name": positional, "options": pos_options or {}}, **extra}


def evaluate_model(model, source, split: str = "validation", examples: int = 1000, batch_size: int = 500) -> dict:
    model.eval()
    out = evaluate(lambda ids, mask: model(input_ids=ids, attention_mask=mask).logits, source, split,
                   batch_size=batch_size, max_batches=max(1, examples // batch_size))
    model.train()
    return out


def fit(net, source, *, steps: int, batch_size: int, lr: float, warmup: int = 100, weight_decay: float = 0.01,
        betas=(0.9, 0.99), clip: float = 1.0, eval_every: int = 0, evaluate_fn=None,
        time_limit_cpu: float | None = None) -> dict:
    """AdamW + warmup/cosine on ``source.train_batch``; ``evaluate_fn(net) -> dict`` every eval_every steps.

    Returns train_cpu_s (process CPU time of the training steps only), wall_s, stopped_at, curve, loss_tail.
    """
    opt = torch.optim.AdamW(param_groups(net, weight_decay), lr=lr, betas=betas)
    curve, train_cpu, stopped_at, losses = [], 0.0, None, []
    wall0 = time.perf_counter()
    for step in range(steps):
        c0 = cpu_seconds()
        batch = source.train_batch(step, batch_size)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, warmup, lr)
        loss = net(**{k: batch[k] for k in ("input_ids", "attention_mask", "labels")}).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        train_cpu += cpu_seconds() - c0
        losses.append(loss.item())
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            curve.append({"step": step + 1, "cpu_s": round(train_cpu, 1), **evaluate_fn(net),
                          "train_loss": round(sum(losses[-50:]) / len(losses[-50:]), 4)})
            print(json.dumps(curve[-1]), file=sys.stderr, flush=True)
        if time_limit_cpu is not None and train_cpu > time_limit_cpu:
            stopped_at = step + 1
            break
    done = stopped_at or steps
    return {"train_cpu_s": round(train_cpu, 1), "wall_s": round(time.perf_counter() - wall0, 1),
            "stopped_at": stopped_at, "steps_per_cpu_s": round(done / train_cpu, 2), "curve": curve,
            "train_loss_tail": round(sum(losses[-50:]) / len(losses[-50:]), 4)}


def train_task(*, task: str, task_options: dict, model: dict, seed: int, steps: int, batch_size: int, lr: float,
               warmup: int = 100, eval_every: int = 0, eval_examples: int = 1000, final_examples: int = 2000,
               threads: int = 1, time_limit_cpu: float | None = None, extra_eval=None, curve_eval=None) -> dict:
    """Train a decoder on a task from scratch; returns measurements (see module docstring).

    ``time_limit_cpu`` stops training early (recorded as ``stopped_at``) so no search run can hang.
    ``extra_eval(model, source) -> dict`` runs after training (e.g. longer lengths); ``curve_eval(model,
    source) -> dict`` replaces the learning curve's default measurement (exact match on eval_examples).
    """
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    source = build_batch_source(seed, task, **task_options)
    net = poslab.build_model(model_config(source.vocab_size, source.max_seq_len, **model))
    quick_eval = ((lambda m: curve_eval(m, source)) if curve_eval is not None else
                  (lambda m: {"acc": evaluate_model(m, source, examples=eval_examples)["exact_match"]}))
    run = fit(net, source, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, eval_every=eval_every,
              evaluate_fn=quick_eval, time_limit_cpu=time_limit_cpu)
    c0 = cpu_seconds()
    final = evaluate_model(net, source, examples=final_examples)
    out = {"task": task, "task_options": task_options, "model": model, "seed": seed, "steps": steps,
           "batch_size": batch_size, "lr": lr, "warmup": warmup, "threads": threads,
           "params": net.num_parameters(), **run, "final_eval_cpu_s": round(cpu_seconds() - c0, 1),
           "final": final, "load": os.getloadavg()[0]}
    if extra_eval is not None:
        out["extra"] = extra_eval(net, source)
    return out


def save(name: str, record: dict) -> None:
    """Append one JSON record to results/NAME.jsonl (one line per run, never rewritten)."""
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
