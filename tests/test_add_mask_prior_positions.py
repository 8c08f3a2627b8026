"""maskprior.add_mask_prior in what users do next with a Hugging Face model, on tiny models built
from configs (no download): M is indexed by the positions the model uses, so cached generation
(dynamic, static, sliding-window and hybrid caches), left padding, beam search, offsets and chunked
prefill read the entries of M that the no-cache run of the same tokens reads, and give its tokens
and logits; a position past M's N is a ValueError on every path. A part of a model (its ModuleList,
one layer) takes the prior in exactly those layers; switching the attention implementation away is
refused; save_pretrained and maskprior.from_pretrained restore a trained prior, exactly the layers
the weight files record, and refuse a damaged or edited folder by layer; cross-attention is left unpatched."""
import copy
import inspect
import json
import os

import pytest
import torch
import torch.nn.functional as F

import maskprior

T = pytest.importorskip("transformers", reason="needs the test extras (pip install .[test]): Hugging Face transformers")

VOCAB, WIDTH, LAYERS = 64, 32, 2
N = 16                  # M covers positions 0..15: a prompt of 5 and 8 new tokens fit, 13 do not
PROMPT, NEW = 5, 8
GREEDY = dict(do_sample=False, pad_token_id=0)
# The models are tiny: a second torch thread only waits on the first (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def decoder(config_class, model_class, **overrides):
    """A decoder of the Llama line: 4 query heads on 2 K/V heads (grouped-query attention)."""
    settings = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=LAYERS,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    bos_token_id=0, eos_token_id=VOCAB, pad_token_id=0)   # eos outside the vocabulary:
    return model_class(config_class(**{**settings, **overrides}))       # every run makes NEW tokens


def gpt2(**overrides):
    settings = dict(n_layer=LAYERS, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=64, bos_token_id=0,
                    eos_token_id=VOCAB, pad_token_id=0)
    return T.GPT2LMHeadModel(T.GPT2Config(**{**settings, **overrides}))


MODELS = {  # name: build; Mistral's window of 4 and Gemma3's sliding layer are passed by 13 tokens
    "gpt2": gpt2,
    "llama": lambda: decoder(T.LlamaConfig, T.LlamaForCausalLM),
    "mistral": lambda: decoder(T.MistralConfig, T.MistralForCausalLM, sliding_window=4),
    "gemma3": lambda: decoder(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"]),
}


def heads(model):
    return model.config.num_attention_heads


def position_dependent_masks(model, seed=1):
    """(layers, heads, N, N) random logits: every position pair has its own prior."""
    return 3 * torch.randn(LAYERS, heads(model), N, N, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(MODELS))
def patched(request):
    """(name, the model with a position-dependent prior, a prompt (1, 5), its no-cache greedy
    continuation (1, 13) and the no-cache logits at every position (1, 13, V))."""
    torch.manual_seed(0)
    model = MODELS[request.param]().eval()
    maskprior.add_mask_prior(model, position_dependent_masks(model))
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()          # one thread here too: the tests' fixture comes later
    torch.set_num_threads(1)
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=NEW, use_cache=False, **GREEDY)
        logits = model(reference, use_cache=False).logits
    torch.set_num_threads(threads)
    return request.param, model, prompt, reference, logits


def step_logits(out, row=0):
    """The logits of each generated token, (NEW, V), from generate(output_logits=True)."""
    return torch.stack([step[row] for step in out.logits])


# ----------------------------------------------------------------------------------------------
# Cached and padded runs equal the no-cache run of the same tokens
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_generation_gives_the_no_cache_tokens_and_logits(patched, cache):
    """Each step's queries read M's rows at their positions, its keys (the cache's buffer, a
    sliding window's last keys) the columns at theirs: the tokens and logits of use_cache=False."""
    _, model, prompt, reference, logits = patched
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=NEW, cache_implementation=cache, output_logits=True,
                             return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, reference)
    torch.testing.assert_close(step_logits(out), logits[0, PROMPT - 1:-1], rtol=0, atol=1e-4)


def test_cached_generation_reads_an_m_stored_column_major_by_its_indices():
    """add_mask_prior keeps M's memory layout (clone keeps a dense tensor's strides), and so does the
    table of log sigmoid(s M) a cached step reads its row from: M stored column-major gives the
    cached steps the no-cache tokens and logits, as a row-major M does."""
    torch.manual_seed(0)
    model = gpt2().eval()
    column_major = position_dependent_masks(model).transpose(-1, -2).contiguous().transpose(-1, -2)
    maskprior.add_mask_prior(model, column_major)
    assert model.transformer.h[0].attn.mask.stride()[-2:] == (1, N)
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=NEW, use_cache=False, **GREEDY)
        logits = model(reference, use_cache=False).logits
        out = model.generate(prompt, max_new_tokens=NEW, output_logits=True, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, reference)
    torch.testing.assert_close(step_logits(out), logits[0, PROMPT - 1:-1], rtol=0, atol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_left_padded_generation_gives_each_prompt_alone(patched, cache):
    """A batch of the prompt left-padded by 3 and a prompt of 8: the padded row reads M at its
    position_ids (0 from its first real token on), not at its slots, and gives the prompt's own
    tokens and logits; the unpadded row gives its own."""
    _, model, prompt, reference, logits = patched
    other = torch.randint(1, VOCAB, (1, PROMPT + 3), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1), other])
    attention_mask = (torch.arange(PROMPT + 3) >= torch.tensor([[3], [0]])).long()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=attention_mask, max_new_tokens=NEW, cache_implementation=cache,
                             output_logits=True, return_dict_in_generate=True, **GREEDY)
        alone = model.generate(other, max_new_tokens=NEW, use_cache=False, **GREEDY)
    assert torch.equal(out.sequences[0, 3:], reference[0])
    torch.testing.assert_close(step_logits(out), logits[0, PROMPT - 1:-1], rtol=0, atol=1e-4)
    assert torch.equal(out.sequences[1], alone[0])


def test_a_batch_s_padded_second_turn_gives_the_no_cache_logits(patched):
    """A batched chat through one cache: turn one with row 0 left-padded by 3, turn two with row 1
    left-padded by 2, so that row's padding lies inside it; position_ids counted from the attention
    mask, as generate counts them. Each cached key reads M at its token's position: turn two gives
    the logits of the two turns run in one piece without a cache (and row 0, padded at its start
    alone, those of its conversation alone)."""
    _, model, _, _, _ = patched
    turns = [torch.randint(1, VOCAB, (2, k), generator=torch.Generator().manual_seed(k)) for k in (8, 4)]
    masks = [torch.ones(2, 8, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)]
    masks[0][0, :3], masks[1][1, :2] = 0, 0
    seen = torch.cat(masks, 1)
    positions = (seen.cumsum(1) - 1).clamp(min=0)
    tokens = torch.cat(turns, 1)
    with torch.no_grad():
        cache = T.DynamicCache(config=model.config)
        model(turns[0], attention_mask=masks[0], position_ids=positions[:, :8], past_key_values=cache, use_cache=True)
        second = model(turns[1], attention_mask=seen, position_ids=positions[:, 8:], past_key_values=cache,
                       use_cache=True).logits
        whole = model(tokens, attention_mask=seen, position_ids=positions, use_cache=False).logits
        alone = model(tokens[:1, 3:], use_cache=False).logits
    torch.testing.assert_close(second[0], whole[0, 8:], rtol=0, atol=1e-4)
    torch.testing.assert_close(second[1, 2:], whole[1, 10:], rtol=0, atol=1e-4)
    torch.testing.assert_close(second[0], alone[0, -4:], rtol=0, atol=1e-4)


def test_right_padded_generation_is_refused_where_the_cached_positions_are_lost():
    """generate after right padding gives a new token the position after the padding's (1, not 5):
    which position each cached token had cannot be read off the step's call, so the cached run is
    refused with the way out, not run at other positions than the run without a cache."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    maskprior.add_mask_prior(model, position_dependent_masks(model))
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones_like(ids)
    attention_mask[0, -3:] = 0
    with pytest.raises(ValueError, match=r"position_ids that do not count the tokens .* pad left"):
        with torch.no_grad():
            model.generate(ids, attention_mask=attention_mask, max_new_tokens=2, **GREEDY)


def test_beam_search_with_its_cache_gives_the_no_cache_beams(patched):
    _, model, prompt, _, _ = patched
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=NEW, num_beams=3, **GREEDY)
        uncached = model.generate(prompt, max_new_tokens=NEW, num_beams=3, use_cache=False, **GREEDY)
    assert torch.equal(cached, uncached)


def test_chunked_prefill_gives_the_one_piece_logits(patched):
    """The 13 tokens fed in chunks of 5, 6 and 2 through one cache (beyond a window of 4: the
    sliding layers' cache drops keys): the logits of the whole sequence in one piece."""
    _, model, _, reference, logits = patched
    with torch.no_grad():
        cache = T.DynamicCache(config=model.config)
        chunks = [model(reference[:, a:b], cache=cache, use_cache=True).logits
                  for a, b in ((0, 5), (5, 11), (11, 13))]
    torch.testing.assert_close(torch.cat(chunks, 1), logits, rtol=0, atol=1e-4)


def test_position_ids_offset_reads_the_shifted_block_of_m():
    """Llama's RoPE scores depend on i - j alone, so a run at position_ids 3..8 is the run at
    0..5 but for the prior: its M block [3:9, 3:9]. The model with that block as its M at 0..5
    gives the same logits; with M unshifted they differ."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    same_weights = copy.deepcopy(model)
    masks = position_dependent_masks(model)
    maskprior.add_mask_prior(model, masks)
    maskprior.add_mask_prior(same_weights, masks[:, :, 3:, 3:].contiguous())
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        offset = model(ids, position_ids=torch.arange(3, 9)[None], use_cache=False).logits
        shifted = same_weights(ids, use_cache=False).logits
        unshifted = model(ids, use_cache=False).logits
    torch.testing.assert_close(offset, shifted, rtol=0, atol=1e-5)
    assert (offset - unshifted).abs().max() > 1e-3


def test_float16_left_padding_with_a_strong_prior_stays_finite():
    """In float16 a blocked entry (the dtype's lowest value, -65504) plus a bias of -50 would be
    -inf; a padded query's row, all blocked, would then be NaN and reach the real tokens through
    0 * NaN. The padded row gives the prompt's own tokens."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval().half()
    maskprior.add_mask_prior(model, torch.full((4, N, N), -5.0), scale=10.0)     # bias -50 everywhere
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=(ids != 0).long(), max_new_tokens=NEW, output_logits=True,
                             return_dict_in_generate=True, **GREEDY)
        alone = model.generate(prompt, max_new_tokens=NEW, use_cache=False, **GREEDY)
    assert torch.isfinite(step_logits(out)).all()
    assert torch.equal(out.sequences[0, 3:], alone[0])


def test_packed_sequences_read_m_at_their_own_positions():
    """Two sequences packed in one row, position_ids 0..3 then 0..2 (transformers masks them apart):
    each reads M from position 0, as it does alone."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    maskprior.add_mask_prior(model, position_dependent_masks(model))
    first, second = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5)).split([4, 3], 1)
    with torch.no_grad():
        packed = model(torch.cat([first, second], 1), position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]),
                       use_cache=False).logits
        alone = torch.cat([model(first, use_cache=False).logits, model(second, use_cache=False).logits], 1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache", [None, "dynamic", "static"])
def test_a_position_past_n_is_refused_on_every_path(patched, cache):
    """The 13th new token after a prompt of 5 is predicted at position 16, past an M of N = 16:
    ValueError naming the first layer, with and without a cache, beyond a sliding window too."""
    name, model, prompt, _, _ = patched
    first = "transformer.h.0.attn" if name == "gpt2" else "model.layers.0.self_attn"
    settings = {"use_cache": False} if cache is None else {"cache_implementation": cache}
    with pytest.raises(ValueError, match=rf"^{first}: mask of shape \({heads(model)}, 16, 16\).*at most 16"
                                         rf".*got position 16"):
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=13, **settings, **GREEDY)


# ----------------------------------------------------------------------------------------------
# Training: the written-out attention, in blocks of query rows
# ----------------------------------------------------------------------------------------------

LONG = 150     # tokens: the trained path's row blocks of 64 are 64, 64 and 22


@pytest.mark.parametrize("build", [lambda: gpt2(n_positions=LONG),
                                   lambda: decoder(T.LlamaConfig, T.LlamaForCausalLM, max_position_embeddings=LONG)],
                         ids=["gpt2", "llama"])
def test_a_trained_m_gets_the_gradients_of_the_eager_attention_over_several_row_blocks(build):
    """A gradient reaching M takes the written-out softmax, a causal layer's in blocks of 64 query rows,
    and the log sigmoid by its own formula. The patched layer's output and the gradients of M, of its
    input and of its weights equal those of the stock layer on the family's eager attention given
    causal + log sigmoid(M) (F.logsigmoid) as its mask, in float64; Llama's 4 query heads share 2 K/V
    heads."""
    n = LONG
    torch.manual_seed(0)
    stock = build().double().eval()     # eval: no dropout; the gradient reaching M still takes the trained path
    model = copy.deepcopy(stock)
    masks = 3 * torch.randn(LAYERS, heads(model), n, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    attn = maskprior.add_mask_prior(model, masks)[1]
    seen = {}
    attn.register_forward_hook(lambda m, args, kwargs, out: seen.update(args=args, kwargs=dict(kwargs)),
                               with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(1, VOCAB, (2, n), generator=torch.Generator().manual_seed(2)), use_cache=False)
    stock.set_attn_implementation("eager")
    stock_attn = stock.get_submodule(attn.mask_prior_name)
    mask = masks[1].clone().requires_grad_()
    causal = torch.zeros(n, n, dtype=torch.float64).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1),
                                                                 torch.finfo(torch.float64).min)
    grad_out = torch.randn(2, n, WIDTH, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    results, args, kwargs = [], seen["args"], seen["kwargs"]      # the model's call: the hook records ours too
    for layer, layer_mask in ((attn, None), (stock_attn, causal + F.logsigmoid(mask))):
        call = inspect.signature(layer.forward).bind(*args, **kwargs)
        hidden = call.args[0].clone().requires_grad_()
        if layer_mask is not None:
            call.arguments["attention_mask"] = layer_mask
        out = layer(hidden, *call.args[1:], **call.kwargs)[0]
        out.backward(grad_out)
        weight = next(p for p in layer.parameters() if p.dim() == 2)
        results.append((out, hidden.grad, weight.grad, layer.mask.grad if layer is attn else mask.grad))
    for what, actual, expected in zip(["output", "input's gradient", "weight's gradient", "M's gradient"], *results):
        torch.testing.assert_close(actual, expected, msg=what)
    assert results[0][3].abs().max() > 0


@pytest.mark.parametrize("device, fused", [("cpu", False), ("meta", True)])
def test_a_trained_m_takes_the_fused_kernel_off_the_cpu_only(monkeypatch, device, fused):
    """The CPU's fused SDPA kernels give a mask no gradient, so there a trained M's attention is
    written out; off the CPU (CUDA: its memory-efficient kernel gives one) it goes to
    F.scaled_dot_product_attention with the bias in its mask. The meta device stands in for CUDA:
    the dispatch reads the device's type. Either way the bias gets its gradient."""
    model = gpt2()
    attn = maskprior.add_mask_prior(model, torch.zeros(2, 8, 8))[0]
    query, key, value = (torch.randn(1, 2, 8, 16, device=device) for _ in range(3))
    bias = torch.zeros(1, 2, 8, 8, device=device, requires_grad=True)
    object.__setattr__(attn, "mask_prior_bias", bias)      # as the layer's pre-hook leaves it
    calls, kernel = [], F.scaled_dot_product_attention
    monkeypatch.setattr(maskprior.F, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(kwargs["attn_mask"]) or kernel(*args, **kwargs))
    output, _ = maskprior._mask_prior_attention(attn, query, key, value, None, scaling=0.25)
    assert output.shape == (1, 8, 2, 16) and output.device.type == device
    assert len(calls) == fused
    if fused:   # the bias, the causal -inf added, reaches the kernel with its gradient
        assert calls[0].requires_grad and calls[0].shape == (1, 2, 8, 8)
    output.sum().backward()
    assert bias.grad is not None and bias.grad.shape == bias.shape


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_trained_m_under_bf16_autocast_trains_as_in_float32(name):
    """Under CPU autocast the scores come in bfloat16 and the bias log sigmoid(M) in float32 (M keeps the
    model's dtype): the trained path gives float32's loss to bfloat16's precision, and a finite
    gradient of M."""
    torch.manual_seed(0)
    model = MODELS[name]().train()
    [attn, _] = maskprior.add_mask_prior(model, position_dependent_masks(model))
    ids = torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(5))
    loss = model(ids, labels=ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model(ids, labels=ids).loss
    low.backward()
    torch.testing.assert_close(low.float(), loss.detach(), rtol=2e-2, atol=0)
    assert attn.mask.grad.isfinite().all() and attn.mask.grad.abs().max() > 0


# ----------------------------------------------------------------------------------------------
# A part of a model, and a switch of its attention implementation
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, part", [("llama", "model.layers"), ("gpt2", "transformer.h")])
def test_patching_the_layers_equals_patching_the_model_and_trains_m(name, part):
    torch.manual_seed(0)
    stock = MODELS[name]().eval()
    whole, layers_only = copy.deepcopy(stock), copy.deepcopy(stock)
    masks = position_dependent_masks(stock)
    maskprior.add_mask_prior(whole, masks)
    patched = maskprior.add_mask_prior(layers_only.get_submodule(part), masks)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    logits = layers_only(ids).logits
    torch.testing.assert_close(logits, whole(ids).logits, rtol=0, atol=1e-6)
    assert (logits - stock(ids).logits).abs().max() > 1e-3
    logits.square().mean().backward()
    assert all(attn.mask.grad.abs().max() > 0 for attn in patched)


def test_patching_one_layer_puts_the_prior_in_that_layer_alone():
    """add_mask_prior(model.model.layers[1], M): the model with M in layer 1 and a constant
    (neutral) M in layer 0; layer 0 has no M, and only layer 1's M trains."""
    torch.manual_seed(0)
    stock = MODELS["llama"]().eval()
    one, reference = copy.deepcopy(stock), copy.deepcopy(stock)
    masks = position_dependent_masks(stock)
    [attn] = maskprior.add_mask_prior(one.model.layers[1], masks[1])
    maskprior.add_mask_prior(reference, torch.stack([torch.full_like(masks[0], maskprior.OPEN), masks[1]]))
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    logits = one(ids).logits
    torch.testing.assert_close(logits, reference(ids).logits, rtol=0, atol=1e-5)
    assert not hasattr(one.model.layers[0].self_attn, "mask")
    logits.square().mean().backward()
    assert attn.mask.grad.abs().max() > 0


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_switching_the_attention_implementation_is_refused_until_switched_back(implementation):
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    maskprior.add_mask_prior(model, position_dependent_masks(model))
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = model(ids).logits
        model.set_attn_implementation(implementation)
        with pytest.raises(ValueError, match=rf"^model\.layers\.0\.self_attn has a mask prior, which needs "
                                             rf"attn_implementation='mask_prior'; got '{implementation}'"):
            model(ids)
        model.set_attn_implementation(maskprior.MASK_PRIOR_ATTENTION)
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# save_pretrained and maskprior.from_pretrained
# ----------------------------------------------------------------------------------------------

def test_from_pretrained_restores_a_trained_prior_and_a_plain_load_does_not(tmp_path):
    """A Llama with the GPT prior (scale 10) after one training step: its weight files record it;
    maskprior.from_pretrained gives back M, scale, mode and the logits (also into the headless
    LlamaModel, whose names lack the "model." prefix); a plain from_pretrained has no prior."""
    torch.manual_seed(0)
    model = MODELS["llama"]()
    patched = maskprior.add_mask_prior(model, maskprior.relative_distance_mask(4, N), scale=10.0)
    optimizer = torch.optim.AdamW(maskprior.param_groups(model, 0.1), lr=1e-2)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    model.save_pretrained(tmp_path)
    assert "mask_prior" not in (tmp_path / "config.json").read_text()
    from safetensors.torch import load_file
    weights = load_file(tmp_path / "model.safetensors")
    records = {key: json.loads(bytes(t.tolist())) for key, t in weights.items() if key.endswith(".mask_record")}
    assert records == {f"model.layers.{i}.self_attn.mask_record": {"scale": 10.0, "mode": "learnable"}
                       for i in range(LAYERS)}
    classes = (T.LlamaForCausalLM, T.LlamaModel)
    ignored = [vars(cls).get("_keys_to_ignore_on_load_unexpected", "inherited") for cls in classes]
    loaded = maskprior.from_pretrained(T.LlamaForCausalLM, tmp_path)
    headless = maskprior.from_pretrained(T.LlamaModel, tmp_path)
    # the classes as they were: from_pretrained ignores the masks for its own load alone
    assert [vars(cls).get("_keys_to_ignore_on_load_unexpected", "inherited") for cls in classes] == ignored
    plain = T.LlamaForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = model.eval()(ids).logits
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(headless(ids).last_hidden_state, model.model(ids).last_hidden_state,
                                   rtol=0, atol=1e-5)
        assert (plain(ids).logits - expected).abs().max() > 1e-3
    for attn, restored in zip(patched, [layer.self_attn for layer in loaded.model.layers]):
        assert torch.equal(restored.mask, attn.mask) and restored.mask.requires_grad
        assert restored.mask_scale == 10.0
    assert not any(hasattr(m, "mask") for m in plain.modules())


def test_from_pretrained_restores_a_partial_fixed_patch(tmp_path):
    torch.manual_seed(0)
    model = MODELS["gpt2"]().eval()
    masks = position_dependent_masks(model)
    maskprior.add_mask_prior(model.transformer.h[1], masks[1], mode="fixed")
    model.save_pretrained(tmp_path)
    loaded = maskprior.from_pretrained(T.GPT2LMHeadModel, tmp_path)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
    assert not hasattr(loaded.transformer.h[0].attn, "mask")
    assert torch.equal(loaded.transformer.h[1].attn.mask, masks[1])
    assert not loaded.transformer.h[1].attn.mask.requires_grad


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A folder save_pretrained wrote for the Llama with a prior in both layers, and that model."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    maskprior.add_mask_prior(model, position_dependent_masks(model), scale=2.0)
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    return folder, model


def edited_copy(folder, tmp_path, weights=None, record=None):
    """A copy of the saved folder with its weights edited by weights(dict of tensors) and each layer's
    record by record(dict), in place."""
    from safetensors.torch import load_file, save_file
    copy_dir = tmp_path / "edited"
    copy_dir.mkdir()
    for file in folder.iterdir():
        (copy_dir / file.name).write_bytes(file.read_bytes())
    tensors = load_file(copy_dir / "model.safetensors")
    if weights:
        weights(tensors)
    for key in [key for key in tensors if record and key.endswith(".mask_record")]:
        edited = json.loads(bytes(tensors[key].tolist()))
        record(edited)
        tensors[key] = torch.tensor(list(json.dumps(edited).encode()), dtype=torch.uint8)
    save_file(tensors, copy_dir / "model.safetensors", metadata={"format": "pt"})
    return copy_dir


def record_of(scale, mode):
    """A layer's record as _write_record writes it into the weights."""
    return torch.tensor(list(json.dumps({"scale": scale, "mode": mode}).encode()), dtype=torch.uint8)


EDITS = {  # name: (weights edit, the message's pattern)
    "missing_m": (lambda t: t.pop("model.layers.1.self_attn.mask"),
                  r"the weight files hold a record but no M for layer 'model\.layers\.1\.self_attn'"),
    "every_m_missing": (lambda t: [t.pop(f"model.layers.{i}.self_attn.mask") for i in range(LAYERS)],
                        r"hold a record but no M for layer 'model\.layers\.0\.self_attn'"),
    "missing_record": (lambda t: t.pop("model.layers.1.self_attn.mask_record"),
                       r"hold an M but no record \(scale, mode\) for layer 'model\.layers\.1\.self_attn'"),
    "every_record_missing": (lambda t: [t.pop(f"model.layers.{i}.self_attn.mask_record") for i in range(LAYERS)],
                             r"hold an M but no record \(scale, mode\) for layer 'model\.layers\.0\.self_attn'"),
    "m_for_a_layer_the_model_lacks": (
        lambda t: t.update({"model.layers.1.mlp.mask": torch.zeros(4, 16, 16),
                            "model.layers.1.mlp.mask_record": record_of(2.0, "learnable")}),
        r"hold an M \(4, 16, 16\) but the LlamaForCausalLM has no self-attention layer of that name"),
    "m_of_another_head_count": (lambda t: t.update({"model.layers.0.self_attn.mask": torch.zeros(3, 16, 16)}),
                                r"model\.layers\.0\.self_attn: mask of shape \(3, 16, 16\) does not fit"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_from_pretrained_refuses_an_edited_or_damaged_folder_by_layer(saved_llama, tmp_path, edit):
    """A saved prior loads whole or not at all: each M needs its record and each record its M, for
    a self-attention layer M fits; else one ValueError naming the layer and what differs (a plain
    from_pretrained of the same folder would run without the prior, or with part of it)."""
    folder, _ = saved_llama
    weights, message = EDITS[edit]
    with pytest.raises(ValueError, match=message):
        maskprior.from_pretrained(T.LlamaForCausalLM, edited_copy(folder, tmp_path, weights))


def test_from_pretrained_takes_scale_and_mode_from_the_record(saved_llama, tmp_path):
    """The record, not a default, sets each layer's scale and mode: edited to scale 3 and fixed, the
    loaded layers hold scale 3 and a frozen M, and the logits differ from the saved model's."""
    folder, model = saved_llama
    loaded = maskprior.from_pretrained(T.LlamaForCausalLM, folder)
    edited = maskprior.from_pretrained(T.LlamaForCausalLM, edited_copy(
        folder, tmp_path, record=lambda r: r.update(scale=3.0, mode="fixed")))
    ids = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5))
    assert [layer.self_attn.mask_scale for layer in loaded.model.layers] == [2.0, 2.0]
    assert [layer.self_attn.mask_scale for layer in edited.model.layers] == [3.0, 3.0]
    assert all(layer.self_attn.mask.requires_grad for layer in loaded.model.layers)
    assert not any(layer.self_attn.mask.requires_grad for layer in edited.model.layers)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)
        assert (edited(ids).logits - model(ids).logits).abs().max() > 1e-3


def test_parts_patched_in_separate_calls_each_keep_their_own_prior(tmp_path):
    """Two layers patched one by one, of two scales and modes, each record their own: save_pretrained
    and maskprior.from_pretrained give back both, and the logits."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    masks = position_dependent_masks(model)
    maskprior.add_mask_prior(model.model.layers[0], masks[0], scale=2.0)
    maskprior.add_mask_prior(model.model.layers[1], masks[1], scale=3.0, mode="fixed")
    model.save_pretrained(tmp_path)
    loaded = maskprior.from_pretrained(T.LlamaForCausalLM, tmp_path)
    layers = [layer.self_attn for layer in loaded.model.layers]
    assert [(a.mask_scale, a.mask.requires_grad) for a in layers] == [(2.0, True), (3.0, False)]
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_from_pretrained_refuses_a_model_saved_without_a_prior(tmp_path):
    MODELS["gpt2"]().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds no mask prior: load it with GPT2LMHeadModel\.from_pretrained"):
        maskprior.from_pretrained(T.GPT2LMHeadModel, tmp_path)
    assert os.path.exists(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"reads a directory written by save_pretrained"):
        maskprior.from_pretrained(T.GPT2LMHeadModel, tmp_path / "elsewhere")


# ----------------------------------------------------------------------------------------------
# Cross-attention stays as it was
# ----------------------------------------------------------------------------------------------

def test_gpt2_cross_attention_is_left_unpatched():
    """GPT-2 with add_cross_attention: its crossattention layers keep no M and read the encoder's
    states of any length, as the stock model's do, while the self-attention takes the prior."""
    torch.manual_seed(0)
    stock = gpt2(add_cross_attention=True).eval()
    model = copy.deepcopy(stock)
    patched = maskprior.add_mask_prior(model, torch.full((2, N, N), maskprior.OPEN))
    assert [attn.mask_prior_name for attn in patched] == [f"transformer.h.{i}.attn" for i in range(LAYERS)]
    assert not any(hasattr(layer.crossattention, "mask") for layer in model.transformer.h)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    memory = torch.randn(2, 9, WIDTH, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, encoder_hidden_states=memory).logits,
                                   stock(ids, encoder_hidden_states=memory).logits, rtol=1e-4, atol=1e-5)
