"""Gradients of diffusers' own context-parallel attention op pairs, on CPU stand-in kernels.

Run in a fresh interpreter by the release-matrix tests, one per release and import order::

    python -c "import subprocess_op_pair_grads as s; s.main('package_first', ulysses=True)"
    python -c "import subprocess_op_pair_grads as s; s.main('diffusers_first', control=True, ulysses=True)"

(the second runs the control, diffusers as shipped, before it imports the package: see ``main``).
It imports diffusers and (unless ``order == 'none'``) this package in the given order, registers the CPU
stand-ins for the ATen cuDNN / flash SDPA ops, and drives diffusers' installed forward/backward ops the way
``TemplatedUlyssesAttention`` does: inside an ``autograd.Function``, on fresh tensors made under no-grad,
with a context-parallel config of world size 2. Gradients are compared with an fp32 eager reference.
Prints one JSON line: per backend / shape / return_lse, the errors and whether they pass.
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

from harness import op_pair, pair_config

#: (name, B, S_q, S_kv, H, D). num_heads == seq_len is where no shape check can catch a transposition.
CASES = (
    ("heads_eq_seq", 2, 16, 16, 16, 64),
    ("heads_ne_seq", 2, 128, 128, 8, 64),
    ("sq_ne_skv", 1, 12, 20, 4, 32),
)
BACKENDS = {
    "cudnn": ("_cudnn_attention_forward_op", "_cudnn_attention_backward_op"),
    "flash": ("_native_flash_attention_forward_op", "_native_flash_attention_backward_op"),
}


def _not_imported_yet(name: str) -> None:
    """Fail loudly if ``name`` was imported before the order asked for it (the order would be a lie)."""
    if name in sys.modules:
        raise RuntimeError(f"{name} is already imported: this is not the order asked for")


def import_in_order(order: str) -> types.ModuleType:
    """diffusers' attention module, imported in ``order``. The checks between the imports also keep the
    import sorter (ruff's isort rule) from merging them into one block and reordering it."""
    if order == "package_first":
        import diffusers_cudnn_fix  # first: its hook patches at diffusers' import

        _not_imported_yet("diffusers.models.attention_dispatch")
        import diffusers.models.attention_dispatch as module
    elif order == "diffusers_first":
        _not_imported_yet("diffusers_cudnn_fix")
        import diffusers.models.attention_dispatch as module

        _not_imported_yet("diffusers_cudnn_fix")
        import diffusers_cudnn_fix  # noqa: F401  (patches the module already imported)
    elif order == "none":
        _not_imported_yet("diffusers_cudnn_fix")
        import diffusers.models.attention_dispatch as module
    else:
        raise ValueError(order)
    return module


def passes(errors: dict[str, float], bf16_errors: dict[str, float], magnitudes: dict[str, float]) -> bool:
    """PyTorch's fused-attention rule: within 5x a bf16 eager reference's own error (with a floor of 1% of
    the value's magnitude, since the bf16 reference can be almost exact on CPU); NaN fails."""
    for name, err in errors.items():
        if err != err or err > max(5 * bf16_errors[name], 0.01 * magnitudes[name]):
            return False
    return True


def test_mask(batch: int, seq_q: int, seq_kv: int) -> Any:
    """(B, 1, S_q, S_kv) bool, True = attend: some masked columns, and the last query row fully masked."""
    import torch

    keep = torch.ones(batch, 1, seq_q, seq_kv, dtype=torch.bool)
    keep[..., seq_kv // 2 :: 3] = False
    keep[..., -1, :] = False
    return keep


def run_case(
    module: types.ModuleType,
    backend: str,
    case: tuple,
    return_lse: bool,
    *,
    mask: str | None = None,
    dtype: str = "bfloat16",
) -> dict[str, Any]:
    """``mask``: None, ``"bool"``, or ``"float32"`` (the same mask as an additive fp32 mask).
    ``dtype``: of q/k/v (``"float32"`` to see what fp32 inputs do)."""
    import torch
    from standin_kernels import max_abs_error, reference_attention

    fwd_name, bwd_name = BACKENDS[backend]
    if not hasattr(module, fwd_name) or not hasattr(module, bwd_name):
        return {"status": "absent"}
    _, batch, seq_q, seq_kv, heads, dim = case
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(batch, s, heads, dim, generator=gen).to(getattr(torch, dtype)) for s in (seq_q, seq_kv, seq_kv)
    )
    grad_out = torch.randn(batch, seq_q, heads, dim, generator=gen).to(q.dtype)
    keep = test_mask(batch, seq_q, seq_kv) if mask else None
    attn_mask = None
    if mask == "bool":
        attn_mask = keep
    elif mask == "float32":
        attn_mask = torch.zeros(keep.shape).masked_fill_(~keep, float("-inf"))
    # What TemplatedUlyssesAttention does around the ops, minus the all-to-alls: fresh tensors, as after the
    # all-to-all (requires_grad is False on what reaches the op), a config of world size 2.
    pair = op_pair(
        getattr(module, fwd_name), getattr(module, bwd_name), return_lse=return_lse, parallel_config=pair_config()
    )
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    try:
        out = pair.apply(*leaves, attn_mask)
        out.backward(grad_out)
    except Exception as exc:
        return {"status": "raised", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    got = {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}

    def reference(dtype: torch.dtype) -> dict[str, torch.Tensor]:
        ref_leaves = [x.to(dtype).transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
        if dtype == torch.float32:
            ref_out = reference_attention(*ref_leaves, bool_mask=keep)
        else:
            # bf16 eager reference; the same dead-row handling as the fp32 one, so only precision differs.
            ref_out = reference_attention(*ref_leaves, bool_mask=keep).to(dtype) if keep is not None else None
            if ref_out is None:
                with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                    ref_out = torch.nn.functional.scaled_dot_product_attention(*ref_leaves)
        ref_out.backward(grad_out.to(dtype).transpose(1, 2))
        tensors = [ref_out.detach(), *(x.grad for x in ref_leaves)]
        return dict(zip(("out", "dq", "dk", "dv"), (t.transpose(1, 2).float() for t in tensors)))

    golden, bf16 = reference(torch.float32), reference(torch.bfloat16)
    errors = {n: max_abs_error(got[n].float(), golden[n]) for n in got}
    bf16_errors = {n: max_abs_error(bf16[n], golden[n]) for n in got}
    magnitudes = {n: golden[n].abs().max().item() for n in got}
    return {
        "status": "pass" if passes(errors, bf16_errors, magnitudes) else "wrong",
        "errors": errors,
        "bf16_errors": bf16_errors,
        "magnitudes": magnitudes,
    }


def run_cases(module: types.ModuleType) -> dict[str, dict[str, Any]]:
    """Every backend, shape and return_lse setting on ``module``'s op pairs (stand-ins registered)."""
    results = {}
    for backend in BACKENDS:
        for case in CASES:
            for return_lse in (False, True):
                results[f"{backend}/{case[0]}/return_lse={return_lse}"] = run_case(module, backend, case, return_lse)
    return results


def imported_first() -> str | None:
    """Which of the package and diffusers' attention module this interpreter imported first ("package" or
    "diffusers"; None without the package), read off the order of ``sys.modules`` (insertion order)."""
    names = list(sys.modules)
    if "diffusers_cudnn_fix" not in names:
        return None
    package_at = names.index("diffusers_cudnn_fix")
    diffusers_at = names.index("diffusers.models.attention_dispatch")
    return "package" if package_at < diffusers_at else "diffusers"


def _phase(module: types.ModuleType, ulysses: bool) -> dict[str, Any]:
    """The cases (and, with ``ulysses``, the same through TemplatedUlyssesAttention) in the state now."""
    package = sys.modules.get("diffusers_cudnn_fix")
    out: dict[str, Any] = {"package_loaded": package is not None, "imported_first": imported_first()}
    out["cases"] = run_cases(module)
    if ulysses:
        import subprocess_ulysses_grads

        out["ulysses"] = subprocess_ulysses_grads.run_cases(module)
    out["status"] = None if package is None else package.status().to_dict()
    return out


def main(order: str, *, control: bool = False, ulysses: bool = False) -> None:
    """Print one JSON line: the release, ``order``, ``status`` (None without the package) and ``cases``.

    ``ulysses``: the same cases through diffusers' TemplatedUlyssesAttention too (``subprocess_ulysses_grads``),
    under ``ulysses``. ``control`` (``order="diffusers_first"`` only): diffusers is imported, then every
    case runs on the ops as shipped, with the package not imported yet, under ``control``; only then is the
    package imported (its hook patching the module already loaded) and the cases run again. One
    interpreter thus gives the control and the diffusers-first run of a release.
    """
    if control and order != "diffusers_first":
        raise ValueError("the control runs before the package is imported: order='diffusers_first' only")
    result: dict[str, Any] = {"order": order}
    import torch

    # One intra-op thread: the tensors are small, and on a small machine shared with other test processes
    # torch's default (a thread per core) spends more CPU waiting than computing.
    torch.set_num_threads(1)
    # The stand-ins (and torch with them) only after the imports under test: "package first" means first.
    if control:
        module = import_in_order("none")
        import standin_kernels

        standin_kernels.register()
        result["control"] = _phase(module, ulysses)
        _not_imported_yet("diffusers_cudnn_fix")
        import diffusers_cudnn_fix  # noqa: F401  (diffusers first: the hook patches the module now)
    else:
        module = import_in_order(order)
        import standin_kernels

        standin_kernels.register()
    result.update(_phase(module, ulysses))
    import diffusers

    result["version"] = diffusers.__version__
    print(json.dumps(result), flush=True)
    if ulysses:
        os._exit(0)  # skip the gloo process group's teardown noise


if __name__ == "__main__":
    main(sys.argv[1])
