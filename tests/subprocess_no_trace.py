"""A training script's first lines, in a fresh interpreter: does the package leave its process as it found it?

Run with one diffusers release first on ``PYTHONPATH`` (``releases.run`` does it; ``stack=True`` puts transformers,
accelerate and peft there too, ``releases.USER_STACK``)::

    python -c "import subprocess_no_trace as s; s.main('package_first', stack=True)"

The script does what a training script does (``ORDERS``: the package imported before diffusers, after it, or not
at all): imports accelerate, peft and transformers where they are installed, imports the package and diffusers in
the order given, seeds torch, imports a model class lazily (``from diffusers import FluxTransformer2DModel``: the
package's checks run here, when diffusers loads the class's modules), builds a tiny Flux from the seeded generator,
and, with the package, calls ``apply()``, ``status()``, ``revert()``, ``apply()``, ``probe()`` and the doctor's
``collect()``. It reads the process's state (``process_state.state``) after each step, keeps every warning shown,
and prints one JSON line: ``steps`` (step -> state), ``weights`` (a digest of the built model's parameters),
``warnings`` (category, message), ``advice``, ``shipped_check`` and ``probed`` (the probe's state).

``train(order, stack)`` runs the same first lines in two gloo ranks and in one process without the package (each
forked fresh after torch's import), then one training step: diffusers' own context-parallel parity pattern.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from typing import Any

import process_state

ORDERS = ("package_first", "diffusers_first", "without")
#: The tiny Flux's heads: 2, one per rank under Ulysses degree 2.
HEADS = 2
#: Image and text tokens of the training step's inputs (each splits over 2 ranks).
TOKENS = 4
#: The user stack's modules, imported as training scripts do, before diffusers.
STACK = ("accelerate", "peft", "transformers")


def _weights(model: Any) -> str:
    digest = hashlib.sha256()
    for name, param in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(param.detach().float().numpy().tobytes())
    return digest.hexdigest()[:16]


def _first_lines(order: str, stack: bool, cuda: bool, shown: list[tuple[str, str]]) -> tuple[Any, dict[str, Any]]:
    """A training script's first lines (the module's docstring), to the model built from the seeded generator: the
    model, and the state after each step. Every warning shown is added to ``shown``."""
    stock = warnings.showwarning

    def keep(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        shown.append((f"{category.__module__}.{category.__name__}", str(message)))
        stock(message, category, *args, **kwargs)

    warnings.showwarning = keep
    import torch

    steps: dict[str, Any] = {}
    if stack:
        import importlib

        for name in STACK:
            importlib.import_module(name)
    if order == "package_first":
        import diffusers_cudnn_fix
    import diffusers  # noqa: F401

    if order == "diffusers_first":
        import diffusers_cudnn_fix  # noqa: F401
    if cuda:
        torch.zeros(1, device="cuda")
    torch.manual_seed(0)  # every CUDA device's generator too, where CUDA is initialised
    steps["seeded"] = process_state.state()
    from diffusers import FluxTransformer2DModel  # diffusers loads the model's modules here: the checks run

    steps["model class imported"] = process_state.state()
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=HEADS, joint_attention_dim=8,
        axes_dims_rope=(4, 6, 6), num_layers=1, num_single_layers=1, pooled_projection_dim=8, guidance_embeds=False,
    )  # fmt: skip
    steps["model built"] = process_state.state()
    return model, steps


def main(order: str, stack: bool = False, cuda: bool = False) -> None:
    """``cuda``: initialise CUDA and seed it with the CPU (a GPU machine): the probe then runs on the GPU."""
    assert order in ORDERS, order
    shown: list[tuple[str, str]] = []
    model, steps = _first_lines(order, stack, cuda, shown)
    import diffusers

    result: dict[str, Any] = {"weights": _weights(model), "diffusers": diffusers.__version__}
    if order != "without":
        import diffusers_cudnn_fix
        from diffusers_cudnn_fix.__main__ import collect

        diffusers_cudnn_fix.apply()
        diffusers_cudnn_fix.status()
        diffusers_cudnn_fix.revert()
        diffusers_cudnn_fix.apply()
        steps["apply, status, revert, apply"] = process_state.state()
        result["probed"] = diffusers_cudnn_fix.probe().state
        data, _ = collect(run_gpu=cuda)
        steps["probe, doctor"] = process_state.state()
        result["advice"] = data["advice"]
        result["shipped_check"] = data["shipped_check"]
    result.update(steps=steps, warnings=shown, stack={name: name in __import__("sys").modules for name in STACK})
    print(json.dumps(result))


# ------------------------------------------------------------------------------------------------------------
# The same first lines, then a training step under context parallelism (diffusers' own CP parity pattern)
# ------------------------------------------------------------------------------------------------------------
def _inputs(torch: Any) -> tuple[dict[str, Any], Any]:
    """The step's inputs and target, from a generator of their own (as a script's data loader would be)."""
    gen = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, TOKENS, 4, generator=gen),
        "encoder_hidden_states": torch.randn(1, TOKENS, 8, generator=gen),
        "timestep": torch.tensor([0.5]),
        "pooled_projections": torch.randn(1, 8, generator=gen),
        "img_ids": torch.tensor([[0.0, i // 2, i % 2] for i in range(TOKENS)]),
        "txt_ids": torch.zeros(TOKENS, 3),
    }
    return inputs, torch.randn(1, TOKENS, 4, generator=gen)


def _train_one(rank: int, world: int, order: str, stack: bool, folder: str) -> None:
    """One process of :func:`train`: the first lines, then one training step; its file in ``folder``."""
    import os

    out: dict[str, Any] = {"rank": rank}
    try:
        shown: list[tuple[str, str]] = []
        model, _ = _first_lines(order, stack, False, shown)
        import torch

        torch.set_num_threads(1)
        out["weights"] = _weights(model)
        if world > 1:
            import torch.distributed as dist
            from diffusers.models._modeling_parallel import ContextParallelConfig

            dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
            model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world))
        inputs, target = _inputs(torch)
        (output,) = model(**inputs, return_dict=False)
        torch.nn.functional.mse_loss(output, target).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        if world > 1:
            dist.all_reduce(grads)  # diffusers' gradients are each rank's partial sums
        out.update(output=output.detach().reshape(-1).tolist(), grads=grads.tolist(), warnings=shown)
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    with open(os.path.join(folder, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)


def train(order: str, stack: bool = False, deadline_s: float = 240.0) -> None:
    """Two gloo ranks (Ulysses degree 2, diffusers' default backend) and one process without context parallelism and
    without the package, each a fresh process running the first lines (the ranks in ``order``), then one training
    step. ``order`` may be "both" (rank 0 imports the package first, rank 1 after diffusers). Prints one JSON line:
    each process's weights digest, its output and its gradients (the ranks' summed)."""
    import multiprocessing
    import os
    import tempfile
    import time

    import torch  # noqa: F401 - before the fork: the processes need not import it again

    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="no_trace_") as folder:
        # "both": rank 0 imports the package first, rank 1 after diffusers (one wrongly patched rank spoils the sum).
        orders = ("package_first", "diffusers_first") if order == "both" else (order, order)
        runs = [(0, 2, orders[0]), (1, 2, orders[1]), ("one", 1, "without")]
        procs = [context.Process(target=_train_one, args=(r, world, how, stack, folder)) for r, world, how in runs]
        for proc in procs:
            proc.start()
        end = time.monotonic() + deadline_s
        for proc in procs:
            proc.join(max(0.0, end - time.monotonic()))
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        found = {}
        for rank, _, _ in runs:
            path = os.path.join(folder, f"{rank}.json")
            found[str(rank)] = json.load(open(path)) if os.path.exists(path) else {"error": "no result (timed out?)"}
    print(json.dumps(found))
