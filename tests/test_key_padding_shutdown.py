"""A clean exit: the mask cache's weakref callback (``_key_padding.remembered``) prints nothing at interpreter exit.

At exit Python sets every module global to None (or clears the module's namespace) before the objects those
globals held are freed. Dropping the cache then frees its entries' answers; an answer that holds the mask frees the
mask, and the mask's weakref callback runs after ``_key_padding``'s globals are gone. A callback that read the
module global ``_kept`` printed ``Exception ignored in: <function remembered.<locals>.<lambda>> ... AttributeError:
'NoneType' object has no attribute 'pop'`` at the end of the run (issue #39, item 7).

Each case runs in a fresh interpreter (the first two take a module's globals away, as teardown does; the last is a
real exit) and reads its stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from releases import ROOT

SET_UP = """
import torch
from diffusers_cudnn_fix import _key_padding

mask = torch.ones(1, 1, 1, 8, dtype=torch.bool)
_key_padding.remembered(lambda tensor, question: question, mask, "a question")
"""


def _stderr_of(script: str) -> str:
    """Run ``script`` with the checkout first on the path; its stderr (it must exit 0 and say "done")."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1:] == ["done"], proc.stdout
    return proc.stderr


@pytest.mark.parametrize(
    "teardown",
    [
        'vars(_key_padding)["_kept"] = None',  # a module's globals set to None, as at exit
        "vars(_key_padding).clear()",  # its namespace emptied
    ],
)
def test_the_callback_runs_safely_after_the_module_globals_are_gone(teardown: str) -> None:
    """The callback runs after the module's globals are gone (the cache itself still held: at exit, by the
    teardown that is dropping it): nothing is printed."""
    stderr = _stderr_of(
        SET_UP
        + f"""
kept = _key_padding._kept  # the cache outlives the module's globals
{teardown}
del mask  # the tensor dies now: its weakref callback runs
print("done", flush=True)
"""
    )
    assert "Exception ignored" not in stderr and "Traceback" not in stderr, stderr


EXIT_WITH_A_REMEMBERED_MASK = """
import torch
from diffusers_cudnn_fix import _key_padding


def holding(tensor, question):
    return [tensor]  # an answer that holds the mask: the mask lives as long as its cache entry


# A custom op whose implementation uses the module: torch's operator registry (C++) keeps it, and through it the
# module, alive past the collection at exit, as the package's own patched ops are kept; the module's globals are
# then cleared with the mask still in its cache.
@torch.library.custom_op("dcf_shutdown_test::attend", mutates_args=())
def attend(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    _key_padding.remembered(holding, mask, "a question")
    return x.clone()


attend(torch.zeros(2), torch.ones(1, 1, 1, 8, dtype=torch.bool))  # the mask: no reference left but the cache's
print("done", flush=True)
"""


def test_an_exit_with_a_remembered_mask_alive_prints_nothing() -> None:
    stderr = _stderr_of(EXIT_WITH_A_REMEMBERED_MASK)
    assert stderr == "", stderr
