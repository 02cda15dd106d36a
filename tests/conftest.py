"""Test-wide settings. The model's tensors are tiny: one torch thread computes them as
fast as two, and does not spin against the other process on a loaded 2-core machine
(which made the model and engine suites 20x slower under load)."""
import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _fingerprint_cache(tmp_path_factory):
    """Weight fingerprints are cached on disk (uniradix.model.fingerprint): the tests
    keep theirs in a directory of their own, not in the user's ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("UNIRADIX_CACHE_DIR", str(tmp_path_factory.mktemp("fingerprints")))
    yield
    mp.undo()

