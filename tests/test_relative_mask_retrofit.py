"""maskprior.add_mask_prior with a relative M (relative=True; issue 65): one logit per head and
distance, (heads, K + 1) on a causal layer, (heads, 2K + 1) on the others. It gives the logits of the
dense M built from the same function of distance; the retrofit's position rules hold (cached
generation, left padding, offsets read the distances the one-piece run reads), now past K and past
any N; a gradient reaches each distance's logit; what cannot take it is refused by name. The README's
section "A prior at any length" runs as written."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import maskprior
from helpers import ROOT

T = pytest.importorskip("transformers", reason="needs the test extras (pip install .[test]): Hugging Face transformers")
from test_add_mask_prior import readme_code  # noqa: E402
from test_add_mask_prior_positions import GREEDY, MODELS, NEW, PROMPT, VOCAB, step_logits  # noqa: E402

K = 6                     # the table covers distances 0..6: the 13 tokens of a generation pass it
pytestmark = pytest.mark.usefixtures("one_thread")


def table(heads, width, seed=1):
    return 3 * torch.randn(2, heads, width, generator=torch.Generator().manual_seed(seed))   # (layers, H, R)


def clamped_dense(tables, n, causal=True):
    """The dense M (layers, H, n, n) with M_ij = table[i - j] clamped to the table: what a relative M reads."""
    i = torch.arange(n)
    k = tables.shape[-1] - 1 if causal else tables.shape[-1] // 2
    d = (i[:, None] - i[None, :]).clamp(0, k) if causal else (i[:, None] - i[None, :]).clamp(-k, k) + k
    return tables[..., d]


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def relative(request):
    """(the model with a relative M of distances 0..K, a copy of it with the dense M that table gives at
    16 positions, a prompt (1, 5), its no-cache greedy continuation (1, 13), no-cache logits (1, 13, V))."""
    torch.manual_seed(0)
    model = MODELS[request.param]().eval()
    dense = copy.deepcopy(model)
    tables = table(model.config.num_attention_heads, K + 1)
    maskprior.add_mask_prior(model, tables, relative=True)
    maskprior.add_mask_prior(dense, clamped_dense(tables, 16))
    prompt = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = model.generate(prompt, max_new_tokens=NEW, use_cache=False, **GREEDY)
        logits = model(reference, use_cache=False).logits
    return model, dense, prompt, reference, logits


def test_relative_gives_the_dense_m_of_the_same_distances(relative):
    model, dense, _, reference, logits = relative
    patched = [m for m in model.modules() if hasattr(m, "mask_prior_name")]
    assert len(patched) == 2 and patched[0].mask.shape == (model.config.num_attention_heads, K + 1)
    with torch.no_grad():
        for n in range(1, reference.shape[1] + 1):              # up to 13 tokens: past K = 6
            torch.testing.assert_close(model(reference[:, :n], use_cache=False).logits,
                                       dense(reference[:, :n], use_cache=False).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_cached_and_left_padded_generation_give_the_one_piece_run(relative, cache):
    """The prompt alone, and left-padded by 3 beside a longer prompt, through a cache: each step
    reads the distances the no-cache run reads (positions from the first real token)."""
    model, _, prompt, reference, logits = relative
    longer = torch.randint(1, VOCAB, (1, PROMPT + 3), generator=torch.Generator().manual_seed(4))
    batches = {"alone": (prompt, torch.ones_like(prompt)),
               "padded": (torch.cat([nn.functional.pad(prompt, (3, 0)), longer]),
                          torch.stack([torch.arange(PROMPT + 3) >= 3, torch.ones(PROMPT + 3, dtype=torch.bool)]))}
    for ids, attention_mask in batches.values():
        with torch.no_grad():
            out = model.generate(ids, attention_mask=attention_mask.long(), max_new_tokens=NEW,
                                 cache_implementation=cache, output_logits=True, return_dict_in_generate=True,
                                 **GREEDY)
        assert torch.equal(out.sequences[0, -reference.shape[1]:], reference[0])
        torch.testing.assert_close(step_logits(out), logits[0, PROMPT - 1:-1], rtol=0, atol=1e-4)


def test_an_offset_reads_the_same_distances_past_any_n():
    """Llama's RoPE and a relative M both depend on i - j alone: a run at position_ids 100..105
    gives the logits of the run at 0..5 (a dense M of any N refuses position 100)."""
    torch.manual_seed(0)
    model = MODELS["llama"]().eval()
    maskprior.add_mask_prior(model, table(4, K + 1), relative=True)
    ids = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        offset = model(ids, position_ids=torch.arange(100, 106)[None], use_cache=False).logits
        plain = model(ids, use_cache=False).logits
    torch.testing.assert_close(offset, plain, rtol=0, atol=1e-5)


def test_a_gradient_reaches_each_distance_logit():
    torch.manual_seed(0)
    model = MODELS["llama"]()
    masks = maskprior.add_mask_prior(model, table(4, K + 1), relative=True)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    model(ids, labels=ids).loss.backward()
    assert all(m.mask.grad is not None and (m.mask.grad != 0).all() for m in masks)


def test_an_encoder_table_spans_both_directions():
    """nn.TransformerEncoder (not causal): (H, 2K + 1) for d = -K..K gives the dense M it reads."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    dense = copy.deepcopy(model)
    tables = table(2, 2 * K + 1)
    maskprior.add_mask_prior(model, tables, relative=True)
    x = torch.randn(3, 20, 16)                                  # 20 tokens: past K both ways
    maskprior.add_mask_prior(dense, clamped_dense(tables, 20, causal=False))
    with torch.no_grad():
        torch.testing.assert_close(model(x), dense(x))


def test_what_cannot_take_a_relative_m_is_refused():
    layer = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1,
                                  enable_nested_tensor=False)
    with pytest.raises(ValueError, match=r"relative mask \(2, 4\) is for a layer over text"):
        maskprior.add_mask_prior(layer, torch.zeros(2, 4), relative=True)      # not causal: odd widths only
    with pytest.raises(ValueError, match=r"\(heads, R\) or \(layers = 1, heads, R\)"):
        maskprior.add_mask_prior(layer, torch.zeros(2, 2, 5), relative=True)
    vit = T.ViTModel(T.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=8, patch_size=4))
    with pytest.raises(ValueError, match="an image's layer takes M dense"):
        maskprior.add_mask_prior(vit, torch.zeros(2, 5), relative=True)


def test_the_readme_section_runs():
    """The README's "A prior at any length" code block, as written, from another directory."""
    [code] = readme_code(os.path.join(ROOT, "README.md"), "## A prior at any length")
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(ROOT), env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2048" in done.stdout
