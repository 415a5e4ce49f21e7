"""The models among Hugging Face tools: Trainer with gradient accumulation, resize_token_embeddings,
from_pretrained overrides and attn_implementation, output_hidden_states / output_attentions / return_dict,
and one-line refusals of the inputs the models do not take."""
import dataclasses
import json
import tempfile

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import poslab
from poslab.errors import ConfigError, InputError

ARCHS = ["decoder", "encoder", "dstg"]


def build(arch: str, seed: int = 0, **extra):
    torch.manual_seed(seed)
    if arch == "dstg":
        cfg = {"arch": "dstg", "vocab_size": 40, "d_ap": 8, "d_sem": 24, "n_heads": 2, "n_layers": 2,
               "max_seq_len": 32, **extra}
    else:
        cfg = {"arch": arch, "vocab_size": 40, "d_model": 32, "n_heads": 2, "n_layers": 2, "max_seq_len": 32,
               "positional": {"name": "rope"}, **extra}
    return poslab.build_model(cfg)


def auto_class(arch: str):
    return AutoModelForCausalLM if arch == "decoder" else AutoModelForMaskedLM


def batches(arch: str, count: int = 4, n: int = 12):
    """Samples whose numbers of scored labels differ, so a per-batch mean would weigh tokens unequally."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(count):
        ids = torch.randint(1, 40, (n,), generator=g)
        labels = ids.clone()
        if arch == "decoder":
            labels[: 2 * i] = -100
        else:
            keep = torch.rand(n, generator=g) < 0.2 + 0.2 * i
            keep[0] = True
            labels[~keep] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def token_mean_loss(model, samples) -> torch.Tensor:
    """Every scored token of every sample weighed alike: the loss an accumulated step should see."""
    total, count = 0.0, 0
    for s in samples:
        out = model(s["input_ids"][None], labels=s["labels"][None], num_items_in_batch=1)
        scored = s["labels"][1:] if model.config.is_decoder else s["labels"]
        total, count = total + out.loss, count + int((scored != -100).sum())
    return total / count


@pytest.mark.parametrize("arch", ARCHS)
def test_num_items_in_batch_turns_the_mean_into_a_sum_over_that_count(arch):
    m = build(arch).eval()
    ids = torch.randint(1, 40, (2, 10))
    labels = ids.clone()
    labels[0, :4] = -100
    mean = m(ids, labels=labels).loss
    scored = int((labels[:, 1:] if arch == "decoder" else labels).ne(-100).sum())
    torch.testing.assert_close(m(ids, labels=labels, num_items_in_batch=scored).loss, mean)
    torch.testing.assert_close(m(ids, labels=labels, num_items_in_batch=4 * scored).loss, mean / 4)


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_gradient_accumulation_weighs_every_token_alike(arch, tmp_path):
    """Trainer passes num_items_in_batch to models whose forward takes **kwargs and then no longer divides by
    the accumulation steps: a model that swallowed the count reported (and stepped with) N x the loss. The
    same with Trainer's activation checkpointing."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    # transformers renamed the argument (the old name warns that it goes in v6); 5.17 knows only the old one.
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"

    class Logs(TrainerCallback):
        def __init__(self):
            self.records = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.records.append(logs)

    samples = batches(arch)
    with torch.no_grad():
        expected = token_mean_loss(build(arch).eval(), samples)
    seen = []
    for batch_size, accumulation, recompute in [(4, 1, False), (2, 2, False), (1, 4, False), (2, 2, True)]:
        logs = Logs()
        args = TrainingArguments(output_dir=str(tmp_path / f"{batch_size}{recompute}"),
                                 per_device_train_batch_size=batch_size, **{checkpointing: recompute},
                                 gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=0.0,
                                 logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
                                 max_grad_norm=1e9, dataloader_num_workers=0)
        Trainer(model=build(arch), args=args, train_dataset=samples, callbacks=[logs]).train()
        seen.append(next(r for r in logs.records if "loss" in r))
    for record in seen:
        assert record["loss"] == pytest.approx(float(expected), rel=1e-4)
        assert record["grad_norm"] == pytest.approx(seen[0]["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("arch,scheme", [("decoder", "pope"), ("decoder", "t5"), ("encoder", "alibi"), ("dstg", None)])
def test_activation_checkpointing_recomputes_the_blocks_and_keeps_the_gradients(arch, scheme):
    """gradient_checkpointing_enable() (Trainer's activation checkpointing) was refused: the models said they
    did not support it. Each block now runs again in the backward pass, with the same loss and gradients; with a
    KV cache or a capture the blocks run once (a recompute would extend the cache, or record, a second time)."""
    extra = {} if scheme is None else {"positional": {"name": scheme}}
    model = build(arch, n_layers=3, **extra).train()
    ids = torch.randint(1, 40, (2, 12))
    calls = []

    def counted(forward):
        def run(*args, **kwargs):
            calls.append(1)
            return forward(*args, **kwargs)
        return run

    for block in model.model.blocks:  # the recompute calls forward again (without the module's hooks)
        block.forward = counted(block.forward)

    def step(**kwargs):
        model.zero_grad()
        calls.clear()
        out = model(ids, labels=ids, **kwargs)
        out.loss.backward()
        return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain, grads = step()
    assert len(calls) == 3
    with pytest.warns(FutureWarning):  # transformers 5 renamed it activation_checkpointing_enable; both work
        model.gradient_checkpointing_enable()
    recomputed, again = step()
    assert len(calls) == 6
    assert recomputed.loss.item() == plain.loss.item() and again.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(again[name], grad, rtol=1e-6, atol=1e-7, msg=name)
    _, again = step(output_hidden_states=True)
    assert len(calls) == 3
    if arch == "decoder":
        out, _ = step(use_cache=True)
        assert len(calls) == 3 and out.past_key_values.get_seq_length() == 12
    model.eval()
    with torch.no_grad():
        model(ids)
    model.activation_checkpointing_disable()
    step()
    assert len(calls) == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_resize_token_embeddings_resizes_both_ends_and_reloads(arch, tmp_path):
    m = build(arch).eval()
    ids = torch.randint(0, 40, (1, 9))
    with torch.no_grad():
        before = m(ids).logits
    m.resize_token_embeddings(48)
    head = m.get_output_embeddings()
    assert m.get_input_embeddings().weight.shape[0] == 48 and head.weight.shape[0] == 48
    if arch != "decoder":
        assert head.bias.shape == (48,)
    assert m.config.vocab_size == 48 and m.config.spec.vocab_size == 48
    with torch.no_grad():
        after = m(ids).logits
        torch.testing.assert_close(after[..., :40], before)  # the old tokens' rows are kept
        m(torch.tensor([[47, 3]]))  # the new ids embed
    m.save_pretrained(tmp_path)
    again = auto_class(arch).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, after)


def test_a_refused_resize_leaves_the_model_as_it_was():
    m = build("decoder", pad_token_id=39)
    with pytest.raises(ConfigError, match="pad_token_id must lie in"):
        m.resize_token_embeddings(32)
    assert m.get_input_embeddings().num_embeddings == 40 == m.lm_head.out_features == m.config.vocab_size
    m.resize_token_embeddings(41, pad_to_multiple_of=8)
    assert m.get_input_embeddings().num_embeddings == 48 == m.config.spec.vocab_size


@pytest.mark.parametrize("arch", ARCHS)
def test_from_pretrained_overrides_reach_the_model(arch, tmp_path):
    build(arch).save_pretrained(tmp_path)
    m = auto_class(arch).from_pretrained(tmp_path, num_hidden_layers=1)
    assert len(m.model.blocks) == 1 and m.config.spec.n_layers == 1
    if arch != "dstg":  # DSTG's AP table is max_seq_len long: another length is another weight shape
        m = auto_class(arch).from_pretrained(tmp_path, max_position_embeddings=16)
        assert m.config.spec.max_seq_len == 16
    with pytest.raises(ConfigError, match=r"divi.* n_heads|n_heads .* must divide"):
        auto_class(arch).from_pretrained(tmp_path, num_attention_heads=5)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_spec_dict_wins_over_the_copies_beside_it(arch, tmp_path):
    """config.json holds each mirrored value twice; a hand-edited spec must not be undone by the stale top-level
    copy, and a spec assigned whole is validated and refreshes the mirrors."""
    m = build(arch)
    m.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    field = m.config.SPEC_FIELD
    saved[field]["n_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(saved))
    again = auto_class(arch).from_pretrained(tmp_path)
    assert len(again.model.blocks) == 1 and again.config.num_hidden_layers == 1
    config = m.config
    config.update({field: {**getattr(config, field), "n_layers": 3}})
    assert config.num_hidden_layers == 3 and config.spec.n_layers == 3
    with pytest.raises(ConfigError, match="must divide|divisible by n_heads"):
        setattr(config, field, {**getattr(config, field), "n_heads": 5})
    assert config.spec.n_heads == 2


@pytest.mark.parametrize("arch", ARCHS)
def test_hugging_face_names_fill_what_the_spec_leaves_out(arch):
    """A config built from Hugging Face's names builds that model; the spec dict, where it sets a value, wins."""
    config = type(build(arch).config)(num_hidden_layers=3, num_attention_heads=2, vocab_size=50)
    assert (config.num_hidden_layers, config.spec.n_layers, config.spec.n_heads, config.spec.vocab_size) == (3, 3, 2, 50)
    field = config.SPEC_FIELD
    config = type(config)(**{field: {"n_layers": 1}}, num_hidden_layers=3)
    assert config.num_hidden_layers == config.spec.n_layers == 1
    if arch != "dstg":  # DSTG's width is its two streams'
        assert type(config)(hidden_size=64).spec.d_model == 64
    with pytest.raises(ConfigError, match="must divide|divisible by n_heads"):
        type(config)(num_attention_heads=5)


def test_derived_attributes_refuse_another_value():
    m = build("dstg")
    with pytest.raises(ConfigError, match="hidden_size .* follows from its 'dstg' settings"):
        m.config.hidden_size = 64
    with pytest.raises(ConfigError, match="is_decoder"):
        build("encoder").config.is_decoder = True


@pytest.mark.parametrize("arch", ARCHS)
def test_attn_implementation_sets_the_backend(arch, tmp_path):
    build(arch).save_pretrained(tmp_path)
    assert auto_class(arch).from_pretrained(tmp_path).config.spec.attn_backend == "auto"
    m = auto_class(arch).from_pretrained(tmp_path, attn_implementation="eager")
    assert m.config.spec.attn_backend == "eager" and m.config._attn_implementation == "eager"
    assert all(b.attn.backend == "eager" for b in m.model.blocks)
    with pytest.raises(ConfigError, match="attn_implementation 'flex_attention' is not available"):
        auto_class(arch).from_pretrained(tmp_path, attn_implementation="flex_attention")
    with pytest.raises(ConfigError, match="built for attn_backend 'eager'; load it with from_pretrained"):
        m.set_attn_implementation("sdpa")  # the blocks are built: the config must not say otherwise
    assert m.config.spec.attn_backend == "eager"


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_states_and_attentions_as_hugging_face_gives_them(arch):
    m = build(arch).eval()
    ids = torch.randint(0, 40, (2, 7))
    cache = poslab.ActivationCache(["embed", "blocks.*.resid_post", "final", "blocks.*.attn.probs"])
    with torch.no_grad():
        out = m(ids, output_hidden_states=True, output_attentions=True, capture=cache)
        plain = m(ids)
    hidden, attentions = out.hidden_states, out.attentions
    assert len(hidden) == 3 and len(attentions) == 2
    torch.testing.assert_close(hidden[0], cache["embed"])
    torch.testing.assert_close(hidden[1], cache["blocks.0.resid_post"])
    torch.testing.assert_close(hidden[2], cache["final"])
    for i, probs in enumerate(attentions):
        assert probs.shape == (2, 2, 7, 7)
        torch.testing.assert_close(probs, cache[f"blocks.{i}.attn.probs"])
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 7))
    torch.testing.assert_close(out.logits, plain.logits, rtol=1e-5, atol=1e-5)
    assert plain.hidden_states is None and plain.attentions is None
    m.config.output_hidden_states = True
    assert len(m(ids).hidden_states) == 3


def test_hidden_states_keep_their_graph():
    m = build("decoder")
    hidden = m(torch.randint(0, 40, (1, 5)), output_hidden_states=True).hidden_states
    hidden[1].sum().backward()
    assert m.model.embed.weight.grad is not None


def test_generate_returns_hidden_states_and_attentions():
    m = build("decoder").eval()
    out = m.generate(torch.randint(0, 40, (1, 4)), max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                     output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 3 and len(out.hidden_states[0]) == 3
    assert out.attentions[-1][0].shape == (1, 2, 1, 6)  # the last step: one query against the six keys


@pytest.mark.parametrize("arch", ARCHS)
def test_return_dict_false_gives_a_tuple_with_the_loss_first(arch):
    m = build(arch).eval()
    ids = torch.randint(1, 40, (1, 6))
    out = m(ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple)
    torch.testing.assert_close(out[0], m(ids, labels=ids).loss)
    assert isinstance(m.model(ids, return_dict=False), tuple)


def test_the_decoder_trunk_makes_a_cache_when_asked():
    from transformers import AutoModel

    m = build("decoder")
    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        trunk = AutoModel.from_pretrained(d)
    assert trunk(torch.randint(0, 40, (1, 5)), use_cache=True).past_key_values.get_seq_length() == 5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", [(2, 1, 6, 6), (2, 1, 6), (2, 5), (1, 6)])
def test_a_mask_of_another_shape_is_one_input_error(arch, shape):
    m = build(arch)
    with pytest.raises(InputError, match=r"attention_mask must be \(batch, length\) = \(2, 6\)"):
        m(torch.randint(0, 40, (2, 6)), attention_mask=torch.ones(shape))


@pytest.mark.parametrize("arch", ARCHS)
def test_an_additive_mask_is_one_input_error(arch):
    """Hugging Face's internal additive masks (0 for real tokens, a large negative number for padding) were
    read as 0/1 masks the other way round: real tokens hidden, padding seen. 0/1 masks of any dtype pass."""
    m = build(arch).eval()
    ids = torch.randint(0, 40, (2, 6))
    additive = torch.zeros(2, 6)
    additive[1, 4:] = -1e4
    with pytest.raises(InputError, match=r"^attention_mask must hold 1 for real tokens and 0 for padding, got values "
                                         r"in \[-10000, 0\]; pass the 0/1 padding mask"):
        m(ids, attention_mask=additive)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    for dtype in (torch.long, torch.bool, torch.float32):
        torch.testing.assert_close(m(ids, attention_mask=mask.to(dtype)).logits, m(ids, attention_mask=mask).logits)
    m(ids, attention_mask=torch.zeros(2, 6))  # all padding is still a 0/1 mask


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("position_ids,message", [
    (torch.arange(6), r"position_ids must be \(batch, length\) = \(2, 6\) or \(1, 6\) for every sequence alike, "
                      r"got shape \(6,\)"),
    (torch.arange(5)[None], r"got shape \(1, 5\)"),
    (torch.arange(6)[None, None], r"got shape \(1, 1, 6\)"),
    (torch.arange(6).expand(3, 6), r"got shape \(3, 6\)"),
    (torch.arange(6.0)[None], r"position_ids must be an integer tensor \(torch.long\), got torch.float32"),
    ([[0, 1, 2, 3, 4, 5]], r"position_ids must be an integer tensor \(torch.long\), got list"),
])
def test_position_ids_of_another_shape_or_dtype_are_one_input_error(arch, position_ids, message):
    """They failed in a broadcast inside a scheme (RoPE's rotation, ALiBi's bias) or in an embedding."""
    m = build(arch).eval()
    with pytest.raises(InputError, match=message):
        m(torch.randint(0, 40, (2, 6)), position_ids=position_ids)
    m(torch.randint(0, 40, (2, 6)), position_ids=torch.arange(6, dtype=torch.int32).expand(2, 6))


@pytest.mark.parametrize("arch", ARCHS)
def test_input_ids_of_one_dimension_are_one_input_error(arch):
    with pytest.raises(InputError, match=r"^input_ids must be \(batch, n\), got shape \(6,\); a single sequence "
                                         r"is input_ids\[None\]"):
        build(arch)(torch.randint(0, 40, (6,)))


def test_a_legacy_tuple_cache_is_one_input_error():
    m = build("decoder").eval()
    ids = torch.randint(0, 40, (1, 4))
    legacy = tuple((torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)) for _ in range(2))
    with pytest.raises(InputError, match=r"^past_key_values must be a transformers Cache \(DynamicCache, what "
                                         r"generate makes\), got tuple"):
        m(ids, past_key_values=legacy)


@pytest.mark.parametrize("arch", ARCHS)
def test_inputs_embeds_is_refused_in_one_line(arch):
    m = build(arch)
    with pytest.raises(InputError, match="inputs_embeds is not supported"):
        m(inputs_embeds=torch.randn(1, 4, 32))
    with pytest.raises(InputError, match="input_ids is required"):
        m(attention_mask=torch.ones(1, 4))
    with pytest.raises(InputError, match="inputs_embeds is not supported"):
        m(torch.randint(0, 40, (1, 4)), inputs_embeds=torch.randn(1, 4, 32))
