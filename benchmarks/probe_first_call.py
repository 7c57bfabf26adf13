"""Where the probe's first call in a process goes (GPU): each step timed separately.

    python benchmarks/probe_first_call.py
    python benchmarks/probe_first_call.py --dry-run   # on the CPU stand-ins: each step called once, untimed

cuDNN is loaded first with a call at a shape the probe does not use. Then, in order, each piece of the
probe's work is timed once (CUDA-synchronised wall clock): so the first occurrence of each kernel
configuration shows what building its cuDNN graph costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from releases import release_dir  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU stand-in kernels, nothing timed")
    dry_run = parser.parse_args().dry_run
    sys.path.insert(0, str(release_dir("0.39.0")))
    import diffusers.models.attention_dispatch as m
    import torch

    if dry_run:
        import standin_kernels

        standin_kernels.register()
    import diffusers_cudnn_fix  # noqa: F401
    from diffusers_cudnn_fix import _devices
    from diffusers_cudnn_fix import _probe as probe

    dev = torch.device("cpu" if dry_run else "cuda")
    sync = (lambda: None) if dry_run else torch.cuda.synchronize
    warm = torch.randn(1, 4, 256, 128, device=dev, dtype=torch.bfloat16)
    torch.ops.aten._scaled_dot_product_cudnn_attention(warm, warm, warm, None, True)
    sync()
    _devices.set_prober(None)  # keep the automatic trigger (the first CUDA call) out of the way

    def timed(label, fn):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        print(f"{label:<48} {'(dry run)' if dry_run else f'{(time.perf_counter() - t) * 1e3:8.1f} ms'}")

    cudnn = (m._cudnn_attention_forward_op, m._cudnn_attention_backward_op)
    flash = (m._native_flash_attention_forward_op, m._native_flash_attention_backward_op)
    for case in probe.CASES:
        timed(f"fp32 reference {case[0]}", lambda: probe.reference(case, dev, torch.float32))
        timed(f"bf16 reference {case[0]}", lambda: probe.reference(case, dev, torch.bfloat16))
        timed(f"poison {case[0]}", lambda: probe._poison(case, dev))
    for label, ops in (("cudnn", cudnn), ("flash", flash)):
        for case in probe.CASES:
            timed(f"{label} copies {case[0]} (1st)", lambda: probe.run_pair(*ops, case, dev))
            timed(f"{label} copies {case[0]} (2nd)", lambda: probe.run_pair(*ops, case, dev))
    with _devices.trying_views():  # the corrected cuDNN forward hands the kernel views, on this thread
        for case in probe.CASES:
            timed(f"cudnn views {case[0]} (1st)", lambda: probe.run_pair(*cudnn, case, dev))
            timed(f"cudnn views {case[0]} (2nd)", lambda: probe.run_pair(*cudnn, case, dev))
    _devices._results.clear()  # the probe below starts as on a fresh device
    timed("whole probe, after all of the above", lambda: probe.probe(dev))


if __name__ == "__main__":
    main()
