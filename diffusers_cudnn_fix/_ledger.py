"""What the corrected code ran: the fixes whose policies a training step reached, for ``verify``.

Each fix's policy marks its id here when it runs on a call (:func:`reached`), but only while :data:`recording` is
on: ``verify`` turns it on around its context-parallel step and reads what was marked (:func:`stop`), so its
report names the fixes its run exercised, by the code that ran rather than by what was installed. Off (always,
outside ``verify``) a policy pays one module-attribute read. Under ``torch.compile`` the mark is made while dynamo
traces the policy into a graph (``comptime``), so a compiled step is accounted for as well: its graph holds the
policies that were traced. Set operations only at call time: this runs on autograd's threads too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.comptime import comptime

#: Whether policies mark what they run (``verify`` turns it on with :func:`start`).
recording = False
_reached: set[str] = set()


def reached(key: str) -> None:
    """Mark ``key`` (a fix id, or a target whose shipped function was called) as reached by the step."""
    if torch.compiler.is_compiling():
        comptime(_reached_while_tracing)  # at trace time: the graph being built holds this policy
    else:
        _reached.add(key)


def _reached_while_tracing(ctx: Any) -> None:
    # Run by dynamo while it traces :func:`reached` (a comptime function may not close over locals): ``key`` is
    # that frame's argument, a constant to dynamo.
    _reached.add(ctx.get_local("key").as_python_constant())


def start() -> None:
    """Forget what was marked before, and mark from now on."""
    global recording
    _reached.clear()
    recording = True


def stop() -> frozenset[str]:
    """Stop marking; what was marked since :func:`start`."""
    global recording
    recording = False
    return frozenset(_reached)
