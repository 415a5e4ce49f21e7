"""PoPE: the explicit formula, the eager path, the SDPA path and pope_attention agree."""
import math

import pytest
import torch

import poslab
from poslab.errors import InputError
from poslab.functional import pope_attention, pope_frequencies, pope_polar, pope_scores
from poslab.models import ActivationCache
from poslab.positional import AttentionGeometry, PositionalConfig, build_positional


def explicit_attention(q, k, v, delta, causal, scale):
    """softmax(scale * a_ts) @ v with a_ts from the explicit loop-free formula, in fp64; the n queries are
    the last n of the m keys' positions."""
    n, m = q.shape[-2], k.shape[-2]
    logits = scale * pope_scores(q.double(), k.double(), delta, q_positions=torch.arange(m - n, m))
    if causal:
        logits = logits.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1 + m - n), float("-inf"))
    return torch.softmax(logits, -1) @ v.double()


def test_scores_equal_the_sum_over_components():
    q, k = torch.randn(1, 2, 5, 6), torch.randn(1, 2, 7, 6)
    delta = -torch.rand(2, 6) * 2 * math.pi
    theta = pope_frequencies(6)
    got = pope_scores(q, k, delta)
    sp = torch.nn.functional.softplus
    for h, t, s in [(0, 0, 0), (1, 4, 2), (0, 3, 6), (1, 1, 5)]:
        position = t + 2  # the 5 queries are the last 5 of the 7 keys' positions, as pope_attention has them
        expected = sum(sp(q[0, h, t, c]) * sp(k[0, h, s, c]) * math.cos((s - position) * theta[c] + delta[h, c])
                       for c in range(6))
        assert got[0, h, t, s].item() == pytest.approx(expected.item(), rel=1e-5)


def test_cartesian_form_equals_polar_score():
    q, k = torch.randn(2, 3, 9, 8, dtype=torch.float64), torch.randn(2, 3, 9, 8, dtype=torch.float64)
    delta = -torch.rand(3, 8, dtype=torch.float64) * 2 * math.pi
    theta = pope_frequencies(8)
    pos = torch.arange(9)
    cart = pope_polar(q, pos, theta) @ pope_polar(k, pos, theta, delta).transpose(-1, -2)
    torch.testing.assert_close(cart, pope_scores(q, k, delta), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d,n", [(8, 1), (16, 9), (64, 100)])
def test_the_layer_matches_x_transformers_polar_embedding(d, n):
    """x-transformers' PolarEmbedding (one delta shared by its layers, the same frequencies and clamp) is an
    implementation written apart from ours: a PoPE layer's q~.k~ logits equal its own, delta included."""
    from x_transformers.x_transformers import PolarEmbedding, apply_polar_pos_emb

    heads = 3
    theirs = PolarEmbedding(d, heads)
    _, layers = build_positional(PositionalConfig("pope"), AttentionGeometry(1, heads, d, heads * d, 128, True))
    ours = layers[0]
    with torch.no_grad():  # its bias_uniform_init fails in 2.31 (an in-place op on a leaf): drawn here
        theirs.learned_bias.uniform_(-2 * math.pi, 0.0)
        ours.raw_delta.copy_(theirs.learned_bias[:, 0])
    q, k = torch.randn(2, heads, n, d), torch.randn(2, heads, n, d)
    pos = torch.arange(n)[None] + 7
    freqs, bias = theirs(pos)  # (1, n, d) and (heads, 1, d): its attention adds them for the keys
    expected = apply_polar_pos_emb(q, freqs) @ apply_polar_pos_emb(k, freqs + bias).transpose(-1, -2)
    q2, k2 = ours.transform_qk(q, k, pos, pos)
    torch.testing.assert_close(q2 @ k2.transpose(-1, -2), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,m,d", [(1, 1, 8), (17, 17, 16), (64, 64, 32), (3, 6, 8), (1, 9, 16)])
def test_pope_attention_matches_explicit(causal, n, m, d):
    """n < m: the queries are the last n positions (new tokens after m - n cached ones), as the causal mask
    places them; they once took positions 0..n-1 against that mask."""
    q, k, v = torch.randn(2, 3, n, d), torch.randn(2, 3, m, d), torch.randn(2, 3, m, d)
    delta = -torch.rand(3, d) * 2 * math.pi
    got = pope_attention(q, k, v, delta, causal=causal)
    expected = explicit_attention(q, k, v, delta, causal, 1 / math.sqrt(d))
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5)


def test_pope_attention_refuses_more_queries_than_keys():
    with pytest.raises(InputError, match="at most as many queries as keys"):
        pope_attention(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8))


@pytest.mark.parametrize("q,k,v,delta,message", [
    ((2, 8), (2, 8), (2, 8), None, "takes 4-D q, k, v"),
    ((1, 2, 3, 8), (1, 2, 3, 4), (1, 2, 3, 8), None, "needs q .b, h, n, d., k .b, h, m, d."),
    ((1, 2, 3, 8), (1, 3, 3, 8), (1, 3, 3, 8), None, "needs q .b, h, n, d., k .b, h, m, d."),
    ((1, 2, 3, 8), (1, 2, 3, 8), (1, 2, 4, 8), None, "and v .b, h, m, dv."),
    ((1, 2, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8), (8,), r"delta is one phase per head and channel, \(2, 8\); got \(8,\)"),
    ((1, 2, 3, 8), (1, 2, 3, 8), (1, 2, 3, 8), (3, 8), r"\(2, 8\); got \(3, 8\)"),
])
def test_pope_attention_names_shapes_that_do_not_fit(q, k, v, delta, message):
    """They were an IndexError or a broadcasting RuntimeError from deep inside."""
    delta = None if delta is None else torch.zeros(delta)
    with pytest.raises(InputError, match=message):
        pope_attention(torch.randn(q), torch.randn(k), torch.randn(v), delta)


def pope_model(backend, delta_init="uniform", **options):
    torch.manual_seed(1)
    return poslab.build_model({"arch": "decoder", "vocab_size": 40, "d_model": 32, "n_heads": 2, "n_layers": 2,
                               "attn_backend": backend,
                               "positional": {"name": "pope", "options": {"delta_init": delta_init, **options}}})


def test_model_eager_and_sdpa_paths_agree():
    x = torch.randint(0, 40, (3, 21))
    sdpa, eager = pope_model("sdpa"), pope_model("eager")
    torch.testing.assert_close(sdpa(x).logits, eager(x).logits, rtol=1e-5, atol=1e-5)


def test_model_logits_use_the_explicit_score():
    """The eager path's content term equals scale * sum_c mu_q mu_k cos((s-t) theta_c + delta_c)."""
    model = pope_model("eager")
    x = torch.randint(0, 40, (2, 11))
    cache = ActivationCache(["blocks.0.attn_out", "blocks.0.attn.logits.content"])
    model(x, capture=cache)
    attn = model.model.blocks[0].attn
    h = model.model.blocks[0].attn_norm(model.model.embed(x))
    q, k, _ = attn.qkv(h).view(2, 11, 3, 2, 16).permute(2, 0, 3, 1, 4)
    delta = model.model.layer_positional[0].delta
    expected = pope_scores(q, k, delta) / math.sqrt(16)
    torch.testing.assert_close(cache["blocks.0.attn.logits.content"], expected.float(), rtol=1e-4, atol=1e-5)


def test_delta_gets_gradients_and_stays_clamped():
    model = pope_model("sdpa", delta_init="zero")
    layer = model.model.layer_positional[0]
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    x = torch.randint(0, 40, (4, 16))
    for _ in range(3):
        opt.zero_grad()
        model(x, labels=x).loss.backward()
        assert layer.raw_delta.grad is not None
        opt.step()
    assert layer.raw_delta.grad.abs().sum() > 0
    assert (layer.delta >= -2 * math.pi).all() and (layer.delta <= 0).all()
    with torch.no_grad():
        layer.raw_delta.fill_(5.0)
    assert (layer.delta == 0).all()
    with torch.no_grad():
        layer.raw_delta.fill_(-9.0)
    assert torch.allclose(layer.delta, torch.full_like(layer.delta, -2 * math.pi))


def test_delta_past_a_bound_can_come_back():
    """The clamp is straight-through: a component pushed above 0 still gets its gradient, so a step the other
    way brings it back inside (a plain clamp would leave it frozen at 0)."""
    layer = pope_model("sdpa", delta_init="zero").model.layer_positional[0]
    with torch.no_grad():
        layer.raw_delta.fill_(0.1)
    assert (layer.delta == 0).all()
    layer.delta.sum().backward()
    assert (layer.raw_delta.grad == 1).all()
    with torch.no_grad():
        layer.raw_delta -= 0.3 * layer.raw_delta.grad
    assert torch.allclose(layer.delta, torch.full_like(layer.delta, -0.2))


def test_uniform_delta_init_lies_in_range():
    delta = pope_model("sdpa", "uniform").model.layer_positional[1].delta
    assert (delta <= 0).all() and (delta >= -2 * math.pi).all() and delta.std() > 0.5


def test_fixed_delta_stays_fixed_through_from_pretrained(tmp_path):
    """learn_delta: false (the paper's "no delta" ablation, or a frozen random delta) survives save_pretrained and
    from_pretrained: Hugging Face's loader rebuilds every loaded parameter as trainable, so a frozen parameter
    would come back learning."""
    from transformers import AutoModelForCausalLM

    model = pope_model("sdpa", "uniform", learn_delta=False)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for before, after in zip(model.model.layer_positional, loaded.model.layer_positional):
        assert torch.equal(after.delta, before.delta) and not after.delta.requires_grad
    assert not any("delta" in name for name, p in loaded.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("magnitude,by_hand", [("relu", lambda x: max(x, 0.0)), ("identity", lambda x: x),
                                                ("softplus", lambda x: math.log1p(math.exp(x)))])
def test_ablation_magnitudes_enter_the_score_and_the_model(magnitude, by_hand):
    """The paper's ablations: ReLU or no softplus (the raw component) in place of softplus, each computed by hand
    in one component's term, then through a model's eager logits and its SDPA path."""
    q, k = torch.randn(1, 2, 5, 6, dtype=torch.float64), torch.randn(1, 2, 7, 6, dtype=torch.float64)
    delta = -torch.rand(2, 6, dtype=torch.float64) * 2 * math.pi
    theta = pope_frequencies(6).double()
    got = pope_scores(q, k, delta, magnitude=magnitude)
    for h, t, s in [(0, 0, 0), (1, 4, 2), (0, 3, 6)]:
        expected = sum(by_hand(q[0, h, t, c].item()) * by_hand(k[0, h, s, c].item())
                       * math.cos((s - t - 2) * theta[c].item() + delta[h, c].item()) for c in range(6))
        assert got[0, h, t, s].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    pos = torch.arange(7)
    cart = pope_polar(q, pos[2:], theta, magnitude=magnitude) @ pope_polar(k, pos, theta, delta,
                                                                          magnitude=magnitude).transpose(-1, -2)
    torch.testing.assert_close(cart, pope_scores(q, k, delta, magnitude=magnitude))  # queries at the last 5 positions

    model, sdpa = pope_model("eager", magnitude=magnitude), pope_model("sdpa", magnitude=magnitude)
    x = torch.randint(0, 40, (2, 11))
    cache = ActivationCache(["blocks.0.attn.logits.content", "blocks.0.attn.freq_norms.q"])
    logits = model(x, capture=cache).logits
    torch.testing.assert_close(sdpa(x).logits, logits, rtol=1e-5, atol=1e-5)
    attn = model.model.blocks[0].attn
    mq, mk, _ = attn.qkv(model.model.blocks[0].attn_norm(model.model.embed(x))).view(2, 11, 3, 2, 16).permute(
        2, 0, 3, 1, 4)
    delta = model.model.layer_positional[0].delta
    torch.testing.assert_close(cache["blocks.0.attn.logits.content"],
                               (pope_scores(mq, mk, delta, magnitude=magnitude) / math.sqrt(16)).float(),
                               rtol=1e-4, atol=1e-5)
    # Frequency usage reads magnitudes: a negative raw component is a positive magnitude at the opposite phase.
    norms = {"relu": mq.relu(), "identity": mq.abs(), "softplus": torch.nn.functional.softplus(mq)}[magnitude]
    torch.testing.assert_close(cache["blocks.0.attn.freq_norms.q"], norms.float(), rtol=1e-5, atol=1e-6)


def test_an_unknown_magnitude_is_refused_in_one_line():
    from poslab.errors import ConfigError

    with pytest.raises(ConfigError, match="pope.magnitude must be one of softplus, relu, identity, got 'tanh'"):
        pope_model("sdpa", magnitude="tanh")


def test_ablation_magnitudes_survive_from_pretrained_and_leave_the_fused_kernel(tmp_path, monkeypatch):
    """The option is saved with the model. The fused kernel computes softplus itself: for inputs it would take
    (a CUDA tensor, here a stand-in), softplus PoPE calls it and the ablations go the Cartesian way."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    import poslab.kernels as kernels
    pytest.importorskip("triton")
    import poslab.kernels.pope_flash as flash

    model = pope_model("auto", magnitude="relu")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.model.layer_positional[0].magnitude == "relu"
    x = torch.randint(0, 40, (1, 9))
    torch.testing.assert_close(loaded(x).logits, model(x).logits)

    monkeypatch.setattr(kernels, "fused_pope_supports", lambda q, *kv, starts=(): True)
    monkeypatch.setattr(flash, "launch_checked", lambda *args, **kwargs: "fused")
    cuda_like, pos = SimpleNamespace(is_cuda=True, shape=(1, 2, 9, 16), device="cpu"), torch.arange(9)[None]
    for magnitude, expected in [("softplus", "fused"), ("relu", None), ("identity", None)]:
        layer = pope_model("auto", magnitude=magnitude).model.layer_positional[0]
        assert layer.fused_attention(cuda_like, None, None, pos, pos, causal=True, scale=1.0,
                                     key_padding=None) == expected, magnitude


def _right_padding(lengths, n):
    return (torch.arange(n)[None] < torch.tensor(lengths)[:, None]).long()


@pytest.mark.parametrize("q_pos,k_pos,padding,expected", [
    (torch.arange(9)[None], None, None, ((0, 0), None)),
    (torch.arange(7, 16)[None], None, _right_padding([9, 4], 9), ((7, 7), [9, 4])),
    (torch.arange(3, 5)[None], torch.arange(5)[None], None, ((3, 0), None)),  # new queries after cached keys
    (torch.arange(9)[None], None, 1 - _right_padding([9, 4], 9), None),  # left padding
    (torch.arange(9)[None], None, _right_padding([9, 0], 9), ((0, 0), [9, 0])),
    (torch.arange(9)[None].expand(2, 9), None, None, None),  # a row per batch entry
    (torch.tensor([[0, 1, 2, 4]]), None, None, None),
    (torch.arange(9)[None], torch.tensor([[0, 1, 1, 2, 3, 4, 5, 6, 7]]), None, None),
    (torch.arange(0, 18, 2)[None], None, None, None),
    (torch.arange(3)[None], None, torch.tensor([[1, 1, 2]]), None),  # would count 4 valid keys of 3
    (torch.arange(3)[None], None, torch.tensor([[1.0, 1.0, 0.0]]), ((0, 0), [2])),
    (torch.arange(3)[None], None, torch.tensor([[True, False, False]]), ((0, 0), [1])),
])
def test_the_kernel_takes_positions_that_count_up_and_right_padding(q_pos, k_pos, padding, expected):
    from poslab.positional.pope import _launch_plan

    plan = _launch_plan(q_pos, q_pos if k_pos is None else k_pos, padding)
    if expected is None:
        assert plan is None
    else:
        assert plan.starts == expected[0]
        assert (plan.seq_lens is None if expected[1] is None
                else plan.seq_lens.dtype == torch.int32 and plan.seq_lens.tolist() == expected[1])


def test_a_forward_reads_positions_and_padding_once_for_every_layer(monkeypatch):
    """Reading positions and padding costs a host sync: the layers of one forward share the answer, and a new
    tensor or one changed in place is read again. Inference tensors, which have no version, are read each time."""
    from types import SimpleNamespace

    import poslab.kernels as kernels
    pytest.importorskip("triton")
    import poslab.kernels.pope_flash as flash
    import poslab.positional.pope as pope

    reads, launches = [], []
    read = pope._read_plan
    monkeypatch.setattr(pope, "_read_plan", lambda *args: reads.append(1) or read(*args))
    monkeypatch.setattr(kernels, "fused_pope_supports", lambda q, *kv, starts=(): True)
    monkeypatch.setattr(flash, "launch_checked", lambda *args, **kwargs: launches.append(kwargs) or "fused")
    layers = poslab.build_model({"arch": "decoder", "vocab_size": 40, "d_model": 32, "n_heads": 2, "n_layers": 4,
                                 "positional": {"name": "pope"}}).model.layer_positional
    q = SimpleNamespace(is_cuda=True, shape=(2, 2, 9, 16), device="cpu")

    def forward(pos, padding):
        return [layer.fused_attention(q, None, None, pos, pos, causal=True, scale=1.0, key_padding=padding)
                for layer in layers]

    pos, padding = torch.arange(3, 12)[None], _right_padding([9, 5], 9)
    assert forward(pos, padding) == ["fused"] * 4 and len(reads) == 1
    assert forward(pos, padding) == ["fused"] * 4 and len(reads) == 1  # the same tensors: the same answer
    assert [kw["q_start"].tolist() for kw in launches] == [[3, 3]] * 8
    assert all(kw["seq_lens"].tolist() == [9, 5] for kw in launches)
    padding[1, 7] = 1  # changed in place: read again, and now a hole the kernel cannot take
    assert forward(pos, padding) == [None] * 4 and len(reads) == 2
    assert forward(torch.arange(3, 12)[None], None) == ["fused"] * 4 and len(reads) == 3
    assert forward(pos, _right_padding([9], 9)) == [None] * 4  # padding rows for another batch than q's
    with torch.inference_mode():
        pos = torch.arange(9)[None]
        assert forward(pos, None) == ["fused"] * 4 and len(reads) == 8


def test_the_kernel_is_offered_only_k_and_v_of_qs_dtype_and_width(monkeypatch):
    """pope_attention takes a v of another width than q and k (SDPA does); on CUDA it was sent to the kernel,
    which refuses one, so a call that works on the CPU failed on a GPU."""
    pytest.importorskip("triton")
    from poslab.kernels import fused_pope_supports

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernel's CPU mode: supported without a GPU
    q = torch.randn(1, 2, 4, 32)
    assert fused_pope_supports(q) and fused_pope_supports(q, q, q)
    assert not fused_pope_supports(q, q, torch.randn(1, 2, 4, 16))
    assert not fused_pope_supports(q, q.half(), q)
    assert pope_attention(q, q, torch.randn(1, 2, 4, 16)).shape == (1, 2, 4, 16)


def test_long_positions_keep_phase_precision():
    """Phases are formed in fp32 even for bf16 inputs, so position 10^6 still rotates correctly."""
    theta = pope_frequencies(8)
    x = torch.randn(1, 1, 2, 8)
    pos = torch.tensor([10**6, 10**6 + 1])
    got = pope_polar(x.bfloat16(), pos, theta).float()
    ref = pope_polar(x.double(), pos.double(), theta.double())
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref, rtol=0.05, atol=0.05)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here, so the triton backend runs")
def test_forced_triton_backend_without_cuda_is_a_clear_error():
    from poslab.errors import ConfigError

    model = pope_model("triton")
    with pytest.raises(ConfigError, match="attn_backend 'triton' needs a CUDA GPU"):
        model(torch.randint(0, 40, (1, 8)))


def test_forced_triton_backend_decodes_and_is_inspected_through_sdpa(monkeypatch):
    """A KV cache holds transformed keys, which the kernel never makes, and captures need probabilities or q and
    k: with "triton" forced, generate() and output_attentions raised that the GPU lacked Triton, on a GPU too.
    The fused call is stood in for by its Cartesian result where the kernel would run (no GPU here); it is
    asked for the full forward only, and generation matches the SDPA model's."""
    from poslab.functional import pope_polar
    from poslab.positional.pope import PolarLayer

    calls = []

    def fused(self, q, k, v, q_pos, k_pos, *, causal, scale, key_padding):
        calls.append(q.shape[-2])
        qc, kc = pope_polar(q, q_pos, self.theta), pope_polar(k, k_pos, self.theta, self.delta)
        return torch.nn.functional.scaled_dot_product_attention(qc, kc, v, is_causal=causal, scale=scale)

    monkeypatch.setattr(PolarLayer, "fused_attention", fused)
    forced, sdpa = pope_model("triton").eval(), pope_model("sdpa").eval()
    ids = torch.randint(0, 40, (1, 5))
    torch.testing.assert_close(forced(ids).logits, sdpa(ids).logits, rtol=1e-5, atol=1e-5)
    assert calls == [5, 5]
    calls.clear()
    kept = forced.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(kept, sdpa.generate(ids, max_new_tokens=4, do_sample=False))
    assert calls == []  # every step decoded through the cache
    assert len(forced(ids, output_attentions=True).attentions) == 2 and calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel's own tests cover CPU)")
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-4), ("bf16", 3e-2)])
def test_cuda_auto_backend_runs_the_fused_kernel_like_sdpa(monkeypatch, precision, tol):
    """On CUDA "auto" takes the fused kernel (padded batch included); its logits at real tokens and every
    parameter's gradient equal the SDPA path's, in fp32 and under bf16 autocast as the trainer runs."""
    pytest.importorskip("triton")
    import poslab.kernels.pope_flash as flash

    calls = []
    kernel = flash.pope_flash_attention
    monkeypatch.setattr(flash, "pope_flash_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    x = torch.randint(0, 40, (3, 21), device="cuda")
    mask = (torch.arange(21, device="cuda")[None] < torch.tensor([[21], [15], [9]], device="cuda")).long()
    labels = x.masked_fill(mask == 0, -100)
    results = []
    for backend in ("auto", "sdpa"):
        model = pope_model(backend).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = model(x, attention_mask=mask, labels=labels)
        out.loss.backward()
        grads = {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.float()[mask.bool()], grads))
    assert len(calls) == 2  # one per layer, in the auto model only
    (fused_logits, fused_grads), (sdpa_logits, sdpa_grads) = results
    torch.testing.assert_close(fused_logits, sdpa_logits, rtol=tol, atol=tol)
    assert fused_grads.keys() == sdpa_grads.keys()
    for name, grad in sdpa_grads.items():
        error = (fused_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12)
        assert error < tol, f"{name}: relative gradient error {error:.2e}"


@pytest.mark.parametrize("d,base", [(8, 10000.0), (6, 500.0)])
def test_frequencies_are_one_per_component_base_to_minus_c_over_d(d, base):
    """theta_c = base^(-c/d), c = 0..d-1 (papers/pope.md: d frequencies, not RoPE's d/2 pairs at base^(-2i/d)),
    computed here by hand; a model's layer and the score use exactly these."""
    expected = torch.tensor([base ** (-c / d) for c in range(d)])
    torch.testing.assert_close(pope_frequencies(d, base), expected, rtol=1e-6, atol=0)
    # The score of one component between a query at t and a key at s: mu_q mu_k cos((s - t) theta_c + delta_c).
    q, k = torch.full((1, 1, 1, d), -30.0), torch.full((1, 1, 1, d), -30.0)
    q[..., 1], k[..., 1] = 2.0, 3.0  # softplus(-30) ~ 1e-13: only component 1 contributes
    delta = torch.zeros(1, d)
    delta[0, 1] = -0.4
    got = pope_scores(q.double(), k.double(), delta, base=base, q_positions=torch.tensor([2]),
                      k_positions=torch.tensor([7]))
    sp = lambda x: math.log1p(math.exp(x))  # noqa: E731
    assert got.item() == pytest.approx(sp(2.0) * sp(3.0) * math.cos(5 * base ** (-1 / d) - 0.4), rel=1e-6)
    layer = poslab.build_model({"arch": "decoder", "vocab_size": 10, "d_model": 2 * d, "n_heads": 2, "n_layers": 1,
                                "positional": {"name": "pope", "options": {"base": base}}}).model.layer_positional[0]
    torch.testing.assert_close(layer.theta, expected, rtol=1e-6, atol=0)
