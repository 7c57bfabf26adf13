"""diffusers' context-parallel split hook calls `logger.warning_once`, which diffusers' logger lacks unless
`transformers` was imported.

Standalone: needs torch and diffusers only (and `transformers` not imported: its import gives every logger the
method); runs on a CPU, in one process. `ContextParallelSplitHook._prepare_cp_input` is handed a tensor whose number
of dimensions is not the plan's `expected_dims` (Wan's plan expects a timestep per token, `(B, S)`; a pipeline or a
training script passing one per sample, `(B,)`, meets it): diffusers means to warn and leave the input unsplit.

Exit status: 1 while it raises AttributeError (the bug), 0 once it warns and returns the input, 2 where the bug
cannot be shown (transformers imported).

    python reproduce.py
"""

import logging
import sys

import torch


def main():
    import diffusers
    from diffusers.hooks.context_parallel import ContextParallelSplitHook
    from diffusers.models._modeling_parallel import ContextParallelInput

    print(f"diffusers {diffusers.__version__}, torch {torch.__version__}, a 1-D tensor for an input planned 2-D")
    if hasattr(logging.Logger, "warning_once"):
        print("could not run: transformers is imported (it gives logging.Logger warning_once)")
        return 2
    hook = ContextParallelSplitHook({}, None)
    x = torch.zeros(2)
    try:
        out = hook._prepare_cp_input(x, ContextParallelInput(split_dim=1, expected_dims=2))
    except AttributeError as exc:
        print(f"BUG: {type(exc).__name__}: {exc}")
        return 1
    if out is not x:
        print(f"BUG: the input came back changed: {out!r}")
        return 1
    print("ok: warned and left the input unsplit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
