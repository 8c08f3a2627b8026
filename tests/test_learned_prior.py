"""Priors learned from a trained model: maskprior.learned_mask against its definition on synthetic
attention maps."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import maskprior

# ------------------------------------------------------------------------------------------
# The construction: M_ij = +A if i = j or p_ij >= tau / n_i, else -A
# ------------------------------------------------------------------------------------------

def test_an_encoder_row_opens_the_keys_at_or_above_tau_over_n():
    """N = 4: a uniform row's share is 0.25; an entry exactly at tau / N is open; the diagonal is
    open whatever it holds."""
    p = torch.tensor([[0.10, 0.25, 0.40, 0.25],      # diagonal 0.10 < 0.25: open anyway
                      [0.30, 0.20, 0.24, 0.26],
                      [0.05, 0.05, 0.05, 0.85],
                      [0.25, 0.25, 0.25, 0.25]])[None, None]        # (1, 1, 4, 4)
    expected = {1.0: [[1, 1, 1, 1], [1, 1, 0, 1], [0, 0, 1, 1], [1, 1, 1, 1]],
                2.0: [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 1]],   # >= 0.5
                0.5: [[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]}   # >= 0.125
    expected[2.0][0][0] = expected[0.5][0][0] = 1
    for tau, opened in expected.items():
        m = maskprior.learned_mask(p, 5.0, tau)
        assert m.dtype == torch.float32 and m.shape == (1, 1, 4, 4)
        assert m[0, 0].tolist() == [[5.0 if o else -5.0 for o in row] for row in opened], tau


def test_a_causal_row_counts_only_the_keys_it_sees():
    """Row i of a causal model sees i + 1 keys: its threshold is tau / (i + 1), not tau / N; the
    future (j > i) is closed even where the maps hold mass."""
    p = torch.tensor([[1.00, 0.00, 0.00, 0.00],
                      [0.45, 0.55, 0.00, 0.00],      # threshold 1/2: 0.45 closed
                      [0.30, 0.34, 0.36, 0.00],      # 1/3: 0.30 closed, 0.34 open
                      [0.20, 0.26, 0.30, 0.24]])     # 1/4: 0.20 and 0.24 closed
    m = maskprior.learned_mask(p, 1.0, 1.0, causal=True)
    assert m.tolist() == [[1, -1, -1, -1], [-1, 1, -1, -1], [-1, 1, 1, -1], [-1, 1, 1, 1]]
    # as an encoder (threshold 1/4 everywhere) the same rows open more, and the future too
    assert maskprior.learned_mask(p, 1.0, 1.0)[1].tolist() == [1, 1, -1, -1]
    past = torch.ones(4, 4).tril()
    uniform = past / past.sum(-1, keepdim=True) + 0.9 * (1 - past)   # mass in the future too
    assert maskprior.learned_mask(uniform, 1.0, causal=True).tolist() == \
        torch.where(past > 0, 1.0, -1.0).tolist()                     # the past open, the future not


@settings(deadline=None, max_examples=40, derandomize=True)
@given(seed=st.integers(0, 2 ** 16), n=st.integers(1, 9), tau=st.floats(0.1, 4.0),
       causal=st.booleans(), magnitude=st.sampled_from([1.0, 5.0, 10.0]),
       sharpness=st.sampled_from([0.5, 2.0, 6.0]))
def test_every_entry_follows_the_rule(seed, n, tau, causal, magnitude, sharpness):
    """Each entry of random maps (softmax over the keys a row sees; 2 layers x 3 heads) is +A
    exactly when i = j or p_ij >= tau / n_i, and a larger tau opens a subset."""
    g = torch.Generator().manual_seed(seed)
    logits = sharpness * torch.randn(2, 3, n, n, generator=g)
    future = torch.ones(n, n, dtype=torch.bool).triu(1)
    p = logits.masked_fill(future, -math.inf).softmax(-1) if causal else logits.softmax(-1)
    m = maskprior.learned_mask(p, magnitude, tau, causal)
    assert m.shape == p.shape and m.dtype == torch.float32
    for l in range(2):
        for h in range(3):
            for i in range(n):
                seen = i + 1 if causal else n
                for j in range(n):
                    opened = i == j or (p[l, h, i, j].item() >= tau / seen and not (causal and j > i))
                    assert m[l, h, i, j].item() == (magnitude if opened else -magnitude), (l, h, i, j)
    wider = maskprior.learned_mask(p, magnitude, tau / 2, causal)
    assert ((wider > 0) | (m < 0)).all()                    # open at tau -> open at tau / 2


@pytest.mark.parametrize("task", [*maskprior.BOOLEAN_MASKS, *maskprior.ARITHMETIC_MASKS])
def test_attention_that_is_the_hand_made_pattern_gives_it_back(task):
    """A model attending uniformly over each hand-made pattern's open keys (every one of them
    opens its diagonal): at tau = 1 the learned mask is that pattern, at its own magnitude."""
    pattern = (maskprior.boolean_mask(task, 2, 3) if task in maskprior.BOOLEAN_MASKS
               else maskprior.ARITHMETIC_MASKS[task](2, 4))
    opened = (pattern > 0).float()
    p = opened / opened.sum(-1, keepdim=True)
    assert torch.equal(maskprior.learned_mask(p, pattern.max().item()), pattern)


def test_open_fraction_counts_off_diagonal_and_for_causal_the_past_only():
    m = torch.tensor([[1.0, -1, 1], [1, 1, -1], [-1, -1, 1]])
    assert maskprior.open_fraction(m) == pytest.approx(2 / 6)          # (0,2) and (1,0) of 6
    assert maskprior.open_fraction(m, causal=True) == pytest.approx(1 / 3)   # (1,0) of 3
    assert maskprior.open_fraction(m.expand(2, 3, 3, 3)) == pytest.approx(2 / 6)
    assert maskprior.open_fraction(torch.ones(1, 1)) == 0.0
