"""report.md from results.json: per recipe, the claims table (paper, ours, held), tables, figures."""
from __future__ import annotations

import math
import re
from typing import Any

NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")  # the bounds in a claim's rule


def cell(value: Any, digits: int | None = None) -> str:
    """A cell; ``digits`` (significant) defaults to what keeps a dict's or list's numbers apart."""
    if isinstance(value, float):
        return f"{value:.{digits or 4}g}"
    if isinstance(value, dict):
        digits = digits or _distinct_digits(list(value.values()))
        return ", ".join(f"{k}: {cell(v, digits)}" for k, v in value.items())
    if isinstance(value, list):
        digits = digits or _distinct_digits(value)
        return ", ".join(cell(v, digits) for v in value)
    return str(value)


def _distinct_digits(values: list[Any]) -> int:
    """Significant digits (4 or more) that keep the different numbers of one cell apart: a claim comparing
    1.0003 with 1.0002 read "1" against "1". Numbers that 8 digits do not tell apart get the usual 4."""
    numbers = {v for v in values if isinstance(v, float) and math.isfinite(v)}
    for digits in range(4, 9):
        if len({f"{v:.{digits}g}" for v in numbers}) == len(numbers):
            return digits
    return 4


def _ours(claim: dict[str, Any]) -> str:
    """A claim's result; its numbers keep apart from each other and from the bounds its rule names ("ours <=
    1.1" failed by 1.1004 read "1.1"; "every value >= 0.8" failed by 0.79996 read "a: 0.8")."""
    ours = claim["ours"]
    values = list(ours.values()) if isinstance(ours, dict) else ours if isinstance(ours, list) else [ours]
    bounds = [float(n) for n in NUMBER.findall(claim["rule"])]
    return cell(ours, _distinct_digits([*values, *bounds]))


def _table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c).replace("|", "/") for c in row) + " |" for row in rows]
    return lines


def summary_rows(data: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for name, rec in data["recipes"].items():
        for claim in rec["claims"]:
            rows.append([name, claim["claim"], claim["paper"], _ours(claim),
                         "yes" if claim["held"] else "**no**"])
    return rows


def run_line(data: dict[str, Any]) -> str:
    """When, where and how long, and how many claims held: one sentence."""
    m = data["machine"]
    total = sum(len(r["claims"]) for r in data["recipes"].values())
    held = sum(c["held"] for r in data["recipes"].values() for c in r["claims"])
    load = f", load average {m['load_average_15min']:.1f} over the last 15 min" if "load_average_15min" in m else ""
    threads, jobs = m["torch_threads"], m.get("jobs", 1)
    return (f"{data['date']} on {m['processor']}, {m['cpus']} CPUs ({threads} torch thread{'s' * (threads != 1)}, "
            f"{jobs} training job{'s' * (jobs != 1)}{load})"
            + (f", GPUs: {', '.join(m['gpus'])}" if m.get("gpus") else "")
            + f", torch {m['torch']}; {data['seconds']:.0f} s in all "
            + "(" + ", ".join(f"{name} {rec['seconds']:.0f} s" for name, rec in data["recipes"].items())
            # Since trainings start ahead (experiments.common.train_ahead), a recipe's seconds are its turn's.
            + ("; with several jobs a recipe's models can train during the turns before its own" if jobs > 1 else "")
            + f"). **{held} of {total} claims held.**")


def summary_table(data: dict[str, Any]) -> list[str]:
    return _table(["recipe", "claim", "paper", "ours", "held"], summary_rows(data))


# What a scale's numbers can say, at the top of its report.
SCALE_NOTES = {
    "smoke": "**Smoke scale only checks that the recipes run**: each model trains for a few steps, so no number "
             "below means anything, and two runs can differ (the dstg recipe's WordPiece vocabulary, trained on 30 "
             "documents, breaks ties between merges in hash order).",
    "quick": "Quick scale trains tiny models for minutes on a CPU: a claim that does not hold there is reported as "
             "not held, with what was tried -- those notes cite earlier searches (benchmarks/quick_search), not "
             "this run.",
    "paper": "Paper scale trains the papers' configurations where they state them (sizes, steps, data by name) "
             "and poslab's choices where they do not (README, 'Where paper scale departs from the papers'): a claim "
             "that does not hold is reported as not held.",
}


def recipe_line(rec: dict[str, Any]) -> str:
    """How one recipe's numbers were made: a directory can hold recipes run at different times and settings."""
    m = rec.get("machine") if isinstance(rec.get("machine"), dict) else {}
    parts = [f"code {rec['code']}"] if isinstance(rec.get("code"), str) else []
    if "torch_threads" in m:
        jobs, threads = m.get("jobs", 1), m["torch_threads"]
        parts.append(f"{jobs} training job{'s' * (jobs != 1)}, {threads} torch thread{'s' * (threads != 1)}")
    if "load_average_15min" in m:
        parts.append(f"load average {m['load_average_15min']:.1f}")
    return f"_{'; '.join(parts)}_" if parts else ""


def render_report(data: dict[str, Any]) -> str:
    lines = [
        f"# poslab reproduction ({data['scale']} scale)",
        "",
        run_line(data),
        "",
        "Every number in the tables below was measured by `poslab reproduce` into this directory (each recipe's "
        "section says when, with which code and settings); `held` is computed from the measured values by the "
        "rule shown. " + SCALE_NOTES.get(data["scale"], ""),
        "",
        "## Summary",
        "",
        *summary_table(data),
    ]
    for name, rec in data["recipes"].items():
        when = f", {rec['date']}" if isinstance(rec.get("date"), str) else ""
        lines += ["", f"## {name} ({rec['seconds']:.0f} s{when})", ""]
        if recipe_line(rec):
            lines += [recipe_line(rec), ""]
        lines += _table(["claim", "paper", "ours", "rule", "held"],
                        [[c["claim"], c["paper"], _ours(c), c["rule"], "yes" if c["held"] else "**no**"]
                         for c in rec["claims"]])
        for table in rec.get("tables", []):
            lines += ["", f"**{table['title']}**", "", *_table(table["columns"], table["rows"])]
        for note in rec.get("notes", []):
            lines += ["", note]
        for fig in rec.get("figures", []):
            lines += ["", f"![{fig}]({fig})"]
    return "\n".join(lines) + "\n"
