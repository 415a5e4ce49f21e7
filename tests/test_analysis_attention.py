"""How far heads look (poslab.analysis.attention): measures on constructed attention, against a brute-force
loop, and ``poslab analyze attention`` on tiny runs."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from poslab.analysis.attention import add_sums, attention_means, attention_sums
from poslab.cli import main
from poslab.train import RunConfig, train

# Small models on shared cores: a second intra-op thread only adds OpenMP spinning.
pytestmark = pytest.mark.usefixtures("one_thread")


def measures(probs: torch.Tensor, causal: bool = True, mask: torch.Tensor | None = None) -> dict:
    return {k: v.tolist() for k, v in attention_means(attention_sums(probs, causal, mask)).items()}


def causal_uniform(n: int) -> torch.Tensor:
    """(1, 1, n, n) uniform attention over each query's keys 0..t."""
    lower = torch.tril(torch.ones(n, n))
    return (lower / lower.sum(-1, keepdim=True))[None, None]


# ---- constructed attention ----------------------------------------------------------------------------------

def test_previous_token_attention():
    """Query 0 sees only itself (forced, p = 1, not counted); every other query puts all its mass on t - 1."""
    n = 7
    probs = torch.zeros(1, 1, n, n)
    probs[0, 0, 0, 0] = 1
    probs[0, 0, torch.arange(1, n), torch.arange(n - 1)] = 1
    m = measures(probs)
    assert m["previous_token"] == [1.0] and m["mean_distance"] == [1.0] and m["self"] == [0.0]
    assert m["entropy"] == [0.0] and m["first_token"] == [pytest.approx(1 / (n - 1))]  # only query 1's t - 1 is 0
    assert m["offsets"] == list(range(n)) and m["profile"][0] == [0.0, 1.0] + [0.0] * (n - 2)
    assert m["uniform_distance"] == pytest.approx(sum(t / 2 for t in range(1, n)) / (n - 1))


def test_keys_the_model_hides_are_not_visible():
    """Uniform attention over a window of 2 keys (a mask the model applies itself, e.g. xPos's blocks, given as
    ``hidden``) is the baseline: ratio 1 and entropy 1, not a local head."""
    n = 6
    t, s = torch.arange(n)[:, None], torch.arange(n)[None]
    hidden = (s < t - 1)[None, None]
    probs = torch.zeros(1, 1, n, n).masked_fill(~hidden & (s <= t), 1.0)
    probs = probs / probs.sum(-1, keepdim=True)
    m = {k: v.tolist() for k, v in attention_means(attention_sums(probs, True, None, hidden)).items()}
    assert m["distance_ratio"] == [pytest.approx(1.0)] and m["entropy"] == [pytest.approx(1.0)]
    assert m["uniform_distance"] == pytest.approx(0.5) and m["previous_token"] == [pytest.approx(0.5)]
    assert all(math.isnan(v) for v in m["profile"][0][2:])


def test_uniform_causal_attention_is_the_baseline():
    m = measures(causal_uniform(9))
    assert m["distance_ratio"] == [pytest.approx(1.0)] and m["entropy"] == [pytest.approx(1.0)]
    # each query t >= 1 puts 1 / (t + 1) on every key; offset Delta is seen by the queries t >= max(Delta, 1)
    assert m["profile"][0] == pytest.approx([sum(1 / (t + 1) for t in range(max(d, 1), 9)) / (9 - max(d, 1))
                                             for d in range(9)])


def test_a_sink_head_puts_everything_on_the_first_token():
    n = 6
    probs = torch.zeros(1, 2, n, n)
    probs[:, :, :, 0] = 1
    probs[0, 1] = causal_uniform(n)[0, 0]  # a second head, uniform: measured on its own
    m = measures(probs)
    assert m["first_token"] == [1.0, pytest.approx(sum(1 / (t + 1) for t in range(1, n)) / (n - 1))]
    assert m["distance_ratio"][0] > 1 and m["distance_ratio"][1] == pytest.approx(1.0)
    assert m["mean_distance"][0] == pytest.approx(sum(range(1, n)) / (n - 1))


@pytest.mark.parametrize("causal", [True, False])
def test_padded_queries_and_keys_are_ignored(causal):
    """A sequence of 5 right-padded to 8, its padding attending anywhere: the numbers of the 5 tokens alone."""
    torch.manual_seed(0)
    short = torch.randn(1, 3, 5, 5)
    if causal:
        short = short.masked_fill(~torch.tril(torch.ones(5, 5, dtype=torch.bool)), -math.inf)
    short = short.softmax(-1)
    padded = torch.rand(1, 3, 8, 8)  # whatever the model puts on padding rows and columns
    padded[..., :5, :5] = short
    padded[..., :5, 5:] = 0
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]])
    alone, with_padding = measures(short, causal), measures(padded, causal, mask)
    for key in ("mean_distance", "uniform_distance", "entropy", "previous_token", "self", "first_token"):
        assert with_padding[key] == pytest.approx(alone[key], rel=1e-12), key
    # the padded width's further offsets have no query: NaN
    inner = [with_padding["offsets"].index(d) for d in alone["offsets"]]
    for got, want in zip(with_padding["profile"], alone["profile"]):
        assert [got[i] for i in inner] == pytest.approx(want, rel=1e-12)
    assert torch.tensor(with_padding["profile"]).isnan().sum() == 3 * (3 if causal else 6)


def test_bidirectional_offsets_are_signed_and_uniform_is_symmetric():
    n = 5
    m = measures(torch.full((1, 1, n, n), 1 / n), causal=False)
    assert m["offsets"] == list(range(-(n - 1), n))
    assert m["profile"][0] == pytest.approx([1 / n] * (2 * n - 1))
    assert m["distance_ratio"] == [pytest.approx(1.0)] and m["entropy"] == [pytest.approx(1.0)]
    # next-token attention (the last query, which has no next token, looks back): Delta = -1 for t < n - 1
    nxt = torch.zeros(1, 1, n, n)
    nxt[0, 0, torch.arange(n - 1), torch.arange(1, n)] = 1
    nxt[0, 0, n - 1, n - 2] = 1
    m = measures(nxt, causal=False)
    assert m["profile"][0][m["offsets"].index(-1)] == 1.0 and m["mean_distance"] == [1.0]
    assert m["previous_token"] == [pytest.approx(1 / (n - 1))]  # only the last query looks back


@pytest.mark.parametrize("causal", [True, False])
def test_batches_of_different_widths_add_up(causal):
    """A task's batches are as wide as their longest problem: the profile widens, the counts weigh each query."""
    torch.manual_seed(1)
    visible = torch.tril(torch.ones(6, 6, dtype=torch.bool)) if causal else torch.ones(6, 6, dtype=torch.bool)
    wide = torch.randn(1, 2, 6, 6).masked_fill(~visible, -math.inf).softmax(-1)
    narrow = torch.randn(2, 2, 4, 4).masked_fill(~visible[:4, :4], -math.inf).softmax(-1)
    total = attention_means(add_sums(attention_sums(narrow, causal), attention_sums(wide, causal)))
    together = torch.zeros(3, 2, 6, 6)
    together[:2, :, :4, :4], together[2:] = narrow, wide
    mask = torch.tensor([[1] * 4 + [0] * 2] * 2 + [[1] * 6])
    expected = attention_means(attention_sums(together, causal, mask))
    for key, value in expected.items():
        assert torch.allclose(total[key].double(), value.double(), rtol=1e-12, equal_nan=True), key


# ---- against a brute-force loop -----------------------------------------------------------------------------

def brute_force(probs: torch.Tensor, causal: bool, lengths: list[int]) -> dict:
    """The module docstring's definitions, one (sequence, query, key) at a time, in float64 Python."""
    h = probs.shape[1]
    n = probs.shape[-1]
    acc = {k: [0.0] * h for k in ("distance", "entropy", "self", "previous", "first")}
    counts = {"queries": 0, "previous": 0, "first": 0}
    uniform = 0.0
    profile = {d: [0.0] * h for d in range(-(n - 1), n)}
    seen = {d: 0 for d in profile}
    for b, length in enumerate(lengths):
        for t in range(length):
            keys = [s for s in range(length) if s <= t or not causal]
            if len(keys) < 2:
                continue
            counts["queries"] += 1
            uniform += sum(abs(t - s) for s in keys) / len(keys)
            counts["previous"] += t >= 1
            counts["first"] += t >= 1
            for s in keys:
                seen[t - s] += 1
            for head in range(h):
                p = {s: float(probs[b, head, t, s]) for s in keys}
                acc["distance"][head] += sum(p[s] * abs(t - s) for s in keys)
                acc["entropy"][head] -= sum(v * math.log(v) for v in p.values() if v > 0) / math.log(len(keys))
                acc["self"][head] += p[t]
                if t >= 1:
                    acc["previous"][head] += p[t - 1]
                    acc["first"][head] += p[0]
                for s in keys:
                    profile[t - s][head] += p[s]
    q = counts["queries"]
    offsets = [d for d in profile if d >= 0 or not causal]
    return {"mean_distance": [v / q for v in acc["distance"]], "uniform_distance": uniform / q,
            "entropy": [v / q for v in acc["entropy"]], "self": [v / q for v in acc["self"]],
            "previous_token": [v / counts["previous"] for v in acc["previous"]],
            "first_token": [v / counts["first"] for v in acc["first"]], "offsets": offsets,
            "profile": [[profile[d][head] / seen[d] if seen[d] else math.nan for d in offsets] for head in range(h)]}


@st.composite
def attention_batches(draw):
    """Softmax of random logits over each query's visible keys, in a right-padded batch (a sequence >= 2 long)."""
    causal = draw(st.booleans())
    n = draw(st.integers(2, 7))
    lengths = [n] + draw(st.lists(st.integers(1, n), max_size=2))
    heads = draw(st.integers(1, 3))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    scale = draw(st.sampled_from([0.1, 1.0, 10.0]))
    logits = torch.randn(len(lengths), heads, n, n, dtype=torch.float64) * scale
    mask = torch.tensor([[1] * length + [0] * (n - length) for length in lengths])
    visible = mask.bool()[:, None, None, :] & (torch.ones(n, n).tril().bool() if causal else True)
    probs = logits.masked_fill(~visible, -math.inf).softmax(-1)
    return probs, causal, mask, lengths


@settings(deadline=None, max_examples=60)
@given(attention_batches())
def test_measures_match_a_brute_force_loop_and_stay_in_range(batch):
    probs, causal, mask, lengths = batch
    m = measures(probs, causal, mask)
    expected = brute_force(probs, causal, lengths)
    assert m["offsets"] == expected["offsets"]
    for key in ("mean_distance", "uniform_distance", "entropy", "self", "previous_token", "first_token"):
        assert m[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12), key
    for got, want in zip(m["profile"], expected["profile"]):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12, nan_ok=True)
    farthest = max(lengths) - 1
    assert all(-1e-12 <= d <= farthest + 1e-9 for d in m["mean_distance"])
    assert all(-1e-12 <= e <= 1 + 1e-9 for e in m["entropy"])


# ---- poslab analyze attention on tiny runs ------------------------------------------------------------------

def decoder(positional: str, **options) -> dict:
    return {"seed": 0,
            "model": {"arch": "decoder", "vocab_size": None, "d_model": 32, "n_layers": 2, "n_heads": 4,
                      "max_seq_len": 24, "positional": {"name": positional, "options": options}},
            "data": {"kind": "task", "name": "addition", "min_len": 3, "max_len": 5, "validation_size": 16,
                     "test_size": 8},
            "train": {"steps": 2, "batch_size": 8, "lr": 1e-2, "warmup_steps": 1, "log_every": 10}}


def dstg(cache) -> dict:
    return {"seed": 0,
            "model": {"arch": "dstg", "vocab_size": None, "n_layers": 1, "n_heads": 2, "d_ap": 8, "d_sem": 24,
                      "max_seq_len": 16},
            "data": {"kind": "mlm", "source": {"type": "synthetic", "documents": 30, "seed": 0},
                     "tokenizer": {"type": "wordpiece", "vocab_size": 120, "train_documents": 20},
                     "validation_documents": 8, "seq_len": 16, "cache_dir": str(cache)},
            "train": {"steps": 2, "batch_size": 4, "warmup_steps": 0, "eval_batches": 1}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("attention_runs")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for name in ("alibi", "nope"):
        train(RunConfig.from_dict(decoder(name)), root / name)
    train(RunConfig.from_dict(decoder("xpos", block=2)), root / "xpos")
    train(RunConfig.from_dict(dstg(root / "cache")), root / "dstg")
    torch.set_num_threads(threads)
    return root


MEASURES = {"mean_distance", "distance_ratio", "entropy", "previous_token", "self", "first_token", "profile"}


def analyzed(run, capsys) -> dict:
    assert main(["analyze", "attention", "--run", str(run), "--sequences", "8", "--batch-size", "4"]) == 0
    assert f"attention: measured {run}" in capsys.readouterr().out
    data = json.loads((run / "analysis" / "attention.json").read_text())
    assert data["figures"] == ["attention_distance.png", "attention_profile.png"]
    for name in data["figures"]:
        assert (run / "analysis" / name).read_bytes()[:4] == b"\x89PNG"
    assert set(data["models"]) == {"trained", "init"} and data["uniform_distance"] > 0 and data["queries"] > 0
    return data


def test_a_decoder_run_and_alibis_steepest_head_looks_nearest(runs, capsys):
    data = analyzed(runs / "alibi", capsys)
    assert data["causal"] and data["offsets"] == list(range(data["sequence_length"]))
    for model in data["models"].values():
        assert set(model) == {"blocks.0", "blocks.1"}
        for layer in model.values():
            assert set(layer) == MEASURES and len(layer["mean_distance"]) == 4
            assert all(len(row) == data["sequence_length"] for row in layer["profile"])
    # At initialisation content logits are tiny and ALiBi's bias -slope * distance decides: head 0 has the
    # steepest slope (1/4), head 3 the shallowest (1/256), nearly uniform attention.
    for layer in data["models"]["init"].values():
        distance = layer["mean_distance"]
        assert distance == sorted(distance) and distance[0] < 0.8 * distance[3]
        assert layer["distance_ratio"][3] == pytest.approx(1.0, abs=0.05)
    nope = analyzed(runs / "nope", capsys)
    assert nope["uniform_distance"] == data["uniform_distance"]  # the same problems and masks


def test_keys_a_model_masks_itself_are_not_in_the_baselines(runs, capsys):
    """xPos with blocks of 2 hides every key 4 or more back through its bias: at initialisation its heads attend
    nearly uniformly over the keys they see, which is what the baseline must be."""
    data = analyzed(runs / "xpos", capsys)
    nope = analyzed(runs / "nope", capsys)
    assert data["uniform_distance"] < nope["uniform_distance"]
    for layer in data["models"]["init"].values():
        assert layer["distance_ratio"] == pytest.approx([1.0] * 4, abs=0.05)
        assert layer["entropy"] == pytest.approx([1.0] * 4, abs=0.01)
        assert all(v is None for row in layer["profile"] for v in row[4:])  # no query sees 4 or more back (null)


def test_an_encoder_run_has_signed_offsets(runs, capsys):
    data = analyzed(runs / "dstg", capsys)
    n = data["sequence_length"]
    assert not data["causal"] and data["offsets"] == list(range(-(n - 1), n))
    layer = data["models"]["trained"]["blocks.0"]
    assert set(layer) == MEASURES and all(len(row) == 2 * n - 1 for row in layer["profile"])
    assert all(0 <= e <= 1 + 1e-9 for e in layer["entropy"])


@pytest.mark.parametrize("option", [["--threshold", "0.3"], ["--factors", "2"]])
def test_an_option_attention_does_not_read_is_refused(option, tmp_path, capsys):
    assert main(["analyze", "attention", "--run", str(tmp_path / "nowhere"), *option]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(f"analyze attention does not use {option[0]} \\(read by .*\\); leave it out",
                                         err)
