"""diffusers 0.42's context parallelism divides by the accelerator count, which is 0 on a CPU-only torch.

Bug: ``ModelMixin._resolve_parallel_config`` (0.42.0 on; ``enable_parallelism`` and ``from_pretrained`` call it)
computes ``rank % torch.accelerator.device_count()``: ZeroDivisionError where torch has no accelerator (gloo on a CPU).
Detection: the method, run in one process with a stand-in of torch that counts 0 accelerators: does it divide by it?
The package: the same method seeing a torch whose accelerator count is 1 where it would be 0, so that the rank's
device is the CPU's, as 0.41.0 computed it (``torch.get_device_module("cpu").device_count()`` is 1); with an
accelerator nothing changes.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from .. import _ledger
from .._detect import with_globals, with_stand_ins
from .._fix import Finding, Lookup
from . import RESOLVE_PARALLEL_CONFIG

#: The record's id (the module is named after it: the registry finds the check so).
FIX_ID = __name__.rpartition(".")[2]


class _Forwarding:
    """Stands for an object (``_real``), its attributes read through, but those given."""

    def __init__(self, real: Any, **given: Any) -> None:
        self._real, self._given = real, given

    def __getattr__(self, name: str) -> Any:
        return self._given[name] if name in self._given else getattr(self._real, name)


def torch_counting_the_cpu(torch_module: Any) -> Any:
    """``torch_module`` as :func:`resolve_parallel_config`'s copy of diffusers' method sees it: its accelerator count
    1 where it is 0 (no accelerator: the rank's device is then the CPU's, index 0), the rest as it is."""
    accelerator = torch_module.accelerator

    def device_count() -> int:
        count = accelerator.device_count()
        if count:
            return int(count)
        if _ledger.recording:  # the policy acts where there is no accelerator
            _ledger.reached(FIX_ID)
        return 1

    return _Forwarding(torch_module, accelerator=_Forwarding(accelerator, device_count=device_count))


def resolve_parallel_config(shipped: Any, torch_module: Any = None) -> Any:
    """diffusers' ``ModelMixin._resolve_parallel_config`` (``shipped``), a copy of it whose ``torch`` global is
    :func:`torch_counting_the_cpu` of ``torch_module`` (default: torch itself; a check's stand-in)."""
    return with_globals(shipped, torch=torch_counting_the_cpu(torch if torch_module is None else torch_module))


class _Reached(Exception):
    """The method got past the device (a stand-in config's ``setup``), with the device it computed."""


def _stand_in_torch() -> Any:
    """torch as a CPU-only build on rank 1 of 2 shows itself to the method: no accelerator (a count of 0), the CPU
    as the accelerator type, a process group in place; every mesh a stand-in."""
    distributed = _Forwarding(
        torch.distributed, is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 1,
        get_world_size=lambda: 2, device_mesh=types.SimpleNamespace(init_device_mesh=lambda *a, **k: object()),
    )  # fmt: skip
    no_accelerator = _Forwarding(torch.accelerator, device_count=lambda: 0)
    cpu_type = _Forwarding(torch._C, _get_accelerator=lambda: torch.device("cpu"))
    return _Forwarding(torch, distributed=distributed, accelerator=no_accelerator, _C=cpu_type)


def _device_on_a_cpu_only_torch(run: Any) -> Any:
    """The device the method ``run`` computes for rank 1 of 2 on a CPU-only torch (a ``torch.device``), the
    ZeroDivisionError it raises, or a text where it cannot be run."""

    def setup(rank: int, world_size: int, device: Any, mesh: Any = None) -> None:
        raise _Reached(device)

    cp = types.SimpleNamespace(mesh=object(), mesh_shape=(2,), mesh_dim_names=("ulysses",))
    config = types.SimpleNamespace(context_parallel_config=cp, tensor_parallel_config=None, setup=setup)
    try:
        run(types.SimpleNamespace(), config)
    except _Reached as reached:
        return reached.args[0]
    except ZeroDivisionError as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - a build this check cannot run: said as unknown
        return f"{type(exc).__name__}: {exc}"
    return "it returned without setting the config up"


def check(lookup: Lookup) -> Finding:
    if lookup(RESOLVE_PARALLEL_CONFIG) is None:
        return Finding(
            "absent", "ModelMixin has no _resolve_parallel_config (this diffusers computes the device elsewhere)"
        )
    stand_in = _stand_in_torch()
    run = with_stand_ins(lookup, RESOLVE_PARALLEL_CONFIG, {"torch": stand_in}, torch_module=stand_in)
    found = run if isinstance(run, str) else _device_on_a_cpu_only_torch(run)
    if isinstance(found, ZeroDivisionError):
        return Finding("broken", "ModelMixin._resolve_parallel_config divides the rank by torch.accelerator."
                       "device_count(), which is 0 on a CPU-only torch: ZeroDivisionError")  # fmt: skip
    if isinstance(found, torch.device) and found.type == "cpu":
        return Finding("ok", f"on a CPU-only torch the rank's device is {found}")
    return Finding("unknown", f"ModelMixin._resolve_parallel_config could not be run in one process ({found})")
