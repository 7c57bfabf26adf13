"""The replaced targets: one replacement per attribute of diffusers' attention module (and QwenImage's attention
processor, and ``ModelMixin.enable_parallelism``), built once from the set of fixes found broken (:func:`build`).
The cuDNN and flash ops are built first; the Ulysses and ring builders are handed them (``ulysses.build``,
``ring.build``): a replacement learns of another through its builder's arguments. A check runs a replacement with
collaborators of its own by building it again here (the registry's ``Objects.built``): diffusers' function in its
place stood in, the other replacements as they are (``siblings``), and the ring's collectives and step ops."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from .._detect import CUDNN_FORWARD_KERNEL, FLASH_FORWARD_KERNEL, input_count, refuses_gqa, run_ulysses_backward
from .._fix import Finding, Lookup
from ..fixes import CUDNN_FORWARD, FLASH_BACKEND, FLASH_FORWARD, ULYSSES_FORWARD, ring_grad_route, ulysses_grad_count
from ..fixes.flash_cp_ignored import refuses_return_lse
from ..fixes.ring_grad_route import REUSES_FIRST_STEP, reuses_first_step
from . import cudnn, flash, models, ring, ulysses


class Facts:
    """What the builders read off the code diffusers shipped (``shipped``), each computed once, on first use: a
    check's rebuild of a replacement is handed the same facts (its stand-ins are not diffusers' code)."""

    def __init__(self, shipped: Lookup, findings: Mapping[str, Finding] | None = None) -> None:
        self.shipped = shipped
        self.findings = findings or {}  # the checks' findings on the shipped code, where they were run already
        self._gqa: dict[str, bool] = {}

    def gqa_refused(self, op: str) -> bool:
        """Whether diffusers' forward op ``op`` raises its own error for ``enable_gqa`` (it runs the op): for the
        op's replacement and the Ulysses forward that may be handed it."""
        if op not in self._gqa:
            kernel = {CUDNN_FORWARD: CUDNN_FORWARD_KERNEL, FLASH_FORWARD: FLASH_FORWARD_KERNEL}[op]
            self._gqa[op] = refuses_gqa(self.shipped(op), kernel)
        return self._gqa[op]

    @functools.cached_property
    def flash_lse_refused(self) -> bool:
        """Whether diffusers' ``_native_flash`` backend raises its own error for ``return_lse``."""
        return refuses_return_lse(self.shipped(FLASH_BACKEND))

    def _read(self, fix_id: str, key: str) -> Any:
        """What fix ``fix_id``'s check read as ``key`` on the shipped code, or None where it was not run or read."""
        finding = self.findings.get(fix_id)
        return None if finding is None else finding.read.get(key)

    @functools.cached_property
    def ulysses_inputs(self) -> int:
        """How many inputs diffusers' Ulysses forward takes (as its check read it, else read here)."""
        inputs = self._read(ulysses_grad_count.FIX_ID, ulysses_grad_count.INPUTS)
        inputs = input_count(self.shipped(ULYSSES_FORWARD)) if inputs is None else inputs
        assert inputs is not None
        return int(inputs)

    @functools.cached_property
    def ulysses_returned(self) -> int:
        """How many gradients diffusers' Ulysses backward returns (as its check read it, else run as it ran it)."""
        returned = self._read(ulysses_grad_count.FIX_ID, ulysses_grad_count.RETURNED)
        if returned is not None:
            return int(returned)
        grads, error = run_ulysses_backward(self.shipped)
        assert grads is not None, error
        return len(grads)

    @functools.cached_property
    def ring_reuses_first_step(self) -> bool:
        """Whether diffusers' ring reuses the first step's tensors in every step (0.36 - 0.39): as the ring's check
        on the shipped code read it, else found by running that ring."""
        reuses = self._read(ring_grad_route.FIX_ID, REUSES_FIRST_STEP)
        return reuses_first_step(self.shipped) if reuses is None else bool(reuses)


def build(
    shipped: Lookup, broken: frozenset[str], *, facts: Facts | None = None, diffusers: Any = None,
    siblings: dict[str, Any] | None = None, collectives: Any = None, step_ops: Any = None, all_to_all: Any = None,
    mask_mode: str | None = None, all_reduce: Any = None, torch_module: Any = None,
) -> dict[str, Any]:  # fmt: skip
    """Every replacement the policies of the ``broken`` fixes need, by target (diffusers' objects: ``shipped``, from
    its attention module ``diffusers``; what the builders read off them: ``facts``, default read off ``shipped``).
    ``siblings``: replacements already built (a check's rebuild of one target: the others as they are, so that the
    rebuilt one is handed the very ops diffusers will hand it); ``collectives`` and ``step_ops``: the ring's
    (:func:`ring.build`); ``all_to_all``: the Ulysses backward's (:func:`ulysses.build`); ``mask_mode``: the
    mask mode the cuDNN forward and the Ulysses forward run in, without its notices (a check's; default: the
    user's switch, read at each call); ``all_reduce``: how ``enable_parallelism``'s replacement sums a gathered
    gradient over the ranks, ``torch_module`` the torch ``_resolve_parallel_config``'s replacement reads
    (:func:`models.build`)."""
    facts = Facts(shipped) if facts is None else facts
    gqa_refused = facts.gqa_refused
    ops = {
        **cudnn.build(shipped, broken, gqa_refused, mask_mode),
        **flash.build(shipped, broken, gqa_refused, facts),
        **(siblings or {}),
    }
    built = {
        **ops,
        **ulysses.build(shipped, broken, ops, facts, diffusers=diffusers, all_to_all=all_to_all, mask_mode=mask_mode),
        **ring.build(shipped, broken, ops, facts, collectives=collectives, step_ops=step_ops),
    }
    return {**built, **models.build(shipped, broken, all_reduce, torch_module)}
