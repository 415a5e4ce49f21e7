"""Backbones: invariances (hypothesis), Hugging Face round trips, generation, bad input."""
import math
import re
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

import poslab
from poslab.errors import ConfigError, InputError
from poslab.models import DSTGConfig, ModelConfig
from poslab.positional import SCHEMES, PositionalConfig

ALL = sorted(SCHEMES)
RELATIVE = sorted(name for name, scheme in SCHEMES.items() if scheme.relative)  # logits depend only on s - t
ENCODER = [name for name in ALL if not SCHEMES[name].causal_only]  # xPos builds into decoders only
FAST = settings(max_examples=8, deadline=None)


def arch_schemes(schemes):
    """(arch, scheme) pairs: every scheme in a decoder, those that build into encoders in an encoder too."""
    return [("decoder", s) for s in schemes] + [("encoder", s) for s in schemes if s in ENCODER]


def model(arch, scheme, backend="sdpa", seed=0, **extra):
    torch.manual_seed(seed)
    # Zero-initialised T5 buckets and CoPE tables would hide the bias.
    options = {"init_std": 0.5} if scheme in ("t5", "cope") else {}
    if scheme == "pope":
        options = {"delta_init": "uniform"}
    cfg = {"arch": arch, "vocab_size": 30, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64,
           "attn_backend": backend, "positional": {"name": scheme, "options": options}, **extra}
    return poslab.build_model(cfg).eval()


@pytest.mark.parametrize("arch,scheme", arch_schemes(RELATIVE))
@FAST
@given(shift=st.integers(1, 500), n=st.integers(2, 12), data=st.data())
def test_shifting_all_positions_changes_nothing(arch, scheme, shift, n, data):
    m = model(arch, scheme)
    x = torch.tensor([data.draw(st.lists(st.integers(0, 29), min_size=n, max_size=n))])
    pos = torch.arange(n)[None]
    with torch.no_grad():
        torch.testing.assert_close(m(x, position_ids=pos).logits, m(x, position_ids=pos + shift).logits,
                                   rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("scheme", RELATIVE)
def test_scheme_logits_are_shift_invariant(scheme):
    """The scheme's own logit pieces (q.k after its transform, plus its bias) depend on s - t only."""
    from poslab.positional import AttentionGeometry, PositionalConfig, build_positional

    opts = {"init_std": 1.0} if scheme in ("t5", "cope") else {}
    causal = SCHEMES[scheme].causal_only
    _, layers = build_positional(PositionalConfig(scheme, opts), AttentionGeometry(1, 2, 8, 16, 64, causal))
    layer = layers[0]
    q, k = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)

    def logits(pos):
        if layer is None:  # a scheme without layer hooks (NoPE)
            return q @ k.transpose(-1, -2)
        q2, k2 = layer.transform_qk(q, k, pos, pos)
        biases = (layer.logit_bias(pos, pos), layer.content_bias(q2, k2, causal=causal, key_padding=None))
        return q2 @ k2.transpose(-1, -2) + sum(b for b in biases if b is not None)

    pos = torch.arange(6)[None]
    torch.testing.assert_close(logits(pos), logits(pos + 1234), rtol=1e-4, atol=1e-4)


@FAST
@given(perm_seed=st.integers(0, 10_000), n=st.integers(2, 16))
def test_nope_encoder_is_permutation_equivariant(perm_seed, n):
    m = model("encoder", "nope")
    x = torch.randint(0, 30, (2, n), generator=torch.Generator().manual_seed(perm_seed))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(perm_seed + 1))
    with torch.no_grad():
        torch.testing.assert_close(m(x).logits[:, perm], m(x[:, perm]).logits, rtol=1e-5, atol=1e-5)


def test_positional_encoder_is_not_permutation_equivariant():
    m = model("encoder", "learned")
    x = torch.arange(8)[None]
    perm = torch.tensor([1, 0, 2, 3, 4, 5, 6, 7])
    with torch.no_grad():
        assert not torch.allclose(m(x).logits[:, perm], m(x[:, perm]).logits, atol=1e-4)


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@FAST
@given(n=st.integers(2, 20), cut=st.integers(1, 19), seed=st.integers(0, 999))
def test_future_tokens_never_change_earlier_outputs(scheme, backend, n, cut, seed):
    cut = min(cut, n - 1)
    m = model("decoder", scheme, backend)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 30, (1, n), generator=g)
    y = x.clone()
    y[:, cut:] = torch.randint(0, 30, (1, n - cut), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(m(x).logits[:, :cut], m(y).logits[:, :cut], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,scheme", arch_schemes(ALL))
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@FAST
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), seed=st.integers(0, 999))
def test_padding_never_changes_real_outputs(arch, scheme, backend, lengths, seed):
    m = model(arch, scheme, backend)
    g = torch.Generator().manual_seed(seed)
    width = max(lengths) + 3
    batch = torch.randint(0, 30, (len(lengths), width), generator=g)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        padded = m(batch, attention_mask=mask).logits
        for row, length in enumerate(lengths):
            alone = m(batch[row : row + 1, :length]).logits[0]
            torch.testing.assert_close(padded[row, :length], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scheme", ALL)
def test_eager_and_sdpa_agree(scheme):
    for arch in ("decoder", "encoder") if scheme in ENCODER else ("decoder",):
        x = torch.randint(0, 30, (2, 13))
        mask = torch.ones_like(x)
        mask[1, 9:] = 0
        a = model(arch, scheme, "sdpa")(x, attention_mask=mask).logits
        b = model(arch, scheme, "eager")(x, attention_mask=mask).logits
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,scheme", arch_schemes(ALL))
def test_round_trip_through_auto_classes(arch, scheme):
    m = model(arch, scheme, tie_embeddings=(arch == "decoder" and scheme == "rope"))
    x = torch.randint(0, 30, (2, 9))
    head_cls = AutoModelForCausalLM if arch == "decoder" else AutoModelForMaskedLM
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        assert any(f.endswith(".safetensors") for f in __import__("os").listdir(d))
        assert AutoConfig.from_pretrained(d).poslab == m.config.poslab
        loaded = head_cls.from_pretrained(d).eval()
        trunk = AutoModel.from_pretrained(d).eval()
    with torch.no_grad():
        assert torch.equal(m(x).logits, loaded(x).logits)
        assert torch.equal(m.model(x).last_hidden_state, trunk(x).last_hidden_state)


def test_tied_embeddings_share_storage():
    m = model("decoder", "rope", tie_embeddings=True)
    assert m.lm_head.weight.data_ptr() == m.model.embed.weight.data_ptr()
    assert model("decoder", "rope").lm_head.weight.data_ptr() != model("decoder", "rope").model.embed.weight.data_ptr()


def test_tied_embeddings_are_refused_for_encoders():
    """The masked-LM head has its own decoder and bias (NeoBERT's): a tie asked for would be silently ignored,
    while the saved Hugging Face config said tie_word_embeddings."""
    with pytest.raises(ConfigError, match="^tie_embeddings is for decoders"):
        model("encoder", "rope", tie_embeddings=True)


def test_a_preallocated_kv_cache_is_refused():
    """A StaticCache returns all its slots, the empty ones too: attention over them gave other logits than the
    full forward (by up to 0.28), so it is refused; the growing cache generate uses by default matches."""
    from transformers import DynamicCache, StaticCache

    m = model("decoder", "rope")
    ids = torch.randint(0, 30, (1, 8))
    with torch.no_grad():
        full = m(ids).logits
        cache = DynamicCache()
        steps = [m(ids[:, :5], cache=cache).logits, *(m(ids[:, i:i + 1], cache=cache).logits for i in range(5, 8))]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)
        with pytest.raises(InputError, match="not a preallocated one such as StaticCache"):
            m(ids[:, :5], cache=StaticCache(config=m.config, max_cache_len=16))


@pytest.mark.parametrize("scheme", ALL)
def test_decoding_with_a_cache_matches_the_full_forward_after_position_jumps(scheme):
    """Bias schemes (ALiBi, T5) need the cached keys' positions: they were once rebuilt as consecutive ones
    ending before the new token, which after a jump (packed documents, an offset) put every cached key at the
    wrong distance (T5: logits off by 0.07)."""
    from transformers import DynamicCache

    m = model("decoder", scheme)
    ids = torch.randint(0, 30, (2, 8))
    positions = torch.tensor([[0, 1, 2, 3, 10, 11, 0, 1], [5, 6, 7, 8, 9, 40, 41, 42]])
    with torch.no_grad():
        full = m(ids, position_ids=positions).logits
        cache = DynamicCache()
        steps = [m(ids[:, :4], position_ids=positions[:, :4], cache=cache).logits]
        steps += [m(ids[:, i:i + 1], position_ids=positions[:, i:i + 1], cache=cache).logits for i in range(4, 8)]
        # A step without position_ids (one row of positions for the batch) keeps each row's cached ones.
        prompt = DynamicCache()
        m(ids[:, :4], position_ids=positions[:, :4], cache=prompt)
        omitted = m(ids[:, 4:5], cache=prompt).logits
        expected = m(ids[:, :5], position_ids=torch.cat([positions[:, :4], torch.full((2, 1), 4)], 1)).logits
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(omitted, expected[:, -1:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("scheme", ALL)
def test_left_padded_generate_equals_each_prompt_alone(scheme):
    m = model("decoder", scheme)
    g = torch.Generator().manual_seed(1)
    long, short = torch.randint(1, 30, (1, 7), generator=g), torch.randint(1, 30, (1, 4), generator=g)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    out = m.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0], m.generate(long, max_new_tokens=6, do_sample=False, pad_token_id=0)[0])
    assert torch.equal(out[1, 3:], m.generate(short, max_new_tokens=6, do_sample=False, pad_token_id=0)[0])


@pytest.mark.parametrize("scheme", ALL)
def test_generate_is_greedy_decoding(scheme):
    m = model("decoder", scheme)
    prompt = torch.randint(1, 30, (1, 5))  # generate reads a pad_token_id in the prompt as padding
    out = m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    manual = prompt
    with torch.no_grad():
        for _ in range(6):
            manual = torch.cat([manual, m(manual).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, manual)


@pytest.mark.parametrize("mean,std", [(0.0, 0.002), (4.0, 0.2)])
def test_init_follows_normal_mean_std(mean, std):
    m = model("decoder", "nope", init_mean=mean, init_std=std)
    w = torch.cat([m.model.embed.weight.flatten(), m.model.blocks[0].attn.qkv.weight.flatten()])
    assert w.mean().item() == pytest.approx(mean, abs=4 * std / 50)
    assert w.std().item() == pytest.approx(std, rel=0.05)


def test_parameter_counts():
    m = model("decoder", "learned")
    d, v, L, ff = 32, 30, 2, 128
    per_block = 4 * d * d + 2 * d * ff + 2 * d
    assert m.num_parameters() == v * d + 64 * d + L * per_block + d + v * d


def test_sequence_longer_than_learned_table_names_the_limit():
    m = model("decoder", "learned")
    with pytest.raises(InputError, match="64 positions"):
        m(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(InputError, match="^position -1 is negative; the learned position table starts at 0"):
        m(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.tensor([[-1, 0, 1]]))  # was the embedding's IndexError


@pytest.mark.parametrize("cfg,message", [
    ({"d_model": 30, "n_heads": 4}, "n_heads \\(4\\) must divide d_model \\(30\\)"),
    ({"d_model": 36, "n_heads": 4, "positional": {"name": "rope"}}, "rope needs an even number >= 2 of rotating"),
    ({"n_layers": -1}, "n_layers must be a positive integer"),
    ({"vocab_size": 0}, "vocab_size must be a positive integer"),
    ({"arch": "encoder-decoder"}, "unknown arch .encoder-decoder."),
    ({"d_modle": 32}, "did you mean 'd_model'"),
    ({"positional": {"name": "yarn"}}, "valid: " + ", ".join(ALL)),
])
def test_bad_configs_rejected_at_build_time(cfg, message):
    with pytest.raises(ConfigError, match=message):
        poslab.build_model(cfg)


@pytest.mark.parametrize("cfg,message", [
    ({"arch": "encoder", "positional": {"name": "xpos"}}, "^xpos needs a causal model \\(arch: decoder\\)"),
    ({"arch": "encoder", "positional": {"name": "cope"}}, "^cope needs a causal model"),
    ({"arch": "decoder", "positional": {"name": "t5", "options": {"num_buckets": 32, "max_distance": 16}}},
     "^t5.max_distance must exceed the exact range \\(16\\) of 32 causal buckets"),
    ({"arch": "decoder", "attn_backend": "triton", "positional": {"name": "alibi"}},
     "^attn_backend 'triton' runs a scheme's fused kernel, and alibi has none \\(pope has\\)"),
    ({"max_seq_len": 200_000, "positional": {"name": "xpos"}}, "^xpos scales at positions 100000 from their centre"),
])
def test_configs_that_can_never_build_are_refused_when_made(cfg, message):
    """These passed ModelConfig (and a training config holding it) and failed only when the model was built or
    first run; the scheme's own build checks now run on the meta device when the config is made."""
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{**cfg, "positional": PositionalConfig(**cfg["positional"])})
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(cfg)


def test_a_config_check_allocates_nothing():
    """A learned table of 10^12 positions is a config a GPU cannot hold, not one the check may try to allocate."""
    config = ModelConfig.from_dict({"positional": {"name": "learned", "options": {"max_positions": 10**12}}})
    assert config.positional.options["max_positions"] == 10**12


def _mlm_pair(arch: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights twice: dense and sparse prediction."""
    if arch == "dstg":
        cfg = {"arch": "dstg", "vocab_size": 30, "n_layers": 2, "n_heads": 4, "d_ap": 8, "d_sem": 24, "max_seq_len": 64}
    else:
        cfg = {"arch": "encoder", "vocab_size": 30, "d_model": 32, "n_heads": 4, "n_layers": 2,
               "positional": {"name": "learned"}}
    pair = []
    for sparse in (False, True):
        torch.manual_seed(0)
        pair.append(poslab.build_model({**cfg, "sparse_prediction": sparse}).train())
    return pair[0], pair[1]


@pytest.mark.parametrize("arch", ["encoder", "dstg"])
def test_sparse_prediction_keeps_the_loss_and_gradients_and_scores_only_labelled_tokens(arch):
    dense, sparse = _mlm_pair(arch)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 30, (3, 10), generator=g)
    labels = torch.where(torch.rand(3, 10, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels[1, 7:] = -100
    out_dense = dense(ids, attention_mask=mask, labels=labels)
    out_sparse = sparse(ids, attention_mask=mask, labels=labels)
    keep = labels != -100
    assert out_sparse.logits.shape == (int(keep.sum()), 30)
    torch.testing.assert_close(out_sparse.logits, out_dense.logits[keep])
    torch.testing.assert_close(out_sparse.loss, out_dense.loss)
    out_dense.loss.backward()
    out_sparse.loss.backward()
    for (name, a), b in zip(dense.named_parameters(), sparse.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=name)
    # Without labels nothing changes; a batch with no label gives the dense model's NaN and still backpropagates.
    torch.testing.assert_close(sparse(ids).logits, dense(ids).logits)
    sparse.zero_grad(set_to_none=True)
    empty = sparse(ids, labels=torch.full_like(ids, -100))
    assert empty.logits.shape == (0, 30) and torch.isnan(empty.loss)
    (empty.logits.sum() * 0.0).backward()  # what the trainer does for a micro-batch without labels
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in sparse.parameters() if p.requires_grad)


def test_sparse_prediction_is_for_encoders():
    with pytest.raises(ConfigError, match="sparse_prediction is for masked-LM encoders"):
        poslab.build_model({"arch": "decoder", "sparse_prediction": True})
    with pytest.raises(ConfigError, match="sparse_prediction must be true or false"):
        poslab.build_model({"arch": "encoder", "sparse_prediction": "yes"})


DSTG = {"arch": "dstg", "vocab_size": 30, "n_layers": 1, "n_heads": 4, "d_ap": 8, "d_sem": 24, "max_seq_len": 32}


@pytest.mark.parametrize("cls,change,message", [
    (ModelConfig, {"tie_embeddings": "no"}, "tie_embeddings must be true or false, got 'no'"),
    (ModelConfig, {"ffn_hidden": 2.5}, "ffn_hidden must be an integer or null, got 2.5"),
    (ModelConfig, {"init_mean": math.nan}, "init_mean must be a finite number, got nan"),
    (ModelConfig, {"init_std": math.inf}, "init_std must be a finite number, got inf"),
    (ModelConfig, {"pad_token_id": 1.5}, "pad_token_id must be an integer or null, got 1.5"),
    (ModelConfig, {"max_seq_len": True}, "max_seq_len must be an integer, got True"),
    (ModelConfig, {"norm_eps": "small"}, "norm_eps must be a number, got 'small'"),
    (ModelConfig, {"attn_backend": None}, "attn_backend must be a string, got None"),
    (DSTGConfig, {"init_mean": math.nan}, "init_mean must be a finite number, got nan"),
    (DSTGConfig, {"init_std": math.inf}, "init_std must be a finite number, got inf"),
    (DSTGConfig, {"pad_token_id": 1.5}, "pad_token_id must be an integer or null, got 1.5"),
    (DSTGConfig, {"max_seq_len": True}, "max_seq_len must be a positive integer, got True"),
    (DSTGConfig, {"position_start": True}, "position_start must be an integer, got True"),
    (DSTGConfig, {"norm_eps": "small"}, "norm_eps must be a number, got 'small'"),
    (DSTGConfig, {"rp": "t5"}, "rp must be a mapping like {name: t5, options: {}} or null"),
])
def test_model_config_fields_are_type_checked_at_construction(cls, change, message):
    """A wrong type is refused in one line by the dataclass itself, not only by the run config's YAML reader
    (``tie_embeddings: "no"`` used to be accepted, and tied the embeddings)."""
    values = {**(DSTG if cls is DSTGConfig else {}), **change}
    for build in (lambda: cls(**values), lambda: cls.from_dict(values)):
        with pytest.raises(ConfigError, match=re.escape(message)):
            build()


def test_model_config_must_be_a_mapping():
    with pytest.raises(ConfigError, match="model must be a mapping, got list"):
        ModelConfig.from_dict([])
    with pytest.raises(ConfigError, match="dstg model must be a mapping, got str"):
        DSTGConfig.from_dict("dstg")


@pytest.mark.parametrize("config", [None, 3, [1], "decoder", [("arch", "decoder")]])
def test_build_model_takes_a_mapping_or_a_config(config):
    with pytest.raises(ConfigError, match="model config must be a mapping .* or a ModelConfig or DSTGConfig, got"):
        poslab.build_model(config)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "dstg"])
def test_token_ids_outside_the_vocabulary_are_input_errors(arch):
    """The embedding would raise IndexError (on CUDA, a device-side assert that ends the process)."""
    net = poslab.build_model(DSTG if arch == "dstg" else {"arch": arch, "vocab_size": 30, "d_model": 16,
                                                          "n_heads": 2, "n_layers": 1}).eval()
    for ids, seen in (([1, 2, 30], "[1, 30]"), ([-1, 2, 29], "[-1, 29]")):
        with pytest.raises(InputError, match=re.escape(f"token ids must lie in [0, 30) for this model's vocabulary; "
                                                       f"got ids in {seen}")):
            net(torch.tensor([ids]))
    assert net(torch.tensor([[0, 29]])).logits.shape[-1] == 30  # the ends of the range are ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_math_path_is_sdpa_bit_for_bit(dtype):
    """A trained bias (DSTG's, T5's) sends SDPA to its math path on the CPU; attend computes that path itself
    without _safe_softmax's guard. Same output and every gradient, to the bit, with padding and a scale whose
    square root is inexact (1 / sqrt(24))."""
    from poslab.attention.core import attend, mask_bias

    gen = torch.Generator().manual_seed(0)
    b, h, n, d = 3, 2, 17, 24
    q, k, v = (torch.randn(b, h, n, d, generator=gen, dtype=dtype, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, h, n, n, generator=gen, dtype=dtype, requires_grad=True)
    padding = torch.ones(b, n, dtype=torch.long)
    padding[0, -5:] = 0
    grad = torch.randn(b, h, n, d, generator=gen, dtype=dtype)
    mask = mask_bias(n, n, causal=False, key_padding=padding, device="cpu").to(dtype)

    def both(run):
        for t in (q, k, v, bias):
            t.grad = None
        out = run()
        out.backward(grad)
        return [out.detach(), *(t.grad.clone() for t in (q, k, v, bias))]

    ours = both(lambda: attend({"qk": (q, k)}, v, scale=d ** -0.5, causal=False, biases={"rp": bias},
                               key_padding=padding)[0])
    sdpa = both(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias + mask,
                                                                         scale=d ** -0.5))
    assert all(torch.equal(x, y) for x, y in zip(ours, sdpa))


def test_causal_loss_shifts_the_labels_with_the_same_loss_and_gradient_as_shifting_the_logits():
    m = poslab.build_model({"arch": "decoder", "vocab_size": 23, "d_model": 16, "n_layers": 1, "n_heads": 2})
    ids = torch.randint(0, 23, (3, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100
    out = m(ids, labels=labels)
    out.logits.retain_grad()
    out.loss.backward()
    logits = out.logits.detach().requires_grad_()
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    expected.backward()
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=0)
    assert torch.equal(out.logits.grad, logits.grad)


@pytest.mark.parametrize("scheme", ALL)
def test_decoding_after_a_crop_or_without_held_positions_matches_the_full_forward(scheme):
    """Two ways the cached keys' positions are found: a cache cut back (``crop``, speculative decoding) keeps
    the positions of its first keys, and a cache that holds none (filled by other code) is taken to end just
    before the new token, consecutively."""
    from transformers import DynamicCache

    m = model("decoder", scheme)
    ids = torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(3))
    jumps = torch.tensor([[0, 1, 2, 9, 10, 11, 12], [4, 5, 30, 31, 32, 33, 34]])
    with torch.no_grad():
        cache = DynamicCache()
        m(ids[:, :6], position_ids=jumps[:, :6], cache=cache)
        cache.crop(-2)  # keep the first 4 keys
        assert cache.get_seq_length() == 4
        cropped = m(ids[:, 4:5], position_ids=jumps[:, 4:5], cache=cache).logits
        full = m(ids[:, :5], position_ids=jumps[:, :5]).logits[:, -1:]
        torch.testing.assert_close(cropped, full, atol=1e-5, rtol=1e-4)

        start = torch.tensor([[7], [20]])
        consecutive = start + torch.arange(6)
        cache = DynamicCache()
        m(ids[:, :5], position_ids=consecutive[:, :5], cache=cache)
        del cache.poslab_key_positions
        fresh = m(ids[:, 5:6], position_ids=consecutive[:, 5:6], cache=cache).logits
        full = m(ids[:, :6], position_ids=consecutive).logits[:, -1:]
        torch.testing.assert_close(fresh, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["decoder", "encoder"])
def test_a_block_is_pre_norm_attention_then_pre_norm_mlp(arch):
    """x + attn(norm1(x)), then h + mlp(norm2(h)): each sub-layer reads its own normed input, the residual
    stream itself is never normed (checked with non-trivial norm weights)."""
    m = model(arch, "rope")
    block = m.model.blocks[0]
    with torch.no_grad():
        for norm in (block.attn_norm, block.mlp_norm):
            norm.weight.copy_(torch.rand_like(norm.weight) + 0.5)
    x = torch.randn(2, 9, 32) * 3
    pos = torch.arange(9)[None]
    with torch.no_grad():
        h = x + block.attn(block.attn_norm(x), pos)
        expected = h + block.mlp(block.mlp_norm(h))
        torch.testing.assert_close(block(x, pos, None), expected)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), extra=st.integers(0, 4), causal=st.booleans(), data=st.data())
def test_mask_bias_never_masks_a_whole_row(n, extra, causal, data):
    """The CPU math path's plain softmax (attention.core._sdpa_math) relies on it: a row of -inf would be NaN
    there, where SDPA's _safe_softmax gives zeros. Holds for any padding, even a row of padding only, and
    while decoding (m keys, the queries the last n)."""
    from poslab.attention.core import mask_bias

    m = n + extra
    padding = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=m, max_size=m), min_size=1,
                                              max_size=3)))
    mask = mask_bias(n, m, causal=causal, key_padding=padding, device="cpu", q_offset=m - n)
    assert torch.isfinite(mask).any(dim=-1).all()
