"""MaskedSelfAttention is self-contained: its class source, pasted alone into a file whose only
other lines are `import math, torch`, `import torch.nn as nn` and `import torch.nn.functional as F`,
builds and computes the same outputs as maskprior's class in every mode, with and without causal."""
import ast
import importlib.util
import os

import pytest
import torch

import maskprior
from helpers import ROOT

HEADER = "import math, torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"
DIM, HEADS, SEQ_LEN = 12, 3, 7


def class_source(name="MaskedSelfAttention"):
    """The source text of one top-level class of maskprior.py, by ast.get_source_segment."""
    with open(os.path.join(ROOT, "maskprior.py")) as f:
        source = f.read()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name)
    return ast.get_source_segment(source, node)


def pasted_class(tmp_path):
    """HEADER + the class source written to a fresh file and imported: (class, module globals)."""
    path = tmp_path / "pasted_attention.py"
    path.write_text(HEADER + class_source() + "\n")
    spec = importlib.util.spec_from_file_location("pasted_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MaskedSelfAttention, vars(module)


def test_pasted_file_holds_only_the_four_imports_and_the_class(tmp_path):
    _, namespace = pasted_class(tmp_path)
    names = {name for name in namespace if not name.startswith("__")}
    assert names == {"math", "torch", "nn", "F", "MaskedSelfAttention"}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["learnable", "fixed", "hadamard", "none"])
def test_pasted_class_matches_the_module_class(tmp_path, mode, causal):
    pasted, _ = pasted_class(tmp_path)
    mask_init = None if mode == "none" else 4 * torch.randn(HEADS, SEQ_LEN, SEQ_LEN)
    kwargs = dict(mask_init=mask_init, mode=mode, causal=causal, mask_scale=2.0)
    original = maskprior.MaskedSelfAttention(DIM, HEADS, SEQ_LEN, **kwargs)
    copy = pasted(DIM, HEADS, SEQ_LEN, **kwargs)
    x = torch.randn(2, SEQ_LEN, DIM)
    assert not torch.equal(copy(x), original(x))   # fresh weights differ: the check below can fail
    copy.load_state_dict(original.state_dict())
    assert list(copy.state_dict()) == list(original.state_dict())
    for n in (SEQ_LEN, 4):                          # the full mask and its top-left block
        x = torch.randn(2, n, DIM)
        assert torch.equal(copy(x), original(x))
        (y_copy, attn_copy), (y_original, attn_original) = (
            copy(x, return_attn=True), original(x, return_attn=True))
        assert torch.equal(y_copy, y_original)
        assert torch.equal(attn_copy, attn_original) and attn_copy.shape == (2, HEADS, n, n)
