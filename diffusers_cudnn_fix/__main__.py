"""``python -m diffusers_cudnn_fix`` / ``diffusers-cudnn-fix``: the doctor.

Prints versions (diffusers, torch, CUDA, cuDNN, GPU), each fix's state, what the behavioural check saw
reach the ATen ops before and after patching, and on a GPU an error table like the upstream report: the ops
"as shipped" and "corrected", out / dQ / dK / dV max-abs error against fp32, and the reference magnitudes.

Exit status:
    0  everything the installed diffusers needs is active, and verified on this GPU by the probe;
    1  something needed is not active, or the GPU probe failed;
    2  diffusers (or torch) cannot be imported;
    3  everything needed is active, but there is no usable GPU here to verify it on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

EXIT_OK, EXIT_NOT_SAFE, EXIT_NO_DIFFUSERS, EXIT_UNVERIFIED = 0, 1, 2, 3


def _environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": None,
    }
    if torch.cuda.is_available():
        env["gpu"] = f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))})"
    return env


def _check_findings() -> dict[str, Any]:
    """What the behavioural check sees now, on the installed objects: per fix, state and evidence."""
    from . import _registry
    from .fixes import ALL_FIXES

    module = sys.modules[_registry.MODULE_NAME]
    now = {}
    for fix in ALL_FIXES:
        finding = fix.check(lambda name: _registry.callable_of(_registry.raw_get(module, name)))
        now[fix.id] = {"state": finding.state, "detail": finding.detail}
    return now


def _shipped_vs_corrected(device: Any) -> list[dict[str, Any]]:
    """Rows "as shipped" and "corrected" for the cuDNN pair on the probe's first case (H == S)."""
    from . import _probe as probe
    from . import _registry

    module = sys.modules[_registry.MODULE_NAME]
    rows = []
    case = probe.CASES[0]
    golden = probe.reference(case, device, __import__("torch").float32)
    variants = {
        "as shipped": tuple(_registry.original(n) for n in probe.BACKENDS["cudnn"]),
        "corrected": tuple(getattr(module, n) for n in probe.BACKENDS["cudnn"]),
    }
    for label, (fwd, bwd) in variants.items():
        if fwd is None or bwd is None:
            continue
        fwd, bwd = _registry.callable_of(fwd), _registry.callable_of(bwd)
        try:
            got = probe.run_pair(fwd, bwd, case, device)
            errors = {n: (got[n] - golden[n]).abs().max().item() for n in probe.TENSORS}
            rows.append({"variant": label, "errors": errors, "error": None})
        except Exception as exc:  # noqa: BLE001 - the shipped ops may raise: that is the finding
            rows.append({"variant": label, "errors": None, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
    rows.append(
        {
            "variant": "reference magnitudes",
            "errors": {n: golden[n].abs().max().item() for n in probe.TENSORS},
            "error": None,
        }
    )
    return rows


def collect(run_gpu: bool = True) -> tuple[dict[str, Any], int]:
    """Everything the doctor shows, as data, and the exit status."""
    try:
        import diffusers.models.attention_dispatch  # noqa: F401 - fires the hook
        import torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return {"error": f"cannot import diffusers' attention module: {type(exc).__name__}: {exc}"}, EXIT_NO_DIFFUSERS

    import diffusers_cudnn_fix

    from . import _probe as probe

    data: dict[str, Any] = {"environment": _environment()}
    before = diffusers_cudnn_fix.status()
    data["check_after_patching"] = _check_findings() if before.enabled else {}
    gpu = None
    if run_gpu:
        result = probe.probe()
        data["probe"] = dataclasses.asdict(result)
        data["probe_table"] = probe.table(result)
        if result.state != "skipped":
            gpu = result.device
            data["shipped_vs_corrected"] = _shipped_vs_corrected(__import__("torch").device(gpu))
    report = diffusers_cudnn_fix.status()
    data["status"] = report.to_dict()
    if not report.ok:
        code = EXIT_NOT_SAFE
    elif gpu is None:
        code = EXIT_UNVERIFIED
    else:
        code = EXIT_OK
    data["exit_status"] = code
    return data, code


def _print_human(data: dict[str, Any]) -> None:
    if "error" in data:
        print(f"diffusers_cudnn_fix doctor: {data['error']}")
        return
    import diffusers_cudnn_fix

    env = data["environment"]
    print(f"python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, GPU {env['gpu']}")
    print(diffusers_cudnn_fix.status())
    if data["check_after_patching"]:
        print("\nbehavioural check on the live (patched) ops:")
        for fix_id, finding in data["check_after_patching"].items():
            print(f"  {fix_id:<20} {finding['state']:<8} {finding['detail']}")
    probe_data = data.get("probe")
    if probe_data is not None:
        print(f"\nGPU probe: {probe_data['state']} on {probe_data['device']} ({probe_data['reason']})")
        if probe_data["state"] != "skipped":
            print(data["probe_table"])
    rows = data.get("shipped_vs_corrected")
    if rows:
        print("\ncuDNN op pair, bf16 B=2 S=16 H=16 D=64, max-abs error vs fp32 eager:")
        print(f"  {'variant':<22}" + "".join(f"{t:>10}" for t in ("out", "dQ", "dK", "dV")))
        for row in rows:
            if row["error"]:
                print(f"  {row['variant']:<22}raises {row['error']}")
            else:
                print(
                    f"  {row['variant']:<22}" + "".join(f"{row['errors'][t]:>10.4f}" for t in ("out", "dq", "dk", "dv"))
                )
    if data.get("probe", {}).get("state") == "skipped":
        print(
            "\nNot verified on a GPU here: the behavioural check above ran (on CPU, no GPU needed), the GPU "
            "probe could not. It runs by itself on the first CUDA call of a corrected op."
        )
    print(f"\nexit status {data['exit_status']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diffusers-cudnn-fix", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU probe and the error table")
    args = parser.parse_args(argv)
    data, code = collect(run_gpu=not args.no_gpu)
    if args.json:
        print(json.dumps(data, default=str))
    else:
        _print_human(data)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
