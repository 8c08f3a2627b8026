"""MaskedSelfAttention's two paths, F.scaled_dot_product_attention (SDPA) and the written-out
_plain, compute the same function, and _sdpa_is_faster picks between them by the rule measured
with tests/bench_attention_paths.py. Forcing SDPA (even where the rule would not take it) and
forcing _plain must give the same outputs and gradients for every mode, causal or not, on the
full mask and on its top-left block; dropout draws the same mask on both."""
import pytest
import torch

import maskprior
from maskprior import MaskedSelfAttention

DIM, HEADS, SEQ_LEN = 12, 3, 7


def force(monkeypatch, path):
    """Make every MaskedSelfAttention take `path` ("sdpa" or "plain") outside return_attn."""
    monkeypatch.setattr(MaskedSelfAttention, "_sdpa_is_faster",
                        lambda self, q, bias, dropout: path == "sdpa")


def make(mode, causal, dropout=0.0, mask_scale=1.0):
    torch.manual_seed(3)
    mask = None if mode == "none" else 4 * torch.randn(HEADS, SEQ_LEN, SEQ_LEN)
    return MaskedSelfAttention(DIM, HEADS, SEQ_LEN, mask_init=mask, mode=mode, causal=causal,
                               mask_scale=mask_scale, dropout=dropout).double()


def output_and_grads(module, x):
    module.zero_grad()
    x = x.clone().requires_grad_()
    y = module(x)
    (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters() if p.requires_grad}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("n", [SEQ_LEN, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["learnable", "fixed", "none"])
def test_sdpa_and_plain_paths_agree(monkeypatch, mode, causal, n):
    module = make(mode, causal, mask_scale=10.0 if causal else 1.0)
    x = torch.randn(5, n, DIM, dtype=torch.float64)
    results = {}
    for path in ("sdpa", "plain"):
        force(monkeypatch, path)
        results[path] = output_and_grads(module, x)
    (y_s, gx_s, g_s), (y_p, gx_p, g_p) = results["sdpa"], results["plain"]
    torch.testing.assert_close(y_s, y_p)
    torch.testing.assert_close(gx_s, gx_p)
    assert g_s.keys() == g_p.keys() and ("mask" in g_s) == (mode == "learnable")
    for name in g_s:
        torch.testing.assert_close(g_s[name], g_p[name])
    # the return_attn path (always _plain) gives the same output too
    torch.testing.assert_close(module(x, return_attn=True)[0], y_p)


@pytest.mark.parametrize("mode", ["learnable", "none"])
def test_attention_dropout_draws_the_same_mask_on_both_paths(monkeypatch, mode):
    """On the CPU, SDPA with dropout runs its math kernel, which calls dropout on the attention
    probabilities exactly as _plain does: the same random numbers, so switching paths does not
    change a training run with attention dropout (the language presets use 0.1 / 0.2)."""
    module = make(mode, causal=True, dropout=0.3).train()
    x = torch.randn(5, SEQ_LEN, DIM, dtype=torch.float64)
    outputs = []
    for path in ("sdpa", "plain"):
        force(monkeypatch, path)
        torch.manual_seed(11)
        outputs.append(module(x))
    torch.testing.assert_close(outputs[0], outputs[1])
    force(monkeypatch, "plain")
    torch.manual_seed(12)
    assert not torch.allclose(module(x), outputs[1])   # the dropout is really on


def qkv_and_bias(module, n, requires_grad):
    q = torch.randn(2, HEADS, n, module.head_dim)
    bias = None if module.mask is None else torch.zeros(HEADS, n, n, requires_grad=requires_grad)
    return q, bias


def test_rule_on_the_cpu():
    long = MaskedSelfAttention.sdpa_cpu_min_tokens
    vanilla = MaskedSelfAttention(DIM, HEADS, 2 * long, mode="none")
    masked = MaskedSelfAttention(DIM, HEADS, 2 * long, mode="learnable")
    fixed = MaskedSelfAttention(DIM, HEADS, 2 * long, mode="fixed")
    # vanilla attention: the fused CPU kernel from sdpa_cpu_min_tokens positions on
    assert not vanilla._sdpa_is_faster(*qkv_and_bias(vanilla, long - 1, False), 0.0)
    assert vanilla._sdpa_is_faster(*qkv_and_bias(vanilla, long, False), 0.0)
    # dropout, or a mask that needs a gradient, would send SDPA to its math kernel: always plain
    assert not vanilla._sdpa_is_faster(*qkv_and_bias(vanilla, long, False), 0.1)
    assert not masked._sdpa_is_faster(*qkv_and_bias(masked, 2 * long, True), 0.0)
    # a mask without gradient (mode "fixed", or any mask under no_grad) is like vanilla
    assert fixed._sdpa_is_faster(*qkv_and_bias(fixed, long, False), 0.0)
    assert not fixed._sdpa_is_faster(*qkv_and_bias(fixed, long - 1, False), 0.0)
    assert masked._sdpa_is_faster(*qkv_and_bias(masked, long, False), 0.0)


def test_use_sdpa_false_forces_the_plain_path(monkeypatch):
    long = MaskedSelfAttention.sdpa_cpu_min_tokens
    module = MaskedSelfAttention(DIM, HEADS, 2 * long, mode="none")
    q, bias = qkv_and_bias(module, module.seq_len, False)
    assert module._sdpa_is_faster(q, bias, 0.0)
    monkeypatch.setattr(MaskedSelfAttention, "use_sdpa", False)
    assert not module._sdpa_is_faster(q, bias, 0.0)


def test_the_rule_decides_which_kernel_runs(monkeypatch):
    """Count the SDPA calls of a forward pass: the Boolean model's short sequences (N = 16) take
    _plain, a long vanilla sequence takes SDPA, return_attn always takes _plain."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(1) or sdpa(*a, **k))
    n = MaskedSelfAttention.sdpa_cpu_min_tokens
    for mode, length, expected in (("none", 16, 0), ("learnable", 16, 0), ("none", n, 1),
                                   ("learnable", n, 0)):
        calls.clear()
        module = MaskedSelfAttention(DIM, HEADS, length, mode=mode)
        module(torch.randn(2, length, DIM))
        assert len(calls) == expected, (mode, length)
        module(torch.randn(2, length, DIM), return_attn=True)
        assert len(calls) == expected, (mode, length)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_always_takes_sdpa_and_agrees_with_plain(monkeypatch):
    module = make("learnable", causal=True).float().cuda()
    q, bias = qkv_and_bias(module, SEQ_LEN, True)
    assert module._sdpa_is_faster(q.cuda(), bias.cuda(), 0.1)
    x = torch.randn(5, SEQ_LEN, DIM, device="cuda")
    y_sdpa = module(x)
    force(monkeypatch, "plain")
    torch.testing.assert_close(y_sdpa, module(x), rtol=1e-4, atol=1e-5)


def test_training_steps_agree_on_both_paths(monkeypatch):
    """A few Adam steps of the Boolean model (N = 16) with the mask prior give the same weights
    whichever path the attention takes (float64: only rounding could differ)."""
    masks = maskprior.BOOLEAN_MASKS["majority"](2, 3)
    tokens = torch.randint(0, 2, (32, 15), generator=torch.Generator().manual_seed(0))
    target = torch.randn(32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    finals = []
    for path in ("sdpa", "plain"):
        force(monkeypatch, path)
        torch.manual_seed(0)
        model = maskprior.Transformer(2, 16, 24, 2, 3, 24, 1, masks=masks,
                                      mode="learnable").double()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(5):
            opt.zero_grad()
            ((model(tokens).squeeze(-1) - target) ** 2).mean().backward()
            opt.step()
        finals.append(model.state_dict())
    for name in finals[0]:
        torch.testing.assert_close(finals[0][name], finals[1][name], msg=name)
