"""``cp_split_warning_once`` (fixes/cp_split_warning_once.py): diffusers' context-parallel split hook calls
``logger.warning_once``, which diffusers' logger has only once transformers is imported (issue #42, item 5). The
package lends that one logger a once-per-message ``warning_once`` when parallelism is enabled, and takes it back at
``revert()``.

* transformers is not installed in the test environment (the bug shows only without it).
* The check: broken on every release with context parallelism, the package's ``enable_parallelism`` passes it;
  absent on 0.35.2.
* The policy, in process (0.39.0): diffusers' own split hook on a stand-in model, without the package (the control:
  AttributeError) and after the package's ``enable_parallelism`` (warns once, the input not split); ``revert()``.
* Two ranks on a tiny real Wan with a 1-D timestep (with the package: output and every gradient as one process;
  without it, or with the fix skipped: AttributeError): tests/test_cp_models.py.
"""

from __future__ import annotations

import importlib.util
import logging
import types

import pytest
from releases import RELEASES, WITH_OPS, fix_states, release_dir, run

FIX = "cp_split_warning_once"
#: The releases that carry the bug, written from the facts (tests/expected_fixes.py collects them).
# diffusers' split hook calls logger.warning_once (every release with context parallelism), which its logger has
# only once transformers is imported (not installed in the test environment).
CARRIES = WITH_OPS
CORRECTION = True  # a correction: the package makes the result right (False: a guard)


def test_transformers_is_not_installed() -> None:
    """Its import gives every logger ``warning_once`` and hides the bug: the tests need an environment without it."""
    assert importlib.util.find_spec("transformers") is None


@pytest.mark.slow
@pytest.mark.parametrize("version", RELEASES)
def test_the_check_finds_the_bug_on_every_release_with_context_parallelism(version: str) -> None:
    found = fix_states(version, models_first=True)[FIX]
    expected = ["broken", True, "fixed"] if version in CARRIES else ["absent", False, "not_applicable"]
    assert found == expected, version


_POLICY = r"""
import json, logging, types, torch
import diffusers_cudnn_fix, diffusers.models.modeling_utils, diffusers.models.attention_dispatch
from diffusers.hooks import context_parallel as cp
from diffusers.hooks.hooks import HookRegistry
from diffusers.models._modeling_parallel import ContextParallelInput
from diffusers_cudnn_fix.targets.models import enable_parallelism

said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
cp.logger.addHandler(Keep())

def split_once(model):
    hook = model._diffusers_hook.hooks["cp_input"]
    x = torch.zeros(2)
    try:
        out = hook._prepare_cp_input(x, ContextParallelInput(split_dim=1, expected_dims=2))
    except AttributeError as exc:
        return f"AttributeError: {exc}"
    return "unsplit" if out is x else "split"

def shipped(self, **kwargs):  # diffusers' own, stood in: puts diffusers' split hook on the model
    HookRegistry.check_if_exists_or_initialize(self).register_hook(cp.ContextParallelSplitHook({}, None), "cp_input")

config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(ulysses_degree=2, ring_degree=1))
result = {"had": hasattr(cp.logger, "warning_once")}
plain = torch.nn.Linear(2, 2)
shipped(plain, config=config)
result["without"] = split_once(plain)
model = torch.nn.Linear(2, 2)
enable_parallelism(shipped, frozenset({"cp_split_warning_once"}))(model, config=config)
result["with"] = [split_once(model), split_once(model)]
result["said"] = said[:]
diffusers_cudnn_fix.revert()
result["after_revert"] = hasattr(cp.logger, "warning_once")
print(json.dumps(result))
"""


def test_the_split_hook_warns_once_with_the_package_and_raises_without() -> None:
    result = run(release_dir("0.39.0"), _POLICY, preloaded=True)
    assert result["had"] is False, result
    assert result["without"] == "AttributeError: 'Logger' object has no attribute 'warning_once'", result
    assert result["with"] == ["unsplit", "unsplit"], result
    assert result["said"] == [
        "Expected input tensor to have 2 dimensions, but got 1 dimensions, split will not be applied."
    ], result
    assert result["after_revert"] is False, result


_WITH_TRANSFORMERS = r"""
import json, warnings
warnings.simplefilter("always")
import transformers
import diffusers_cudnn_fix, diffusers.models.modeling_utils, diffusers.models.attention_dispatch
from diffusers_cudnn_fix import __main__ as doctor
import contextlib, io
with warnings.catch_warnings(record=True) as shown:
    warnings.simplefilter("always")
    diffusers_cudnn_fix.apply()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        doctor.main(["--no-gpu"])
row = next(f for f in diffusers_cudnn_fix.status().fixes if f.id == "cp_split_warning_once")
print(json.dumps({"row": [row.expected, row.detected, row.applied, row.reason_code, row.reason],
                  "warnings": [str(w.category.__name__) for w in shown], "text": out.getvalue()}))
"""


@pytest.mark.parametrize("version", ["0.36.0", "0.42.1"])
def test_with_transformers_imported_it_is_not_needed_here_and_the_doctor_says_why(version: str) -> None:
    """The environment users have (transformers installed, ``releases.USER_STACK``): the release carries the bug
    (the table says so), this process does not (its loggers have the method): not needed, no release-table warning
    (#49: before, every import with transformers said to report a bug that was not there), and the doctor's row
    says why."""
    result = run(release_dir(version), _WITH_TRANSFORMERS, preloaded=True, stack=True)
    expected, detected, applied, code, reason = result["row"]
    assert (expected, detected, applied, code) == (True, "ok", False, "not_needed"), result["row"]
    assert reason.startswith("not needed: here diffusers' logger has") and "transformers" in reason, reason
    assert "ReleaseTableMismatchWarning" not in result["warnings"], result["warnings"]
    text = " ".join(result["text"].split())
    assert "why: not needed: here diffusers' logger has" in text, text


def test_a_logger_that_has_the_method_is_left_alone() -> None:
    """transformers' import gives ``logging.Logger`` the method: the package lends none then."""
    from diffusers_cudnn_fix.fixes.cp_split_warning_once import _lent, lend

    logger = logging.getLogger("diffusers_cudnn_fix.test.has_it")
    own = logger.warning_once = lambda *args, **kwargs: None  # type: ignore[attr-defined]

    class Hook:
        pass

    namespace = {"logger": logger}  # a method whose module global ``logger`` is this logger, as diffusers' is
    exec("def _prepare_cp_input(self, x, cp_input):\n    return logger.warning_once\n", namespace)
    Hook._prepare_cp_input = namespace["_prepare_cp_input"]  # type: ignore[attr-defined]
    import torch

    model = torch.nn.Linear(2, 2)
    model._diffusers_hook = types.SimpleNamespace(hooks={"cp_input": Hook()})
    lend(model)
    assert logger.warning_once is own and not any(lent is logger for lent, _ in _lent)  # type: ignore[attr-defined]
