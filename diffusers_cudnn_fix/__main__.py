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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

from . import __version__, _launcher, _switches
from ._warnings import DiffusersCudnnFixWarning

EXIT_OK, EXIT_NOT_SAFE, EXIT_NO_DIFFUSERS, EXIT_UNVERIFIED = 0, 1, 2, 3
#: A switch or argument the command line does not take (BSD ``sysexits.h``'s EX_USAGE): kept apart from 2,
#: which says that diffusers cannot be imported.
EXIT_USAGE = 64

PROG = "diffusers-cudnn-fix"
_TENSORS = ("out", "dq", "dk", "dv")  # the probe's (_probe.TENSORS), whose module needs torch

DOCTOR_EXIT_STATUSES = f"""\
exit status of the doctor:
  0   nothing to fix here (this diffusers needs none of the fixes), or everything it needs is
      active in the doctor's process and the GPU probe verified it on this GPU
  1   something this diffusers needs is not active (package switched off, a fix skipped, or
      a replacement that failed its check), or the GPU probe failed
  2   diffusers (or torch) cannot be imported
  3   everything needed is active, but there is no usable GPU here to verify it on
  {EXIT_USAGE}  usage error: an unknown switch or argument
"""

RUN_EXIT_STATUSES = f"""\
exit status of "run":
  the command's own: the launcher becomes the command, so a command ended by a signal ends
  by that signal (a shell shows 128 + its number), as if it had been started directly;
  {_launcher.EXIT_NOT_EXECUTABLE} the command was found but cannot be run
  {_launcher.EXIT_NOT_FOUND} the command is not found
  {EXIT_USAGE}  usage error: no COMMAND, or an unknown switch before "--"
"""

ENVIRONMENT = """\
environment switches (values are case-insensitive):
  DIFFUSERS_CUDNN_FIX=0|1            0 turns the package off (default 1); the same:
                                     off: 0 off false no disable disabled
                                     on:  1 on true yes enable enabled
  DIFFUSERS_CUDNN_FIX_SKIP=id,...    fixes to leave alone (still checked and reported)
  DIFFUSERS_CUDNN_FIX_MASK=convert|warn|error
                                     what a bool or wrongly typed mask reaching the cuDNN
                                     context-parallel op does (default convert)
  DIFFUSERS_CUDNN_FIX_PROBE=warn|strict|off
                                     what a failed GPU probe does (default warn)
"""

DESCRIPTION = """\
The doctor: checks the installed diffusers' context-parallel cuDNN / native-flash attention ops by
behaviour, applies the fixes they need in its own process, says what to do next, and on a GPU
verifies the corrected ops against an fp32 reference.

The fixes are active only in processes that import diffusers_cudnn_fix. Add
"import diffusers_cudnn_fix" at the top of the training entry point, or start the training
through the launcher:
  diffusers-cudnn-fix run -- torchrun --nproc-per-node 8 train.py ...
"""

RUN_DESCRIPTION = """\
Run COMMAND with diffusers_cudnn_fix active in every Python process it starts (torchrun,
accelerate and multiprocessing workers included), without the script importing it. The
launcher puts a start-up hook first on PYTHONPATH in COMMAND's environment and then becomes
COMMAND: exit status and signals pass through. Not covered: Python started with -S, -I or -E,
and children started with an environment that drops PYTHONPATH.

examples:
  diffusers-cudnn-fix run -- torchrun --nproc-per-node 8 train_dreambooth_flux.py ...
  python -m diffusers_cudnn_fix run -- accelerate launch train.py ...
"""


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; 2 already means "diffusers cannot be imported"."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _parser() -> _Parser:
    parser = _Parser(
        prog=PROG,
        usage=f"{PROG} [doctor] [--json] [--no-gpu] [--verbose]\n       {PROG} run [--] COMMAND [ARGS...]"
        f"\n       {PROG} --version",
        description=DESCRIPTION,
        epilog=ENVIRONMENT + "\n" + DOCTOR_EXIT_STATUSES + "\n" + RUN_EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU probe and the error table")
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="also show each check's evidence, and the checks after patching"
    )
    return parser


# ------------------------------------------------------------------------------------------------------------
# What the doctor finds
# ------------------------------------------------------------------------------------------------------------
def _environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "gpu": None,
    }
    if torch.cuda.is_available():
        env["gpu"] = f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))})"
    return env


def _shipped_vs_corrected(device: Any) -> list[dict[str, Any]]:
    """Rows "as shipped" and "corrected" for the cuDNN pair on the probe's first case (H == S)."""
    from . import _probe as probe
    from . import _registry

    module = sys.modules[_registry.MODULE_NAME]
    rows = []
    case = probe.CASES[0]
    golden = probe.reference(case, device, __import__("torch").float32)
    variants = {
        "as shipped": tuple(_registry.original(n) for n in probe.BACKENDS["cudnn"]),
        "corrected": tuple(getattr(module, n) for n in probe.BACKENDS["cudnn"]),
    }
    for label, (fwd, bwd) in variants.items():
        if fwd is None or bwd is None:
            continue
        fwd, bwd = _registry.callable_of(fwd), _registry.callable_of(bwd)
        try:
            got = probe.run_pair(fwd, bwd, case, device)
            errors = {n: (got[n] - golden[n]).abs().max().item() for n in probe.TENSORS}
            rows.append({"variant": label, "errors": errors, "error": None})
        except Exception as exc:  # noqa: BLE001 - the shipped ops may raise: that is the finding
            rows.append({"variant": label, "errors": None, "error": f"{type(exc).__name__}: {exc}"})
    magnitudes = {n: golden[n].abs().max().item() for n in probe.TENSORS}
    return [*rows, {"variant": "reference magnitudes", "errors": magnitudes, "error": None}]


def _needs(report_fixes: list[dict[str, Any]], live: dict[str, Any]) -> dict[str, Any]:
    """What this diffusers needs, from the check of the shipped code (or, where the package is switched off,
    of the live code, which then is the shipped code)."""
    from .fixes import ALL_FIXES

    kinds = {fix.id: fix.kind for fix in ALL_FIXES}
    only_for = {fix.id: fix.only_for for fix in ALL_FIXES if fix.only_for}
    shipped = {}
    for f in report_fixes:
        state = f["detected"]
        if state in ("disabled", "unchecked", "pending") and f["id"] in live:
            state = live[f["id"]]["state"]
        shipped[f["id"]] = state
    applied = [f["id"] for f in report_fixes if f["applied"]]
    quiet = ("ok", "absent")
    return {
        "shipped_check": shipped,
        "nothing_to_fix": bool(shipped) and not applied and all(s in quiet for s in shipped.values()),
        # Corrections that matter only to some runs (only_for) do not count here; they are named as the condition.
        "no_gradient_correction_needed": bool(shipped)
        and all(s in quiet for i, s in shipped.items() if kinds.get(i) == "correction" and i not in only_for),
        "active_guards": [i for i in applied if kinds.get(i) == "guard"],
        "needed_only_for": {i: only_for[i] for i in applied if i in only_for},
        "applied": applied,
    }


def release_table() -> list[dict[str, str]]:
    """Per fix: id, the releases the table lists (a PEP 440 specifier), kind and title (no torch needed)."""
    from .fixes import ALL_FIXES

    return [{"id": f.id, "affected": f.affected, "kind": f.kind, "title": f.title} for f in ALL_FIXES]


def collect(run_gpu: bool = True) -> tuple[dict[str, Any], int]:
    """Everything the doctor shows, as data, and the exit status."""
    try:
        import diffusers.models.attention_dispatch  # noqa: F401 - fires the hook
        import torch  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        error = f"cannot import diffusers' attention module: {type(exc).__name__}: {exc}"
        found = {"version": __version__, "error": error, "release_table": release_table()}
        return {**found, "exit_status": EXIT_NO_DIFFUSERS}, EXIT_NO_DIFFUSERS

    import diffusers_cudnn_fix

    from . import _probe as probe
    from . import _registry

    data: dict[str, Any] = {"version": __version__, "environment": _environment()}
    before = diffusers_cudnn_fix.status()
    # What the behavioural check sees now, on the installed objects: per fix, state and evidence.
    checked = _registry.check_live(sys.modules[_registry.MODULE_NAME])
    live = {fix_id: {"state": f.state, "detail": f.detail} for fix_id, f in checked.items()}
    data["check_after_patching"] = live if before.enabled else {}
    gpu = None
    if run_gpu:
        result = probe.probe()
        data["probe"] = dataclasses.asdict(result)
        data["probe_table"] = probe.table(result) if result.cases else None  # no header without rows
        if result.state != "skipped":
            gpu = result.device
            data["shipped_vs_corrected"] = _shipped_vs_corrected(__import__("torch").device(gpu))
    report = diffusers_cudnn_fix.status()
    data["status"] = report.to_dict()
    data.update(_needs(data["status"]["fixes"], live))
    if not report.ok:
        code = EXIT_NOT_SAFE
    elif data["nothing_to_fix"] or gpu is not None:
        code = EXIT_OK
    else:
        code = EXIT_UNVERIFIED
    data["exit_status"] = code
    return data, code


# ------------------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------------------
def _wrap(text: str, indent: str, width: int = 100) -> str:
    """The whole of ``text``, wrapped: nothing the doctor prints is cut."""
    return textwrap.fill(text, width=width, initial_indent=indent, subsequent_indent=indent, break_long_words=False)


def _columns(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Rows as aligned columns, each as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


#: Outcomes that say all there is to say; any other prints the reason under the title.
_SELF_EXPLAINING = frozenset(
    {"corrected", "guarded", "not needed", "no such code", "package off", "NOT ACTIVE (package off)"}
    | {"skipped", "NOT FIXED (skipped)"}
)


def _outcome(fix: dict[str, Any], kind: str) -> str:
    if fix["applied"]:
        return "corrected" if kind == "correction" else "guarded"
    if fix["detected"] == "disabled":
        return "NOT ACTIVE (package off)" if fix["needs_attention"] else "package off"
    if fix["reason"].startswith("skipped"):
        return "NOT FIXED (skipped)" if fix["needs_attention"] else "skipped"
    if fix["needs_attention"]:
        return "NOT FIXED"
    return {"ok": "not needed", "absent": "no such code"}.get(fix["detected"], fix["detected"])


def _next_step(data: dict[str, Any]) -> list[str]:
    status = data["status"]
    version = status["diffusers_version"]
    if not status["ok"] and not status["enabled"]:
        needed = ", ".join(f["id"] for f in status["fixes"] if f["needs_attention"])
        return [
            _wrap(
                f"NOT SAFE: the package is switched off ({_switched_off_by()}), and diffusers {version} needs "
                f"its fixes ({needed}). Unset {_switches.ENABLE_VAR} (or set it to 1) to turn it on.",
                "",
            )
        ]
    if not status["ok"]:
        lines = [f"NOT SAFE: diffusers {version} needs fixes that are not active here:"]
        for f in status["fixes"]:
            if f["needs_attention"]:
                lines.append(_wrap(f"{f['id']}: {f['reason']}", "  - "))
        for p in status["probes"]:
            if p["state"] == "failed":
                lines.append(_wrap(f"the GPU probe failed on {p['device']}: {p['reason']} (table below)", "  - "))
        if any(f["needs_attention"] and f["reason"].startswith("skipped") for f in status["fixes"]):
            lines.append("Take those ids out of DIFFUSERS_CUDNN_FIX_SKIP, or do not train with this backend under CP.")
        else:
            lines.append("Do not train with this backend under context parallelism here; please report this case.")
        return lines
    if data["nothing_to_fix"]:
        return [
            f"Nothing to fix here: diffusers {version} needs none of this package's fixes. You do not need it;",
            "imported anyway, it changes nothing.",
        ]
    how = [
        "  - add `import diffusers_cudnn_fix` at the top of the training entry point (the script every rank",
        "    runs), before or after diffusers; or",
        "  - if you cannot edit it, start the training through the launcher:",
        f"      {PROG} run -- torchrun --nproc-per-node 8 train.py ...",
        f"      {PROG} run -- accelerate launch train.py ...",
    ]
    if data["no_gradient_correction_needed"]:
        # One decision, not two instructions: remove it, or keep the guards active everywhere.
        guards = ", ".join(data["active_guards"])
        conditional = data.get("needed_only_for", {})
        needs = "".join(f" except {i}, which matters only to {runs}" for i, runs in conditional.items())
        return [
            _wrap(
                f"Can be removed: diffusers {version} needs no gradient correction{needs}. The package only "
                f"guards here ({guards}; what each guards against is in the table below). If your training can "
                "meet none of those cases, remove it. To keep the guards instead, make them active in every "
                "process of your training run (the doctor applied them in its own process only), either way:",
                "",
            ),
            *how,
        ]
    return [
        f"NEXT STEP: diffusers {version} needs the fixes below. The doctor applied them in its own process only;",
        "make them active in every process of your training run, either way:",
        *how,
    ]


def _switched_off_by() -> str:
    """The master switch as the user spelled it (``DIFFUSERS_CUDNN_FIX='OFF'``)."""
    return f"{_switches.ENABLE_VAR}={_switches.raw_enable_value()!r}"


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
    status = data["status"]
    print("\n".join(_next_step(data)))

    env = data["environment"]
    print(
        f"\ndiffusers_cudnn_fix {data['version']}, diffusers {status['diffusers_version']}, torch {env['torch']}, "
        f"Python {env['python']}, CUDA {env['cuda'] or 'none'}, cuDNN {env['cudnn'] or 'none'}, "
        f"GPU {env['gpu'] or 'none'}"
    )
    if not status["enabled"]:
        print(f"diffusers_cudnn_fix is SWITCHED OFF by {_switched_off_by()}")

    print("\nfixes (table: the release table lists this release; check: what the check found in the shipped code):")
    rows = [("fix", "table", "check", "applied", "result")]
    for f in status["fixes"]:
        table = {True: "affected", False: "not affected", None: "unknown"}[f["expected"]]
        kind = fixes_by_id[f["id"]].kind if f["id"] in fixes_by_id else "correction"
        check = data["shipped_check"].get(f["id"], f["detected"])
        rows.append((f["id"], table, check, "yes" if f["applied"] else "no", _outcome(f, kind)))
    lines = _columns(rows)
    print(lines[0])
    for f, line, (*_, outcome) in zip(status["fixes"], lines[1:], rows[1:], strict=True):
        print(line)
        print(_wrap(f["title"], "      "))
        fix = fixes_by_id.get(f["id"])
        if f["applied"] and fix is not None and fix.note is not None:
            print(_wrap(fix.note(), "      "))
        if verbose or outcome not in _SELF_EXPLAINING:
            print(_wrap(f"why: {f['reason']}", "      "))
    for ref in status["stale_references"]:
        print(_wrap(f"still holds a shipped function: {ref}", "  "))

    if verbose and data["check_after_patching"]:
        print("\nbehavioural check on the live (patched) ops:")
        live = data["check_after_patching"]
        width = max(len(i) for i in live)
        for fix_id, finding in live.items():
            print(_wrap(f"{fix_id:<{width}}  {finding['state']:<7} {finding['detail']}", "  "))

    probe_data = data.get("probe")
    if probe_data is not None:
        print(f"\nGPU probe: {probe_data['state']} on {probe_data['device']} ({probe_data['reason']})")
        if probe_data["state"] != "skipped":
            print(data["probe_table"])
    rows_gpu = data.get("shipped_vs_corrected")
    if rows_gpu:
        print("\ncuDNN op pair, bf16 B=2 S=16 H=16 D=64, max-abs error vs fp32 eager:")
        gpu_table = [("variant", "out", "dQ", "dK", "dV")]
        for row in rows_gpu:
            errors = ["raises", "", "", ""] if row["error"] else [f"{row['errors'][t]:.4f}" for t in _TENSORS]
            gpu_table.append((row["variant"], *errors))
        print("\n".join(_columns(gpu_table)))
        for row in rows_gpu:
            if row["error"]:
                print(_wrap(f"{row['variant']} raises {row['error']}", "  "))
    if not data["nothing_to_fix"] and status["ok"] and data.get("probe", {}).get("state") == "skipped":
        print(
            "\n"
            + _wrap(
                "Not verified on a GPU here: the behavioural check above ran (on CPU, no GPU needed), the GPU probe "
                "could not. It runs by itself on the first CUDA call of a corrected op.",
                "",
            )
        )
    verdict = {
        EXIT_OK: "OK",
        EXIT_NOT_SAFE: "NOT SAFE",
        EXIT_UNVERIFIED: "OK on the check, not verified on a GPU",
    }[data["exit_status"]]
    print(f"\nverdict: {verdict} (exit status {data['exit_status']})")


# ------------------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------------------
def _run_command(argv: list[str]) -> int:
    parser = _Parser(
        prog=f"{PROG} run",
        usage=f"{PROG} run [--] COMMAND [ARGS...]",
        description=RUN_DESCRIPTION,
        epilog=RUN_EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if argv[:1] == ["--"]:
        command = argv[1:]
    elif argv[:1] in (["-h"], ["--help"]):
        parser.print_help()
        return EXIT_OK
    elif argv[:1] and argv[0].startswith("-"):
        parser.error(f"unknown switch {argv[0]!r} (put -- before COMMAND)")
    else:
        command = argv
    if not command:
        parser.error("no COMMAND given")
    return _launcher.run(command)


@contextmanager
def _warnings_as_lines() -> Iterator[None]:
    """The package's warnings raised while the doctor works, shown as ``diffusers-cudnn-fix: Category:
    message``: the doctor is the user's code here, so there is no line of theirs to file them at."""
    stock = warnings.formatwarning

    def formatwarning(
        message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
    ) -> str:
        if issubclass(category, DiffusersCudnnFixWarning):
            return f"{PROG}: {category.__name__}: {message}\n"
        return stock(message, category, filename, lineno, line)

    warnings.formatwarning = formatwarning
    try:
        yield
    finally:
        warnings.formatwarning = stock


def main(argv: list[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["run"]:
        return _run_command(args_list[1:])
    if args_list[:1] == ["doctor"]:
        args_list = args_list[1:]
    args = _parser().parse_args(args_list)
    with _warnings_as_lines():
        data, code = collect(run_gpu=not args.no_gpu)
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
