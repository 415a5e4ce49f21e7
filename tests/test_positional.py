"""Positional schemes: parity with Hugging Face transformers and the definitions we commit to."""
import dataclasses
import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.t5.modeling_t5 import T5Attention

from poslab.errors import ConfigError
from poslab.positional import SCHEMES, AttentionGeometry, PositionalConfig, build_positional
from poslab.positional.alibi import alibi_slopes
from poslab.positional.relative_bias import relative_position_bucket
from poslab.positional.rope import RoPEOptions, rope_cos_sin, rope_inv_freq

HEAD_DIM, MAX_LEN = 64, 256


def hf_rope(rope_type: str, seq_len=None, **params):
    params = {"rope_type": rope_type, "rope_theta": 10000.0, **params}
    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=MAX_LEN,
                      rope_parameters=params)
    init = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init is None:  # "default" has no entry in some versions
        return 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), 1.0
    return init(cfg, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("factor", [1.5, 2.0, 4.0, 8.0])
@pytest.mark.parametrize("scaling", ["linear", "dynamic", "yarn"])
@pytest.mark.parametrize("seq_len", [None, 100, 256, 700, 2048])
def test_rope_frequencies_match_hugging_face(scaling, factor, seq_len):
    params = {"factor": factor}
    if scaling == "yarn":
        params["original_max_position_embeddings"] = MAX_LEN
    ours, our_scale = rope_inv_freq(RoPEOptions(scaling=scaling, factor=factor), HEAD_DIM, MAX_LEN, seq_len)
    theirs, their_scale = hf_rope(scaling, seq_len=seq_len, **params)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(their_scale)


@pytest.mark.parametrize("beta_fast,beta_slow,attention_factor", [(32, 1, None), (16, 2, None), (64, 1, 1.3)])
def test_yarn_options_match_hugging_face(beta_fast, beta_slow, attention_factor):
    opts = RoPEOptions(scaling="yarn", factor=4.0, beta_fast=beta_fast, beta_slow=beta_slow,
                       attention_factor=attention_factor, original_max_len=128)
    ours, our_scale = rope_inv_freq(opts, HEAD_DIM, 128)
    params = {"factor": 4.0, "beta_fast": beta_fast, "beta_slow": beta_slow, "original_max_position_embeddings": 128}
    if attention_factor is not None:
        params["attention_factor"] = attention_factor
    theirs, their_scale = hf_rope("yarn", **params)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(their_scale)


def test_rope_rotation_matches_llama():
    q, k = torch.randn(2, 4, 33, HEAD_DIM), torch.randn(2, 4, 33, HEAD_DIM)
    pos = torch.arange(5, 38)[None].expand(2, -1)
    opts = RoPEOptions(scaling="yarn", factor=4.0, original_max_len=16)
    _, layers = build_positional(PositionalConfig("rope", {"scaling": "yarn", "factor": 4.0, "original_max_len": 16}),
                                 AttentionGeometry(1, 4, HEAD_DIM, 4 * HEAD_DIM, 64, True))
    ours_q, ours_k = layers[0].transform_qk(q, k, pos, pos)
    inv_freq, scale = rope_inv_freq(opts, HEAD_DIM, 16)
    cos, sin = rope_cos_sin(inv_freq, pos, scale)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0])
    torch.testing.assert_close(ours_q, ref_q)
    torch.testing.assert_close(ours_k, ref_k)
    # and the Llama rotary module's own cos/sin
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, max_position_embeddings=64,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                       "original_max_position_embeddings": 16})
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(q, pos)
    torch.testing.assert_close(cos[:, 0], hf_cos)
    torch.testing.assert_close(sin[:, 0], hf_sin)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (8, 20), (64, 512)])
def test_t5_buckets_match_hugging_face(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-1500, 1500)[None, :] + torch.randint(-3, 3, (4, 1))
    ours = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    theirs = T5Attention._relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 6, 8, 12, 16, 20])
def test_alibi_slopes_any_head_count(heads):
    slopes = alibi_slopes(heads)
    assert slopes.shape == (heads,) and (slopes > 0).all() and (slopes < 1).all()
    assert len(set(slopes.tolist())) == heads
    if heads & (heads - 1) == 0:  # powers of two: the paper's geometric sequence 2^(-8i/n)
        expected = torch.tensor([2 ** (-8 * (i + 1) / heads) for i in range(heads)])
        torch.testing.assert_close(slopes, expected)
    if heads == 12:  # the reference recipe: 8 from the 8-head sequence + every other of the 16-head one
        expected = [2 ** (-(i + 1)) for i in range(8)] + [2 ** (-0.5 * (2 * i + 1)) for i in range(4)]
        torch.testing.assert_close(slopes, torch.tensor(expected))


@pytest.mark.parametrize("heads", [1, 3, 5, 6, 8, 12, 20, 64])
def test_alibi_slopes_match_bloom(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    # Bloom's bias for a key at position p is slope * p: read the slopes off position 1.
    theirs = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]
    torch.testing.assert_close(alibi_slopes(heads), theirs, rtol=1e-6, atol=0)


def test_sinusoidal_matches_vaswani():
    geometry = AttentionGeometry(1, 2, 8, 16, 64, True)
    inp, _ = build_positional(PositionalConfig("sinusoidal"), geometry)
    out = inp(torch.zeros(1, 10, 16), torch.arange(10)[None])
    p, i = 7, 3
    assert out[0, p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 16)), abs=1e-6)
    assert out[0, p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 16)), abs=1e-6)
    # Token embeddings are scaled by sqrt(d) before the table is added (Vaswani et al. 3.4), unless told not to.
    x = torch.randn(1, 10, 16)
    torch.testing.assert_close(inp(x, torch.arange(10)[None]), x * 4 + out)
    plain, _ = build_positional(PositionalConfig("sinusoidal", {"scale_tokens": False}), geometry)
    torch.testing.assert_close(plain(x, torch.arange(10)[None]), x + out)
    with pytest.raises(ConfigError, match="sinusoidal.scale_tokens must be true or false, got 'yes'"):
        PositionalConfig("sinusoidal", {"scale_tokens": "yes"})


def test_unknown_scheme_lists_valid_names():
    with pytest.raises(ConfigError, match="valid: " + ", ".join(sorted(SCHEMES))):
        PositionalConfig("ropee")


def test_unknown_option_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'factor'"):
        PositionalConfig("rope", {"facotr": 2.0})


@pytest.mark.parametrize("name,options,message", [
    ("rope", {"scaling": "ntk"}, "rope.scaling must be one of"),
    ("rope", {"factor": 0.5}, "rope.factor must be >= 1"),
    ("pope", {"delta_init": "normal"}, "pope.delta_init must be one of"),
    ("t5", {"num_buckets": 2}, "t5.num_buckets must be >= 4"),
    ("t5", {"num_buckets": 32, "max_distance": 8}, "exact range \\(8\\) of 32 bidirectional buckets"),
    ("t5", {"num_buckets": 32, "max_distance": 16, "bidirectional": False}, "exact range \\(16\\) of 32 causal"),
    ("rope", {"attention_factor": 0.0}, "rope.attention_factor must be > 0"),
    ("rope", {"attention_factor": -1.3}, "rope.attention_factor must be > 0"),
    ("rope", {"attention_factor": float("inf")}, "rope.attention_factor must be a finite number"),
    ("rope", {"truncate": "no"}, "rope.truncate must be true or false, got 'no'"),
    # a scaling's options without the scaling were ignored without a word
    ("rope", {"factor": 4.0}, "^rope.factor 4 needs a scaling to apply it; set rope.scaling"),
    ("rope", {"scaling": "linear", "factor": 2.0, "beta_fast": 16.0},
     "^rope.beta_fast is an option of yarn scaling, and rope.scaling is 'linear'; set rope.scaling: yarn or drop it"),
    ("rope", {"attention_factor": 1.2}, "^rope.attention_factor is an option of yarn scaling, and rope.scaling is 'none'"),
])
def test_bad_options_rejected(name, options, message):
    with pytest.raises(ConfigError, match=message):
        PositionalConfig(name, options)


def test_a_scheme_without_options_says_so():
    """Not "unknown option ... (valid: )"."""
    with pytest.raises(ConfigError, match="^positional scheme 'nope' takes no options; remove base, scale$"):
        PositionalConfig("nope", {"base": 1, "scale": 2})
    PositionalConfig("nope", {})


def test_demo_refuses_bad_steps_and_seed(capsys):
    """--steps 0 was an UnboundLocalError, a seed past 2^64 a ValueError from torch: one line each."""
    from poslab.cli import main

    for argv, message in ((["--steps", "0"], "--steps must be >= 1 (training steps per scheme), got 0"),
                          (["--steps", "-3"], "--steps must be >= 1"),
                          (["--seed", "99999999999999999999999"], "--seed must lie in [0, 2^63), got 9999"),
                          (["--seed", "-1"], "--seed must lie in [0, 2^63), got -1")):
        assert main(["demo", *argv]) == 2
        out, err = capsys.readouterr()
        assert err.startswith(f"poslab: error: {message}") and err.count("\n") == 1 and not out


def test_options_take_numbers_in_yamls_string_spelling():
    """YAML 1.1 reads 1e4 as the string '1e4'; model and train numbers accept it, so scheme options do too."""
    from poslab.positional.pope import PoPEOptions
    from poslab.positional.rope import RoPEOptions

    assert PoPEOptions(base="1e4").base == 10000.0
    assert RoPEOptions(scaling="yarn", factor="2", original_max_len="2048").original_max_len == 2048
    with pytest.raises(ConfigError, match="pope.base must be a number"):
        PoPEOptions(base="ten thousand")
    with pytest.raises(ConfigError, match="rope.original_max_len must be an integer or null"):
        RoPEOptions(original_max_len="2048.5")


def test_a_config_keeps_its_options_as_the_scheme_reads_them(tmp_path):
    """`--set model.positional.options.base=1e3` was kept as the string '1e3' in the run's config and in the
    checkpoint's config.json, which other readers then took for a string."""
    import json

    from poslab.models import build_model

    assert PositionalConfig("rope", {"base": "1e3"}).to_dict() == {"name": "rope", "options": {"base": 1000.0}}
    assert PositionalConfig("alibi", {}).to_dict() == {"name": "alibi", "options": {}}  # defaults stay unspelled
    model = build_model({"arch": "decoder", "vocab_size": 11, "d_model": 16, "n_layers": 1, "n_heads": 2,
                         "positional": {"name": "pope", "options": {"base": "1e3"}}})
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["poslab"]["positional"]["options"] == {"base": 1000.0}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_a_scheme_names_itself_once(name):
    """The registry key, Scheme.name and Options.scheme (which the option errors print) are one name, and the
    options go through options_dataclass, whose errors are one-line ConfigErrors."""
    scheme = SCHEMES[name]
    assert scheme.name == name == scheme.Options.scheme
    with pytest.raises(ConfigError, match=f"positional scheme '{name}'"):
        scheme.Options(no_such_option_anywhere=1)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_causal_only_schemes_and_only_they_refuse_a_bidirectional_model(name):
    geometry = AttentionGeometry(n_layers=2, n_heads=2, head_dim=8, d_model=16, max_seq_len=16, causal=False)
    if SCHEMES[name].causal_only:
        with pytest.raises(ConfigError, match=f"{name} needs a causal model"):
            build_positional(PositionalConfig(name), geometry)
    else:
        build_positional(PositionalConfig(name), geometry)


# Options under which five short positions show what a scheme is: FIRE is relative below its threshold L
# (512 by default), and only a query past L sees its distances normalised by its own position.
REVEALING_OPTIONS = {"fire": {"threshold_init": 1.0}}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_scheme_capabilities_say_what_the_scheme_does(name):
    """bias_only (what DSTG accepts as its relative term), context_scalings (what extrapolation rescales) and
    relative (what the shift-invariance tests cover) are read instead of scheme names, so they must be true to
    the scheme."""
    scheme = SCHEMES[name]
    geometry = AttentionGeometry(n_layers=2, n_heads=2, head_dim=8, d_model=16, max_seq_len=16, causal=True)
    input_pos, layers = build_positional(PositionalConfig(name, REVEALING_OPTIONS.get(name, {})), geometry)
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    pos = torch.arange(5)[None]
    layer = layers[0]
    q_out, k_out = layer.transform_qk(q, k, pos, pos) if layer is not None else (q, k)
    bias = layer.logit_bias(pos, pos) if layer is not None else None
    content = layer.content_bias(q_out, k_out, causal=True, key_padding=None) if layer is not None else None
    touches_only_bias = (input_pos is None and torch.equal(q_out, q) and torch.equal(k_out, k) and bias is not None
                         and content is None)
    assert scheme.bias_only == touches_only_bias
    option_names = {f.name for f in dataclasses.fields(scheme.Options)}
    assert scheme.context_scalings == {"rope": ("linear", "ntk", "yarn"), "xpos": ("blockwise",)}.get(name, ())
    for scaling in scheme.context_scalings:  # each names options the scheme has, which build a model
        scaled = scheme.context_options(scaling, 4.0, 16)
        assert set(scaled) <= option_names
        build_positional(PositionalConfig(name, {**REVEALING_OPTIONS.get(name, {}), **scaled}), geometry)
    for module in (input_pos, *layers):
        if module is not None:
            module.init_weights(0.0, 0.5)  # a zero-initialised T5 table would be shift-invariant by accident

    def scores(shift: int) -> list[torch.Tensor]:
        at = pos + shift
        q_at, k_at = layer.transform_qk(q, k, at, at) if layer is not None else (q, k)
        biases = (layer.logit_bias(at, at), layer.content_bias(q_at, k_at, causal=True, key_padding=None)) \
            if layer is not None else ()
        logits = q_at @ k_at.transpose(-1, -2) + sum(b for b in biases if b is not None)
        return [logits] + ([input_pos(torch.ones(1, 5, 16), at)] if input_pos is not None else [])

    assert scheme.relative == all(torch.allclose(a, b, atol=1e-4) for a, b in zip(scores(0), scores(7)))


def fp32_tables(model) -> dict[tuple[str, str], torch.Tensor]:
    """Every table a positional module declares in ``fp32_tables``, by (module path, buffer name)."""
    return {(path, table): getattr(module, table) for path, module in model.named_modules()
            for table in getattr(module, "fp32_tables", ())}


def cast_model(name: str, options: dict):
    import poslab

    return poslab.build_model({"arch": "decoder", "vocab_size": 30, "d_model": 48, "n_heads": 12, "n_layers": 1,
                               "max_seq_len": 64, "positional": {"name": name, "options": options}})


def test_the_schemes_with_fixed_tables_are_found():
    assert {"rope", "pope", "alibi", "xpos"} <= {name for name in SCHEMES if fp32_tables(cast_model(name, {}))}


@pytest.mark.parametrize("name,options", [(name, {}) for name in sorted(SCHEMES)] +
                         [("rope", {"scaling": "yarn", "factor": 4.0, "original_max_len": 16})])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_model_cast_keeps_its_fixed_tables_in_fp32(name, options, dtype):
    """model.to(bf16) casts weights, not the frequency and slope tables: a bf16 inv_freq or theta is 0.4% off,
    which at position 4000 turns RoPE's rotations by up to 0.7 rad and PoPE's phases by up to 1.7 rad."""
    model = cast_model(name, options)
    exact = {key: table.clone() for key, table in fp32_tables(model).items()}
    model.to(dtype)
    assert model.model.embed.weight.dtype == dtype  # the weights do follow the cast
    for key, kept in fp32_tables(model).items():
        assert kept.dtype == torch.float32 and torch.equal(kept, exact[key]), key


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_model_loaded_in_half_precision_keeps_its_fixed_tables_in_fp32(name, dtype, tmp_path):
    """from_pretrained(dtype=bf16) builds the model under bf16 as the default dtype: xPos's tables, made without
    a dtype, were bf16 (inv_freq 0.4% off) and stayed so after .float(), as casts keep fixed tables."""
    from transformers import AutoModelForCausalLM

    model = cast_model(name, {})
    exact = {key: table.clone() for key, table in fp32_tables(model).items()}
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype)
    assert loaded.model.embed.weight.dtype == dtype
    tables = fp32_tables(loaded)
    assert tables.keys() == exact.keys()
    for key, kept in tables.items():
        assert kept.dtype == torch.float32 and torch.equal(kept, exact[key]), key


@settings(max_examples=60, deadline=None)
@given(num_buckets=st.integers(4, 40), max_distance=st.integers(1, 100), causal=st.booleans())
@example(num_buckets=6, max_distance=3, causal=True).via("the review's case")
@example(num_buckets=10, max_distance=5, causal=True).via("the review's case")
@example(num_buckets=7, max_distance=3, causal=True).via("the review's case")
def test_every_accepted_t5_table_gives_buckets_in_range(num_buckets, max_distance, causal):
    """Bucket counts that are not multiples of 4 once passed a check meant for another direction, and then
    indexed the table with int64-min buckets (6 causal buckets up to distance 3)."""
    geometry = AttentionGeometry(n_layers=1, n_heads=2, head_dim=8, d_model=16, max_seq_len=64, causal=causal)
    try:
        _, layers = build_positional(PositionalConfig("t5", {"num_buckets": num_buckets, "max_distance": max_distance,
                                                             "init_std": 0.5}), geometry)
    except ConfigError as error:
        assert "t5.max_distance must exceed the exact range" in str(error)
        return
    rel = torch.arange(-150, 151)
    buckets = relative_position_bucket(rel, not causal, num_buckets, max_distance)
    assert buckets.min() >= 0 and buckets.max() < num_buckets
    layers[0].logit_bias(torch.arange(5)[None], torch.arange(5)[None])


def test_an_encoders_t5_table_may_end_where_a_decoders_could_not():
    geometry = AttentionGeometry(n_layers=1, n_heads=2, head_dim=8, d_model=16, max_seq_len=64, causal=False)
    build_positional(PositionalConfig("t5", {"num_buckets": 32, "max_distance": 16}), geometry)  # exact range 8
    with pytest.raises(ConfigError, match="exact range \\(16\\) of 32 causal buckets"):
        build_positional(PositionalConfig("t5", {"num_buckets": 32, "max_distance": 16}),
                         dataclasses.replace(geometry, causal=True))


# --- formulas the parity tests above leave unexercised (mutation testing) ---------------------------------

@pytest.mark.parametrize("original_max_len,base,truncate", [
    (131072, 10000.0, True),   # beta_slow's correction dim (34.5) passes the 32 frequencies: clamped at dim - 1
    (256, 20.0, True),         # a small base does the same at a short length
    (256, 10000.0, False),     # an untruncated (fractional) ramp
    (100, 500000.0, False),
])
def test_yarn_ramp_bounds_match_hugging_face_past_the_frequencies_and_untruncated(original_max_len, base, truncate):
    """YaRN's correction range: high is clamped to rotary_dim - 1 (not to the last frequency index) and
    ``truncate: false`` keeps the fractional bounds, both as Hugging Face computes them."""
    opts = RoPEOptions(scaling="yarn", factor=4.0, base=base, truncate=truncate, original_max_len=original_max_len)
    ours, our_scale = rope_inv_freq(opts, HEAD_DIM, original_max_len)
    theirs, their_scale = hf_rope("yarn", rope_theta=base, factor=4.0, truncate=truncate,
                                  original_max_position_embeddings=original_max_len)
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(their_scale)


@pytest.mark.parametrize("causal", [True, False])
def test_alibi_bias_is_minus_slope_times_distance(causal):
    """bias[h, q, k] = -m_h |k - q| (Press et al.), with Bloom's slopes: a penalty growing with distance on both
    sides of the diagonal, at offset positions too."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    heads = 6
    _, layers = build_positional(PositionalConfig("alibi"), AttentionGeometry(1, heads, 8, 8 * heads, 64, causal))
    pos = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    bias = layers[0].logit_bias(pos, pos)[0]
    slopes = build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)[:, 0, 1]
    for h, i, j in [(0, 6, 0), (1, 5, 2), (5, 0, 6), (3, 2, 4), (2, 4, 4)]:
        assert bias[h, i, j].item() == pytest.approx(-slopes[h].item() * abs(j - i), rel=1e-6, abs=1e-7)
    assert (bias <= 0).all()


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_matches_hugging_face_compute_bias(bidirectional):
    """The whole bias, not only the buckets: T5's compute_bias with the same table puts bucket(k - q)'s row of
    head h at [h, q, k]."""
    from transformers import T5Config

    n_heads, n = 3, 40
    opts = {"num_buckets": 16, "max_distance": 32, "bidirectional": bidirectional, "init_std": 1.0}
    _, layers = build_positional(PositionalConfig("t5", opts), AttentionGeometry(1, n_heads, 8, 8 * n_heads, 64, True))
    ours = layers[0]
    t5 = T5Attention(T5Config(num_heads=n_heads, d_model=8 * n_heads, d_kv=8, relative_attention_num_buckets=16,
                              relative_attention_max_distance=32, is_decoder=not bidirectional),
                     has_relative_attention_bias=True)
    with torch.no_grad():
        t5.relative_attention_bias.weight.copy_(ours.weight)
    pos = torch.arange(n)[None]
    torch.testing.assert_close(ours.logit_bias(pos, pos), t5.compute_bias(n, n))
