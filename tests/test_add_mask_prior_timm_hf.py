"""maskprior.add_mask_prior on timm's VisionTransformer (with and without a class token, with register
tokens, with dynamic_img_size) and on Hugging Face transformers families on the AttentionInterface,
all tiny and built from configs (no download): decoders (GPT-2, Llama with grouped-query attention,
Mistral, Qwen2, Gemma2 with its softcap, Gemma3, GPT-OSS with its sinks, OPT, GPT-NeoX, Phi3),
encoders (BERT, ModernBERT) and vision models (ViT, DeiT, CLIP, DINOv2 with registers, BEiT). A
patched layer computes softmax(Q K^T / sqrt(d) + log sigmoid(s M) + the model's own scores' changes
and masks) V (Section 4.1), trains M, and refuses what it cannot patch; a constant M leaves every
family unchanged. An image layer takes exactly the tokens its mask was built for (every image family
here, at another grid: one ValueError that says how to build M). Cached generation, padding and saving
are in tests/test_add_mask_prior_positions.py."""
import copy
import inspect
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import maskprior
from helpers import ROOT, random_masks, split_heads

timm = pytest.importorskip("timm", reason="needs the test extras (pip install .[test]): timm")
T = pytest.importorskip("transformers", reason="needs the test extras (pip install .[test]): Hugging Face transformers")
import timm.optim  # noqa: E402  (the optimizer factory, after timm is known to be there)

WIDTH, LAYERS, VOCAB = 32, 2, 64
TEXT_N, TEXT_LEN = 8, 6              # M covers 8 tokens; inputs of 6 use its top-left 6 x 6 block
IMAGE_N = 17                         # CLS + 4 x 4 patches of 4 x 4 in a 16 x 16 image
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
# The models are tiny: a second torch thread only waits on the first (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------
# The families, each tiny: build() -> model, its query heads, M's N, its inputs
# ----------------------------------------------------------------------------------------------

def decoder(config_class, model_class, **overrides):
    """A decoder of the Llama line: 4 query heads on 2 K/V heads (grouped-query attention)."""
    settings = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=LAYERS,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return model_class(config_class(**{**settings, **overrides}))


def gpt2(**overrides):
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=2, vocab_size=VOCAB,
                                          n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                          pad_token_id=0, **overrides))


def bert():
    return T.BertModel(T.BertConfig(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=2,
                                    intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=TEXT_N,
                                    **NO_DROPOUT), add_pooling_layer=False)


def vision(config_class, model_class, **overrides):
    settings = dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=2, intermediate_size=64,
                    image_size=16, patch_size=4)
    return model_class(config_class(**{**settings, **overrides}))


def beit():
    model = vision(T.BeitConfig, T.BeitModel, use_relative_position_bias=True, vocab_size=VOCAB)
    for table in (p for name, p in model.named_parameters() if name.endswith("relative_position_bias_table")):
        nn.init.normal_(table)            # the table starts at zero: give the bias something to add
    return model


def timm_vit(**overrides):
    return timm.models.VisionTransformer(img_size=16, patch_size=4, embed_dim=WIDTH, depth=LAYERS,
                                         num_heads=2, mlp_ratio=2, num_classes=10, **overrides)


def tokens(batch, padding=None):
    """input_ids (batch, 6), and with padding "left" or "right" an attention_mask whose last row
    holds 4 tokens and 2 pads."""
    ids = torch.randint(1, VOCAB, (batch, TEXT_LEN), generator=torch.Generator().manual_seed(batch))
    if padding is None:
        return {"input_ids": ids}
    mask = torch.ones(batch, TEXT_LEN, dtype=torch.long)
    mask[-1, :2] = 0 if padding == "left" else 1
    mask[-1, -2:] = 0 if padding == "right" else 1
    return {"input_ids": ids, "attention_mask": mask}


def images(batch, key="pixel_values", size=16):
    return {key: torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(batch))}


FAMILIES = {  # name: (build, query heads, M's N, inputs(batch), name of the first patched layer)
    "gpt2": (gpt2, 2, TEXT_N, lambda b: tokens(b, "left"), "transformer.h.0.attn"),
    "llama": (lambda: decoder(T.LlamaConfig, T.LlamaForCausalLM), 4, TEXT_N,
              lambda b: tokens(b, "left"), "model.layers.0.self_attn"),
    "mistral": (lambda: decoder(T.MistralConfig, T.MistralForCausalLM, sliding_window=3), 4, TEXT_N,
                lambda b: tokens(b, "left"), "model.layers.0.self_attn"),
    "qwen2": (lambda: decoder(T.Qwen2Config, T.Qwen2ForCausalLM, use_sliding_window=True, sliding_window=3,
                              max_window_layers=1), 4, TEXT_N, lambda b: tokens(b, "left"),
              "model.layers.0.self_attn"),
    "gemma2": (lambda: decoder(T.Gemma2Config, T.Gemma2ForCausalLM, head_dim=8, sliding_window=3,
                               attn_logit_softcapping=2.0), 4, TEXT_N, lambda b: tokens(b, "left"),
               "model.layers.0.self_attn"),
    "gemma3": (lambda: decoder(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=8, sliding_window=3,
                               layer_types=["sliding_attention", "full_attention"]), 4, TEXT_N,
               lambda b: tokens(b, "left"), "model.layers.0.self_attn"),
    "gpt_oss": (lambda: decoder(T.GptOssConfig, T.GptOssForCausalLM, head_dim=8, sliding_window=3,
                                num_local_experts=2, num_experts_per_tok=1,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                layer_types=["sliding_attention", "full_attention"]), 4, TEXT_N,
                lambda b: tokens(b, "left"), "model.layers.0.self_attn"),
    "opt": (lambda: T.OPTForCausalLM(T.OPTConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                                 ffn_dim=64, num_attention_heads=2, word_embed_proj_dim=WIDTH,
                                                 max_position_embeddings=64, dropout=0.0, pad_token_id=0,
                                                 bos_token_id=0, eos_token_id=0)), 2, TEXT_N,
            lambda b: tokens(b, "left"), "model.decoder.layers.0.self_attn"),
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, bos_token_id=0, eos_token_id=0)), 2, TEXT_N,
                 lambda b: tokens(b, "left"), "gpt_neox.layers.0.attention"),
    "phi3": (lambda: decoder(T.Phi3Config, T.Phi3ForCausalLM), 4, TEXT_N, lambda b: tokens(b, "left"),
             "model.layers.0.self_attn"),
    "bert": (bert, 2, TEXT_N, lambda b: tokens(b, "right"), "encoder.layer.0.attention.self"),
    "modernbert": (lambda: T.ModernBertModel(T.ModernBertConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=2,
        pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0, sep_token_id=0)), 2, TEXT_N,
                   lambda b: tokens(b, "right"), "layers.0.attn"),
    "hf_vit": (lambda: vision(T.ViTConfig, T.ViTModel, **NO_DROPOUT), 2, IMAGE_N, images,
               "layers.0.attention"),
    "deit": (lambda: vision(T.DeiTConfig, T.DeiTModel), 2, IMAGE_N + 1, images, "layers.0.attention"),
    "clip_vision": (lambda: vision(T.CLIPVisionConfig, T.CLIPVisionModel), 2, IMAGE_N, images,
                    "encoder.layers.0.self_attn"),
    "dinov2_registers": (lambda: vision(T.Dinov2WithRegistersConfig, T.Dinov2WithRegistersModel,
                                        num_register_tokens=2), 2, IMAGE_N + 2, images,
                         "encoder.layer.0.attention"),
    "dinov2": (lambda: vision(T.Dinov2Config, T.Dinov2Model), 2, IMAGE_N, images, "encoder.layer.0.attention"),
    "beit": (beit, 2, IMAGE_N, images, "layers.0.attention"),
    "timm_vit": (timm_vit, 2, IMAGE_N, lambda b: images(b, "x"), "blocks.0.attn"),
    "timm_vit_no_class_token": (lambda: timm_vit(class_token=False, global_pool="avg"), 2, IMAGE_N - 1,
                                lambda b: images(b, "x"), "blocks.0.attn"),
    "timm_vit_registers": (lambda: timm_vit(reg_tokens=2), 2, IMAGE_N + 2, lambda b: images(b, "x"),
                           "blocks.0.attn"),
    "timm_vit_dynamic_size": (lambda: timm_vit(dynamic_img_size=True), 2, 10,       # CLS + 3 x 3 patches
                              lambda b: images(b, "x", size=12), "blocks.0.attn"),
}
WRITTEN_OUT = ["gpt2", "llama", "gemma2", "gpt_oss", "bert", "hf_vit", "timm_vit"]


def build(name, seed=0):
    torch.manual_seed(seed)
    return FAMILIES[name][0]().eval()


def run(model, inputs, **kwargs):
    """The model's main output: timm's logits, transformers' logits or last hidden state."""
    out = model(**inputs, **kwargs)
    return out if torch.is_tensor(out) else out[0]


def real_tokens(model, inputs):
    """The model's output at every token it keeps (B * n, ...): a timm ViT's features before its
    pooling (an average over the tokens would blur what M changes), a transformers model's output
    at the tokens the attention_mask keeps (a padded query's row is noise)."""
    if isinstance(model, timm.models.VisionTransformer):
        return model.forward_features(**inputs)
    out = run(model, inputs)
    return out[inputs["attention_mask"].bool()] if "attention_mask" in inputs else out


def constant(heads, n, value=maskprior.OPEN):
    return torch.full((heads, n, n), value)


def band(heads, n):
    """(heads, n, n): +10 where |i - j| <= 1 (open), -10 elsewhere (closed)."""
    i = torch.arange(n)
    return torch.where((i[:, None] - i[None, :]).abs() <= 1, 10.0, -10.0).expand(heads, n, n)


def capture(layer):
    """{"args", "kwargs", "out"} of layer's next call, as its forward saw them (after our hooks)."""
    seen = {}
    layer.register_forward_hook(lambda m, args, kwargs, out: seen.update(
        args=args, kwargs=dict(kwargs), out=out), with_kwargs=True)
    return seen


def timm_written_out(attn, x, mask, extra=0.0):
    """timm's Attention written out from its weights: softmax(Q K^T / sqrt(d) + log sigmoid(M)
    [+ extra]) V, then proj. x (B, n, C), mask (H, N, N). Returns the output (B, n, C) and p
    (B, H, n, n)."""
    B, n, C = x.shape
    q, k, v = (split_heads(t, attn.num_heads)
               for t in F.linear(x, attn.qkv.weight, attn.qkv.bias).chunk(3, dim=-1))   # (B, H, n, d) each
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + F.logsigmoid(mask[:, :n, :n]) + extra
    p = logits.softmax(dim=-1)
    return attn.proj((p @ v).transpose(1, 2).reshape(B, n, C)), p


# ----------------------------------------------------------------------------------------------
# What the patched model computes
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_constant_mask_leaves_every_family_unchanged_and_a_random_one_does_not(name):
    """M = +10 everywhere moves every score by log sigmoid(10) = -4.5e-5, the same in every row,
    which softmax cancels (GPT-OSS's sink, outside M, moves by 4.5e-5 against the keys): the model's
    causal, padding and window masks, softcap, sinks and position biases stay as they were. The
    stock model runs its default attention; a random M (mixed rows) does change the output."""
    _, heads, n, make_inputs, _ = FAMILIES[name]
    stock = build(name)
    constant_prior, random_prior = copy.deepcopy(stock), copy.deepcopy(stock)
    maskprior.add_mask_prior(constant_prior, constant(heads, n))
    maskprior.add_mask_prior(random_prior, random_masks(LAYERS, heads, n))
    inputs = make_inputs(3)
    with torch.no_grad():
        expected = real_tokens(stock, inputs)
        torch.testing.assert_close(real_tokens(constant_prior, inputs), expected, rtol=1e-4, atol=1e-5)
        assert (real_tokens(random_prior, inputs) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "hf_vit", "timm_vit"])
def test_pattern_puts_less_than_1e_3_of_the_attention_on_closed_keys(name):
    _, heads, n, make_inputs, _ = FAMILIES[name]
    model = build(name)
    maskprior.add_mask_prior(model, band(heads, n))
    closed = band(heads, n)[0] < 0                                     # (N, N)
    inputs = {key: value for key, value in make_inputs(3).items() if key != "attention_mask"}
    with torch.no_grad():
        if name == "timm_vit":
            seen = [capture(block.attn) for block in model.blocks]
            model(**inputs)
            maps = [timm_written_out(block.attn, s["kwargs"]["x"], block.attn.mask)[1]
                    for block, s in zip(model.blocks, seen)]
        else:
            maps = model(**inputs, output_attentions=True).attentions
    assert len(maps) == LAYERS
    for p in maps:                                                      # (B, H, n, n)
        m = p.shape[-1]
        assert p.shape[1] == heads
        assert (p * closed[:m, :m]).sum(-1).max() < 1e-3
        assert (p * ~closed[:m, :m]).sum(-1).min() > 0.999


@pytest.mark.parametrize("name", WRITTEN_OUT)
def test_patched_layer_computes_the_section_4_1_attention(name):
    """The second layer's output against the written-out softmax(Q K^T / sqrt(d) + log sigmoid(M)
    [+ the causal mask]) V of the same weights: timm's by hand; a transformers layer's by the stock
    layer on its family's eager attention (the formula as the family writes it: Gemma2's softcap,
    GPT-OSS's sinks), given log sigmoid(M)'s top-left block plus the model's mask as its mask."""
    _, heads, n, make_inputs, _ = FAMILIES[name]
    model = build(name)
    stock_layer = None
    masks = random_masks(LAYERS, heads, n)
    if name != "timm_vit":
        stock = copy.deepcopy(model)
        stock.set_attn_implementation("eager")
        stock_layer = dict(stock.named_modules())[maskprior.add_mask_prior(model, masks)[1].mask_prior_name]
    patched = [m for m in model.modules() if hasattr(m, "mask_prior_name")] if stock_layer else \
        maskprior.add_mask_prior(model, masks)
    seen = capture(patched[1])
    inputs = {key: value for key, value in make_inputs(3).items() if key != "attention_mask"}
    with torch.no_grad():
        run(model, inputs)
        if name == "timm_vit":
            expected, _ = timm_written_out(patched[1], seen["kwargs"]["x"], masks[1])
            actual = seen["out"]
        else:
            call = inspect.signature(stock_layer.forward).bind(*seen["args"], **seen["kwargs"])
            call.arguments["cache"] = None                # the model's cache holds these keys
            m = TEXT_LEN if n == TEXT_N else n
            # the model's mask as the patched layer saw it: Boolean (B, 1, n, n), or None where SDPA's
            # is_causal would serve (a decoder's) or nothing is masked
            allowed = call.arguments.get("attention_mask")
            if allowed is None:
                allowed = torch.ones(m, m, dtype=torch.bool)
                allowed = allowed.tril() if getattr(stock_layer, "is_causal", True) else allowed
            model_mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
            call.arguments["attention_mask"] = model_mask + F.logsigmoid(masks[1][:, :m, :m])   # (B or 1, H, n, n)
            expected, actual = stock_layer(*call.args, **call.kwargs)[0], seen["out"][0]
    assert (masks[1] != masks[0]).any()
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_mask_holds_under_a_prior_that_opens_the_future(name):
    """M open on and above the diagonal, closed below: without the causal mask each token would
    look at later ones; with it, all its attention is on itself, and later tokens change nothing."""
    _, heads, n, _, _ = FAMILIES[name]
    model = build(name)
    i = torch.arange(n)
    maskprior.add_mask_prior(model, torch.where(i[None, :] >= i[:, None], 10.0, -10.0).expand(
        heads, n, n))
    inputs = tokens(2)
    with torch.no_grad():
        for p in model(**inputs, output_attentions=True).attentions:     # (B, H, n, n)
            assert p.triu(1).max() == 0
            assert p.diagonal(dim1=-2, dim2=-1).min() > 0.999
        changed = inputs["input_ids"].clone()
        changed[:, -1] = (changed[:, -1] + 1) % VOCAB
        torch.testing.assert_close(run(model, {"input_ids": changed})[:, :-1],
                                   run(model, inputs)[:, :-1])


def test_bert_padding_mask_holds_and_a_shorter_input_uses_the_top_left_block():
    """A sequence padded from 4 to 6 tokens: no attention on the padding, and its 4 tokens come out
    as the same sequence alone (length 4: M's top-left 4 x 4 block)."""
    model = build("bert")
    maskprior.add_mask_prior(model, random_masks(LAYERS, 2, TEXT_N))
    ids = torch.randint(1, VOCAB, (1, TEXT_LEN))
    padding = torch.tensor([[1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=padding, output_attentions=True)
        alone = model(input_ids=ids[:, :4]).last_hidden_state
    for p in padded.attentions:
        assert p[..., 4:].max() < 1e-30
    torch.testing.assert_close(padded.last_hidden_state[:, :4], alone)


def test_timm_caller_mask_and_is_causal_add_to_the_prior():
    """timm's Attention called with is_causal=True, or with a Boolean attn_mask (True = may attend,
    SDPA's meaning) on both its paths: the written-out attention plus the causal or caller's -inf."""
    model = build("timm_vit").double()
    masks = random_masks(LAYERS, 2, 5).double()                         # the layer alone, on 5 tokens
    attn = maskprior.add_mask_prior(model, masks)[0]
    x = torch.randn(2, 5, WIDTH, dtype=torch.float64)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()                  # True = may attend
    may_attend = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(3)) < 0.7
    may_attend |= torch.eye(5, dtype=torch.bool)
    for fused in (True, False):
        attn.fused_attn = fused
        for kwargs, allowed in (({"is_causal": True}, causal), ({"attn_mask": may_attend}, may_attend)):
            blocked = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, -math.inf)
            expected, p = timm_written_out(attn, x, masks[0], blocked)
            torch.testing.assert_close(attn(x, **kwargs), expected)
            assert p.masked_select(~allowed.expand_as(p)).max() == 0


def test_siglip_pooling_head_is_left_unpatched_and_its_encoder_takes_the_prior():
    """SigLIP's vision model pools with an nn.MultiheadAttention whose one probe query (a parameter of
    the head beside it) attends to the tokens: cross-attention, left unpatched at the patch. The whole
    model patched equals its encoder patched alone, pooled output included; its encoder takes the
    prior (its attention hands the attention function no keyword arguments)."""
    build = lambda: vision(T.SiglipVisionConfig, T.SiglipVisionModel)
    inputs = images(2)
    torch.manual_seed(0)
    stock = build().eval()
    whole, constant_prior, random_prior = (copy.deepcopy(stock) for _ in range(3))
    masks = random_masks(LAYERS, 2, IMAGE_N - 1)
    patched = maskprior.add_mask_prior(whole, masks)
    assert [attn.mask_prior_name for attn in patched] == [f"encoder.layers.{i}.self_attn" for i in range(LAYERS)]
    assert not hasattr(whole.head.attention, "mask")
    maskprior.add_mask_prior(constant_prior.encoder, constant(2, IMAGE_N - 1))
    maskprior.add_mask_prior(random_prior.encoder, masks)
    with torch.no_grad():
        torch.testing.assert_close(whole(**inputs).pooler_output, random_prior(**inputs).pooler_output, rtol=0, atol=0)
        expected = run(stock, inputs)
        torch.testing.assert_close(run(constant_prior, inputs), expected, rtol=1e-4, atol=1e-5)
        assert (run(random_prior, inputs) - expected).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------
# Training, modes, checkpoints, param_groups
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["timm_vit", "gpt2", "hf_vit", "bert", "llama"])
def test_one_step_with_param_groups_trains_every_layers_mask(name):
    _, heads, n, make_inputs, _ = FAMILIES[name]
    model = build(name).train()
    masks = random_masks(LAYERS, heads, n)
    patched = maskprior.add_mask_prior(model, masks)
    optimizer = torch.optim.AdamW(maskprior.param_groups(model, weight_decay=0.05), lr=1e-2)
    run(model, make_inputs(2)).square().mean().backward()
    optimizer.step()
    for attn, mask in zip(patched, masks):
        assert attn.mask.grad.abs().max() > 0
        assert not torch.equal(attn.mask.detach(), mask)                     # M moved


@pytest.mark.parametrize("name", ["timm_vit", "llama"])
def test_fixed_mode_leaves_m_frozen(name):
    _, heads, n, make_inputs, _ = FAMILIES[name]
    model = build(name).train()
    masks = random_masks(LAYERS, heads, n)
    patched = maskprior.add_mask_prior(model, masks, mode="fixed")
    optimizer = torch.optim.AdamW(maskprior.param_groups(model, 0.05, mask_decay=0.5), lr=1e-2)
    run(model, make_inputs(2)).square().mean().backward()
    optimizer.step()
    for attn, mask in zip(patched, masks):
        assert not attn.mask.requires_grad and attn.mask.grad is None
        assert torch.equal(attn.mask, mask)


@pytest.mark.parametrize("name", ["timm_vit", "gpt2", "bert"])
def test_state_dict_round_trip_into_a_fresh_patched_model(name):
    _, heads, n, make_inputs, _ = FAMILIES[name]
    model = build(name, seed=0)
    maskprior.add_mask_prior(model, random_masks(LAYERS, heads, n))
    state = model.state_dict()
    assert len([key for key in state if key.endswith(".mask")]) == LAYERS
    fresh = build(name, seed=5)
    maskprior.add_mask_prior(fresh, torch.zeros(heads, n, n))
    inputs = make_inputs(2)
    with torch.no_grad():
        assert not torch.equal(run(fresh, inputs), run(model, inputs))
        fresh.load_state_dict(state)
        assert torch.equal(run(fresh, inputs), run(model, inputs))


@pytest.mark.parametrize("name", ["timm_vit", "llama"])
def test_param_groups_hold_each_parameter_once_and_decay_m_by_mask_decay_alone(name):
    """Matrices decay by weight_decay (timm's pos_embed and cls_token not: its no_weight_decay),
    vectors not, M by mask_decay; with M's gradient zero an AdamW step shrinks the matrices and
    leaves M where it was."""
    _, heads, n, _, _ = FAMILIES[name]
    model = build(name)
    patched = maskprior.add_mask_prior(model, random_masks(LAYERS, heads, n))
    groups = maskprior.param_groups(model, weight_decay=0.5)
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    decay = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    masks = {id(attn.mask) for attn in patched}
    no_decay = set(getattr(model, "no_weight_decay", set)())
    for pname, p in model.named_parameters():
        expected = 0.0 if id(p) in masks or p.dim() < 2 or pname in no_decay else 0.5
        assert decay[id(p)] == expected, pname
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0, 0.0]
    assert {id(p) for p in groups[2]["params"]} == masks
    before = [attn.mask.detach().clone() for attn in patched]
    weight = next(p for g in groups[:1] for p in g["params"])
    weight_before = weight.detach().clone()
    optimizer = torch.optim.AdamW(groups, lr=0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert all(torch.equal(attn.mask, m) for attn, m in zip(patched, before))
    torch.testing.assert_close(weight.detach(), weight_before * (1 - 0.1 * 0.5))


def test_param_groups_honour_no_weight_decay_of_a_nested_timm_vit():
    """nn.Sequential(vit, head): the ViT's no_weight_decay names (pos_embed, cls_token) hold at
    its depth, 0.pos_embed and 0.cls_token, as they do for the ViT alone."""
    vit = build("timm_vit")
    maskprior.add_mask_prior(vit, band(2, IMAGE_N))
    model = nn.Sequential(vit, nn.Linear(10, 3))
    decay = {id(p): g["weight_decay"] for g in maskprior.param_groups(model, 0.5) for p in g["params"]}
    alone = {id(p): g["weight_decay"] for g in maskprior.param_groups(vit, 0.5) for p in g["params"]}
    assert decay[id(vit.pos_embed)] == decay[id(vit.cls_token)] == 0.0
    assert decay[id(model[1].weight)] == 0.5
    assert all(decay[i] == alone[i] for i in alone)


def test_param_groups_work_with_timms_optimizer_factory():
    model = build("timm_vit")
    maskprior.add_mask_prior(model, band(2, IMAGE_N))
    groups = maskprior.param_groups(model, weight_decay=0.05, mask_decay=1e-4)
    optimizer = timm.optim.create_optimizer_v2(groups, opt="adamw", lr=1e-3)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0, 1e-4]


# ----------------------------------------------------------------------------------------------
# Refusals, each one ValueError naming the module
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["timm_vit", "gpt2", "hf_vit", "bert", "llama"])
def test_wrong_head_count_and_layer_count_are_refused(name):
    _, heads, n, _, first = FAMILIES[name]
    message = re.escape(first) + rf".*\({heads + 1}, {n}, {n}\).*num_heads={heads}"
    with pytest.raises(ValueError, match=message):
        maskprior.add_mask_prior(build(name), torch.zeros(heads + 1, n, n))
    with pytest.raises(ValueError, match=rf"layers = {LAYERS}.*\(3, {heads}, {n}, {n}\)"):
        maskprior.add_mask_prior(build(name), torch.zeros(3, heads, n, n))


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_sequence_longer_than_the_mask_is_refused_at_forward_time(name):
    _, heads, n, make_inputs, first = FAMILIES[name]
    model = build(name)
    short = TEXT_LEN - 1
    maskprior.add_mask_prior(model, torch.zeros(heads, short, short))
    message = re.escape(first) + rf".*\({heads}, {short}, {short}\).*at most {short}.*got position {TEXT_LEN - 1}"
    with pytest.raises(ValueError, match=message):
        run(model, make_inputs(1))


# An image layer takes exactly the N tokens its mask was built for: its prefix tokens (class,
# distillation, register tokens) and its grid of patches. Each case gives a family a mask built for
# another layout: (family, image size, call keywords, prefix tokens, grid at that size, M's N). 12 px
# is a 3 x 3 grid of the 16 px models (timm's dynamic_img_size, transformers' interpolate_pos_encoding),
# where M's top-left block would give each patch another patch's prior.
WRONG_GRIDS = {
    "timm_vit": ("timm_vit", 16, {}, 1, 4, 26),                    # M for a 5 x 5 grid
    "timm_vit_no_class_token": ("timm_vit_no_class_token", 16, {}, 0, 4, IMAGE_N),   # a CLS it lacks
    "timm_vit_registers": ("timm_vit_registers", 16, {}, 3, 4, IMAGE_N),
    "timm_vit_dynamic_size": ("timm_vit_dynamic_size", 12, {}, 1, 3, IMAGE_N),
    "hf_vit_interpolated": ("hf_vit", 12, {"interpolate_pos_encoding": True}, 1, 3, IMAGE_N),
    "hf_vit": ("hf_vit", 16, {}, 1, 4, 26),
    "deit": ("deit", 16, {}, 2, 4, IMAGE_N),                      # CLS and the distillation token
    "deit_interpolated": ("deit", 12, {"interpolate_pos_encoding": True}, 2, 3, IMAGE_N + 1),
    "clip_vision_interpolated": ("clip_vision", 12, {"interpolate_pos_encoding": True}, 1, 3, IMAGE_N),
    "dinov2": ("dinov2", 12, {}, 1, 3, IMAGE_N),                   # DINOv2 always interpolates
    "dinov2_registers": ("dinov2_registers", 12, {}, 3, 3, IMAGE_N + 2),
    "beit_interpolated": ("beit", 12, {"interpolate_pos_encoding": True}, 1, 3, IMAGE_N),
}


@pytest.mark.parametrize("case", list(WRONG_GRIDS))
def test_a_mask_for_another_grid_is_refused_and_the_recipe_given_fits(case):
    """The forward refuses M with one ValueError naming the layer, the tokens the image gives (prefix
    tokens + patches, the grid), M's N and how to build M for this grid; the mask built as the
    message says then runs and trains."""
    name, size, keywords, prefix, grid, wrong = WRONG_GRIDS[case]
    _, heads, _, _, first = FAMILIES[name]
    key = "x" if name.startswith("timm") else "pixel_values"
    inputs = {**images(2, key, size), **keywords}
    model = build(name).train()
    maskprior.add_mask_prior(model, torch.zeros(heads, wrong, wrong))
    n = prefix + grid * grid
    message = (rf"^{re.escape(first)}: an image layer takes the N tokens its mask was built for, on its grid; "
               rf"got {n} = {prefix} prefix tokens \(.*\) \+ {grid * grid} patches, M \({heads}, {wrong}, {wrong}\) is "
               rf"for N = {wrong}: for a {grid} x {grid} grid M = (?P<recipe>.*), i = (?P<index>.*)$")
    with pytest.raises(ValueError, match=message) as refused:
        run(model, inputs)
    found = re.match(message, str(refused.value))
    index = eval(found["index"])
    mask = eval(found["recipe"], {"maskprior": maskprior, "depth": LAYERS, "heads": heads, "i": index})
    assert mask.shape == (LAYERS, heads, n, n)
    model = build(name).train()
    patched = maskprior.add_mask_prior(model, mask)
    run(model, inputs).square().mean().backward()
    assert all(attn.mask.grad.abs().max() > 0 for attn in patched)


def test_boolean_mask_init_is_refused():
    """A Boolean pattern (True = may attend) taken as M = 1 / 0 would be a prior of 0.3 nats."""
    allowed = torch.ones(4, TEXT_N, TEXT_N, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"float logits.*got dtype torch.bool.*torch.where"):
        maskprior.add_mask_prior(build("llama"), allowed)


def test_transformers_model_off_the_attention_interface_is_refused():
    model = T.BloomForCausalLM(T.BloomConfig(n_layer=LAYERS, hidden_size=WIDTH, n_head=2, vocab_size=VOCAB))
    with pytest.raises(ValueError, match=r"^BloomForCausalLM: BloomForCausalLM's family takes no attention "
                                         r"function from transformers' AttentionInterface"):
        maskprior.add_mask_prior(model, torch.zeros(2, TEXT_N, TEXT_N))
    assert model.config._attn_implementation != maskprior.MASK_PRIOR_ATTENTION


def test_layers_of_an_encoder_decoder_family_are_refused_by_name():
    """BART's layers are on the interface, but its family does not support attention backends: a
    patch of its encoder's layers is refused as the whole model is."""
    bart = T.BartModel(T.BartConfig(vocab_size=VOCAB, d_model=WIDTH, encoder_layers=1, decoder_layers=1,
                                    encoder_attention_heads=2, decoder_attention_heads=2,
                                    encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16))
    with pytest.raises(ValueError, match=r"^0\.self_attn: BartAttention's family takes no attention function"):
        maskprior.add_mask_prior(bart.encoder.layers, torch.zeros(2, TEXT_N, TEXT_N))
    with pytest.raises(ValueError, match=r"^BartModel: BartModel's family takes no attention function"):
        maskprior.add_mask_prior(bart, torch.zeros(2, TEXT_N, TEXT_N))


def test_swin_is_refused_with_the_reason():
    model = T.SwinModel(T.SwinConfig(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1],
                                     num_heads=[2, 2], window_size=2))
    with pytest.raises(ValueError, match=r"encoder\.layers\.0\.blocks\.0\.attention: SwinAttention takes "
                                         r"a head count per stage, num_heads=\[2, 2\].*within windows"):
        maskprior.add_mask_prior(model, torch.zeros(2, 4, 4))


def test_model_without_supported_attention_is_refused():
    model = timm.create_model("resnet10t", num_classes=3)       # a timm model without Attention
    with pytest.raises(ValueError, match="ResNet contains no nn.MultiheadAttention, timm "
                                         "Attention or transformers attention layer"):
        maskprior.add_mask_prior(model, torch.zeros(2, 4, 4))


def test_patching_twice_is_refused():
    model = build("llama")
    maskprior.add_mask_prior(model, torch.zeros(4, TEXT_N, TEXT_N))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn already has a mask prior"):
        maskprior.add_mask_prior(model, torch.zeros(4, TEXT_N, TEXT_N))
    with pytest.raises(ValueError, match=r"^self_attn already has a mask prior"):
        maskprior.add_mask_prior(model.model.layers[1], torch.zeros(4, TEXT_N, TEXT_N))


def test_importing_maskprior_imports_neither_timm_nor_transformers():
    code = "import sys, maskprior; print(sorted({'timm', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
