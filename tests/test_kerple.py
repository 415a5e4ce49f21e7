"""KERPLE: the log and power kernels against a loop over positions, gradients to r1 and r2, the clamps after an
optimizer pushes past them, the paper's init, options, a tiny decoder that learns, and DSTG's relative term."""
import json
import math

import numpy as np
import pytest
import torch

import poslab
from poslab.errors import ConfigError
from poslab.experiments import plan as planning
from poslab.models import ActivationCache
from poslab.models.dstg_config import RP_SCHEMES
from poslab.positional import SCHEMES, AttentionGeometry, PositionalConfig, build_positional
from poslab.positional.kerple import MAX_POWER, MIN_VALUE, KERPLEBias

F64 = torch.float64


def layers(options=None, heads=4, n_layers=1, causal=True):
    geometry = AttentionGeometry(n_layers, heads, 8, heads * 8, 64, causal)
    return build_positional(PositionalConfig("kerple", options or {}), geometry)[1]


def reference(variant, r1, r2, q_pos, k_pos):
    """The kernel written out entry by entry in numpy float64: (batch, heads, n, m)."""
    batch, n, m = q_pos.shape[0], q_pos.shape[1], k_pos.shape[1]
    out = np.zeros((batch, len(r1), n, m))
    for b in range(batch):
        for h in range(len(r1)):
            for i in range(n):
                for j in range(m):
                    d = abs(int(k_pos[b, j]) - int(q_pos[b, i]))
                    out[b, h, i, j] = (-r1[h] * math.log(1 + r2[h] * d) if variant == "log"
                                       else -r1[h] * d ** r2[h])
    return out


def set_params(layer, r1, r2):
    with torch.no_grad():
        layer.raw_r1.copy_(torch.as_tensor(r1))
        layer.raw_r2.copy_(torch.as_tensor(r2))


# --- the formula -------------------------------------------------------------------------------------------

POSITIONS = {
    # a decoder's square block: queries and keys at 0..n-1, each row shifted (packed documents, offsets)
    "causal": lambda: (torch.arange(7)[None] + torch.tensor([[0], [5]]),) * 2,
    # an encoder sees keys on both sides: the same positions, both triangles used
    "bidirectional": lambda: (torch.tensor([[3, 1, 4, 1, 5, 9, 2]]), torch.tensor([[2, 7, 1, 8, 2, 8, 1]])),
    # a KV cache: 2 new queries against 9 cached keys (n < m)
    "cached": lambda: (torch.tensor([[7, 8]]), torch.arange(9)[None]),
}


@pytest.mark.parametrize("variant", ["log", "power"])
@pytest.mark.parametrize("heads", [1, 3, 8])
@pytest.mark.parametrize("positions", POSITIONS)
def test_bias_matches_a_loop_over_positions(variant, heads, positions):
    q_pos, k_pos = POSITIONS[positions]()
    layer = layers({"variant": variant}, heads=heads, causal=positions != "bidirectional")[0].double()
    gen = np.random.default_rng(heads)
    r1 = gen.uniform(0.05, 2.0, heads)
    r2 = gen.uniform(0.05, 2.0 if variant == "power" else 1.5, heads)
    set_params(layer, r1, r2)
    bias = layer.logit_bias(q_pos, k_pos)
    assert bias.shape == (q_pos.shape[0], heads, q_pos.shape[1], k_pos.shape[1]) and bias.dtype == F64
    np.testing.assert_allclose(bias.detach().numpy(), reference(variant, r1, r2, q_pos, k_pos), rtol=1e-12, atol=0)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_bias_is_fp32_from_a_bf16_model_and_relative(variant):
    layer = layers({"variant": variant})[0]
    q_pos, k_pos = torch.arange(5)[None], torch.arange(5)[None]
    fp32 = layer.logit_bias(q_pos, k_pos)
    layer.to(torch.bfloat16)
    assert layer.logit_bias(q_pos, k_pos).dtype == torch.float32 and fp32.dtype == torch.float32
    # zero on the diagonal, the same for positions shifted together, symmetric in k - q
    assert torch.equal(fp32.diagonal(dim1=-2, dim2=-1), torch.zeros(1, 4, 5))
    layer.float()
    torch.testing.assert_close(layer.logit_bias(q_pos + 100, k_pos + 100), layer.logit_bias(q_pos, k_pos))
    torch.testing.assert_close(fp32, fp32.transpose(-1, -2))


# --- gradients and clamps ----------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["log", "power"])
def test_gradcheck_reaches_r1_and_r2(variant):
    layer = layers({"variant": variant}, heads=3)[0].double()
    q_pos, k_pos = torch.tensor([[0, 3, 5]]), torch.arange(6)[None]  # distance 0 included: pow's gradient there

    class Bias(torch.nn.Module):  # functional_call substitutes parameters in a module's forward
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self):
            return self.layer.logit_bias(q_pos, k_pos)

    wrapper = Bias()
    r1 = torch.tensor([0.3, 1.0, 1.7], dtype=F64, requires_grad=True)
    r2 = torch.tensor([0.2, 0.9, 1.6], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: torch.func.functional_call(wrapper, {"layer.raw_r1": a, "layer.raw_r2": b}, ()), (r1, r2))


@pytest.mark.parametrize("variant", ["log", "power"])
def test_clamps_hold_after_an_optimizer_step_and_gradients_still_flow(variant):
    layer = layers({"variant": variant}, heads=2)[0]
    q_pos = k_pos = torch.arange(6)[None]
    opt = torch.optim.SGD(layer.parameters(), lr=100.0)
    # One step pushes r1 below zero and r2 (the power kernel's exponent) past both of its bounds.
    (layer.raw_r1.sum() - layer.raw_r2[0] + layer.raw_r2[1]).backward()
    opt.step()
    assert layer.raw_r1.min() < 0 and layer.raw_r2[1] < 0 and layer.raw_r2[0] > MAX_POWER
    assert torch.equal(layer.r1, torch.full((2,), MIN_VALUE))
    top = MAX_POWER if variant == "power" else layer.raw_r2[0].item()
    assert torch.equal(layer.r2, torch.tensor([top, MIN_VALUE]))
    bias = layer.logit_bias(q_pos, k_pos)
    assert torch.isfinite(bias).all() and (bias <= 0).all()
    expected = reference(variant, layer.r1.tolist(), layer.r2.tolist(), q_pos, k_pos)
    np.testing.assert_allclose(bias.detach().numpy(), expected, rtol=1e-5, atol=1e-6)
    # The clamp is straight-through: the gradient still reaches the raw parameters, so a head can come back.
    opt.zero_grad()
    bias.sum().backward()
    assert (layer.raw_r1.grad != 0).all() and layer.raw_r2.grad[1] != 0


def test_default_init_is_the_papers_uniform_draw_per_layer():
    torch.manual_seed(0)
    log, power = layers({}, heads=64, n_layers=2), layers({"variant": "power"}, heads=64, n_layers=1)
    assert log[0] is not log[1] and not torch.equal(log[0].raw_r1, log[1].raw_r1)
    for layer, (r1_max, r2_max) in ((log[0], (2.0, 1.0)), (power[0], (1.0, 2.0))):
        for raw, top in ((layer.raw_r1, r1_max), (layer.raw_r2, r2_max)):
            assert raw.min() >= 0 and raw.max() <= top and raw.max() > top / 2  # U(0, top)
    fixed = layers({"r1_init": 1.0, "r2_init": 0.5}, heads=3)[0]
    fixed.init_weights(0.0, 0.02)  # the model's normal(mean, std) init does not apply
    assert torch.equal(fixed.raw_r1, torch.ones(3)) and torch.equal(fixed.raw_r2, torch.full((3,), 0.5))


# --- options -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,message", [
    ({"variant": "exp"}, "kerple.variant must be one of log, power, got 'exp'"),
    ({"r1_init": 0.0}, "kerple.r1_init must be >= 0.01 (r1 and r2 are used as at least 0.01), got 0.0; omit it "
                       "for the paper's uniform init"),
    ({"r2_init": -1}, "kerple.r2_init must be >= 0.01 (r1 and r2 are used as at least 0.01), got -1; omit it "
                      "for the paper's uniform init"),
    ({"variant": "power", "r2_init": 2.5}, "kerple.r2_init must be <= 2.0 for variant power (the exponent of "
                                           "|k - q|), got 2.5"),
    ({"r1_init": "big"}, "kerple.r1_init must be a number or null, got 'big'"),
    ({"slope": 1.0}, "unknown option for positional scheme 'kerple' 'slope'"),
])
def test_bad_options_rejected_in_one_line(options, message):
    with pytest.raises(ConfigError) as error:
        PositionalConfig("kerple", options)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_good_options_and_registry():
    assert SCHEMES["kerple"].name == "kerple" and SCHEMES["kerple"].bias_only and SCHEMES["kerple"].relative
    PositionalConfig("kerple", {"variant": "power", "r1_init": "1e-1", "r2_init": 2})  # YAML 1.1 numbers too
    assert isinstance(layers({"r2_init": 3.0})[0], KERPLEBias)  # the log kernel's rate has no upper bound


# --- models ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["log", "power"])
def test_tiny_decoder_trains(variant):
    torch.manual_seed(0)
    model = poslab.build_model({"arch": "decoder", "vocab_size": 20, "d_model": 32, "n_layers": 2, "n_heads": 4,
                                "max_seq_len": 16, "positional": {"name": "kerple", "options": {"variant": variant}}})
    ids = torch.randint(0, 20, (4, 16))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        if not losses[1:]:
            grads = {n: p.grad for n, p in model.named_parameters() if "raw_r" in n}
            assert len(grads) == 4 and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
                                           for g in grads.values())
        opt.step()
    assert losses[-1] < losses[0] - 0.1


def test_dstg_takes_kerple_as_its_relative_term():
    assert "kerple" in RP_SCHEMES
    torch.manual_seed(0)
    m = poslab.build_model({"arch": "dstg", "vocab_size": 40, "n_layers": 2, "n_heads": 4, "d_ap": 8, "d_sem": 24,
                            "max_seq_len": 32, "attn_backend": "eager",
                            "rp": {"name": "kerple", "options": {"variant": "power"}}}).eval()
    rp = [module for module in m.modules() if isinstance(module, KERPLEBias)]
    assert len(rp) == 2 and rp[0] is not rp[1]
    ids = torch.randint(0, 40, (2, 9))
    cache = ActivationCache("blocks.*.attn.logits.rp")
    with torch.no_grad():
        m(ids, capture=cache)
    pos = torch.arange(9)[None]
    for i, layer in enumerate(rp):
        torch.testing.assert_close(cache[f"blocks.{i}.attn.logits.rp"], layer.logit_bias(pos, pos).expand(2, -1, -1, -1))


def test_plan_counts_a_kerple_model_on_the_meta_device():
    """--plan runs forward on the meta device: the bias must not read values there. The count is the standard
    one (tests/test_plan.py): 6 n M + 12 L n^2 d."""
    n_layers, width, n = 2, 64, 24
    config = {"arch": "decoder", "vocab_size": 100, "d_model": width, "n_layers": n_layers, "n_heads": 4,
              "max_seq_len": 64, "mlp": "swiglu", "positional": {"name": "kerple", "options": {"variant": "power"}}}
    model = poslab.build_model(config)
    matmul = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and name != "model.embed.weight")
    parameters, flops = planning._count(json.dumps(config, sort_keys=True), n)
    assert parameters == model.num_parameters()
    assert flops == 6 * n * matmul + 12 * n_layers * n * n * width


def test_activation_checkpointing_keeps_the_gradients():
    """The clamp writes nothing, so a block run again in the backward pass gives the same r1 and r2 gradients."""
    torch.manual_seed(0)
    model = poslab.build_model({"arch": "decoder", "vocab_size": 20, "d_model": 32, "n_layers": 2, "n_heads": 4,
                                "max_seq_len": 16, "positional": {"name": "kerple"}}).train()
    ids = torch.randint(0, 20, (2, 12))

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if "raw_r" in name}

    plain = grads()
    with pytest.warns(FutureWarning):  # transformers 5 renamed it activation_checkpointing_enable
        model.gradient_checkpointing_enable()
    again = grads()
    assert plain.keys() == again.keys() and len(plain) == 4
    for name in plain:
        torch.testing.assert_close(again[name], plain[name], rtol=1e-6, atol=1e-7)
