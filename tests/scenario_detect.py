"""The check's two ways of catching the ATen calls give the same record, on one release.

Run in a fresh interpreter by ``test_detect.py``::

    python -c "import scenario_detect; scenario_detect.main()"

Every run the fixes' checks make while ``apply()`` checks the shipped ops, builds the replacements and
verifies them is made twice: on the fast path (copies of the ops seeing a view of torch) and on the
thorough path (a ``TorchDispatchMode``). The two records are compared call by call: op, every argument
(tensors by shape, stride, dtype, and by value where they are masks), the error, and the shapes of what
came back. Prints one JSON line: how many runs were compared, the mismatches, the fixes applied.
"""

from __future__ import annotations

import json
from typing import Any


def describe(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        info = [list(value.shape), list(value.stride()), str(value.dtype)]
        if value.dtype in (torch.bool, torch.float32, torch.bfloat16) and value.dim() == 4 and value.shape[1] == 1:
            info.append(value.float().tolist())  # a mask or additive bias: its values are the finding
        return info
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    return repr(value)


def describe_trace(trace: Any) -> dict[str, Any]:
    return {
        "calls": [[c.op, {k: describe(v) for k, v in sorted(c.args.items())}] for c in trace.calls],
        "error": trace.error,
        "forward_result": describe(trace.forward_result),
        "grads": describe(trace.grads),
    }


def main() -> None:
    from diffusers_cudnn_fix import _detect

    compared: list[str] = []
    mismatches: list[dict[str, Any]] = []
    original = _detect._run_pair

    def both(forward: Any, backward: Any, **kwargs: Any) -> Any:
        fast = original(forward, backward, thorough=False, **kwargs)
        thorough = original(forward, backward, thorough=True, **kwargs)
        label = f"{getattr(forward, '__qualname__', forward)} / {getattr(backward, '__qualname__', None)} {kwargs}"
        compared.append(label)
        a, b = describe_trace(fast), describe_trace(thorough)
        if a != b:
            mismatches.append({"run": label, "fast": a, "thorough": b})
        return fast

    _detect._run_pair = both
    import diffusers_cudnn_fix
    import diffusers.models.attention_dispatch  # noqa: F401  (the hook checks and patches here)

    status = diffusers_cudnn_fix.status()
    print(
        json.dumps(
            {
                "compared": compared,
                "mismatches": mismatches,
                "applied": sorted(f.id for f in status.fixes if f.applied),
                "ok": status.ok,
            }
        )
    )
