"""``poslab reproduce --compare OLD --out NEW``: which claims moved between two reproductions."""
from __future__ import annotations

import json

import pytest

from poslab.cli import main
from poslab.experiments import compare


def claim(text: str, ours, held: bool) -> dict:
    return {"claim": text, "paper": "p", "ours": ours, "held": held, "rule": "r"}


def results(recipes: dict[str, list[dict]], date: str = "2026-12-01 09:00 UTC", code: str = "abc") -> dict:
    return {"scale": "quick", "date": date, "seconds": 1.0,
            "recipes": {name: {"claims": claims, "code": code} for name, claims in recipes.items()}}


OLD = results({"adjacency": [claim("a", 0.5, True), claim("b", {"x": 0.9, "y": 0.8}, True), claim("c", 1.0, False),
                             claim("d", 2.0, True)],
               "dstg": [claim("e", 0.3, False)]}, code="old")
NEW = results({"adjacency": [claim("a", 0.5, True), claim("b", {"x": 0.9, "y": 0.81}, True), claim("c", 1.0, True),
                             claim("f", 3.0, True)],
               "dstg": [claim("e", 0.3, False)]}, code="new")


def test_claims_match_by_recipe_and_wording_and_values_as_stored():
    rows = compare.compare(OLD, NEW)
    assert [(r["recipe"], r["claim"], r["status"]) for r in rows] == [
        ("adjacency", "a", "same"), ("adjacency", "b", "value changed"), ("adjacency", "c", "verdict changed"),
        ("adjacency", "f", "added"), ("dstg", "e", "same"), ("adjacency", "d", "gone")]
    assert rows[3]["old"] is None and rows[5]["new"] is None
    # The same wording in another recipe is another claim.
    moved = compare.compare(results({"adjacency": [claim("a", 0.5, True)]}), results({"dstg": [claim("a", 0.5, True)]}))
    assert [r["status"] for r in moved] == ["added", "gone"]


def write(directory, data) -> str:
    directory.mkdir()
    (directory / "results.json").write_text(json.dumps(data))
    return str(directory)


def test_the_command_lists_what_moved_verdicts_first_and_exits_as_diff_does(tmp_path, capsys):
    old, new = write(tmp_path / "old", OLD), write(tmp_path / "new", NEW)
    assert main(["reproduce", "--compare", old, "--out", new]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"old {old}: scale quick, 2026-12-01 09:00 UTC, 3 of 5 claims held, code old"
    assert out[1] == f"new {new}: scale quick, 2026-12-01 09:00 UTC, 4 of 5 claims held, code new"
    assert out[3] == "1 verdict changed, 1 value changed, 1 gone, 1 added, 2 same (of 6 claims)"
    assert out[5:7] == ["| status | recipe | claim | old | new |", "|---|---|---|---|---|"]
    assert out[7:] == ["| verdict changed | adjacency | c | 1 (not held) | 1 (held) |",
                       "| value changed | adjacency | b | x: 0.9, y: 0.8 (held) | x: 0.9, y: 0.81 (held) |",
                       "| gone | adjacency | d | 2 (held) | - |",
                       "| added | adjacency | f | - | 3 (held) |"]
    # A run compared with itself, or only the recipes that did not move: nothing differs.
    assert main(["reproduce", "--compare", new, "--out", new]) == 0
    assert main(["reproduce", "dstg", "--compare", old, "--out", new]) == 0
    out = capsys.readouterr().out
    assert out.count("0 verdict changed, 0 value changed, 0 gone, 0 added") == 2 and "| status |" not in out


DAMAGED = "recipe 'adjacency' holds no list of claims, each with its claim, ours and held; the file is damaged"


@pytest.mark.parametrize("content, problem", [
    (None, "has no results.json"), ("{not json", "cannot be read as JSON"), ("[1, 2]", "holds no recipes"),
    ('{"recipes": 3}', "holds no recipes"),
    # These were tracebacks with exit status 1, which reads as "claims differ"
    ('{"recipes": {"adjacency": []}}', DAMAGED), ('{"recipes": {"adjacency": {"claims": "abc"}}}', DAMAGED),
    ('{"recipes": {"adjacency": {"claims": [{"claim": "x"}]}}}', DAMAGED),
    ('{"recipes": {"adjacency": {"claims": [{"claim": "x", "ours": 1, "held": "yes"}]}}}', DAMAGED),
])
def test_a_directory_without_readable_results_is_refused_in_one_line(content, problem, tmp_path, capsys):
    good = write(tmp_path / "good", OLD)
    bad = tmp_path / "bad"
    bad.mkdir()
    if content is not None:
        (bad / "results.json").write_text(content)
    for args in (["--compare", str(bad), "--out", good], ["--compare", good, "--out", str(bad)]):
        assert main(["reproduce", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and problem in err and "pass the --out directory of a `poslab reproduce`" in err
        assert "Traceback" not in err
    assert main(["reproduce", "dstgg", "--compare", good, "--out", good]) == 2
    assert "did you mean 'dstg'" in capsys.readouterr().err


def test_options_that_train_or_plan_are_refused_with_compare_and_scales_are_told_apart(tmp_path, capsys):
    old, new = write(tmp_path / "old", OLD), write(tmp_path / "new", {**NEW, "scale": "smoke"})
    for flag in (["--plan"], ["--force"], ["--jobs", "2"], ["--threads", "1"]):
        assert main(["reproduce", "--compare", old, "--out", new, *flag]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"drop {flag[0]}" in err, err
    assert main(["reproduce", "--compare", old, "--out", new]) == 1
    assert "The scales differ (quick vs smoke)" in capsys.readouterr().out
    assert main(["reproduce", "--compare", old, "--out", old]) == 0
    assert "scales differ" not in capsys.readouterr().out


def test_named_recipes_narrow_the_headers_too_and_one_in_neither_is_refused(tmp_path, capsys):
    """Naming a recipe neither run has compared nothing and exited 0 ("the same"); the headers counted every
    recipe's claims and codes whatever was named."""
    old, new = write(tmp_path / "old", OLD), write(tmp_path / "new", NEW)
    assert main(["reproduce", "dstg", "--compare", old, "--out", new]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"old {old}: scale quick, 2026-12-01 09:00 UTC, 0 of 1 claims held, code old"
    assert out[3] == "0 verdict changed, 0 value changed, 0 gone, 0 added, 1 same (of 1 claims)"
    assert main(["reproduce", "extrapolation", "--compare", old, "--out", new]) == 2
    err = capsys.readouterr().err
    assert err == (f"poslab: error: neither {old} nor {new} has a result of extrapolation; name recipes they finished, "
                   "or none to compare all\n")
    only_old = write(tmp_path / "only-old", results({"adjacency": [claim("a", 0.5, True)]}, code=""))
    assert main(["reproduce", "dstg", "--compare", old, "--out", only_old]) == 1  # in one of them: gone
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"new {only_old}: scale quick, 2026-12-01 09:00 UTC, 0 of 0 claims held, code not recorded"


def test_jobs_or_threads_of_zero_are_refused_with_compare_too(tmp_path, capsys):
    old = write(tmp_path / "old", OLD)
    for flag in (["--jobs", "0"], ["--threads", "0"]):
        assert main(["reproduce", "--compare", old, "--out", old, *flag]) == 2
        assert f"drop {flag[0]}" in capsys.readouterr().err
