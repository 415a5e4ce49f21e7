"""CoPE (positional/cope.py): its logits against a loop over query, key and counted key, gradients through the
whole attention, a KV cache, what it is for (counting marked tokens), dtypes, options, the meta device."""
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.autograd import gradcheck

import poslab
from poslab.attention.core import attend, visible_keys
from poslab.errors import ConfigError
from poslab.experiments import plan as planning
from poslab.models import ActivationCache
from poslab.positional import SCHEMES, AttentionGeometry, PositionalConfig, build_positional, cope
from poslab.positional.cope import CoPELayer

F64 = torch.float64
HEADS, HEAD_DIM = 2, 4


def cope_layer(npos_max=None, init_std=0.0, max_seq_len=8, causal=True):
    geometry = AttentionGeometry(1, HEADS, HEAD_DIM, HEADS * HEAD_DIM, max_seq_len, causal)
    options = {"init_std": init_std} if npos_max is None else {"npos_max": npos_max, "init_std": init_std}
    return build_positional(PositionalConfig("cope", options), geometry)[1][0]


def random_layer(npos_max, seed=0):
    torch.manual_seed(seed)
    layer = cope_layer(npos_max).double()
    with torch.no_grad():
        layer.pos_emb.copy_(torch.randn_like(layer.pos_emb))
    return layer


def reference_logits(q, k, table, npos_max, padding):
    """The paper's formula entry by entry in numpy float64: (batch, heads, n, m), NaN where a query does not see
    the key; also the contextual positions p (before the clamp) for the visible pairs."""
    q, k, table = q.detach().numpy(), k.detach().numpy(), table.detach().numpy()
    batch, heads, n, d = q.shape
    m = k.shape[2]
    s = 1 / math.sqrt(d)
    offset = m - n
    logits, positions = np.full((batch, heads, n, m), np.nan), np.full((batch, heads, n, m), np.nan)

    def visible(b, i, t):  # causal, and a padding key only to itself
        return t <= i + offset and (padding is None or padding[b][t] == 1 or t == i + offset)

    for b in range(batch):
        for h in range(heads):
            for i in range(n):
                for j in range(m):
                    if not visible(b, i, j):
                        continue
                    p = 0.0
                    for t in range(j, i + offset + 1):
                        if visible(b, i, t):
                            p += 1 / (1 + math.exp(-s * float(q[b, h, i] @ k[b, h, t])))
                    positions[b, h, i, j] = p
                    p = min(p, npos_max - 1)
                    low, high = math.floor(p), math.ceil(p)
                    w = p - low
                    bias = (1 - w) * float(q[b, h, i] @ table[:, low]) + w * float(q[b, h, i] @ table[:, high])
                    logits[b, h, i, j] = s * float(q[b, h, i] @ k[b, h, j]) + bias
    return logits, positions


def layer_logits(layer, q, k, padding):
    """What attention adds up before the mask: the content term s q k^T and CoPE's ``bias`` term."""
    bias = layer.content_bias(q, k, causal=True, key_padding=padding)
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias


# --- the formula -------------------------------------------------------------------------------------------

CASES = {
    # npos_max 3 clamps: 7 keys' gates sum to up to 7
    "clamped": dict(n=7, m=7, npos_max=3, padding=None),
    # npos_max 8 holds every count of 7 keys: no clamp
    "unclamped": dict(n=7, m=7, npos_max=8, padding=None),
    # padded keys (the second row's last two, and one in the middle of the first row)
    "padded": dict(n=6, m=6, npos_max=4, padding=[[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]]),
    # a KV cache: 2 new queries against 5 cached and new keys, padded
    "cached": dict(n=2, m=5, npos_max=5, padding=[[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]),
}


def rows_per_chunk(monkeypatch, rows, batch, m):
    """Make content_bias compute ``rows`` queries at a time for inputs of this batch and key count."""
    monkeypatch.setattr(cope, "CHUNK_ELEMENTS", rows * batch * HEADS * m)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("case", CASES)
def test_logits_match_a_loop_over_queries_keys_and_counted_keys(case, chunked, monkeypatch):
    c = CASES[case]
    if chunked:  # 3 rows at a time: chunks of 3, 3, 1 for 7 queries, of 1 for the cached case's 2
        rows_per_chunk(monkeypatch, 3 if c["n"] > 2 else 1, 2, c["m"])
    layer = random_layer(c["npos_max"])
    torch.manual_seed(1)
    q = torch.randn(2, HEADS, c["n"], HEAD_DIM, dtype=F64) * 2
    k = torch.randn(2, HEADS, c["m"], HEAD_DIM, dtype=F64) * 2
    padding = None if c["padding"] is None else torch.tensor(c["padding"])
    expected, positions = reference_logits(q, k, layer.pos_emb, c["npos_max"], c["padding"])
    ours = layer_logits(layer, q, k, padding)
    assert ours.shape == (2, HEADS, c["n"], c["m"]) and ours.dtype == F64
    seen = ~np.isnan(expected)
    np.testing.assert_allclose(ours.detach().numpy()[seen], expected[seen], rtol=1e-10, atol=1e-10)
    if case in ("clamped", "unclamped"):  # they are what they say: one clamps some counts, the other none
        assert (positions[seen] > c["npos_max"] - 1).any() == (case == "clamped")


def test_padding_keys_get_zero_gates():
    """p_ij - p_i,j+1 is the gate of key j: zero for padding keys, in (0, 1) for the real ones a query sees."""
    layer = random_layer(16)
    torch.manual_seed(2)
    q, k = torch.randn(2, HEADS, 6, HEAD_DIM, dtype=F64), torch.randn(2, HEADS, 6, HEAD_DIM, dtype=F64)
    padding = torch.tensor([[1, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    visible = visible_keys(6, 6, causal=True, key_padding=padding, device="cpu")
    p = layer.positions(q, k, visible)
    gates = p - torch.cat([p[..., 1:], torch.zeros_like(p[..., :1])], dim=-1)
    assert (gates[0, :, 3:, 2] == 0).all() and (gates[1, :, :4, 4:] == 0).all()  # the real queries, padded keys
    assert (gates[visible.expand_as(gates)] > 0).all() and (gates[visible.expand_as(gates)] < 1).all()
    assert (gates[~visible.expand_as(gates)] == 0).all()


def test_attention_logits_term_is_the_sum_of_the_hooks():
    """The eager path's ``bias`` term (analysis reads it) is CoPE's bias, and the probabilities follow it."""
    torch.manual_seed(0)
    m = poslab.build_model({"arch": "decoder", "vocab_size": 20, "d_model": 8, "n_heads": 2, "n_layers": 1,
                            "max_seq_len": 8, "attn_backend": "eager",
                            "positional": {"name": "cope", "options": {"init_std": 0.5}}}).eval()
    cache = ActivationCache(["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.logits.*"])
    with torch.no_grad():
        m(torch.randint(0, 20, (2, 6)), capture=cache)
    layer = m.model.layer_positional[0]
    q, k = cache["blocks.0.attn.q"], cache["blocks.0.attn.k"]
    torch.testing.assert_close(cache["blocks.0.attn.logits.bias"],
                               layer.content_bias(q, k, causal=True, key_padding=None))
    assert cache["blocks.0.attn.logits.bias"].abs().max() > 0.1


# --- gradients ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_attention_gradcheck_through_q_k_v_and_the_table(chunked, monkeypatch):
    """The whole attention (softmax over content + CoPE bias, a padded row) in float64: the gradient reaches q
    and k through both the content term and the gates, and E through z = q E. Random inputs keep p off the
    integers, where floor and ceil jump. Chunked: 2 queries at a time, each chunk recomputed in backward."""
    if chunked:
        rows_per_chunk(monkeypatch, 2, 2, 5)
    layer = random_layer(4)
    torch.manual_seed(3)
    q, k, v = (torch.randn(2, HEADS, 5, HEAD_DIM, dtype=F64, requires_grad=True) for _ in range(3))
    table = layer.pos_emb.detach().clone().requires_grad_()
    padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])

    def attention(q, k, v, table):
        bias = with_table(layer, table, lambda: layer.content_bias(q, k, causal=True, key_padding=padding))
        return attend({"content": (q, k)}, v, scale=1 / math.sqrt(HEAD_DIM), causal=True, biases={"bias": bias},
                      key_padding=padding)[0]

    out = attention(q, k, v, table)
    grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k, v, table))
    assert all(g.abs().max() > 1e-3 for g in grads)
    assert gradcheck(attention, (q, k, v, table))


def test_chunks_give_the_whole_bias_and_its_gradients_in_less_memory(monkeypatch):
    """Rows in chunks of 5 (the last of 3), recomputed in backward: the same bias and gradients as the whole
    (n, m) at once, to float32's rounding; without gradients the chunks are computed once."""
    layer = cope_layer(npos_max=16, init_std=0.5, max_seq_len=32)
    torch.manual_seed(4)
    q, k = (torch.randn(3, HEADS, 23, HEAD_DIM, requires_grad=True) for _ in range(2))
    weights = torch.randn(3, HEADS, 23, 23)

    def bias_and_grads():
        bias = layer.content_bias(q, k, causal=True, key_padding=None)
        return (bias, *torch.autograd.grad((bias * weights).sum(), (q, k, layer.pos_emb)))

    whole = bias_and_grads()
    calls = []
    rows_per_chunk(monkeypatch, 5, 3, 23)
    bias = CoPELayer._bias
    monkeypatch.setattr(CoPELayer, "_bias", lambda self, q, *rest: calls.append(q.shape[-2]) or bias(self, q, *rest))
    chunked = bias_and_grads()
    # each chunk once forward, once again in backward (where autograd reaches the last chunk first)
    assert calls[:5] == [5, 5, 5, 5, 3] and sorted(calls[5:]) == [3, 5, 5, 5, 5]
    for ours, reference in zip(chunked, whole):
        torch.testing.assert_close(ours, reference)
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(layer.content_bias(q, k, causal=True, key_padding=None), whole[0])
    assert calls == [5, 5, 5, 5, 3]


def with_table(layer, table, fn):
    """fn() with ``table`` (a tensor gradcheck can perturb) in place of the layer's E."""
    saved = layer._parameters["pos_emb"]
    layer._parameters["pos_emb"] = table
    try:
        return fn()
    finally:
        layer._parameters["pos_emb"] = saved


def test_the_zero_table_starts_as_nope_and_still_learns():
    """The paper's init: E = 0 whatever the model's normal init, so the logits are NoPE's; its gradient is not
    zero, so the first step moves it."""
    config = {"arch": "decoder", "vocab_size": 20, "d_model": 16, "n_heads": 2, "n_layers": 2, "max_seq_len": 12,
              "init_std": 0.5}
    torch.manual_seed(0)
    nope = poslab.build_model({**config, "positional": {"name": "nope"}}).eval()
    cope = poslab.build_model({**config, "positional": {"name": "cope"}}).eval()
    tables = [p for name, p in cope.named_parameters() if name.endswith("pos_emb")]
    assert len(tables) == 2 and all(t.shape == (8, 12) and (t == 0).all() for t in tables)
    assert cope.load_state_dict(nope.state_dict(), strict=False).unexpected_keys == []
    ids = torch.randint(0, 20, (2, 10))
    torch.testing.assert_close(cope(ids).logits, nope(ids).logits)
    cope(ids, labels=ids).loss.backward()
    assert all(t.grad is not None and t.grad.abs().max() > 1e-4 for t in tables)


# --- what CoPE is for --------------------------------------------------------------------------------------

MARKED = [0, 3, 4, 9, 11, 12, 17]  # irregular: counts, not distances


def marked_qk(n=20, sharpness=200.0):
    """q, k (1, 1, n, 4) float64 whose gates are 1 on the MARKED keys and 0 on the others (sigmoid(+-200)), for
    every query: q = (a, b, 0, 0), k = (+-1, 0, 0, 0) with a = 2 * sharpness (s = 1/2)."""
    q = torch.zeros(1, 1, n, 4, dtype=F64)
    q[..., 0], q[..., 1] = 2 * sharpness, 1000.0
    k = torch.zeros(1, 1, n, 4, dtype=F64)
    k[..., 0] = -1.0
    k[0, 0, MARKED, 0] = 1.0
    return q, k


def test_positions_count_the_marked_tokens_between_key_and_query():
    q, k = marked_qk()
    n = q.shape[2]
    layer = cope_layer(npos_max=n, max_seq_len=n).double()
    p = layer.positions(q, k, visible_keys(n, n, causal=True, key_padding=None, device="cpu"))[0, 0]
    for i in range(n):
        for j in range(i + 1):
            assert p[i, j].item() == pytest.approx(sum(1 for t in MARKED if j <= t <= i), abs=1e-12), (i, j)


def test_a_head_can_attend_to_the_second_marked_token_back():
    """With E[1, 2] = 1 (and b = 1000 in q), keys counted at p = 2 get +1000: among them the marked one wins on
    content, so every query attends to the second-to-last marked token at or before it, however far back."""
    q, k = marked_qk()
    n = q.shape[2]
    layer = cope_layer(npos_max=8, max_seq_len=n).double()
    with torch.no_grad():
        layer.pos_emb[1, 2] = 1.0
    logits = layer_logits(layer, q, k, None)[0, 0]
    logits = logits.masked_fill(~visible_keys(n, n, causal=True, key_padding=None, device="cpu")[0, 0], -math.inf)
    for i in range(n):
        before = [t for t in MARKED if t <= i]
        if len(before) >= 2:
            assert logits[i].argmax().item() == before[-2], i


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 9), extra=st.integers(0, 3), seed=st.integers(0, 10_000), data=st.data())
def test_positions_never_grow_toward_the_query_and_count_at_most_the_keys(n, extra, seed, data):
    """For a fixed query, p_ij is non-increasing in j, in [0, i - j + 1] for the keys it sees, and the clamp
    holds; with a KV cache (m = n + extra) and any padding."""
    m = n + extra
    padding = torch.tensor([data.draw(st.lists(st.integers(0, 1), min_size=m, max_size=m))])
    npos_max = data.draw(st.integers(1, 12))
    layer = cope_layer(npos_max=npos_max)
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, HEADS, n, HEAD_DIM, generator=g) * 3, torch.randn(1, HEADS, m, HEAD_DIM, generator=g) * 3
    visible = visible_keys(n, m, causal=True, key_padding=padding, device="cpu", q_offset=extra)
    p = layer.positions(q, k, visible)
    assert (p[..., :-1] >= p[..., 1:]).all() and (p >= 0).all() and (p <= npos_max - 1).all()
    span = (torch.arange(n)[:, None] + extra - torch.arange(m)[None, :] + 1).clamp(min=0)  # i - j + 1
    assert (p <= span + 1e-5).all()


# --- caching, dtypes, models -------------------------------------------------------------------------------

def test_decoding_with_a_cache_matches_the_full_forward_with_clamping_and_padding():
    """Each new query's gates see every cached key; npos_max 3 clamps most counts of 10 tokens."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    m = poslab.build_model({"arch": "decoder", "vocab_size": 20, "d_model": 16, "n_heads": 2, "n_layers": 2,
                            "max_seq_len": 16, "positional": {"name": "cope", "options": {"npos_max": 3,
                                                                                        "init_std": 0.5}}}).eval()
    ids = torch.randint(1, 20, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        full = m(ids, attention_mask=mask).logits
        cache = DynamicCache()
        steps = [m(ids[:, :4], attention_mask=mask[:, :4], cache=cache).logits]
        steps += [m(ids[:, i:i + 1], attention_mask=mask[:, :i + 1], cache=cache).logits for i in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1)[mask.bool()], full[mask.bool()], atol=1e-5, rtol=1e-4)


def test_bias_is_fp32_from_a_bf16_model_and_counts_past_bf16s_integers():
    """Gates of 1 on 600 keys: a bf16 cumulative sum would stop telling counts apart at 256."""
    layer = cope_layer(npos_max=1024, max_seq_len=1024).to(torch.bfloat16)
    n = 600
    q = torch.zeros(1, 1, n, HEAD_DIM, dtype=torch.bfloat16)
    q[..., 0] = 100.0
    k = torch.zeros(1, 1, n, HEAD_DIM, dtype=torch.bfloat16)
    k[..., 0] = 1.0  # s q.k = 50: every gate is 1 in fp32
    bias = layer.content_bias(q, k, causal=True, key_padding=None)
    assert bias.dtype == torch.float32
    p = layer.positions(q.float(), k.float(), visible_keys(n, n, causal=True, key_padding=None, device="cpu"))
    assert torch.equal(p[0, 0, -1], torch.arange(n, 0, -1, dtype=torch.float32))
    assert cope_layer().double().content_bias(q.double(), k.double(), causal=True, key_padding=None).dtype == F64


def test_a_meta_device_model_materialises_and_plans(monkeypatch):
    """from_pretrained's path and --plan's: forward on the meta device reads no values. The FLOP count is the
    standard one (6 n M + 12 L n^2 d) plus CoPE's two matmuls per layer, q k^T for the gates (2 n^2 d) and q E
    (2 n d npos_max), forward and backward (x 3), chunked or not (no recomputation counted)."""
    config = {"arch": "decoder", "vocab_size": 30, "d_model": 16, "n_heads": 2, "n_layers": 2, "max_seq_len": 12,
              "positional": {"name": "cope", "options": {"init_std": 0.5}}}
    torch.manual_seed(0)
    reference = poslab.build_model(config).eval()
    with torch.device("meta"):
        model = poslab.build_model(config)
    assert model(torch.zeros(1, 5, dtype=torch.long, device="meta")).logits.shape == (1, 5, 30)
    model.to_empty(device="cpu")
    model.init_weights()
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 30, (2, 20))  # past max_seq_len: counts clamp at npos_max - 1
    torch.testing.assert_close(model.eval()(ids).logits, reference(ids).logits)

    n, width, layers_, npos = 10, 16, 2, 12
    matmul = sum(p.numel() for name, p in reference.named_parameters()
                 if p.dim() == 2 and name != "model.embed.weight" and not name.endswith("pos_emb"))
    parameters, flops = planning._count(json.dumps(config, sort_keys=True), n)
    assert parameters == reference.num_parameters()
    extra = 3 * layers_ * (2 * n * n * width + 2 * n * width * npos)
    assert flops == 6 * n * matmul + 12 * layers_ * n * n * width + extra
    rows_per_chunk(monkeypatch, 3, 1, n)
    assert planning._count.__wrapped__(json.dumps(config, sort_keys=True), n)[1] == flops


def test_a_tiny_decoder_trains():
    torch.manual_seed(0)
    model = poslab.build_model({"arch": "decoder", "vocab_size": 20, "d_model": 32, "n_layers": 2, "n_heads": 4,
                                "max_seq_len": 16, "positional": {"name": "cope", "options": {"npos_max": 8}}})
    ids = torch.randint(0, 20, (4, 16))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert all((p != 0).any() for name, p in model.named_parameters() if name.endswith("pos_emb"))


# --- options and the registry ------------------------------------------------------------------------------

def test_encoders_refuse_it_in_one_line():
    with pytest.raises(ConfigError) as error:
        poslab.build_model({"arch": "encoder", "vocab_size": 20, "d_model": 8, "n_heads": 2, "n_layers": 1,
                            "positional": {"name": "cope"}})
    assert str(error.value).startswith("cope needs a causal model") and "\n" not in str(error.value)


@pytest.mark.parametrize("options,message", [
    ({"npos_max": 0}, "cope.npos_max must be >= 1 (entries of the position table), got 0"),
    ({"npos_max": -3}, "cope.npos_max must be >= 1"),
    ({"npos_max": 2.5}, "cope.npos_max must be an integer or null, got 2.5"),
    ({"init_std": -0.1}, "cope.init_std must be >= 0 (0 = the paper's zero table), got -0.1"),
    ({"npos": 64}, "unknown option for positional scheme 'cope' 'npos'"),
])
def test_bad_options_rejected_in_one_line(options, message):
    with pytest.raises(ConfigError) as error:
        PositionalConfig("cope", options)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_good_options_and_registry():
    scheme = SCHEMES["cope"]
    assert scheme.name == "cope" and scheme.causal_only and not scheme.bias_only and scheme.relative
    PositionalConfig("cope", {"npos_max": "64", "init_std": "1e-2"})  # YAML 1.1 numbers too
    assert cope_layer().pos_emb.shape == (HEAD_DIM, 8)  # npos_max defaults to max_seq_len
    layers = build_positional(PositionalConfig("cope", {"npos_max": 5}), AttentionGeometry(3, 2, 4, 8, 16, True))[1]
    assert len({id(layer) for layer in layers}) == 3 and all(isinstance(layer, CoPELayer) for layer in layers)
    assert layers[0].pos_emb.shape == (4, 5)


def test_the_bias_stays_fp32_under_bf16_autocast():
    """Training on CUDA runs in bf16 autocast, which would make the gates' matmul, their count and q E bf16."""
    layer = cope_layer(npos_max=1024, init_std=0.5, max_seq_len=1024)
    q, k = torch.randn(1, HEADS, 300, HEAD_DIM), torch.randn(1, HEADS, 300, HEAD_DIM)
    expected = layer.content_bias(q, k, causal=True, key_padding=None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = layer.content_bias(q, k, causal=True, key_padding=None)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, expected)
