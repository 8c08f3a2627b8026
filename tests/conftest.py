"""Shared test set-up: import the three top-level modules from the repository root; the
fixtures several test modules use (plain helpers live in helpers.py; test modules never import
each other or this file)."""
import base64
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from helpers import ROOT, qkv_weights, split_heads

sys.path.insert(0, ROOT)

# Without the test extras (tests/requirements.txt: timm, transformers) the tests that need them skip with
# the reason (pytest.importorskip); CI (.ci/run) sets MASKPRIOR_TEST_EXTRAS and must skip none of them,
# so there a missing extra stops the run before any test.
if os.environ.get("MASKPRIOR_TEST_EXTRAS"):
    import timm  # noqa: F401
    import transformers  # noqa: F401

# The suite runs on a 2-core CI machine; torch's default thread count is already the core count,
# and subprocess tests run one at a time, so nothing oversubscribes the cores.
torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One torch thread for in-process runs: the CI machine's 2 cores may be shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def run_cli():
    """run_cli(*args, timeout=300): `python train.py *args` in a subprocess from the repository
    root; the subprocess.CompletedProcess, output as text. TIKTOKEN_CACHE_DIR is left out of its
    environment, so no run reads a tokenizer cache (language tests pass --bpe-file)."""
    def run(*args, timeout=300):
        env = {key: value for key, value in os.environ.items() if key != "TIKTOKEN_CACHE_DIR"}
        return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=env)
    return run


@pytest.fixture
def mass_on_pseudo_input():
    """mass(model, pattern): attention of every layer and head computed on the pseudo-input P
    (no token content), mass on the pattern's open entries averaged over query rows, (L, H)."""
    import maskprior

    def mass(model, pattern):
        p = maskprior.pseudo_input(model)
        masses = []
        for layer, attn in enumerate(maskprior.attention_modules(model)):
            w_q, w_k, _ = qkv_weights(attn)
            q, k = (split_heads((p @ w.T)[None], attn.heads)[0] for w in (w_q, w_k))   # (H, N, d)
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(attn.head_dim), -1)
            masses.append((a * maskprior.pattern_targets(pattern[layer])).sum(-1).mean(-1))
        return torch.stack(masses)
    return mass


@pytest.fixture
def attention_svg():
    """read(folder): a run folder's attention.svg, after checking that the folder holds no PNG
    file, as (its text lines, its block titles, {title: the block's panels decoded, (3, H, W)
    uint8}). The titles are the texts in 13 px; the panels are the embedded PNG of each block."""
    import warnings
    from torchvision.io import decode_png

    def read(folder):
        assert not [name for name in os.listdir(folder) if name.endswith(".png")]
        root = ET.parse(os.path.join(folder, "attention.svg")).getroot()
        texts = [t for t in root.iter("{http://www.w3.org/2000/svg}text")]
        titles = [t.text for t in texts if t.get("font-size") == "13"]
        images = [i.get("href") for i in root.iter("{http://www.w3.org/2000/svg}image")]
        assert len(images) == len(titles)
        with warnings.catch_warnings():   # torchvision marks its image codecs as deprecated
            warnings.simplefilter("ignore", DeprecationWarning)
            panels = [decode_png(torch.frombuffer(bytearray(base64.b64decode(
                href.split(",", 1)[1])), dtype=torch.uint8)) for href in images]
        return [t.text for t in texts], titles, dict(zip(titles, panels))
    return read
