"""``poslab reproduce --compare OLD --out NEW``: which claims moved between two reproductions.

Reads only the two directories' results.json. Claims are matched by recipe and wording: a claim whose
wording changed counts as gone from OLD and added in NEW. A matched claim is the same when its value (as
results.json holds it, 6 significant digits) and its verdict are; otherwise its verdict or its value changed.
The exit status follows diff(1): 0 when every claim is the same, 1 when anything differs, 2 on bad input.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from poslab.errors import PoslabError
from poslab.experiments.report import cell

# The order rows are listed in: what a reader checks first.
STATUSES = ("verdict changed", "value changed", "gone", "added")


def load(directory: str | Path) -> dict[str, Any]:
    """DIR/results.json, or a PoslabError saying what to pass instead."""
    path = Path(directory) / "results.json"
    hint = "pass the --out directory of a `poslab reproduce` that finished a recipe"
    if not path.is_file():
        raise PoslabError(f"{directory} has no results.json; {hint}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PoslabError(f"{path} cannot be read as JSON ({error}); {hint}") from None
    if not isinstance(data, dict) or not isinstance(data.get("recipes"), dict):
        raise PoslabError(f"{path} holds no recipes; {hint}")
    for name, result in data["recipes"].items():
        # A damaged file must not read as a difference (exit 1): name what is wrong with it (exit 2)
        claims = result.get("claims") if isinstance(result, dict) else None
        if not isinstance(claims, list) or not all(
                isinstance(c, dict) and isinstance(c.get("claim"), str) and isinstance(c.get("held"), bool)
                and "ours" in c for c in claims):
            raise PoslabError(f"{path}: recipe '{name}' holds no list of claims, each with its claim, ours and held; "
                              f"the file is damaged: {hint}")
    return data


def _claims(data: dict[str, Any], only: set[str] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    return {(recipe, claim["claim"]): claim for recipe, result in data["recipes"].items()
            if only is None or recipe in only for claim in result["claims"]}


def check_names(only: set[str], old: dict[str, Any], new: dict[str, Any], old_dir: str | Path,
                new_dir: str | Path) -> None:
    """PoslabError when a recipe named for the comparison is in neither reproduction: nothing compared is not
    "the same"."""
    missing = sorted(name for name in only if name not in old["recipes"] and name not in new["recipes"])
    if missing:
        raise PoslabError(f"neither {old_dir} nor {new_dir} has a result of {', '.join(missing)}; name recipes they "
                          f"finished, or none to compare all")


def compare(old: dict[str, Any], new: dict[str, Any], only: set[str] | None = None) -> list[dict[str, Any]]:
    """One row per claim in either (of the recipes in ``only``, None: all): recipe, claim, status (one of
    STATUSES, or "same"), old and new (the claim records, None where absent). Rows keep NEW's order, then the
    claims only OLD has."""
    before, after = _claims(old, only), _claims(new, only)
    rows = []
    for key in [*after, *(k for k in before if k not in after)]:
        a, b = before.get(key), after.get(key)
        if a is None or b is None:
            status = "added" if a is None else "gone"
        elif a["held"] != b["held"]:
            status = "verdict changed"
        else:
            status = "value changed" if a["ours"] != b["ours"] else "same"
        rows.append({"recipe": key[0], "claim": key[1], "status": status, "old": a, "new": b})
    return rows


def _side(claim: dict[str, Any] | None) -> str:
    if claim is None:
        return "-"
    return f"{cell(claim['ours'], 6)} ({'held' if claim['held'] else 'not held'})"


def _header(label: str, directory: str | Path, data: dict[str, Any], only: set[str] | None) -> str:
    """One line on a reproduction, of the compared recipes only."""
    claims = list(_claims(data, only).values())
    results = [result for recipe, result in data["recipes"].items() if only is None or recipe in only]
    codes = sorted({str(result["code"]) for result in results if result.get("code")}) or ["not recorded"]
    return (f"{label} {directory}: scale {data.get('scale', '?')}, {data.get('date', '?')}, "
            f"{sum(c['held'] for c in claims)} of {len(claims)} claims held, code {', '.join(codes)}")


def render(rows: list[dict[str, Any]], old: dict[str, Any], new: dict[str, Any], old_dir: str | Path,
           new_dir: str | Path, only: set[str] | None = None) -> str:
    """Markdown: both runs (their recipes in ``only``, None: all), the count of each status, and a table of the
    claims that are not the same."""
    counts = {status: sum(r["status"] == status for r in rows) for status in (*STATUSES, "same")}
    lines = [_header("old", old_dir, old, only), _header("new", new_dir, new, only), "",
             ", ".join(f"{n} {status}" for status, n in counts.items()) + f" (of {len(rows)} claims)"]
    if old.get("scale") != new.get("scale"):
        lines.append(f"The scales differ ({old.get('scale', '?')} vs {new.get('scale', '?')}): claims name their "
                     "scale's sizes and lengths, so those count as gone and added.")
    moved = sorted((r for r in rows if r["status"] != "same"), key=lambda r: STATUSES.index(r["status"]))
    if moved:
        lines += ["", "| status | recipe | claim | old | new |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(text.replace("|", "/") for text in (r["status"], r["recipe"], r["claim"],
                                                                        _side(r["old"]), _side(r["new"]))) + " |"
                  for r in moved]
    return "\n".join(lines)
