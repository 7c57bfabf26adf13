"""``diffusers-cudnn-fix run -- COMMAND [ARGS...]``: run a training command with the package active in it.

For training scripts the user cannot or will not edit (diffusers' example scripts, a framework's entry
point), in the manner of ``ddtrace-run`` and ``opentelemetry-instrument``. The launcher puts the folder
holding this package's ``sitecustomize.py`` (``site-bootstrap/``) first on ``PYTHONPATH`` in the command's
environment and then *becomes* the command (``os.execvpe``): same process id, so the exit status and every
signal reach the caller exactly as if the command had been started directly.

Python runs ``sitecustomize`` at start-up, before the script, in every interpreter that has ``site``
enabled and reads ``PYTHONPATH``. Every Python process the command starts inherits the environment, so
``torchrun`` / ``accelerate launch`` workers, spawned ``multiprocessing`` children and DataLoader workers
all import ``diffusers_cudnn_fix`` before anything else. That import is the ordinary one: it loads neither
torch nor diffusers, starts no thread and never initialises CUDA; the fixes go in when the script imports
diffusers' attention module.

What the bootstrap does in each Python process (``site-bootstrap/sitecustomize.py``):

* imports ``diffusers_cudnn_fix``; if that fails (say the command's Python is another interpreter where the
  package is not installed) it prints one line saying so on stderr and the process runs on without it;
* takes its own folder off ``sys.path`` again, so nothing in it stays importable;
* runs the ``sitecustomize`` the process would have run without the launcher (the user's, or the one the
  Python distribution ships), if there is one.

Not covered: interpreters started with ``-S`` (no ``site``), ``-I`` or ``-E`` (``PYTHONPATH`` ignored), and
children given an environment of their own without ``PYTHONPATH``: the package is not active there (import
it in the script instead). Nothing outside the command's environment is changed: no file is written and
the caller's environment stays as it was.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The folder the launcher puts first on ``PYTHONPATH``; it holds ``sitecustomize.py`` and nothing else. Its
#: name is no Python identifier, so it is no importable package either (and setuptools ships it as data).
BOOTSTRAP_DIR = Path(__file__).resolve().parent / "site-bootstrap"

#: Exit statuses of the launcher itself (a command that ran exits with its own status instead). The same
#: values as POSIX shells, ``env`` and ``timeout`` use.
EXIT_NOT_EXECUTABLE = 126  # COMMAND was found but could not be run (permissions, not a program)
EXIT_NOT_FOUND = 127  # COMMAND is not a file and not on PATH


def child_environment(parent: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``parent`` with the bootstrap folder first on ``PYTHONPATH`` (entries already there follow
    in their order; an empty ``PYTHONPATH`` adds no entry for the current directory). ``parent`` itself is
    not changed."""
    ours = str(BOOTSTRAP_DIR)
    rest = [entry for entry in parent.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != ours]
    return {**parent, "PYTHONPATH": os.pathsep.join([ours, *rest])}


def run(command: Sequence[str], environ: Mapping[str, str] | None = None) -> int:
    """Replace this process with ``command``, the package active in every Python process it starts.

    Returns only if ``command`` cannot be started: an exit status (:data:`EXIT_NOT_FOUND`,
    :data:`EXIT_NOT_EXECUTABLE`), after one line on stderr saying why. On Windows, which has no ``exec``
    that keeps the process, the command runs as a child and its exit status is returned.
    """
    if not command:
        raise ValueError("no command given")
    env = child_environment(os.environ if environ is None else environ)
    program = command[0]
    hook = BOOTSTRAP_DIR / "sitecustomize.py"
    if not hook.is_file():
        print(f"diffusers-cudnn-fix run: {hook} is missing (broken install?)", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if os.name == "nt":
            import subprocess

            return subprocess.call(list(command), env=env)
        os.execvpe(program, list(command), env)
    except FileNotFoundError:
        print(f"diffusers-cudnn-fix run: {program}: command not found", file=sys.stderr)
        return EXIT_NOT_FOUND
    except OSError as exc:
        print(f"diffusers-cudnn-fix run: {program}: cannot run it: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_NOT_EXECUTABLE
