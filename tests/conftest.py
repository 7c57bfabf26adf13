"""Shared fixtures.

In-process tests use one affected release, 0.39.0 (the last one carrying every bug), put first on
``sys.path`` the first time a test asks for it. Everything that depends on import order, environment
switches or another release runs in a fresh interpreter through ``releases.run``.
"""

from __future__ import annotations

import sys
import types
from pathlib import PurePosixPath

import pytest
from releases import RELEASES, close_preloaded, release_dir

IN_PROCESS_RELEASE = "0.39.0"


#: Test modules whose tests share work done once per pytest process: a cached subprocess job read by several
#: tests, or a module fixture that starts the work of every selected test at once. Under pytest-xdist the
#: tests sharing one piece of work must run on one worker, or each worker would redo it (the scheduler
#: below). Module -> what is shared: "release" (one piece of work per diffusers release, the release being
#: named in the test's parameter id) or "module" (one for the whole module).
SHARED_WORK = {
    "test_release_matrix": "release",  # one interpreter per (release, import order), read by three tests
    "test_cp_training": "release",  # one launcher per release runs its jobs (release, package, mask switch)
    "test_properties": "module",  # one module fixture starts the search of every selected test
    "test_doctor": "module",  # one doctor run per release, cached, read by several tests naming no release
}


def shared_work_scope(nodeid: str) -> str | None:
    """The share of work (``SHARED_WORK``) the test ``nodeid`` belongs to; None if it shares none."""
    path, _, names = nodeid.partition("::")
    module = PurePosixPath(path).stem
    if module not in SHARED_WORK:
        return None
    if SHARED_WORK[module] == "release":
        params = names.partition("[")[2].removesuffix("]")
        named = [part for part in params.split("-") if part in RELEASES]
        if named:
            return f"{module}-{named[0]}"
    return module  # a test naming no release: the module's own share, which is never wrong, only slower


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``-n logical --dist loadgroup`` (.ci/run): xdist's group scheduling, each share of work one group.

    xdist learns a test's group from the test id, and only the scheduler sees every id; the shares come
    from the ids here rather than from ``xdist_group`` marks, which pytest-xdist 3.8 loses on pytest 9.2
    (pytest-xdist issue #1386). A test's own ``xdist_group`` mark still counts where xdist keeps it.
    """
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedWorkScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return shared_work_scope(nodeid) or super()._split_scope(nodeid)

    return SharedWorkScheduling(config, log)


#: Releases that call ``torch.accelerator`` (torch 2.6) at import: on an older torch (.ci/run's oldest torch
#: leg) their tests are skipped. 0.39.0 and later declare torch>=2.6, but 0.39.0 and 0.40.0 run on 2.5.
NEED_TORCH_2_6 = ("0.41.0", "0.42.0", "0.42.1")


def _skip_releases_this_torch_cannot_import(items: list[pytest.Item]) -> None:
    import torch
    from packaging.version import Version

    if Version(torch.__version__).release[:2] >= (2, 6):
        return
    skip = pytest.mark.skip(reason=f"diffusers {'/'.join(NEED_TORCH_2_6)} need torch >= 2.6 (torch.accelerator)")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and set(map(str, callspec.params.values())) & set(NEED_TORCH_2_6):
            item.add_marker(skip)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """GPU tests need CUDA with cuDNN SDPA; on this CPU CI they are skipped with the reason shown. Releases
    the running torch cannot import are skipped too."""
    _skip_releases_this_torch_cannot_import(items)
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


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Wait for the preloaded interpreter of this process (``releases.run(preloaded=True)``), so that the CPU
    time of the runs it forked counts in this process's (each pytest-xdist worker has its own).

    Also removes the folder torch < 2.6 makes at the import of ``torch.distributed.nn.jit.instantiator`` (which
    diffusers imports) and leaves to its finalizer, which says "ResourceWarning: Implicitly cleaning up" at exit.
    """
    close_preloaded()
    instantiator = sys.modules.get("torch.distributed.nn.jit.instantiator")
    folder = getattr(instantiator, "_TEMP_DIR", None)
    if folder is not None and hasattr(folder, "cleanup"):
        folder.cleanup()


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """One intra-op thread for the tests run in this process: their tensors are small, and with a thread per
    core, on a machine whose cores the other pytest-xdist worker and the subprocesses share, torch spends more
    CPU waiting than computing. (Subprocess scenarios set their own.)"""
    import torch

    torch.set_num_threads(1)


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
