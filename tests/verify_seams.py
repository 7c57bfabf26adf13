"""Test-only seams for ``diffusers-cudnn-fix verify``, imported in each rank through verify's hidden
``--preload verify_seams`` (after torch, before diffusers; docs/verify.md, "Tests"). Never part of the wheel.

* The CPU stand-ins for the cuDNN / flash SDPA ATen ops (``standin_kernels.register()``), so that
  ``_native_cudnn`` and ``_native_flash`` run on a CPU. The one-process references run on diffusers'
  ``_native_math`` backend, which never reaches those ops.
* On a torch without an accelerator, diffusers 0.42.x's ``enable_parallelism`` divides by
  ``torch.accelerator.device_count()`` (0). As in tests/subprocess_cp_training.py, only for the duration of
  that one call the count reads 1; nothing else changes. Needed only with the package off (``--without-package``):
  its ``cp_no_accelerator`` corrects it otherwise (tests/test_verify.py runs that case without this module).
* On a CPU, ``_native_cudnn``'s calls outside context parallelism (a model's cross-attention to the unsplit text,
  Helios') ask ``F.scaled_dot_product_attention`` for the cuDNN kernel alone, which has no CPU implementation (the
  stand-ins are the context-parallel path's ATen ops): there, that request runs the math kernel.
"""

from __future__ import annotations

import functools

import standin_kernels
import torch

standin_kernels.register()


def _count_one_during_enable_parallelism() -> None:
    from diffusers.models.modeling_utils import ModelMixin

    shipped = getattr(ModelMixin, "enable_parallelism", None)
    if shipped is None:  # 0.35.2: no context parallelism (verify says so)
        return

    @functools.wraps(shipped)
    def enable_parallelism(self, *args, **kwargs):
        original = torch.accelerator.device_count
        torch.accelerator.device_count = lambda: 1
        try:
            return shipped(self, *args, **kwargs)
        finally:
            torch.accelerator.device_count = original

    ModelMixin.enable_parallelism = enable_parallelism


if hasattr(torch, "accelerator") and torch.accelerator.device_count() == 0:
    _count_one_during_enable_parallelism()


def _cudnn_alone_runs_math_on_a_cpu() -> None:
    import torch.nn.attention as attention

    shipped = attention.sdpa_kernel

    @functools.wraps(shipped)
    def sdpa_kernel(backends, *args, **kwargs):
        if backends == attention.SDPBackend.CUDNN_ATTENTION or backends == [attention.SDPBackend.CUDNN_ATTENTION]:
            backends = attention.SDPBackend.MATH
        return shipped(backends, *args, **kwargs)

    attention.sdpa_kernel = sdpa_kernel


if not torch.cuda.is_available():
    _cudnn_alone_runs_math_on_a_cpu()
