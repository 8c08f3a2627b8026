"""The query-key initialisation baselines do what they claim before any training step, and the
persistence numbers measure what they say (Section 6.1, Figure "Comparison of
attention patterns before and after training")."""
import pytest
import torch

import maskprior
from helpers import mimetic_noise, qkv_weights


def boolean_model(dim=64, heads=3, depth=4, seed=0):
    torch.manual_seed(seed)
    return maskprior.Transformer(2, 16, dim, depth, heads, dim, 1, mode="none")


@pytest.mark.parametrize("task", list(maskprior.BOOLEAN_MASKS))
def test_structured_svd_puts_the_pattern_into_qk(task, mass_on_pseudo_input):
    pattern = maskprior.boolean_mask(task, 4, 3)
    default = mass_on_pseudo_input(boolean_model(), pattern)
    model = maskprior.structured_svd_init_(boolean_model(), pattern,
                                           generator=torch.Generator().manual_seed(0))
    mass = mass_on_pseudo_input(model, pattern)
    assert mass.min() > 0.99          # measured: 1.00 on every task, layer and head
    assert default.max() < 0.4        # measured: 0.07 (0.18 for cyclic3's wider pattern)


@pytest.mark.parametrize("task", ["majority", "threesym"])
def test_structured_opt_puts_the_pattern_into_qk(task, mass_on_pseudo_input):
    pattern = maskprior.boolean_mask(task, 4, 3)
    model = maskprior.structured_opt_init_(boolean_model(), pattern,
                                           generator=torch.Generator().manual_seed(0))
    mass = mass_on_pseudo_input(model, pattern)
    assert mass.mean() > 0.85         # measured: 0.92 (2000 Adam steps at lr 1e-4)
    assert mass.min() > 0.6
    # one solution reused in every layer, since every layer has the same pattern
    attns = maskprior.attention_modules(model)
    qk_rows = 2 * attns[0].heads * attns[0].head_dim           # the q and k rows of qkv.weight
    assert all(torch.equal(attns[0].qkv.weight[:qk_rows], a.qkv.weight[:qk_rows]) for a in attns)


def test_structured_opt_solves_each_distinct_layer_pattern(mass_on_pseudo_input):
    pattern = maskprior.boolean_mask("cyclic3", 2, 3)
    pattern[1] = maskprior.boolean_mask("majority", 1, 3)[0]
    model = maskprior.structured_opt_init_(boolean_model(depth=2), pattern, steps=300, lr=1e-3)
    mass = mass_on_pseudo_input(model, pattern)
    assert mass.min() > 0.5
    w0, w1 = (a.qkv.weight for a in maskprior.attention_modules(model))
    assert not torch.equal(w0, w1)


def test_mimetic_heads_are_identity_like_at_the_paper_shape():
    """Width 64, heads of 21: W_Q,h W_K,h^T is the best rank-21 approximation of 0.7 Z1 + 0.7 I
    (Eckart-Young, from its SVD), Z1 the head's draw (each layer draws one Z1 per head, then Z2),
    and beta1 I survives the truncation."""
    model = maskprior.mimetic_init_(boolean_model(), generator=torch.Generator().manual_seed(4))
    draws = torch.Generator().manual_seed(4)
    eye = torch.eye(64)
    for attn in maskprior.attention_modules(model):
        w_q, w_k, _ = qkv_weights(attn)
        for h in range(3):
            u, s, vh = torch.linalg.svd(0.7 * mimetic_noise(64, draws) + 0.7 * eye)
            best_rank_21 = u[:, :21] @ torch.diag(s[:21]) @ vh[:21]
            rows = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
            product = w_q[rows].T @ w_k[rows]                  # W_Q,h W_K,h^T, (D, D)
            torch.testing.assert_close(product, best_rank_21, atol=1e-4, rtol=1e-4)
            assert product.diagonal().mean() > 0.3     # beta1 I survives the rank-21 truncation
        mimetic_noise(64, draws)                               # the layer's Z2


def test_prior_stats_measure_mass_and_correlation():
    pattern = maskprior.boolean_mask("majority", 2, 3)            # (2, 3, 16, 16)
    target = maskprior.pattern_targets(pattern)
    exact = target / target.sum(-1, keepdim=True)
    mass, corr = maskprior.prior_stats(exact, pattern)
    torch.testing.assert_close(mass, torch.ones(2, 3))
    assert (corr > 0.9).all()
    uniform = torch.full_like(exact, 1 / 16)
    mass, corr = maskprior.prior_stats(uniform, pattern)
    open_fraction = target.sum(-1).mean(-1) / 16
    torch.testing.assert_close(mass, open_fraction)
    torch.testing.assert_close(corr, torch.zeros(2, 3))


def test_persistence_fields_report_mask_drift():
    pattern = maskprior.boolean_mask("2parity", 1, 2)
    attn = torch.full((1, 2, 16, 16), 1 / 16)
    before = torch.nn.functional.logsigmoid(pattern)
    fields = maskprior.persistence_fields({"attn": attn, "bias": before},
                                      {"attn": attn, "bias": before * 1.5}, pattern)
    assert fields["mask_drift"] == pytest.approx(0.5)
    assert torch.tensor(fields["mask_drift_per_head"]) == pytest.approx(torch.full((1, 2), 0.5))
    assert fields["prior_mass_init"] == fields["prior_mass_final"]
    # uniform 1/16 attention: the mass on the open entries is the open fraction of each row
    open_fraction = maskprior.pattern_targets(pattern).sum(-1).mean(-1) / 16
    assert fields["prior_mass_init"] == pytest.approx(open_fraction.mean().item())
    no_mask = {"attn": attn, "bias": None}
    assert maskprior.persistence_fields(no_mask, no_mask, pattern)["mask_drift"] is None


def test_persistence_fields_of_the_causal_prior_give_the_bias_by_distance():
    """No pattern (the GPT prior): no mass or correlation, the drift and the mean bias at each
    distance i - j, log sigmoid(s * -d) before training."""
    bias = torch.nn.functional.logsigmoid(10.0 * maskprior.relative_distance_mask(2, 5))[None]
    fields = maskprior.persistence_fields({"attn": None, "bias": bias}, {"attn": None, "bias": bias}, None)
    assert "prior_mass_init" not in fields and fields["mask_drift"] == 0
    expected = [torch.nn.functional.logsigmoid(torch.tensor(-10.0 * d)).item() for d in range(5)]
    assert fields["bias_by_distance_init"] == pytest.approx(expected, rel=1e-5)
    assert fields["bias_by_distance_final"] == fields["bias_by_distance_init"]
