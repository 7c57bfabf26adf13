"""``diffusers-cudnn-fix verify``: context-parallel gradients of a tiny real transformer against one process.

Each rank builds the same tiny diffusers transformer (``--model``: any transformer of the installed diffusers that
declares a context-parallel plan, from the table in ``_verify_models``; small dims, seeded random weights: nothing
is downloaded), hands it to diffusers' own ``enable_parallelism`` with the user's
``ContextParallelConfig`` and attention backend, runs one forward and backward, and sums the parameter
gradients over the ranks. Rank 0 runs the same model in one process without context parallelism in fp32
(the reference) and in the checked dtype (the noise floor), and compares the output and every parameter
group's gradient. Exit status: 0 all within tolerance, 1 a mismatch, 2 refused or could not run, 64 a usage
error. docs/verify.md says what it checks and how to read the table.

Launch: under torchrun / accelerate (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` in the
environment), or alone with ``--nproc N``, which starts N local ranks itself (a ``file://`` rendezvous, a
deadline, and a rank that fails stops the others).

torch and diffusers are imported only here, inside functions: this module is imported only when the
subcommand runs, never by ``import diffusers_cudnn_fix``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import functools
import importlib
import importlib.util
import inspect
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

from . import probe, revert, status
from ._report import json_text
from ._verify_models import MODELS, Shapes, TinyModel, installed, shapes

EXIT_PASS, EXIT_MISMATCH, EXIT_CANNOT_RUN = 0, 1, 2
#: ``--json``'s ``verdict`` for a PASS that left fixes this diffusers needs unexercised (``not_exercised`` names
#: them): the comparison holds for what the run reached, which is not all the release needs. Exit status 0 all
#: the same; a script that reads only the verdict still tells it from a ``pass`` that exercised every needed fix.
PASS_UNEXERCISED = "pass-unexercised"
#: Backends whose templated forward returns no log-sum-exp, which ring attention merges its steps with: diffusers
#: refuses ring attention on them ("Native attention does not support return_lse=True"; docs/verify.md, "Limits").
NO_RING = {"native": "returns no log-sum-exp, which ring attention merges its steps with (diffusers raises)"}
#: What ``--model list`` names as running ring attention, where no ``--backend`` is given.
RING_BACKENDS = ("_native_cudnn", "_native_flash")
#: What ``_build`` returns: the model, its inputs, one loss target per output, the inputs cast with the model.
Built = tuple[Any, dict[str, Any], tuple[Any, ...], tuple[str, ...]]
#: The row of the parameters the loss does not reach in one process (their true gradient is 0).
UNREACHED = "not reached in one process"

#: Factor over the measured noise floor (PyTorch's fused-attention tests allow 5 x the low-precision
#: reference's error; docs/verify.md, "Tolerance").
FLOOR_FACTOR = 5.0
#: The least tolerance per checked dtype: a group whose noise floor happens to be near 0 must not demand
#: exactness from a run that sums in another order. bf16 / fp16: two units in the last place of the dtype
#: (2 x eps); fp32: no low-precision floor exists (the reference is fp32 itself), so a fixed 1e-4 (about
#: 800 x fp32's eps: reassociation of tiny sums, far below any layout bug's error).
MIN_TOLERANCE = {"bfloat16": 2 * 2**-7, "float16": 2 * 2**-10, "float32": 1e-4}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
#: After the first rank of ``--nproc`` ends with an error, how long the others get to say theirs.
GRACE_S = 10.0
#: The signals on which the ``--nproc`` launcher ends its ranks before it exits.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

DESCRIPTION = """\
Check context-parallel training on this set-up: a tiny real diffusers transformer (random weights, nothing
downloaded) runs one forward and backward under diffusers' own enable_parallelism with your context-parallel
config and attention backend; its output and every parameter gradient (summed over the ranks) are compared
with the same model in one process without context parallelism (fp32). Start it under torchrun / accelerate,
or alone with --nproc N. Rank 0 prints the table.
  diffusers-cudnn-fix verify --nproc 2
  torchrun --nproc-per-node 8 -m diffusers_cudnn_fix verify --ring 2
  diffusers-cudnn-fix verify --model list          (the models this diffusers has; then --model M)
"""

EXIT_STATUSES = """\
exit status of verify:
  0   every group within tolerance: context-parallel gradients match one process on this set-up
  1   a mismatch: the output or some gradients are off (the worst parameters are named)
  2   refused or could not run (the reason is printed: an UnsafeAttentionError, diffusers' own refusal, a rank
      that failed or timed out)
  64  usage error
Under torchrun the exit status is torchrun's (1 for any failed rank): read the verdict line.
"""


# ------------------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------------------
def build_parser(make_parser: Callable[[str, str, str, str], argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """verify's options on the CLI's parser class (usage errors exit 64)."""
    prog = "diffusers-cudnn-fix verify"
    parser = make_parser(prog, f"{prog} [options]", DESCRIPTION, EXIT_STATUSES)
    add = parser.add_argument
    add(
        "--model",
        choices=(*MODELS, "list"),
        default="flux",
        metavar="|".join((*MODELS, "list")),
        help="the tiny transformer (default: flux); list: every model, whether this diffusers has it, what it takes",
    )
    add("--ulysses", type=int, default=None, metavar="U", help="Ulysses degree (default: world size / ring)")
    add("--ring", type=int, default=None, metavar="R", help="ring degree (default: 1)")
    add("--backend", metavar="NAME", help="diffusers attention backend (default: _native_cudnn on CUDA, native on CPU)")
    add("--mask", choices=("none", "padded"), default="none", help="padded prompts through the model's text mask")
    add("--compile", action="store_true", help="torch.compile the parallelised transformer (inductor)")
    add("--checkpointing", action="store_true", help="gradient checkpointing on")
    add("--dtype", choices=tuple(DTYPES), default="bf16", help="dtype of the checked run (default: bf16)")
    add("--seed", type=int, default=0, help="seed of the weights and inputs (default: 0)")
    add("--json", action="store_true", help="rank 0 prints one JSON object instead of the table")
    add("--traceback", action="store_true", help="print the traceback of an error, not only its message")
    add("--without-package", action="store_true", help="every fix off in every rank: the install as shipped")
    add("--nproc", type=int, default=None, metavar="N", help="start N local ranks (not under torchrun)")
    dist_help = (
        "process-group backend (default: nccl on CUDA, gloo on CPU). On GPUs use nccl, one GPU per rank: two gloo "
        "ranks sharing one GPU crashed with SIGSEGV on an H100 and an H200"
    )
    add("--dist-backend", choices=("nccl", "gloo"), default=None, help=dist_help)
    add("--timeout", type=float, default=300.0, metavar="S", help="deadline in seconds (default: 300)")
    # Hidden. --preload: the tests' seam (docs/verify.md, "Tests"), a module imported in each rank after torch and
    # before diffusers (the CPU tests' stand-in kernels); no environment hook runs at that point of a rank.
    # --rendezvous: what the --nproc launcher hands its ranks (and marks them as ranks, not a launcher).
    add("--preload", action="append", default=[], metavar="MODULE", help=argparse.SUPPRESS)
    add("--rendezvous", default=None, help=argparse.SUPPRESS)
    # Hidden too: where the --nproc launcher's ranks leave their results, which the launcher prints once.
    add("--report-dir", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str], make_parser: Callable[[str, str, str, str], argparse.ArgumentParser]) -> int:
    """``verify [options]``: launch N local ranks (``--nproc``), or run as one rank of the world the
    environment describes (torchrun, accelerate; alone: a world of one)."""
    parser = build_parser(make_parser)
    args = parser.parse_args(argv)
    if args.model == "list":
        revert()  # this process only reads diffusers' classes: no checks, nothing patched
        found = model_list(args.backend)
        print(json_text(found) if args.json else render_model_list(found), flush=True)
        return EXIT_PASS
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    launching = args.nproc is not None and args.rendezvous is None
    if launching and "RANK" in os.environ and env_world > 1:
        parser.error("--nproc starts its own ranks: do not combine it with torchrun / accelerate")
    world = args.world_size = args.nproc if launching else env_world
    ring = 1 if args.ring is None else args.ring
    ulysses = max(1, world // max(ring, 1)) if args.ulysses is None else args.ulysses  # what the ring leaves
    if args.mask == "padded" and MODELS[args.model].mask is None:
        masked = [name for name, entry in MODELS.items() if entry.mask is not None]
        which = ", ".join(f"--model {name}" for name in masked)
        parser.error(f"--mask padded needs a model with a text mask: {which} ({args.model} has none)")
    if args.nproc is not None and args.nproc < 2:
        parser.error("--nproc must be at least 2: context parallelism needs 2 or more ranks")
    for name in ("ulysses", "ring"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    if ulysses * ring != world:
        parser.error(f"--ulysses {ulysses} x --ring {ring} = {ulysses * ring} ranks, but the world size is {world}")
    args.ulysses, args.ring, args.dtype = ulysses, ring, DTYPES[args.dtype]
    if launching:
        # Before any rank starts: a misspelt backend is a usage error here, not N ranks failing alike.
        # A diffusers without context parallelism (no model declares a plan): the ranks say so (exit 2).
        states = {name: installed(entry) for name, entry in MODELS.items()}
        if "plan" in states.values():
            problem = model_problem(args.model, states[args.model], _installed_version())
            if problem is not None:
                parser.error(problem)
        fork = _ranks_can_fork()
        problem = _in_a_child(backend_problem, args.backend) if fork else _here(backend_problem, args.backend)
        if problem is not None:
            parser.error(problem)
        return _launch(argv, args, (lambda rank_argv: main(rank_argv, make_parser)) if fork else None)
    return _run_rank(args, parser)


#: What the ranks import first, whichever way they start: forked from the launcher, they find it imported (most of a
#: rank's start: torch._dynamo, which diffusers imports, is half of it).
PRELOAD = ("torch", "torch._dynamo", "torch.distributed")


def _ranks_can_fork() -> bool:
    """Whether the ``--nproc`` launcher can start its ranks by forking itself after importing :data:`PRELOAD` (and
    nothing of diffusers, so that each rank imports diffusers after the package, as a training script does), rather
    than as fresh interpreters: a POSIX system whose ``/proc`` counts this process's threads, one thread (a fork
    copies memory that other threads may be changing), CUDA not initialised. Anything else: fresh interpreters."""
    if not hasattr(os, "fork") or "diffusers" in sys.modules:
        return False
    # numpy's OpenBLAS (torch imports numpy) starts a thread server at import unless told not to; verify's ranks
    # work on tiny tensors, and a launcher with threads could not fork.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    for name in PRELOAD:
        importlib.import_module(name)
    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        return False
    torch = sys.modules["torch"]
    return threads == 1 and not torch.cuda.is_initialized()


def _here(check: Callable[[Any], Any], value: Any) -> Any:
    """``check(value)`` in this process, the package reverted first: it only reads diffusers' registry."""
    revert()
    return check(value)


def _in_a_child(check: Callable[[Any], Any], value: Any) -> Any:
    """``check(value)`` (plain JSON data back) in a forked child that reverts the package and may import diffusers,
    so that this process, which forks the ranks next, has imported neither. None where the child fails."""
    import json

    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the launcher's frames
        code = 1
        try:
            os.close(read)
            with os.fdopen(write, "w") as out:
                out.write(json.dumps(_here(check, value)))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as got:
        text = got.read()
    _, status = os.waitpid(pid, 0)
    return json.loads(text) if status == 0 and text else None


class _ForkedRank:
    """A rank forked by the launcher, as the launcher watches it (``subprocess.Popen``'s ``pid``, ``returncode``,
    ``poll`` and ``wait``: a status, or minus the signal that ended it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return int(self.returncode)


def _start_rank(
    cmd: list[str], env: dict[str, str], run_forked: Callable[[list[str]], Any] | None, mask: Any = None
) -> Any:
    """Start one rank in a session of its own: forked from this launcher (``run_forked`` runs verify's command line,
    ``cmd`` less the interpreter's part, in the child, which ends there, with the signal ``mask`` the launcher had),
    or as ``cmd`` in a fresh interpreter."""
    if run_forked is None:
        return subprocess.Popen(cmd, env=env, start_new_session=True)
    sys.stdout.flush()  # what the launcher buffered must not be written again by the child
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: its own session, the default signal handlers, its rank's environment; never returns
        code = 70  # EX_SOFTWARE: verify's command line returned, which a rank's never does
        try:
            os.setsid()
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
            if mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            os.environ.clear()
            os.environ.update(env)
            run_forked(cmd[cmd.index("verify") + 1 :])
        except SystemExit as exc:  # argparse's, say: its status
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - said on stderr, as a fresh interpreter would
            traceback.print_exc()
        finally:
            os._exit(code)
    return _ForkedRank(pid)


def backend_problem(backend: str | None) -> str | None:
    """Why ``--backend`` names no attention backend of the installed diffusers (listing the valid names), else
    None. Imports diffusers' attention module; its registry is the authority."""
    if backend is None:
        return None
    try:
        from diffusers.models import attention_dispatch
    except Exception:  # noqa: BLE001 - the ranks say why diffusers cannot be imported
        return None
    registry = getattr(attention_dispatch, "_AttentionBackendRegistry", None)
    names = [str(getattr(name, "value", name)) for name in getattr(registry, "_backends", {})]
    if not names or backend in names:
        return None  # a registry this command cannot read: diffusers' own error decides
    parallel = set(getattr(registry, "_supports_context_parallel", ()))
    listed = [n for n in names if n in parallel] or names
    which = "context-parallel backends" if len(listed) < len(names) else "backends"
    return f"--backend {backend!r} is not an attention backend of this diffusers; its {which}: {', '.join(listed)}"


def _installed_version() -> str | None:
    """The version of the diffusers Python would import, read from its ``__init__.py`` (no import)."""
    spec = importlib.util.find_spec("diffusers")
    if spec is None or spec.origin is None:
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            found = re.search(r"^__version__ = [\"']([^\"']+)", f.read(), re.M)
    except OSError:
        return None
    return found.group(1) if found else None


def _state_of_class(diffusers: Any, entry: TinyModel) -> str:
    """``installed``'s answer from the imported class itself (each rank, before it builds the model)."""
    try:
        cls = getattr(diffusers, entry.cls, None)
    except Exception:  # noqa: BLE001 - a class whose module fails to import is not usable here either
        cls = None
    if cls is None:
        return "missing"
    return "plan" if entry.plan and getattr(cls, "_cp_plan", None) is not None else "no plan"


def model_problem(name: str, state: str | None, version: str | None) -> str | None:
    """Why ``--model name`` cannot run on diffusers ``version``, where ``state`` (``_verify_models.installed``) says
    its class is missing or declares no context-parallel plan; else None."""
    entry = MODELS[name]
    if state == "missing":
        return (
            f"--model {name}: diffusers {version} has no {entry.cls} (not in this diffusers; diffusers "
            f"{entry.since} and later have it). Install one of those, or pick a model --model list shows here"
        )
    if state == "no plan" or (state is not None and not entry.plan):
        return (
            f"--model {name}: diffusers {version}'s {entry.cls} declares no context-parallel plan (_cp_plan), so "
            "diffusers' enable_parallelism cannot shard it and there is nothing to verify; --model list shows the "
            "models that declare one"
        )
    return None


def ring_with(backend: str | None, entry_ring: bool | str) -> str:
    """``--model list``'s ring column for a model (``TinyModel.ring``) on ``backend`` (None: the backends verify runs
    by default, said one by one): whether ``--ring`` runs it, and where not, why."""
    if entry_ring is not True:
        return str(entry_ring) if entry_ring else "no"
    if backend is None:
        cannot = "; ".join(f"not {name} (it {why})" for name, why in NO_RING.items())
        return f"with {', '.join(RING_BACKENDS)} (GPUs); {cannot}"
    return f"no: {backend} {NO_RING[backend]}" if backend in NO_RING else f"yes, with {backend}"


def model_list(backend: str | None = None) -> dict[str, Any]:
    """Every model of the table: whether the installed diffusers has its class and the class declares a plan (read
    from diffusers' source, no import), and what verify can run it with (``--mask padded``, ``--ring`` on
    ``backend``: ``--backend``, else each backend verify runs by default)."""
    words = {
        "plan": "yes",
        "no plan": "no context-parallel plan",
        None: "unknown (diffusers not found)",
    }
    rows = []
    for name, entry in MODELS.items():
        state = installed(entry)
        here = words.get(state, f"not in this diffusers (diffusers {entry.since} and later)")
        runs = state == "plan" and entry.plan
        rows.append(
            {
                "model": name,
                "class": entry.cls,
                "since": entry.since,
                "here": here if entry.plan or state != "plan" else words["no plan"],
                "runs": runs,
                "mask": entry.mask if entry.plan else None,
                "ring": ring_with(backend, entry.ring) if entry.plan else "no",
                "note": entry.blocks,
            }
        )
    return {"diffusers": _installed_version(), "backend": backend, "models": rows}


def render_model_list(found: dict[str, Any]) -> str:
    """``--model list`` as a table."""
    ring = f"--ring (backend {found['backend']})" if found["backend"] else "--ring (by backend)"
    cells = [("model", "class", "in this diffusers", "--mask padded (text mask)", ring)]
    for row in found["models"]:
        cells.append((row["model"], row["class"], row["here"], row["mask"] or "no", row["ring"]))
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [
        f"models of diffusers-cudnn-fix verify --model M (diffusers {found['diffusers'] or 'not importable'}); "
        "tiny configs, seeded random weights"
    ]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines += [f"{row['model']}: {row['note']}" for row in found["models"] if row["note"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------
# --nproc: local ranks
# ------------------------------------------------------------------------------------------------------------
def _launch(argv: list[str], args: argparse.Namespace, run_forked: Callable[[list[str]], Any] | None) -> int:
    """Start ``--nproc`` ranks (``python -m diffusers_cudnn_fix verify ...``, forked from this process where
    ``run_forked`` is given: :func:`_ranks_can_fork`), each in a session of its own, and
    wait for them under ``--timeout``; a rank that ends with an error gives the others ``GRACE_S`` to say
    theirs, then they are killed (they would wait in a collective). Rank 0 prints the result; the launcher's
    exit status is rank 0's where every rank finished its part, else 2 (with a line saying why)."""
    nproc, deadline = args.nproc, time.monotonic() + args.timeout
    why: str | None = None  # the launcher's own reason: a deadline or a signal
    first_failed: int | None = None
    procs: list[Any] = []  # subprocess.Popen or _ForkedRank
    signalled: list[int] = []

    def stop(signum: int, frame: object) -> None:
        # SIGTERM / SIGHUP: the ranks run in sessions of their own (no signal to the launcher's group reaches
        # them), so the launcher must end them first. Once: a second signal must not interrupt that.
        if not signalled:
            signalled.append(signum)
            raise KeyboardInterrupt

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        with tempfile.TemporaryDirectory(prefix="dcf-verify-") as tmp:
            # The ranks keep --nproc: --rendezvous tells them they are ranks.
            cmd = [sys.executable, "-m", "diffusers_cudnn_fix", "verify", *argv, "--rendezvous", f"file://{tmp}/rdv"]
            cmd += ["--report-dir", tmp]
            try:  # started inside the ``try``: a signal while starting them ends those already started
                # Forking, the stop signals wait until every rank is started and recorded: a handler run inside
                # os.fork() (in an at-fork callback) has its exception dropped, and the signal with it.
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if run_forked else None
                try:
                    for rank in range(nproc):
                        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc)}
                        env = {**os.environ, **ranks, "LOCAL_WORLD_SIZE": str(nproc)}
                        procs.append(_start_rank(cmd, env, run_forked, mask))
                finally:
                    if mask is not None:
                        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
                while [p.poll() for p in procs].count(None):  # every rank polled each time (any() would stop early)
                    failed = [r for r, p in enumerate(procs) if p.returncode not in (None, EXIT_PASS, EXIT_MISMATCH)]
                    if failed and first_failed is None:
                        first_failed = failed[0]
                        deadline = min(deadline, time.monotonic() + GRACE_S)
                    if time.monotonic() > deadline:
                        why = why or f"timed out after {args.timeout:g} s"
                        break
                    time.sleep(0.1)
            except KeyboardInterrupt:
                why = f"stopped by signal {signalled[0]}" if signalled else "interrupted"
            killed = [r for r, p in enumerate(procs) if p.poll() is None]
            for r in killed:
                try:
                    os.killpg(procs[r].pid, signal.SIGKILL)  # the rank's own session: it and whatever it started
                except ProcessLookupError:  # a rank forked a moment ago, before its own session: the rank itself
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(procs[r].pid, signal.SIGKILL)
            for proc in procs:
                proc.wait()
            reports = [_read_report(tmp, rank) for rank in range(nproc)]
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    codes = [None if r in killed else p.returncode for r, p in enumerate(procs)] + [None] * (nproc - len(procs))
    result = reports[0].get("result")
    if result is not None and all(code == EXIT_PASS for code in codes[1:]):
        print(json_text(result) if args.json else render(result), flush=True)
        return int(result["exit_status"])
    # Could not run: every distinct reason once, the main one (rank 0's, else the first rank's that failed, else
    # the launcher's) on the verdict line, which ends the output as on every run.
    by_text: dict[str, list[int]] = {}
    for r, report in enumerate(reports):
        if report.get("reason"):
            by_text.setdefault(report["reason"], []).append(r)
    reasons = [f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {text}" for text, r in by_text.items()]
    if first_failed is not None and not reports[first_failed]:  # it said nothing: a crash, or a signal
        reasons.append(_rank_ended(first_failed, procs[first_failed].returncode))
    if why is not None:
        reasons.append(why)
    if killed:  # only after a deadline, a failed rank or a signal: the reasons above say which
        reasons.append(f"stopped rank(s) {', '.join(map(str, killed))}, which were still running")
    main_reason, *others = reasons or [f"rank exit statuses {codes}"]
    for other in others:
        print(f"diffusers-cudnn-fix verify: {other}", file=sys.stderr, flush=True)
    _could_not_run(args.json, main_reason, others)
    return EXIT_CANNOT_RUN


def _read_report(folder: str, rank: int) -> dict[str, Any]:
    """What rank ``rank`` left in the launcher's folder ({} if it left nothing: killed, or crashed)."""
    import json

    try:
        with open(os.path.join(folder, f"rank{rank}.json"), encoding="utf-8") as f:
            report: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        return {}
    return report


def _rank_ended(rank: int, status: int | None) -> str:
    """Why a rank stopped, in words: its exit status, or the signal that killed it."""
    if status is None or status >= 0:
        return f"rank {rank} ended with exit status {status}"
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    # Seen on an H200 (torch 2.11): two ranks sharing one GPU over gloo, rank 1 killed by SIGSEGV in the
    # context-parallel step; gloo's collectives on CUDA tensors are the likely cause.
    return (
        f"rank {rank} was killed by {name} (a crash inside the process, not a wrong result); if the ranks "
        "share a GPU over gloo, run one GPU per rank over NCCL instead"
    )


def _could_not_run(as_json: bool, reason: str, others: list[str] | None = None) -> None:
    """The verdict when verify could not run: rank 0's, or the launcher's (``others``: the other ranks' reasons
    where they differ, already said on stderr)."""
    found = {"exit_status": EXIT_CANNOT_RUN, "verdict": "could not run", "reason": reason}
    found["other_reasons"] = others or []
    # One line, whatever the reason holds (a problem message is three): every run's output ends with its verdict.
    text = f"verdict: COULD NOT RUN (exit status {EXIT_CANNOT_RUN}): {' '.join(reason.split())}"
    print(json_text(found) if as_json else text, flush=True)


# ------------------------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------------------------
class CannotRun(Exception):
    """Verify cannot run here; the message says why (exit status 2)."""


class _UsageError(Exception):
    """An option the installed diffusers cannot take (a backend it does not have): exit status 64."""


def _run_rank(args: argparse.Namespace, parser: argparse.ArgumentParser) -> NoReturn:
    """This rank's part; rank 0 prints the result and one short line per phase on stderr (under the ``--nproc``
    launcher each rank leaves its result or its reason to the launcher, which prints them once). Ends through
    ``_exit``, also after an error, so that no process-group teardown can wait on a rank that is gone."""
    rank = args.rank = int(os.environ.get("RANK", "0"))
    started, phase = time.monotonic(), ""
    raised_in: list[tuple[str, BaseException]] = []  # --without-package: the shipped functions an error came through
    needed: tuple[str, ...] = ()

    def enter(step: int, name: str, detail: str = "") -> None:
        nonlocal phase
        phase = name
        if rank == 0:
            took = time.monotonic() - started
            print(f"verify [{step}/6] {name}{detail} ({took:.1f} s)", file=sys.stderr, flush=True)

    try:
        enter(1, "importing torch and diffusers")
        torch, diffusers = _imports(args)
        problem = backend_problem(args.backend) or model_problem(
            args.model, _state_of_class(diffusers, MODELS[args.model]), diffusers.__version__
        )
        if problem is not None:
            raise _UsageError(problem)
        import torch.distributed as dist

        # Launched: the launcher's rendezvous; under torchrun (MASTER_ADDR): env://; alone: a world of one.
        init = args.rendezvous or ("env://" if "MASTER_ADDR" in os.environ else None)
        rendezvous = init.partition(":")[0] if init else "in-process"
        enter(2, "joining the process group", f" ({args.world_size} ranks, {rendezvous} rendezvous)")
        dist.init_process_group(
            args.dist_backend or ("nccl" if args.device != "cpu" else "gloo"),
            init_method=init,
            store=None if init else dist.HashStore(),
            rank=rank,
            world_size=args.world_size,
            timeout=datetime.timedelta(seconds=args.timeout),
        )
        enter(3, "building the model", f": tiny {args.model} (seed {args.seed}) on {args.device}")
        built = _build(torch, diffusers, args)
        low = args.dtype != "float32"
        enter(4, "one-process reference", f": fp32{f' and noise floor ({args.dtype})' if low else ''}")
        if rank == 0:
            ref = _one_process(torch, built, torch.float32)
            floor = _one_process(torch, built, getattr(torch, args.dtype)) if low else None
        dist.barrier()
        stack = [s for s, on in (("compiled", args.compile), ("checkpointing", args.checkpointing)) if on]
        setup = [f"ulysses {args.ulysses} x ring {args.ring}", args.backend, args.dtype.replace("bfloat", "bf")]
        setup += stack + (["mask padded"] if args.mask == "padded" else [])
        enter(5, "context-parallel forward and backward", f": {', '.join(setup)}")
        needed = _needed(diffusers)
        with _accounting(torch, args, needed, raised_in) as reached:
            got = _cp_step(torch, dist, built, args)
        gathered: list[Any] = [None] * args.world_size
        dist.all_gather_object(gathered, sorted(reached))  # what every rank's code ran
        enter(6, "comparing")
        if got is None:  # not rank 0
            _finish(args, EXIT_PASS)
        result = compare(torch, got, ref, floor, args.dtype)
        result["setup"] = _setup(args, diffusers.__version__, torch.__version__)
        result.update(exercise(needed, set().union(*gathered), without_package=args.without_package))
        if result["verdict"] == "pass" and result["not_exercised"]:
            result["verdict"] = PASS_UNEXERCISED
    except BaseException as exc:  # any error is a finding: said once, then exit 2 (64 for a usage error)
        if isinstance(exc, KeyboardInterrupt):
            raise
        if isinstance(exc, _UsageError):
            if rank == 0 and args.report_dir is None:  # the launcher checked it already: it cannot get here
                parser.print_usage(sys.stderr)
                print(f"{parser.prog}: error: {exc}", file=sys.stderr, flush=True)
            _exit(64)
        reason = f"{phase}: {exc if isinstance(exc, CannotRun) else f'{type(exc).__name__}: {exc}'}"
        reason += _bug_met(needed, [target for target, raised in raised_in if raised is exc])
        if args.traceback and not isinstance(exc, CannotRun):
            traceback.print_exc()
        _finish(args, EXIT_CANNOT_RUN, reason=reason)
    _finish(args, result["exit_status"], result=result)


def _finish(args: argparse.Namespace, code: int, *, result: Any = None, reason: str | None = None) -> NoReturn:
    """End this rank with ``code``. Under the ``--nproc`` launcher: leave the result or the reason to it (it prints
    each once). Otherwise rank 0 prints the result, or the verdict with the reason; another rank that failed says
    why on stderr (the rank that meets a problem says it)."""
    if args.report_dir is not None:
        with open(os.path.join(args.report_dir, f"rank{args.rank}.json"), "w", encoding="utf-8") as f:
            f.write(json_text({"exit_status": code, "result": result, "reason": reason}))
    elif result is not None:
        print(json_text(result) if args.json else render(result), flush=True)
    elif reason is not None and args.rank == 0:
        _could_not_run(args.json, reason)
    elif reason is not None:
        print(f"diffusers-cudnn-fix verify: rank {args.rank}: {reason}", file=sys.stderr, flush=True)
    _exit(code)


def _exit(code: int) -> NoReturn:
    """End the process now: its output flushed, no process-group teardown (which can wait on other ranks)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _imports(args: argparse.Namespace) -> tuple[Any, Any]:
    """torch; the package off (``--without-package``) before diffusers; the test seams; diffusers; this rank's
    device and backend."""
    import torch

    if args.without_package:
        revert()  # before diffusers' attention module: the hook patches nothing (after: the shipped objects back)
    for module in args.preload:
        importlib.import_module(module)
    import diffusers
    import diffusers.models.attention_dispatch  # where the package's hook acts

    # diffusers' notes about experimental APIs and deprecated collectives, said once per rank and model copy,
    # would bury the table; errors still show, and so do this package's own warnings.
    diffusers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\.")
    warnings.filterwarnings("ignore", message=r".*_functional_collectives", category=FutureWarning)
    if not hasattr(diffusers.ModelMixin, "enable_parallelism"):
        raise CannotRun(
            f"diffusers {diffusers.__version__} has no context parallelism (no ModelMixin.enable_parallelism): "
            "nothing to verify, and nothing for this package to fix"
        )
    # As diffusers' own mesh does (rank % device count): ranks beyond the GPU count share a GPU (gloo only).
    local_rank = int(os.environ.get("LOCAL_RANK", str(args.rank)))
    args.device = f"cuda:{local_rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    args.backend = args.backend or ("_native_cudnn" if args.device != "cpu" else "native")
    if args.device == "cpu":
        # The tensors are tiny; one thread per core in each of N ranks would oversubscribe the machine.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    else:
        torch.cuda.set_device(torch.device(args.device))
    return torch, diffusers


def _setup(args: argparse.Namespace, diffusers_version: str, torch_version: str) -> dict[str, Any]:
    report = status()
    keys = ("model", "ulysses", "ring", "world_size", "backend", "dtype", "mask", "compile", "checkpointing", "seed")
    return {
        **{key: getattr(args, key) for key in (*keys, "device")},
        "package": "off (--without-package)" if args.without_package else ("on" if report.enabled else "switched off"),
        "package_ok": report.ok,
        "applied": sorted(f.id for f in report.fixes if f.applied),
        "diffusers": diffusers_version,
        "torch": torch_version,
    }


# ------------------------------------------------------------------------------------------------------------
# The model, its inputs and the runs
# ------------------------------------------------------------------------------------------------------------
def _build(torch: Any, diffusers: Any, args: argparse.Namespace) -> Built:
    """The seeded fp32 model of ``--model`` (``_verify_models``) on this rank's device, its inputs (fp32), one loss
    target per output, and the names of the inputs cast to the checked dtype with the model."""
    heads, tokens = shapes(args.ulysses, args.ring)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    entry = MODELS[args.model]
    assert entry.build is not None  # model_problem refused a model without a plan before any rank got here
    model, inputs, targets = entry.build(torch, diffusers, Shapes(heads, tokens, args.mask == "padded"), gen)
    moved = {k: v.to(args.device) if hasattr(v, "to") else v for k, v in inputs.items()}
    return model.to(args.device), moved, tuple(t.to(args.device) for t in targets), entry.cast


def _forward_backward(
    torch: Any, built: Built, dtype: Any, backend: str, parallel: Callable[[Any], Any]
) -> tuple[Any, dict[str, Any]]:
    """A fresh copy of the model in ``dtype`` on attention ``backend`` (``parallel`` readies it and returns what
    to call), one forward on the inputs (the model's ``cast`` ones in ``dtype``), the sum of an MSE loss per output
    against its target, one backward. The output: every output, flattened and joined."""
    model, inputs, targets, cast = built
    model = copy.deepcopy(model).to(dtype)
    model.set_attention_backend(backend)
    inputs = {k: (v.to(dtype) if k in cast and v is not None else v) for k, v in inputs.items()}
    outs = [o for o in parallel(model)(**inputs, return_dict=False) if isinstance(o, torch.Tensor)]
    loss = sum(torch.nn.functional.mse_loss(o.float(), t) for o, t in zip(outs, targets, strict=True))
    loss.backward()
    out = torch.cat([o.detach().float().reshape(-1) for o in outs])
    return model, {"out": out, "loss": loss.item()}


def _one_process(torch: Any, built: Built, dtype: Any) -> dict[str, Any]:
    """The model in one process, no parallel config, on F.scaled_dot_product_attention's math kernel; diffusers'
    default backend where that refuses the model's inputs (0.37.x's 2-D QwenImage mask, which only ``native``
    reads as key padding)."""
    failures = []
    for backend in ("_native_math", "native"):
        try:
            model, run = _forward_backward(torch, built, dtype, backend, lambda model: model)
        except Exception as exc:  # noqa: BLE001 - try the next backend; all failing is a finding (below)
            failures.append(f"{backend}: {type(exc).__name__}: {exc}")
            continue
        grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
        return {**run, "grads": grads, "backend": backend}
    raise CannotRun(f"the one-process reference raised in diffusers itself ({'; '.join(failures)})")


def _cp_step(torch: Any, dist: Any, built: Built, args: argparse.Namespace) -> Any:
    """One forward and backward under diffusers' own context parallelism; rank 0 gets the output and the
    parameter gradients summed over the ranks (diffusers' own gradients are each rank's partial sums)."""
    import diffusers
    from diffusers.models._modeling_parallel import ContextParallelConfig

    def parallelise(model: Any) -> Any:
        try:
            config = ContextParallelConfig(ulysses_degree=args.ulysses, ring_degree=args.ring)
        except ValueError as exc:
            if args.world_size > 1:
                raise
            # A world of one: diffusers runs no context parallelism there, so there is nothing to check.
            raise CannotRun(
                "context parallelism needs at least 2 ranks: diffusers' ContextParallelConfig refuses Ulysses and "
                f"ring degree 1 ({exc}). Start verify with --nproc N (N >= 2), or under torchrun --nproc-per-node N."
            ) from exc
        try:
            model.enable_parallelism(config=config)
        except ZeroDivisionError as exc:
            if getattr(getattr(torch, "accelerator", None), "device_count", lambda: None)() != 0:
                raise
            raise CannotRun(
                f"diffusers {diffusers.__version__}'s enable_parallelism cannot run on a torch without an accelerator:"
                " it computes `rank % torch.accelerator.device_count()`, and this torch counts 0 devices "
                f"(ZeroDivisionError: {exc}). The package corrects it (cp_no_accelerator): run verify with the package "
                "on (not --without-package, nor the fix skipped), on the GPU machine (NCCL), or with diffusers <= 0.41."
            ) from exc
        if args.checkpointing:
            model.enable_gradient_checkpointing()
        return torch.compile(model) if args.compile else model

    try:
        model, run = _forward_backward(torch, built, getattr(torch, args.dtype), args.backend, parallelise)
    except ValueError as exc:
        if args.ring < 2 or "return_lse" not in str(exc):
            raise
        # Recognised by diffusers' own message (seen with ``native`` on 0.38.0 - 0.41.0), not by version.
        raise CannotRun(
            f"diffusers {diffusers.__version__}'s {args.backend} backend cannot run ring attention: each ring step's "
            f"output is merged through its log-sum-exp, which this backend does not return (ValueError: {exc}). "
            f"Check Ulysses with this backend (--ring 1), or ring with a backend that returns one, on GPUs: "
            f"--backend _native_cudnn --ring {args.ring}."
        ) from exc
    except RuntimeError as exc:
        frames = {frame.name for frame in traceback.extract_tb(exc.__traceback__)}
        if "_native_attention_backward_op" not in frames or "does not require grad" not in str(exc):
            raise
        raise CannotRun(
            f"diffusers {diffusers.__version__}'s native backend cannot train under context parallelism: its "
            "_native_attention_backward_op recomputes attention with autograd off and raises "
            f"(RuntimeError: {exc}). Run verify on a GPU (default backend _native_cudnn), or on a CPU with "
            "diffusers >= 0.38, where diffusers fixed it."
        ) from exc
    params = list(model.named_parameters())
    # A parameter this rank's shard does not reach adds 0 to the sum.
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1) for _, p in params])
    dist.reduce(flat, dst=0)
    if args.device != "cpu":
        # NCCL only enqueues the reduce: a rank that ended now could take its part with it and leave rank 0
        # waiting until the process-group timeout.
        torch.cuda.synchronize()
    if args.rank != 0:
        return None
    sizes = [p.numel() for _, p in params]
    run["grads"] = {name: g.view(p.shape) for (name, p), g in zip(params, flat.split(sizes), strict=True)}
    return run


# ------------------------------------------------------------------------------------------------------------
# What the run exercised
# ------------------------------------------------------------------------------------------------------------
def _needed(diffusers: Any) -> tuple[str, ...]:
    """The fix ids the installed diffusers needs: the package's checks of its shipped code (with the package off
    too), summed up as the doctor's advice is."""
    from . import _registry
    from ._advice import decide

    findings = _registry.check_shipped(sys.modules[_registry.MODULE_NAME])
    return decide({fix_id: found.state for fix_id, found in findings.items()}, diffusers.__version__).needed


def _bug_met(needed: tuple[str, ...], targets: list[str]) -> str:
    """For a ``--without-package`` run that raised through diffusers' shipped ``targets`` (innermost first): the
    corrections this diffusers needs whose bug lies in one of them, named as the fix the package makes there
    ("" where none does: then the failure is not one the package corrects)."""
    from .fixes import ALL_FIXES

    met = [
        fix
        for fix in ALL_FIXES
        if fix.id in needed and fix.kind == "correction" and set(fix.bug_in or fix.targets) & set(targets)
    ]
    if not met:
        return ""
    named = "; ".join(f"{fix.id} ({fix.title})" for fix in met)
    return (
        f". This is the bug the package corrects as {named}, met in diffusers' {targets[0]}: run verify without "
        "--without-package to see the corrected run"
    )


@contextlib.contextmanager
def _accounting(
    torch: Any, args: argparse.Namespace, needed: tuple[str, ...], raised_in: list[tuple[str, BaseException]]
) -> Iterator[set[str]]:
    """What the step inside reaches, left in the set it yields once it ends: with the package, the ids of the
    fixes whose policies ran (each policy marks itself, ``_ledger``); ``--without-package``, diffusers' shipped
    functions that carry the needed fixes' bugs (``Fix.bug_in``) and were called, and the fixes whose bug such a
    call meets as far as it can be seen (``Fix.reached_when``), through counting wrappers put in their place for
    the step; an error that comes out of such a function is added to ``raised_in`` with its name."""
    from . import _ledger, _registry
    from .fixes import ALL_FIXES

    module = sys.modules[_registry.MODULE_NAME]
    put_back: list[tuple[str, Any]] = []
    if args.without_package:
        by_target: dict[str, list[Any]] = {}
        for fix in ALL_FIXES:
            for target in (fix.bug_in or fix.targets) if fix.id in needed else ():
                by_target.setdefault(target, []).append(fix)
        for target, fixes in by_target.items():
            stored = _registry.raw_get(module, target)
            if stored is not None:
                _registry.raw_set(module, target, _counting(torch, target, fixes, stored, raised_in))
                put_back.append((target, stored))
    elif args.device != "cpu":
        probe()  # the GPU probe runs the ops on cases of its own: once per device, before the accounting starts
    reached: set[str] = set()
    _ledger.start()
    try:
        yield reached
    finally:
        reached.update(_ledger.stop())
        for target, stored in put_back:
            _registry.raw_set(module, target, stored)


def _counting(
    torch: Any, target: str, fixes: list[Any], stored: Any, raised_in: list[tuple[str, BaseException]]
) -> Any:
    """``stored`` (diffusers' object at ``target``) marking, on each call, ``target`` and the ``fixes`` whose bug
    the call meets: any call, or one with an attention mask (an argument named ``*mask`` that is a tensor). A fix
    whose bug needs what the call does not show (``reached_when="never"``), or only some runs on this release
    (``Fix.only_for``: ring degree 3, say), is never marked: the accounting may say less than the run did, never
    more."""
    from . import _ledger, _registry

    func = _registry.callable_of(stored)
    masks = [(at, name) for at, name in enumerate(inspect.signature(func).parameters) if name.endswith("mask")]
    visible = [fix for fix in fixes if not fix.only_for]
    every_call = [fix.id for fix in visible if fix.reached_when == "call"]
    masked_calls = [fix.id for fix in visible if fix.reached_when == "mask"]

    @functools.wraps(func)
    def counted(*args: Any, **kwargs: Any) -> Any:
        if _ledger.recording:
            _ledger.reached(target)
            masked = any(
                isinstance(kwargs[name] if name in kwargs else args[at] if at < len(args) else None, torch.Tensor)
                for at, name in masks
            )
            for fix_id in every_call + (masked_calls if masked else []):
                _ledger.reached(fix_id)
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            raised_in.append((target, exc))
            raise

    return staticmethod(counted) if isinstance(stored, staticmethod) else counted


def exercise(needed: tuple[str, ...], reached: set[str], *, without_package: bool) -> dict[str, Any]:
    """``needed`` split by whether the run ``reached`` it, with the runs that reach the rest (``reach_them_with``:
    a run -> the fix ids it reaches); ``--without-package``, the shipped functions too, and the fixes whose bug
    the accounting cannot see met without the package (``cannot_tell``: never counted as exercised)."""
    from .fixes import ALL_FIXES

    fixes = [fix for fix in ALL_FIXES if fix.id in needed]
    unseen = [fix.id for fix in fixes if without_package and (fix.reached_when == "never" or fix.only_for)]
    hints: dict[str, list[str]] = {}
    for fix in fixes:
        if fix.id not in reached and fix.id not in unseen:
            hints.setdefault(fix.reached_by, []).append(fix.id)
    found: dict[str, Any] = {
        "needed": [fix.id for fix in fixes],
        "exercised": [fix.id for fix in fixes if fix.id in reached],
        "not_exercised": [fix.id for fix in fixes if fix.id not in reached],
        "reach_them_with": hints,
        "cannot_tell": unseen,
        "functions_reached": None,
        "functions_not_reached": None,
    }
    if without_package:
        targets = list(dict.fromkeys(target for fix in fixes for target in fix.bug_in or fix.targets))
        found["functions_reached"] = [target for target in targets if target in reached]
        found["functions_not_reached"] = [target for target in targets if target not in reached]
    return found


# ------------------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------------------
def group_of(name: str) -> str:
    """The table row of a parameter: its block (``transformer_blocks.0.attn``) or top-level module."""
    parts = name.split(".")[:-1] or [name]
    return ".".join(parts[:3]) if len(parts) >= 2 and parts[1].isdigit() else parts[0]


def rel_error(torch: Any, got: Any, ref: Any) -> float:
    """max|got - ref| / max|ref|; NaN or inf where the reference has none counts as infinitely off."""
    diff = torch.nan_to_num((got.float() - ref.float()).abs(), nan=math.inf, posinf=math.inf).max().item()
    scale = ref.abs().max().item()
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return float(diff / scale)


def compare(torch: Any, got: dict[str, Any], ref: dict[str, Any], floor_run: Any, dtype: str) -> dict[str, Any]:
    """Per row (the output, then each parameter group): relative error against the fp32 reference ``ref``, noise
    floor (``floor_run``'s error; None for fp32), tolerance, verdict; the worst parameters; the exit status.
    Parameters the loss does not reach in the reference (``unreached``) have a true gradient of 0: their own
    row wants exactly 0."""
    unreached = [name for name in got["grads"] if name not in ref["grads"]]
    ref = {**ref, "grads": {**ref["grads"], **{n: torch.zeros_like(got["grads"][n]) for n in unreached}}}

    def error(run: dict[str, Any], names: list[str]) -> float:
        if not names:
            return rel_error(torch, run["out"], ref["out"])
        return rel_error(torch, *(torch.cat([r["grads"][n].reshape(-1) for n in names]) for r in (run, ref)))

    groups: dict[str, list[str]] = {}
    for name in got["grads"]:
        if name not in unreached:
            groups.setdefault(group_of(name), []).append(name)
    rows: list[dict[str, Any]] = []
    per_param: list[dict[str, Any]] = []
    for label, names in [("output", []), *groups.items(), *([(UNREACHED, unreached)] if unreached else [])]:
        err, floor = error(got, names), (None if floor_run is None or label == UNREACHED else error(floor_run, names))
        # fp32 has no low-precision run to measure a floor with: the fixed least tolerance alone. Nor does a
        # floor run that went NaN or inf: an infinite floor would make any error, NaN included, acceptable.
        usable_floor = floor if floor is not None and math.isfinite(floor) else 0.0
        tolerance = 0.0 if label == UNREACHED else max(FLOOR_FACTOR * usable_floor, MIN_TOLERANCE[dtype])
        row = {"group": label, "params": len(names), "error": err, "floor": floor, "tolerance": tolerance}
        rows.append({**row, "ok": math.isfinite(err) and err <= tolerance})
        for name in names:
            e = rel_error(torch, got["grads"][name], ref["grads"][name])
            ratio = e / tolerance if tolerance else (0.0 if e == 0 else math.inf)
            per_param.append({"param": name, "error": e, "tolerance": tolerance, "ratio": ratio})
    ok, loss, ref_loss = all(row["ok"] for row in rows), got["loss"], ref["loss"]
    return {
        "exit_status": EXIT_PASS if ok else EXIT_MISMATCH,
        "verdict": "pass" if ok else "mismatch",
        "rows": rows,
        "worst": sorted(per_param, key=lambda p: -p["ratio"])[:3],
        "loss": {"cp": loss, "reference": ref_loss, "rel_error": abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)},
        "reference_backend": ref["backend"],
        "unreached": unreached,
        "compared_params": len(per_param),
    }


# ------------------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------------------
def _pct(value: float | None) -> str:
    """A relative error in percent, three significant digits (fp32 errors are millionths); "-" for none."""
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{100 * value:.3g}%"


def _exercise_lines(result: dict[str, Any]) -> list[str]:
    """What this release needs and what of it the run reached (:func:`exercise`), in words."""
    if "needed" not in result:
        return []
    if not result["needed"]:
        return ["this diffusers needs none of the package's fixes (its checks of the shipped code)"]
    lines = [f"this diffusers needs: {', '.join(result['needed'])} (the package's checks of the shipped code)"]
    if result["functions_reached"] is None:
        what = "exercised by this run (the package's policies that ran)"
    else:
        what = "reached by this run in diffusers' shipped code (the package off)"
        functions = result["functions_reached"]
        lines.append(f"diffusers' functions of those bugs called by this run: {', '.join(functions) or 'none'}")
    lines.append(f"{what}: {', '.join(result['exercised']) or 'none'}")
    for run, ids in result["reach_them_with"].items():
        lines.append(f"NOT exercised: {', '.join(ids)}; a run that reaches them: {run}")
    if result.get("cannot_tell"):
        unseen = ", ".join(result["cannot_tell"])
        lines.append(
            f"NOT counted with the package off: {unseen} (their bugs need inputs or runs the accounting cannot see; "
            "run with the package to see their policies run)"
        )
    return lines


def render(result: dict[str, Any]) -> str:
    """The table, the worst parameters on a mismatch, and the one-line verdict."""
    s, on = result["setup"], {True: "on", False: "off"}
    tolerance = (
        f"tolerance = max({FLOOR_FACTOR:g} x floor, {_pct(MIN_TOLERANCE[s['dtype']])}), floor = the one-process "
        f"{s['dtype']} run's error"
        if s["dtype"] != "float32"
        else f"tolerance = {_pct(MIN_TOLERANCE['float32'])} (fp32: no lower-precision run to measure a floor)"
    )
    lines = [
        f"diffusers {s['diffusers']}, torch {s['torch']}, {s['device']}; package {s['package']}"
        + (f" (applied: {', '.join(s['applied'])}; what this run exercised: below the table)" if s["applied"] else ""),
        f"tiny {s['model']}, {s['world_size']} ranks: ulysses {s['ulysses']} x ring {s['ring']}, "
        f"backend {s['backend']}, {s['dtype']}, mask {s['mask']}, compile {on[s['compile']]}, "
        f"checkpointing {on[s['checkpointing']]}, seed {s['seed']}",
        f"against one process in fp32 ({result['reference_backend']}); error = max|cp - ref| / max|ref| per group; "
        + tolerance,
        "",
    ]
    cells = [("group", "params", "error", "floor", "tolerance", "verdict")]
    for row in result["rows"]:
        params = "-" if row["group"] == "output" else str(row["params"])
        verdict = "ok" if row["ok"] else "MISMATCH"
        cells.append((row["group"], params, _pct(row["error"]), _pct(row["floor"]), _pct(row["tolerance"]), verdict))
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    loss = result["loss"]
    lines.append(f"\nloss {loss['cp']:.6g} vs {loss['reference']:.6g} ({_pct(loss['rel_error'])} off)")
    if result["unreached"]:
        lines.append(f"{UNREACHED}: {len(result['unreached'])} parameters whose gradient must be exactly 0")
    lines += _exercise_lines(result)
    missed = result.get("not_exercised") or []
    if result["exit_status"] == EXIT_PASS:
        n = result["compared_params"]
        # The PASS covers what the run reached, no more: said where the verdict is read, as --json's verdict does.
        word = "PASS, NOT ALL EXERCISED" if missed else "PASS"
        passed = f"verdict: {word} (exit status 0): output and {n} parameter gradients within tolerance"
        if missed:
            runs = "; ".join(result["reach_them_with"]) or "with the package, to see them run"
            passed += f"; NOT exercised by this run: {', '.join(missed)} (a run that reaches them: {runs})"
        lines.append(passed)
    else:
        named = ", ".join(
            f"{w['param']} {_pct(w['error'])} (tolerance {_pct(w['tolerance'])})" for w in result["worst"]
        )
        lines.append(f"verdict: MISMATCH (exit status 1): worst {named}")
    return "\n".join(lines)
