"""Numerical checks of the paper's theory against torch.autograd.

Theorem 1 (Section 6.1, Appendix "Proof of Theorem 1"): the Jacobians of one masked attention row
    p = softmax(K q / sqrt(d) + log sigmoid(m))
with respect to q, each key k_j and each mask entry m_j. Corollary 1: their norm bounds.
Proposition 1 (Appendix B): ||softmax(A)||_F >= 1, and the Hadamard mask sigma(M) o softmax(A)
has a Jacobian no larger (in Frobenius norm) than softmax's own.

Part 1 checks the algebra on hand-built tensors and does not use maskprior. Part 2 checks
Theorem 1 and Corollary 1 on what maskprior.MaskedSelfAttention computes: the gradient that
autograd sends into the module's `mask` parameter, against the theorem's closed form. Part 3
checks Theorem 1's query and key Jacobians and Proposition 1 on the module's own probabilities
(learnable, hadamard and vanilla modes), differentiated with respect to the module's q and k.
"""
import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import maskprior
from helpers import qkv_by_hand, split_heads

SETTINGS = settings(deadline=None, max_examples=40, derandomize=True)


@st.composite
def attention_row(draw):
    """A query q (d,), keys K (N, d) and mask logits m (N,), float64, drawn by Hypothesis."""
    n = draw(st.integers(1, 8))
    d = draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    q_scale = draw(st.floats(0.1, 5.0))
    k_scale = draw(st.floats(0.1, 5.0))
    m_scale = draw(st.floats(0.1, 12.0))
    g = torch.Generator().manual_seed(seed)
    q = q_scale * torch.randn(d, generator=g, dtype=torch.float64)
    k = k_scale * torch.randn(n, d, generator=g, dtype=torch.float64)
    m = m_scale * torch.randn(n, generator=g, dtype=torch.float64)
    return q, k, m


def row_probs(q, k, m):
    """Theorem 1's p_j = softmax_j(q . k_j / sqrt(d) + log sigmoid(m_j))."""
    return torch.softmax(k @ q / math.sqrt(q.shape[0]) + F.logsigmoid(m), dim=0)


def jacobians(q, k, m):
    """dp/dq (N, d), dp/dK (N, N, d) with [i, j] = dp_i/dk_j, dp/dm (N, N), all by autograd."""
    return torch.autograd.functional.jacobian(row_probs, (q, k, m))


@SETTINGS
@given(attention_row())
def test_theorem1_jacobians_match_autograd(row):
    q, k, m = row
    n, d = k.shape
    p = row_probs(q, k, m)
    dq, dk, dm = jacobians(q, k, m)
    eye = torch.eye(n, dtype=torch.float64)
    # dp_i/dq = p_i / sqrt(d) (k_i - sum_l p_l k_l)
    expected_dq = p[:, None] / math.sqrt(d) * (k - p @ k)
    # dp_i/dk_j = p_i (delta_ij - p_j) q / sqrt(d)
    expected_dk = (p[:, None] * (eye - p[None, :]))[:, :, None] * q / math.sqrt(d)
    # dp_i/dm_j = p_i (delta_ij - p_j) sigma(-m_j)
    expected_dm = p[:, None] * (eye - p[None, :]) * torch.sigmoid(-m)[None, :]
    torch.testing.assert_close(dq, expected_dq, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dk, expected_dk, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(dm, expected_dm, rtol=1e-9, atol=1e-12)


@SETTINGS
@given(attention_row())
def test_corollary1_bounds_hold(row):
    q, k, m = row
    n, d = k.shape
    p = row_probs(q, k, m)
    dq, dk, dm = jacobians(q, k, m)  # measured by autograd, not by the closed forms
    b_q, b_k = q.norm(), k.norm(dim=1).max()
    eye = torch.eye(n, dtype=torch.float64)
    slack = 1e-12
    # ||dp_i/dq|| <= 2 p_i B_k / sqrt(d)
    assert (dq.norm(dim=1) <= 2 * p * b_k / math.sqrt(d) + slack).all()
    # ||dp_i/dk_j|| <= p_i |delta_ij - p_j| B_q / sqrt(d) <= p_i B_q / sqrt(d)
    tight = p[:, None] * (eye - p[None, :]).abs() * b_q / math.sqrt(d)
    assert (dk.norm(dim=2) <= tight + slack).all()
    assert (dk.norm(dim=2) <= (p * b_q / math.sqrt(d))[:, None] + slack).all()
    # |dp_i/dm_j| <= p_i |delta_ij - p_j| sigma(-m_j) <= p_i
    tight_m = p[:, None] * (eye - p[None, :]).abs() * torch.sigmoid(-m)[None, :]
    assert (dm.abs() <= tight_m + slack).all()
    assert (dm.abs() <= p[:, None] + slack).all()


def test_corollary1_mask_gradient_shrinks_as_the_entry_opens():
    """sigma(-m) moderates the mask gradient: a wide-open entry (m = 10) barely moves."""
    q, k = torch.randn(4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    grads = []
    for value in (0.0, 10.0):
        m = torch.zeros(5, dtype=torch.float64)
        m[2] = value
        _, _, dm = jacobians(q, k, m)
        grads.append(dm[:, 2].abs().max())
    assert grads[1] < 1e-3 * grads[0]


@st.composite
def logits_and_mask(draw):
    n = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    a_scale = draw(st.floats(0.0, 10.0))
    m_shift = draw(st.floats(-15.0, 15.0))
    g = torch.Generator().manual_seed(seed)
    a = a_scale * torch.randn(n, n, generator=g, dtype=torch.float64)
    mask = m_shift + 3 * torch.randn(n, n, generator=g, dtype=torch.float64)
    return a, mask


@SETTINGS
@given(logits_and_mask())
def test_proposition1_softmax_frobenius_norm_at_least_one(am):
    a, _ = am
    assert torch.softmax(a, dim=-1).norm() >= 1 - 1e-12


@SETTINGS
@given(logits_and_mask())
def test_proposition1_hadamard_jacobian_is_no_larger(am):
    a, mask = am
    jac_softmax = torch.autograd.functional.jacobian(lambda x: torch.softmax(x, -1), a)
    jac_hadamard = torch.autograd.functional.jacobian(
        lambda x: torch.sigmoid(mask) * torch.softmax(x, -1), a)
    assert jac_hadamard.norm() <= jac_softmax.norm() + 1e-12


def test_proposition1_hadamard_can_collapse_where_additive_cannot():
    """The degenerate case of the proof: sigma(M) ~ 0 drives the Hadamard map's norm to ~0, while
    the additive mask's rows still sum to one."""
    a = torch.randn(4, 4, dtype=torch.float64)
    m = torch.full((4, 4), -30.0, dtype=torch.float64)
    assert (torch.sigmoid(m) * torch.softmax(a, -1)).norm() < 1e-12
    additive = torch.softmax(a + F.logsigmoid(m), -1)
    torch.testing.assert_close(additive.sum(-1), torch.ones(4, dtype=torch.float64))


# ----------------------------------------------------------------------------------------------
# Part 2: Theorem 1 and Corollary 1 on maskprior.MaskedSelfAttention
# ----------------------------------------------------------------------------------------------
# The module computes p = softmax(Q K^T / sqrt(d) + log sigmoid(s M)) per batch element b and
# head h, one row per query i. Theorem 1 with m_j = s M_hij (chain rule: dm_j/dM_hij = s) gives
#     dp_bhia / dM_hij = s p_bhia (delta_aj - p_bhij) sigma(-s M_hij),
# and no other entry of M reaches row (b, h, i). For a scalar L with G_bhia = dL/dp_bhia:
#     dL/dM_hij = s sigma(-s M_hij) sum_b p_bhij (G_bhij - sum_a G_bhia p_bhia).


@st.composite
def attention_module(draw):
    """A float64 MaskedSelfAttention (learnable) and an input x (B, n, dim), n <= seq_len."""
    heads, head_dim = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    n = draw(st.integers(1, 6))
    seq_len = n + draw(st.integers(0, 2))          # n < seq_len uses the top-left block of M
    batch = draw(st.integers(1, 3))
    mask_scale = draw(st.sampled_from([1.0, 10.0]))
    causal = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = draw(st.floats(0.5, 6.0)) * torch.randn(heads, seq_len, seq_len, generator=g)
    if draw(st.booleans()):                         # the paper's +-10 patterns
        mask = torch.where(mask > 0, maskprior.OPEN, maskprior.CLOSE)
    dim = heads * head_dim
    torch.manual_seed(seed)
    block = maskprior.MaskedSelfAttention(dim, heads, seq_len, mask_init=mask, causal=causal,
                                          mask_scale=mask_scale).double()
    x = draw(st.floats(0.1, 3.0)) * torch.randn(batch, n, dim, generator=g, dtype=torch.float64)
    return block, x


def theorem1_mask_gradient(block, p, grad_p):
    """dL/dM by Theorem 1 from p (B, H, n, n) and G = dL/dp (B, H, n, n); zero outside (n, n)."""
    n, s = p.shape[-1], block.mask_scale
    m = block.mask.detach()[:, :n, :n]                                   # (H, n, n)
    centred = grad_p - (grad_p * p).sum(-1, keepdim=True)               # G_ij - sum_a G_ia p_ia
    expected = torch.zeros_like(block.mask)
    expected[:, :n, :n] = s * torch.sigmoid(-s * m) * (p * centred).sum(0)
    return expected


@settings(deadline=None, max_examples=25, derandomize=True)
@given(attention_module())
def test_theorem1_mask_gradient_of_the_modules_probabilities(module_and_input):
    """L = sum(W o p) over the probabilities the module returns: G = W."""
    block, x = module_and_input
    _, p = block(x, return_attn=True)                                    # (B, H, n, n)
    weights = torch.randn(p.shape, generator=torch.Generator().manual_seed(0), dtype=p.dtype)
    (grad,) = torch.autograd.grad((weights * p).sum(), block.mask)
    expected = theorem1_mask_gradient(block, p.detach(), weights)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)


@settings(deadline=None, max_examples=25, derandomize=True)
@given(attention_module())
def test_theorem1_mask_gradient_of_the_modules_output(module_and_input):
    """L = sum(W o y) with y the module's output by its default path (without return_attn; on
    the CPU that is the written-out softmax, since the mask needs a gradient):
    G = dL/dp = (dL/dO) V^T, O = p V the per-head output before W_O."""
    block, x = module_and_input
    y = block(x)                                                         # (B, n, dim)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(0), dtype=y.dtype)
    (grad,) = torch.autograd.grad((weights * y).sum(), block.mask)
    with torch.no_grad():
        _, p = block(x, return_attn=True)                                # (B, H, n, n)
        v = qkv_by_hand(block, x)[2]                                     # (B, H, n, hd)
        grad_o = split_heads(weights @ block.proj.weight, block.heads)   # dL/dO, (B, H, n, hd)
        expected = theorem1_mask_gradient(block, p, grad_o @ v.transpose(-1, -2))
    torch.testing.assert_close(grad, expected, rtol=1e-8, atol=1e-11)


@settings(deadline=None, max_examples=15, derandomize=True)
@given(attention_module(), st.data())
def test_corollary1_bounds_the_modules_mask_jacobian(module_and_input, data):
    """Every |dp_bhia / dM_hij| of one returned row, by autograd: <= s p_a |delta_aj - p_j|
    sigma(-s M_hij) <= s p_a (Corollary 1 in units of s M). Open entries (M = 10, s = 1) move by at
    most sigma(-10) p_a = 4.5e-5 p_a."""
    block, x = module_and_input
    B, n, _ = x.shape
    b, h, i = (data.draw(st.integers(0, top - 1)) for top in (B, block.heads, n))
    _, p = block(x, return_attn=True)
    row = p[b, h, i]                                                     # (n,)
    jacobian = torch.stack([torch.autograd.grad(row[a], block.mask, retain_graph=True)[0][h, i, :n]
                            for a in range(n)])                          # [a, j], (n, n)
    row, s = row.detach(), block.mask_scale
    m = block.mask.detach()[h, i, :n]
    eye = torch.eye(n, dtype=row.dtype)
    tight = s * row[:, None] * (eye - row[None, :]).abs() * torch.sigmoid(-s * m)[None, :]
    assert (jacobian.abs() <= tight + 1e-12).all()
    assert (jacobian.abs() <= s * row[:, None] + 1e-12).all()


# ----------------------------------------------------------------------------------------------
# Part 3: Theorem 1's query and key Jacobians and Proposition 1 on maskprior.MaskedSelfAttention
# ----------------------------------------------------------------------------------------------
# The block's qkv projection is replaced by a stand-in that returns chosen q and k (v = 0), so
# the block's own forward (return_attn=True) computes the probabilities from them and autograd
# differentiates those probabilities with respect to q and k themselves.

class GivenProjections(torch.nn.Module):
    """Stands in for a block's qkv Linear: returns the given (B, n, 3 H d) tensor whatever x is."""

    def __init__(self, qkv):
        super().__init__()
        self.qkv = qkv

    def forward(self, x):
        return self.qkv


def module_probabilities(block, q, k):
    """The block's own attention probabilities (B, H, n, n) when its projections yield q and k,
    (B, H, n, d) each, laid out as the block's view (B, n, 3, H, d) reads them."""
    B, H, n, d = q.shape
    qkv = torch.stack([q, k, torch.zeros_like(q)])                    # (3, B, H, n, d)
    block.qkv = GivenProjections(qkv.permute(1, 3, 0, 2, 4).reshape(B, n, 3 * H * d))
    return block(torch.zeros(B, n, 1, dtype=q.dtype), return_attn=True)[1]


@st.composite
def block_with_queries_and_keys(draw, mode="learnable", head_dim=None):
    """A float64 MaskedSelfAttention of `mode`, with q and k (B, H, n, d) drawn by Hypothesis;
    head_dim=None draws d, a function of n fixes it."""
    heads, n, batch = draw(st.integers(1, 2)), draw(st.integers(1, 5)), draw(st.integers(1, 2))
    d = draw(st.integers(1, 4)) if head_dim is None else head_dim(n)
    seq_len = n + draw(st.integers(0, 2))          # n < seq_len uses the top-left block of M
    mask_scale, causal = draw(st.sampled_from([1.0, 10.0])), draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    mask = draw(st.floats(0.5, 6.0)) * torch.randn(heads, seq_len, seq_len, generator=g)
    block = maskprior.MaskedSelfAttention(heads * d, heads, seq_len, head_dim=d, mask_init=mask,
                                          mode=mode, causal=causal, mask_scale=mask_scale).double()
    scales = [draw(st.floats(0.1, 4.0)) for _ in range(2)]
    q, k = (s * torch.randn(batch, heads, n, d, generator=g, dtype=torch.float64) for s in scales)
    return block, q, k


THEORY_SETTINGS = settings(deadline=None, max_examples=20, derandomize=True)


@THEORY_SETTINGS
@given(block_with_queries_and_keys(), st.data())
def test_theorem1_query_jacobian_of_the_modules_probabilities(drawn, data):
    """Row i of head h, batch b: dp_a/dq_i = p_a / sqrt(d) (k_a - sum_l p_l k_l), and no other
    query reaches the row (with causal, the hidden keys have p = 0 and drop out of the sum)."""
    block, q, k = drawn
    B, H, n, d = q.shape
    b, h, i = (data.draw(st.integers(0, top - 1)) for top in (B, H, n))
    jac = torch.autograd.functional.jacobian(
        lambda q: module_probabilities(block, q, k)[b, h, i], q)         # (n, B, H, n, d)
    p = module_probabilities(block, q, k)[b, h, i].detach()            # (n,)
    expected = torch.zeros_like(jac)
    expected[:, b, h, i] = p[:, None] / math.sqrt(d) * (k[b, h] - p @ k[b, h])
    torch.testing.assert_close(jac, expected, rtol=1e-9, atol=1e-12)


@THEORY_SETTINGS
@given(block_with_queries_and_keys(), st.data())
def test_theorem1_key_jacobian_of_the_modules_probabilities(drawn, data):
    """Row i of head h, batch b: dp_a/dk_j = p_a (delta_aj - p_j) q_i / sqrt(d) for every key j
    of that head and batch, zero for every other key."""
    block, q, k = drawn
    B, H, n, d = q.shape
    b, h, i = (data.draw(st.integers(0, top - 1)) for top in (B, H, n))
    jac = torch.autograd.functional.jacobian(
        lambda k: module_probabilities(block, q, k)[b, h, i], k)         # (n, B, H, n, d)
    p = module_probabilities(block, q, k)[b, h, i].detach()            # (n,)
    centred = torch.eye(n, dtype=p.dtype) - p[None, :]                  # delta_aj - p_j
    expected = torch.zeros_like(jac)
    expected[:, b, h] = (p[:, None] * centred)[:, :, None] * q[b, h, i] / math.sqrt(d)
    torch.testing.assert_close(jac, expected, rtol=1e-9, atol=1e-12)


def block_of_mode(block, mode):
    """A fresh block of another mode with block's shape, causal, mask_scale and mask (mode "none": no
    mask); module_probabilities supplies its q and k."""
    other = maskprior.MaskedSelfAttention(
        block.heads * block.head_dim, block.heads, block.seq_len, head_dim=block.head_dim,
        mask_init=None if mode == "none" else block.mask.detach(), mode=mode, causal=block.causal,
        mask_scale=block.mask_scale)
    return other.double()


@THEORY_SETTINGS
@given(block_with_queries_and_keys(), st.floats(-20.0, 15.0))
def test_proposition1_attention_norms_of_the_modules(drawn, shift):
    """Proposition 1, Eq. (1), per batch element and head: the additive block's A has rows that
    sum to one, so ||A||_F >= 1 for any M. The Hadamard block's map is H = sigma(s M) o P entry by
    entry, P the vanilla block's softmax (Appendix B), so row i sums to sum_j sigma(s M_ij) P_ij
    < 1 and, with the proof's ||P||_F >= 1, min sigma(s M) <= ||H||_F <= ||P||_F: the only lower
    bound left is the gate's, and H collapses where every sigma(s M) ~ 0 (M = -40), while the
    additive block's norm stays >= 1."""
    block, q, k = drawn
    n = q.shape[-2]
    for m in (block.mask.detach() + shift, torch.full_like(block.mask, -40.0)):
        with torch.no_grad():
            block.mask.copy_(m)
        additive = module_probabilities(block, q, k)                   # (B, H, n, n)
        torch.testing.assert_close(additive.sum(-1), torch.ones(additive.shape[:-1], dtype=q.dtype))
        assert (additive.flatten(2).norm(dim=-1) >= 1 - 1e-12).all()
        gated = block_of_mode(block, "hadamard")        # its M: block's, rounded to float32
        hadamard = module_probabilities(gated, q, k)                    # (B, H, n, n)
        vanilla = module_probabilities(block_of_mode(block, "none"), q, k)
        gate = torch.sigmoid(gated.mask_scale * gated.mask.detach()[:, :n, :n])    # (H, n, n)
        torch.testing.assert_close(hadamard, gate * vanilla, rtol=1e-9, atol=1e-300)
        torch.testing.assert_close(hadamard.sum(-1), (gate * vanilla).sum(-1), rtol=1e-9, atol=1e-300)
        hadamard_norm, vanilla_norm = hadamard.flatten(2).norm(dim=-1), vanilla.flatten(2).norm(dim=-1)
        assert (vanilla_norm >= 1 - 1e-12).all()
        # ||H||_F >= min sigma(s M) ||P||_F, divided through by the smallest gate of each head
        # (M = -40 gives gates of 1e-174, whose squares would underflow)
        smallest_gate = gate.flatten(1).min(-1).values[:, None, None]             # (H, 1, 1)
        assert ((hadamard / smallest_gate).flatten(2).norm(dim=-1) >= vanilla_norm * (1 - 1e-9)).all()
        assert (hadamard_norm <= vanilla_norm + 1e-12).all()
    assert (hadamard_norm < 1e-12).all()                               # M = -40: collapsed


@THEORY_SETTINGS
@given(block_with_queries_and_keys(head_dim=lambda n: n))
def test_proposition1_hadamard_jacobian_of_the_module_is_no_larger(drawn):
    """Proposition 1, Eq. (2). With keys k_j = sqrt(d) e_j the logits Q K^T / sqrt(d) are Q itself,
    so the Jacobian with respect to q is the Jacobian with respect to the logits A. The vanilla
    block's is softmax's, dp_ia / dA_ij = p_ia (delta_aj - p_ij); the Hadamard block's is
    sigma(s M_ia) times it, and its Frobenius norm is no larger."""
    block, q, _ = drawn
    B, H, n, d = q.shape
    k = math.sqrt(d) * torch.eye(n, dtype=q.dtype).expand(B, H, n, n)  # (B, H, n, d = n)
    jacobians = {}
    for mode in ("none", "hadamard"):
        other = block_of_mode(block, mode)
        jacobians[mode] = torch.autograd.functional.jacobian(
            lambda a: module_probabilities(other, a, k), q)             # (B, H, n, n, B, H, n, n)
    p = module_probabilities(block_of_mode(block, "none"), q, k).detach()   # (B, H, n, n)
    eye = torch.eye(n, dtype=q.dtype)
    softmax_jac = torch.zeros_like(jacobians["none"])
    for b in range(B):
        for h in range(H):
            for i in range(n):   # row i of A reaches row i of p only: p_a (delta_aj - p_j)
                softmax_jac[b, h, i, :, b, h, i, :] = p[b, h, i][:, None] * (eye - p[b, h, i][None, :])
    torch.testing.assert_close(jacobians["none"], softmax_jac, rtol=1e-9, atol=1e-12)
    gate = torch.sigmoid(block.mask_scale * block.mask.detach()[:, :n, :n])   # (H, n, n)
    torch.testing.assert_close(jacobians["hadamard"],
                               gate[None, :, :, :, None, None, None, None] * softmax_jac,
                               rtol=1e-9, atol=1e-12)
    per_head = lambda jac: jac.flatten(4).flatten(2, 3).norm(dim=(-2, -1))   # (B, H)
    # the blocks of other (b, h) are zero, so the norm over the whole Jacobian splits per head
    assert (per_head(jacobians["hadamard"]) <= per_head(jacobians["none"]) + 1e-12).all()
