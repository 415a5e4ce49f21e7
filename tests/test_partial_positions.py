"""Partial schemes, the PoPE paper's baselines: RoPE on a share of each head's channels (rope.fraction, Hugging
Face's partial_rotary_factor) and ALiBi on a share of the heads (alibi.heads, the rest NoPE heads)."""
import tempfile

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, GPTNeoXConfig
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXRotaryEmbedding, apply_rotary_pos_emb

import poslab
from poslab.errors import ConfigError
from poslab.models import ModelConfig
from poslab.positional import AttentionGeometry, PositionalConfig, build_positional
from poslab.positional.alibi import alibi_slopes

F64 = torch.float64
HEAD_DIM, HEADS, MAX_LEN = 16, 2, 32


def layer(name, options, head_dim=HEAD_DIM, heads=HEADS):
    geometry = AttentionGeometry(1, heads, head_dim, heads * head_dim, MAX_LEN, True)
    return build_positional(PositionalConfig(name, options), geometry)[1][0]


# --- RoPE: rope.fraction ------------------------------------------------------------------------------------

# scaling -> (our options, Hugging Face's rope_parameters); positions run past MAX_LEN (dynamic stretches)
# and past YaRN's original length.
SCALINGS = {
    "none": ({}, {"rope_type": "default"}),
    "linear": ({"scaling": "linear", "factor": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    "dynamic": ({"scaling": "dynamic", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}),
    "yarn": ({"scaling": "yarn", "factor": 4.0, "original_max_len": 8},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
}


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_partial_rope_matches_gpt_neox(fraction, scaling):
    """GPT-NeoX's rotary module and apply_rotary_pos_emb rotate the first int(head_dim * partial_rotary_factor)
    channels; ours must give the same q and k in float64, for every scaling."""
    ours, theirs = SCALINGS[scaling]
    cfg = GPTNeoXConfig(hidden_size=HEAD_DIM * HEADS, num_attention_heads=HEADS, max_position_embeddings=MAX_LEN,
                        rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": fraction, **theirs})
    q, k = torch.randn(2, HEADS, 40, HEAD_DIM, dtype=F64), torch.randn(2, HEADS, 40, HEAD_DIM, dtype=F64)
    pos = torch.arange(40)[None] + torch.tensor([[0], [7]])
    cos, sin = GPTNeoXRotaryEmbedding(cfg)(q, pos)
    assert cos.shape[-1] == int(HEAD_DIM * fraction)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = layer("rope", {**ours, "fraction": fraction}).transform_qk(q, k, pos, pos)
    assert got_q.dtype == got_k.dtype == F64
    # Hugging Face's dynamic update passes the length as a tensor, so its stretched base is rounded to
    # float32; ours stays a Python float. Everything else is the same arithmetic.
    tolerance = {"rtol": 1e-6, "atol": 1e-6} if scaling == "dynamic" else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(got_q, ref_q, **tolerance)
    torch.testing.assert_close(got_k, ref_k, **tolerance)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_fraction_one_is_full_rotation(scaling):
    """fraction 1.0 (the default) rotates every channel exactly as before the option existed."""
    ours, _ = SCALINGS[scaling]
    q, k = torch.randn(1, HEADS, 40, HEAD_DIM), torch.randn(1, HEADS, 40, HEAD_DIM)
    pos = torch.arange(40)[None]
    full = layer("rope", {**ours, "fraction": 1.0})
    assert full.rotary_dim == HEAD_DIM and full.inv_freq.shape == (HEAD_DIM // 2,)
    for got, expected in zip(full.transform_qk(q, k, pos, pos), layer("rope", ours).transform_qk(q, k, pos, pos)):
        assert torch.equal(got, expected)


@settings(max_examples=40, deadline=None)
@given(head_dim=st.sampled_from([4, 8, 12, 16, 32]), fraction=st.floats(0.05, 1.0),
       scaling=st.sampled_from(["none", "linear", "yarn"]), shift=st.integers(1, 300), n=st.integers(1, 9),
       seed=st.integers(0, 2**16))
def test_partial_rope_passes_the_rest_through_and_stays_relative(head_dim, fraction, scaling, shift, n, seed):
    """The channels past rotary_dim come out unchanged, and the q.k scores of the rotated channels depend on
    the positions only through their difference. (Dynamic scaling is left out: its base depends on the
    largest position, so by design it is not shift invariant.)"""
    rotary_dim = int(head_dim * fraction)
    assume(rotary_dim % 2 == 0 and rotary_dim >= 2)
    rope = layer("rope", {**SCALINGS[scaling][0], "fraction": fraction}, head_dim=head_dim)
    assert rope.rotary_dim == rotary_dim
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, HEADS, n, head_dim, dtype=F64, generator=generator) for _ in range(2))
    pos = torch.arange(n)[None] + torch.tensor([[0], [11]])

    def rotated_scores(positions):
        q_out, k_out = rope.transform_qk(q, k, positions, positions)
        assert torch.equal(q_out[..., rotary_dim:], q[..., rotary_dim:])
        assert torch.equal(k_out[..., rotary_dim:], k[..., rotary_dim:])
        return q_out[..., :rotary_dim] @ k_out[..., :rotary_dim].transpose(-1, -2)

    # cos and sin are float32 (as Hugging Face builds them), so shifted angles agree to float32 precision.
    torch.testing.assert_close(rotated_scores(pos), rotated_scores(pos + shift), rtol=1e-4, atol=1e-4)


def test_partial_rope_frequency_norms_cover_the_rotated_channels():
    rope = layer("rope", {"fraction": 0.5})
    q, k = torch.randn(1, HEADS, 3, HEAD_DIM), torch.randn(1, HEADS, 3, HEAD_DIM)
    q_norms, _ = rope.qk_frequency_norms(q, k)
    assert q_norms.shape == (1, HEADS, 3, HEAD_DIM // 4) == (*q.shape[:-1], rope.inv_freq.shape[0])
    torch.testing.assert_close(q_norms[..., 0], torch.hypot(q[..., 0], q[..., HEAD_DIM // 4]))


@pytest.mark.parametrize("fraction,message", [
    (0, r"rope.fraction must lie in \(0, 1\] \(the share of channels that rotate\), got 0"),
    (1.5, r"rope.fraction must lie in \(0, 1\] \(the share of channels that rotate\), got 1.5"),
    (-0.5, r"rope.fraction must lie in \(0, 1\]"),
    ("half", "rope.fraction must be a number"),
])
def test_bad_rope_fraction_rejected(fraction, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        PositionalConfig("rope", {"fraction": fraction})


@pytest.mark.parametrize("fraction,scaling,rotated", [
    (0.375, "none", 3),  # 16 * 0.375 = 6 channels per head: 3 here, with head dim 8
    (0.1, "none", 0),
    (0.25, "dynamic", 2),  # dynamic NTK's base stretch divides by rotary_dim - 2
])
def test_rotary_dim_that_is_odd_or_too_small_rejected_at_build(fraction, scaling, rotated):
    least = 4 if scaling == "dynamic" else 2
    expected = (f"rope needs an even number >= {least} of rotating channels per head, got {rotated} "
                f"(head dim 8 x rope.fraction {fraction}); change d_model, n_heads or rope.fraction")
    with pytest.raises(ConfigError) as error:
        poslab.build_model({"arch": "decoder", "vocab_size": 50, "d_model": 32, "n_layers": 1, "n_heads": 4,
                            "positional": {"name": "rope", "options": {"fraction": fraction, "scaling": scaling}}})
    assert str(error.value) == expected


# --- ALiBi: alibi.heads -------------------------------------------------------------------------------------

def test_half_head_alibi_slopes_are_four_heads_slopes_then_zeros():
    slopes = layer("alibi", {"heads": 0.5}, heads=8).slopes
    assert torch.equal(slopes, torch.cat([alibi_slopes(4), torch.zeros(4)]))


@pytest.mark.parametrize("heads", [1, 3, 5, 8, 12])
def test_all_head_alibi_is_unchanged(heads):
    assert torch.equal(layer("alibi", {"heads": 1.0}, heads=heads).slopes, alibi_slopes(heads))
    assert torch.equal(layer("alibi", {}, heads=heads).slopes, alibi_slopes(heads))


@pytest.mark.parametrize("share,n_heads,biased", [(0.5, 4, 2), (0.25, 8, 2), (0.75, 4, 3), (0.3, 5, 2)])
def test_partial_alibi_biases_only_the_first_heads(share, n_heads, biased):
    """round(heads * n_heads) heads get a bias; the others get none, and the scheme is still bias-only."""
    alibi = layer("alibi", {"heads": share}, heads=n_heads)
    pos = torch.arange(6)[None]
    q, k = torch.randn(1, n_heads, 6, 4), torch.randn(1, n_heads, 6, 4)
    assert alibi.transform_qk(q, k, pos, pos) == (q, k)
    bias = alibi.logit_bias(pos, pos)
    assert bias.shape == (1, n_heads, 6, 6)
    assert (bias[:, :biased].flatten(2) < 0).any(-1).all() and (bias[:, biased:] == 0).all()


def test_half_head_alibi_model_trains():
    model = poslab.build_model({"arch": "decoder", "vocab_size": 50, "d_model": 32, "n_layers": 1, "n_heads": 4,
                                "max_seq_len": 16, "positional": {"name": "alibi", "options": {"heads": 0.5}}})
    ids = torch.randint(0, 50, (2, 16))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("share,message", [
    (0, r"alibi.heads must lie in \(0, 1\] \(the share of heads with a bias\), got 0"),
    (1.5, r"alibi.heads must lie in \(0, 1\] \(the share of heads with a bias\), got 1.5"),
])
def test_bad_alibi_heads_rejected(share, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        PositionalConfig("alibi", {"heads": share})


def test_alibi_heads_that_round_to_no_head_rejected_at_build():
    with pytest.raises(ConfigError) as error:
        poslab.build_model({"arch": "decoder", "vocab_size": 50, "d_model": 32, "n_layers": 1, "n_heads": 4,
                            "positional": {"name": "alibi", "options": {"heads": 0.1}}})
    assert str(error.value) == ("alibi.heads 0.1 of 4 heads biases 0 heads; it must bias at least one: "
                                "raise alibi.heads or n_heads")


# --- both: the model config carries them --------------------------------------------------------------------

@pytest.mark.parametrize("positional", [{"name": "rope", "options": {"fraction": 0.5, "scaling": "yarn",
                                                                     "factor": 2.0}},
                                        {"name": "alibi", "options": {"heads": 0.5}}])
def test_partial_options_round_trip(positional):
    torch.manual_seed(0)
    model = poslab.build_model({"arch": "decoder", "vocab_size": 50, "d_model": 32, "n_layers": 2, "n_heads": 4,
                                "max_seq_len": 16, "positional": positional}).eval()
    assert ModelConfig.from_dict(model.config.poslab).positional.to_dict() == positional
    ids = torch.randint(0, 50, (2, 16))
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        assert AutoConfig.from_pretrained(d).poslab["positional"] == positional
        loaded = AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
