"""The QK baselines against the public code they reproduce, on tiny cases.

Each test writes out, in its own words, what the reference code does (the "transcription") and
compares our implementation with it:
  - Structured (Opt): impulse_init of osiriszjq/structured_init (timm/models/vision_transformer.py),
    its Adam fit with the norm reset before steps 0, 100, 200, ...;
  - impulse (SVD): impulse_init and post_init_weights of osiriszjq/structured_initialization,
    which solve on the patch positions only, pos_embed[1:], with a patches-only target;
  - mimetic: get_ortho_like of the same code, Z uniform on +-sqrt(3 / D);
and the two cyclic3 mask patterns against their definitions (Appendix "Design of Mask Pattern",
Principle 4, layer-wise composition).
"""
import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import maskprior
import tasks
from helpers import mimetic_noise, qkv_weights


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------
# Structured (Opt): osiriszjq/structured_init, impulse_init
# ------------------------------------------------------------------------------------------

def reference_opt_fit(pe, target, q0, k0, steps, every, scale, lr):
    """Our transcription of the reference's fit. Q (H, D, r), K (H, r, D) start at q0, k0; nq is
    Q's mean column norm over D at the start. At every step i with i % every == 0, BEFORE the
    update, Q is divided by (its norm over dim 1) / nq and so is K (dim 1 of K is r). Then one
    Adam step on MSE(softmax(scale * pe Q K pe^T), target). The reference registers K before Q;
    Adam treats each tensor on its own, so the order does not matter."""
    k = k0.clone().requires_grad_()
    q = q0.clone().requires_grad_()
    nq = q0.norm(dim=1).mean()
    adam = torch.optim.Adam([k, q], lr=lr)
    for i in range(steps):
        if i % every == 0:
            with torch.no_grad():
                q.div_(q.norm(dim=1, keepdim=True) / nq)
                k.div_(k.norm(dim=1, keepdim=True) / nq)
        adam.zero_grad()
        out = torch.softmax((pe @ q @ k @ pe.T) * scale, -1)
        F.mse_loss(out, target).backward()
        adam.step()
    return q.detach(), k.detach()


def uniform_qk(heads, dim, rank, generator):
    """The reference's starting Q and K: uniform on +-sqrt(1 / (r H)), Q drawn first."""
    bound = math.sqrt(1 / rank / heads)
    q = bound * (2 * torch.rand(heads, dim, rank, generator=generator) - 1)
    k = bound * (2 * torch.rand(heads, rank, dim, generator=generator) - 1)
    return q, k


def test_opt_norm_reset_matches_the_reference_on_a_tiny_case():
    """One step at lr 0 leaves only the norm reset of the fresh draw: Q and K as the reference
    rescales them, every column of Q over D and of K over r at nq, Q's mean column norm."""
    heads, n, dim, rank = 2, 6, 5, 3
    g = torch.Generator().manual_seed(1)
    p = F.layer_norm(torch.randn(n, dim, generator=g), (dim,))
    target = (torch.rand(heads, n, n, generator=g) > 0.6).float()
    q, k = maskprior._fit_qk(p, target, rank, 1, 0.0, 100, rank ** -0.5, torch.Generator().manual_seed(5))
    q0, k0 = uniform_qk(heads, dim, rank, torch.Generator().manual_seed(5))
    nq = q0.norm(dim=1).mean()
    torch.testing.assert_close(q, q0 / (q0.norm(dim=1, keepdim=True) / nq))
    torch.testing.assert_close(k, k0 / (k0.norm(dim=1, keepdim=True) / nq))
    torch.testing.assert_close(q.norm(dim=1), nq.expand(heads, rank))   # (H, r): columns over D
    torch.testing.assert_close(k.norm(dim=1), nq.expand(heads, dim))    # (H, D): columns over r


@pytest.mark.parametrize("steps", [1, 101, 250])
def test_opt_fit_follows_the_reference_schedule(steps):
    """The whole fit, reset timing included: resets before steps 0, 100, 200 (steps=250 has
    three, the last 50 steps none; steps=1 is the reset of the fresh draw plus one update)."""
    heads, n, dim, rank = 2, 6, 8, 4
    g = torch.Generator().manual_seed(0)
    p = F.layer_norm(torch.randn(n, dim, generator=g), (dim,))
    target = (torch.rand(heads, n, n, generator=g) > 0.6).float()
    q, k = maskprior._fit_qk(p, target, rank, steps, 1e-2, 100, rank ** -0.5,
                             torch.Generator().manual_seed(5))
    q0, k0 = uniform_qk(heads, dim, rank, torch.Generator().manual_seed(5))
    want_q, want_k = reference_opt_fit(p, target, q0, k0, steps, 100, rank ** -0.5, 1e-2)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)


def test_structured_opt_writes_the_reference_solution_into_the_model():
    """End to end on a tiny Boolean-style encoder: positions x 18, P = layer_norm(positions), the
    0/1 pattern as target (not row-normalised), scale 1/sqrt(head_dim); q rows = Q_h^T, k rows = K_h; one fit shared
    by the layers with the same pattern."""
    depth, heads, dim, n = 2, 2, 12, 5
    torch.manual_seed(0)
    model = maskprior.Transformer(2, n, dim, depth, heads, dim, 1, mode="none")
    pos = model.pos.detach()[0].clone()
    pattern = torch.full((depth, heads, n, n), maskprior.CLOSE)
    pattern[:, 0].diagonal(dim1=-2, dim2=-1).fill_(maskprior.OPEN)
    pattern[:, 1, :, :2] = maskprior.OPEN          # two open keys per row: the target stays 0/1
    maskprior.structured_opt_init_(model, pattern, steps=130, lr=1e-2,
                                   generator=torch.Generator().manual_seed(2))
    rank = dim // heads
    pe = F.layer_norm(18 * pos, (dim,))
    q0, k0 = uniform_qk(heads, dim, rank, torch.Generator().manual_seed(2))
    target = (pattern[0] > 0).float()
    want_q, want_k = reference_opt_fit(pe, target, q0, k0, 130, 100, rank ** -0.5, 1e-2)
    torch.testing.assert_close(model.pos.detach()[0], 18 * pos)
    for attn in maskprior.attention_modules(model):
        w = attn.qkv.weight.detach()
        for h in range(heads):
            rows = slice(h * rank, (h + 1) * rank)
            torch.testing.assert_close(w[rows], want_q[h].T, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(w[heads * rank:][rows], want_k[h], rtol=1e-5, atol=1e-6)


def test_structured_opt_scale_argument_reaches_the_fit():
    """scale=1 (the reference function's own default) fits different Q, K than the default
    1/sqrt(head_dim) (the value its caller passes)."""
    def fit(**kw):
        torch.manual_seed(0)
        model = maskprior.Transformer(2, 5, 12, 1, 2, 12, 1, mode="none")
        pattern = torch.full((1, 2, 5, 5), maskprior.CLOSE)
        pattern.diagonal(dim1=-2, dim2=-1).fill_(maskprior.OPEN)
        maskprior.structured_opt_init_(model, pattern, steps=20, lr=1e-2,
                                       generator=torch.Generator().manual_seed(0), **kw)
        return maskprior.attention_modules(model)[0].qkv.weight.detach()
    assert torch.equal(fit(), fit(scale=6 ** -0.5))                   # head_dim 12 / 2 = 6
    assert not torch.allclose(fit(), fit(scale=1.0))


# ------------------------------------------------------------------------------------------
# Impulse (SVD) on a ViT: osiriszjq/structured_initialization, impulse_init + post_init_weights
# ------------------------------------------------------------------------------------------

def reference_impulse_target(heads, grid):
    """The reference's 0/1 impulse over patches only, (heads, grid^2, grid^2): head i takes
    k = [4, 1, 5, 3, 7, 0, 2, 6, 8][i % 9], row offset m = k // 3 - 1, column offset
    n = k % 3 - 1; query patch (row j, col c) has a 1 at key (j + m, c + n) when that is on the
    grid, and an all-zero row otherwise."""
    order = [4, 1, 5, 3, 7, 0, 2, 6, 8]
    t = torch.zeros(heads, grid * grid, grid * grid)
    for i in range(heads):
        m, n = order[i % 9] // 3 - 1, order[i % 9] % 3 - 1
        for j, c in itertools.product(range(grid), range(grid)):
            if 0 <= j + m < grid and 0 <= c + n < grid:
                t[i, j * grid + c, (j + m) * grid + (c + n)] = 1
    return t


def reference_impulse_product(pe, logits, rank, qk_norm=7.0):
    """W_Q,h^T W_K,h the reference writes for one head (noise-free target logits): P = layer_norm
    of the patch positions, P+ from the r largest singular values of P^T P, M = P+ T P+^T,
    Q = U_r sqrt(S_r), K = sqrt(S_r) V_r^T, each scaled to Frobenius norm 1 and then by 7."""
    p = F.layer_norm(pe, pe.shape[-1:])
    u, s, v = torch.svd(p.T @ p)
    s_inv = torch.zeros_like(s)
    s_inv[:rank] = 1 / s[:rank]
    p_inv = v @ torch.diag(s_inv) @ u.T @ p.T
    u, s, v = torch.svd(p_inv @ logits @ p_inv.T)
    q = u[:, :rank] * s[:rank].sqrt()
    k = (v[:, :rank] * s[:rank].sqrt()).T
    return qk_norm ** 2 * (q / q.norm()) @ (k / k.norm())


def tiny_vit():
    """32 x 32 images, patch 8: 4 x 4 patches + CLS; width 16, 2 heads of 8 (rank 8 >= the rank of
    M, so the rank-r truncation is exact and the product is unique)."""
    torch.manual_seed(0)
    return maskprior.ViT(32, 8, 10, 16, 2, 2, 32)


def svd_solution(model, pattern, **kw):
    """The q, k, v and proj weights structured_svd_init_ writes into a copy of model."""
    model = copy.deepcopy(model)
    maskprior.structured_svd_init_(model, pattern, generator=torch.Generator().manual_seed(0), **kw)
    return [w.detach() for w in (*(a.qkv.weight for a in maskprior.attention_modules(model)), model.pos)]


def test_vit_impulse_solve_inputs_are_the_reference_ones():
    """What goes into the solve: the patch positions only (skip defaults to 1 for a ViT, its CLS;
    to 0 for an encoder, whose patterns cover every position) and the patches-only target."""
    vit = tiny_vit()
    pos = vit.pos.detach()[0]
    torch.testing.assert_close(maskprior.pseudo_input(vit, skip=1), F.layer_norm(pos[1:], (16,)))
    impulse = maskprior.impulse_mask(2, 2, 4)
    assert all(torch.equal(a, b) for a, b in zip(svd_solution(vit, impulse), svd_solution(vit, impulse, skip=1)))
    torch.manual_seed(0)
    encoder = maskprior.Transformer(2, 5, 12, 1, 2, 12, 1)
    diagonal = torch.full((1, 2, 5, 5), maskprior.CLOSE)
    diagonal.diagonal(dim1=-2, dim2=-1).fill_(maskprior.OPEN)
    assert all(torch.equal(a, b) for a, b in zip(svd_solution(encoder, diagonal),
                                                   svd_solution(encoder, diagonal, skip=0)))
    assert not torch.equal(svd_solution(encoder, diagonal)[0], svd_solution(encoder, diagonal, skip=1)[0])
    pattern = maskprior.impulse_mask(1, 3, 4)
    torch.testing.assert_close(maskprior.pattern_targets(pattern[0, :, 1:, 1:]),
                               reference_impulse_target(3, 4))


def test_vit_impulse_init_equals_the_reference_solve():
    """With the noise off (noise_scale=0), W_Q,h^T W_K,h equals the reference's product computed
    on pos_embed[1:] x 18 and the patches-only 1000 x target, for every layer and head."""
    vit = tiny_vit()
    pos = vit.pos.detach()[0].clone()
    pattern = maskprior.impulse_mask(2, 2, 4)
    maskprior.structured_svd_init_(vit, pattern, noise_scale=0.0,
                                   generator=torch.Generator().manual_seed(0))
    target = reference_impulse_target(2, 4)
    for attn in maskprior.attention_modules(vit):
        w = attn.qkv.weight.detach()
        for h in range(2):
            rows = slice(h * 8, (h + 1) * 8)
            got = w[rows].T @ w[16:32][rows]
            want = reference_impulse_product(18 * pos[1:], 1000 * target[h], 8)
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def test_solving_with_the_cls_row_would_differ():
    """The same solve with the CLS row kept (skip=0) gives another product,
    so the test above does tell the two setups apart."""
    vit = tiny_vit()
    pos = vit.pos.detach()[0].clone()
    maskprior.structured_svd_init_(vit, maskprior.impulse_mask(2, 2, 4), noise_scale=0.0, skip=0,
                                   generator=torch.Generator().manual_seed(0))
    w = maskprior.attention_modules(vit)[0].qkv.weight.detach()
    want = reference_impulse_product(18 * pos[1:], 1000 * reference_impulse_target(2, 4)[1], 8)
    got = w[8:16].T @ w[16:32][8:16]
    assert (got - want).abs().max() > 0.05 * want.abs().max()


# ------------------------------------------------------------------------------------------
# Mimetic: get_ortho_like of osiriszjq/structured_initialization
# ------------------------------------------------------------------------------------------

def test_mimetic_noise_is_uniform_with_variance_one_over_dim():
    """Our transcription of get_ortho_like's Z (the draws test_mimetic_init_uses_uniform_noise
    finds in the model): entries uniform on [-sqrt(3/D), sqrt(3/D)]: mean 0, variance 1/D, support
    bounded by sqrt(3/D) and reaching it, kurtosis 1.8 (a normal has 3)."""
    dim = 256
    z = mimetic_noise(dim, torch.Generator().manual_seed(0)).double()
    bound = math.sqrt(3 / dim)
    assert z.shape == (dim, dim)
    assert z.abs().max() <= bound and z.abs().max() > 0.999 * bound
    assert abs(z.mean()) < 0.01 / math.sqrt(dim)
    assert z.var().item() == pytest.approx(1 / dim, rel=0.02)
    kurtosis = (z ** 4).mean() / (z ** 2).mean() ** 2
    assert kurtosis.item() == pytest.approx(1.8, abs=0.03)
    # the 10 % quantiles of a uniform are evenly spaced
    deciles = torch.quantile(z.flatten()[:50000], torch.linspace(0.1, 0.9, 9, dtype=torch.float64))
    torch.testing.assert_close(deciles, torch.linspace(-0.8, 0.8, 9, dtype=torch.float64) * bound,
                               atol=0.02 * bound, rtol=0)


def test_mimetic_init_uses_uniform_noise():
    """One head with head_dim = width (exact factoring): W_Q^T W_K = 0.7 Z1 + 0.7 I and
    W_V W_O = 0.4 Z2 - 0.4 I with Z1, Z2 the next two mimetic_noise draws; so the off-diagonal
    entries lie within 0.7 sqrt(3/D) (a normal Z would exceed it)."""
    dim = 32
    model = maskprior.Transformer(2, 16, dim, 1, 1, dim, 1, mode="none")
    maskprior.mimetic_init_(model, generator=torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(3)
    z1, z2 = mimetic_noise(dim, g), mimetic_noise(dim, g)
    attn = maskprior.attention_modules(model)[0]
    w_q, w_k, w_v = qkv_weights(attn)
    eye = torch.eye(dim)
    qk = w_q.T @ w_k
    torch.testing.assert_close(qk, 0.7 * z1 + 0.7 * eye, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w_v.T @ attn.proj.weight.detach().T, 0.4 * z2 - 0.4 * eye,
                               atol=1e-4, rtol=1e-4)
    off = qk[~eye.bool()]
    assert off.abs().max() <= 0.7 * math.sqrt(3 / dim) + 1e-4


# ------------------------------------------------------------------------------------------
# cyclic3: composed (Principle 4) and direct masks against their definitions
# ------------------------------------------------------------------------------------------

BIT = 1  # bit x_i sits at position 1 + i; position 0 is CLS


def opened(layer_mask):
    """{query: set of open keys} of one (N, N) logit matrix."""
    return {q: set((layer_mask[q] > 0).nonzero().flatten().tolist()) for q in range(len(layer_mask))}


def receptive_fields(masks):
    """Which input positions each position can have read after the given layers, (N, N) bool:
    a layer lets query q take in everything its open keys had (and keeps its own residual)."""
    n = masks.shape[-1]
    reach = torch.eye(n, dtype=torch.bool)
    for m in masks:
        step = (m > 0) | torch.eye(n, dtype=torch.bool)
        reach = (step.float() @ reach.float()) > 0
    return reach


def cyclic3_monomials(d=15):
    """The monomials S with a nonzero Fourier coefficient in the cyclic3 target, computed on the
    whole cube from tasks.py's definition, hat f(S) = mean f(x) prod_{i in S} x_i (degree 3)."""
    cube = tasks.boolean_dataset("cyclic3")["x_test"]
    assert cube.shape == (2 ** d, d)
    f = tasks.boolean_task("cyclic3", cube).target
    return {frozenset(s) for s in itertools.combinations(range(d), 3)
            if abs((f * cube[:, list(s)].prod(1)).mean()) > 0.5}


def test_cyclic3_composed_layers_match_their_definition():
    d, depth, heads = 15, 4, 3
    m = maskprior.boolean_mask("cyclic3", depth, heads, d=d)
    assert m.shape == (depth, heads, d + 1, d + 1)
    assert set(m.unique().tolist()) == {maskprior.OPEN, maskprior.CLOSE}
    assert torch.equal(m[:, :1].expand_as(m), m)                       # every head the same
    for layer in range(depth):
        keys = opened(m[layer, 0])
        if layer < 2:   # build layers: bit i sees x_i and x_{i+1 mod 15}; CLS only itself
            assert keys[0] == {0}
            assert all(keys[BIT + i] == {BIT + i, BIT + (i + 1) % d} for i in range(d))
        else:           # readout layers: CLS sees every position; bits only themselves
            assert keys[0] == set(range(d + 1))
            assert all(keys[BIT + i] == {BIT + i} for i in range(d))


def test_cyclic3_composition_builds_exactly_the_target_triples():
    """After the first layer a bit token spans a pair; after the second exactly one cyclic triple
    of f, all 15 of them once each; the CLS token reaches every bit after the readout layer."""
    d = 15
    m = maskprior.boolean_mask("cyclic3", 4, 3, d=d)[:, 0]            # (layers, N, N)
    one = receptive_fields(m[:1])
    assert all(set(one[BIT + i].nonzero().flatten().tolist()) == {BIT + i, BIT + (i + 1) % d}
               for i in range(d))
    two = receptive_fields(m[:2])
    triples = [frozenset(j - BIT for j in two[BIT + i].nonzero().flatten().tolist())
               for i in range(d)]
    assert set(triples) == cyclic3_monomials(d) and len(set(triples)) == d
    assert two[0].nonzero().flatten().tolist() == [0]                 # CLS has read nothing yet
    assert receptive_fields(m[:3])[0].all()


def test_cyclic3_direct_matches_its_definition():
    """The direct variant: every layer, bit i sees {i, i+1, i+2} (mod 15), CLS only itself, so one
    layer already spans each whole triple."""
    d = 15
    m = maskprior.boolean_mask("cyclic3", 4, 3, "direct", d=d)
    assert torch.equal(m[:1, :1].expand_as(m), m)                      # every layer and head
    keys = opened(m[0, 0])
    assert keys[0] == {0}
    assert all(keys[BIT + i] == {BIT + (i + s) % d for s in range(3)} for i in range(d))
    one = receptive_fields(m[:1, 0])
    assert {frozenset(j - BIT for j in one[BIT + i].nonzero().flatten().tolist())
            for i in range(d)} == cyclic3_monomials(d)


def test_cyclic3_variants_are_registered():
    """composed is cyclic3's default, direct its alternative; majority has no variant."""
    assert maskprior.BOOLEAN_MASK_VARIANTS["cyclic3"] == ("composed", "direct")
    assert torch.equal(maskprior.boolean_mask("cyclic3", 4, 3), maskprior.boolean_mask("cyclic3", 4, 3, "composed"))
    assert not torch.equal(maskprior.boolean_mask("cyclic3", 4, 3), maskprior.boolean_mask("cyclic3", 4, 3, "direct"))
    assert "majority" in maskprior.BOOLEAN_MASKS and "majority" not in maskprior.BOOLEAN_MASK_VARIANTS
    with pytest.raises(KeyError, match="direct"):
        maskprior.boolean_mask("majority", 4, 3, "direct")


def test_2parity_composed_builds_the_product_then_lets_cls_read_it():
    """--mask-variant composed of 2parity (Principle 4): layers 1-2 open x0 <-> x1 with CLS closed (the
    paper's 2parity pattern), layers 3-4 let CLS read x0 and x1 while every bit sees only itself."""
    d, x0, x1 = 15, BIT, BIT + 1
    m = maskprior.boolean_mask("2parity", 4, 3, "composed")
    assert m.shape == (4, 3, d + 1, d + 1)
    assert torch.equal(m[:, :1].expand_as(m), m)                       # every head alike
    assert torch.equal(m[:2], maskprior.boolean_mask("2parity", 2, 3, d=d))   # the build layers
    for layer in (2, 3):
        keys = opened(m[layer, 0])
        assert keys[0] == {0, x0, x1}                                  # CLS reads the two bits
        assert all(keys[i] == {i} for i in range(1, d + 1))           # every bit only itself
    assert set(m.unique().tolist()) == {maskprior.OPEN, maskprior.CLOSE}
    assert maskprior.BOOLEAN_MASK_VARIANTS["2parity"] == ("direct", "composed")     # direct: the default
    assert torch.equal(maskprior.boolean_mask("2parity", 4, 3, "direct"), maskprior.boolean_mask("2parity", 4, 3))
