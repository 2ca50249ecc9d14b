"""pytest setup of moh's Python tests.

The reference PyTorch modules are tools/moh_modules.py of the source tree: MOH_SOURCE_DIR (ctest
sets it) or, when unset, the repository this file lies in. The module under test is the one on
PYTHONPATH (ctest: <build>/python). The helpers the test files share are in moh_test_helpers.py.
"""

import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("MOH_SOURCE_DIR") or os.path.dirname(os.path.dirname(_HERE))
TOOLS_DIR = os.path.join(SOURCE_DIR, "tools")
if TOOLS_DIR not in sys.path:
    sys.path.insert(0, TOOLS_DIR)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

try:  # the machine has 2 cores shared with other work: torch gets one thread
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - the torch tests skip themselves
    torch = None


@pytest.fixture(scope="session")
def mm():
    """tools/moh_modules.py (the PyTorch reference modules)."""
    pytest.importorskip("torch")
    path = os.path.join(TOOLS_DIR, "moh_modules.py")
    if not os.path.exists(path):
        pytest.fail(f"the reference modules are not at {path}: set MOH_SOURCE_DIR to the repository root")
    import moh_modules

    return moh_modules


@pytest.fixture
def rng():
    """A NumPy generator with a fixed seed (each test starts from the same state)."""
    import numpy as np

    return np.random.default_rng(1234)


@pytest.fixture(autouse=True)
def _torch_seed():
    """Every test draws the same torch random weights whatever ran before it."""
    if torch is not None:
        torch.manual_seed(0)
    yield
