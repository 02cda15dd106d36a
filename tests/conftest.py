"""Test-wide settings. The model's tensors are tiny: one torch thread computes them as
fast as two, and does not spin against the other process on a loaded 2-core machine
(which made the model and engine suites 20x slower under load)."""
import torch

torch.set_num_threads(1)
