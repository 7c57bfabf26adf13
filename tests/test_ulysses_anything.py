"""diffusers' ``TemplatedUlyssesAnythingAttention`` (``ulysses_anything=True``, 0.37.0 on) gathers the mask
too, and the package checks it (issue #29, item 3), as it checks ``TemplatedUlyssesAttention``:

* ``qwen_joint_mask_order`` (here): on 0.37.x / 0.38.0 it hands the op QwenImage's joint mask in the global token
  order while the K/V arrive in rank order, and its shards may differ in length across ranks (no rank knows the
  others'), so the package refuses such a mask naming the way out instead of reordering it.
* ``cudnn_bool_mask``: a bool mask entering it (0.39 on) is converted where it enters, before the gather:
  tests/fixes/test_cudnn_bool_mask.py.
* ``ulysses_mask_grad``: nothing silent to guard: its backward raises ``NotImplementedError`` on every release,
  so a mask (or q/k/v) that requires grad fails loudly at ``backward()`` (tests/fixes/test_cudnn_bool_mask.py
  shows it, as shipped and patched).
"""

from __future__ import annotations

import pytest
from fixes import test_qwen_joint_mask_order
from releases import release_dir, run

# diffusers' own TemplatedUlyssesAnythingAttention.forward as installed, called from a stand-in of QwenImage's
# attention processor: tests/fixes/test_qwen_joint_mask_order.py's harness, pointed at the ulysses_anything class.
_HARNESS = test_qwen_joint_mask_order.ENTERING_SCRIPT.partition("gen = torch.Generator")[0]
QWEN_SCRIPT = (
    _HARNESS.replace("module.TemplatedUlyssesAttention.forward", "module.TemplatedUlyssesAnythingAttention.forward")
    .replace(
        "diffusers_cudnn_fix.get_original(fix.ULYSSES_FORWARD)",
        "(diffusers_cudnn_fix.get_original(ANYTHING) if ANYTHING in diffusers_cudnn_fix.TARGETS"
        " else module.TemplatedUlyssesAnythingAttention.__dict__['forward'])",  # a package not knowing the target
    )
    .replace("installed = ", 'ANYTHING = "TemplatedUlyssesAnythingAttention.forward"\ninstalled = ')
    + """
padded = torch.ones(2, 1, 1, 8, dtype=torch.bool)
padded[0, ..., 3] = False
out = {
    "padded": entering(installed, padded),
    "unpadded": entering(installed, torch.ones(2, 1, 1, 8, dtype=torch.bool)),
    "other_model": entering(installed, padded, qwen=False),
    "shipped": entering(shipped, padded),
    "patched": ANYTHING in diffusers_cudnn_fix.TARGETS and diffusers_cudnn_fix.is_patched(ANYTHING),
}
print(json.dumps(out))
"""
)


@pytest.mark.parametrize("version", ["0.37.0", "0.38.0"])
def test_qwen_joint_mask_through_ulysses_anything_is_refused(version: str) -> None:
    """0.37.x / 0.38.0: as shipped, QwenImage's padded joint mask reaches the op as it came, in the global order
    [text, image] against K/V in rank order (the control); with the package it is refused, naming ulysses_anything
    and the ways out. A mask that masks nothing, and another model's mask, pass as they came."""
    result = run(release_dir(version), QWEN_SCRIPT, preloaded=True)
    refused = result["padded"].get("refused", "")
    assert refused.startswith("diffusers_cudnn_fix: QwenImage's joint attention mask"), result["padded"]
    assert result["shipped"].get("same") is True, result["shipped"]
    assert result["patched"] is True, result
    assert "ulysses_anything" in refused and "0.39.0" in refused, refused
    for case in ("unpadded", "other_model"):
        assert result[case].get("same") is True, (case, result[case])
