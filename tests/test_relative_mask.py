"""A relative M (issue 65): one logit per head and distance d = i - j, 0..K back (causal) or -K..K,
read past K at its last logit. Its attention equals the dense M's built from the same function of
distance at every length up to N; each distance's logit takes the gradient of its diagonal; past K it
runs; the GPT without positions runs past its block size; train.py's inits and --no-pos."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import maskprior
import train
from helpers import runs_of
from maskprior import MaskedSelfAttention

DIM, HEADS, N = 12, 3, 9


def pair(causal, values, mode="learnable", path="auto"):
    """Two blocks with the same weights: M dense (HEADS, N, N) and relative, both from the function of
    distance d -> values[h, d + N - 1] (values (HEADS, 2N - 1)), float64."""
    prior = lambda d: values[:, d + N - 1]             # (HEADS, *d.shape): a prior per head
    index = torch.arange(N)
    dense = prior(index[:, None] - index[None, :])                                 # (H, N, N)
    table = prior(torch.arange(0 if causal else 1 - N, N))                         # (H, N) or (H, 2N - 1)
    blocks = [MaskedSelfAttention(DIM, HEADS, N, mask_init=m, mode=mode, causal=causal, mask_scale=2.0).double()
              for m in (dense, table)]
    blocks[1].load_state_dict({**blocks[0].state_dict(), "mask": table})
    for block in blocks:
        block.path = path
    return blocks


@settings(max_examples=12, deadline=None)
@given(causal=st.booleans(), seed=st.integers(0, 2 ** 16), mode=st.sampled_from(["learnable", "fixed", "hadamard"]),
       path=st.sampled_from(["written", "fused"]))
def test_relative_attention_equals_the_dense_one_at_every_length(causal, seed, mode, path):
    generator = torch.Generator().manual_seed(seed)
    values = 3 * torch.randn(HEADS, 2 * N - 1, generator=generator, dtype=torch.float64)
    dense, relative = pair(causal, values, mode, path)
    assert relative.mask.shape == (HEADS, N if causal else 2 * N - 1)
    for n in range(1, N + 1):                                   # every length up to N
        x = torch.randn(2, n, DIM, generator=generator, dtype=torch.float64)
        torch.testing.assert_close(relative(x), dense(x))
        (_, a_relative), (_, a_dense) = relative(x, return_attn=True), dense(x, return_attn=True)
        torch.testing.assert_close(a_relative, a_dense)
    # the bias pictured (L, H, N, N): equal where attention reads it (a causal table's future reads d = 0)
    seen = torch.ones(N, N, dtype=torch.bool).tril() if causal else torch.ones(N, N, dtype=torch.bool)
    torch.testing.assert_close(maskprior.mask_biases(relative)[..., seen], maskprior.mask_biases(dense)[..., seen])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("path", ["written", "fused"])
def test_each_distance_logit_takes_the_gradient_of_its_diagonal(causal, path):
    # dL / dtable[h, d] = the sum of dL / dM[h, i, j] over the entries with i - j = d (clamped past K)
    values = torch.randn(HEADS, 2 * N - 1, dtype=torch.float64)
    dense, relative = pair(causal, values, path=path)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    target = torch.randn(2, N, DIM, dtype=torch.float64)
    for block in (dense, relative):
        F.mse_loss(block(x), target).backward()
    i = torch.arange(N)
    d = i[:, None] - i[None, :]
    distances = range(0, N) if causal else range(1 - N, N)
    summed = torch.stack([dense.mask.grad[:, d == k].sum(-1) for k in distances], 1)     # (H, R)
    torch.testing.assert_close(relative.mask.grad, summed)
    assert (relative.mask.grad.abs() > 0).all()                 # every head's every distance learns
    if causal:   # the future's entries read distance 0 under -inf: no gradient from them
        assert (dense.mask.grad[:, d < 0] == 0).all()


@pytest.mark.parametrize("causal", [True, False])
def test_a_length_past_k_reads_the_last_logit(causal):
    K, n = 3, 11
    table = torch.randn(HEADS, K + 1 if causal else 2 * K + 1, dtype=torch.float64)
    relative = MaskedSelfAttention(DIM, HEADS, K + 1, mask_init=table, causal=causal).double()
    i = torch.arange(n)
    d = (i[:, None] - i[None, :]).clamp(0 if causal else -K, K)
    clamped = table[:, d if causal else d + K]                                      # (H, n, n)
    dense = MaskedSelfAttention(DIM, HEADS, n, mask_init=clamped, causal=causal).double()
    dense.load_state_dict({**relative.state_dict(), "mask": clamped})
    x = torch.randn(2, n, DIM, dtype=torch.float64)
    y = relative(x)
    assert y.shape == (2, n, DIM) and torch.isfinite(y).all()
    torch.testing.assert_close(y, dense(x))
    with pytest.raises(ValueError, match="longer than seq_len=4"):   # a dense M still stops at its N
        MaskedSelfAttention(DIM, HEADS, K + 1, mask_init=torch.zeros(HEADS, K + 1, K + 1))(x.float())


def test_constructors_give_both_forms_of_one_function_of_distance():
    dense, table = (maskprior.relative_distance_mask(2, 6, relative=r) for r in (False, True))
    assert table.shape == (2, 6) and table[1].tolist() == [0, -1, -2, -3, -4, -5]
    i = torch.arange(6)
    assert torch.equal(dense, table[:, (i[:, None] - i[None, :]).clamp(min=0)])
    window = lambda d: torch.where((d >= 0) & (d < 2), maskprior.OPEN, maskprior.CLOSE)   # a causal window of 2
    assert maskprior.distance_mask(window, 1, 4, relative=True).tolist() == [[10, 10, -10, -10]]
    encoder = maskprior.distance_mask(lambda d: d.float(), 2, 3, causal=False, relative=True)
    assert encoder.shape == (2, 5) and encoder[0].tolist() == [-2, -1, 0, 1, 2]


def test_relative_mask_shapes_are_checked():
    with pytest.raises(ValueError, match=r"\(3, 2K \+ 1\) not; got \(3, 4\)"):   # an encoder's table is odd
        MaskedSelfAttention(DIM, 3, 7, mask_init=torch.zeros(3, 4))
    with pytest.raises(ValueError, match=r"\(3, 7, 7\)"):
        MaskedSelfAttention(DIM, 3, 7, mask_init=torch.zeros(2, 5), causal=True)
    MaskedSelfAttention(DIM, 3, 7, mask_init=torch.zeros(3, 4), causal=True)     # K = 3 < N: fine


def test_gpt_without_positions_runs_past_its_block_size():
    masks = maskprior.relative_distance_mask(2, 8, relative=True).expand(2, -1, -1)          # (L, H, T)
    gpt = maskprior.GPT(40, 8, 16, 2, 2, mode="learnable", masks=masks, positions=False)
    assert gpt.pos is None and sum(p.numel() for n, p in gpt.named_parameters() if n.endswith("mask")) == 2 * 2 * 8
    idx = torch.randint(0, 40, (2, 32))                         # 4 x the block size
    logits, loss = gpt(idx[:, :-1], idx[:, 1:])
    assert logits.shape == (2, 31, 40) and torch.isfinite(loss)
    loss.backward()
    assert (maskprior.attention_modules(gpt)[0].mask.grad[:, -1] != 0).all()   # the last logit reads past K
    with pytest.raises(ValueError, match="block_size=8"):       # learned positions stop at the block size
        maskprior.GPT(40, 8, 16, 2, 2, mode="learnable", masks=masks)(idx)


def test_train_builds_the_relative_inits_and_refuses_them_elsewhere():
    run = runs_of("--task", "lm", "--init", "mask-relative-fixed", "--no-pos")[0]
    assert run.config["no_pos"] is True
    assert runs_of("--task", "lm", "--init", "mask-relative")[0].config["no_pos"] is False
    with pytest.raises(train.UsageError, match="--no-pos applies to language tasks only"):
        runs_of("--task", "majority", "--no-pos")
    with pytest.raises(train.UsageError, match="--init mask-relative is not available for boolean"):
        runs_of("--task", "majority", "--init", "mask-relative")
