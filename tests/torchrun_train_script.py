"""A training script that never imports ``diffusers_cudnn_fix``, for ``torchrun`` (``tests/test_launcher.py``).

Run as ``torchrun --standalone --nproc-per-node 2 torchrun_train_script.py OUT_DIR`` with one diffusers release,
the repository and ``tests/`` on ``PYTHONPATH``, with or without ``diffusers-cudnn-fix run --`` in front.
Each rank trains one step of the tiny Flux of ``subprocess_cp_training`` under diffusers' own Ulysses context
parallelism (degree 2, ``_native_cudnn`` backend on the CPU stand-in kernels) in the gloo group torchrun
sets up; rank 0 first computes the one-process fp32 reference on diffusers' math backend, before the
stand-ins exist. Each rank writes ``OUT_DIR/rank<N>.json``: whether the package was in ``sys.modules``
before the script imported anything and at the end, its status if so, and the case's outcome (rank 0: the
worst relative gradient error against the reference).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

# What the process had imported before this script ran anything: the launcher's start-up hook, or nothing.
PACKAGE_AT_START = "diffusers_cudnn_fix" in sys.modules

import subprocess_cp_training as cp  # noqa: E402 - after the check above; imports only the standard library

MODE = "ulysses"


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    result: dict = {"rank": rank, "world_size": int(os.environ["WORLD_SIZE"]), "package_at_start": PACKAGE_AT_START}
    try:
        _train(rank, result)
    except BaseException as exc:
        result["fatal"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["package_at_end"] = "diffusers_cudnn_fix" in sys.modules
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _train(rank: int, result: dict) -> None:
    rec = cp._Warnings()
    import diffusers
    import diffusers.models.attention_dispatch as dispatch
    import torch
    import torch.distributed as dist

    result["diffusers_version"] = diffusers.__version__
    pkg = sys.modules.get("diffusers_cudnn_fix")
    if pkg is not None:
        report = pkg.status()
        result["status_ok"] = report.ok
        result["applied"] = sorted(f.id for f in report.fixes if f.applied)
    model16, inputs16, target, cast = cp._build("flux")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cp.PG_TIMEOUT_S))
    import standin_kernels

    ref32 = cp._reference(model16, inputs16, target, torch.float32, cast) if rank == 0 else None
    standin_kernels.register()
    entry = cp._train(MODE, model16, inputs16, target, 1, rec, dispatch)
    if ref32 is not None and entry.get("grads") is not None:
        entry["compare_worst"] = cp._compare(entry["grads"], ref32["grads"])["worst"]
    entry.pop("grads", None)
    entry.pop("local_grads", None)
    result["case"] = entry
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
