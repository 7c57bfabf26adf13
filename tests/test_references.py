"""Other modules holding a shipped op (``from ... import _cudnn_..._op``), diffusers imported first.

Each case in a fresh interpreter. With diffusers imported before the package, the hook walks
``sys.modules`` after patching: it rebinds what a user's module holds, leaves installed packages alone, and
``revert()`` puts the user's references back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from releases import release_dir, run
from test_import_safety import script

USER_MODULE = """
from diffusers.models.attention_dispatch import _cudnn_attention_forward_op as cudnn_forward
"""


@pytest.mark.slow
@pytest.mark.parametrize("version", ["0.36.0", "0.39.0", "0.42.1"])
def test_user_holders_are_rebound_and_restored(tmp_path: Path, version: str) -> None:
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
            rebound = user_train_step.cudnn_forward is dispatch._cudnn_attention_forward_op
            # (no global of this script holds the shipped op: it would be rebound too, as a user's module)
            patched = dispatch._cudnn_attention_forward_op is not kept[0]
            vendor_left = vendor.cudnn_forward is kept[0]
            diffusers_cudnn_fix.revert()
            restored = user_train_step.cudnn_forward is kept[0]
            done(rebound=rebound, patched=patched, vendor_left=vendor_left, restored=restored)
            """
        ),
        preloaded=True,
    )
    assert result["patched"] and result["rebound"] and result["vendor_left"] and result["restored"], result
