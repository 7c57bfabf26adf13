"""0.36.0's Ulysses backward returns 11 gradients for 12 inputs.

Bug: autograd raises "returned an incorrect number of gradients (expected 12, got 11)" for every backend.
Release 0.36.0 (fixed in 0.37.0).
Detection: run the backward in one process (stand-in collectives) and count what it returns.
The package: the Ulysses backward's replacement pads the result with ``None`` (docs/fixes.md).
"""

from __future__ import annotations

from .. import _detect
from .._fix import Finding, Lookup, State, shipped_of
from . import ULYSSES_BACKWARD, ULYSSES_FORWARD

#: The record's id (the module is named after it: the registry finds the check so), for its policy's mark (targets/).
FIX_ID = __name__.rpartition(".")[2]


#: The keys of what :func:`check` read in its finding: the Ulysses forward's inputs, the backward's gradients.
INPUTS, RETURNED = "ulysses_inputs", "ulysses_returned"


def check(lookup: Lookup) -> Finding:
    forward, backward = lookup(ULYSSES_FORWARD), lookup(ULYSSES_BACKWARD)
    if forward is None or backward is None:
        return Finding("absent", "this diffusers has no TemplatedUlyssesAttention")
    inputs = _detect.input_count(shipped_of(lookup, ULYSSES_FORWARD))
    if inputs is None or getattr(backward, "__code__", None) is None:
        return Finding("unknown", "TemplatedUlyssesAttention's forward/backward are not plain functions")
    grads, error = _detect.run_ulysses_backward(lookup)
    if grads is None:
        return Finding("unknown", f"the Ulysses backward could not be run in one process ({error})")
    read = {INPUTS: inputs, RETURNED: len(grads)}  # for the builders (targets.Facts), on the shipped code
    if len(grads) != inputs:
        # Fewer is the bug; more is a build this check does not know.
        state: State = "broken" if len(grads) < inputs else "unknown"
        return Finding(state, f"the Ulysses backward returns {len(grads)} gradients for {inputs} inputs", read)
    return Finding("ok", f"the Ulysses backward returns one gradient per input ({inputs})", read)
