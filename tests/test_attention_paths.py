"""MaskedSelfAttention's two paths, F.scaled_dot_product_attention (SDPA, "fused") and the
written-out softmax ("written"), compute the same function, and forward picks between them by the
rule measured with tests/bench_attention_paths.py. Forcing SDPA (even where the rule would not
take it) and forcing the written-out path must give the same outputs and gradients for every
mode, causal or not, on the full mask and on its top-left block; dropout draws the same mask on
both."""
import pytest
import torch

import maskprior
from maskprior import MaskedSelfAttention

DIM, HEADS, SEQ_LEN = 12, 3, 7


def force(monkeypatch, path):
    """Make every MaskedSelfAttention take `path` ("sdpa" or "plain") outside return_attn."""
    monkeypatch.setattr(MaskedSelfAttention, "path", "fused" if path == "sdpa" else "written")


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The list that every call of F.scaled_dot_product_attention appends to."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
    return calls


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
    # the return_attn path (always written out) gives the same output too
    torch.testing.assert_close(module(x, return_attn=True)[0], y_p)


@pytest.mark.parametrize("mode", ["learnable", "none"])
def test_attention_dropout_draws_the_same_mask_on_both_paths(monkeypatch, mode):
    """On the CPU, SDPA with dropout runs its math kernel, which calls dropout on the attention
    probabilities exactly as the written-out path does: the same random numbers, so switching paths does not
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


def takes_sdpa(module, n, calls, train=False):
    """Whether one forward pass of module over n positions calls SDPA."""
    calls.clear()
    module.train(train)(torch.randn(2, n, DIM))
    return len(calls) == 1


def test_rule_on_the_cpu(sdpa_calls):
    long = MaskedSelfAttention.sdpa_cpu_min_tokens
    vanilla = MaskedSelfAttention(DIM, HEADS, 2 * long, mode="none", dropout=0.1)
    masked = MaskedSelfAttention(DIM, HEADS, 2 * long, mode="learnable")
    fixed = MaskedSelfAttention(DIM, HEADS, 2 * long, mode="fixed")
    # vanilla attention: the fused CPU kernel from sdpa_cpu_min_tokens positions on
    assert not takes_sdpa(vanilla, long - 1, sdpa_calls)
    assert takes_sdpa(vanilla, long, sdpa_calls)
    # dropout, or a mask that needs a gradient, would send SDPA to its math kernel: written out
    assert not takes_sdpa(vanilla, long, sdpa_calls, train=True)
    assert not takes_sdpa(masked, 2 * long, sdpa_calls)
    # a mask without gradient (mode "fixed", or any mask under no_grad) is like vanilla
    assert takes_sdpa(fixed, long, sdpa_calls)
    assert not takes_sdpa(fixed, long - 1, sdpa_calls)
    with torch.no_grad():
        assert takes_sdpa(masked, long, sdpa_calls)
    # return_attn and the Hadamard variant need the probabilities: always written out
    calls_before = len(sdpa_calls)
    vanilla.eval()(torch.randn(2, long, DIM), return_attn=True)
    MaskedSelfAttention(DIM, HEADS, long, mode="hadamard")(torch.randn(2, long, DIM))
    assert len(sdpa_calls) == calls_before


def test_path_forces_one_path_everywhere(monkeypatch, sdpa_calls):
    long = MaskedSelfAttention.sdpa_cpu_min_tokens
    module = MaskedSelfAttention(DIM, HEADS, 2 * long, mode="learnable")
    assert not takes_sdpa(module, 16, sdpa_calls)
    monkeypatch.setattr(MaskedSelfAttention, "path", "fused")
    assert takes_sdpa(module, 16, sdpa_calls)
    monkeypatch.setattr(MaskedSelfAttention, "path", "written")
    with torch.no_grad():
        assert not takes_sdpa(module, 2 * long, sdpa_calls)


def test_the_rule_decides_which_kernel_runs(sdpa_calls):
    """Count the SDPA calls of a forward pass: the Boolean model's short sequences (N = 16) are
    written out, a long vanilla sequence takes SDPA, return_attn is always written out."""
    n = MaskedSelfAttention.sdpa_cpu_min_tokens
    for mode, length, expected in (("none", 16, 0), ("learnable", 16, 0), ("none", n, 1),
                                   ("learnable", n, 0)):
        sdpa_calls.clear()
        module = MaskedSelfAttention(DIM, HEADS, length, mode=mode)
        module(torch.randn(2, length, DIM))
        assert len(sdpa_calls) == expected, (mode, length)
        module(torch.randn(2, length, DIM), return_attn=True)
        assert len(sdpa_calls) == expected, (mode, length)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_always_takes_sdpa_and_agrees_with_plain(monkeypatch, sdpa_calls):
    module = make("learnable", causal=True, dropout=0.1).float().cuda().eval()
    x = torch.randn(5, SEQ_LEN, DIM, device="cuda")
    y_sdpa = module(x)
    assert len(sdpa_calls) == 1
    force(monkeypatch, "plain")
    torch.testing.assert_close(y_sdpa, module(x), rtol=1e-4, atol=1e-5)


def test_training_steps_agree_on_both_paths(monkeypatch):
    """A few Adam steps of the Boolean model (N = 16) with the mask prior give the same weights
    whichever path the attention takes (float64: only rounding could differ)."""
    masks = maskprior.boolean_mask("majority", 2, 3)
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
