"""The attention block of Section 4.1 and its variants, against hand-written formulas."""
import math

import pytest
import torch
import torch.nn.functional as F

import maskprior
from helpers import qkv_by_hand
from maskprior import MaskedSelfAttention

BIT = 1     # bit x_i of the Boolean tasks sits at position BIT + i; position 0 is CLS


def make_block(mode="learnable", heads=3, seq_len=7, dim=12, mask_init=None, **kw):
    torch.manual_seed(1)
    if mask_init is None and mode != "none":
        mask_init = 4 * torch.randn(heads, seq_len, seq_len)
    return MaskedSelfAttention(dim, heads, seq_len, mask_init=mask_init, mode=mode, **kw).double()


def merge(block, y):
    B, H, N, hd = y.shape
    return y.transpose(1, 2).reshape(B, N, H * hd) @ block.proj.weight.T + block.proj.bias


def reference(block, x):
    """softmax(Q K^T / sqrt(d) + log sigmoid(M)) V, written out (Section 4.1)."""
    q, k, v = qkv_by_hand(block, x)
    n = x.shape[1]
    logits = q @ k.transpose(-1, -2) / math.sqrt(block.head_dim)
    logits = logits + torch.log(torch.sigmoid(block.mask[:, :n, :n]))
    attn = torch.softmax(logits, -1)
    return merge(block, attn @ v), attn


@pytest.mark.parametrize("n", [7, 4])
def test_learnable_block_equals_written_out_formula(n, monkeypatch):
    block = make_block()
    x = torch.randn(2, n, 12, dtype=torch.float64)
    expected, expected_attn = reference(block, x)
    torch.testing.assert_close(block(x), expected)               # the rule's path: written out here
    monkeypatch.setattr(MaskedSelfAttention, "path", "fused")
    torch.testing.assert_close(block(x), expected)               # the fused path (SDPA)
    y, attn = block(x, return_attn=True)                         # written-out path
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(attn, expected_attn)
    assert attn.shape == (2, 3, n, n)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 3, n, dtype=torch.float64))


def functional_form(q, k, v, mask, scale):
    """Section 4.1 as one line: softmax(Q K^T / sqrt(d) + log sigmoid(s M)) V, q, k, v (B, H, n, d),
    mask (H, n, n)."""
    return (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + F.logsigmoid(scale * mask)).softmax(-1) @ v


@pytest.mark.parametrize("n, mask_scale, causal",
                         [(7, 1.0, False), (4, 10.0, False), (7, 1.0, True)])
def test_plain_path_equals_the_functional_form(n, mask_scale, causal):
    """The class's return_attn path and its default path compute the one-line Section 4.1 equation
    (plus the hard causal -inf when causal)."""
    block = make_block(mask_scale=mask_scale, causal=causal)
    x = torch.randn(2, n, 12, dtype=torch.float64)
    q, k, v = qkv_by_hand(block, x)
    mask = block.mask[:, :n, :n]
    if causal:                           # sigmoid(-inf) = 0: log sigmoid adds the hard -inf
        mask = mask.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    expected = merge(block, functional_form(q, k, v, mask, mask_scale))
    torch.testing.assert_close(block(x, return_attn=True)[0], expected)
    torch.testing.assert_close(block(x), expected)


def test_mask_gradient_of_sdpa_path_equals_plain_path_and_autograd_of_formula(monkeypatch):
    """SDPA (forced: on the CPU the rule would take the written-out path for a learnable mask) and the
    written-out path both give M the gradient that autograd finds through the written-out formula."""
    block = make_block()
    monkeypatch.setattr(type(block), "path", "fused")
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    grads = []
    for run in ("sdpa", "plain", "reference"):
        block.zero_grad()
        if run == "sdpa":
            y = block(x)
        elif run == "plain":
            y = block(x, return_attn=True)[0]
        else:
            y = reference(block, x)[0]
        (y ** 2).sum().backward()
        grads.append(block.mask.grad.clone())
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[0], grads[2])
    torch.testing.assert_close(grads[1], grads[2])


def test_zero_mask_equals_vanilla_attention():
    """log sigmoid(0) = -log 2 shifts every logit of a row equally, which softmax ignores."""
    zero = make_block(mask_init=torch.zeros(3, 7, 7))
    vanilla = make_block(mode="none")
    vanilla.load_state_dict({k: v for k, v in zero.state_dict().items() if k != "mask"})
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    torch.testing.assert_close(zero(x), vanilla(x))
    assert vanilla.mask is None


def test_open_mask_equals_vanilla_and_closed_entries_are_suppressed():
    open_all = torch.full((3, 7, 7), maskprior.OPEN)
    block = make_block(mask_init=open_all)
    vanilla = make_block(mode="none")
    vanilla.load_state_dict({k: v for k, v in block.state_dict().items() if k != "mask"})
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    torch.testing.assert_close(block(x), vanilla(x), rtol=1e-4, atol=1e-4)
    diag_only = torch.full((3, 7, 7), maskprior.CLOSE)
    diag_only[:, range(7), range(7)] = maskprior.OPEN
    _, attn = make_block(mask_init=diag_only)(x, return_attn=True)
    assert attn.diagonal(dim1=-2, dim2=-1).min() > 0.9


def test_fixed_mode_trains_no_mask_and_learnable_does():
    x = torch.randn(4, 7, 12, dtype=torch.float64)
    for mode, moves in (("fixed", False), ("learnable", True)):
        block = make_block(mode=mode)
        before = block.mask.detach().clone()
        opt = torch.optim.Adam([p for p in block.parameters() if p.requires_grad], lr=0.1)
        (block(x) ** 2).sum().backward()
        opt.step()
        assert isinstance(block.mask, torch.nn.Parameter)
        assert block.mask.requires_grad is moves
        assert (not torch.equal(block.mask, before)) is moves


def test_hadamard_mode_equals_its_formula():
    block = make_block(mode="hadamard")
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    q, k, v = qkv_by_hand(block, x)
    attn = torch.sigmoid(block.mask) * torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(block.head_dim), -1)
    torch.testing.assert_close(block(x), merge(block, attn @ v))
    y, returned = block(x, return_attn=True)
    torch.testing.assert_close(returned, attn)
    assert (returned.sum(-1) < 1).all()  # rows no longer sum to one (Appendix B)


def test_causal_learnable_block():
    block = make_block(causal=True, mask_scale=10.0)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    y, attn = block(x, return_attn=True)
    assert attn.triu(1).abs().max() == 0
    torch.testing.assert_close(block(x), y)
    q, k, v = qkv_by_hand(block, x)
    logits = q @ k.transpose(-1, -2) / math.sqrt(block.head_dim) + F.logsigmoid(10.0 * block.mask)
    logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(attn, torch.softmax(logits, -1))


def test_wrong_mask_shape_raises_naming_the_expected_shape():
    with pytest.raises(ValueError, match=r"\(3, 7, 7\)"):
        MaskedSelfAttention(12, 3, 7, mask_init=torch.zeros(7, 7))
    with pytest.raises(ValueError, match=r"\(3, 7, 7\)"):
        MaskedSelfAttention(12, 3, 7, mask_init=torch.zeros(2, 7, 7))
    with pytest.raises(ValueError, match="mode"):
        MaskedSelfAttention(12, 3, 7, mode="multiplicative")
    with pytest.raises(ValueError, match="longer"):
        make_block()(torch.randn(1, 8, 12, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\(4, 3, 16, 16\)"):
        maskprior.Transformer(2, 16, 12, 4, 3, 12, 1, masks=torch.zeros(2, 3, 16, 16), mode="learnable")


def test_transformer_takes_one_mask_per_layer_and_returns_attention():
    masks = maskprior.boolean_mask("cyclic3", 4, 3)
    masks[1] = maskprior.boolean_mask("majority", 1, 3)[0]
    model = maskprior.Transformer(2, 16, 12, 4, 3, 12, 1, masks=masks, mode="learnable")
    for layer, attn in enumerate(maskprior.attention_modules(model)):
        torch.testing.assert_close(attn.mask.detach(), masks[layer])
    tokens = torch.randint(0, 2, (5, 15))
    out, attns = model(tokens, return_attn=True)
    assert out.shape == (5, 1) and len(attns) == 4 and attns[0].shape == (5, 3, 16, 16)
    torch.testing.assert_close(model(tokens), out)


@pytest.mark.parametrize("task", list(maskprior.BOOLEAN_MASKS))
def test_boolean_masks_have_the_documented_structure(task):
    masks = maskprior.boolean_mask(task, 4, 3)
    assert masks.shape == (4, 3, 16, 16)
    assert set(masks.unique().tolist()) == {maskprior.OPEN, maskprior.CLOSE}
    assert (masks.diagonal(dim1=-2, dim2=-1) == maskprior.OPEN).all()  # every token sees itself
    if task == "2parity":
        assert masks[0, 0, BIT + 0, BIT + 1] == masks[0, 0, BIT + 1, BIT + 0] == maskprior.OPEN
        assert (masks == maskprior.OPEN).sum() == 4 * 3 * (16 + 2)
    if task == "majority":
        assert (masks[0, 0, 0, [BIT + 0, BIT + 1, BIT + 2]] == maskprior.OPEN).all()
        assert (masks == maskprior.OPEN).sum() == 4 * 3 * (16 + 3)
    if task == "cyclic3":   # composed: bit i sees i + 1 (mod 15) in the two build layers
        assert masks[0, 0, BIT + 14, BIT + 0] == masks[1, 0, BIT + 13, BIT + 14] == maskprior.OPEN
        assert masks[0, 0, BIT + 13, BIT + 0] == masks[0, 0, BIT + 0, BIT + 14] == maskprior.CLOSE
        direct = maskprior.boolean_mask("cyclic3", 4, 3, "direct")   # i sees i + 1 and i + 2, every layer
        assert direct[3, 0, BIT + 14, BIT + 0] == direct[3, 0, BIT + 13, BIT + 0] == maskprior.OPEN
    if task == "threesym":
        for head, (a, b) in enumerate([(0, 1), (1, 2), (2, 0)]):
            assert masks[0, head, BIT + a, BIT + b] == maskprior.OPEN
            assert (masks[0, head] == maskprior.OPEN).sum() == 16 + 2


def test_boolean_mask_names_its_choices():
    with pytest.raises(KeyError, match="threesym"):
        maskprior.boolean_mask("parity", 4, 3)
    with pytest.raises(KeyError, match="composed"):
        maskprior.boolean_mask("2parity", 4, 3, "stacked")
