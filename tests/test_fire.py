"""FIRE (positional/fire.py): its bias against a plain loop, its two regimes either side of the threshold L,
its gradients, its options, and a model that trains and materialises from the meta device."""
import math

import pytest
import torch

import poslab
from poslab.errors import ConfigError
from poslab.positional import AttentionGeometry, PositionalConfig, build_positional
from poslab.positional.fire import FIREOptions

F64 = torch.float64
HEADS, HIDDEN = 3, 5


def fire_layer(causal=True, **options):
    """One FIRE layer in fp64 with random MLP weights and c = 0.7 (a larger c than 0.1 makes psi's log bend
    within a few positions)."""
    geometry = AttentionGeometry(n_layers=1, n_heads=HEADS, head_dim=4, d_model=4 * HEADS, max_seq_len=8,
                                 causal=causal)
    _, layers = build_positional(PositionalConfig("fire", {"hidden": HIDDEN, "c_init": 0.7, **options}), geometry)
    torch.manual_seed(0)
    layer = layers[0].double()
    with torch.no_grad():
        for p in (layer.w1, layer.b1, layer.w2):
            p.copy_(torch.randn_like(p))
    return layer


def loop_bias(layer, q_pos, k_pos, causal):
    """The paper's formula, pair by pair in Python floats: (batch, heads, n, m) float64."""
    c = abs(layer.c.item())
    multiplier = layer.threshold_multiplier
    threshold = layer.opts.threshold_init * (1.0 if multiplier is None else abs(multiplier.item()))
    w1, b1, w2 = layer.w1.tolist(), layer.b1.tolist(), layer.w2.tolist()
    out = torch.zeros(q_pos.shape[0], HEADS, q_pos.shape[1], k_pos.shape[1], dtype=F64)
    for b in range(q_pos.shape[0]):
        for a, i in enumerate(q_pos[b].tolist()):
            for t, j in enumerate(k_pos[b].tolist()):
                d = i - j
                if causal:
                    x = math.log(c * max(d, 0) + 1)
                else:
                    x = math.copysign(math.log(c * abs(d) + 1), d) if d else 0.0
                x /= math.log(c * max(threshold, i) + 1) + 1e-6
                hidden = [max(w * x + bias, 0.0) for w, bias in zip(w1, b1)]
                for h in range(HEADS):
                    out[b, h, a, t] = sum(v * h_ for v, h_ in zip(w2[h], hidden))
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_bias_matches_a_loop_over_query_key_pairs(causal):
    """n = 3 new queries at offset positions against m = 9 cached keys, one row with a jump in its positions,
    with L = 6.5 so queries sit on both sides of the threshold."""
    layer = fire_layer(causal, threshold_init=6.5)
    q_pos = torch.tensor([[6, 7, 8], [20, 21, 40]])
    k_pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [14, 15, 16, 17, 18, 19, 20, 21, 40]])
    bias = layer.logit_bias(q_pos, k_pos)
    assert bias.shape == (2, HEADS, 3, 9) and bias.dtype == F64
    torch.testing.assert_close(bias, loop_bias(layer, q_pos, k_pos, causal), rtol=1e-12, atol=1e-12)


def test_bias_is_fp32_in_an_fp32_or_bf16_model():
    layer = fire_layer().float()
    pos = torch.arange(4)[None]
    assert layer.logit_bias(pos, pos).dtype == torch.float32
    assert layer.to(torch.bfloat16).logit_bias(pos, pos).dtype == torch.float32


def test_values_at_distance_zero_and_far_away():
    """Distance 0 is input 0 for every query: f(0) = w2 relu(b1). A key at position 0 seen from any query
    past L is input psi(i) / psi(i) = 1, however far: f(1) = w2 relu(w1 + b1), with no table to run out of."""
    layer = fire_layer(threshold_init=4.0)
    at_zero = layer.w2 @ torch.relu(layer.b1)
    at_one = layer.w2 @ torch.relu(layer.w1 + layer.b1)
    queries = torch.tensor([[0, 3, 10, 1000, 10**6]])
    diagonal = layer.logit_bias(queries, queries).diagonal(dim1=-2, dim2=-1)  # (1, heads, 5)
    torch.testing.assert_close(diagonal, at_zero[None, :, None].expand(1, HEADS, 5))
    far = layer.logit_bias(torch.tensor([[10, 1000, 10**6, 10**9]]), torch.tensor([[0]]))[0, :, :, 0]
    torch.testing.assert_close(far, at_one[:, None].expand(HEADS, 4), rtol=1e-5, atol=1e-5)  # 1 less eps / psi(i)


def test_masked_future_keys_are_finite_and_read_as_distance_zero():
    layer = fire_layer()
    bias = layer.logit_bias(torch.tensor([[2]]), torch.tensor([[0, 1, 2, 3, 50]]))[0, :, 0]  # (heads, 5)
    assert torch.isfinite(bias).all()
    torch.testing.assert_close(bias[:, 3:], bias[:, 2:3].expand(HEADS, 2))


def test_relative_below_the_threshold_and_a_ratio_beyond_it():
    """Below L every query is normalised by psi(L): the bias depends on i - j alone. Beyond it a query divides
    by its own psi(i): shifting a pair changes its bias, and the input is psi(i - j) / psi(i)."""
    layer = fire_layer(threshold_init=100.0)
    below = layer.logit_bias(torch.tensor([[10, 20]]), torch.tensor([[4, 14]]))  # both at distance 6
    torch.testing.assert_close(below[..., 0, 0], below[..., 1, 1])
    beyond = layer.logit_bias(torch.tensor([[200, 400]]), torch.tensor([[194, 394]]))
    assert not torch.allclose(beyond[..., 0, 0], beyond[..., 1, 1])
    psi = lambda x: torch.log1p(layer.c * x)  # noqa: E731
    norm = lambda x: psi(x) + 1e-6  # noqa: E731 (the paper's eps in the normaliser)
    inputs = layer.inputs(torch.tensor([[50, 200, 400]]), torch.tensor([[44, 194, 394]]), F64)[0].diagonal()
    torch.testing.assert_close(inputs, torch.cat([psi(6) / norm(100), psi(6) / norm(200), psi(6) / norm(400)]))
    # Bidirectional: the same magnitude either way, the sign telling past from future.
    both = fire_layer(causal=False, threshold_init=100.0).inputs(torch.tensor([[300]]), torch.tensor([[290, 310]]), F64)
    torch.testing.assert_close(both[0, 0, 0], -both[0, 0, 1])
    torch.testing.assert_close(both[0, 0, 0], (psi(10) / norm(300))[0])


@pytest.mark.parametrize("causal", [True, False])
def test_gradients_reach_c_the_threshold_and_the_mlp(causal):
    """gradcheck in fp64 on the bias as a function of every parameter, with queries either side of L = 6.5."""
    layer = fire_layer(causal, threshold_init=6.5)
    names = ["w1", "b1", "w2", "c", "threshold_multiplier"]
    values = tuple(getattr(layer, name).detach().clone().requires_grad_() for name in names)
    q_pos, k_pos = torch.tensor([[3, 6, 9, 12]]), torch.arange(13)[None]

    class Bias(torch.nn.Module):  # functional_call calls forward, which a LayerPositional has none of
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, q, k):
            return self.layer.logit_bias(q, k)

    def bias(*params):
        return torch.func.functional_call(Bias(), {f"layer.{n}": p for n, p in zip(names, params)}, (q_pos, k_pos))

    assert torch.autograd.gradcheck(bias, values)
    grads = torch.autograd.grad((bias(*values) * torch.randn(1, HEADS, 4, 13, dtype=F64)).sum(), values)
    assert all(g.abs().max() > 1e-3 for g in grads)  # a detached parameter would pass gradcheck with zeros


def test_a_frozen_threshold_is_no_parameter_and_gives_the_same_bias():
    learned, frozen = fire_layer(threshold_init=6.5), fire_layer(threshold_init=6.5, learn_threshold=False)
    assert "threshold_multiplier" not in dict(frozen.named_parameters()) and frozen.threshold_multiplier is None
    q_pos, k_pos = torch.tensor([[3, 9]]), torch.arange(10)[None]
    torch.testing.assert_close(frozen.logit_bias(q_pos, k_pos), learned.logit_bias(q_pos, k_pos))


def test_a_learned_threshold_below_one_keeps_position_zero_finite():
    layer = fire_layer(threshold_init=1.0)
    with torch.no_grad():
        layer.threshold_multiplier.fill_(0.1)
    assert torch.isfinite(layer.logit_bias(torch.tensor([[0, 1]]), torch.tensor([[0, 1]]))).all()


@pytest.mark.parametrize("options,message", [
    ({"hidden": 0}, r"fire.hidden must be a positive integer (the MLP's width), got 0"),
    ({"c_init": 0}, r"fire.c_init must be > 0 (psi(x) = log(c x + 1) needs c > 0), got 0"),
    ({"c_init": -0.1}, r"fire.c_init must be > 0 (psi(x) = log(c x + 1) needs c > 0), got -0.1"),
    ({"threshold_init": 0.5}, r"fire.threshold_init must be >= 1 (the floor L of max(L, i); positions start at 0), "
                              r"got 0.5"),
    ({"learn_threshold": "yes"}, r"fire.learn_threshold must be true or false, got 'yes'"),
    ({"hiden": 8}, r"unknown option for positional scheme 'fire' 'hiden'; did you mean 'hidden'? (valid: c_init, "
                   r"hidden, learn_threshold, shared_across_layers, threshold_init)"),
])
def test_bad_options_are_one_line_config_errors(options, message):
    with pytest.raises(ConfigError) as error:
        PositionalConfig("fire", options)
    assert str(error.value) == message


def test_options_defaults_are_the_papers():
    opts = FIREOptions()
    assert (opts.hidden, opts.c_init, opts.threshold_init, opts.learn_threshold) == (32, 0.1, 512.0, True)


def test_a_shared_fire_is_one_module_for_every_layer():
    shared = {"name": "fire", "options": {"shared_across_layers": True}}
    m = poslab.build_model({**CONFIG, "n_layers": 3, "positional": shared})
    per_layer = poslab.build_model({**CONFIG, "n_layers": 3})
    biases = [block.attn.positional for block in m.model.blocks]
    assert biases[0] is biases[1] is biases[2]
    fire_params = sum(p.numel() for p in biases[0].parameters())
    assert m.num_parameters() == per_layer.num_parameters() - 2 * fire_params


CONFIG = {"arch": "decoder", "vocab_size": 30, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 32,
          "positional": {"name": "fire", "options": {"threshold_init": 8.0}}}


def test_a_tiny_fire_decoder_trains():
    torch.manual_seed(0)
    model = poslab.build_model(CONFIG).train()
    ids = torch.randint(0, 30, (4, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        positional = {n: p.grad for n, p in model.named_parameters() if "positional" in n}
        assert len(positional) == 2 * 5 and all(g is not None and torch.isfinite(g).all() for g in positional.values())
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_a_meta_device_model_materialises_and_matches():
    """from_pretrained's path: built on the meta device (where --plan also runs its forward), moved to real
    memory, initialised, then given the saved weights."""
    torch.manual_seed(0)
    reference = poslab.build_model(CONFIG).eval()
    with torch.device("meta"):
        model = poslab.build_model(CONFIG)
    assert model(torch.zeros(1, 5, dtype=torch.long, device="meta")).logits.shape == (1, 5, 30)
    model.to_empty(device="cpu")
    model.init_weights()
    layer = model.model.layer_positional[0]
    assert layer.threshold_multiplier.item() == 1.0 and layer.threshold(torch.float32).item() == 8.0
    assert layer.c.item() == pytest.approx(0.1)
    assert layer.w1.abs().max() <= 1 and layer.w2.abs().max() <= 1 / math.sqrt(32)
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 30, (2, 40))  # past max_seq_len: FIRE has no table
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, reference(ids).logits)
