"""``diffusers-cudnn-fix verify``: context-parallel gradients of a tiny real transformer against one process.

Each rank builds the same tiny diffusers transformer (Flux or QwenImage, small dims, seeded random weights:
nothing is downloaded), hands it to diffusers' own ``enable_parallelism`` with the user's
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
import datetime
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from . import revert, status

EXIT_PASS, EXIT_MISMATCH, EXIT_CANNOT_RUN = 0, 1, 2

#: Factor over the measured noise floor (PyTorch's fused-attention tests allow 5 x the low-precision
#: reference's error; docs/verify.md, "Tolerance").
FLOOR_FACTOR = 5.0
#: The least tolerance per checked dtype: a group whose noise floor happens to be near 0 must not demand
#: exactness from a run that sums in another order. bf16 / fp16: two units in the last place of the dtype
#: (2 x eps); fp32: no low-precision floor exists (the reference is fp32 itself), so a fixed 1e-4 (about
#: 800 x fp32's eps: reassociation of tiny sums, far below any layout bug's error).
MIN_TOLERANCE = {"bfloat16": 2 * 2**-7, "float16": 2 * 2**-10, "float32": 1e-4}
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16", "fp32": "float32"}
MODELS = ("flux", "qwen")
#: The backend the references run on: F.scaled_dot_product_attention restricted to its math kernel.
REFERENCE_BACKEND = "_native_math"
#: diffusers' default backend, the fallback reference where the math one refuses the model's inputs (0.37.x's
#: 2-D QwenImage mask, which only ``native`` reads as key padding).
FALLBACK_REFERENCE_BACKEND = "native"
DEFAULT_TIMEOUT_S = 300.0
#: After the first rank of ``--nproc`` ends with an error, how long the others get to say theirs.
GRACE_S = 10.0
HEAD_DIM = 16
AXES_DIMS_ROPE = (4, 6, 6)  # sums to HEAD_DIM (Flux and QwenImage split the head dim over three RoPE axes)
BATCH = 2
WORST_SHOWN = 3

DESCRIPTION = """\
Check context-parallel training on this set-up: a tiny real diffusers transformer (random weights, nothing
downloaded) runs one forward and backward under diffusers' own enable_parallelism with your context-parallel
config and attention backend; its output and every parameter gradient (summed over the ranks) are compared
with the same model in one process without context parallelism (fp32). Start it under torchrun / accelerate,
or alone with --nproc N. Rank 0 prints the table.
  diffusers-cudnn-fix verify --nproc 2
  torchrun --nproc-per-node 8 -m diffusers_cudnn_fix verify --ring 2
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
    add("--model", choices=MODELS, default="flux", help="the tiny transformer (default: flux)")
    add("--ulysses", type=int, default=None, metavar="U", help="Ulysses degree (default: world size / ring)")
    add("--ring", type=int, default=None, metavar="R", help="ring degree (default: 1)")
    backend_help = "diffusers attention backend (default: _native_cudnn on CUDA, native on CPU)"
    add("--backend", default=None, metavar="NAME", help=backend_help)
    add("--mask", choices=("none", "padded"), default="none", help="padded prompts through the model's mask (qwen)")
    add("--compile", action="store_true", help="torch.compile the parallelised transformer (inductor)")
    add("--checkpointing", action="store_true", help="gradient checkpointing on")
    add("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="dtype of the checked run (default: bf16)")
    add("--seed", type=int, default=0, help="seed of the weights and inputs (default: 0)")
    add("--json", action="store_true", help="rank 0 prints one JSON object instead of the table")
    add("--traceback", action="store_true", help="print the traceback of an error, not only its message")
    add("--without-package", action="store_true", help="every fix off in every rank: the install as shipped")
    add("--nproc", type=int, default=None, metavar="N", help="start N local ranks (not under torchrun)")
    add(
        "--dist-backend",
        choices=("nccl", "gloo"),
        default=None,
        help="process-group backend (default: nccl on CUDA, gloo on CPU; gloo lets ranks share one GPU)",
    )
    add("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S", help="deadline in seconds (default: 300)")
    # Test-only seams (docs/verify.md, "Tests"): a module imported in each rank after torch, before diffusers
    # (the CPU tests' stand-in kernels), and the rendezvous --nproc hands its ranks.
    add("--preload", action="append", default=[], metavar="MODULE", help=argparse.SUPPRESS)
    add("--rendezvous", default=None, help=argparse.SUPPRESS)
    return parser


@dataclass
class Plan:
    """What one rank runs: the parsed options and the launch it is part of."""

    model: str
    ulysses: int
    ring: int
    backend: str
    mask: str
    compile: bool
    checkpointing: bool
    dtype: str
    seed: int
    json: bool
    without_package: bool
    traceback: bool
    timeout: float
    preload: list[str]
    dist_backend: str | None
    rank: int
    world_size: int
    local_rank: int
    init_method: str
    device: str


def _degrees(ulysses: int | None, ring: int | None, world_size: int) -> tuple[int, int]:
    """(Ulysses, ring): the ring degree defaults to 1, the Ulysses degree to what the ranks leave."""
    ring = 1 if ring is None else ring
    if ulysses is None:
        ulysses = max(1, world_size // max(ring, 1))
    return ulysses, ring


def _usage_problem(args: argparse.Namespace, world_size: int) -> str | None:
    """Why these options cannot run on ``world_size`` ranks (a usage error), or None."""
    if args.mask == "padded" and args.model != "qwen":
        return "--mask padded needs a model with a text mask path: --model qwen (Flux has none)"
    if args.nproc is not None and args.nproc < 1:
        return "--nproc must be at least 1"
    if args.timeout <= 0:
        return "--timeout must be positive"
    for name in ("ulysses", "ring"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name} must be at least 1"
    ulysses, ring = _degrees(args.ulysses, args.ring, world_size)
    if ulysses * ring != world_size:
        return f"--ulysses {ulysses} x --ring {ring} = {ulysses * ring} ranks, but the world size is {world_size}"
    return None


# ------------------------------------------------------------------------------------------------------------
# Entry point
# ------------------------------------------------------------------------------------------------------------
def main(argv: list[str], make_parser: Callable[[str, str, str, str], argparse.ArgumentParser]) -> int:
    """``verify [options]``: launch N local ranks (``--nproc``), or run as one rank of the world the
    environment describes (torchrun, accelerate; alone: a world of one)."""
    parser = build_parser(make_parser)
    args = parser.parse_args(argv)
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    launching = args.nproc is not None and args.rendezvous is None
    if launching and "RANK" in os.environ and env_world > 1:
        parser.error("--nproc starts its own ranks: do not combine it with torchrun / accelerate")
    world_size = args.nproc if launching else env_world
    problem = _usage_problem(args, world_size)
    if problem is not None:
        parser.error(problem)
    if launching:
        return launch_local(argv, args.nproc, args.timeout)
    return run_rank(_plan(args, world_size))


def _plan(args: argparse.Namespace, world_size: int) -> Plan:
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    ulysses, ring = _degrees(args.ulysses, args.ring, world_size)
    if args.rendezvous is not None:
        init_method = args.rendezvous
    elif "MASTER_ADDR" in os.environ:
        init_method = "env://"  # torchrun, accelerate, or a multi-node launcher that sets it
    else:
        init_method = f"file://{_scratch()}/rendezvous"  # a world of one: no launcher to say where
    return Plan(
        model=args.model,
        ulysses=ulysses,
        ring=ring,
        backend=args.backend or "",
        mask=args.mask,
        compile=args.compile,
        checkpointing=args.checkpointing,
        dtype=DTYPES[args.dtype],
        seed=args.seed,
        json=args.json,
        without_package=args.without_package,
        traceback=args.traceback,
        timeout=args.timeout,
        preload=list(args.preload),
        dist_backend=args.dist_backend,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        init_method=init_method,
        device="",
    )


# ------------------------------------------------------------------------------------------------------------
# --nproc: local ranks
# ------------------------------------------------------------------------------------------------------------
def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N`` / ``--nproc=N`` (the ranks must not launch again)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def launch_local(argv: list[str], nproc: int, timeout: float) -> int:
    """Start ``nproc`` ranks (``python -m diffusers_cudnn_fix verify ...``), each in a session of its own,
    wait for them under ``timeout``; a rank that ends with an error gives the others ``GRACE_S`` to say
    theirs, then they are killed (they would wait in a collective). Rank 0 prints the result."""
    rank_argv = _without_nproc(argv)
    with tempfile.TemporaryDirectory(prefix="dcf-verify-") as tmp, _stop_on_signals():
        rendezvous = f"file://{os.path.join(tmp, 'rendezvous')}"

        def start(rank: int) -> subprocess.Popen[bytes]:
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
            }
            cmd = [sys.executable, "-m", "diffusers_cudnn_fix", "verify", *rank_argv, "--rendezvous", rendezvous]
            return subprocess.Popen(cmd, env=env, start_new_session=True)

        codes, why = _wait_ranks(start, nproc, timeout)
    return _launch_verdict(codes, why, "--json" in argv)


class _Stopped(Exception):
    """The launcher got SIGTERM or SIGHUP: its ranks must not outlive it (each runs in a session of its own,
    so no signal to the launcher's process group reaches them)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """SIGTERM / SIGHUP raise ``_Stopped`` in the launcher while it waits, so that it ends its ranks first."""

    raised: list[int] = []

    def stop(signum: int, frame: object) -> None:
        if not raised:  # once: a second signal must not interrupt the ending of the ranks
            raised.append(signum)
            raise _Stopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _rank_ended(rank: int, status: int | None) -> str:
    """Why a rank stopped, in words: its exit status, or the signal that killed it."""
    if status is not None and status < 0:
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
    return f"rank {rank} ended with exit status {status}"


def _wait_ranks(
    start: Callable[[int], subprocess.Popen[bytes]], nproc: int, timeout: float
) -> tuple[list[int | None], str | None]:
    """Start the ranks and wait for them; each rank's exit status (None: killed here) and why the others were
    stopped, if they were. Started inside the ``try``: a signal while starting them ends those already started."""
    deadline = time.monotonic() + timeout
    why: str | None = None
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nproc):
            procs.append(start(rank))
        while [p.poll() for p in procs].count(None):  # every rank polled each time (any() would stop early)
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, EXIT_PASS, EXIT_MISMATCH)]
            if failed and why is None:
                why = _rank_ended(failed[0], procs[failed[0]].returncode)
                deadline = min(deadline, time.monotonic() + GRACE_S)
            if time.monotonic() > deadline:
                why = why or f"timed out after {timeout:g} s"
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        why = "interrupted"
    except _Stopped as exc:
        why = f"stopped by signal {exc.signum}"
    killed = [r for r, p in enumerate(procs) if p.poll() is None]
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the rank's own session: it and whatever it started
    for proc in procs:
        proc.wait()
    codes: list[int | None] = [None if r in killed else p.returncode for r, p in enumerate(procs)]
    codes += [None] * (nproc - len(procs))  # never started
    if killed and why is not None:
        why = f"{why}; stopped rank(s) {', '.join(map(str, killed))}"
    return codes, why


def _launch_verdict(codes: list[int | None], why: str | None, as_json: bool) -> int:
    """The launcher's exit status: rank 0's where every rank finished its part, else 2 (with a line saying
    why, and for ``--json`` an object, where rank 0 could not print one)."""
    others_ok = all(code == EXIT_PASS for code in codes[1:])
    if codes[0] in (EXIT_PASS, EXIT_MISMATCH) and others_ok:
        return int(codes[0] or 0)
    reason = why or f"rank exit statuses {codes}"
    if codes[0] not in (EXIT_PASS, EXIT_MISMATCH, EXIT_CANNOT_RUN):  # rank 0 printed no verdict
        verdict = f"verdict: COULD NOT RUN (exit status {EXIT_CANNOT_RUN}): {reason}"
        if as_json:
            print(json.dumps({"exit_status": EXIT_CANNOT_RUN, "verdict": "could not run", "reason": reason}))
        else:
            print(verdict)
    print(f"diffusers-cudnn-fix verify: {reason}", file=sys.stderr)
    return EXIT_CANNOT_RUN


# ------------------------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------------------------
class CannotRun(Exception):
    """Verify cannot run here; the message says why (exit status 2)."""


@dataclass
class Progress:
    """One short line per phase on stderr, from rank 0."""

    rank: int
    phases: int = 6
    done: int = 0
    started: float = field(default_factory=time.monotonic)

    def __call__(self, what: str) -> None:
        self.done += 1
        if self.rank == 0:
            took = time.monotonic() - self.started
            print(f"verify [{self.done}/{self.phases}] {what} ({took:.1f} s)", file=sys.stderr, flush=True)


def run_rank(plan: Plan) -> int:
    """This rank's part; rank 0 prints the result. Exits through ``os._exit`` after an error, so that no
    process-group teardown can wait on a rank that is gone."""
    progress = Progress(plan.rank)
    phase = "starting"
    try:
        phase = "importing torch and diffusers"
        progress(phase)
        torch, diffusers = _imports(plan)
        phase = "joining the process group"
        progress(f"{phase} ({plan.world_size} ranks, {plan.init_method.partition(':')[0]} rendezvous)")
        dist = _join(torch, plan)
        phase = "building the model"
        progress(f"building tiny {plan.model} (seed {plan.seed}) on {plan.device}")
        built = _build(torch, diffusers, plan)
        phase = "one-process reference"
        floor = f" and noise floor ({plan.dtype})" if plan.dtype != "float32" else ""
        progress(f"one-process reference (fp32){floor}" if plan.rank == 0 else phase)
        refs = _references(torch, built, plan) if plan.rank == 0 else None
        dist.barrier()
        phase = "context-parallel forward and backward"
        progress(f"{phase}: {_setup_text(plan)}")
        got = _cp_step(torch, dist, built, plan)
        phase = "comparing"
        progress(phase)
        if plan.rank != 0:
            _exit(EXIT_PASS)
        assert refs is not None and got is not None
        result = compare(torch, got, refs, plan)
    except CannotRun as exc:
        return _fail(plan, phase, str(exc))
    except BaseException as exc:  # any error is a finding: said, then exit 2
        if isinstance(exc, KeyboardInterrupt):
            raise
        reason = f"{type(exc).__name__}: {exc}"
        if plan.traceback:
            traceback.print_exc()
        return _fail(plan, phase, reason)
    result["setup"] = _setup(plan, diffusers.__version__, torch.__version__)
    print(json.dumps(result, default=str) if plan.json else render(result), flush=True)
    _exit(result["exit_status"])
    return int(result["exit_status"])  # not reached: _exit ends the process


_SCRATCH: list[str] = []


def _scratch() -> str:
    """A temporary folder for this process's own rendezvous, removed by ``_exit``."""
    _SCRATCH.append(tempfile.mkdtemp(prefix="dcf-verify-"))
    return _SCRATCH[-1]


def _exit(code: int) -> None:
    """End the process now: its output flushed, no process-group teardown (which can wait on other ranks)."""
    import shutil

    for folder in _SCRATCH:
        shutil.rmtree(folder, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _fail(plan: Plan, phase: str, reason: str) -> int:
    """Say why this rank cannot go on (rank 0 with the verdict), and end it with exit status 2."""
    text = f"{phase}: {reason}"
    print(f"diffusers-cudnn-fix verify: rank {plan.rank}: {text}", file=sys.stderr, flush=True)
    if plan.rank == 0:
        if plan.json:
            print(json.dumps({"exit_status": EXIT_CANNOT_RUN, "verdict": "could not run", "reason": text}))
        else:
            print(f"verdict: COULD NOT RUN (exit status {EXIT_CANNOT_RUN}): {text}")
    _exit(EXIT_CANNOT_RUN)
    return EXIT_CANNOT_RUN


def _imports(plan: Plan) -> tuple[Any, Any]:
    """torch; the package off (``--without-package``) before diffusers; the test seams; diffusers."""
    import torch

    if plan.without_package:
        revert()  # before diffusers' attention module: the hook patches nothing (after: the shipped objects back)
    for module in plan.preload:
        importlib.import_module(module)
    import diffusers
    import diffusers.models.attention_dispatch  # where the package's hook acts

    _quiet_diffusers(diffusers)
    if not hasattr(diffusers.ModelMixin, "enable_parallelism"):
        raise CannotRun(
            f"diffusers {diffusers.__version__} has no context parallelism (no ModelMixin.enable_parallelism): "
            "nothing to verify, and nothing for this package to fix"
        )

    # As diffusers' own mesh does (rank % device count): ranks beyond the GPU count share a GPU (gloo only).
    plan.device = f"cuda:{plan.local_rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    plan.backend = plan.backend or ("_native_cudnn" if plan.device != "cpu" else "native")
    if plan.device == "cpu":
        # The tensors are tiny; one thread per core in each of N ranks would oversubscribe the machine.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.world_size))
    else:
        torch.cuda.set_device(torch.device(plan.device))
    return torch, diffusers


def _quiet_diffusers(diffusers: Any) -> None:
    """diffusers' notes about experimental APIs and deprecated collectives, said once per rank and model
    copy, would bury the table; errors still show, and so do this package's own warnings."""
    import warnings

    diffusers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"diffusers\.")
    warnings.filterwarnings("ignore", message=r".*_functional_collectives", category=FutureWarning)


def _join(torch: Any, plan: Plan) -> Any:
    """The process group diffusers' enable_parallelism needs, under the deadline (NCCL on CUDA, gloo on CPU)."""
    import torch.distributed as dist

    backend = plan.dist_backend or ("nccl" if plan.device != "cpu" else "gloo")
    dist.init_process_group(
        backend,
        init_method=plan.init_method,
        rank=plan.rank,
        world_size=plan.world_size,
        timeout=datetime.timedelta(seconds=plan.timeout),
    )
    return dist


def _setup_text(plan: Plan) -> str:
    stack = [s for s, on in (("compiled", plan.compile), ("checkpointing", plan.checkpointing)) if on]
    parts = [f"ulysses {plan.ulysses} x ring {plan.ring}", plan.backend, plan.dtype.replace("bfloat", "bf")]
    return ", ".join(parts + stack + (["mask padded"] if plan.mask == "padded" else []))


def _setup(plan: Plan, diffusers_version: str, torch_version: str) -> dict[str, Any]:
    report = status()
    package = "off (--without-package)" if plan.without_package else ("on" if report.enabled else "switched off")
    return {
        "model": plan.model,
        "ulysses": plan.ulysses,
        "ring": plan.ring,
        "world_size": plan.world_size,
        "backend": plan.backend,
        "dtype": plan.dtype,
        "mask": plan.mask,
        "compile": plan.compile,
        "checkpointing": plan.checkpointing,
        "seed": plan.seed,
        "device": plan.device,
        "package": package,
        "package_ok": report.ok,
        "applied": sorted(f.id for f in report.fixes if f.applied),
        "diffusers": diffusers_version,
        "torch": torch_version,
    }


# ------------------------------------------------------------------------------------------------------------
# The model and its inputs
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Built:
    """The seeded fp32 model, its inputs (fp32) and the loss target; the input keys cast with the model."""

    model: Any
    inputs: dict[str, Any]
    target: Any
    cast: tuple[str, ...]


def shapes(ulysses: int, ring: int) -> tuple[int, int]:
    """(heads, image tokens = text tokens) for these degrees.

    Each stream's length divides by the world size (diffusers' plans shard image and text apart), and the
    attention op sees as many heads as sequence positions (heads / U == tokens / R): where a layout bug hands
    the op (B, S, H, D) as (B, H, S, D), every shape check passes and the bug shows as wrong numbers, as it
    does on a real model, instead of as a shape error. At least 4 text tokens, so that a padded prompt has
    room for padding.
    """
    world = ulysses * ring
    n = max(1, math.ceil(4 / world))
    return 2 * n * ulysses * ulysses, n * world


def _build(torch: Any, diffusers: Any, plan: Plan) -> Built:
    heads, tokens = shapes(plan.ulysses, plan.ring)
    torch.manual_seed(plan.seed)
    gen = torch.Generator().manual_seed(plan.seed + 1)
    if plan.model == "flux":
        model = diffusers.FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=heads,
            joint_attention_dim=8,
            pooled_projection_dim=8,
            guidance_embeds=False,
            axes_dims_rope=AXES_DIMS_ROPE,
        )
        inputs = {
            "hidden_states": torch.randn(BATCH, tokens, 4, generator=gen),
            "encoder_hidden_states": torch.randn(BATCH, tokens, 8, generator=gen),
            "pooled_projections": torch.randn(BATCH, 8, generator=gen),
            "timestep": torch.tensor([0.5, 0.25]),
            "img_ids": torch.tensor([[0.0, i // 2, i % 2] for i in range(tokens)]),
            "txt_ids": torch.zeros(tokens, 3),
        }
        cast: tuple[str, ...] = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")
    else:
        model = diffusers.QwenImageTransformer2DModel(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=heads,
            joint_attention_dim=8,
            axes_dims_rope=AXES_DIMS_ROPE,
        )
        inputs = {
            "hidden_states": torch.randn(BATCH, tokens, 4, generator=gen),
            "encoder_hidden_states": torch.randn(BATCH, tokens, 8, generator=gen),
            "timestep": torch.tensor([0.5, 0.25]),
            "img_shapes": [[(1, 1, tokens)]] * BATCH,
        }
        if plan.mask == "padded":
            inputs["encoder_hidden_states_mask"] = padded_mask(torch, tokens)
        _qwen_text_lengths(model, inputs, tokens)
        cast = ("hidden_states", "encoder_hidden_states", "timestep")
    target = torch.randn(BATCH, tokens, 4, generator=gen)
    device = torch.device(plan.device)
    moved = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
    return Built(model.to(device), moved, target.to(device), cast)


def padded_mask(torch: Any, tokens: int) -> Any:
    """Right-padded prompts as a tokenizer gives them (int64 1/0): a quarter and a half of the text padded."""
    mask = torch.ones(BATCH, tokens, dtype=torch.int64)
    mask[0, tokens - max(1, tokens // 4) :] = 0
    mask[1, tokens - max(1, tokens // 2) :] = 0
    return mask


def _qwen_text_lengths(model: Any, inputs: dict[str, Any], tokens: int) -> None:
    """0.36.0's QwenImage RoPE needs ``txt_seq_lens`` (later releases derive it from the mask, or take none)."""
    import inspect

    if "max_txt_seq_len" not in inspect.signature(model.pos_embed.forward).parameters:
        inputs["txt_seq_lens"] = [tokens] * BATCH


def _dtype(torch: Any, name: str) -> Any:
    return getattr(torch, name)


def _copy(torch: Any, built: Built, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """A fresh copy of the model and the inputs in ``dtype`` (the model's own stays untouched)."""
    import copy

    model = copy.deepcopy(built.model).to(dtype)
    inputs = {k: (v.to(dtype) if k in built.cast else v) for k, v in built.inputs.items()}
    return model, inputs


def _loss(torch: Any, model: Any, inputs: dict[str, Any], target: Any) -> tuple[Any, Any]:
    out = model(**inputs, return_dict=False)[0]
    return out, torch.nn.functional.mse_loss(out.float(), target)


# ------------------------------------------------------------------------------------------------------------
# The runs
# ------------------------------------------------------------------------------------------------------------
def _one_process(torch: Any, built: Built, dtype: Any) -> dict[str, Any]:
    """The model in one process, no parallel config, on the math backend (else diffusers' default)."""
    failures = []
    for backend in (REFERENCE_BACKEND, FALLBACK_REFERENCE_BACKEND):
        model, inputs = _copy(torch, built, dtype)
        model.set_attention_backend(backend)
        try:
            out, loss = _loss(torch, model, inputs, built.target)
            loss.backward()
        except Exception as exc:  # noqa: BLE001 - try the next backend; all failing is a finding (below)
            failures.append(f"{backend}: {type(exc).__name__}: {exc}")
            continue
        grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
        return {"out": out.detach().float(), "loss": loss.item(), "grads": grads, "backend": backend}
    raise CannotRun(f"the one-process reference raised in diffusers itself ({'; '.join(failures)})")


def _references(torch: Any, built: Built, plan: Plan) -> dict[str, Any]:
    """fp32 (the reference) and, for a low-precision check, the same run in that dtype (the noise floor)."""
    refs = {"fp32": _one_process(torch, built, torch.float32)}
    if plan.dtype != "float32":
        refs["floor"] = _one_process(torch, built, _dtype(torch, plan.dtype))
    return refs


@contextlib.contextmanager
def _no_accelerator_hint(torch: Any, diffusers_version: str) -> Iterator[None]:
    """Turn 0.42.x's ZeroDivisionError on a CPU-only torch into a plain cause (exit 2)."""
    try:
        yield
    except ZeroDivisionError as exc:
        count = getattr(getattr(torch, "accelerator", None), "device_count", lambda: None)()
        if count == 0:
            raise CannotRun(
                f"diffusers {diffusers_version}'s enable_parallelism cannot run on a torch without an accelerator: it "
                "computes `rank % torch.accelerator.device_count()`, and this torch counts 0 devices "
                f"(ZeroDivisionError: {exc}). Run verify on the GPU machine (NCCL), or on a CPU with diffusers <= 0.41."
            ) from exc
        raise


def _cp_step(torch: Any, dist: Any, built: Built, plan: Plan) -> dict[str, Any] | None:
    """One forward and backward under diffusers' own context parallelism; rank 0 gets the output and the
    parameter gradients summed over the ranks (diffusers' own gradients are each rank's partial sums)."""
    import diffusers
    from diffusers.models._modeling_parallel import ContextParallelConfig

    model, inputs = _copy(torch, built, _dtype(torch, plan.dtype))
    model.set_attention_backend(plan.backend)
    try:
        config = ContextParallelConfig(ulysses_degree=plan.ulysses, ring_degree=plan.ring)
    except ValueError as exc:
        if plan.ulysses * plan.ring > 1:
            raise
        # A world of one: diffusers runs no context parallelism there, so there is nothing to check.
        raise CannotRun(
            f"context parallelism needs at least 2 ranks: diffusers' ContextParallelConfig refuses Ulysses and ring "
            f"degree 1 ({exc}). Start verify with --nproc N (N >= 2), or under torchrun --nproc-per-node N."
        ) from exc
    with _no_accelerator_hint(torch, diffusers.__version__):
        model.enable_parallelism(config=config)
    if plan.checkpointing:
        model.enable_gradient_checkpointing()
    forward = torch.compile(model) if plan.compile else model
    out, loss = _loss(torch, forward, inputs, built.target)
    loss.backward()
    params = list(model.named_parameters())
    # A parameter this rank's shard does not reach adds 0 to the sum.
    flat = torch.cat(
        [
            (p.grad.detach().float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)).reshape(-1)
            for _, p in params
        ]
    )
    dist.reduce(flat, dst=0)
    if plan.device != "cpu":
        # NCCL only enqueues the reduce: a rank that ended now could take its part with it and leave rank 0
        # waiting until the process-group timeout.
        torch.cuda.synchronize()
    if plan.rank != 0:
        return None
    grads, offset = {}, 0
    for name, p in params:
        grads[name] = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
    return {"out": out.detach().float(), "loss": loss.item(), "grads": grads}


# ------------------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------------------
def group_of(name: str) -> str:
    """The table row of a parameter: its block (``transformer_blocks.0.attn``) or top-level module."""
    parts = name.split(".")[:-1] or [name]
    if len(parts) >= 2 and parts[1].isdigit():
        return ".".join(parts[:3])
    return parts[0]


def rel_error(torch: Any, got: Any, ref: Any) -> float:
    """max|got - ref| / max|ref|; NaN or inf where the reference has none counts as infinitely off."""
    diff = torch.nan_to_num((got.float() - ref.float()).abs(), nan=math.inf, posinf=math.inf).max().item()
    scale = ref.abs().max().item()
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return float(diff / scale)


def _rows(torch: Any, got: dict[str, Any], refs: dict[str, Any]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Table rows (the output, then each parameter group: its parameter names) and the parameters the loss
    does not reach in the reference (left out)."""
    ref = refs["fp32"]["grads"]
    groups: dict[str, list[str]] = {}
    for name in got["grads"]:
        if name in ref:
            groups.setdefault(group_of(name), []).append(name)
    unreached = [name for name in got["grads"] if name not in ref]
    return [("output", []), *groups.items()], unreached


def compare(torch: Any, got: dict[str, Any], refs: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Per row: relative error, noise floor, tolerance, verdict; the worst parameters; the exit status."""
    ref32, floor_run = refs["fp32"], refs.get("floor")
    least = MIN_TOLERANCE[plan.dtype]

    def flat(tensors: dict[str, Any], names: list[str]) -> Any:
        return torch.cat([tensors[n].reshape(-1) for n in names])

    def versus_fp32(run: dict[str, Any] | None, names: list[str]) -> float | None:
        """``run``'s error on one row (the output where ``names`` is empty)."""
        if run is None:
            return None
        if not names:
            return rel_error(torch, run["out"], ref32["out"])
        return rel_error(torch, flat(run["grads"], names), flat(ref32["grads"], names))

    rows, unreached = _rows(torch, got, refs)
    table: list[dict[str, Any]] = []
    per_param: list[dict[str, Any]] = []
    for label, names in rows:
        error = versus_fp32(got, names)
        assert error is not None
        floor = versus_fp32(floor_run, names)
        # fp32 has no low-precision run to measure a floor with: the fixed least tolerance alone.
        tolerance = max(FLOOR_FACTOR * (floor or 0.0), least)
        table.append(
            {
                "group": label,
                "params": len(names),
                "error": error,
                "floor": floor,
                "tolerance": tolerance,
                "ok": error <= tolerance,
            }
        )
        for name in names:
            err = rel_error(torch, got["grads"][name], ref32["grads"][name])
            per_param.append({"param": name, "error": err, "tolerance": tolerance, "ratio": err / tolerance})
    worst = sorted(per_param, key=lambda p: -p["ratio"])[:WORST_SHOWN]
    loss_error = abs(got["loss"] - ref32["loss"]) / max(abs(ref32["loss"]), 1e-30)
    ok = all(row["ok"] for row in table)
    return {
        "exit_status": EXIT_PASS if ok else EXIT_MISMATCH,
        "verdict": "pass" if ok else "mismatch",
        "rows": table,
        "worst": worst,
        "loss": {"cp": got["loss"], "reference": ref32["loss"], "rel_error": loss_error},
        "reference_backend": ref32["backend"],
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


def render(result: dict[str, Any]) -> str:
    """The table, the worst parameters on a mismatch, and the one-line verdict."""
    s = result["setup"]
    lines = [
        f"diffusers {s['diffusers']}, torch {s['torch']}, {s['device']}; package {s['package']}"
        + (f" (applied: {', '.join(s['applied'])})" if s["applied"] else ""),
        f"tiny {s['model']}, {s['world_size']} ranks: ulysses {s['ulysses']} x ring {s['ring']}, "
        f"backend {s['backend']}, "
        f"{s['dtype']}, mask {s['mask']}, compile {'on' if s['compile'] else 'off'}, "
        f"checkpointing {'on' if s['checkpointing'] else 'off'}, seed {s['seed']}",
        f"against one process in fp32 ({result['reference_backend']}); error = max|cp - ref| / max|ref| per group; "
        + (
            f"tolerance = max({FLOOR_FACTOR:g} x floor, {_pct(MIN_TOLERANCE[s['dtype']])}), floor = the one-process "
            f"{s['dtype']} run's error"
            if s["dtype"] != "float32"
            else f"tolerance = {_pct(MIN_TOLERANCE['float32'])} (fp32: no lower-precision run to measure a floor)"
        ),
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
        lines.append(f"not compared: {len(result['unreached'])} parameters the loss does not reach in one process")
    if result["exit_status"] == EXIT_PASS:
        lines.append(
            f"verdict: PASS (exit status 0): output and {result['compared_params']} parameter gradients "
            "within tolerance"
        )
    else:
        named = ", ".join(
            f"{w['param']} {_pct(w['error'])} (tolerance {_pct(w['tolerance'])})" for w in result["worst"]
        )
        lines.append(f"verdict: MISMATCH (exit status 1): worst {named}")
    return "\n".join(lines)
