"""Real diffusers releases for the tests, each installed into its own folder, and fresh-subprocess runs.

Every release goes to ``.cache/diffusers/<version>`` with ``pip install --no-deps --target`` (their shared
dependencies come from the ``test`` extra), so one test session can run each release in its own
interpreter: ``run(version, script)`` starts ``python`` with that folder first on ``PYTHONPATH``.

``run(..., preloaded=True)`` forks the interpreter instead from one that has imported torch and nothing else of
ours (``PRELOAD``; one per pytest process, started on first use): importing torch and ``torch._dynamo``
(which diffusers pulls in) is most of a fresh interpreter's start, and the suite starts over a hundred. The
fork has imported neither diffusers nor this package, so the import order between them, the package's
environment switches and the release on the path are as in a fresh interpreter; what it cannot show is
anything about torch's own import (CUDA initialisation, threads, torch's environment variables): tests of
those run fresh (the default). It forks only while it has one thread (``OPENBLAS_NUM_THREADS=1`` there: numpy's
OpenBLAS would start a thread server), and refuses to start otherwise (``tests/test_releases_harness.py``).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
CACHE = ROOT / ".cache" / "diffusers"

#: Every release the package knows of, oldest first (0.35.2 predates the ops; 0.40.0+ ship them fixed).
RELEASES = ("0.35.2", "0.36.0", "0.37.0", "0.37.1", "0.38.0", "0.39.0", "0.40.0", "0.41.0", "0.42.0", "0.42.1")
#: Releases whose cuDNN context-parallel ops are broken as shipped.
BROKEN_CUDNN = ("0.36.0", "0.37.0", "0.37.1", "0.38.0", "0.39.0")
#: Releases whose native-flash context-parallel backward is broken as shipped.
BROKEN_FLASH = ("0.37.0", "0.37.1", "0.38.0", "0.39.0")
#: Every release with the context-parallel ops (all but 0.35.2): what most fixes' ``CARRIES`` start from.
WITH_OPS = frozenset(RELEASES) - {"0.35.2"}

#: What diffusers users install beside it (its training examples need them), at versions that install beside every
#: release above (transformers 5.24 is the newest that takes the huggingface-hub < 2 of diffusers 0.36 - 0.41). They
#: go into a folder of their own (``user_stack_dir``), which ``run(..., stack=True)`` puts on the path: the tests that
#: ask for it run in the environment users have, the others in one without them (some users have that too).
USER_STACK = ("transformers==5.24.0", "accelerate==1.16.0", "peft==0.22.0")
USER_STACK_DIR = ROOT / ".cache" / "user-stack"
#: The stack's modules, as a training script imports them (``run(..., stack=True, preloaded=True)`` forks from an
#: interpreter that imported them).
STACK_MODULES = ("accelerate", "peft", "transformers")


def release_dir(version: str) -> Path:
    """The folder holding diffusers ``version`` (installed on first use)."""
    target = CACHE / version
    if (target / "diffusers" / "__init__.py").exists():
        return target
    partial = CACHE / f".{version}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    # Where interpreters may not write bytecode (PYTHONDONTWRITEBYTECODE, as on the CI machines), pip compiles it
    # here, once: the suite starts hundreds of interpreters that import diffusers, and each would otherwise compile
    # it again. Where they may (.ci/run: into PYTHONPYCACHEPREFIX), the first import compiles only what is used.
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(partial)]
    if not sys.dont_write_bytecode:
        cmd.append("--no-compile")
    wheels = os.environ.get("DIFFUSERS_WHEELS")  # a folder of wheels, for machines without an index
    if wheels:
        cmd += ["--no-index", "--find-links", wheels]
    subprocess.run([*cmd, f"diffusers=={version}"], check=True)
    partial.rename(target)
    return target


def user_stack_dir() -> Path:
    """The folder holding ``USER_STACK`` and what it needs that this environment lacks (installed on first use).

    pip resolves the stack against this environment (``--dry-run --report``: torch and what the test extra brings
    are taken as they are, never a second torch), then installs exactly what it would add into the folder.
    """
    marker = USER_STACK_DIR / "installed.txt"
    if marker.exists() and marker.read_text().split("\n", 1)[0] == " ".join(USER_STACK):
        return USER_STACK_DIR
    partial = USER_STACK_DIR.with_name(".user-stack.partial")
    shutil.rmtree(partial, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "install", "-q"]
    wheels = os.environ.get("DIFFUSERS_WHEELS")
    if wheels:
        pip += ["--no-index", "--find-links", wheels]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        subprocess.run([*pip, "--dry-run", "--report", str(report), *USER_STACK, "huggingface-hub<2"], check=True)
        items = json.loads(report.read_text())["install"]
    wanted = [f"{i['metadata']['name']}=={i['metadata']['version']}" for i in items]
    # The stack goes beside the torch this environment has, never a torch of its own (gigabytes, and another one).
    if any(w.lower().startswith(("torch==", "nvidia-", "triton==")) for w in wanted):
        raise RuntimeError(f"the user stack would install {wanted} here: install the test extra (torch) first")
    cmd = [*pip, "--no-deps", "--target", str(partial), *wanted]
    if not sys.dont_write_bytecode:
        cmd.append("--no-compile")
    subprocess.run(cmd, check=True)
    (partial / "installed.txt").write_text("\n".join([" ".join(USER_STACK), *wanted]) + "\n")
    shutil.rmtree(USER_STACK_DIR, ignore_errors=True)
    partial.rename(USER_STACK_DIR)
    return USER_STACK_DIR


def relabelled_copy(source_version: str, label: str) -> Path:
    """A copy of release ``source_version`` whose version string says ``label`` (a mislabelled build)."""
    target = CACHE / f"relabelled-{source_version}-as-{label}"
    if (target / "diffusers" / "__init__.py").exists():
        return target
    partial = CACHE / f".relabelled-{source_version}-as-{label}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(release_dir(source_version), partial)
    init = partial / "diffusers" / "__init__.py"
    text = init.read_text()
    old = f'__version__ = "{source_version}"'
    assert old in text, f"cannot find {old!r} in {init}"
    init.write_text(text.replace(old, f'__version__ = "{label}"', 1))
    for info in partial.glob("diffusers-*.dist-info"):
        meta = info / "METADATA"
        meta.write_text(meta.read_text().replace(f"Version: {source_version}", f"Version: {label}", 1))
        info.rename(partial / f"diffusers-{label}.dist-info")
    partial.rename(target)
    return target


def run_raw(
    site: Path | None,
    script: str,
    *,
    env: dict[str, str | None] | None = None,
    timeout: float = 300,
    preloaded: bool = False,
    stack: bool = False,
) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``script`` in a fresh interpreter with ``site`` (a release folder) first on
    the path; ``stack``: the packages users install beside diffusers (``USER_STACK``) next. ``env``: variables to
    set, or to remove where the value is None. ``preloaded``: fork it from an interpreter that has imported torch
    (see the module's docstring); the same path, environment, working directory and warning filters."""
    paths = [str(site)] if site is not None else []
    paths += [str(user_stack_dir())] if stack else []
    paths += [str(ROOT), str(TESTS)]
    full_env = {**os.environ, **{k: v for k, v in (env or {}).items() if v is not None}}
    for name in [k for k, v in (env or {}).items() if v is None]:
        full_env.pop(name, None)
    full_env["PYTHONPATH"] = os.pathsep.join([*paths, full_env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    full_env.setdefault("PYTHONWARNINGS", "default")
    if preloaded:
        returncode, stdout, stderr = _zygote(stack).run(script, full_env, paths, timeout)
    else:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout,
            cwd=str(ROOT),
        )
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    return returncode, stdout, stderr


def run(
    site: Path | None,
    script: str,
    *,
    env: dict[str, str | None] | None = None,
    timeout: float = 300,
    preloaded: bool = False,
    stack: bool = False,
) -> dict:
    """``run_raw``, for a script that prints one JSON object as its last line of stdout: that object (with the
    script's stderr as ``_stderr``). A non-zero exit fails with the script's output."""
    returncode, stdout, stderr = run_raw(site, script, env=env, timeout=timeout, preloaded=preloaded, stack=stack)
    if returncode != 0:
        raise AssertionError(f"subprocess failed ({returncode}):\n{stdout}\n{stderr}")
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise AssertionError(f"subprocess printed nothing:\n{stderr}")
    result = json.loads(lines[-1])
    result["_stderr"] = stderr
    return result


def keep(name: str, result: dict) -> None:
    """Write ``result`` as ``name`` (JSON) into the folder ``DIFFUSERS_CUDNN_FIX_RESULTS`` names, if any: the GPU
    tests' raw results, which the GPU session brings back."""
    folder = os.environ.get("DIFFUSERS_CUDNN_FIX_RESULTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        Path(folder, name).write_text(json.dumps(result, indent=1, default=str))


_FIX_STATES = (
    "import json, diffusers_cudnn_fix{first}, diffusers.models.attention_dispatch\n"
    "print(json.dumps({{f.id: [f.detected, f.applied, f.reason_code] for f in diffusers_cudnn_fix.status().fixes}}))\n"
)


@functools.cache
def fix_states(version: str, *, models_first: bool = False) -> dict[str, list]:
    """Each fix's ``[detected, applied, reason_code]`` (``status()``) once diffusers ``version``'s attention module
    is imported with the package, in a fresh interpreter; cached per process (tests/fixes/ read it per fix).
    ``models_first``: diffusers' ``ModelMixin`` module imported before the attention module, as a model's import
    may (the model fixes' checks read both)."""
    first = ", diffusers.models.modeling_utils" if models_first else ""
    result = run(release_dir(version), _FIX_STATES.format(first=first), preloaded=True)
    return {fix: states for fix, states in result.items() if fix != "_stderr"}


#: What the preloaded interpreter imports before it forks: torch, and what diffusers imports of it that costs
#: most (``torch._dynamo``, through ``torch.compiler``). No diffusers, no package, no test module.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed")
#: Its environment's differences from the test process's: warnings as ``run`` sets them for every script (a request
#: asking for others gets the filters a fresh interpreter importing the same would have: what the imports add, its
#: ``PYTHONWARNINGS``, the interpreter's defaults); nothing of ours on the path; and no OpenBLAS
#: thread server (numpy, which torch imports, starts one): a process that forks must have one thread, since the
#: child gets a copy of memory that other threads may be changing (CI once saw a forked search die in malloc).
_ZYGOTE_ENV = {"PYTHONWARNINGS": "default", "PYTHONPATH": "", "OPENBLAS_NUM_THREADS": "1"}

#: The preloaded interpreter: reads one request per line (JSON) on stdin, answers with a line once it forked.
#: Each request is run in a grandchild: the child waits for it and writes its exit status to a file, which is
#: how the requester learns it (the requester is not the grandchild's parent), then exits. Every process is
#: waited for by its parent (the interpreter reaps its children between requests and all of them at the end
#: of its input, and ``close_preloaded`` waits for the interpreter), so their CPU time counts in the test
#: process's (``/usr/bin/time``, ``resource.getrusage``).
_ZYGOTE = r"""
import importlib, json, os, sys, warnings
# The interpreter's own filters, under the ones its PYTHONWARNINGS put in front (the warnings module at start-up).
DEFAULT_FILTERS = warnings.filters[len(sys.warnoptions):]
before = len(warnings.filters)
for name in sys.argv[1:]:
    importlib.import_module(name)
# What the imports put in front (torch's, sympy's, numpy's own filters): a fresh interpreter has them in front too.
IMPORTED_FILTERS = warnings.filters[: len(warnings.filters) - before]
threads = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["main"]
if len(threads) != 1:  # forking now would copy memory other threads are changing: refuse, loudly
    sys.exit(f"the preloaded interpreter has {len(threads)} threads after importing {sys.argv[1:]}; it forks with one")
def reap(block):
    while True:
        try:
            if os.waitpid(-1, 0 if block else os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return
print("ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if os.fork() == 0:  # the child: run the script in a grandchild, record its exit status
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # its own process group: a timeout ends the script and whatever it started
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            sys.stdout = open(1, "w", buffering=1, encoding="utf-8", closefd=False)
            sys.stderr = open(2, "w", buffering=1, encoding="utf-8", closefd=False)
            sys.stdin = open(0, encoding="utf-8", closefd=False)
            os.environ.clear()
            os.environ.update(req["env"])
            options = [o for o in req["env"].get("PYTHONWARNINGS", "").split(",") if o]
            if options != sys.warnoptions:  # what a fresh interpreter importing the same would have
                sys.warnoptions[:] = options
                warnings.filters[:] = DEFAULT_FILTERS
                warnings._processoptions(options)  # in front, an option equal to a default one moved there
                warnings.filters[:] = IMPORTED_FILTERS + warnings.filters
                warnings._filters_mutated()
            os.chdir(req["cwd"])
            sys.path[1:1] = req["paths"]
            sys.argv = ["-c"]
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            code = 0
            try:
                exec(compile(req["script"], "<string>", "exec"), main.__dict__)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                if not isinstance(exc.code, (int, type(None))):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            try:
                import atexit
                atexit._run_exitfuncs()
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
        try:
            with open(req["status"] + ".pid", "w") as f:
                f.write(str(pid))
            _, status = os.waitpid(pid, 0)
            with open(req["status"] + ".tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.rename(req["status"] + ".tmp", req["status"])
        except OSError:
            pass  # the requester gave up on it (a timeout) and removed its folder
        os._exit(0)
    print("forked", flush=True)
    reap(block=False)
reap(block=True)
# torch < 2.6 makes a folder at the import of torch.distributed.nn.jit.instantiator (torch._dynamo imports it) and
# leaves it to its finalizer, which says "ResourceWarning: Implicitly cleaning up" at exit: remove it here.
folder = getattr(sys.modules.get("torch.distributed.nn.jit.instantiator"), "_TEMP_DIR", None)
if folder is not None:
    folder.cleanup()
"""


class _Zygote:
    """A preloaded interpreter of this process (``_zygote(stack)``): ``PRELOAD``, and with ``stack`` the user stack
    (``USER_STACK``) too, imported as a training script imports it, before diffusers."""

    def __init__(self, stack: bool = False) -> None:
        env = {**os.environ, **_ZYGOTE_ENV}
        if stack:
            env["PYTHONPATH"] = str(user_stack_dir())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, *PRELOAD, *(STACK_MODULES if stack else ())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(ROOT),
        )
        self.lock = threading.Lock()
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n", "the zygote failed"

    def run(self, script: str, env: dict[str, str], paths: list[str], timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) of ``script`` run in a fork; a timeout kills its process group."""
        with tempfile.TemporaryDirectory(prefix="releases-run-") as scratch:
            files = {name: os.path.join(scratch, name) for name in ("stdout", "stderr", "status")}
            request = {"script": script, "env": env, "paths": paths, "cwd": str(ROOT), **files}
            with self.lock:
                assert self.proc.stdin is not None and self.proc.stdout is not None
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                assert self.proc.stdout.readline() == "forked\n", "the zygote died"
            deadline = time.monotonic() + timeout
            while not os.path.exists(files["status"]):
                if time.monotonic() > deadline:
                    self._kill(files["status"] + ".pid")
                    raise subprocess.TimeoutExpired(["<preloaded>", "-c", script], timeout)
                time.sleep(0.05)
            with open(files["status"]) as f:
                code = int(f.read())
            with open(files["stdout"], encoding="utf-8", errors="replace") as out:
                stdout = out.read()
            with open(files["stderr"], encoding="utf-8", errors="replace") as err:
                stderr = err.read()
        return code, stdout, stderr

    @staticmethod
    def _kill(pid_file: str) -> None:
        """End the timed-out script's process group (the script and what it started)."""
        try:
            with open(pid_file) as f:
                os.killpg(int(f.read()), signal.SIGKILL)
        except (OSError, ValueError):
            pass


_zygotes: dict[tuple[int, bool], _Zygote] = {}
_zygote_lock = threading.Lock()


def close_preloaded() -> None:
    """End this process's preloaded interpreters (each ends once its runs have) and wait for them (conftest.py
    calls this at the end of the session; also at exit)."""
    with _zygote_lock:
        mine = [_zygotes.pop(key) for key in list(_zygotes) if key[0] == os.getpid()]
    for zygote in mine:
        assert zygote.proc.stdin is not None
        zygote.proc.stdin.close()
        try:
            zygote.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            zygote.proc.kill()
            zygote.proc.wait()


atexit.register(close_preloaded)


def _zygote(stack: bool = False) -> _Zygote:
    """This process's preloaded interpreter (with the user stack imported, or not), started on first use (one of
    each per pytest-xdist worker)."""
    with _zygote_lock:
        key = (os.getpid(), stack)
        if key not in _zygotes:
            _zygotes[key] = _Zygote(stack)
        return _zygotes[key]


if __name__ == "__main__":
    # python tests/releases.py [VERSION ...]: install the given releases (default: all) into the cache, four
    # pip processes at a time (each spends most of its time waiting on the download); any failure fails.
    # The user stack too (USER_STACK), unless releases are named or --no-user-stack is given.
    named = [arg for arg in sys.argv[1:] if arg != "--no-user-stack"]
    with ThreadPoolExecutor(max_workers=4) as pool:
        stack = None if sys.argv[1:] else pool.submit(user_stack_dir)
        for installed in pool.map(release_dir, named or RELEASES):
            print(installed)
        if stack is not None:
            print(stack.result())
