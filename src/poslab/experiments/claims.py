"""Claims: a paper's statement, its figure, ours, and whether it held -- computed, never typed in.

A ``Claim`` is built from measured values, by a comparison helper below or, for a compound rule, by the
recipe next to the rule's words; either way ``held`` follows from the numbers in the same record.
"""
from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Claim:
    claim: str
    paper: Any
    ours: Any
    held: bool
    rule: str  # the test that decided ``held``, in words, so a reader can check it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _finite(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)


# Values this close count as equal: a bound reached by a sum or difference of floats sits an ulp off it.
TOLERANCE = 1e-9


def reaches(value: float, bound: float) -> bool:
    """value >= bound, a value at the bound included though floats put it an ulp below (0.9 - 0.8 < 0.1)."""
    return value >= bound or math.isclose(value, bound, rel_tol=TOLERANCE)


def at_least(claim: str, paper: Any, ours: float, threshold: float) -> Claim:
    return Claim(claim, paper, rounded(ours, threshold), _finite(ours) and reaches(ours, threshold),
                 f"ours >= {threshold:g}")


def at_most(claim: str, paper: Any, ours: float, threshold: float) -> Claim:
    return Claim(claim, paper, rounded(ours, threshold), _finite(ours) and reaches(threshold, ours),
                 f"ours <= {threshold:g}")


def within(claim: str, paper: Any, ours: float, low: float, high: float) -> Claim:
    return Claim(claim, paper, rounded(ours, low, high), _finite(ours) and reaches(ours, low) and reaches(high, ours),
                 f"{low:g} <= ours <= {high:g}")


def exceeds(claim: str, paper: Any, ours: dict[str, float], larger: str, smaller: str, margin: float = 0.0) -> Claim:
    """ours[larger] > ours[smaller]; with a margin, ours[larger] - ours[smaller] >= margin, as the claims that
    name one say ("by >= 0.2"). A gap at the margin must hold, but in floats 0.9 - 0.8 < 0.1: the difference
    is compared within rounding error."""
    a, b = ours[larger], ours[smaller]
    if margin:
        held = _finite(a, b) and reaches(a - b, margin)
        rule = f"{larger} - {smaller} >= {margin:g}"
    else:
        held, rule = _finite(a, b) and a > b, f"{larger} > {smaller}"
    return Claim(claim, paper, rounded_apart(ours), held, rule)


def all_exceed(claim: str, paper: Any, larger: dict[str, float], smaller: dict[str, float],
               names: tuple[str, str]) -> Claim:
    """larger[k] > smaller[k] for every key k (a task, say); ours shows each pair as "k names[0]", "k names[1]"."""
    held = all(_finite(larger[k], smaller[k]) and larger[k] > smaller[k] for k in larger)
    ours = rounded_apart({f"{k} {name}": values[k] for k in larger for name, values in zip(names, (larger, smaller))})
    return Claim(claim, paper, ours, held, f"{names[0]} > {names[1]} for each")


def lowest(claim: str, paper: Any, ours: dict[str, float], best: str) -> Claim:
    """ours[best] below every other value (errors, losses: lower is better)."""
    return _best(claim, paper, ours, best, "<")


def highest(claim: str, paper: Any, ours: dict[str, float], best: str) -> Claim:
    """ours[best] above every other value (accuracies: higher is better)."""
    return _best(claim, paper, ours, best, ">")


def _best(claim: str, paper: Any, ours: dict[str, float], best: str, order: str) -> Claim:
    others = [k for k in ours if k != best]
    beats = operator.lt if order == "<" else operator.gt
    held = _finite(*ours.values()) and all(beats(ours[best], ours[k]) for k in others)
    return Claim(claim, paper, rounded_apart(ours), held, f"{best} {order} {' and '.join(others)}")


def more_than(claim: str, paper: Any, ours: float, threshold: float) -> Claim:
    """ours strictly above threshold: the complement of ``at_most`` with the same threshold, so that one value
    cannot be both flat and degrading."""
    return Claim(claim, paper, rounded(ours, threshold), _finite(ours) and not reaches(threshold, ours),
                 f"ours > {threshold:g}")


def all_within(claim: str, paper: Any, ours: dict[str, float], low: float, high: float) -> Claim:
    """Every value in [low, high]."""
    held = all(_finite(v) and reaches(v, low) and reaches(high, v) for v in ours.values())
    return Claim(claim, paper, rounded_apart(ours, (low, high)), held, f"every value in [{low:g}, {high:g}]")


def all_of(claim: str, paper: Any, ours: dict[str, float], threshold: float, above: bool = True) -> Claim:
    """Every value >= threshold (above) or <= threshold (not above)."""
    held = all(_finite(v) and (reaches(v, threshold) if above else reaches(threshold, v)) for v in ours.values())
    rule = f"every value {'>=' if above else '<='} {threshold:g}"
    return Claim(claim, paper, rounded_apart(ours, (threshold,)), held, rule)


def tried_notes(result_claims: list[Claim], tried: dict[str, str]) -> list[str]:
    """For each claim that did not hold, a note saying what the search tried: a report that says "not
    held" should also say what was done before concluding so. ``tried`` is keyed by the opening words of
    a claim, so reordering or adding claims cannot attach a note to the wrong one."""
    notes = []
    for opening, text in tried.items():
        matching = [c for c in result_claims if c.claim.startswith(opening)]
        if len(matching) != 1:
            raise ValueError(f"a 'tried' note must open exactly one claim; '{opening}' opens {len(matching)}")
        if not matching[0].held:
            notes.append(f"Not held: {matching[0].claim}. {text}")
    return notes


def rounded(value: Any, *bounds: float) -> Any:
    """6 significant digits, as results.json keeps values (the report shows 4 unless more are needed), more where
    6 would show the value equal to one of ``bounds`` it differs from."""
    return rounded_apart({"": value}, bounds)[""]


def rounded_apart(values: dict[str, Any], bounds: tuple[float, ...] = ()) -> dict[str, Any]:
    """Each value to 6 significant digits, or as many more (up to all 17) as keep every two values, or a value
    and a bound, that differ from showing the same number: values a rule told apart must stay apart in
    results.json, where the report reads them. Values within TOLERANCE of each other count as equal."""
    exact = [v for v in (*values.values(), *bounds) if _finite(v)]
    pairs = [(a, b) for i, a in enumerate(exact) for b in exact[i + 1:]
             if not math.isclose(a, b, rel_tol=TOLERANCE)]
    for digits in range(6, 18):
        if all(_round(a, digits) != _round(b, digits) for a, b in pairs):
            break
    return {k: _round(v, digits) for k, v in values.items()}


def _round(value: Any, digits: int) -> Any:
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.{digits}g}")
    return value
