"""Every transformers family on the AttentionInterface, built tiny, right or refused by add_mask_prior.

    OMP_NUM_THREADS=1 python tests/sweep_transformers.py [--only TYPE,...] [--out FILE]

A family is a model type of the installed transformers (its CONFIG_MAPPING) whose modeling file runs
its attention through the AttentionInterface (ALL_ATTENTION_FUNCTIONS). Each is built tiny from its
config class: the defaults with the size fields shrunk (SMALL), per-family fixes in OVERRIDES where
transformers' own model testers (tests/models/*/test_modeling_*.py of huggingface/transformers) build
them otherwise. Then, by kind:
  decoder  (a *ForCausalLM): a plain forward; a batch with a row left-padded by 3, position_ids from
           the attention mask; cached greedy generation from that batch, each step's logits against the
           no-cache forward of the row's tokens alone; a second turn through the cache, padded inside
           the other row, against the two turns in one piece (second_turn);
  encoder  (a base model on input_ids): a batch with a row right-padded by 3; a composite (input_ids
           and pixel_values: towers of their own N) the same, its language model patched alone;
  vision   (a base model on pixel_values): a batch of images, M over every token the layers see (over
           one image's where they see the batch's images packed into one sequence, Pixtral's: the reference
           reads M at each token's place in its own image); audio (input_values, input_features) the same.
Each forward of the patched model is compared with the unpatched model's, run on REFERENCE: the
family's own eager attention with log sigmoid(s M) added to its float mask at the positions this file
computes (position_ids where given, else 0..n-1), independently of maskprior's hooks.
Each family ends as one line:
  right        every check matches the reference (max |difference| <= ATOL + RTOL |reference|), and
               the folder save_pretrained writes loads back by maskprior.from_pretrained to every M and
               the patched model's outputs (round_trip);
  refused      add_mask_prior raised a ValueError at the patch: its message;
  refused at forward   the patched model raised maskprior's ValueError at the forward: its message;
  WRONG        a check differs from the reference: a silent wrong answer;
  FAILS        the patched model raised where the unpatched one ran: its error;
  not built    the tiny model could not be built or run unpatched: why.
The lines and the totals go to stdout and to --out (default tests/sweep_transformers.txt).
"""
import argparse
import contextlib
import copy
import gc
import importlib
import inspect
import os
import signal
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior  # noqa: E402

import transformers  # noqa: E402
from transformers import AttentionInterface, AttentionMaskInterface  # noqa: E402
from transformers.masking_utils import eager_mask  # noqa: E402
from transformers.models.auto import configuration_auto, modeling_auto  # noqa: E402

N = 16               # M's N for text: a prompt of 5, a batch of 8 and 4 new tokens fit
SCALE = 1.0
ATOL, RTOL = 1e-4, 1e-3
MAX_PARAMETERS = 30_000_000     # a family still this big after shrinking is "not built"
SECONDS = 120                   # a family's time limit
REFERENCE = "sweep_reference"

# The size fields shrunk in every config and sub-config, to the sizes transformers' model testers
# use (hidden 32, 2 layers, 4 heads, vocabulary 99; images 32 px in patches of 8; intermediate 64, not the
# testers' 37: grouped MoE kernels take rows of a multiple of 16 bytes):
# a field is set to this value where its default is larger.
SMALL = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
    vocab_size=99, head_dim=8, n_embd=32, n_head=4, n_layer=2, n_inner=64, d_model=32, d_ff=64, d_kv=8,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, ffn_dim=64, embed_dim=32, num_layers=2, num_heads=4,
    n_layers=2, n_heads=4, dim=32, hidden_dim=64, num_experts=4, num_local_experts=4, n_routed_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16, n_shared_experts=1,
    kv_lora_rank=16, q_lora_rank=16,
    image_size=32, patch_size=8, projection_dim=32, text_embed_dim=32, vision_embed_dim=32,
    num_global_layers=1, global_attn_every_n_layers=1, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, max_window_layers=2, first_k_dense_replace=1,
    mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, window_size=2, rotary_dim=4,
    projection_size=32, vocab_size_per_layer_input=99, hidden_size_per_layer_input=16, max_source_positions=32,
)
# Per-family fixes, learned from transformers' model testers where the generic shrink does not build.
# Keyed by the model_type of a config or of a sub-config (a composite's text or vision tower); a
# rope_parameters entry joins the config's own. The values are the testers' (SMALL's per-layer embeddings of
# Gemma 3n and Gemma 4 too: a vocabulary of 99 and 16 per layer, Gemma3nTextModelTester's; Whisper-like
# audio encoders' 32 positions, which 64 frames fill after their stride of 2):
#   Swin's (SwinModelTester): patches of 2, stages of depth [1, 2, 1];
#   mRoPE's sections (Qwen2VLVisionText2TextModelTester, Glm4vVisionText2TextModelTester) sum to half the
#   rotary head size: [2, 1, 1] for heads of 8;
#   DeepSeek-V3's multi-head latent attention (DeepseekV3ModelTester): rope 16, nope 32, values 32, 8 experts in 2
#   groups; head_dim is then the rope part, as DeepseekV3Config derives it;
#   a head_dim left None by the config (HunYuan, Ministral): hidden / heads, 8; ESM's vocabulary of 33
#   (EsmModelTester); Step-3.5's sliding window, unset by default, 4; the Audio Spectrogram Transformer's
#   spectrogram of 24 frames of 16 bins in patches of 2 (ASTModelTester), its input_values (B, frames, bins);
#   Gemma 3n's two layers one sliding, one full, none reading another's cache (its default shares the
#   cache of 15 of its 35 layers; ours, as no two layers are left to share);
#   DETR's object queries as many as its encoder's tokens (DetrModelTester's are 12), 16: a 128 px image,
#   4 x 4 after the backbone's stride of 32, so that one N serves the encoder's and the decoder's layers;
#   YOLOS's images square and small, 32 px, with 10 detection tokens (YolosModelTester's: 30 px, 10 tokens)
#   where its default 512 x 864 px (a list SMALL leaves) and 100 tokens would give M 4,197 tokens a side.
SWIN = dict(image_size=32, patch_size=2, embed_dim=16, depths=[1, 2, 1], num_heads=[2, 2, 4], window_size=2)
MROPE = dict(rope_parameters=dict(mrope_section=[2, 1, 1]))
MLA = dict(qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, head_dim=16, n_routed_experts=8,
           num_experts_per_tok=8, n_group=2, topk_group=1, q_lora_rank=32)
HEAD_8 = dict(head_dim=8)
AST = dict(max_length=24, num_mel_bins=16, patch_size=2, frequency_stride=2, time_stride=2)
OVERRIDES = {"swin": SWIN, "swinv2": SWIN, "donut-swin": SWIN, "maskformer-swin": SWIN,
             **dict.fromkeys(["qwen2_vl_text", "qwen2_5_vl_text", "glm4v_text", "glm_image_text", "glm_ocr_text",
                              "qwen2_5_omni_text", "qwen2_5_omni_thinker"], MROPE),
             "glm4v_moe_text": dict(rope_parameters=dict(mrope_section=[2, 1, 1], partial_rotary_factor=1.0)),
             **dict.fromkeys(["deepseek_v3", "deepseek_v2", "kimi_k25_text", "axk1"], MLA),
             **dict.fromkeys(["hunyuan_v1_dense", "hunyuan_v1_moe", "hunyuan_vl_text", "ministral"], HEAD_8),
             "esm": dict(vocab_size=33, pad_token_id=1),
             **dict.fromkeys(["gemma3n_text"], dict(layer_types=["sliding_attention", "full_attention"],
                                                     num_kv_shared_layers=0)),
             **dict.fromkeys(["detr", "conditional_detr"], dict(num_queries=16)),
             "yolos": dict(image_size=[32, 32], num_detection_tokens=10),
             "audio-spectrogram-transformer": AST, "clap_audio_model": AST,
             "step3p5": dict(sliding_window=4), "step3p7": dict(sliding_window=4)}


# The image side of a family whose config names none (inputs_for's default: the config's image_size, else 32)
IMAGE_SIZES = {"detr": 128, "conditional_detr": 128}


def override(d):
    """OVERRIDES of d's model_type into d, in place; a rope_parameters entry into d's own."""
    for key, value in OVERRIDES.get(d.get("model_type"), {}).items():
        d[key] = {**(d.get(key) or {}), **value} if key == "rope_parameters" else value


def shrink(d):
    """A config's to_dict() with SMALL applied, in place, sub-configs (dicts with a model_type) too: the
    vocabulary kept above the config's special token ids, the per-layer lists and dicts cut to the
    shrunk layer count."""
    layers = {key: d[key] for key in ("num_hidden_layers", "num_layers", "n_layer") if isinstance(d.get(key), int)}
    tokens = [v for k, v in d.items() if k.endswith(("token_id", "token_index")) and isinstance(v, int)]
    for key, value in list(d.items()):
        if isinstance(value, dict) and "model_type" in value:
            shrink(value)
        elif key in SMALL and isinstance(value, int) and not isinstance(value, bool) and value > SMALL[key]:
            d[key] = max(SMALL[key], max(tokens, default=0) + 1) if key == "vocab_size" else SMALL[key]
            d[key] = min(d[key], value)
    for key, old in layers.items():
        new = d[key]
        if new < old:                   # a backbone's stages named by layer: its defaults again
            d.pop("out_features", None)
            d.pop("out_indices", None)
        for name, value in list(d.items()):
            if isinstance(value, list) and len(value) == old and new < old:
                d[name] = value[:new]
            elif isinstance(value, dict) and name.startswith("per_layer") and new < old:
                d[name] = {k: v for k, v in value.items() if int(k) < new}
    if SMALL["num_key_value_heads"] == KV_AS_HEADS and isinstance(d.get("num_key_value_heads"), int):
        d["num_key_value_heads"] = d.get("num_attention_heads", d["num_key_value_heads"])
    override(d)
    return d


# Where the first shrink does not build, the next: no grouped-query attention (ESMC, GLM5-Next refuse
# it), then the default head size (mRoPE sections sum to half of it).
KV_AS_HEADS = -1
VARIANTS = ({}, {"num_key_value_heads": KV_AS_HEADS}, {"head_dim": 10 ** 9},
            {"num_key_value_heads": KV_AS_HEADS, "head_dim": 10 ** 9})


def tiny_config(model_type, variant=0):
    config_class = configuration_auto.CONFIG_MAPPING[model_type]
    SMALL.update({"num_key_value_heads": 2, "head_dim": 8, **VARIANTS[variant]})
    d = shrink(config_class().to_dict())
    d.setdefault("model_type", model_type)
    override(d)
    for key in ("transformers_version", "architectures", "_name_or_path", "torch_dtype", "dtype"):
        d.pop(key, None)
    config = config_class.from_dict(d)
    if model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and hasattr(config, "is_decoder"):
        config.is_decoder = True            # BERT's line: its *LMHeadModel is causal with is_decoder
    for c in [config] + [getattr(config, k) for k in getattr(config, "sub_configs", {}) if getattr(config, k, None)]:
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "dropout",
                    "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "activation_dropout"):
            if isinstance(getattr(c, key, None), float):
                setattr(c, key, 0.0)
    return config


# ---------------------------------------------------------------------------------------------------
# The reference: the unpatched model on its family's eager attention, the prior added to its float mask
# ---------------------------------------------------------------------------------------------------
BIAS = {}        # id(reference layer) -> (B, H, n, n_keys) log sigmoid(s M) at the positions computed here


def reference_attention(module, query, key, value, attention_mask, **kwargs):
    """The family's eager attention (the default its layer names beside ALL_ATTENTION_FUNCTIONS), with
    BIAS added to attention_mask: Section 4.1's softmax(scaling Q K^T + mask + log sigmoid(s M)) V."""
    frame = sys._getframe(1)
    eager = next(frame.f_globals[name] for name in frame.f_code.co_names
                 if "eager" in name and inspect.isfunction(frame.f_globals.get(name)))
    bias = BIAS.get(id(module))
    if bias is not None:
        bias = bias[..., :query.shape[-2], :key.shape[-2]]
        if attention_mask is None:
            attention_mask = bias
        else:
            mask = attention_mask[..., :key.shape[-2]]
            if mask.dtype == torch.bool:
                mask = torch.zeros_like(mask, dtype=query.dtype).masked_fill(~mask, torch.finfo(query.dtype).min)
            attention_mask = mask + bias
    return eager(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(REFERENCE, reference_attention)
AttentionMaskInterface.register(REFERENCE, eager_mask)


def set_reference_bias(reference, layers, masks, positions):
    """BIAS for each reference layer at query and key positions (B, n) (a no-cache run: keys are the
    queries), clamped to M's edge as a blocked padding slot may read it."""
    for (name, _), mask in zip(layers, masks):
        q = positions.clamp(0, mask.shape[-1] - 1) if positions is not None else torch.arange(mask.shape[-1])[None]
        bias = F.logsigmoid(SCALE * mask[:, q[:, :, None], q[:, None, :]])      # (H, B, n, n)
        BIAS[id(reference.get_submodule(name))] = bias.transpose(0, 1)


def set_attention(model, implementation):
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(config, transformers.PretrainedConfig):
            for c in [config] + [getattr(config, k, None) for k in getattr(config, "sub_configs", {})]:
                if c is not None:
                    c._attn_implementation = implementation


# ---------------------------------------------------------------------------------------------------
# Families
# ---------------------------------------------------------------------------------------------------
def families():
    """[(model_type, modeling module name)] of every model type whose modeling file looks up
    ALL_ATTENTION_FUNCTIONS, and the count of those that do not."""
    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    found, off = [], 0
    for model_type in configuration_auto.CONFIG_MAPPING_NAMES:
        folder = os.path.join(root, configuration_auto.model_type_to_module_name(model_type))
        files = [f for f in os.listdir(folder) if f.startswith("modeling_")] if os.path.isdir(folder) else []
        if any("ALL_ATTENTION_FUNCTIONS" in open(os.path.join(folder, f), encoding="utf-8").read() for f in files):
            found.append(model_type)
        else:
            off += 1
    return found, off


def model_class(model_type, config):
    """(kind, class): the causal LM of a decoder, else the base model, on input_ids (encoder) or
    pixel_values (vision); else the first model class of its module made for this config class."""
    names = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    kind = "decoder" if names else None
    names = names or modeling_auto.MODEL_MAPPING_NAMES.get(model_type)
    if isinstance(names, (list, tuple)):
        names = names[0]
    cls = getattr(transformers, names, None) if names else None
    if cls is None:                  # a part's config (a text or vision tower): its modeling module's class
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
        candidates = [c for c in vars(module).values() if isinstance(c, type) and
                      issubclass(c, transformers.PreTrainedModel) and getattr(c, "config_class", None) is type(config)
                      and not c.__name__.endswith("PreTrainedModel")]
        if not candidates:
            return None, None
        cls = min(candidates, key=lambda c: (not c.__name__.endswith("Model"), len(c.__name__)))
    arguments = inspect.signature(cls.forward).parameters
    if kind is None and "input_ids" in arguments and "pixel_values" in arguments:
        kind = "composite"
    elif kind is None:
        kind = "encoder" if "input_ids" in arguments else "vision" if "pixel_values" in arguments else next(
            (name for name in ("input_values", "input_features") if name in arguments), None)
    return kind, cls


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds):
    def stop(signum, frame):
        raise Timeout(f"over {seconds} s")
    signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def first_float(out):
    """The first floating-point tensor of a model's output (logits, last_hidden_state, ...)."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    for value in values:
        found = first_float(value)
        if found is not None:
            return found
    return None


def differ(patched, reference, where=None):
    """max |patched - reference| beyond the tolerance (over the rows `where` selects), else None."""
    a, b = first_float(patched), first_float(reference)
    if where is not None and a.shape[:2] == where.shape:   # an encoder-decoder's output: its decoder's, whole
        a, b = a[where], b[where]
    gap = ((a - b).abs() - RTOL * b.abs()).max().item()
    return None if gap <= ATOL else gap


def inputs_for(kind, config, batch=2, n=8):
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = min(getattr(text, "vocab_size", 99) or 99, 99)
    g = torch.Generator().manual_seed(5)
    if kind == "input_values":                      # a waveform: 0.25 s at 16 kHz
        return {"input_values": torch.randn(batch, 4000, generator=g)}
    if kind == "input_features":                    # a log-mel spectrogram, 64 frames
        # the bins of the config or of its audio encoder's sub-config (Canary's, LASR's encoder_config)
        parts = [config] + [getattr(config, k) for k in getattr(config, "sub_configs", {}) if getattr(config, k, None)]
        bins = next((getattr(c, k) for c in parts for k in ("num_mel_bins", "feature_size", "input_feat_size",
                                                            "feature_projection_input_dim", "input_feat_per_channel")
                     if isinstance(getattr(c, k, None), int)), 80)
        return {"input_features": torch.randn(batch, bins, 64, generator=g)}
    if kind == "vision":
        vision = getattr(config, "vision_config", None) or config
        channels, size = getattr(vision, "num_channels", 3), getattr(vision, "image_size", None)
        size = size or IMAGE_SIZES.get(config.model_type, 32)
        size = size if isinstance(size, int) else size[0]
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=g)}
    return {"input_ids": torch.randint(3, vocab, (batch, n), generator=g)}


def seq2seq(model, inputs):
    """An encoder-decoder's decoder_input_ids beside the encoder's input_ids: its decoder's first token."""
    if "decoder_input_ids" in inspect.signature(model.forward).parameters and "input_ids" in inputs:
        inputs["decoder_input_ids"] = inputs["input_ids"][:, :1]


def run(model, inputs, **kwargs):
    with torch.no_grad():
        return model(**inputs, **kwargs)


def token_count(model, kind, inputs):
    """(the tokens each attention layer sees of one input in an unpatched run of inputs (an image's
    prefix and patches): one count, or a sorted list where the layers differ (DETR's encoder and its
    queries); the images the layers see in one sequence, packed one after another (Pixtral's), else 1)."""
    seen, batches = set(), set()
    layers = [m for m in model.modules() if "ALL_ATTENTION_FUNCTIONS" in
              getattr(getattr(inspect.unwrap(type(m).forward), "__code__", None), "co_names", ())]

    def hook(module, args, kwargs):
        shape = (args[0] if args else next(iter(kwargs.values()))).shape
        seen.add(shape[1])
        batches.add(shape[0])
    hooks = [layer.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    try:
        run(model, inputs, **({"use_cache": False} if kind == "decoder" else {}))
    finally:
        for hook in hooks:
            hook.remove()
    images = packed(kind, inputs, batches, seen)
    return (seen.pop() // images if len(seen) == 1 else sorted(seen) or None), images


def packed(kind, inputs, batches, seen):
    """How many images the layers see in one sequence: the batch's where a batch of images reaches the
    layers as one sequence of a multiple of its size (Pixtral's), else 1."""
    images = len(inputs["pixel_values"]) if kind == "vision" else 1
    return images if batches == {1} and len(seen) == 1 and min(seen) % images == 0 else 1


def first_run(model, kind, config):
    """(M's N, the inputs, the images in one sequence) of the first of the inputs this kind may take that
    the unpatched model runs:
    inputs_for's; a composite's with an image beside its text (a dual encoder's, CLIP's: both towers run,
    the text one patched); log-mel features time first, (B, frames, bins) (Parakeet's, Speech2Text's)."""
    first = inputs_for(kind, config)
    tries = [first]
    if kind == "composite":
        tries.append({**first, **inputs_for("vision", config)})
    if kind == "input_features":
        tries.append({"input_features": first["input_features"].transpose(1, 2)})
        # the lengths an audio encoder asks for beside its features (Qwen3-ASR's, AudioFlamingo3's mask), all 64 frames
        lengths = {"input_features_mask": torch.ones(2, 64, dtype=torch.long), "feature_lens": torch.full((2,), 64)}
        lengths = {k: v for k, v in lengths.items() if k in inspect.signature(model.forward).parameters}
        tries = [{**inputs, **lengths} for inputs in tries]
    if kind == "input_values" and isinstance(getattr(config, "max_length", None), int):   # a spectrogram (AST's)
        shape = (2, config.max_length, getattr(config, "num_mel_bins", 16))
        tries.append({"input_values": torch.randn(*shape, generator=torch.Generator().manual_seed(5))})
    errors = []
    for inputs in tries:
        seq2seq(model, inputs)
        try:
            n, images = (N, 1) if kind in ("decoder", "encoder", "composite") else token_count(model, kind, inputs)
            run(model, inputs, **({"use_cache": False} if kind == "decoder" else {}))
            return n, inputs, images
        except Timeout:
            raise
        except Exception as e:                                 # noqa: BLE001 (the next inputs, else the first's error)
            errors.append(e)
    raise errors[0]


def build(model_type, variant):
    """("built", kind, the tiny model, its inputs, M's N, the images in one sequence) or ("not built", why)."""
    try:
        config = tiny_config(model_type, variant)
        kind, cls = model_class(model_type, config)
        if cls is None:
            return "not built", "no model class in transformers' auto mappings or namespace"
        if not isinstance(config, cls.config_class) and isinstance(config.get_text_config(), cls.config_class):
            config = config.get_text_config()   # a composite's causal LM (Qwen3.5's, Llama 4's): on its text config
        if kind is None:
            return "not built", f"{cls.__name__} takes no input_ids, pixel_values, input_values or input_features"
        with torch.device("meta"):
            size = sum(p.numel() for p in cls(config).parameters())
        if size > MAX_PARAMETERS:
            return "not built", f"{cls.__name__}: {size / 1e6:.0f}M parameters after shrinking"
        torch.manual_seed(0)
        model = cls(config).eval()
        set_attention(model, "eager")
        n, inputs, images = first_run(model, kind, config)
        if "input_ids" in inputs:       # the checks' calls: with an attention mask, a decoder's with position_ids
            ones = torch.ones_like(inputs["input_ids"])
            given = dict(position_ids=ones.cumsum(1) - 1, use_cache=False) if kind == "decoder" else {}
            run(model, inputs, attention_mask=ones, **given)
    except Timeout:
        raise
    except Exception as e:                                     # noqa: BLE001 (a family's own error)
        return "not built", f"{type(e).__name__}: {one_line(e)}"
    if n is None:
        return "not built", f"{cls.__name__}: no attention layer ran"
    if isinstance(n, list):
        return "not built", f"{cls.__name__}: its layers see {n} tokens, where one (layers, heads, N, N) M has one N"
    return "built", kind, model, inputs, n, images


def language_model(model):
    """A composite's language model (a transformers model of its own), else None."""
    for holder in (model, getattr(model, "model", None)):
        for name in ("language_model", "text_model"):
            part = getattr(holder, name, None)
            if isinstance(part, transformers.PreTrainedModel):
                return part
    return None


def check_family(model_type):
    """(outcome, detail) of one family."""
    BIAS.clear()        # another family's entries: their layers' ids can come back as this family's
    first = outcome = build(model_type, 0)
    for variant in range(1, len(VARIANTS)):     # a family's own error, not one of its kind's: the next shrink
        if outcome[0] == "built" or "Error" not in outcome[1].split(":")[0]:
            break
        outcome = build(model_type, variant)
    if outcome[0] != "built":
        return first
    _, kind, model, inputs, n, images = outcome
    reference = copy.deepcopy(model)
    set_attention(reference, REFERENCE)
    # M per layer, (layers, H, n, n), random so that every pair of positions has its own prior
    try:
        # a composite of towers of their own N: its language model patched alone, run on text
        part = language_model(model) if kind == "composite" else model
        if part is None:
            return "not built", (f"{type(model).__name__} takes input_ids and pixel_values, and holds no "
                                 f"language_model to patch alone (its towers have their own N)")
        where = {id(m): name for name, m in model.named_modules()}[id(part)]
        named = [(f"{where}.{name}".strip("."), m) for name, m, _, _ in maskprior._self_attention_layers(part)]
        heads = {maskprior._heads(m) for _, m in named}
        if len(heads) != 1:
            return "not built", f"layers with head counts {sorted(heads)}: no one (layers, heads, N, N) M"
        masks = 3 * torch.randn(len(named), heads.pop(), n, n, generator=torch.Generator().manual_seed(1))
        maskprior.add_mask_prior(part, masks, scale=SCALE)
    except ValueError as e:
        return "refused", one_line(e)
    except Exception as e:                                      # noqa: BLE001
        return "FAILS", f"add_mask_prior: {type(e).__name__}: {one_line(e)}"
    try:
        outcome, detail = check(kind, model, reference, named, masks, inputs, images)
        return (outcome, detail) if outcome != "right" else round_trip(kind, model, inputs, detail)
    except Timeout:
        raise
    except Exception as e:                                      # noqa: BLE001
        frames = traceback.extract_tb(e.__traceback__)
        if isinstance(e, ValueError) and frames[-1].filename == maskprior.__file__:   # maskprior's own message
            return "refused at forward", one_line(e)
        return "FAILS", f"{type(e).__name__}: {one_line(e)}"


def round_trip(kind, model, inputs, detail):
    """A right family's folder: save_pretrained of the patched model, maskprior.from_pretrained of its
    class gives back every M under its layer's name and the patched model's outputs (a composite's
    weights under the names transformers saves them); else FAILS."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = maskprior.from_pretrained(type(model), folder).eval()
    masks = [{name: m.mask for name, m in each.named_modules() if hasattr(m, "mask_prior_name")}
             for each in (model, loaded)]
    if masks[0].keys() != masks[1].keys() or not all(torch.equal(m, masks[1][name]) for name, m in masks[0].items()):
        return "FAILS", f"saved and loaded back: M in {sorted(masks[1])}, saved from {sorted(masks[0])}"
    plain = dict(use_cache=False) if kind == "decoder" else {}
    gap = differ(run(loaded, inputs, **plain), run(model, inputs, **plain))
    if gap is not None:
        return "FAILS", f"saved and loaded back by maskprior.from_pretrained, differs by {gap:.2e}"
    return "right", f"{detail}; saved and loaded back"


def stock_gap(reference, inputs, where=None, **kwargs):
    """How far the unpatched model on SDPA lies from it on its eager attention (no prior), or None: where
    a family's own two disagree, the eager reference cannot judge the patched model, which runs SDPA's."""
    BIAS.clear()
    sdpa = copy.deepcopy(reference)
    set_attention(sdpa, "sdpa")
    try:
        return differ(run(sdpa, inputs, **kwargs), run(reference, inputs, **kwargs), where)
    except Exception:                                           # noqa: BLE001 (no SDPA in the family)
        return None


def verdict(outcome, detail, reference, inputs, where=None, **kwargs):
    """outcome, or "not built" where the family's own eager and SDPA attention disagree on these inputs."""
    gap = stock_gap(reference, inputs, where, **kwargs) if outcome == "WRONG" else None
    if gap is not None:
        return "not built", f"unpatched, its eager and SDPA attention differ by {gap:.2e} on the inputs of: {detail}"
    return outcome, detail


def check(kind, model, reference, named, masks, inputs, images=1):
    """The checks of one kind: (outcome, detail)."""
    if kind not in ("decoder", "encoder", "composite"):  # images, sounds: M over every token the layers see
        # images packed into one sequence: each token at its place in its own image, M tiled
        n = masks.shape[-1]
        set_reference_bias(reference, named, masks, None if images == 1 else (torch.arange(images * n) % n)[None])
        gap = differ(run(model, inputs), run(reference, inputs))
        what = "vision" if kind == "vision" else f"audio ({kind})"
        what += f", {n} tokens" + (f" an image, {images} images packed in one sequence" if images > 1 else "")
        return ("right", what) if gap is None else verdict(
            "WRONG", f"{what}: differs by {gap:.2e}", reference, inputs)
    ids = inputs["input_ids"]
    real = torch.ones_like(ids)
    if kind in ("encoder", "composite"):
        real[0, -3:] = 0                                                      # row 0 right-padded by 3
        set_reference_bias(reference, named, masks, None)
        gap = differ(run(model, inputs, attention_mask=real), run(reference, inputs, attention_mask=real),
                     real.bool())
        what = "encoder" if kind == "encoder" else f"the language model of a composite"
        return ("right", f"{what}, padded batch") if gap is None else verdict(
            "WRONG", f"padded batch differs by {gap:.2e}", reference, inputs, real.bool(), attention_mask=real)
    plain = dict(use_cache=False)
    set_reference_bias(reference, named, masks, None)
    gap = differ(run(model, inputs, **plain), run(reference, inputs, **plain))
    if gap is not None:
        return verdict("WRONG", f"plain forward differs by {gap:.2e}", reference, inputs, **plain)
    real[0, :3] = 0                                                           # row 0 left-padded by 3
    positions = (real.cumsum(1) - 1).clamp(min=0)
    set_reference_bias(reference, named, masks, positions)
    padded = dict(attention_mask=real, position_ids=positions, use_cache=False)
    gap = differ(run(model, inputs, **padded), run(reference, inputs, **padded), real.bool())
    if gap is not None:
        return verdict("WRONG", f"left-padded batch with position_ids differs by {gap:.2e}", reference, inputs,
                       real.bool(), **padded)
    # cached generation from the padded batch: each step's logits are those of generate without a cache,
    # the whole sequence at each step, at the positions generate gives it (checked above where it passes
    # position_ids from the attention mask)
    new = 4
    greedy = dict(attention_mask=real, max_new_tokens=new, do_sample=False, output_logits=True,
                  return_dict_in_generate=True, pad_token_id=0, eos_token_id=None, min_new_tokens=new)
    try:
        with torch.no_grad():
            cached, whole = (model.generate(ids, use_cache=use, **greedy) for use in (True, False))
    except Exception as e:                                      # noqa: BLE001
        BIAS.clear()                                            # the unpatched model's own generation
        try:
            with torch.no_grad():
                reference.generate(ids, **greedy)
        except Exception:                                       # noqa: BLE001
            return "not built", f"the unpatched model's generate raises {type(e).__name__}: {one_line(e)}"
        raise
    gap = differ(torch.stack(cached.logits, 1), torch.stack(whole.logits, 1))             # (B, new, V)
    if gap is not None:
        return "WRONG", f"cached generation from the left-padded batch differs from generate without cache by {gap:.2e}"
    gap = second_turn(model, ids, real)
    if gap is not None:
        return "WRONG", f"a second turn through the cache, padded inside row 1, differs from the no-cache run by {gap:.2e}"
    return "right", "decoder: plain, left-padded with position_ids, cached generation, a padded second turn"


def second_turn(model, ids, real):
    """A batched chat's second turn of 3 tokens through the cache of the first (ids, real: row 0
    left-padded), row 1 left-padded by 2 inside the row, position_ids counted from the attention mask:
    max |difference| from the two turns in one piece without a cache, beyond the tolerance, else None."""
    turn = torch.randint(3, int(ids.max()) + 1, (len(ids), 3), generator=torch.Generator().manual_seed(6))
    later = torch.ones_like(turn)
    later[1, :2] = 0
    both = torch.cat([real, later], 1)
    positions = (both.cumsum(1) - 1).clamp(min=0)
    n = ids.shape[1]
    first = run(model, {"input_ids": ids}, attention_mask=real, position_ids=positions[:, :n], use_cache=True)
    second = run(model, {"input_ids": turn}, attention_mask=both, position_ids=positions[:, n:], use_cache=True,
                 past_key_values=first.past_key_values)
    whole = run(model, {"input_ids": torch.cat([ids, turn], 1)}, attention_mask=both, position_ids=positions,
                use_cache=False)
    return differ(second.logits, whole.logits[:, n:], later.bool())


def one_line(e):
    text = " ".join(line.strip() for line in str(e).strip().splitlines())
    return (text or type(e).__name__)[:300]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                      "sweep_transformers.txt"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()       # save_pretrained's and from_pretrained's
    warnings.simplefilter("ignore", FutureWarning)          # a family's deprecated argument names
    found, off = families()
    if args.only:
        found = [t for t in found if t in args.only.split(",")]
    start, lines, totals = time.time(), [], {}
    for model_type in found:
        began = time.time()
        with time_limit(SECONDS):
            try:
                outcome, detail = check_family(model_type)
            except Timeout as e:
                outcome, detail = "not built", f"ran {e}"
        BIAS.clear()
        gc.collect()
        totals.setdefault(outcome, []).append(model_type)
        lines.append(f"{model_type:36s} {time.time() - began:5.1f} s  {outcome}: {detail}")
        print(lines[-1], flush=True)
    summary = [f"transformers {transformers.__version__}, torch {torch.__version__}: {len(found)} families on the "
               f"AttentionInterface swept in {time.time() - start:.0f} s ({off} model types off it, not swept)"]
    summary += [f"{outcome}: {len(types)}" for outcome, types in sorted(totals.items())]
    print("\n".join(summary))
    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(lines + summary) + "\n")
    return 1 if "WRONG" in totals or "FAILS" in totals else 0


if __name__ == "__main__":
    sys.exit(main())
