"""One launch-order case on a CUDA GPU, run in a fresh interpreter by ``test_gpu.py`` (marker ``gpu``).

    python tests/gpu_launch_order.py --order package_first|diffusers_first --cuda cold|cuda|nccl|torchrun
    torchrun --standalone --nproc-per-node 1 tests/gpu_launch_order.py --order package_first --cuda torchrun

The release under test is whichever diffusers is first on ``PYTHONPATH``. Steps, each timed:

1. the CUDA state before any import of the package or of diffusers: ``cold`` (nothing), ``cuda``
   (``torch.cuda.set_device(0); torch.zeros(1, device="cuda")``), ``nccl`` (that, then a one-rank NCCL
   process group, rendezvous on the file store ``DCF_INIT_METHOD`` names (else env://), ``device_id`` given so the
   communicator exists now), ``torchrun`` (the same under a real ``torchrun``, which sets the environment);
2. the two imports in the order given (``import diffusers_cudnn_fix``,
   ``import diffusers.models.attention_dispatch``); then what the imports did: the probes recorded
   (must be none: no GPU work inside an import), whether CUDA is initialised, the fixes' status;
3. a one-rank NCCL group if there is none yet, and a forward and backward through diffusers' own
   ``TemplatedUlyssesAttention`` (``_native_cudnn`` op pair, world size 1, config saying 2 ranks as in
   training), twice per shape, against fp32 eager attention with the probe's pass rule;
4. the probes recorded afterwards (must be: one, on cuda:0, passed, run once).

A hang is the failure this exists to catch: ``faulthandler`` dumps every thread's stack to stderr and
exits 70 after ``--timeout`` minus 10 seconds (the launcher's own timeout is the backstop). The result is
one JSON object, printed as the last line and written to ``$DCF_LAUNCH_RESULT`` if set.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback
import types
import warnings
from typing import Any

from harness import ulysses_attention, ulysses_config

NAMES = ("out", "dq", "dk", "dv")
#: (name, B, S, H, D): H == S (where no shape check helps) and H != S.
SHAPES = (("heads_eq_seq", 2, 16, 16, 64), ("heads_ne_seq", 2, 128, 8, 64))


def _probe_dicts(report: Any) -> list[dict[str, Any]]:
    import dataclasses

    out = []
    for p in getattr(report, "probes", ()):
        if dataclasses.is_dataclass(p):
            data = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
        elif hasattr(p, "as_dict"):
            data = p.as_dict()
        else:
            data = {"repr": repr(p)}
        data.pop("cases", None)  # the per-case tables are long; state / device / runs are what is checked
        out.append(data)
    return out


def _init_nccl(torch: Any, eager: bool, backend: str = "nccl") -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    kwargs: dict[str, Any] = {}
    if backend != "nccl":
        eager = False
    if eager:
        kwargs["device_id"] = torch.device("cuda", 0)  # eager communicator: NCCL really is up before imports
    dist.init_process_group(
        backend,
        # A file store where the test gives one: ports picked ahead of time can be taken by the time a case
        # binds them (torchrun's own rendezvous picks one too), which failed a case with EADDRINUSE.
        init_method=os.environ.get("DCF_INIT_METHOD", "env://"),
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
        **kwargs,
    )


def _attention(q: Any, k: Any, v: Any, grad: Any, dtype: Any) -> dict[str, Any]:
    """Eager attention in ``dtype`` on (B, S, H, D) tensors: out, dq, dk, dv as fp32 (B, S, H, D)."""
    import torch

    leaves = [x.to(dtype).transpose(1, 2).detach().requires_grad_(True) for x in (q, k, v)]
    with torch.enable_grad():
        scores = (leaves[0] @ leaves[1].transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        out = torch.softmax(scores, dim=-1) @ leaves[2]
        out.backward(grad.to(dtype).transpose(1, 2))
    return {n: t.transpose(1, 2).float() for n, t in zip(NAMES, (out.detach(), *(x.grad for x in leaves)))}


def _pass_rule() -> tuple[float, float, str]:
    from diffusers_cudnn_fix import _probe

    factor = getattr(_probe, "REFERENCE_FACTOR", None)
    slack = getattr(_probe, "ABSOLUTE_SLACK", None)
    if factor is None or slack is None:
        return 5.0, 1e-3, "fallback (5x + 1e-3): _probe has no REFERENCE_FACTOR / ABSOLUTE_SLACK"
    return float(factor), float(slack), "diffusers_cudnn_fix._probe"


def ulysses(module: types.ModuleType, torch: Any, device: Any) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,))
    config = ulysses_config(mesh)
    factor, slack, rule_source = _pass_rule()
    results: dict[str, Any] = {"rule": {"factor": factor, "slack": slack, "from": rule_source}}
    for name, batch, seq, heads, dim in SHAPES:
        gen = torch.Generator(device=device).manual_seed(1234)
        q, k, v, grad = (
            torch.randn(batch, seq, heads, dim, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(4)
        )
        golden = _attention(q, k, v, grad, torch.float32)
        low = _attention(q, k, v, grad, torch.bfloat16)
        ref_errors = {n: (low[n] - golden[n]).abs().max().item() for n in NAMES}
        for attempt in (1, 2):  # the second call must not probe again
            key = f"{name} call {attempt}"
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
            try:
                out = ulysses_attention(module, *leaves, config=config)
                out.backward(grad)
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as exc:
                results[key] = {
                    "raised": f"{type(exc).__name__}: {str(exc)[:400]}",
                    "traceback": traceback.format_exc()[-2000:],
                }
                continue
            got = {"out": out.detach().float(), **{n: x.grad.float() for n, x in zip(("dq", "dk", "dv"), leaves)}}
            errors = {
                n: float("inf") if not torch.isfinite(got[n]).all() else (got[n] - golden[n]).abs().max().item()
                for n in NAMES
            }
            results[key] = {
                "shape": {"B": batch, "S": seq, "H": heads, "D": dim},
                "errors": errors,
                "ref_errors": ref_errors,
                "limits": {n: factor * ref_errors[n] + slack for n in NAMES},
                "passed": all(errors[n] <= factor * ref_errors[n] + slack for n in NAMES),
            }
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--order", choices=("package_first", "diffusers_first"), required=True)
    parser.add_argument("--cuda", choices=("cold", "cuda", "nccl", "torchrun"), required=True)
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="CPU stand-in kernels and gloo instead of CUDA/NCCL (to test this script only)",
    )
    parser.add_argument("--timeout", type=float, default=float(os.environ.get("DCF_LAUNCH_TIMEOUT", 120)))
    args = parser.parse_args(argv)
    # A hang: every thread's stack to stderr, then exit 70, before the launcher's own timeout kills us.
    faulthandler.dump_traceback_later(max(args.timeout - 10, 5), exit=True)
    warnings.simplefilter("always")
    caught: list[str] = []
    show = warnings.showwarning

    def _record(message, category, filename, lineno, file=None, line=None):
        caught.append(f"{category.__name__}: {str(message)[:300]}")
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = _record
    times: dict[str, float] = {}
    start = time.perf_counter()
    result: dict[str, Any] = {"order": args.order, "cuda_state": args.cuda, "pid": os.getpid()}
    try:
        if args.cuda != "cold":
            import torch

            torch.cuda.set_device(0)
            torch.zeros(1, device="cuda")
            if args.cuda in ("nccl", "torchrun"):
                _init_nccl(torch, eager=True)
        times["before_imports_s"] = time.perf_counter() - start

        t0 = time.perf_counter()
        if args.order == "package_first":
            import diffusers.models.attention_dispatch as module

            import diffusers_cudnn_fix
        else:
            import diffusers.models.attention_dispatch as module

            import diffusers_cudnn_fix
        times["imports_s"] = time.perf_counter() - t0
        import torch  # already loaded by diffusers

        report = diffusers_cudnn_fix.status()
        result["after_imports"] = {
            "probes": _probe_dicts(report),
            "cuda_initialised": torch.cuda.is_initialized(),
            "probe_module_loaded": "diffusers_cudnn_fix._probe" in sys.modules,
            "ok": report.ok,
            "fixes": {f.id: {"detected": f.detected, "applied": f.applied} for f in report.fixes},
        }
        import diffusers

        result.update(
            version=diffusers.__version__,
            torch=torch.__version__,
            cudnn=torch.backends.cudnn.version(),
            gpu=None if args.cpu_smoke else torch.cuda.get_device_name(0),
        )

        t0 = time.perf_counter()
        if args.cpu_smoke:
            import standin_kernels

            standin_kernels.register()
            device = torch.device("cpu")
            _init_nccl(torch, eager=False, backend="gloo")
        else:
            device = torch.device("cuda", 0)
            torch.cuda.set_device(0)
            _init_nccl(torch, eager=False)
        times["nccl_after_imports_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        result["ulysses"] = ulysses(module, torch, device)
        times["ulysses_s"] = time.perf_counter() - t0
        result["probes_after"] = _probe_dicts(diffusers_cudnn_fix.status())
        result["status_ok"] = diffusers_cudnn_fix.status().ok
    except BaseException as exc:
        result["raised"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        result["traceback"] = traceback.format_exc()[-4000:]
    faulthandler.cancel_dump_traceback_later()
    times["total_s"] = time.perf_counter() - start
    result["times"] = times
    result["warnings"] = caught[:20]
    line = json.dumps(result, default=str)
    target = os.environ.get("DCF_LAUNCH_RESULT")
    if target:
        with open(target, "w") as fh:
            fh.write(line)
    print(line, flush=True)
    sys.stderr.flush()
    os._exit(0)  # no NCCL teardown at exit: what is checked here is done


if __name__ == "__main__":
    main()
