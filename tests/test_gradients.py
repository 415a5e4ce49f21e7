"""torch.autograd.gradcheck in float64 on every differentiable CPU piece: PoPE, RoPE, T5, tables, attention, DSTG."""
import math

import pytest
import torch
from torch import nn
from torch.autograd import gradcheck, gradgradcheck

import poslab
from poslab.attention.core import attend
from poslab.functional import pope_attention, pope_frequencies, pope_polar, pope_scores
from poslab.positional import SCHEMES, AttentionGeometry, PositionalConfig, build_positional

F64 = torch.float64
ATOL = 1e-5  # gradcheck's default; every check below also asserts its gradients are far above it


def rand(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=F64).requires_grad_(requires_grad)


def inside_delta(heads, d):
    """A phase bias strictly inside (-2 pi, 0), at least 0.3 from either clamp bound."""
    return (-0.3 - torch.rand(heads, d, dtype=F64) * (2 * math.pi - 0.6)).requires_grad_()


def assert_not_negligible(fn, inputs, floor=100 * ATOL):
    """A check only has teeth if the gradients it compares are large: a random projection of the output
    must have a gradient above ``floor`` with respect to every input, so a detached input (zero
    gradient) or a flipped sign (off by twice the gradient) cannot pass within gradcheck's tolerance."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o * torch.randn_like(o)).sum() for o in outs if o.requires_grad)
    grads = torch.autograd.grad(total, inputs, allow_unused=True)
    for i, g in enumerate(grads):
        assert g is not None and g.abs().max() > floor, f"input {i} gets no (or a negligible) gradient"


def check(fn, inputs, *, grad2=False, **kwargs):
    assert_not_negligible(fn, inputs)
    assert gradcheck(fn, inputs, **kwargs)
    if grad2:
        assert gradgradcheck(fn, inputs, **kwargs)


class Bound(nn.Module):
    """``fn(module, *args)`` as a module, so torch.func.functional_call can swap the module's parameters."""

    def __init__(self, module, fn):
        super().__init__()
        self.module, self.fn = module, fn

    def forward(self, *args):
        return self.fn(self.module, *args)


def of_params(module, names, fn):
    """``fn(module, *args)`` as a function of (the named parameters of ``module``, *args)."""
    bound = Bound(module, fn)

    def call(*tensors):
        params = {f"module.{name}": t for name, t in zip(names, tensors)}
        return torch.func.functional_call(bound, params, tensors[len(names):])
    return call


def geometry(heads=2, head_dim=4, causal=True, max_len=16):
    return AttentionGeometry(1, heads, head_dim, heads * head_dim, max_len, causal)


def layer(name, options=None, **geo):
    return build_positional(PositionalConfig(name, options or {}), geometry(**geo))[1][0].double()


# --- PoPE: the functional form ---------------------------------------------------------------------------

@pytest.mark.parametrize("batched_positions", [False, True])
def test_pope_polar_gradcheck(batched_positions):
    b, h, n, d = 2, 2, 3, 4
    x, bias = rand(b, h, n, d), inside_delta(h, d)
    positions = torch.tensor([[0, 5, 9], [3, 4, 100]]) if batched_positions else torch.tensor([2, 7, 1000])
    theta = pope_frequencies(d).double()
    check(lambda x, bias: pope_polar(x, positions, theta, bias), (x, bias), grad2=True)
    check(lambda x: pope_polar(x, positions, theta), (x,))


def test_pope_scores_gradcheck():
    q, k, delta = rand(1, 2, 3, 4), rand(1, 2, 4, 4), inside_delta(2, 4)
    check(lambda q, k, delta: pope_scores(q, k, delta), (q, k, delta), grad2=True)


@pytest.mark.parametrize("causal", [False, True])
def test_pope_attention_gradcheck(causal):
    """The CPU path: the Cartesian form through SDPA, differentiated in q, k, v and delta."""
    q, k, v, delta = rand(1, 2, 4, 4), rand(1, 2, 4, 4), rand(1, 2, 4, 4), inside_delta(2, 4)
    fn = lambda q, k, v, delta: pope_attention(q, k, v, delta, causal=causal)  # noqa: E731
    check(fn, (q, k, v, delta), fast_mode=True)

    # Every gradient equals that of the written-out polar formula, softmax(a_ts / sqrt(d)) @ v.
    def explicit(q, k, v, delta):
        logits = pope_scores(q, k, delta) / math.sqrt(4)
        if causal:
            logits = logits.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -math.inf)
        return torch.softmax(logits, dim=-1) @ v

    upstream = torch.randn(1, 2, 4, 4, dtype=F64)
    got = torch.autograd.grad((fn(q, k, v, delta) * upstream).sum(), (q, k, v, delta))
    expected = torch.autograd.grad((explicit(q, k, v, delta) * upstream).sum(), (q, k, v, delta))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-10)


# --- PoPE: the layer and its straight-through clamp ----------------------------------------------------------

def test_polar_layer_transform_qk_gradcheck():
    """q, k and raw_delta (inside the clamp range, where the clamp is the identity) through transform_qk,
    with key positions apart from the query positions (a KV-cache layout)."""
    pope = layer("pope", {"delta_init": "uniform"})
    q, k, raw = rand(2, 2, 3, 4), rand(2, 2, 5, 4), inside_delta(2, 4)
    q_pos, k_pos = torch.tensor([[4, 5, 6]]), torch.tensor([[2, 3, 4, 5, 6]])
    fn = of_params(pope, ["raw_delta"], lambda m, q, k: m.transform_qk(q, k, q_pos, k_pos))
    check(lambda raw, q, k: fn(raw, q, k), (raw, q, k), grad2=True)


# Each mixes components inside [-2 pi, 0], above 0 and below -2 pi, all well away from the bounds.
RAW_DELTAS = {
    "inside": [[-0.5, -1.0, -3.0, -6.0], [-0.2, -2.5, -4.0, -5.9]],
    "above": [[0.5, 2.0, 0.1, 7.0], [0.3, 0.2, 1.0, 12.0]],
    "below": [[-7.0, -6.5, -20.0, -6.4], [-9.0, -100.0, -6.5, -7.5]],
    "mixed": [[0.5, -1.0, -7.0, 0.2], [-0.2, -6.5, 3.0, -3.0]],
}


@pytest.mark.parametrize("case", RAW_DELTAS)
def test_delta_clamp_is_straight_through(case):
    """delta = clamp(raw_delta, -2 pi, 0) in value, but its Jacobian w.r.t. raw_delta is the identity
    everywhere, inside the range and outside it (where a plain clamp's would be 0)."""
    pope = layer("pope")
    raw = torch.tensor(RAW_DELTAS[case], dtype=F64, requires_grad=True)
    delta = of_params(pope, ["raw_delta"], lambda m: m.delta)
    assert torch.equal(delta(raw), raw.detach().clamp(-2 * math.pi, 0.0))  # exactly inside the range
    assert torch.equal(delta(raw.float()), raw.detach().float().clamp(-2 * math.pi, 0.0))
    jacobian = torch.autograd.functional.jacobian(delta, raw)
    assert torch.equal(jacobian, torch.eye(raw.numel(), dtype=F64).view(*raw.shape, *raw.shape))


@pytest.mark.parametrize("case", RAW_DELTAS)
def test_delta_gradient_through_keys_is_that_of_the_clamped_delta(case):
    """Downstream, raw_delta gets exactly the gradient the clamped delta would: the key transform's
    gradient w.r.t. raw_delta equals pope_polar's w.r.t. its phase bias at clamp(raw_delta), which
    gradcheck verifies there. Outside the range that gradient is non-zero, so the component can return."""
    pope = layer("pope")
    raw = torch.tensor(RAW_DELTAS[case], dtype=F64, requires_grad=True)
    q, k = rand(1, 2, 3, 4, requires_grad=False), rand(1, 2, 3, 4, requires_grad=False)
    pos = torch.tensor([[0, 1, 2]])
    keys = of_params(pope, ["raw_delta"], lambda m, q, k: m.transform_qk(q, k, pos, pos)[1])
    out = keys(raw, q, k)
    upstream = torch.randn_like(out)
    (got,) = torch.autograd.grad((out * upstream).sum(), raw)

    clamped = raw.detach().clamp(-2 * math.pi, 0.0).requires_grad_()
    theta = pope_frequencies(4).double()
    reference = lambda bias: pope_polar(k, pos, theta, bias)  # noqa: E731
    assert gradcheck(reference, (clamped,))
    torch.testing.assert_close(out, reference(clamped))
    (expected,) = torch.autograd.grad((reference(clamped) * upstream).sum(), clamped)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    assert (got.abs() > 1e-3).all()


# --- RoPE ----------------------------------------------------------------------------------------------

ROPE_OPTIONS = {
    "none": {},
    "linear": {"scaling": "linear", "factor": 2.0},
    "dynamic": {"scaling": "dynamic", "factor": 2.0, "original_max_len": 4},  # positions reach 7 > 4: stretched
    "yarn": {"scaling": "yarn", "factor": 4.0, "original_max_len": 8},  # attention factor != 1
    "half": {"fraction": 0.5},  # channels 4..7 pass through: identity rows of the Jacobian
    "half-yarn": {"fraction": 0.5, "scaling": "yarn", "factor": 4.0, "original_max_len": 8},
}


@pytest.mark.parametrize("scaling", ROPE_OPTIONS)
def test_rope_transform_qk_gradients(scaling):
    """RoPE is linear in q and k: the autograd Jacobian must be the (scaled) rotation itself, built here in
    float64 from the layer's frequencies. transform_qk computes in float32 even for float64 inputs, so the
    Jacobian is compared at float32 tolerance, and gradcheck takes a wide step (exact for a linear map)."""
    rope = layer("rope", ROPE_OPTIONS[scaling], head_dim=8)
    d = 8
    q, k = rand(1, 2, 3, d), rand(1, 2, 4, d)
    q_pos, k_pos = torch.tensor([[5, 6, 7]]), torch.tensor([[4, 5, 6, 7]])
    fn = lambda q, k: rope.transform_qk(q, k, q_pos, k_pos)  # noqa: E731
    check(fn, (q, k), eps=1e-2, atol=1e-4, rtol=1e-3)

    inv_freq, scaling_factor = rope.frequencies(q_pos, k_pos)
    if "yarn" in scaling:
        assert scaling_factor > 1
    r = rope.rotary_dim
    assert r == (d // 2 if "half" in scaling else d)
    for x, pos, index in ((q, q_pos, 0), (k, k_pos, 1)):
        n = x.shape[2]
        angle = pos[0].double()[:, None] * torch.cat([inv_freq, inv_freq]).double()  # (n, r)
        cos, sin = angle.cos() * scaling_factor, angle.sin() * scaling_factor
        # Half-split pairs (i, i + r/2): out_i = x_i cos - x_(i+r/2) sin, out_(i+r/2) = x_(i+r/2) cos + x_i sin;
        # channels r.. are copied.
        half = torch.arange(r // 2)
        rotation = torch.eye(d, dtype=F64).repeat(n, 1, 1)  # (n, d_out, d_in)
        rotation[:, :r, :r] = torch.diag_embed(cos)
        rotation[:, half, half + r // 2] = -sin[:, half]
        rotation[:, half + r // 2, half] = sin[:, half + r // 2]
        jacobian = torch.autograd.functional.jacobian(lambda x: fn(*((x, k) if index == 0 else (q, x)))[index], x)
        for h in range(2):
            for t in range(n):
                torch.testing.assert_close(jacobian[0, h, t, :, 0, h, t, :], rotation[t], rtol=0, atol=2e-6)
        # Nothing leaks between heads or positions.
        mask = torch.zeros_like(jacobian, dtype=torch.bool)
        for h in range(2):
            for t in range(n):
                mask[0, h, t, :, 0, h, t, :] = True
        assert (jacobian[~mask] == 0).all()


# --- T5 relative bias, ALiBi ----------------------------------------------------------------------------

@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("per_head", [True, False])
def test_t5_bias_table_gradcheck(bidirectional, per_head):
    """The learned bucket table, through logit_bias: every (query, key) pair adds its bucket's gradient."""
    t5 = layer("t5", {"num_buckets": 8, "max_distance": 16, "bidirectional": bidirectional, "per_head": per_head})
    table = rand(*t5.weight.shape)
    q_pos, k_pos = torch.tensor([[0, 3, 9], [2, 2, 5]]), torch.tensor([[0, 1, 4, 20], [0, 2, 6, 30]])
    fn = of_params(t5, ["weight"], lambda m: m.logit_bias(q_pos, k_pos))
    check(fn, (table,), grad2=True)


def test_alibi_bias_is_a_constant():
    alibi = layer("alibi")
    pos = torch.tensor([[0, 1, 2, 3]])
    assert not list(alibi.parameters()) and not alibi.logit_bias(pos, pos).requires_grad


# --- attention: the SDPA path, and the eager path against it ------------------------------------------------

def attention_case(case):
    """(function of the differentiable inputs, those inputs) for one ``attend`` configuration."""
    b, h, n, d = 2, 2, 4, 4
    q, k, v = rand(b, h, n, d), rand(b, h, n, d), rand(b, h, n, d)
    pos = torch.arange(n)[None]
    padding = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    if case == "plain":
        return lambda q, k, v, eager=False: attend({"c": (q, k)}, v, scale=0.5, causal=False, eager=eager)[0], (q, k, v)
    if case == "causal":
        return lambda q, k, v, eager=False: attend({"c": (q, k)}, v, scale=0.5, causal=True, eager=eager)[0], (q, k, v)
    if case == "causal_padded_alibi":
        bias = layer("alibi").logit_bias(pos, pos).double()
        return (lambda q, k, v, eager=False: attend({"c": (q, k)}, v, scale=0.5, causal=True, biases={"b": bias},
                                                    key_padding=padding, eager=eager)[0], (q, k, v))
    if case == "padded_t5":
        t5 = layer("t5", {"num_buckets": 8, "max_distance": 16, "init_std": 0.5}, causal=False)
        table = rand(*t5.weight.shape)
        bias = of_params(t5, ["weight"], lambda m: m.logit_bias(pos, pos))
        return (lambda q, k, v, table, eager=False: attend({"c": (q, k)}, v, scale=0.5, causal=False,
                                                           biases={"rp": bias(table)}, key_padding=padding,
                                                           eager=eager)[0], (q, k, v, table))
    if case == "kv_cache":  # 2 queries, the last of 4 keys
        q2 = rand(b, h, 2, d)
        return lambda q, k, v, eager=False: attend({"c": (q, k)}, v, scale=0.5, causal=True, eager=eager)[0], (q2, k, v)
    if case == "two_terms_extra_values":  # DSTG's layout: two q/k pairs, a narrower v and an extra value
        q2, k2, v2 = rand(b, h, n, 6), rand(b, h, n, 6), rand(b, h, n, 3)
        v1 = rand(b, h, n, 2)
        return (lambda q, k, q2, k2, v1, v2, eager=False: attend(
            {"a": (q, k), "b": (q2, k2)}, v1, values={"x": v2}, scale=0.5, causal=False, key_padding=padding,
            eager=eager)[0], (q, k, q2, k2, v1, v2))
    raise ValueError(case)


ATTENTION_CASES = ["plain", "causal", "causal_padded_alibi", "padded_t5", "kv_cache", "two_terms_extra_values"]


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attend_sdpa_gradcheck(case):
    fn, inputs = attention_case(case)
    # A bias that needs a gradient sends SDPA to its composite math path, which can be differentiated twice.
    check(fn, inputs, grad2=case == "padded_t5", fast_mode=True)


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attend_eager_gradients_match_sdpa(case):
    """The eager path computes its logits in float32 whatever the input dtype, so it cannot be gradchecked in
    float64; its gradients must match the SDPA path's (gradchecked above) to float32 precision."""
    fn, inputs = attention_case(case)
    upstream = torch.randn_like(fn(*inputs))
    sdpa = torch.autograd.grad((fn(*inputs) * upstream).sum(), inputs)
    eager = torch.autograd.grad((fn(*inputs, eager=True) * upstream).sum(), inputs)
    for s, e in zip(sdpa, eager):
        assert s.abs().max() > 1e-2
        torch.testing.assert_close(e, s, rtol=1e-4, atol=1e-5)


# --- input positional modules ----------------------------------------------------------------------------

def test_learned_absolute_table_gradcheck():
    table_module = build_positional(PositionalConfig("learned", {"max_positions": 6}), geometry())[0].double()
    x, table = rand(2, 3, 8), rand(6, 8)
    positions = torch.tensor([[0, 1, 2], [2, 2, 5]])  # a repeated position accumulates its rows' gradients
    fn = of_params(table_module, ["weight"], lambda m, x: m(x, positions))
    check(fn, (table, x), grad2=True)


def test_sinusoidal_input_gradient_is_the_token_scale():
    sinusoidal = build_positional(PositionalConfig("sinusoidal"), geometry())[0]
    x = rand(2, 3, 8)
    positions = torch.tensor([[0, 1, 2], [7, 8, 9]])
    check(lambda x: sinusoidal(x, positions), (x,))
    (grad,) = torch.autograd.grad(sinusoidal(x, positions).sum(), x)
    torch.testing.assert_close(grad, torch.full_like(x, math.sqrt(8)))


# --- whole models: the parameters reach the loss ----------------------------------------------------------

# Options that make a scheme's parameters matter at this size (zero-initialised T5 buckets and CoPE tables hide
# the bias).
GRADCHECK_OPTIONS = {"pope": {"delta_init": "uniform"}, "t5": {"num_buckets": 8, "max_distance": 16, "init_std": 0.5},
                     "cope": {"init_std": 0.5}}


def positional_decoder(scheme: str):
    torch.manual_seed(3)
    return poslab.build_model({"arch": "decoder", "vocab_size": 11, "d_model": 8, "n_heads": 2, "n_layers": 2,
                               "max_seq_len": 6, "init_std": 0.5, "attn_backend": "sdpa",
                               "positional": {"name": scheme, "options": GRADCHECK_OPTIONS.get(scheme, {})}})


def positional_parameters(model) -> list[str]:
    return [name for name, _ in model.named_parameters() if "positional" in name]


# Every registered scheme with parameters: a new one is checked without being named here.
WITH_PARAMETERS = [s for s in sorted(SCHEMES) if positional_parameters(positional_decoder(s))]


def test_the_schemes_with_parameters_are_found():
    assert {"pope", "t5", "learned"} <= set(WITH_PARAMETERS)


@pytest.mark.parametrize("scheme", WITH_PARAMETERS)
def test_decoder_positional_parameters_gradcheck(scheme):
    model = positional_decoder(scheme).double().eval()
    params = dict(model.named_parameters())
    ids = torch.tensor([[1, 4, 2, 9, 3], [5, 5, 0, 7, 10]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    for name in positional_parameters(model):
        value = params[name].detach().clone()
        if name.endswith("raw_delta"):  # keep PoPE's delta away from the clamp bounds
            value = value.clamp(-2 * math.pi + 0.3, -0.3)
        value.requires_grad_()
        fn = lambda p: torch.func.functional_call(model, {name: p}, (ids,),  # noqa: E731
                                                  {"attention_mask": mask}).logits
        check(fn, (value,), fast_mode=True)


def dstg_model(backend="sdpa"):
    torch.manual_seed(2)
    return poslab.build_model({
        "arch": "dstg", "vocab_size": 13, "n_layers": 2, "n_heads": 2, "d_ap": 4, "d_sem": 8, "max_seq_len": 6,
        "init_std": 0.5, "attn_backend": backend,
        "rp": {"name": "t5", "options": {"init_std": 0.5, "num_buckets": 8, "max_distance": 16}},
    }).double().eval()


def dstg_inputs():
    b, n = 2, 5
    positions = torch.arange(1, n + 1)[None]
    padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    return rand(b, n, 4), rand(b, n, 8), positions, padding


def test_dstg_attention_gradcheck():
    """Both streams' inputs and the relative-bias table through DSTG attention (one softmax, padding)."""
    trunk = dstg_model().model
    x_ap, x_sem, positions, padding = dstg_inputs()
    table = trunk.layer_positional[0].weight.detach().clone().requires_grad_()

    attention = of_params(trunk, ["layer_positional.0.weight"],
                          lambda m, x_ap, x_sem: m.blocks[0].attn({"ap": x_ap, "sem": x_sem}, positions, padding))

    def fn(table, x_ap, x_sem):
        out = attention(table, x_ap, x_sem)
        return out["ap"], out["sem"]

    check(fn, (table, x_ap, x_sem), fast_mode=True)


def test_dstg_attention_is_one_softmax_over_all_logit_terms():
    """Gradients of DSTG attention equal those of the written-out formula, softmax(ap + sem + rp logits)
    applied to each stream's values, for the inputs and every weight (SDPA in float64); the eager path
    agrees to float32 precision."""
    trunk = dstg_model().model
    attn, rp = trunk.blocks[0].attn, trunk.layer_positional[0]
    x_ap, x_sem, positions, padding = dstg_inputs()
    x = {"ap": x_ap, "sem": x_sem}
    heads, dim = attn.n_heads, attn.head_dim

    def reference():
        logits, values = 0, {}
        for s, xs in x.items():
            q, k, v = attn.qkv[s](xs).split([heads * dim, heads * dim, attn.widths[s]], dim=-1)
            q, k, v = (t.view(*xs.shape[:2], heads, -1).transpose(1, 2) for t in (q, k, v))
            logits = logits + q @ k.transpose(-1, -2) / math.sqrt(dim)
            values[s] = v
        logits = logits + rp.logit_bias(positions, positions)
        logits = logits.masked_fill(~padding.bool()[:, None, None, :] & ~torch.eye(5, dtype=torch.bool), -math.inf)
        probs = torch.softmax(logits, dim=-1)
        return {s: attn.out[s]((probs @ v).transpose(1, 2).reshape(*x[s].shape)) for s, v in values.items()}

    wrt = [x_ap, x_sem, *attn.parameters(), *rp.parameters()]
    upstream = {s: torch.randn_like(xs) for s, xs in x.items()}

    def grads(out):
        return torch.autograd.grad(sum((out[s] * upstream[s]).sum() for s in out), wrt)

    expected = grads(reference())
    got = grads(attn(x, positions, padding))
    attn.backend = "eager"
    eager = grads(attn(x, positions, padding))
    for e, g, ge in zip(expected, got, eager):
        assert e.abs().max() > 1e-2
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ge, e, rtol=1e-4, atol=1e-5)


def test_dstg_position_tables_gradcheck():
    """The learned AP table and each layer's T5 table reach the trunk's output (fast mode: many inputs)."""
    trunk = dstg_model().model
    ids = torch.tensor([[1, 4, 2, 9, 3], [5, 5, 0, 7, 12]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    names = ["ap_embed.weight", "layer_positional.0.weight", "layer_positional.1.weight"]
    params = dict(trunk.named_parameters())
    values = tuple(params[n].detach().clone().requires_grad_() for n in names)

    def fn(*tensors):
        out = torch.func.functional_call(trunk, dict(zip(names, tensors)), (ids,), {"attention_mask": mask})
        return out.last_hidden_state

    check(fn, values, fast_mode=True)
