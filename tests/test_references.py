"""Other modules holding a shipped op (``from ... import _cudnn_..._op``), diffusers imported first.

Each case in a fresh interpreter. The hook counts references before it walks ``sys.modules``: with nobody
else holding a shipped op it must skip the walk (the common case, and the hook's time budget), and with a
holder it must walk, rebind what it can and say what it cannot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from releases import RELEASES, release_dir, run
from test_import_safety import script

WITH_OPS = [v for v in RELEASES if v != "0.35.2"]  # 0.35.2 has no context-parallel cuDNN ops


@pytest.mark.slow
@pytest.mark.parametrize("version", WITH_OPS)
def test_no_holder_means_no_walk(version: str) -> None:
    result = run(
        release_dir(version),
        script(
            """
            import diffusers.models.attention_dispatch
            import diffusers_cudnn_fix
            from diffusers_cudnn_fix import _registry
            patched = sorted(t for t in _registry._state.originals if "." not in t)
            done(scan=_registry._state.scan, patched=patched)
            """
        ),
    )
    assert "_cudnn_attention_forward_op" in result["patched"]  # so the reference check had work to do
    assert result["scan"].startswith("not needed"), result["scan"]
    assert result["status"]["ok"] is True


USER_MODULE = """
from diffusers.models.attention_dispatch import _cudnn_attention_forward_op as cudnn_forward
"""


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.36.0", "0.39.0", "0.42.1"])
def test_holders_are_rebound_or_named(tmp_path: Path, version: str) -> None:
    (tmp_path / "user_train_step.py").write_text(USER_MODULE)
    result = run(
        release_dir(version),
        script(
            f"""
            import types
            sys.path.insert(0, {str(tmp_path)!r})
            import diffusers.models.attention_dispatch as dispatch
            import user_train_step  # a user's module: rebound
            vendor = types.ModuleType("vendor_pkg")  # an installed package: never touched
            vendor.__file__ = "/opt/venv/lib/python3/site-packages/vendor_pkg/__init__.py"
            vendor.cudnn_forward = dispatch._cudnn_attention_forward_op
            sys.modules["vendor_pkg"] = vendor
            kept = [dispatch._cudnn_attention_forward_op]  # not a module global: nothing to rebind
            import diffusers_cudnn_fix
            from diffusers_cudnn_fix import _registry
            rebound = user_train_step.cudnn_forward is dispatch._cudnn_attention_forward_op
            # (no global of this script holds the shipped op: it would be rebound too, as a user's module)
            patched = dispatch._cudnn_attention_forward_op is not kept[0]
            vendor_left = vendor.cudnn_forward is kept[0]
            scan = _registry._state.scan
            diffusers_cudnn_fix.revert()
            restored = user_train_step.cudnn_forward is kept[0]
            done(rebound=rebound, patched=patched, vendor_left=vendor_left, scan=scan, restored=restored)
            """
        ),
    )
    assert result["patched"] and result["rebound"] and result["vendor_left"] and result["restored"], result
    assert result["scan"].startswith("scanned"), result["scan"]
    assert "still referenced elsewhere: _cudnn_attention_forward_op" in result["scan"], result["scan"]
    assert any("remain outside the scanned modules" in line for line in result["logs"]), result["logs"]
