"""Start-up hook of ``diffusers-cudnn-fix run`` (see ``diffusers_cudnn_fix/_launcher.py``).

Python imports ``sitecustomize`` at start-up; the launcher puts this file's folder first on ``PYTHONPATH``
in the command's environment, so every Python process of the command runs this first. It must never stop
the process: whatever goes wrong becomes one line on stderr.
"""

import importlib.machinery
import importlib.util
import os
import sys

try:
    import diffusers_cudnn_fix  # noqa: F401 - arms the post-import hook; never initialises CUDA
except KeyboardInterrupt:
    raise
except BaseException as exc:  # noqa: BLE001 - the user's process must start regardless
    sys.stderr.write(
        f"diffusers-cudnn-fix run: diffusers_cudnn_fix is not active in {sys.executable} "
        f"({type(exc).__name__}: {exc}); install it into that interpreter or import it in the script\n"
    )


def _chain() -> None:
    """Run the ``sitecustomize`` this process would have run without the launcher, if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    # Our folder leaves sys.path: it must shadow nothing and show nothing to the program.
    sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module  # as if it had been imported by site itself
    # Errors propagate to site, which reports them exactly as it would have without the launcher.
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # run by site at start-up (never chain when loaded some other way)
    _chain()
