"""What a training script relies on in its process, read without changing it: ``state()``.

The random generators (CPU, and every CUDA device's where CUDA is initialised), torch's global flags (default
dtype, grad and inference mode, deterministic algorithms, the cuDNN, matmul and SDPA flags, float32 matmul
precision, autocast, intra-op threads), the loggers a training script configures (root, diffusers, transformers,
accelerate, peft, torch: level, handlers, propagation; and the methods of ``logging.Logger`` itself), the warning
filters, the environment variables changed since the script began, ``sys.path`` and the threads. Plain JSON data,
so that two processes (with and without the package) can be compared. Reading it creates no logger and initialises
nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import warnings
from typing import Any

#: The environment when this module was imported (a script's first line): ``state`` reports what changed since, which
#: two processes started from different callers can compare.
_ENVIRON_AT_START = dict(os.environ)

#: The loggers a training script configures or reads (looked up without creating them).
LOGGERS = ("", "diffusers", "transformers", "accelerate", "peft", "torch")


def _digest(tensor: Any) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()[:16]


def _logger(name: str) -> dict[str, Any] | None:
    logger = logging.root if not name else logging.root.manager.loggerDict.get(name)
    if not isinstance(logger, logging.Logger):
        return None
    handlers = [[type(h).__name__, h.level, type(h.formatter).__name__] for h in logger.handlers]
    return {"level": logger.level, "handlers": handlers, "propagate": logger.propagate, "disabled": logger.disabled}


def _torch() -> dict[str, Any]:
    import torch

    cuda = torch.backends.cuda
    found: dict[str, Any] = {
        "cpu_rng": _digest(torch.get_rng_state()),
        "cuda_initialized": torch.cuda.is_initialized(),
        "default_dtype": str(torch.get_default_dtype()),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "deterministic": [
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ],
        "cudnn": {k: getattr(torch.backends.cudnn, k) for k in ("enabled", "benchmark", "deterministic", "allow_tf32")},
        "matmul": {
            k: getattr(cuda.matmul, k)
            for k in ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")
        },
        "sdp": {k: getattr(cuda, k)() for k in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled")},
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "autocast": {d: [torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))] for d in ("cpu", "cuda")},
        "num_threads": torch.get_num_threads(),
    }
    if hasattr(cuda, "cudnn_sdp_enabled"):
        found["sdp"]["cudnn_sdp_enabled"] = cuda.cudnn_sdp_enabled()
    if torch.cuda.is_initialized():  # reading them needs CUDA: only where the process initialised it already
        found["cuda_rng"] = [_digest(s) for s in torch.cuda.get_rng_state_all()]
    return found


def state() -> dict[str, Any]:
    """The process's state as a training script relies on it (see the module's docstring)."""
    return {
        **(_torch() if "torch" in sys.modules else {}),
        "loggers": {name or "root": _logger(name) for name in LOGGERS},
        "logger_methods": sorted(name for name in vars(logging.Logger) if not name.startswith("__")),
        "logging_disabled": logging.root.manager.disable,
        "warning_filters": [repr(f) for f in warnings.filters],
        "environ_changed": sorted(
            k for k in _ENVIRON_AT_START.keys() | os.environ.keys() if _ENVIRON_AT_START.get(k) != os.environ.get(k)
        ),
        "sys_path": list(sys.path),
        "threads": sorted(t.name for t in threading.enumerate()),
    }


def differences(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The keys whose values differ, with (before, after)."""
    keys = sorted(before.keys() | after.keys())
    return {k: (before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)}
