"""Shared test set-up: import the three top-level modules from the repository root."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# The suite runs on a 2-core CI machine; torch's default thread count is already the core count,
# and subprocess tests run one at a time, so nothing oversubscribes the cores.
torch.manual_seed(0)
