"""maskprior.add_mask_prior on modules the project did not write: torchvision's VisionTransformer,
nn.TransformerEncoder (batch_first True and False) and nn.Transformer. A patched nn.MultiheadAttention
must compute softmax(Q K^T / sqrt(d) + log sigmoid(M)) V (Section 4.1) in train and eval mode, train
M, save and load it, and refuse masks that do not fit; cross-attention stays unpatched.
maskprior.param_groups groups the project's own models as it always has. The package builds as a
wheel of maskprior.py alone, and the README's examples run as written from another directory, on
the installed wheel."""
import copy
import importlib.util
import math
import os
import re
import subprocess
import sys
import zipfile

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

import maskprior
from helpers import ROOT, random_masks, split_heads

# The section whose code blocks test_readme_snippets_run executes: the README's, and a draft of it
# beside the README where one is being written.
README_PATHS = [path for path in (os.path.join(ROOT, "README.md"), os.path.join(ROOT, "README-own-model.md"))
                if os.path.exists(path)]
README_HEADING = "## Add a mask prior to your own model"
# The models are tiny: a second torch thread only waits on the first (conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, HEADS, LAYERS = 32, 2, 2
VIT_TOKENS = 17                                   # CLS + 4 x 4 patches of 8 x 8 in a 32 x 32 image
ENCODER_TOKENS = 6


# ----------------------------------------------------------------------------------------------
# The three models, each with its input and its nn.MultiheadAttention modules
# ----------------------------------------------------------------------------------------------

def vit(seed=0):
    torch.manual_seed(seed)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=LAYERS, num_heads=HEADS, hidden_dim=WIDTH,
        mlp_dim=64, num_classes=10)
    # torchvision starts the classifier at zero, which would make every output 0 whatever the mask.
    nn.init.normal_(model.heads.head.weight, std=0.1)
    return model


def encoder(batch_first, seed=0):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 64, dropout=0.0, batch_first=batch_first)
    # batch_first=False cannot use the nested-tensor path and would warn that it is not used.
    return nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=batch_first)


MODELS = {  # name: (build(seed), tokens N, batch_first, model input of batch B)
    "vit": (vit, VIT_TOKENS, True, lambda B: torch.randn(B, 3, 32, 32)),
    "encoder_batch_first": (lambda seed=0: encoder(True, seed), ENCODER_TOKENS, True,
                            lambda B: torch.randn(B, ENCODER_TOKENS, WIDTH)),
    "encoder_seq_first": (lambda seed=0: encoder(False, seed), ENCODER_TOKENS, False,
                          lambda B: torch.randn(ENCODER_TOKENS, B, WIDTH)),
}


def written_out(attn, x, mask, batch_first, logit_extra=None):
    """softmax(Q K^T / sqrt(d) + log sigmoid(M) [+ logit_extra]) V, then W_O, from attn's own
    in_proj / out_proj weights. Returns the output (in x's layout) and p (B, H, N, N)."""
    if not batch_first:
        x = x.transpose(0, 1)                                            # (B, N, E)
    B, N, E = x.shape
    d = E // attn.num_heads
    q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    q, k, v = (split_heads(t, attn.num_heads) for t in (q, k, v))       # (B, H, N, d)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d) + F.logsigmoid(mask)
    if logit_extra is not None:
        logits = logits + logit_extra
    p = logits.softmax(dim=-1)                                           # (B, H, N, N)
    y = attn.out_proj((p @ v).transpose(1, 2).reshape(B, N, E))
    return (y if batch_first else y.transpose(0, 1)), p


# ----------------------------------------------------------------------------------------------
# What the patched model computes
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_open_mask_leaves_the_model_unchanged(name, training):
    """M = +10 everywhere: every logit moves by log sigmoid(10) = -4.5e-5, the same in every row,
    which softmax cancels. In eval mode the unpatched model takes PyTorch's fused paths."""
    build, n, _, make_input = MODELS[name]
    model = build().double().train(training)
    reference = copy.deepcopy(model)
    maskprior.add_mask_prior(model, torch.full((HEADS, n, n), maskprior.OPEN))
    x = make_input(3).double()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_module_computes_the_section_4_1_attention(name, training):
    build, n, batch_first, _ = MODELS[name]
    model = build().double().train(training)
    masks = random_masks(LAYERS, HEADS, n)
    attn = maskprior.add_mask_prior(model, masks)[1]                     # the second layer's
    x = torch.randn((3, n, WIDTH) if batch_first else (n, 3, WIDTH), dtype=torch.float64)
    expected, p = written_out(attn, x, masks[1].double(), batch_first)
    with torch.no_grad():                                                # eval: fused paths off
        y, _ = attn(x, x, x, need_weights=False)
        y_weights, weights = attn(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(y_weights, expected)
    torch.testing.assert_close(weights, p)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_patch_s_log_sigmoid_is_torch_s_to_the_dtype_s_precision(dtype):
    """The patch's log sigmoid (log(sigmoid(x)) above log eps, x below: F.logsigmoid's CPU kernel is
    slow) against the float64 log sigmoid, from -10^4 to 10^4 through the switch at log eps and at
    +-inf: values and gradients (sigmoid(-x)) within the dtype's eps."""
    eps = torch.finfo(dtype).eps
    switch = math.log(eps)
    x = torch.cat([torch.linspace(-1e4, 1e4, 20001), torch.linspace(switch - 4, switch + 4, 8001),
                   torch.linspace(-40, 40, 8001), torch.tensor([-math.inf, math.inf])]).to(dtype).requires_grad_()
    y = maskprior._log_sigmoid(x)
    y.backward(torch.ones_like(y))
    exact = F.logsigmoid(x.detach().double())
    torch.testing.assert_close(y.detach().double(), exact, rtol=eps, atol=eps)
    torch.testing.assert_close(x.grad.double(), torch.sigmoid(-x.detach().double()), rtol=eps, atol=eps)
    few = x.detach()[::37]                       # a cached token's row of M is this small: a path of its own
    assert len(few) < 4096 < len(x)
    torch.testing.assert_close(maskprior._log_sigmoid(few).double(), exact[::37], rtol=eps, atol=eps)


def test_caller_masks_and_unbatched_input_combine_with_the_prior():
    """A Boolean causal attn_mask with is_causal=True and a Boolean key_padding_mask are added to
    log sigmoid(M) as -inf entries; an unbatched (N, E) input gets the prior too."""
    model = encoder(batch_first=True).double()
    masks = random_masks(LAYERS, HEADS, ENCODER_TOKENS)
    attn = maskprior.add_mask_prior(model, masks)[0]
    n = ENCODER_TOKENS
    x = torch.randn(3, n, WIDTH, dtype=torch.float64)
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    padding = torch.zeros(3, n, dtype=torch.bool)
    padding[0, -2:] = True
    blocked = causal[None, None] | padding[:, None, None, :]            # (B, 1, N, N)
    extra = torch.zeros(blocked.shape, dtype=torch.float64).masked_fill(blocked, float("-inf"))
    expected, _ = written_out(attn, x, masks[0].double(), True, extra)
    y, _ = attn(x, x, x, attn_mask=causal, key_padding_mask=padding, need_weights=False,
                is_causal=True)
    torch.testing.assert_close(y, expected)
    causal_only = torch.zeros(n, n, dtype=torch.float64).masked_fill(causal, float("-inf"))
    y, _ = attn(x, x, x, attn_mask=causal, need_weights=False, is_causal=True)
    torch.testing.assert_close(y, written_out(attn, x, masks[0].double(), True, causal_only)[0])
    single, _ = attn(x[1], x[1], x[1], need_weights=False)               # unbatched (N, E)
    torch.testing.assert_close(single, written_out(attn, x[1:2], masks[0].double(), True)[0][0])


def test_shorter_input_uses_the_top_left_block_of_the_mask():
    """4 of the mask's 6 positions: log sigmoid(M[:, :4, :4]), as MaskedSelfAttention takes it."""
    model = encoder(batch_first=True).double()
    masks = random_masks(LAYERS, HEADS, ENCODER_TOKENS)
    attn = maskprior.add_mask_prior(model, masks)[0]
    x = torch.randn(3, 4, WIDTH, dtype=torch.float64)
    y, _ = attn(x, x, x, need_weights=False)
    torch.testing.assert_close(y, written_out(attn, x, masks[0, :, :4, :4].double(), True)[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_prior_acts_in_train_and_in_eval_mode(name):
    """Eval under no_grad is where PyTorch would bypass nn.MultiheadAttention.forward; the patched
    model gives the train-mode output there (dropout is 0), which differs from the unpatched one."""
    build, n, _, make_input = MODELS[name]
    model = build()
    reference = copy.deepcopy(model).eval()
    maskprior.add_mask_prior(model, random_masks(LAYERS, HEADS, n))
    x = make_input(3)
    trained_path = model.train()(x)
    with torch.no_grad():
        eval_path = model.eval()(x)
        unpatched = reference(x)
    torch.testing.assert_close(eval_path, trained_path.detach(), rtol=1e-5, atol=1e-5)
    assert (eval_path - unpatched).abs().max() > 1e-3


def test_encoder_padding_mask_in_eval_mode_matches_train_mode():
    """nn.TransformerEncoder would turn a padded batch into nested tensors in eval mode; the
    patched encoder keeps dense tensors and gives the train-mode output."""
    model = encoder(batch_first=True)
    maskprior.add_mask_prior(model, random_masks(LAYERS, HEADS, ENCODER_TOKENS))
    x = torch.randn(3, ENCODER_TOKENS, WIDTH)
    padding = torch.zeros(3, ENCODER_TOKENS, dtype=torch.bool)
    padding[0, -2:] = True
    trained_path = model.train()(x, src_key_padding_mask=padding).detach()
    with torch.no_grad():
        eval_path = model.eval()(x, src_key_padding_mask=padding)
    assert not eval_path.is_nested
    torch.testing.assert_close(eval_path, trained_path, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Training, modes, checkpoints
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_gradient_reaches_a_learnable_mask_and_not_a_fixed_one(name):
    build, n, _, make_input = MODELS[name]
    x = make_input(2)
    for mode in ("learnable", "fixed"):
        model = build()
        patched = maskprior.add_mask_prior(model, random_masks(LAYERS, HEADS, n), mode=mode)
        model(x).square().sum().backward()
        for attn in patched:
            assert isinstance(attn.mask, nn.Parameter)
            assert attn.mask.requires_grad is (mode == "learnable")
            if mode == "learnable":
                assert attn.mask.grad is not None and attn.mask.grad.abs().max() > 0
            else:
                assert attn.mask.grad is None


@pytest.mark.parametrize("name", list(MODELS))
def test_a_few_steps_train_the_patched_model_end_to_end(name):
    build, n, _, make_input = MODELS[name]
    model = build()
    masks = maskprior.impulse_mask(LAYERS, HEADS, 4) if name == "vit" else random_masks(LAYERS, HEADS, n)
    patched = maskprior.add_mask_prior(model, masks)
    x = make_input(8)
    target = torch.randn(model(x).shape, generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = F.mse_loss(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]
    assert not torch.equal(patched[0].mask.detach(), masks[0])           # M moved


@pytest.mark.parametrize("name", list(MODELS))
def test_state_dict_round_trip_into_a_fresh_patched_model(name):
    build, n, _, make_input = MODELS[name]
    model = build(seed=0)
    maskprior.add_mask_prior(model, random_masks(LAYERS, HEADS, n, seed=1))
    state = model.state_dict()
    mask_keys = [key for key in state if key.endswith(".mask")]
    assert len(mask_keys) == LAYERS
    fresh = build(seed=5)
    maskprior.add_mask_prior(fresh, torch.zeros(HEADS, n, n))
    x = make_input(2)
    assert not torch.equal(fresh.eval()(x), model.eval()(x))
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), model(x))


# ----------------------------------------------------------------------------------------------
# Refusals, with the module's qualified name
# ----------------------------------------------------------------------------------------------

FIRST_VIT_ATTENTION = "encoder.layers.encoder_layer_0.self_attention"


def test_wrong_head_count_is_refused_at_call_time():
    message = re.escape(FIRST_VIT_ATTENTION) + r".*\(3, 17, 17\).*num_heads=2"
    with pytest.raises(ValueError, match=message):
        maskprior.add_mask_prior(vit(), maskprior.impulse_mask(LAYERS, 3, 4))


@pytest.mark.parametrize("grid", [3, 5])
def test_a_mask_for_another_grid_is_refused_at_forward_time(grid):
    """torchvision's ViT (CLS + 4 x 4 patches, N = 17) with the impulse mask of a 3 x 3 or a 5 x 5
    grid: one ValueError naming the layer, the image's tokens (1 prefix token + 16 patches), M's N and
    the impulse mask of this grid; the longer M's top-left block would give each patch another's prior."""
    model = vit()
    n = grid * grid + 1
    maskprior.add_mask_prior(model, maskprior.impulse_mask(LAYERS, HEADS, grid))
    message = (re.escape(FIRST_VIT_ATTENTION) + r": an image layer takes the N tokens its mask was built for, on its "
               rf"grid; got 17 = 1 prefix tokens \(.*\) \+ 16 patches, M \(2, {n}, {n}\) is for N = {n}: for a 4 x 4 "
               r"grid M = maskprior\.impulse_mask\(depth, heads, 4\)")
    with pytest.raises(ValueError, match=message):
        model(torch.randn(1, 3, 32, 32))


def test_wrong_sequence_length_is_refused_at_forward_time():
    model = encoder(batch_first=False)
    maskprior.add_mask_prior(model, random_masks(LAYERS, HEADS, ENCODER_TOKENS))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn.*at most 6.*got position 6"):
        model(torch.randn(7, 2, WIDTH))                                   # (N, B, E)


def test_models_without_multihead_attention_and_other_misuse_are_refused():
    with pytest.raises(ValueError, match="Sequential contains no nn.MultiheadAttention"):
        maskprior.add_mask_prior(nn.Sequential(nn.Linear(4, 4)), torch.zeros(2, 4, 4))
    with pytest.raises(ValueError, match=r"layers = 2.*\(3, 2, 17, 17\)"):
        maskprior.add_mask_prior(vit(), torch.zeros(3, HEADS, VIT_TOKENS, VIT_TOKENS))
    with pytest.raises(ValueError, match="mode"):
        maskprior.add_mask_prior(vit(), torch.zeros(HEADS, VIT_TOKENS, VIT_TOKENS), mode="hadamard")
    model = vit()
    maskprior.add_mask_prior(model, torch.zeros(HEADS, VIT_TOKENS, VIT_TOKENS))
    with pytest.raises(ValueError, match=re.escape(FIRST_VIT_ATTENTION) + " already has a mask"):
        maskprior.add_mask_prior(model, torch.zeros(HEADS, VIT_TOKENS, VIT_TOKENS))
    attn = model.encoder.layers[0].self_attention
    x, memory = torch.randn(1, VIT_TOKENS, WIDTH), torch.randn(1, 5, WIDTH)
    message = re.escape(FIRST_VIT_ATTENTION) + r".*self-attention.*key \(1, 5, 32\) from another sequence"
    with pytest.raises(ValueError, match=message):
        attn(x, memory, memory)                                          # cross-attention
    with pytest.raises(ValueError, match=r"key \(1, 17, 32\) from another sequence"):
        attn(x, x + 1, x + 1)                                            # of the same length


def test_nn_transformer_patches_self_attention_and_leaves_cross_attention():
    """nn.Transformer: the encoder's and the decoder's self_attn take the prior; the decoder's
    multihead_attn (queries from the target, keys from the memory) keeps its stock attention, also
    with a source of another length than the target."""
    torch.manual_seed(0)
    model = nn.Transformer(WIDTH, HEADS, 1, 1, 64, dropout=0.0, batch_first=True).double()
    stock = copy.deepcopy(model)
    patched = maskprior.add_mask_prior(model, torch.full((2, HEADS, 5, 5), maskprior.OPEN))
    assert [attn.mask_prior_name for attn in patched] == ["encoder.layers.0.self_attn",
                                                          "decoder.layers.0.self_attn"]
    assert not hasattr(model.decoder.layers[0].multihead_attn, "mask")
    source, target = torch.randn(2, 5, WIDTH).double(), torch.randn(2, 3, WIDTH).double()
    causal = nn.Transformer.generate_square_subsequent_mask(3, dtype=torch.float64)
    torch.testing.assert_close(model(source, target, tgt_mask=causal), stock(source, target, tgt_mask=causal))


@pytest.mark.parametrize("mode", ["none", "learnable"])
@pytest.mark.parametrize("name", ["vit", "gpt", "transformer"])
def test_param_groups_group_the_projects_own_models_as_train_py_trains_them(name, mode):
    """maskprior's ViT, GPT and Transformer, as train.py's optimizer groups them (the rule of the
    recorded runs, written out here): matrices decayed but the positions and CLS (no_weight_decay,
    timm's convention), vectors not, every M alone, in named_parameters order; decay_all (aryol/GOTU's
    coupled decay) decays everything but M in one group; mask_lr reaches M's group alone."""
    torch.manual_seed(0)
    masks = None if mode == "none" else torch.zeros(2, HEADS, 17, 17)
    model = {"vit": lambda: maskprior.ViT(16, 4, 10, WIDTH, 2, HEADS, 64, masks=masks, mode=mode),
             "gpt": lambda: maskprior.GPT(50, 17, WIDTH, 2, HEADS, mode=mode, masks=masks),
             "transformer": lambda: maskprior.Transformer(2, 17, WIDTH, 2, HEADS, 64, 1, masks=masks,
                                                          mode=mode)}[name]()
    mask_ids = {id(m.mask) for m in maskprior.attention_modules(model) if m.mask is not None}
    starts = {id(p) for n, p in model.named_parameters() if n in ("pos", "cls")}
    assert len(starts) == (1 if name == "gpt" else 2)
    parameters = [p for p in model.parameters() if p.requires_grad]
    weights = [id(p) for p in parameters if id(p) not in mask_ids]
    matrices = [i for i, p in zip(weights, [p for p in parameters if id(p) not in mask_ids])
                if p.dim() >= 2 and i not in starts]
    expected = [(matrices, 0.05), ([i for i in weights if i not in matrices], 0.0),
                ([id(p) for p in parameters if id(p) in mask_ids], 1e-3)]
    groups = maskprior.param_groups(model, 0.05, mask_decay=1e-3)
    assert [([id(p) for p in g["params"]], g["weight_decay"]) for g in groups] == [e for e in expected if e[0]]
    coupled = maskprior.param_groups(model, 0.05, mask_decay=1e-3, mask_lr=0.03, decay_all=True)
    assert [([id(p) for p in g["params"]], g["weight_decay"], g.get("lr")) for g in coupled] == [
        e for e in [(weights, 0.05, None), (expected[2][0], 1e-3, 0.03)] if e[0]]


# ----------------------------------------------------------------------------------------------
# The package and the README's examples, as a user gets them
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The directory a wheel of the repository's pyproject.toml was unpacked into (as pip installs
    a pure-Python wheel), and the names the wheel holds. The build runs on a copy of pyproject.toml
    and maskprior.py, so no build/ or egg-info lands in the repository."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools, the build backend, is not installed (pip would fetch it)")
    source, dist, site = (tmp_path_factory.mktemp(name) for name in ("source", "dist", "site"))
    for name in ("pyproject.toml", "maskprior.py"):
        (source / name).write_bytes(open(os.path.join(ROOT, name), "rb").read())
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "-w", str(dist), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [wheel] = dist.glob("maskprior-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
        return site, archive.namelist()


def test_the_wheel_holds_maskprior_alone(installed):
    """maskprior.py is the library; tasks.py and train.py, the paper's scripts, stay out."""
    _, names = installed
    assert [name for name in names if not name.startswith("maskprior-")] == ["maskprior.py"]
    metadata = next(name for name in names if name.endswith("METADATA"))
    assert metadata.startswith("maskprior-0.1.0.dist-info/")


def readme_code(path, heading=README_HEADING):
    """The ```python blocks between the heading line and the next "## " heading in the file at path."""
    with open(path) as f:
        text = f.read()
    section = text[text.index(heading + "\n") + len(heading):]
    section = section[:section.find("\n## ")]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


# Runs each block given as a file in a fresh namespace, then checks it: every model it patched holds
# its M as Parameters, and no optimizer it made decays an M (maskprior.param_groups).
CHECK_BLOCKS = """
import sys, torch, torch.nn as nn
for path in sys.argv[1:]:
    namespace = {}
    exec(compile(open(path).read(), path, "exec"), namespace)
    masks = [m.mask for v in namespace.values() if isinstance(v, nn.Module) for m in v.modules()
             if hasattr(m, "mask_prior_name")]
    assert masks and all(isinstance(mask, nn.Parameter) for mask in masks), path
    for optimizer in (v for v in namespace.values() if isinstance(v, torch.optim.Optimizer)):
        for group in optimizer.param_groups:
            held = {id(p) for p in group["params"]}
            assert group["weight_decay"] == 0.0 or not any(id(mask) in held for mask in masks), path
    print("ran", path, "imported maskprior from", namespace["maskprior"].__file__)
"""


# Each README block, by the file it is in and its place there, with what it needs beyond `pip install .`:
# the extras it imports (the README says which before each block), which pyproject.toml's [examples]
# and [test] extras install; a block whose extra is not installed is skipped with the reason.
README_BLOCKS = [(path, i, code) for path in README_PATHS for i, code in enumerate(readme_code(path))]
EXTRAS = ("torchvision", "timm", "transformers")


def test_the_readme_section_holds_its_examples_and_says_what_each_needs():
    """At least two examples (a torchvision model; timm's and Hugging Face's), and the line before
    each block names the extras it imports and how to install them."""
    for path in README_PATHS:
        blocks = readme_code(path)
        assert len(blocks) >= 2
        with open(path) as f:
            text = f.read()
        for code in blocks:
            needs = [extra for extra in EXTRAS if re.search(rf"^import .*\b{extra}\b", code, re.M)]
            before = text[:text.index(code)].rstrip().rsplit("\n", 2)[-2]    # the line before ```python
            assert needs and all(f"`{extra}`" in before for extra in needs) and "pip install" in before, before


@pytest.mark.parametrize("path, index, code", README_BLOCKS, ids=[f"{os.path.basename(p)}-{i}" for p, i, _ in
                                                                   README_BLOCKS])
def test_readme_snippets_run_from_another_directory(path, index, code, installed, tmp_path):
    """Each example runs as written in a directory of its own, importing the installed maskprior
    (not the repository's); each of its models has its attention patched, and each optimizer keeps
    every M undecayed (maskprior.param_groups)."""
    for extra in EXTRAS:
        if re.search(rf"^import .*\b{extra}\b", code, re.M):
            pytest.importorskip(extra, reason=f"README example {index} needs {extra}: pip install .[examples]")
    site, _ = installed
    example = tmp_path / f"example_{index}.py"
    example.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK_BLOCKS, str(example)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(f"imported maskprior from {site}") == 1, done.stdout
    assert len(done.stdout.splitlines()) >= 2, done.stdout     # the example shows its prior went in
