"""maskprior.add_mask_prior's rules for a patched model's life outside one forward, on tiny models
built from configs (no download): every forward reads log sigmoid(s M) of M as it is at that
forward, whatever wrote M (fused and foreach optimizers, .data writes, an EMA, load_state_dict, a
parametrization, torch.func.functional_call), and param_groups finds M however it is held; the
prior's record belongs to the model patched, not to a config object two models share, and a model
loaded without it takes a new one; a patched model travels (pickled whole into a fresh process,
torch.export with a dynamic length, a composite's folder under the names transformers saves); an
image layer refuses an M of another grid, of the same token count too, saying how to build its M, with
tokens after its grid (YOLOS's detection tokens) too; images packed into one sequence (Pixtral's) each read M
at their own places."""
import copy
import json
import re
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize

import maskprior
from helpers import ROOT, random_masks

timm = pytest.importorskip("timm", reason="needs the test extras (pip install .[test]): timm")
T = pytest.importorskip("transformers", reason="needs the test extras (pip install .[test]): Hugging Face transformers")

VOCAB, WIDTH, LAYERS, N = 64, 32, 2, 16
# The models are tiny: a second torch thread only waits on the first (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def llama_config():
    return T.LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)


def llama():
    torch.manual_seed(0)
    return T.LlamaForCausalLM(llama_config()).eval()


def timm_vit():
    torch.manual_seed(0)
    return timm.models.VisionTransformer(img_size=16, patch_size=4, embed_dim=WIDTH, depth=LAYERS, num_heads=2,
                                         mlp_ratio=2, num_classes=10).eval()


IDS = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
IMAGES = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))
FAMILIES = {  # name: (build, M's shape, run(model) -> output, loss(model))
    "llama": (llama, (4, N, N), lambda m: m(IDS).logits, lambda m: m(IDS, labels=IDS).loss),
    "timm_vit": (timm_vit, (2, 17, 17), lambda m: m(IMAGES), lambda m: m(IMAGES).square().mean()),
}


def step(optimizer_class, **options):
    """A writer: one step of optimizer_class on param_groups after the family's loss."""
    def write(model, patched, loss):
        optimizer = optimizer_class(maskprior.param_groups(model, 0.0), lr=0.5, **options)
        loss(model).backward()
        optimizer.step()
    return write


def new_m(attn):
    return torch.randn(attn.mask.shape, generator=torch.Generator().manual_seed(7))


def ema(model, patched, loss):
    """An EMA of weights written through .data, as many training scripts keep one (here into the model itself)."""
    for attn in patched:
        attn.mask.data.mul_(0.5).add_(new_m(attn), alpha=0.5)


class Doubled(nn.Module):
    def forward(self, x):
        return 2 * x


def parametrized(model, patched, loss):
    """M held through a parametrization (M = 2 M_original), evaluated, its original then written under no_grad."""
    for attn in patched:
        parametrize.register_parametrization(attn, "mask", Doubled())
    with torch.no_grad():
        loss(model)
        for attn in patched:
            attn.parametrizations.mask.original.add_(new_m(attn))


WRITERS = {  # name: write(model, patched layers, loss)
    "adamw_fused": step(torch.optim.AdamW, fused=True),           # the HF Trainer's default, adamw_torch_fused
    "adam_foreach": step(torch.optim.Adam, foreach=True),
    "sgd_fused": step(torch.optim.SGD, fused=True),
    "data_copy": lambda model, patched, loss: [attn.mask.data.copy_(new_m(attn)) for attn in patched],
    "data_assigned": lambda model, patched, loss: [setattr(attn.mask, "data", new_m(attn)) for attn in patched],
    "copy_under_no_grad": lambda model, patched, loss: [attn.mask.detach().copy_(new_m(attn)) for attn in patched],
    "ema": ema,
    "load_state_dict": lambda model, patched, loss: model.load_state_dict(
        {**model.state_dict(), **{f"{attn.mask_prior_name}.mask": new_m(attn) for attn in patched}}),
    "parametrization": parametrized,
}


@pytest.mark.parametrize("writer", list(WRITERS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_forward_reads_m_as_it_is_whatever_wrote_it(family, writer):
    """An evaluation, then M written, then an evaluation: the second equals a fresh copy of the stock
    model patched with M as it now is (a stale log sigmoid(s M) from the first would differ)."""
    build, shape, run, loss = FAMILIES[family]
    stock = build()
    model = copy.deepcopy(stock)
    patched = maskprior.add_mask_prior(model, random_masks(LAYERS, *shape[:2]))
    with torch.no_grad():
        before = run(model)
    WRITERS[writer](model, patched, loss)
    masks = torch.stack([attn.mask.detach().clone() for attn in patched])
    reference = copy.deepcopy(stock)
    reference.load_state_dict(model.state_dict(), strict=False)    # the optimizer's steps on the other weights
    maskprior.add_mask_prior(reference, masks)
    with torch.no_grad():
        after, expected = run(model), run(reference)
    assert (after - before).abs().max() > 1e-4                     # M moved the output
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_stateless_call_reads_the_m_it_is_given(family):
    """torch.func.functional_call with another M gives the model patched with that M."""
    build, shape, run, _ = FAMILIES[family]
    stock = build()
    model = copy.deepcopy(stock)
    patched = maskprior.add_mask_prior(model, random_masks(LAYERS, *shape[:2]))
    masks = random_masks(LAYERS, *shape[:2], seed=9)
    with torch.no_grad():
        run(model)
        swapped = torch.func.functional_call(model, {f"{a.mask_prior_name}.mask": m for a, m in zip(patched, masks)},
                                             (IDS if family == "llama" else IMAGES,))
        swapped = swapped.logits if family == "llama" else swapped
        maskprior.add_mask_prior(stock, masks)
        torch.testing.assert_close(swapped, run(stock), rtol=0, atol=1e-5)


def test_param_groups_find_m_through_a_parametrization():
    """M held as parametrizations.mask.original goes to M's group (mask_decay), not to the decayed one."""
    model = llama()
    patched = maskprior.add_mask_prior(model, torch.zeros(4, N, N))
    for attn in patched:
        parametrize.register_parametrization(attn, "mask", Doubled())
    groups = maskprior.param_groups(model, weight_decay=0.1, mask_decay=0.0)
    originals = {id(attn.parametrizations.mask.original) for attn in patched}
    [mask_group] = [g for g in groups if {id(p) for p in g["params"]} & originals]
    assert {id(p) for p in mask_group["params"]} == originals and mask_group["weight_decay"] == 0.0


# ----------------------------------------------------------------------------------------------
# The prior's record belongs to the model patched
# ----------------------------------------------------------------------------------------------

def test_two_models_built_from_one_config_patch_independently(tmp_path):
    """Two Llamas from one config object: patching one leaves the other stock (its outputs, its
    config.json, which claims no prior), and the other then takes a prior of its own scale."""
    config = llama_config()
    torch.manual_seed(0)
    first, second = T.LlamaForCausalLM(config).eval(), T.LlamaForCausalLM(config).eval()
    stock = copy.deepcopy(second)
    maskprior.add_mask_prior(first, random_masks(LAYERS, 4, N), scale=2.0)
    second.save_pretrained(tmp_path / "second")
    assert "mask_prior" not in (tmp_path / "second" / "config.json").read_text()
    with pytest.raises(ValueError, match="holds no mask prior"):
        maskprior.from_pretrained(T.LlamaForCausalLM, tmp_path / "second")
    with torch.no_grad():
        torch.testing.assert_close(second(IDS).logits, stock(IDS).logits, rtol=0, atol=0)
    maskprior.add_mask_prior(second.model.layers, random_masks(LAYERS, 4, N, seed=3), scale=3.0)
    maskprior.add_mask_prior(stock, random_masks(LAYERS, 4, N, seed=3), scale=3.0)
    with torch.no_grad():
        torch.testing.assert_close(second(IDS).logits, stock(IDS).logits, rtol=0, atol=1e-5)
    first.save_pretrained(tmp_path / "first")
    assert maskprior.from_pretrained(T.LlamaForCausalLM, tmp_path / "first").model.layers[0].self_attn.mask_scale == 2.0


@pytest.mark.parametrize("part", ["", "model.layers"])
def test_a_model_loaded_without_its_prior_takes_a_new_one(tmp_path, part):
    """A plain from_pretrained of a patched model's folder has no prior; add_mask_prior gives it a new
    one (another scale, the whole model or its layers), which save_pretrained and
    maskprior.from_pretrained carry."""
    model = llama()
    maskprior.add_mask_prior(model, random_masks(LAYERS, 4, N), scale=2.0)
    model.save_pretrained(tmp_path / "patched")
    plain = T.LlamaForCausalLM.from_pretrained(tmp_path / "patched").eval()
    maskprior.add_mask_prior(plain.get_submodule(part), random_masks(LAYERS, 4, N, seed=3), scale=3.0)
    plain.save_pretrained(tmp_path / "again")
    loaded = maskprior.from_pretrained(T.LlamaForCausalLM, tmp_path / "again")
    assert [layer.self_attn.mask_scale for layer in loaded.model.layers] == [3.0, 3.0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, plain(IDS).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("part", ["", "model", "model.layers"])
def test_a_folder_written_by_an_unpatched_model_claims_no_prior(tmp_path, part):
    """A patched model (whole, its base model, its layers) saved; a plain from_pretrained of that
    folder, saved again: neither config.json nor the weight files of the second folder hold a prior,
    and maskprior.from_pretrained says so. A second model built from the patched one's config object
    writes a folder without a prior as well."""
    config = llama_config()
    model, sibling = T.LlamaForCausalLM(config), T.LlamaForCausalLM(config)
    maskprior.add_mask_prior(model.get_submodule(part), random_masks(LAYERS, 4, N), scale=2.0)
    model.save_pretrained(tmp_path / "patched")
    T.LlamaForCausalLM.from_pretrained(tmp_path / "patched").save_pretrained(tmp_path / "plain")
    sibling.save_pretrained(tmp_path / "sibling")
    from safetensors import safe_open
    for folder in ("plain", "sibling"):
        assert "mask" not in (tmp_path / folder / "config.json").read_text()
        with safe_open(tmp_path / folder / "model.safetensors", "pt") as tensors:
            assert not [key for key in tensors.keys() if "mask" in key]
        with pytest.raises(ValueError, match="holds no mask prior"):
            maskprior.from_pretrained(T.LlamaForCausalLM, tmp_path / folder)


def test_load_state_dict_keeps_the_layer_s_own_scale_and_mode():
    """A patched model takes M from a patched model's state_dict (strict: its records are no
    unexpected keys) and keeps its own scale and mode, which its next state_dict records."""
    source, target = llama(), llama()
    maskprior.add_mask_prior(source, random_masks(LAYERS, 4, N), scale=2.0)
    patched = maskprior.add_mask_prior(target, random_masks(LAYERS, 4, N, seed=3), scale=3.0, mode="fixed")
    target.load_state_dict(source.state_dict(), strict=True)
    assert all(torch.equal(attn.mask, source.model.layers[i].self_attn.mask) for i, attn in enumerate(patched))
    record = json.loads(bytes(target.state_dict()["model.layers.0.self_attn.mask_record"].tolist()))
    assert record == {"scale": 3.0, "mode": "fixed"} and not patched[0].mask.requires_grad


# ----------------------------------------------------------------------------------------------
# A patched model travels
# ----------------------------------------------------------------------------------------------

def test_a_pickled_patched_model_gives_its_outputs_in_a_fresh_process(tmp_path):
    """torch.save(model) of a patched Llama (an SDPA family) and Gemma2 (an eager one: its softcap),
    torch.load in a fresh process that never imports maskprior itself: the same logits. A deep copy
    and the state_dict stay as they are: the stock model's keys and each layer's M and record."""
    gemma2 = T.Gemma2ForCausalLM(T.Gemma2Config(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, attn_logit_softcapping=2.0, pad_token_id=0)).eval()
    models = {"llama": llama(), "gemma2": gemma2}
    for name, model in models.items():
        stock_keys = set(model.state_dict())
        patched = maskprior.add_mask_prior(model, random_masks(LAYERS, 4, N))
        assert set(model.state_dict()) == stock_keys | {f"{attn.mask_prior_name}.{key}" for attn in patched
                                                        for key in ("mask", "mask_record")}
        with torch.no_grad():
            expected = model(IDS).logits
            torch.testing.assert_close(copy.deepcopy(model)(IDS).logits, expected, rtol=0, atol=0)
        torch.save(model, tmp_path / f"{name}.pt")
        torch.save(expected, tmp_path / f"{name}_logits.pt")
    torch.save(IDS, tmp_path / "ids.pt")
    script = ("import sys, torch\n"
              "ids = torch.load(sys.argv[1] + '/ids.pt')\n"
              "for name in ('llama', 'gemma2'):\n"
              "    model = torch.load(f'{sys.argv[1]}/{name}.pt', weights_only=False)\n"
              "    with torch.no_grad():\n"
              "        torch.save(model(ids).logits, f'{sys.argv[1]}/{name}_loaded.pt')\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr
    for name in models:
        loaded, expected = (torch.load(tmp_path / f"{name}_{kind}.pt") for kind in ("loaded", "logits"))
        torch.testing.assert_close(loaded, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "timm_vit"])
def test_torch_compile_with_fullgraph_gives_the_eager_outputs_and_gradient(family):
    """torch.compile(fullgraph=True) traces a patched model in one graph, as it does the stock one
    (backend aot_eager: Dynamo's trace and AOTAutograd's, no C++ compiler): the eager model's outputs,
    and with M trained the same gradient on M."""
    build, shape, run, loss = FAMILIES[family]
    model = build()
    patched = maskprior.add_mask_prior(model, random_masks(LAYERS, *shape[:2]))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(run(compiled), run(model), rtol=0, atol=1e-5)
    gradients = []
    for each in (model, compiled):
        model.zero_grad()
        loss(each).backward()
        gradients.append(patched[0].mask.grad.clone())
    torch.testing.assert_close(gradients[1], gradients[0], rtol=0, atol=1e-6)
    assert gradients[0].abs().sum() > 0


def torchvision_vit():
    import torchvision
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(image_size=16, patch_size=4, num_layers=LAYERS, num_heads=2,
                                                hidden_dim=WIDTH, mlp_dim=64, num_classes=10).eval()


@pytest.mark.parametrize("build", [timm_vit, torchvision_vit])
def test_an_image_model_exports_with_a_dynamic_batch_and_traces(build):
    """torch.export with a dynamic batch size (exported at 2, run at 3) and torch.jit.trace (whose
    check runs the model twice, with and without grad) of a patched ViT: the eager model's outputs."""
    model = build()
    maskprior.add_mask_prior(model, random_masks(LAYERS, 2, 17))
    exported = torch.export.export(model, (IMAGES,), dynamic_shapes=({0: torch.export.Dim("batch", max=8)},))
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(6))
    traced = torch.jit.trace(model, (IMAGES,))
    with torch.no_grad():
        torch.testing.assert_close(exported.module()(images), model(images), rtol=0, atol=1e-5)
        torch.testing.assert_close(traced(images), model(images), rtol=0, atol=1e-5)


def test_torch_export_with_a_dynamic_length_runs_every_length_up_to_n():
    """A patched Llama whose M trains (gradient on, the written-out attention on the CPU) exports with
    a dynamic sequence length up to M's N and gives the eager model's logits at every length; a range
    past N is refused at export, with the range that fits."""
    model = llama()
    maskprior.add_mask_prior(model, random_masks(LAYERS, 4, N))
    exported = torch.export.export(model, (), {"input_ids": IDS, "use_cache": False}, dynamic_shapes={
        "input_ids": {1: torch.export.Dim("seq", min=2, max=N)}, "use_cache": None}).module()
    for length in (3, N):
        ids = torch.randint(1, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        torch.testing.assert_close(exported(input_ids=ids, use_cache=False).logits, model(ids).logits,
                                   rtol=0, atol=1e-5)
    with pytest.raises(Exception, match=rf"(?s)Constraints violated.*max={N}\)"):
        torch.export.export(model, (), {"input_ids": IDS, "use_cache": False}, dynamic_shapes={
            "input_ids": {1: torch.export.Dim("seq", min=2, max=2 * N)}, "use_cache": None})


# ----------------------------------------------------------------------------------------------
# A grid is a grid
# ----------------------------------------------------------------------------------------------

def rectangle_impulse(heads, rows, cols):
    """The impulse prior of Section 5.3 on CLS + a rows x cols grid, written out: head h of offset
    IMPULSE_ORDER[h mod 9] opens query patch (r, c) to key patch (r + dr, c + dc) where that lies on
    the grid, CLS's row to every token, and closes the rest."""
    m = torch.full((heads, 1 + rows * cols, 1 + rows * cols), maskprior.CLOSE)
    m[:, 0] = maskprior.OPEN
    for h in range(heads):
        k = maskprior.IMPULSE_ORDER[h % len(maskprior.IMPULSE_ORDER)]
        dr, dc = k // 3 - 1, k % 3 - 1
        for r in range(max(0, -dr), min(rows, rows - dr)):
            for c in range(max(0, -dc), min(cols, cols - dc)):
                m[h, 1 + r * cols + c, 1 + (r + dr) * cols + c + dc] = maskprior.OPEN
    return m


GRIDS = {  # name: (build, call(model, image), image size (h, w) of a 2 x 8 grid, its 4 x 4 one)
    "timm_dynamic_img_size": (lambda: timm.models.VisionTransformer(
        img_size=16, patch_size=4, embed_dim=WIDTH, depth=LAYERS, num_heads=2, mlp_ratio=2, num_classes=10,
        dynamic_img_size=True), lambda m, x: m.forward_features(x)),
    "hf_vit_interpolate_pos_encoding": (lambda: T.ViTModel(T.ViTConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=2, intermediate_size=64, image_size=16,
        patch_size=4)), lambda m, x: m(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state),
}


@pytest.mark.parametrize("name", list(GRIDS))
def test_a_grid_of_the_same_token_count_is_refused_and_the_recipe_given_fits(name):
    """A 4 x 4 grid's M (17 tokens) on an 8 x 32 px image, a 2 x 8 grid of as many patches: one
    ValueError at the forward saying how to build M for 2 x 8 and to patch with grid=(2, 8). The M so
    built is the impulse prior of the 2 x 8 grid written out; patched with it the model runs there and
    refuses the 4 x 4 grid it no longer fits."""
    build, call = GRIDS[name]
    torch.manual_seed(0)
    model = build().eval()
    maskprior.add_mask_prior(model, maskprior.impulse_mask(LAYERS, 2, 4))
    wide, square = torch.randn(1, 3, 8, 32), torch.randn(1, 3, 16, 16)
    call(model, square)
    with pytest.raises(ValueError, match=r"\+ 16 patches, M \(2, 17, 17\) is for N = 17: for a 2 x 8 grid M = "
                                         r"(?P<recipe>.*), i = (?P<index>.*); patch with add_mask_prior\(\.\.\., "
                                         r"grid=\(2, 8\)\)$") as refused:
        call(model, wide)
    found = re.search(r"M = (?P<recipe>.*), i = (?P<index>.*); patch", str(refused.value))
    mask = eval(found["recipe"], {"maskprior": maskprior, "depth": LAYERS, "heads": 2, "i": eval(found["index"])})
    assert torch.equal(mask, rectangle_impulse(2, 2, 8).expand(LAYERS, -1, -1, -1))
    torch.manual_seed(0)
    model = build().eval()
    maskprior.add_mask_prior(model, mask, grid=(2, 8))
    assert call(model, wide).shape[-2] == 17
    with pytest.raises(ValueError, match=r"for a 4 x 4 grid M = "):
        call(model, square)


def test_a_model_that_drops_patches_while_training_is_refused_at_the_patch():
    """timm's patch_drop_rate keeps a random subset of the patches in training, each then at another
    index of the sequence: refused when patched, naming the rate, not at the first training forward;
    at rate 0 the same model takes the prior."""
    build = lambda rate: timm.models.VisionTransformer(img_size=16, patch_size=4, embed_dim=WIDTH, depth=LAYERS,
                                                       num_heads=2, patch_drop_rate=rate)
    with pytest.raises(ValueError, match=r"^patch_drop: VisionTransformer drops a random 0\.25 of its patches"):
        maskprior.add_mask_prior(build(0.25), maskprior.impulse_mask(LAYERS, 2, 4))
    model = build(0.0).train()
    maskprior.add_mask_prior(model, maskprior.impulse_mask(LAYERS, 2, 4))
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 1000)


def test_a_composite_model_s_folder_loads_back_whole_under_its_saved_names(tmp_path):
    """Llava (a CLIP vision tower, a Llama language model) with the prior in its language model:
    save_pretrained writes each M as language_model.model.layers.i.self_attn.mask (transformers'
    name in the checkpoint) and its record beside it as ...self_attn.mask_record; maskprior.from_pretrained
    gives back every M and the logits, a plain from_pretrained the model without them."""
    config = T.LlavaConfig(text_config=llama_config(), image_token_id=VOCAB - 1, vision_config=T.CLIPVisionConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=2, intermediate_size=64, image_size=16,
        patch_size=4))
    torch.manual_seed(0)
    model = T.LlavaForConditionalGeneration(config).eval()
    patched = maskprior.add_mask_prior(model.model.language_model, random_masks(LAYERS, 4, N))
    model.save_pretrained(tmp_path)
    loaded = maskprior.from_pretrained(T.LlavaForConditionalGeneration, tmp_path)
    plain = T.LlavaForConditionalGeneration.from_pretrained(tmp_path)
    restored = [layer.self_attn for layer in loaded.model.language_model.layers]
    assert all(torch.equal(a.mask, b.mask) for a, b in zip(patched, restored))
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
        torch.testing.assert_close(loaded(input_ids=IDS).logits, expected, rtol=0, atol=1e-5)
        assert (plain(input_ids=IDS).logits - expected).abs().max() > 1e-3


def yolos():
    torch.manual_seed(0)
    return T.YolosModel(T.YolosConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=2,
                                      intermediate_size=64, image_size=[16, 16], patch_size=4,
                                      num_detection_tokens=3)).eval()


def test_tokens_after_the_grid_keep_the_grid_check_and_its_recipe():
    """YOLOS appends 3 detection tokens after its 4 x 4 patches: M spans CLS, the patches and them (N =
    20), and a 4 x 4 grid's M without them is refused at the forward, counting the tokens after the grid.
    A 2 x 8 grid of as many patches is one ValueError too, whose recipe gives the 2 x 8 impulse prior with
    CLS's prior on the detection tokens; patched with it the model runs there and refuses the 4 x 4 grid."""
    wide, square = torch.randn(1, 3, 8, 32), torch.randn(1, 3, 16, 16)
    model = yolos()
    maskprior.add_mask_prior(model, maskprior.impulse_mask(LAYERS, 2, 4))
    with pytest.raises(ValueError, match=r"got 20 = 1 prefix tokens .* \+ 16 patches \+ 3 after them \(detection "
                                         r"tokens\), M \(2, 17, 17\) is for N = 17: for a 4 x 4 grid"):
        model(square)
    i = [0] + list(range(1, 17)) + [0] * 3
    model = yolos()
    maskprior.add_mask_prior(model, maskprior.impulse_mask(LAYERS, 2, 4)[..., i, :][..., i])
    assert model(square).last_hidden_state.shape[1] == 20
    with pytest.raises(ValueError, match=r"\+ 16 patches \+ 3 after them \(detection tokens\), M \(2, 20, 20\) is "
                                         r"for N = 20: for a 2 x 8 grid M = .*, i = .*; patch with "
                                         r"add_mask_prior\(\.\.\., grid=\(2, 8\)\)$") as refused:
        model(wide)
    found = re.search(r"M = (?P<recipe>.*), i = (?P<index>.*); patch", str(refused.value))
    mask = eval(found["recipe"], {"maskprior": maskprior, "depth": LAYERS, "heads": 2, "i": eval(found["index"])})
    assert torch.equal(mask[..., :17, :17], rectangle_impulse(2, 2, 8).expand(LAYERS, -1, -1, -1))
    assert torch.equal(mask[..., 17:, :], mask[..., :1, :].expand(-1, -1, 3, -1))      # CLS's row, CLS's column
    assert torch.equal(mask[..., :, 17:], mask[..., :, :1].expand(-1, -1, -1, 3))
    model = yolos()
    maskprior.add_mask_prior(model, mask, grid=(2, 8))
    assert model(wide).last_hidden_state.shape[1] == 20
    with pytest.raises(ValueError, match=r"\+ 3 after them \(detection tokens\).* for a 4 x 4 grid M = "):
        model(square)


def test_images_packed_into_one_sequence_each_read_m_at_their_own_places():
    """Pixtral packs a batch's images, each its own grid, into one sequence (a block-diagonal mask, 2-D
    RoPE positions restarting at each image): patched with a 4 x 4 grid's M, two 32 px images packed
    give each image's output alone, as its positions do; a second image cropped to 3 x 4 patches
    (image_sizes) takes another grid, a ValueError at the forward."""
    torch.manual_seed(0)
    model = T.PixtralVisionModel(T.PixtralVisionConfig(hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                                       num_attention_heads=4, intermediate_size=64, image_size=32,
                                                       patch_size=8, head_dim=8)).eval()
    maskprior.add_mask_prior(model, 3 * torch.randn(LAYERS, 4, 16, 16, generator=torch.Generator().manual_seed(1)))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        both = model(images).last_hidden_state                                                  # (1, 32, C)
        alone = torch.cat([model(image[None]).last_hidden_state for image in images], 1)
        torch.testing.assert_close(both, alone, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match=r"got 28 = 0 prefix tokens .* \+ 28 patches, M \(4, 16, 16\) is for "
                                             r"N = 16"):
            model(images, image_sizes=[(32, 32), (24, 32)])
