"""diffusers' ``TemplatedUlyssesAnythingAttention`` (``ulysses_anything=True``, 0.37.0 on) gathers the mask
too, and the package checks it (issue #29, item 3), as it checks ``TemplatedUlyssesAttention``:

* ``cudnn_bool_mask``: a bool mask entering it (0.39 on) is all-gathered, which inductor types wrong
  (docs/kernel-facts.md): the package converts it where it enters, as for plain Ulysses. Shown on diffusers' own
  class over a one-process gloo group: the gathered mask's dtype and the output against fp32. (Not under
  ``torch.compile``: on torch 2.13 dynamo fails on diffusers' own ``all_to_all_single_any_qkv_async`` with fake
  tensors, package or not, so this class does not compile at all there.)
* ``qwen_joint_mask_order``: on 0.37.x / 0.38.0 it hands the op QwenImage's joint mask in the global token order
  while the K/V arrive in rank order, and its shards may differ in length across ranks (no rank knows the
  others'), so the package refuses such a mask naming the way out instead of reordering it.
* ``ulysses_mask_grad``: nothing silent to guard: its backward raises ``NotImplementedError`` on every release,
  so a mask (or q/k/v) that requires grad fails loudly at ``backward()`` (shown here as shipped and patched).
"""

from __future__ import annotations

import pytest
from fixes import test_qwen_joint_mask_order
from releases import release_dir, run

GATHER_SCRIPT = """
import json, tempfile, types, warnings, torch, torch.distributed as dist
import diffusers_cudnn_fix
import diffusers.models.attention_dispatch as module
import standin_kernels
from standin_kernels import reference_attention, max_abs_error
from torch.distributed.device_mesh import init_device_mesh
standin_kernels.register()
warnings.simplefilter("ignore")
dist.init_process_group("gloo", init_method="file://" + tempfile.mkstemp()[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
config = types.SimpleNamespace(context_parallel_config=types.SimpleNamespace(
    _ulysses_mesh=mesh, ulysses_degree=1, ring_degree=1, _world_size=1, ulysses_anything=True))
B, S, H, D = 2, 16, 4, 32
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(B, S, H, D, generator=gen).to(torch.bfloat16) for _ in range(3))
keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
keep[1, ..., -4:] = False
gathered = []
real_gather = module.dist.all_gather
def spy(out, tensor, group=None):
    gathered.append(str(tensor.dtype))
    return real_gather(out, tensor, group=group)
module.dist = types.SimpleNamespace(**{n: getattr(dist, n) for n in dir(dist) if not n.startswith("__")})
module.dist.all_gather = spy
def attention(q, k, v, mask):
    return module.TemplatedUlyssesAnythingAttention.apply(
        q, k, v, mask, 0.0, False, None, False, False,
        module._cudnn_attention_forward_op, module._cudnn_attention_backward_op, config)
ref = reference_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), bool_mask=keep).transpose(1, 2)
try:
    out = {"anything_patched": diffusers_cudnn_fix.is_patched("TemplatedUlyssesAnythingAttention.forward")}
except ValueError:  # a package that does not know the target
    out = {"anything_patched": None}
with torch.no_grad():
    out["eager"] = max_abs_error(attention(q, k, v, keep).float(), ref)
    out["gathered"] = gathered[:]
# A mask that requires grad: the backward raises, as shipped (nothing silent to guard).
try:
    attention(q, k, v, torch.zeros(B, 1, 1, S, dtype=torch.bfloat16, requires_grad=True)).float().sum().backward()
    out["backward"] = "returned"
except Exception as exc:
    out["backward"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
import os; os._exit(0)
"""


def _gather_run(env: dict[str, str] | None = None) -> dict:
    return run(release_dir("0.39.0"), GATHER_SCRIPT, env=env, timeout=600, preloaded=True)


def test_a_bool_mask_enters_ulysses_anything_converted_before_the_gather() -> None:
    """0.39.0: the mask diffusers' ulysses_anything attention all-gathers is an additive bf16 mask, not the bool
    one (as shipped: bool, which inductor gathers into a wrongly typed buffer); the output is right."""
    result = _gather_run()
    assert result["gathered"] == ["torch.bfloat16"], result
    assert result["anything_patched"] is True, result
    assert result["eager"] < 0.05, result
    assert result["backward"].startswith("NotImplementedError"), result


def test_shipped_ulysses_anything_gathers_the_bool_mask() -> None:
    """The control: with the package switched off, the bool mask is what diffusers gathers."""
    result = _gather_run(env={"DIFFUSERS_CUDNN_FIX": "0"})
    assert result["anything_patched"] is False, result
    assert result["gathered"] == ["torch.bool"], result
    assert result["backward"].startswith("NotImplementedError"), result


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
