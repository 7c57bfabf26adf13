"""``python -m diffusers_cudnn_fix`` / ``diffusers-cudnn-fix``: the doctor, and the launcher.

The doctor (no command, or ``doctor``) says first what to do next, then shows versions (diffusers, torch,
CUDA, cuDNN, GPU), each fix's state, and on a GPU an error table like the upstream report: the ops "as
shipped" and "corrected", out / dQ / dK / dV max-abs error against fp32, and the reference magnitudes.
The fixes it shows are active in the doctor's own process only: a training run needs
``import diffusers_cudnn_fix`` in its entry point, or to be started through the launcher
(``diffusers-cudnn-fix run -- COMMAND [ARGS...]``, see ``_launcher.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import textwrap
import warnings
from collections.abc import Sequence
from typing import Any, NoReturn

from . import __version__, _launcher, _switches, status
from ._report import TABLE_SAYS, switched_off_by
from ._warnings import DiffusersCudnnFixWarning

EXIT_OK, EXIT_NOT_SAFE, EXIT_NO_DIFFUSERS, EXIT_UNVERIFIED = 0, 1, 2, 3
#: A switch or argument the command line does not take (BSD ``sysexits.h``'s EX_USAGE): kept apart from 2,
#: which says that diffusers cannot be imported.
EXIT_USAGE = 64

PROG = "diffusers-cudnn-fix"

USAGE = f"""{PROG} [doctor] [--json] [--no-gpu] [--require-gpu] [--verbose]
       {PROG} run [--] COMMAND [ARGS...]
       {PROG} verify [--nproc N] [options]   (docs/verify.md; verify --help)
       {PROG} --version"""

DOCTOR_EXIT_STATUSES = f"""\
exit status of the doctor:
  0   nothing to fix here; or everything this diffusers needs is active, and verified on this GPU or there is
      no GPU on this machine to verify it on (the verdict then says "not verified on a GPU: no GPU here")
  1   something needed is not active (switched off, a fix skipped or failing its check), or the GPU probe failed
  2   diffusers (or torch) cannot be imported
  3   everything needed is active, but not verified on a GPU: there is a GPU here and the probe could not run
      on it (or --no-gpu), or --require-gpu was given and there is no GPU here
  {EXIT_USAGE}  usage error: an unknown switch or argument
"""

RUN_EXIT_STATUSES = f"""\
exit status of "run": the command's own (the launcher becomes the command: one ended by a signal ends by that
signal, a shell shows 128 + its number, as if it had been started directly), or
  {_launcher.EXIT_NOT_EXECUTABLE} the command was found but cannot be run
  {_launcher.EXIT_NOT_FOUND} the command is not found
  {EXIT_USAGE}  usage error: no COMMAND, or an unknown switch before "--"
"""

ENVIRONMENT = """\
environment switches (the first value is the default; case-insensitive; all of them: docs/behaviour.md, "Switches"):
  DIFFUSERS_CUDNN_FIX=1|0                      the package on or off; on: 1 on true yes enable enabled,
                                               off: 0 off false no disable disabled
  DIFFUSERS_CUDNN_FIX_SKIP=id,...              fixes to leave alone (still checked and reported)
  DIFFUSERS_CUDNN_FIX_MASK=convert|warn|error  what a bool or wrongly typed mask reaching the cuDNN CP op does
  DIFFUSERS_CUDNN_FIX_PROBE=warn|strict|off    what a failed GPU probe does
"""

DESCRIPTION = """\
The doctor: checks the installed diffusers' context-parallel cuDNN / native-flash attention ops by behaviour,
applies the fixes they need in its own process only, says what to do next (import diffusers_cudnn_fix at the top
of the training entry point, or start it with "run"), and on a GPU verifies the corrected ops against fp32.
"""

RUN_DESCRIPTION = """\
Run COMMAND with diffusers_cudnn_fix active in every Python process it starts (torchrun, accelerate, multiprocessing
workers), without the script importing it: a start-up hook goes first on PYTHONPATH in COMMAND's environment. Not
covered: Python started with -S, -I or -E, and children whose environment drops PYTHONPATH. For example:
  diffusers-cudnn-fix run -- torchrun --nproc-per-node 8 train_dreambooth_flux.py ...
"""

_VERDICTS = {EXIT_OK: "OK", EXIT_NOT_SAFE: "NOT SAFE", EXIT_UNVERIFIED: "OK on the check, not verified on a GPU"}
#: The verdict where everything needed is active and this machine has no GPU to verify it on (exit status 0).
NO_GPU_VERDICT = "OK on the check; not verified on a GPU: no GPU here"

#: What each guard (and a correction that matters only to some runs) matters to, in the words of a training run:
#: the doctor's conditions for removing the package on a release that needs no other correction (a fix not
#: listed here is named by its title, or its ``only_for``).
GUARDED_CASES = {
    "cudnn_bool_mask": "attention masks",
    "ulysses_mask_grad": "attention masks",
    "cudnn_masked_row_grads": "attention masks",
    "cudnn_input_dtypes": "fp32 or mixed-dtype q/k/v",
    "flash_input_alignment": "native flash with one head or token per rank",
    "ring_grad_route": "ring attention from ring degree 3 or with dropout",
}


class _Parser(argparse.ArgumentParser):
    """Plain-text help; a usage error exits 64, as argparse's 2 already means "diffusers cannot be imported"."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _parser(prog: str, usage: str, description: str, epilog: str) -> _Parser:
    formatter = argparse.RawDescriptionHelpFormatter
    return _Parser(prog=prog, usage=usage, description=description, epilog=epilog, formatter_class=formatter)


# ------------------------------------------------------------------------------------------------------------
# What the doctor finds
# ------------------------------------------------------------------------------------------------------------
def _environment() -> dict[str, Any]:
    import torch

    gpu = None
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))})"
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": gpu,
    }


def _shipped_vs_corrected(device: Any) -> list[dict[str, Any]]:
    """Rows "as shipped" and "corrected" for the cuDNN pair on the probe's first case (H == S)."""
    import torch

    from . import _probe, _registry

    module = sys.modules[_registry.MODULE_NAME]
    case, names = _probe.CASES[0], _probe.BACKENDS["cudnn"]
    golden = _probe.reference(case, device, torch.float32)
    variants = {"as shipped": [_registry.original(n) for n in names], "corrected": [getattr(module, n) for n in names]}
    rows = []
    for label, pair in variants.items():
        if None in pair:
            continue
        fwd, bwd = map(_registry.callable_of, pair)
        errors, error = None, None
        try:
            got = _probe.run_pair(fwd, bwd, case, device)
            errors = {n: (got[n] - golden[n]).abs().max().item() for n in _probe.TENSORS}
        except Exception as exc:  # noqa: BLE001 - the shipped ops may raise: that is the finding
            error = f"{type(exc).__name__}: {exc}"
        rows.append({"variant": label, "errors": errors, "error": error})
    magnitudes = {n: golden[n].abs().max().item() for n in _probe.TENSORS}
    return [*rows, {"variant": "reference magnitudes", "errors": magnitudes, "error": None}]


def _needs(fixes: list[dict[str, Any]], live: dict[str, Any]) -> dict[str, Any]:
    """What this diffusers needs, from the check of the shipped code (or, where the package is switched off,
    of the live code, which then is the shipped code)."""
    from .fixes import ALL_FIXES

    by_id = {fix.id: fix for fix in ALL_FIXES}
    not_checked = ("disabled", "unchecked", "pending")
    shipped = {f["id"]: live[f["id"]]["state"] if f["detected"] in not_checked else f["detected"] for f in fixes}
    quiet = {fix_id: state in ("ok", "absent") for fix_id, state in shipped.items()}
    applied = [f["id"] for f in fixes if f["applied"]]
    # A correction that matters only to some runs (only_for) and is found broken does not count here: it is named
    # as the condition. Found in any other state it counts, as in the registry's log.
    conditional = {i for i, state in shipped.items() if by_id[i].only_for and state == "broken"}
    corrections = [i for i in shipped if by_id[i].kind == "correction" and i not in conditional]
    return {
        "shipped_check": shipped,
        "nothing_to_fix": bool(shipped) and not applied and all(quiet.values()),
        "no_gradient_correction_needed": bool(shipped) and all(quiet[i] for i in corrections),
        "active_guards": [i for i in applied if by_id[i].kind == "guard"],
        "needed_only_for": {i: by_id[i].only_for for i in applied if by_id[i].only_for},
        "applied": applied,
    }


def _upstream(shipped_check: dict[str, str]) -> dict[str, dict[str, str]]:
    """Per fix found broken in the shipped code that has an upstream folder (``upstream/<id>/``, in the source
    tree: the wheel does not carry it): its ISSUE.md and what the folder holds."""
    from .fixes import ALL_FIXES

    return {
        fix.id: {"issue": fix.upstream_folder, "holds": fix.upstream_issue}
        for fix in ALL_FIXES
        if fix.upstream_folder is not None and fix.upstream_issue is not None and shipped_check.get(fix.id) == "broken"
    }


def collect(run_gpu: bool = True, require_gpu: bool = False) -> tuple[dict[str, Any], int]:
    """Everything the doctor shows, as data, and the exit status. Where everything needed is active and this
    machine has no GPU, the doctor did all it could: exit status 0, its verdict saying "not verified on a GPU"
    (``require_gpu``: 3, for CI on GPU hosts)."""
    try:
        import diffusers.models.attention_dispatch  # noqa: F401 - fires the hook
        import torch
    except Exception as exc:  # noqa: BLE001
        from .fixes import ALL_FIXES  # plain data: the release table needs no torch

        error = f"cannot import diffusers' attention module: {type(exc).__name__}: {exc}"
        table = [{"id": f.id, "affected": f.affected, "kind": f.kind, "title": f.title} for f in ALL_FIXES]
        found = {"version": __version__, "error": error, "release_table": table}
        return {**found, "exit_status": EXIT_NO_DIFFUSERS}, EXIT_NO_DIFFUSERS

    from . import _probe, _registry

    # What the behavioural check sees now, on the installed objects: per fix, state and evidence.
    checked = _registry.check_live(sys.modules[_registry.MODULE_NAME])
    live = {fix_id: {"state": f.state, "detail": f.detail} for fix_id, f in checked.items()}
    data: dict[str, Any] = {"version": __version__, "environment": _environment(), "check_after_patching": live}
    if run_gpu:
        result = _probe.probe()
        data["probe"] = dataclasses.asdict(result)
        data["probe_table"] = _probe.table(result) if result.cases else None  # no header without rows
        if result.state != "skipped":
            data["shipped_vs_corrected"] = _shipped_vs_corrected(torch.device(result.device))
    report = status()
    if not report.enabled:  # the live objects are the shipped ones: nothing was patched
        data["check_after_patching"] = {}
    data["status"] = report.to_dict()
    data.update(_needs(data["status"]["fixes"], live))
    data["upstream"] = _upstream(data["shipped_check"])
    verified = data["nothing_to_fix"] or "shipped_vs_corrected" in data  # nothing to verify, or verified on a GPU
    no_gpu_here = data["environment"]["gpu"] is None
    code = EXIT_NOT_SAFE if not report.ok else (EXIT_OK if verified else EXIT_UNVERIFIED)
    verdict = _VERDICTS[code]
    if code == EXIT_UNVERIFIED and no_gpu_here and not require_gpu:
        code, verdict = EXIT_OK, NO_GPU_VERDICT
    data["exit_status"], data["verdict"] = code, verdict
    return data, code


# ------------------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------------------
def _wrap(text: str, indent: str = "") -> str:
    """The whole of ``text``, wrapped: nothing the doctor prints is cut."""
    return textwrap.fill(text, width=100, initial_indent=indent, subsequent_indent=indent, break_long_words=False)


def _columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as aligned columns, each as wide as its widest cell, indented by two spaces."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def _outcome(fix: dict[str, Any], kind: str) -> str:
    """The fix table's result cell: a word that says why, or else "NOT FIXED" or the bare check state."""
    if fix["applied"]:
        return "corrected" if kind == "correction" else "guarded"
    if fix["detected"] == "disabled":
        return "NOT ACTIVE (package off)" if fix["needs_attention"] else "package off"
    if fix["reason"].startswith("skipped"):
        return "NOT FIXED (skipped)" if fix["needs_attention"] else "skipped"
    if fix["needs_attention"]:
        return "NOT FIXED"
    return {"ok": "not needed", "absent": "no such code"}.get(fix["detected"], fix["detected"])


_HOW = [
    "  - add `import diffusers_cudnn_fix` at the top of the training entry point (the script every rank",
    "    runs), before or after diffusers; or",
    "  - if you cannot edit it, start the training through the launcher:",
    f"      {PROG} run -- torchrun --nproc-per-node 8 train.py ...",
    f"      {PROG} run -- accelerate launch train.py ...",
]


def _next_step(data: dict[str, Any]) -> list[str]:
    from .fixes import ALL_FIXES

    status, version = data["status"], data["status"]["diffusers_version"]
    needing = [f for f in status["fixes"] if f["needs_attention"]]
    if not status["ok"] and not status["enabled"]:
        switched_off = (
            f"NOT SAFE: the package is switched off ({switched_off_by()}), and diffusers {version} needs "
            f"its fixes ({', '.join(f['id'] for f in needing)}). Unset {_switches.ENABLE_VAR} (or set it to 1) "
            "to turn it on."
        )
        return [_wrap(switched_off)]
    if not status["ok"]:
        failed = [p for p in status["probes"] if p["state"] == "failed"]
        lines = [f"NOT SAFE: diffusers {version} needs fixes that are not active here:"]
        lines += [_wrap(f"{f['id']}: {f['reason']}", "  - ") for f in needing]
        lines += [_wrap(f"the GPU probe failed on {p['device']}: {p['reason']} (table below)", "  - ") for p in failed]
        way_out = "Do not train with this backend under context parallelism here; please report this case."
        if any(f["reason"].startswith("skipped") for f in needing):
            way_out = "Take those ids out of DIFFUSERS_CUDNN_FIX_SKIP, or do not train with this backend under CP."
        return [*lines, way_out]
    if data["nothing_to_fix"]:
        return [
            f"Nothing to fix here: diffusers {version} needs none of this package's fixes. You do not need it;",
            "imported anyway, it changes nothing.",
        ]
    if data["no_gradient_correction_needed"]:
        # What it still guards, and when removing it is safe, first; then how to keep it active everywhere.
        by_id = {fix.id: fix for fix in ALL_FIXES}
        cases = [GUARDED_CASES.get(i, by_id[i].title) for i in data["active_guards"]]
        cases += [GUARDED_CASES.get(i, runs) for i, runs in data["needed_only_for"].items()]
        *most, last = dict.fromkeys(cases) or ["case the table below lists as guarded"]
        uses = f"{', '.join(most)}, or {last}" if most else last
        bug = " has the bool-mask bug (#14342: padded prompts train wrong without the package), so"
        lead = f"diffusers {version}{bug}" if "cudnn_bool_mask" in data["active_guards"] else f"on diffusers {version},"
        still = f"Still guarding here: {lead} removing the package is safe only if your training uses no {uses}."
        needs = "".join(f" except {i}, which matters only to {runs}" for i, runs in data["needed_only_for"].items())
        keep = (
            f"For training that uses none of them it changes nothing: diffusers {version} needs no gradient "
            f"correction{needs}; the guards ({', '.join(data['active_guards'])}) are in the table below. To keep them, "
            "make them active in every process of your training run (the doctor applied them in its own process "
            "only), either way:"
        )
        return [_wrap(still), _wrap(keep), *_HOW]
    return [
        f"NEXT STEP: diffusers {version} needs the fixes below. The doctor applied them in its own process only;",
        "make them active in every process of your training run, either way:",
        *_HOW,
    ]


def _print_human(data: dict[str, Any], verbose: bool = False) -> None:
    if "error" in data:
        print(f"diffusers_cudnn_fix {data['version']} doctor: {data['error']}")
        print("Install diffusers and torch into this interpreter (the one that runs the training), then run the")
        print("doctor again.")
        print("\nThe release table (the releases each fix's bug is known in; the check decides once diffusers runs):")
        listed = [(r["id"], r["affected"], r["kind"]) for r in data["release_table"]]
        print("\n".join(_columns([("fix", "releases", "kind"), *listed])))
        print(f"\nexit status {EXIT_NO_DIFFUSERS}")
        return
    from .fixes import ALL_FIXES

    fixes_by_id = {fix.id: fix for fix in ALL_FIXES}
    status, env = data["status"], data["environment"]
    print("\n".join(_next_step(data)))
    print(
        f"\ndiffusers_cudnn_fix {data['version']}, diffusers {status['diffusers_version']}, torch {env['torch']}, "
        f"Python {env['python']}, CUDA {env['cuda'] or 'none'}, cuDNN {env['cudnn'] or 'none'}, "
        f"GPU {env['gpu'] or 'none'}"
    )
    if not status["enabled"]:
        print(f"diffusers_cudnn_fix is SWITCHED OFF by {switched_off_by()}")

    print("\nfixes (table: the release table lists this release; check: what the check found in the shipped code):")
    rows = [("fix", "table", "check", "applied", "result")]
    for f in status["fixes"]:
        outcome = _outcome(f, fixes_by_id[f["id"]].kind)
        check = data["shipped_check"][f["id"]]
        rows.append((f["id"], TABLE_SAYS[f["expected"]], check, "yes" if f["applied"] else "no", outcome))
    header, *lines = _columns(rows)
    print(header)
    for f, line, (*_, outcome) in zip(status["fixes"], lines, rows[1:], strict=True):
        note = fixes_by_id[f["id"]].note
        print(line)
        print(_wrap(f["title"], "      "))
        if f["applied"] and note is not None:
            print(_wrap(note(), "      "))
        if verbose or outcome in ("NOT FIXED", f["detected"]):  # the result does not say why: the reason does
            print(_wrap(f"why: {f['reason']}", "      "))
        if (upstream := data["upstream"].get(f["id"])) is not None:  # the bug is open: where to fix it upstream
            print(_wrap(f"upstream: {upstream['issue']} in this package's source tree ({upstream['holds']})", "      "))
    for ref in status["stale_references"]:
        print(_wrap(f"still holds a shipped function: {ref}", "  "))

    if verbose and data["check_after_patching"]:
        print("\nbehavioural check on the live (patched) ops:")
        live = data["check_after_patching"]
        width = max(len(i) for i in live)
        for fix_id, finding in live.items():
            print(_wrap(f"{fix_id:<{width}}  {finding['state']:<7} {finding['detail']}", "  "))

    probe = data.get("probe")
    if probe is not None:
        print(f"\nGPU probe: {probe['state']} on {probe['device']} ({probe['reason']})")
        if probe["state"] != "skipped":
            print(data["probe_table"])
    if data.get("shipped_vs_corrected"):
        print("\ncuDNN op pair, bf16 B=2 S=16 H=16 D=64, max-abs error vs fp32 eager:")
        table = [("variant", "out", "dQ", "dK", "dV")]
        for row in data["shipped_vs_corrected"]:
            errors = ["raises", "", "", ""] if row["error"] else [f"{e:.4f}" for e in row["errors"].values()]
            table.append((row["variant"], *errors))
        print("\n".join(_columns(table)))
        for row in data["shipped_vs_corrected"]:
            if row["error"]:
                print(_wrap(f"{row['variant']} raises {row['error']}", "  "))
    if not data["nothing_to_fix"] and status["ok"] and probe is not None and probe["state"] == "skipped":
        print("\nNot verified on a GPU here: the behavioural check above ran (on CPU, no GPU needed), the GPU probe")
        print("could not. It runs by itself on the first CUDA call of a corrected op.")
    print(f"\nverdict: {data['verdict']} (exit status {data['exit_status']})")


# ------------------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------------------
def _run_command(argv: list[str]) -> int:
    """``run [--] COMMAND [ARGS...]``, read by hand: argparse would take COMMAND's own switches for ours."""
    parser = _parser(f"{PROG} run", f"{PROG} run [--] COMMAND [ARGS...]", RUN_DESCRIPTION, RUN_EXIT_STATUSES)
    first = argv[0] if argv else "--"
    if first in ("-h", "--help"):
        parser.print_help()
        return EXIT_OK
    if first != "--" and first.startswith("-"):
        parser.error(f"unknown switch {first!r} (put -- before COMMAND)")
    command = argv[1:] if first == "--" else argv
    if not command:
        parser.error("no COMMAND given")
    return _launcher.run(command)


def main(argv: list[str] | None = None) -> int:
    """The command line: the doctor (no command, or ``doctor``), or ``run -- COMMAND [ARGS...]``."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:
        return _run_command(args_list[1:])
    if args_list[:1] == ["verify"]:  # imported only here: it loads torch and diffusers when it runs
        from . import _verify

        return _verify.main(args_list[1:], _parser)
    parser = _parser(PROG, USAGE, DESCRIPTION, f"{ENVIRONMENT}\n{DOCTOR_EXIT_STATUSES}\n{RUN_EXIT_STATUSES}")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU probe and the error table")
    parser.add_argument("--require-gpu", action="store_true", help="exit 3 unless verified on a GPU (for CI)")
    parser.add_argument("--verbose", "-v", action="store_true", help="show each check's evidence and the live checks")
    args = parser.parse_args(args_list[1:] if args_list[:1] == ["doctor"] else args_list)
    stock = warnings.formatwarning

    def formatwarning(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> str:
        # The doctor is the user's code here: no line of theirs to file the package's warnings at, so one line each.
        if issubclass(category, DiffusersCudnnFixWarning):
            return f"{PROG}: {category.__name__}: {message}\n"
        return stock(message, category, *args, **kwargs)

    warnings.formatwarning = formatwarning
    try:
        data, code = collect(run_gpu=not args.no_gpu, require_gpu=args.require_gpu)
    finally:
        warnings.formatwarning = stock
    try:
        if args.json:
            print(json.dumps(data, default=str))
        else:
            _print_human(data, verbose=args.verbose)
        sys.stdout.flush()
    except BrokenPipeError:  # `diffusers-cudnn-fix | head`: the reader left; no traceback, same status
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python flushes stdout again at exit
    return code


if __name__ == "__main__":
    raise SystemExit(main())
