"""DSTG-NeoBERT: stream separation (gradients, FFN blocks, value paths), logit terms, options, Hugging
Face round trip, matched baselines, bad configs."""
import math
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM

import poslab
from poslab.data.cli import load_data_config
from poslab.data.preparation import _trained_tokenizer
from poslab.data.sources import open_source
from poslab.errors import ConfigError, InputError
from poslab.models import ActivationCache
from poslab.models.dstg import (CONFIG_DIR, READY, SCALES, DSTGBlock, DSTGNeoBertConfig, DSTGNeoBertForMaskedLM,
                                DSTGNeoBertModel, count_parameters, ready_config)
from poslab.models.dstg_config import RP_SCHEMES, DSTGConfig

FAST = settings(max_examples=10, deadline=None)
V = 40


def cfg(**extra):
    # A non-zero RP init: the paper's zero-initialised table would hide the RP term from every test.
    base = {"arch": "dstg", "vocab_size": V, "n_layers": 3, "n_heads": 4, "d_ap": 8, "d_sem": 24,
            "max_seq_len": 32, "rp": {"name": "t5", "options": {"init_std": 0.5, "num_buckets": 8,
                                                                 "max_distance": 16}}}
    return {**base, **extra}


def model(seed=0, **extra):
    torch.manual_seed(seed)
    return poslab.build_model(cfg(**extra)).eval()


_SHARED: dict[str, torch.nn.Module] = {}


def shared_model(seed=0, **extra):
    """A model built once per (seed, options), for property tests that only run it under no_grad."""
    key = repr((seed, sorted(extra.items())))
    if key not in _SHARED:
        _SHARED[key] = model(seed, **extra)
    return _SHARED[key]


def mlm_batch(b=3, n=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (b, n), generator=gen)
    labels = torch.where(torch.rand(b, n, generator=gen) < 0.3, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]  # at least one labelled token per row
    return ids, labels


# --- stream separation ---------------------------------------------------------------------------------

def test_last_layer_ap_part_gets_exactly_zero_mlm_gradient():
    m = model().train()
    ids, labels = mlm_batch()
    last = m.config.spec.n_layers - 1
    cache = ActivationCache(["blocks.*.resid_post.ap", "blocks.*.resid_post.sem"], detach=False)
    loss = m(ids, labels=labels, capture=cache).loss
    names = [f"blocks.{last}.resid_post.ap", f"blocks.{last}.resid_post.sem", f"blocks.{last - 1}.resid_post.ap"]
    grads = dict(zip(names, torch.autograd.grad(loss, [cache[n] for n in names], retain_graph=True,
                                                materialize_grads=True)))
    assert torch.equal(grads[names[0]], torch.zeros_like(grads[names[0]]))
    # The MLM gradient does reach the last layer's semantic part and the earlier layers' AP parts.
    assert grads[names[1]].abs().sum() > 0 and grads[names[2]].abs().sum() > 0
    loss.backward()
    # What writes the last layer's AP output -- its FFN's AP rows, the final AP norm -- learns nothing;
    # the same FFN rows one layer down do (the last attention's AP part still feeds the last FFN).
    # Those two are frozen (an optimizer or DDP would otherwise wait for gradients that never come); every
    # other parameter gets one.
    frozen = {f"model.blocks.{last}.mlp.down.ap.weight", "model.final_norm.norms.ap.weight"}
    params = dict(m.named_parameters())
    assert {name for name, p in params.items() if not p.requires_grad} == frozen
    assert all(params[name].grad is None for name in frozen)
    assert all(p.grad is not None for name, p in params.items() if name not in frozen)
    assert params[f"model.blocks.{last - 1}.mlp.down.ap.weight"].grad.abs().sum() > 0
    assert params[f"model.blocks.{last}.attn.out.ap.weight"].grad.abs().sum() > 0
    assert all(p.requires_grad for p in model(d_ap=0).parameters())


def _dense_down(mlp) -> torch.Tensor:
    """The FFN down-projection as one (hidden, d_model) matrix, read off by probing with unit vectors."""
    width = sum(mlp.split.values())
    with torch.no_grad():
        return torch.cat(list(mlp.down_project(torch.eye(width)).values()), dim=-1)


def test_ffn_down_projection_stays_block_diagonal_through_training():
    m = model().train()
    spec = m.config.spec
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    h_ap, d_ap = spec.ffn_ap, spec.d_ap
    for step in range(3):
        ids, labels = mlm_batch(seed=step)
        m(ids, labels=labels).loss.backward()
        for block in m.model.blocks:
            mlp = block.mlp
            # Gradient from one stream's output never reaches the other stream's hidden units or weights.
            x = {s: torch.randn(2, 5, d, requires_grad=False) for s, d in spec.streams.items()}
            h = mlp.hidden(x).detach().requires_grad_()
            out = mlp.down_project(h)
            ap_weight = [mlp.down["ap"].weight] if mlp.down["ap"].weight.requires_grad else []  # last block: frozen
            g_sem = torch.autograd.grad(out["sem"].square().sum(), [h, *ap_weight], allow_unused=True)
            g_ap = torch.autograd.grad(out["ap"].square().sum(), [h, mlp.down["sem"].weight], allow_unused=True)
            assert torch.equal(g_sem[0][..., :h_ap], torch.zeros_like(g_sem[0][..., :h_ap]))
            assert torch.equal(g_ap[0][..., h_ap:], torch.zeros_like(g_ap[0][..., h_ap:]))
            assert all(g is None for g in g_sem[1:]) and g_ap[1] is None
            assert g_sem[0][..., h_ap:].abs().sum() > 0 and g_ap[0][..., :h_ap].abs().sum() > 0
        opt.step()
        opt.zero_grad()
        for block in m.model.blocks:
            dense = _dense_down(block.mlp)  # rows: hidden units (AP share first); columns: [AP | sem]
            assert torch.equal(dense[:h_ap, d_ap:], torch.zeros_like(dense[:h_ap, d_ap:]))
            assert torch.equal(dense[h_ap:, :d_ap], torch.zeros_like(dense[h_ap:, :d_ap]))
            assert dense[:h_ap, :d_ap].abs().sum() > 0 and dense[h_ap:, d_ap:].abs().sum() > 0


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("fixed,perturbed", [("ap", "ap"), ("sem", "sem")])
def test_value_paths_never_read_the_other_stream(backend, fixed, perturbed):
    """Zero the perturbed stream's q/k projection so the attention weights cannot move, perturb that
    stream: the other stream's attention output (norm -> value -> output projection) must not change."""
    m = model(attn_backend=backend)
    spec = m.config.spec
    block: DSTGBlock = m.model.blocks[1]
    qk_rows = 2 * spec.n_heads * spec.head_dim
    with torch.no_grad():
        block.attn.qkv[fixed].weight[:qk_rows] = 0
    other = "sem" if perturbed == "ap" else "ap"
    x = {s: torch.randn(2, 9, d) for s, d in spec.streams.items()}
    y = {**x, perturbed: x[perturbed] * 3 + torch.randn_like(x[perturbed])}
    pos = torch.arange(9)[None] + 1
    pad = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    with torch.no_grad():
        a = block.attn(block.attn_norm(x), pos, pad)
        b = block.attn(block.attn_norm(y), pos, pad)
    torch.testing.assert_close(a[other], b[other], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(a[perturbed], b[perturbed], atol=1e-3)  # the perturbation did arrive


# --- logit terms and backends ----------------------------------------------------------------------------

def test_eager_logit_terms_sum_to_the_fast_path_logits():
    m = model(attn_backend="sdpa")
    spec = m.config.spec
    ids, _ = mlm_batch(b=2, n=10)
    mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    fast = ActivationCache(["blocks.*.attn.q", "blocks.*.attn.k", "blocks.*.attn_out"])
    eager = ActivationCache(["blocks.*.attn.logits.*", "blocks.*.attn.probs", "blocks.*.attn_out",
                             "blocks.*.attn.q.*", "blocks.*.attn.k.*"])
    with torch.no_grad():
        out_fast = m(ids, attention_mask=mask, capture=fast).logits
        out_eager = m(ids, attention_mask=mask, capture=eager).logits
    positions = m.model.positions(ids, mask)
    scale = 1 / math.sqrt(spec.head_dim)
    for i in range(spec.n_layers):
        terms = {t: eager[f"blocks.{i}.attn.logits.{t}"] for t in ("ap", "sem", "rp")}
        for t in ("ap", "sem"):
            q, k = eager[f"blocks.{i}.attn.q.{t}"], eager[f"blocks.{i}.attn.k.{t}"]
            torch.testing.assert_close(terms[t], scale * q @ k.mT)
        rp = m.model.blocks[i].attn.rp.logit_bias(positions, positions)
        torch.testing.assert_close(terms["rp"], rp.expand_as(terms["rp"]))
        assert terms["rp"].abs().sum() > 0 and terms["ap"].abs().sum() > 0
        # The fast path's logits: one dot product over the concatenated per-stream q/k, plus the bias.
        fast_logits = scale * fast[f"blocks.{i}.attn.q"] @ fast[f"blocks.{i}.attn.k"].mT + rp
        torch.testing.assert_close(sum(terms.values()), fast_logits, rtol=1e-5, atol=1e-5)
        keep = mask.bool()[:, None, None, :] | torch.eye(10, dtype=torch.bool)
        probs = torch.softmax(fast_logits.masked_fill(~keep, float("-inf")), dim=-1)
        torch.testing.assert_close(eager[f"blocks.{i}.attn.probs"], probs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(eager[f"blocks.{i}.attn_out"], fast[f"blocks.{i}.attn_out"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_eager, out_fast, rtol=1e-5, atol=1e-5)


@FAST
@given(n=st.integers(2, 16), pad=st.integers(0, 5), rp=st.sampled_from(["t5", "alibi", None]),
       d_ap=st.sampled_from([0, 4, 8]), seed=st.integers(0, 1000))
def test_eager_and_sdpa_backends_agree(n, pad, rp, d_ap, seed):
    extra = {"d_ap": d_ap, "rp": None if rp is None else {"name": rp}}
    fast, slow = shared_model(attn_backend="sdpa", **extra), shared_model(attn_backend="eager", **extra)
    ids = torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, n - min(pad, n - 1):] = 0
    with torch.no_grad():
        torch.testing.assert_close(fast(ids, attention_mask=mask).logits, slow(ids, attention_mask=mask).logits,
                                   rtol=1e-5, atol=1e-5)


# --- options ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("start", [0, 1])
@FAST
@given(n=st.integers(1, 10), pad=st.integers(1, 6), seed=st.integers(0, 1000))
def test_positions_count_non_pad_tokens_so_left_padding_changes_nothing(start, n, pad, seed):
    m = shared_model(position_start=start)
    ids = torch.randint(1, V, (1, n), generator=torch.Generator().manual_seed(seed))
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, n, dtype=torch.long)], dim=1)
    cache = ActivationCache("embed.ap")
    with torch.no_grad():
        plain = m(ids, capture=cache).logits
        torch.testing.assert_close(cache["embed.ap"][0], m.ap_table()[:n])
        left = m(padded, attention_mask=mask).logits[:, pad:]
    torch.testing.assert_close(left, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32])
@FAST
@given(lengths=st.lists(st.integers(1, 10), min_size=2, max_size=4), seed=st.integers(0, 1000))
def test_right_padded_batches_share_one_row_of_positions_and_match_each_sequence_alone(dtype, lengths, seed):
    m = shared_model()
    n = max(lengths)
    ids = torch.randint(1, V, (len(lengths), n), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(n)[None] < torch.tensor(lengths)[:, None]).to(dtype)
    assert m.model.positions(ids, mask).shape == (1, n)  # the relative bias is built once for the batch
    with torch.no_grad():
        batch = m(ids, attention_mask=mask).logits
        for i, length in enumerate(lengths):
            torch.testing.assert_close(batch[i, :length], m(ids[i:i + 1, :length]).logits[0], rtol=1e-5, atol=1e-5)


def test_random_position_offset_applies_in_training_only():
    m = model(position_offset_max=7, max_seq_len=16)
    assert m.ap_table().shape[0] == 16 + 7 and m.model.ap_embed.weight.shape[0] == 1 + 16 + 7
    ids = torch.randint(0, V, (64, 5))
    assert torch.equal(m.model.positions(ids), torch.arange(5)[None] + 1)  # eval: no offset
    m.train()
    pos = m.model.positions(ids)
    offsets = pos - (torch.arange(5)[None] + 1)
    assert torch.equal(offsets, offsets[:, :1].expand_as(offsets))  # one offset per sequence
    assert offsets.min() >= 0 and offsets.max() <= 7 and len(offsets[:, 0].unique()) > 1
    with pytest.raises(InputError, match="max_seq_len"):
        m(torch.zeros(1, 17, dtype=torch.long))
    # Given positions get the offset too: the last 7 rows of the table are the offset's, not the caller's.
    with pytest.raises(InputError, match=r"position_ids must lie in \[0, 17\) .*offset up to 7 is added\); got \[0, 20\]"):
        m(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[0, 1, 20]]))
    m.eval()
    assert m(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[0, 1, 20]])).logits.shape == (1, 3, V)


def test_ap_off_and_rp_off_is_permutation_equivariant_and_ap_on_is_not():
    ids = torch.randint(0, V, (2, 8))
    perm = torch.randperm(8)
    nope = model(d_ap=0, rp=None)
    assert nope.ap_table() is None and not any(".ap." in n for n, _ in nope.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(nope(ids).logits[:, perm], nope(ids[:, perm]).logits, rtol=1e-5, atol=1e-5)
        for extra in ({}, {"rp": None}, {"d_ap": 0}):
            m = model(**extra)
            assert not torch.allclose(m(ids).logits[:, perm], m(ids[:, perm]).logits, atol=1e-4), extra


def test_qk_head_dim_is_shared_by_both_streams():
    m = model(qk_head_dim=5)
    cache = ActivationCache(["blocks.0.attn.q.*", "blocks.0.attn.k.*"])
    with torch.no_grad():
        m(torch.randint(0, V, (1, 6)), capture=cache)
    assert {tuple(cache[k].shape) for k in cache.keys()} == {(1, 4, 6, 5)}


def test_capture_names_and_semantic_states():
    m = model()
    ids = torch.randint(0, V, (2, 7))
    cache = ActivationCache()
    with torch.no_grad():
        out = m(ids, capture=cache)
        sem = m.semantic_states(ids)
    for i in range(3):
        for name in ("resid_pre", "resid_mid", "resid_post", "attn_out"):
            full = cache[f"blocks.{i}.{name}"]
            assert torch.equal(full, torch.cat([cache[f"blocks.{i}.{name}.ap"], cache[f"blocks.{i}.{name}.sem"]], -1))
        for term in ("ap", "sem", "rp"):
            assert cache[f"blocks.{i}.attn.logits.{term}"].shape == (2, 4, 7, 7)
    assert cache["embed.ap"].shape == (2, 7, 8) and cache["embed.sem"].shape == (2, 7, 24)
    torch.testing.assert_close(sem, cache["final.sem"])
    torch.testing.assert_close(out.logits, m.mlm_head(sem))


# --- Hugging Face, baselines, configs ---------------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"rp": {"name": "alibi"}, "position_start": 0, "d_ap": 0},
                                   {"rp": None, "qk_head_dim": 4}])
def test_round_trip_through_auto_classes(extra):
    m = model(**extra)
    ids = torch.randint(0, V, (2, 9))
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        config = AutoConfig.from_pretrained(d)
        loaded = AutoModelForMaskedLM.from_pretrained(d).eval()
        trunk = AutoModel.from_pretrained(d).eval()
    assert isinstance(config, DSTGNeoBertConfig) and config.spec == m.config.spec
    assert isinstance(loaded, DSTGNeoBertForMaskedLM) and isinstance(trunk, DSTGNeoBertModel)
    # loading replaces the parameters: the ones no gradient reaches stay frozen (DDP would wait for them)
    frozen = {name for name, p in m.named_parameters() if not p.requires_grad}
    assert {name for name, p in loaded.named_parameters() if not p.requires_grad} == frozen
    assert bool(frozen) == bool(m.config.spec.d_ap)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, m(ids).logits)
        assert torch.equal(trunk(ids).semantic_state, m.semantic_states(ids))


@pytest.mark.parametrize("scale", SCALES)
def test_ready_configs_match_parameter_counts_within_two_percent(scale):
    counts = {name: count_parameters(ready_config(name, scale)) for name in READY}
    for name, count in counts.items():
        assert abs(count / counts["rope_neobert"] - 1) < 0.02, (name, counts)
    assert ready_config("dstg", scale)["arch"] == "dstg"
    assert {ready_config(n, scale)["arch"] for n in READY if n != "dstg"} == {"encoder"}


def test_meta_counts_equal_built_counts_and_every_quick_config_trains_a_step():
    for name in READY:
        values = ready_config(name, "quick")
        m = poslab.build_model({**values, "n_layers": 1})
        assert m.num_parameters() == count_parameters({**values, "n_layers": 1})
        ids = torch.randint(0, values["vocab_size"], (2, 16))
        loss = m(ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)


def test_quick_ready_configs_fit_the_quick_corpus_vocabulary():
    """mlm_quick.yaml's WordPiece (trained as `data prepare` trains it) fits the ready quick models exactly: a
    smaller table would be refused at training, a larger one would train rows no token reaches."""
    config = load_data_config(str(CONFIG_DIR.parent / "data" / "mlm_quick.yaml"), [])
    vocabulary = _trained_tokenizer(config, open_source(config.source), lambda message: None).get_vocab_size()
    assert {ready_config(name, "quick")["vocab_size"] for name in READY} == {vocabulary}


@pytest.mark.parametrize("change,message", [
    ({"d_ap": 10}, "d_ap (10) must be divisible by n_heads (4)"),
    ({"d_sem": 30}, "d_sem (30) must be divisible by n_heads (4)"),
    ({"qk_head_dim": 0}, "qk_head_dim must be a positive integer"),
    ({"qk_head_dim": "64"}, "qk_head_dim must be a positive integer"),
    ({"rp": {"name": "t5", "options": {"num_buckets": 2}}}, "t5.num_buckets must be >= 4"),
    ({"rp": {"name": "t5", "options": {"num_buckets": 32, "max_distance": 8}}}, "t5.max_distance must exceed"),
    ({"rp": {"name": "rope"}}, "rp.name must be one of " + ", ".join(RP_SCHEMES)),
    ({"rp": {"name": "t5", "options": {"buckets": 8}}}, "did you mean 'num_buckets'"),
    ({"d_ap": -4}, "d_ap must be a non-negative integer"),
    ({"ffn_hidden": 2}, "raise ffn_hidden"),
    ({"position_start": 2}, "position_start must be 0 or 1"),
    ({"position_offset_max": -1}, "position_offset_max must be a non-negative integer"),
    ({"attn_backend": "triton"}, "attn_backend must be one of auto, sdpa, eager"),
    ({"d_model": 32}, "DSTG has no 'd_model': its width is d_ap \\+ d_sem"),
    ({"n_head": 4}, "did you mean 'n_heads'"),
    ({"sparse_prediction": 1}, "sparse_prediction must be true or false"),
])
def test_bad_configs_are_rejected_with_the_fix(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        poslab.build_model(cfg(**change))
    with pytest.raises(ConfigError):
        DSTGNeoBertConfig(dstg=cfg(**change))


def test_bad_inputs_and_names_are_rejected():
    with pytest.raises(ConfigError, match="did you mean 'rope_neobert'"):
        ready_config("rope_nebert")
    with pytest.raises(InputError, match=r"position_ids must lie in \[0, 33\)"):
        model()(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[0, 1, 40]]))
    assert DSTGConfig(**{k: v for k, v in cfg().items()}).d_model == 32


def test_params_command_prints_counts_and_the_matching_width(capsys):
    import argparse

    from poslab.models.dstg import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["params", "--scale", "quick", "--match"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    expected = count_parameters(ready_config("dstg", "quick"))
    assert f"{expected:,d}" in out and "rp_neobert" in out
    # and the models the recipe trains from them (2 x 64 at quick scale, not the ready configs' 4 x 128)
    from poslab.experiments import dstg as recipe

    trained = count_parameters(recipe.model_sections(recipe.SCALES["quick"])["dstg"])
    assert "as `poslab reproduce dstg --scale quick` trains them" in out and f"{trained:,d}" in out
    assert f"matching rope_neobert: {ready_config('dstg', 'quick')['ffn_hidden']}" in out


@pytest.mark.parametrize("ffn_hidden, ap_units", [(69, 17), (71, 18), (96, 24), (None, 21)])
def test_ffn_ap_share_is_the_nearest_whole_number_of_units(ffn_hidden, ap_units):
    """round(ffn_hidden * d_ap / d_model) hidden units write to AP (d_ap / d_model = 8 / 32 here): 69 -> 17.25
    -> 17, 71 -> 17.75 -> 18; the default width int(8 * 32 / 3) = 85 -> 21.25 -> 21. The built block has them."""
    m = model(ffn_hidden=ffn_hidden)
    mlp = m.model.blocks[0].mlp
    size = ffn_hidden or 85
    assert m.config.spec.ffn_size == size and m.config.spec.ffn_ap == ap_units
    assert mlp.down["ap"].in_features == ap_units and mlp.down["sem"].in_features == size - ap_units
    assert mlp.gate_up.out_features == 2 * size


def test_matched_ffn_width_is_the_closest_by_direct_search():
    """match_ffn_hidden returns the width whose count is closest to the target, checked against counting every
    width in the range: a target just below a width's count and one just above both give that width (the
    next-larger or next-smaller width of the bracket would be off by one)."""
    from poslab.models.dstg import match_ffn_hidden

    values = cfg(n_layers=1)
    counts = {h: count_parameters({**values, "ffn_hidden": h}) for h in range(40, 80)}
    assert all(counts[h] < counts[h + 1] for h in range(40, 79))
    for h in (50, 63, 64, 71):
        step = min(counts[h] - counts[h - 1], counts[h + 1] - counts[h])
        for target in (counts[h] - step // 3, counts[h] + step // 3, counts[h]):
            closest = min(counts, key=lambda w: abs(counts[w] - target))
            assert closest == h and match_ffn_hidden(values, target) == h


@pytest.mark.parametrize("scale", ["quick", "smoke", "paper"])
def test_recipe_model_sections_apply_widths_and_stay_parameter_matched(scale):
    from poslab.experiments import dstg as recipe

    spec = recipe.SCALES[scale]
    models = recipe.model_sections(spec)
    counts = {name: count_parameters(values) for name, values in models.items()}
    for name, count in counts.items():
        assert abs(count / counts["rope_neobert"] - 1) < 0.02, (name, counts)
    for name, values in models.items():
        own = spec.get("dstg_overrides" if name == "dstg" else "baseline_overrides", {})
        assert {**spec["model_overrides"], **own}.items() <= values.items()
    if scale == "paper":  # the recipe trains the width of `model: paper/dstg`, not one of its own
        from poslab.models.dstg import ready_config

        assert models["dstg"]["ffn_hidden"] == ready_config("dstg", "paper")["ffn_hidden"] == 2432


def test_random_offset_takes_every_value_from_zero_to_the_maximum():
    """The training offset is uniform on [0, position_offset_max], both ends included (the last rows of the
    table, reserved for it, are reachable)."""
    m = model(position_offset_max=7, max_seq_len=16).train()
    torch.manual_seed(0)
    offsets = m.model.positions(torch.zeros(400, 3, dtype=torch.long))[:, 0] - m.config.spec.position_start
    assert set(offsets.tolist()) == set(range(8))


def test_relative_bias_uses_bidirectional_t5_buckets():
    """DSTG is an encoder: its RP term tells a key before the query from one after it (papers/dstg.md), with
    Hugging Face T5's bidirectional buckets over k - q."""
    from transformers.models.t5.modeling_t5 import T5Attention

    m = model()
    rp = m.model.blocks[0].attn.rp
    pos = torch.arange(20)[None]
    buckets = T5Attention._relative_position_bucket(pos[0][None, :] - pos[0][:, None], True, 8, 16)  # (q, k)
    expected = rp.weight[buckets].permute(2, 0, 1)[None]
    torch.testing.assert_close(rp.logit_bias(pos, pos).expand_as(expected), expected)
    assert not torch.equal(expected[0, :, 3, 5], expected[0, :, 5, 3])
