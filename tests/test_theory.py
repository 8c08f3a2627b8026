"""Numerical checks of the paper's theory against torch.autograd.

Theorem 1 (Section 6.1, Appendix "Proof of Theorem 1"): the Jacobians of one masked attention row
    p = softmax(K q / sqrt(d) + log sigmoid(m))
with respect to q, each key k_j and each mask entry m_j. Corollary 1: their norm bounds.
Proposition 1 (Appendix B): ||softmax(A)||_F >= 1, and the Hadamard mask sigma(M) o softmax(A)
has a Jacobian no larger (in Frobenius norm) than softmax's own.
"""
import math

import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

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
    assert (tight <= (p * b_q / math.sqrt(d))[:, None] + slack).all()
    # |dp_i/dm_j| <= p_i |delta_ij - p_j| sigma(-m_j) <= p_i
    tight_m = p[:, None] * (eye - p[None, :]).abs() * torch.sigmoid(-m)[None, :]
    assert (dm.abs() <= tight_m + slack).all()
    assert (tight_m <= p[:, None] + slack).all()


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
    a, mask = am
    assert torch.softmax(a, dim=-1).norm() >= 1 - 1e-12
    assert (torch.sigmoid(mask) * torch.softmax(a, dim=-1)).norm() >= 0


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
