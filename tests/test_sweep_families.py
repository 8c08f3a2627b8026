"""add_mask_prior across transformers' families, as tests/sweep_transformers.py sweeps them all: a
representative subset, one family of each kind and each rule (decoders with RoPE, learned positions,
sliding windows, MoE; a decoder whose layers are handed no positions; an encoder, an encoder-decoder,
a composite's language model; vision models; families refused at the patch), each right against the unpatched model
with log sigmoid(s M) in its float mask, or refused with a ValueError naming the family and why.
Plus the rules the sweep found: a layer its model hands no position_ids reads M at the model call's
(through deepcopy too), and a model that shuffles its patches is refused."""
import copy
import os
import sys

import pytest
import torch

import maskprior

T = pytest.importorskip("transformers",
                        reason="needs the test extras (pip install .[test]): Hugging Face transformers")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sweep_transformers as sweep  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

# model type: the outcome the sweep must give it, and a phrase of its detail
SUBSET = {
    "llama": ("right", "decoder"),                  # RoPE, grouped-query attention
    "gpt2": ("right", "decoder"),                   # learned positions
    "gpt_bigcode": ("right", "decoder"),            # its layers get no position_ids
    "mistral": ("right", "decoder"),                # a sliding window
    "qwen3_moe": ("right", "decoder"),              # MoE
    "bert": ("right", "decoder"),                   # BERT's line as a decoder (is_decoder)
    "clip_text_model": ("right", "encoder"),        # a padded batch
    "t5gemma": ("right", "encoder"),                # an encoder-decoder
    "smolvlm": ("right", "composite"),              # a vision-language model's language model
    "clip": ("right", "composite"),                 # a dual encoder, run with an image: its text tower patched
    "qwen2_vl": ("right", "composite"),             # mRoPE sections from its tester
    "deepseek_v3": ("right", "decoder"),            # multi-head latent attention, its tester's dimensions
    "parakeet_encoder": ("right", "audio (input_features)"),   # log-mel features time first
    "vit": ("right", "vision, 17 tokens"),          # class token + 4 x 4 patches
    "clip_vision_model": ("right", "vision, 17 tokens"),
    "siglip_vision_model": ("right", "vision, 16 tokens"),  # its pooling head's probe attention left unpatched
    "yolos": ("right", "vision, 27 tokens"),        # class token + 4 x 4 patches + 10 detection tokens after them
    "pixtral": ("right", "16 tokens an image, 2 images packed"),   # one sequence, M at each image's own places
    "vit_mae": ("refused", "shuffles its patches"),
    "sam3_vit_model": ("refused", "hidden states as a grid"),   # (B, rows, cols, C), windows of the grid
    "diffllama": ("refused", "calls its attention function twice"),
    "detr": ("refused", "grid follows each image's size"),    # a backbone's feature map of each image's size
    "align_text_model": ("refused", "_supports_attention_backend"),
}


@pytest.mark.parametrize("model_type", list(SUBSET))
def test_a_family_is_right_against_the_float_mask_reference_or_refused_by_name(model_type):
    outcome, phrase = SUBSET[model_type]
    got, detail = sweep.check_family(model_type)
    assert (got, phrase in detail) == (outcome, True), detail
    assert (got == "right") == detail.endswith("; saved and loaded back"), detail
    if got == "refused":            # the family's layer class, by name
        assert type(sweep.tiny_config(model_type)).__name__.removesuffix("Config")[:5].lower() in detail.lower()


def test_the_sweep_finds_a_layer_reading_m_at_its_cache_slots(monkeypatch):
    """With the model's position_ids kept from its layers, GPTBigCode's left-padded row reads M at its
    padded slots: the sweep reports it WRONG, so a right above is not a check that cannot fail."""
    monkeypatch.setattr(maskprior, "_remember_positions",
                        lambda model, args, kwargs: model.mask_prior_positions.update(position_ids=None))
    outcome, detail = sweep.check_family("gpt_bigcode")
    assert outcome == "WRONG" and "left-padded" in detail, detail


def test_the_sweep_finds_cached_keys_read_as_if_no_padding_lay_inside_a_row(monkeypatch):
    """The layers' pre-hook kept from the model's attention mask: a cached key is then taken to lie as
    many positions before the queries as slots, and the second turn padded inside row 1 reads M
    off by the padding: the sweep reports it WRONG."""
    hook = maskprior._add_mask_prior_to_transformers_call
    monkeypatch.setattr(maskprior, "_add_mask_prior_to_transformers_call", lambda attn, args, kwargs: hook(
        attn, args, {key: value for key, value in kwargs.items() if key != "attention_mask"}))
    outcome, detail = sweep.check_family("llama")
    assert outcome == "WRONG" and "second turn" in detail, detail


def test_the_sweep_finds_a_folder_that_loads_back_another_prior(monkeypatch):
    """A record of another scale written into the folder: the sweep's round trip through
    save_pretrained and maskprior.from_pretrained reports it, so its "saved and loaded back" can fail."""
    write = maskprior._write_record
    def doubled(attn, state_dict, prefix, metadata):
        attn.mask_scale *= 2
        write(attn, state_dict, prefix, metadata)
        attn.mask_scale /= 2
    monkeypatch.setattr(maskprior, "_write_record", doubled)
    outcome, detail = sweep.check_family("llama")
    assert outcome == "FAILS" and "saved and loaded back by maskprior.from_pretrained, differs" in detail, detail


def bigcode():
    torch.manual_seed(0)
    return T.GPTBigCodeForCausalLM(T.GPTBigCodeConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
                                                      eos_token_id=64, pad_token_id=0)).eval()


@pytest.mark.parametrize("how", ["patched", "deepcopy", "from_pretrained"])
def test_a_left_padded_row_of_a_family_without_layer_positions_equals_its_prompt_alone(how, tmp_path):
    """GPTBigCode hands position_ids to its embeddings alone; generate counts them from the attention
    mask. The row left-padded by 3 reads M[i, j], as its prompt alone does, not M[3 + i, 3 + j]: the
    same greedy tokens and logits (also in a deepcopy, whose layers read the copy's model's call, and
    in the model maskprior.from_pretrained loads)."""
    model = bigcode()
    maskprior.add_mask_prior(model, 3 * torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(1)))
    if how == "deepcopy":
        model = copy.deepcopy(model)
    elif how == "from_pretrained":
        model.save_pretrained(tmp_path)
        model = maskprior.from_pretrained(T.GPTBigCodeForCausalLM, tmp_path).eval()
    prompt = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(3))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        alone = model.generate(prompt, **greedy)
        left = model.generate(padded, attention_mask=(padded != 0).long(), **greedy)
    assert torch.equal(left.sequences[:, 3:], alone.sequences)
    torch.testing.assert_close(torch.stack(left.logits), torch.stack(alone.logits), rtol=0, atol=1e-4)


def test_vit_mae_is_refused_at_any_mask_ratio():
    """ViTMAE orders its patches by argsort(noise) before its layers, even at mask_ratio 0 (ids_restore
    is not the identity): refused at the patch, saying so."""
    model = T.ViTMAEModel(T.ViTMAEConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=64, image_size=32, patch_size=8, mask_ratio=0.0)).eval()
    with torch.no_grad():
        order = model(torch.randn(1, 3, 32, 32)).ids_restore
    assert not torch.equal(order[0], torch.arange(16))
    with pytest.raises(ValueError, match="ViTMAEAttention shuffles its patches"):
        maskprior.add_mask_prior(model, torch.zeros(4, 17, 17))
    assert not any(hasattr(m, "mask") for m in model.modules())


@pytest.mark.parametrize("family", ["gpt_bigcode", "ctrl", "gpt2"])
def test_the_layers_of_a_model_that_hands_them_no_positions_are_refused_when_patched_alone(family):
    """add_mask_prior(model.transformer.h, M): GPTBigCode's and CTRL's models give position_ids to their
    position embeddings alone, so their layers patched without the model would read M at a left-padded
    row's cache slots: the first forward is a ValueError naming the layer's class and saying to patch the
    model. GPT-2's model hands its layers position_ids: its left-padded row equals its prompt alone."""
    config = sweep.tiny_config(family)
    torch.manual_seed(0)
    model = sweep.model_class(family, config)[1](config).eval()
    [attn, _] = maskprior.add_mask_prior(model.transformer.h, 3 * torch.randn(2, 4, 16, 16))
    prompt = torch.randint(3, 99, (1, 5), generator=torch.Generator().manual_seed(3))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)
    real = (padded != 0).long()
    with torch.no_grad():
        if family != "gpt2":
            with pytest.raises(ValueError, match=f"{type(attn).__name__}'s model hands its layers no position_ids.*"
                                                 f"patch the model"):
                model(padded, attention_mask=real, position_ids=(real.cumsum(1) - 1).clamp(min=0))
            return
        alone = model(prompt).logits
        left = model(padded, attention_mask=real, position_ids=(real.cumsum(1) - 1).clamp(min=0)).logits[:, 3:]
    torch.testing.assert_close(left, alone, rtol=0, atol=1e-4)


def test_a_layer_over_a_grid_of_hidden_states_is_refused_at_the_patch():
    """SAM3's ViT takes (B, rows, cols, C) hidden states and attends within windows of the grid in most
    layers: refused at add_mask_prior, naming the layer class, and nothing patched."""
    config = sweep.tiny_config("sam3_vit_model")
    model = sweep.model_class("sam3_vit_model", config)[1](config).eval()
    with pytest.raises(ValueError, match="Sam3ViTRoPEAttention takes its hidden states as a grid"):
        maskprior.add_mask_prior(model, torch.zeros(4, 16, 16))
    assert not any(hasattr(m, "mask") for m in model.modules())

