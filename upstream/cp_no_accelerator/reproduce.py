"""diffusers 0.42's `enable_parallelism` divides by `torch.accelerator.device_count()`, which is 0 on a CPU-only torch.

Standalone: needs torch and diffusers only; runs on a CPU-only torch (2 processes over gloo). A tiny random
`FluxTransformer2DModel` gets `enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))` on each rank.

Exit status: 1 while it raises ZeroDivisionError (the bug), 0 once the rank's device is set up, 2 where the bug cannot
be shown (a torch with an accelerator).

    python reproduce.py
"""

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def _worker(rank, port, results):
    from diffusers import FluxTransformer2DModel
    from diffusers.models._modeling_parallel import ContextParallelConfig

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
            axes_dims_rope=(4, 6, 6), num_layers=1, num_single_layers=1, pooled_projection_dim=8,
        )  # fmt: skip
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=WORLD_SIZE))
        results[rank] = f"ok: {model._parallel_config.context_parallel_config._device}"
    except ZeroDivisionError as exc:
        results[rank] = f"BUG: ZeroDivisionError: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported by the parent
        results[rank] = f"could not run: {type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group()


def main():
    import diffusers

    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, accelerators: "
          f"{torch.accelerator.device_count()}")  # fmt: skip
    if torch.accelerator.device_count() > 0:
        print("could not run: this torch has an accelerator")
        return 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        start_method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(_worker, (port, results), nprocs=WORLD_SIZE, start_method=start_method)
        said = results.get(0, "could not run: no report")
    print(said)
    return 1 if said.startswith("BUG") else 2 if said.startswith("could not") else 0


if __name__ == "__main__":
    sys.exit(main())
