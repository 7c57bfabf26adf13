"""Shared fixtures.

In-process tests use one affected release, 0.39.0 (the last one carrying every bug), put first on
``sys.path`` the first time a test asks for it. Everything that depends on import order, environment
switches or another release runs in a fresh interpreter through ``releases.run``.
"""

from __future__ import annotations

import sys
import types

import pytest
from releases import release_dir

IN_PROCESS_RELEASE = "0.39.0"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests need CUDA with cuDNN SDPA; on this CPU CI they are skipped with the reason shown."""
    try:
        import torch

        have_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)
    except Exception:
        have_gpu = False
    if have_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability >= 8.0 (cuDNN SDPA); none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def dispatch_module() -> types.ModuleType:
    """diffusers 0.39.0's attention_dispatch, imported in this process, with the stand-in kernels."""
    site = str(release_dir(IN_PROCESS_RELEASE))
    if site not in sys.path:
        sys.path.insert(0, site)
    import diffusers.models.attention_dispatch as module
    import standin_kernels

    import diffusers_cudnn_fix  # noqa: F401  (arms the hook)

    standin_kernels.register()
    assert module.__file__.startswith(site), module.__file__
    return module


@pytest.fixture()
def patched(dispatch_module: types.ModuleType):
    """The module with the fixes applied; reverted afterwards whatever the test did."""
    import diffusers_cudnn_fix

    diffusers_cudnn_fix.apply()
    yield dispatch_module
    diffusers_cudnn_fix.revert()
