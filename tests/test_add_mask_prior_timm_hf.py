"""maskprior.add_mask_prior on timm's VisionTransformer and on Hugging Face transformers' GPT-2, ViT,
BERT and Llama (grouped-query attention), all tiny and built from configs (no download), and
maskprior.param_groups. A patched layer must compute softmax(Q K^T / sqrt(d) + log sigmoid(s M)) V
(Section 4.1) with the model's causal and padding masks kept, train M, save and load it, and refuse
what it cannot patch."""
import copy
import inspect
import math
import re
import subprocess
import sys

import pytest
import timm
import timm.optim
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from transformers import (BertConfig, BertModel, BloomConfig, BloomForCausalLM, GPT2Config,
                          GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, ViTConfig, ViTModel)

import maskprior
from conftest import ROOT

WIDTH, LAYERS, VOCAB = 32, 2, 50
TEXT_N, TEXT_LEN = 8, 6              # M covers 8 tokens; inputs of 6 use its top-left 6 x 6 block
IMAGE_N = 17                         # CLS + 4 x 4 patches of 4 x 4 in a 16 x 16 image
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def timm_vit():
    return timm.models.VisionTransformer(img_size=16, patch_size=4, embed_dim=WIDTH, depth=LAYERS,
                                         num_heads=2, mlp_ratio=2, num_classes=10)


def gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=2, vocab_size=VOCAB,
                                      n_positions=TEXT_N, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def hf_vit():
    return ViTModel(ViTConfig(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=2,
                              intermediate_size=64, image_size=16, patch_size=4, **NO_DROPOUT),
                    add_pooling_layer=False)


def bert():
    return BertModel(BertConfig(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=2,
                                intermediate_size=64, vocab_size=VOCAB,
                                max_position_embeddings=TEXT_N, **NO_DROPOUT),
                     add_pooling_layer=False)


def llama():   # grouped-query attention: 4 query heads share 2 K/V heads
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=LAYERS, hidden_size=WIDTH,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=64, vocab_size=VOCAB,
                                        max_position_embeddings=TEXT_N, bos_token_id=0,
                                        eos_token_id=0))


def images(batch):
    return {"x": torch.randn(batch, 3, 16, 16, dtype=torch.float64)}


def tokens(batch):
    return {"input_ids": torch.randint(0, VOCAB, (batch, TEXT_LEN))}


MODELS = {  # name: (build, heads, N, causal, inputs(batch), name of the first patched layer)
    "timm_vit": (timm_vit, 2, IMAGE_N, False, images, "blocks.0.attn"),
    "gpt2": (gpt2, 2, TEXT_N, True, tokens, "transformer.h.0.attn"),
    "hf_vit": (hf_vit, 2, IMAGE_N, False, lambda b: {"pixel_values": images(b)["x"]},
               "layers.0.attention"),
    "bert": (bert, 2, TEXT_N, False, tokens, "encoder.layer.0.attention.self"),
    "llama": (llama, 4, TEXT_N, True, tokens, "model.layers.0.self_attn"),
}


def build(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name][0]().double()


def run(model, inputs, **kwargs):
    """The model's main output: timm's logits, transformers' logits or last hidden state."""
    out = model(**inputs, **kwargs)
    return out if torch.is_tensor(out) else out[0]


def band(heads, n):
    """(heads, n, n): +10 where |i - j| <= 1 (open), -10 elsewhere (closed)."""
    i = torch.arange(n)
    return torch.where((i[:, None] - i[None, :]).abs() <= 1, 10.0, -10.0).expand(heads, n, n)


def random_masks(heads, n, seed=1):
    """(layers, heads, n, n) mask logits of all sizes, so rows mix open and closed entries."""
    return 3 * torch.randn(LAYERS, heads, n, n, generator=torch.Generator().manual_seed(seed))


def capture(layer):
    """{"args", "kwargs", "out"} of layer's next call, as its forward saw them (after our hooks)."""
    seen = {}
    layer.register_forward_hook(lambda m, args, kwargs, out: seen.update(
        args=args, kwargs=kwargs, out=out), with_kwargs=True)
    return seen


def timm_written_out(attn, x, mask, extra=0.0):
    """timm's Attention written out from its weights: softmax(Q K^T / sqrt(d) + log sigmoid(M)
    [+ extra]) V, then proj. x (B, n, C), mask (H, N, N). Returns the output (B, n, C) and p
    (B, H, n, n)."""
    B, n, C = x.shape
    q, k, v = F.linear(x, attn.qkv.weight, attn.qkv.bias).view(B, n, 3, attn.num_heads, -1).permute(
        2, 0, 3, 1, 4)                                                     # (B, H, n, d) each
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + F.logsigmoid(mask[:, :n, :n]) + extra
    p = logits.softmax(dim=-1)
    return attn.proj((p @ v).transpose(1, 2).reshape(B, n, C)), p


def attention_maps(name, model, inputs):
    """Each layer's attention probabilities (B, H, n, n): transformers' output_attentions (the
    patched attention returns its weights); for timm written out from each layer's input."""
    if name != "timm_vit":
        return model(**inputs, output_attentions=True).attentions
    seen = [capture(block.attn) for block in model.blocks]
    model(**inputs)
    return [timm_written_out(block.attn, s["kwargs"]["x"], block.attn.mask)[1]
            for block, s in zip(model.blocks, seen)]


# ----------------------------------------------------------------------------------------------
# What the patched model computes
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_constant_mask_leaves_the_stock_model_unchanged(name, training):
    """M = +10 everywhere moves every logit by log sigmoid(10), which softmax cancels; the causal
    and padding masks stay (GPT-2's and Llama's stock attention is causal)."""
    _, heads, n, _, make_inputs, _ = MODELS[name]
    model = build(name).train(training)
    stock = copy.deepcopy(model)
    maskprior.add_mask_prior(model, torch.full((heads, n, n), maskprior.OPEN))
    inputs = make_inputs(3)
    if name == "bert":                                   # one padded sequence
        inputs["attention_mask"] = torch.tensor([[1] * TEXT_LEN] * 2 + [[1] * 4 + [0] * 2])
    with torch.no_grad():
        torch.testing.assert_close(run(model, inputs), run(stock, inputs), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(MODELS))
def test_pattern_puts_less_than_1e_3_of_the_attention_on_closed_keys(name):
    _, heads, n, _, make_inputs, _ = MODELS[name]
    model = build(name)
    maskprior.add_mask_prior(model, band(heads, n))
    closed = band(heads, n)[0] < 0                                     # (N, N)
    with torch.no_grad():
        maps = attention_maps(name, model, make_inputs(3))
    assert len(maps) == LAYERS
    for p in maps:                                                      # (B, H, n, n)
        m = p.shape[-1]
        assert p.shape[1] == heads
        assert (p * closed[:m, :m]).sum(-1).max() < 1e-3
        assert (p * ~closed[:m, :m]).sum(-1).min() > 0.999


@pytest.mark.parametrize("name", list(MODELS))
def test_patched_layer_computes_the_section_4_1_attention(name):
    """The second layer's output against the written-out softmax(Q K^T / sqrt(d) + log sigmoid(M)
    [+ the causal mask]) V of the same weights: timm's by hand; a transformers layer's by a copy of
    the stock layer on transformers' eager attention (the formula written out there), given the
    bias and the model's own causal mask as its additive attention_mask."""
    _, heads, n, _, make_inputs, _ = MODELS[name]
    model = build(name)
    masks = random_masks(heads, n).double()
    patched = maskprior.add_mask_prior(model, masks)
    eager_layer = copy.deepcopy(patched[1])          # its own config: eager, M unused
    seen = capture(patched[1])
    with torch.no_grad():
        run(model, make_inputs(3))
        if name == "timm_vit":
            expected, _ = timm_written_out(patched[1], seen["kwargs"]["x"], masks[1])
            actual = seen["out"]
        else:
            eager_layer.config._attn_implementation = "eager"
            call = inspect.signature(eager_layer.forward).bind(*seen["args"], **seen["kwargs"])
            call.arguments["cache"] = None                # the model's cache holds these keys
            m = TEXT_LEN if n == TEXT_N else n
            causal = call.arguments.get("attention_mask")               # (B, 1, n, n) or None
            bias = F.logsigmoid(masks[1][:, :m, :m])                    # (H, n, n)
            call.arguments["attention_mask"] = bias if causal is None else causal + bias
            expected, actual = eager_layer(*call.args, **call.kwargs)[0], seen["out"][0]
    assert (masks[1] != masks[0]).any()
    torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_causal_mask_holds_under_a_prior_that_opens_the_future(name):
    """M open on and above the diagonal, closed below: without the causal mask each token would
    look at later ones; with it, all its attention is on itself, and later tokens change nothing."""
    _, heads, n, _, make_inputs, _ = MODELS[name]
    model = build(name)
    i = torch.arange(n)
    maskprior.add_mask_prior(model, torch.where(i[None, :] >= i[:, None], 10.0, -10.0).expand(
        heads, n, n))
    inputs = make_inputs(2)
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
    model = build("bert").eval()
    maskprior.add_mask_prior(model, random_masks(2, TEXT_N))
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
    model = build("timm_vit")
    masks = random_masks(2, IMAGE_N).double()
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


def test_llama_with_its_cache_gives_the_full_forward_pass():
    """Cached decoding: 2 new queries after 4 cached keys are the last 2 rows of the prior."""
    model = build("llama").eval()
    maskprior.add_mask_prior(model, random_masks(4, TEXT_N))
    ids = torch.randint(1, VOCAB, (1, TEXT_LEN))
    with torch.no_grad():
        cache = model(input_ids=ids[:, :4], use_cache=True).cache
        step = model(input_ids=ids[:, 4:], cache=cache, use_cache=True).logits      # (1, 2, V)
        torch.testing.assert_close(step, model(input_ids=ids).logits[:, 4:])


# ----------------------------------------------------------------------------------------------
# Training, modes, checkpoints, param_groups
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_one_step_with_param_groups_trains_every_layers_mask(name):
    _, heads, n, _, make_inputs, _ = MODELS[name]
    model = build(name)
    masks = random_masks(heads, n).double()
    patched = maskprior.add_mask_prior(model, masks)
    optimizer = torch.optim.AdamW(maskprior.param_groups(model, weight_decay=0.05), lr=1e-2)
    run(model, make_inputs(2)).square().mean().backward()
    optimizer.step()
    for attn, mask in zip(patched, masks):
        assert attn.mask.grad.abs().max() > 0
        assert not torch.equal(attn.mask.detach(), mask)                     # M moved


@pytest.mark.parametrize("name", list(MODELS))
def test_fixed_mode_leaves_m_frozen(name):
    _, heads, n, _, make_inputs, _ = MODELS[name]
    model = build(name)
    masks = random_masks(heads, n).double()
    patched = maskprior.add_mask_prior(model, masks, mode="fixed")
    optimizer = torch.optim.AdamW(maskprior.param_groups(model, 0.05, mask_decay=0.5), lr=1e-2)
    run(model, make_inputs(2)).square().mean().backward()
    optimizer.step()
    for attn, mask in zip(patched, masks):
        assert not attn.mask.requires_grad and attn.mask.grad is None
        assert torch.equal(attn.mask, mask)


@pytest.mark.parametrize("name", list(MODELS))
def test_state_dict_round_trip_into_a_fresh_patched_model(name):
    _, heads, n, _, make_inputs, _ = MODELS[name]
    model = build(name, seed=0)
    maskprior.add_mask_prior(model, random_masks(heads, n))
    state = model.state_dict()
    assert len([key for key in state if key.endswith(".mask")]) == LAYERS
    fresh = build(name, seed=5)
    maskprior.add_mask_prior(fresh, torch.zeros(heads, n, n))
    inputs = make_inputs(2)
    with torch.no_grad():
        assert not torch.equal(run(fresh.eval(), inputs), run(model.eval(), inputs))
        fresh.load_state_dict(state)
        assert torch.equal(run(fresh, inputs), run(model, inputs))


@pytest.mark.parametrize("name", ["timm_vit", "llama"])
def test_param_groups_hold_each_parameter_once_and_decay_m_by_mask_decay_alone(name):
    """Matrices decay by weight_decay (timm's pos_embed and cls_token not: its no_weight_decay),
    vectors not, M by mask_decay; with M's gradient zero an AdamW step shrinks the matrices and
    leaves M where it was."""
    _, heads, n, _, make_inputs, _ = MODELS[name]
    model = build(name)
    patched = maskprior.add_mask_prior(model, random_masks(heads, n).double())
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


def test_param_groups_work_with_timms_optimizer_factory():
    model = build("timm_vit")
    maskprior.add_mask_prior(model, band(2, IMAGE_N))
    groups = maskprior.param_groups(model, weight_decay=0.05, mask_decay=1e-4)
    optimizer = timm.optim.create_optimizer_v2(groups, opt="adamw", lr=1e-3)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.05, 0.0, 1e-4]


def test_param_groups_of_the_projects_own_models_name_their_mask():
    model = maskprior.ViT(16, 4, 10, WIDTH, LAYERS, 2, 64, masks=band(2, IMAGE_N).expand(
        LAYERS, -1, -1, -1), mode="learnable")
    groups = maskprior.param_groups(model, 0.05, mask_decay=1e-3)
    assert [p is attn.mask for p, attn in zip(groups[-1]["params"],
                                              maskprior.attention_modules(model))] == [True] * LAYERS
    assert groups[-1]["weight_decay"] == 1e-3


# ----------------------------------------------------------------------------------------------
# Refusals, each one ValueError naming the module
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_wrong_head_count_and_layer_count_are_refused(name):
    _, heads, n, _, _, first = MODELS[name]
    message = re.escape(first) + rf".*\({heads + 1}, {n}, {n}\).*num_heads={heads}"
    with pytest.raises(ValueError, match=message):
        maskprior.add_mask_prior(build(name), torch.zeros(heads + 1, n, n))
    with pytest.raises(ValueError, match=rf"layers = {LAYERS}.*\(3, {heads}, {n}, {n}\)"):
        maskprior.add_mask_prior(build(name), torch.zeros(3, heads, n, n))


@pytest.mark.parametrize("name", ["timm_vit", "gpt2", "hf_vit", "bert", "llama"])
def test_sequence_longer_than_the_mask_is_refused_at_forward_time(name):
    _, heads, n, _, make_inputs, first = MODELS[name]
    model = build(name)
    short = 3 if name.endswith("vit") else TEXT_LEN - 1
    maskprior.add_mask_prior(model, torch.zeros(heads, short, short))
    message = re.escape(first) + rf".*\({heads}, {short}, {short}\).*at most {short}"
    with pytest.raises(ValueError, match=message):
        run(model, make_inputs(1))


def test_transformers_model_off_the_attention_interface_is_refused():
    model = BloomForCausalLM(BloomConfig(n_layer=LAYERS, hidden_size=WIDTH, n_head=2,
                                         vocab_size=VOCAB))
    with pytest.raises(ValueError, match="BloomForCausalLM's attention does not go through "
                                         "transformers' AttentionInterface"):
        maskprior.add_mask_prior(model, torch.zeros(2, TEXT_N, TEXT_N))
    assert model.config._attn_implementation != maskprior.MASK_PRIOR_ATTENTION


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


def test_importing_maskprior_imports_neither_timm_nor_transformers():
    code = "import sys, maskprior; print(sorted({'timm', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr
