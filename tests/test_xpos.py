"""xPos: parity with x-transformers' implementation, the decay it defines, and what it refuses."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from x_transformers.x_transformers import RotaryEmbedding, apply_rotary_pos_emb

import poslab
from poslab.analysis.capture import run_with_cache
from poslab.errors import ConfigError, InputError
from poslab.positional import AttentionGeometry, PositionalConfig, build_positional
from poslab.positional.xpos import XPosOptions, xpos_zeta


def xpos_layer(head_dim=16, max_seq_len=64, **options):
    _, layers = build_positional(PositionalConfig("xpos", options),
                                 AttentionGeometry(2, 2, head_dim, 2 * head_dim, max_seq_len, True))
    assert layers[0] is layers[1]  # parameter-free: one module for every layer
    return layers[0]


def half_split(x):
    """x-transformers pairs channels (2i, 2i+1); poslab (as Llama) pairs (i, i + d/2): the same channels reordered."""
    d = x.shape[-1]
    order = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), dim=-1).reshape(-1)
    return x[..., order]


@pytest.mark.parametrize("head_dim,n", [(8, 1), (16, 7), (64, 40), (32, 300)])
def test_rotated_and_scaled_q_and_k_match_x_transformers(head_dim, n):
    q, k = torch.randn(1, 3, n, head_dim), torch.randn(1, 3, n, head_dim)
    pos = torch.arange(n)[None]
    # x-transformers centres each call's scales at half its length; give poslab the same centre
    ours_q, ours_k = xpos_layer(head_dim, center=n // 2).transform_qk(q, k, pos, pos)
    freqs, scale = RotaryEmbedding(head_dim, use_xpos=True, scale_base=512)(torch.arange(n))
    theirs_q = apply_rotary_pos_emb(half_split(q), freqs, scale)
    theirs_k = apply_rotary_pos_emb(half_split(k), freqs, scale**-1)
    torch.testing.assert_close(half_split(ours_q), theirs_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half_split(ours_k), theirs_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale_base,gamma", [(512.0, 0.4), (16.0, 0.4), (8.0, 1.5)])
def test_logits_are_rope_decayed_by_zeta_to_the_distance(scale_base, gamma):
    """q.k = sum_i zeta_i^((t - s) / scale_base) Re[z_q,i conj(z_k,i) e^(i (t - s) theta_i)], pair i as the
    complex number z = x_i + i x_(i + d/2): computed here in complex float64, apart from the implementation."""
    d, n = 16, 24
    q, k = torch.randn(2, 2, n, d, dtype=torch.float64), torch.randn(2, 2, n, d, dtype=torch.float64)
    pos = torch.arange(n)[None] + torch.tensor([[0], [5]])  # two rows at different offsets
    layer = xpos_layer(d, scale_base=scale_base, gamma=gamma)
    q2, k2 = layer.transform_qk(q, k, pos, pos)
    ours = q2 @ k2.transpose(-1, -2)

    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    zeta = (2 * torch.arange(d // 2, dtype=torch.float64) / d + gamma) / (1 + gamma)
    zq, zk = torch.complex(*q.chunk(2, -1)), torch.complex(*k.chunk(2, -1))
    dist = (pos[:, :, None] - pos[:, None, :]).double()[:, None, :, :, None]  # (batch, 1, t, s, 1)
    terms = zq[:, :, :, None] * zk[:, :, None].conj() * torch.exp(1j * dist * theta)
    expected = (zeta ** (dist / scale_base) * terms.real).sum(-1)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)


def test_the_centre_cancels_in_every_logit():
    q, k = torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    pos = torch.arange(30)[None]

    def logits(center):
        q2, k2 = xpos_layer(center=center).transform_qk(q, k, pos, pos)
        return q2 @ k2.transpose(-1, -2)

    for center in (17, 32, 200):  # the scales are fp32: equal to fp32's precision
        torch.testing.assert_close(logits(center), logits(0), rtol=1e-5, atol=1e-5)


def test_a_cached_key_keeps_the_transform_it_was_cached_with():
    """A key's transform depends on its own position only: keys transformed one call at a time (as a KV cache
    holds them) equal the same keys transformed in one call."""
    layer = xpos_layer()
    q, k = torch.randn(1, 2, 12, 16), torch.randn(1, 2, 12, 16)
    pos = torch.arange(12)[None]
    _, whole = layer.transform_qk(q, k, pos, pos)
    parts = [layer.transform_qk(q[:, :, i:i + 1], k[:, :, i:i + 1], pos[:, i:i + 1], pos[:, i:i + 1])[1]
             for i in range(12)]
    torch.testing.assert_close(torch.cat(parts, dim=2), whole, rtol=0, atol=0)


def test_distant_keys_decay_fastest_at_the_fastest_frequency():
    zeta = xpos_zeta(64, 0.4)
    assert zeta[0] == pytest.approx(0.4 / 1.4) and bool((zeta.diff() > 0).all()) and float(zeta[-1]) < 1


def test_gradients_reach_q_and_k():
    layer = xpos_layer(8, scale_base=8.0)
    pos = torch.arange(5)[None] + 3

    def logits(q, k):
        q2, k2 = layer.transform_qk(q, k, pos, pos)
        return q2 @ k2.transpose(-1, -2)

    q = torch.randn(1, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(logits, (q, k))


def test_a_decoder_with_xpos_learns():
    torch.manual_seed(0)
    m = poslab.build_model({"arch": "decoder", "vocab_size": 16, "d_model": 32, "n_heads": 2, "n_layers": 2,
                            "max_seq_len": 32, "positional": {"name": "xpos", "options": {"scale_base": 32}}})
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x = torch.arange(32).remainder(7)[None].repeat(4, 1)  # a period-7 pattern: needs position to predict
    losses = []
    for _ in range(40):
        loss = m(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]


def test_an_encoder_refuses_xpos_in_one_line():
    with pytest.raises(ConfigError, match=r"xpos needs a causal model \(arch: decoder\).*use rope for encoders"):
        poslab.build_model({"arch": "encoder", "vocab_size": 16, "d_model": 32, "n_heads": 2, "n_layers": 1,
                            "max_seq_len": 32, "positional": {"name": "xpos"}})


def test_a_context_past_float32s_range_is_refused_with_the_scale_base_that_fits():
    with pytest.raises(ConfigError, match=r"leave float32's range.*raise xpos.scale_base to at least (\d+)") as err:
        xpos_layer(max_seq_len=200_000, scale_base=512)
    fits = int(str(err.value).rsplit(" ", 1)[1])
    xpos_layer(max_seq_len=200_000, scale_base=fits)  # the suggested value builds
    with pytest.raises(ConfigError):
        xpos_layer(max_seq_len=200_000, scale_base=fits - 10)


def test_float16_past_its_range_is_refused_and_bfloat16_there_stays_finite():
    layer = xpos_layer(max_seq_len=8192, scale_base=128.0)  # scales are 1 at position 4096
    q, k = torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16)
    far, near = torch.arange(6)[None], torch.arange(4090, 4096)[None]  # e^(4096 * 1.25 / 128) >> 65504
    with pytest.raises(InputError, match="overflow float16.*run in bfloat16 or float32, or raise xpos.scale_base"):
        layer.transform_qk(q.half(), k.half(), far, far)
    for dtype, pos in ((torch.bfloat16, far), (torch.float16, near)):
        q2, k2 = layer.transform_qk(q.to(dtype), k.to(dtype), pos, pos)
        assert bool(torch.isfinite(q2).all() and torch.isfinite(k2).all())


def test_float16_q_and_k_that_overflow_inside_the_positions_reach_are_refused():
    """The positions' check allows for entries of about 1: entries of 4 at positions it accepts overflowed to inf
    in float16 and gave NaN logits. The scaled values themselves are read in float16; the same inputs in
    bfloat16 stay finite."""
    layer = xpos_layer(max_seq_len=128, scale_base=8.0)  # centre 64
    pos = torch.arange(128)[None]
    q = torch.full((1, 1, 128, 16), 4.0)
    with pytest.raises(InputError, match=r"^xpos-scaled q or k overflow float16 at positions up to 64 from their "
                                         r"centre \(64\): run in bfloat16 or float32"):
        layer.transform_qk(q.half(), q.half(), pos, pos)
    assert bool(torch.isfinite(torch.cat(layer.transform_qk(q.bfloat16(), q.bfloat16(), pos, pos))).all())
    small = torch.full((1, 1, 128, 16), 0.05).half()  # the same positions with small entries pass
    assert bool(torch.isfinite(torch.cat(layer.transform_qk(small, small, pos, pos))).all())


def test_positions_past_float32s_range_are_refused_with_the_scale_base_that_fits():
    """Past max_seq_len (generation, extrapolation) positions are checked when they arrive, a fresh tensor each time."""
    layer = xpos_layer(max_seq_len=64, scale_base=8.0)  # float32 holds ~510 positions either side of 32
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16)
    fine = torch.arange(500, 503)[None]
    assert bool(torch.isfinite(torch.cat(layer.transform_qk(q, k, fine, fine))).all())
    far = torch.arange(600, 603)[None]
    with pytest.raises(InputError, match=r"positions 570 from their centre \(32\) overflow float32, which holds 510: "
                                          r"raise xpos.scale_base to at least 9"):
        layer.transform_qk(q, k, far, far)
    wider = xpos_layer(max_seq_len=64, scale_base=9.0)  # the value suggested
    assert bool(torch.isfinite(torch.cat(wider.transform_qk(q, k, far, far))).all())


@pytest.mark.parametrize("options,message", [
    ({"scale_base": 0}, "xpos.scale_base must be > 0"),
    ({"gamma": -0.1}, "xpos.gamma must be > 0"),
    ({"base": 1.0}, "xpos.base must be > 1"),
    ({"center": -3}, "xpos.center must be >= 0"),
    ({"block": 0}, "xpos.block must be >= 1"),
    ({"scale": 512}, "unknown"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        XPosOptions(**options)


def test_frequency_norms_are_the_raw_pairs():
    q = torch.zeros(1, 1, 1, 8)
    q[..., 1], q[..., 5] = 3.0, 4.0  # pair 1 is channels (1, 5)
    norms, _ = xpos_layer(8).qk_frequency_norms(q, q)
    assert norms.flatten().tolist() == [0.0, 5.0, 0.0, 0.0] and not math.isnan(norms.sum())


# --- blockwise causal attention ------------------------------------------------------------------------------

def xpos_decoder(**options):
    torch.manual_seed(0)
    return poslab.build_model({"arch": "decoder", "vocab_size": 20, "d_model": 16, "n_heads": 2, "n_layers": 2,
                               "max_seq_len": 32, "positional": {"name": "xpos", "options": options}}).eval()


@settings(deadline=None, max_examples=40)
@given(block=st.integers(1, 9), n=st.integers(1, 30), offset=st.integers(0, 40))
def test_blocks_hide_exactly_the_keys_before_the_previous_block(block, n, offset):
    """A query at t sees s (<= t) iff s // block >= t // block - 1: never 2 x block or more back, and always the
    last block x 2 - 1 positions when t sits at the end of its block."""
    pos = torch.arange(n)[None] + offset
    bias = xpos_layer(block=block).logit_bias(pos, pos)
    assert bias.shape == (1, 1, n, n)
    seen = (bias[0, 0] == 0).tolist()
    positions = pos[0].tolist()
    assert seen == [[s // block >= t // block - 1 for s in positions] for t in positions]
    assert all(t - s < 2 * block for i, t in enumerate(positions) for j, s in enumerate(positions)
               if seen[i][j] and s <= t)
    for i, t in enumerate(positions):  # the last position of a block past the first sees 2 x block - 1 back
        if t // block >= 1 and (t + 1) % block == 0 and t - (2 * block - 1) in positions:
            assert seen[i][positions.index(t - (2 * block - 1))]


def test_blockwise_attention_is_the_full_attention_renormalised_over_the_visible_keys():
    ids = torch.randint(0, 20, (2, 20))
    names = ["blocks.*.attn.probs", "blocks.*.attn.logits.content"]
    blocked = xpos_decoder(block=4)
    _, cache = run_with_cache(blocked, ids, names)
    full = xpos_decoder()
    full.load_state_dict(blocked.state_dict())
    _, reference = run_with_cache(full, ids, ["blocks.0.attn.logits.content"])
    t, s = torch.arange(20)[:, None], torch.arange(20)[None]
    visible = (s <= t) & (s // 4 >= t // 4 - 1)
    # the first layer sees the same inputs in both models: its content logits agree, and the blocked probabilities
    # are their softmax over the visible keys only
    content = reference["blocks.0.attn.logits.content"]
    torch.testing.assert_close(cache["blocks.0.attn.logits.content"], content)
    expected = torch.softmax(content.masked_fill(~visible, float("-inf")), -1)
    torch.testing.assert_close(cache["blocks.0.attn.probs"], expected)
    assert (cache["blocks.1.attn.probs"][..., ~visible] == 0).all()


def test_a_block_as_long_as_the_input_changes_nothing():
    ids = torch.randint(0, 20, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(xpos_decoder(block=24)(ids).logits, xpos_decoder()(ids).logits)
        assert not torch.allclose(xpos_decoder(block=4)(ids).logits, xpos_decoder()(ids).logits)


def test_blockwise_decoding_with_a_cache_matches_the_full_forward_with_padding():
    """The mask reads the cached keys' positions: each new token sees its block and the one before only."""
    from transformers import DynamicCache

    m = xpos_decoder(block=3)
    ids = torch.randint(1, 20, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        full = m(ids, attention_mask=mask).logits
        cache = DynamicCache()
        steps = [m(ids[:, :5], attention_mask=mask[:, :5], cache=cache).logits]
        steps += [m(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=cache).logits for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1)[mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-4)


def test_the_blockwise_scaling_sets_half_the_training_length():
    from poslab.positional import get_scheme

    assert get_scheme("xpos").context_options("blockwise", 10.0, 64) == {"block": 32}
    # an odd length: blocks of 32 reach 63 back, within its 65; 33 would reach 65, past anything trained on
    assert get_scheme("xpos").context_options("blockwise", 10.0, 65) == {"block": 32}
    assert get_scheme("xpos").context_options("blockwise", 2.0, 1) == {"block": 1}
    with pytest.raises(ConfigError, match="positional scheme 'xpos' has no context scaling 'yarn'"):
        get_scheme("xpos").context_options("yarn", 2.0, 64)
    with pytest.raises(ConfigError, match="positional scheme 'rope' has no context scaling 'blockwise'"):
        get_scheme("rope").context_options("blockwise", 2.0, 64)
