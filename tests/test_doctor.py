"""The doctor as a user's tool (``python -m diffusers_cudnn_fix``, ``diffusers_cudnn_fix/__main__.py``).

* It says what to do next before anything else: on a release that needs fixes, that the fixes it shows are
  active in its own process only and how to make them active in training (``import diffusers_cudnn_fix``
  at the top of the entry point, or the launcher); on 0.35.2 "nothing to fix here", exit status 0 (not 3:
  there is nothing to verify on a GPU); on 0.42.1 first what the package still guards there (the bool-mask bug
  #14342 is open) and when removing it is safe, then which guards it has and how to keep them active.
* Without a GPU on the machine, everything needed active is exit status 0 (a ``set -e`` set-up goes on), the
  verdict saying "not verified on a GPU"; ``--require-gpu`` (CI on GPU hosts) makes it 3.
* Each fix's plain title is shown, not the check's evidence (tensor shapes) unless ``--verbose``; the
  columns of the fix table line up whatever the cells hold; nothing is cut (a long error message in the
  GPU table is shown whole, wrapped).
* ``--help`` is plain text listing every exit status and every switch; a usage error exits with its own
  status (64), not 2, which says that diffusers cannot be imported; that 2 is tested with a ``diffusers`` made
  missing on the path, whatever the interpreter running the tests has installed (the README's set-up puts
  diffusers into the checkout's ``.venv``).

One interpreter per release (0.39.0, 0.42.1) runs the doctor in process (text, ``--verbose``, ``--json``); a
real ``python -m diffusers_cudnn_fix`` process runs where its exit status is the point (0.35.2, usage errors).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from releases import ROOT, TESTS, release_dir, run

pytestmark = pytest.mark.slow

EXIT_USAGE = 64
#: The tests reading the one 0.39.0 interpreter's results run on one pytest-xdist worker (.ci/run's -n auto).
SHARES_0_39_0 = pytest.mark.xdist_group("test_doctor-0.39.0")


def strict_json(text: str) -> object:
    """The doctor's --json, parsed as strict JSON (no NaN / Infinity words, which jq rejects)."""

    def refuse(word: str) -> object:
        raise AssertionError(f"--json printed {word}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


DOCTOR = """
import contextlib, io, json
from diffusers_cudnn_fix import __main__ as doctor


def go(*args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = doctor.main(list(args))
    return {"code": code, "text": out.getvalue()}


result = {"text": go("--no-gpu"), "verbose": go("--no-gpu", "--verbose"), "json": go("--no-gpu", "--json")}
result["strict"] = go("--no-gpu", "--require-gpu")  # CI on a GPU host: exit 3 unless verified on a GPU
result["json_probe"] = go("--json")  # the GPU probe asked for (on a CPU: skipped, with its reason)
result["subcommand"] = go("doctor", "--no-gpu", "--json")  # the doctor named: the same
result["before_subcommand"] = go("--no-gpu", "doctor", "--json")  # switches on either side of it
"""

# 0.39.0 only: the table the doctor prints on a GPU, with a row that raises the package's real fp32 error
# (the text once cut it to "torch.float32/torch.fl"), rendered by the doctor's own printer.
LONG_ERROR = """
import torch
from diffusers_cudnn_fix.fixes.cudnn_input_dtypes import refuse_unsupported_dtypes
q = torch.zeros(1, 2, 2, 4)
try:
    refuse_unsupported_dtypes(q, q, q, None)
except Exception as exc:
    message = f"{type(exc).__name__}: {exc}"
data, _ = doctor.collect(run_gpu=False)
errors = {"out": 0.0049, "dq": 0.0085, "dk": 0.0085, "dv": 0.0068}
data["shipped_vs_corrected"] = [
    {"variant": "as shipped", "errors": None, "error": message},
    {"variant": "corrected", "errors": errors, "error": None},
    {"variant": "reference magnitudes", "errors": errors, "error": None},
]
out = io.StringIO()
with contextlib.redirect_stdout(out):
    doctor._print_human(data)
result["long_error"] = {"message": message, "text": out.getvalue()}
"""

_results: dict[str, dict] = {}


def doctor(version: str) -> dict:
    if version not in _results:
        body = DOCTOR + (LONG_ERROR if version == "0.39.0" else "") + "\nprint(json.dumps(result))\n"
        _results[version] = run(release_dir(version), body, env={"DIFFUSERS_CUDNN_FIX": "1"}, preloaded=True)
    return _results[version]


def _doctor_process(version: str | None, *args: str, hide_diffusers: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m diffusers_cudnn_fix ARGS`` with release ``version`` first on the path; ``hide_diffusers``: a
    folder in which to make a ``diffusers`` that is not there, whatever this interpreter has installed (the
    README's set-up puts diffusers into the checkout's .venv)."""
    paths = ([str(release_dir(version))] if version else []) + [str(ROOT), str(TESTS)]
    if hide_diffusers is not None:
        stub = hide_diffusers / "diffusers"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "__init__.py").write_text(
            'raise ModuleNotFoundError("No module named \'diffusers\'", name="diffusers")\n'
        )
        paths.insert(0, str(hide_diffusers))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DIFFUSERS_CUDNN_FIX"))}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return subprocess.run(
        [sys.executable, "-m", "diffusers_cudnn_fix", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(ROOT),
        timeout=300,
    )


def _words(text: str) -> str:
    return " ".join(text.split())


def _first_paragraph(text: str) -> str:
    return _words(text.strip().split("\n\n")[0])


def _fix_table(text: str) -> list[str]:
    """The header and the rows of the fix table (rows start at the header's indentation)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["fix", "table"])
    indent = len(lines[start]) - len(lines[start].lstrip())
    rows = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        if len(line) - len(line.lstrip()) == indent:
            rows.append(line)
    return rows


def assert_aligned(rows: list[str]) -> None:
    """Every cell of every row starts where a header word starts (cells are separated by 2+ spaces, words
    inside a cell by one)."""
    header = rows[0]
    starts = {m.start() for m in re.finditer(r"\S+", header)}
    for row in rows[1:]:
        cells = {m.start() for m in re.finditer(r"(?:(?<=^)|(?<=  ))\S", row)}
        assert cells <= starts, f"not aligned:\n{header}\n{row}"


def test_nothing_to_fix_on_0_35_2_exits_0() -> None:
    proc = _doctor_process("0.35.2", "--no-gpu")
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    first = _first_paragraph(proc.stdout)
    assert first.startswith("advice remove: ") and "changes nothing here" in first, proc.stdout
    assert "not verified" not in proc.stdout.lower(), proc.stdout
    assert proc.stdout.rstrip().endswith("(exit status 0)"), proc.stdout
    assert_aligned(_fix_table(proc.stdout))


@SHARES_0_39_0
def test_the_next_step_comes_first_where_fixes_are_needed() -> None:
    result = doctor("0.39.0")
    text = result["text"]["text"]
    first = _first_paragraph(text)
    assert "import diffusers_cudnn_fix" in first, text
    assert "diffusers-cudnn-fix run --" in first, text
    assert "own process only" in first, text  # "applied: yes" is about the doctor's process, not training
    assert "can be removed" not in text.lower()
    data = strict_json(result["json"]["text"])
    assert data["advice"] == "apply" and data["advice_text"] in _words(first), data
    for named in ("subcommand", "before_subcommand"):
        same = strict_json(result[named]["text"])
        assert (same["status"], same["exit_status"]) == (data["status"], data["exit_status"]), named


@SHARES_0_39_0
def test_titles_not_evidence_and_aligned_columns() -> None:
    result = doctor("0.39.0")
    text, verbose = result["text"]["text"], result["verbose"]["text"]
    data = strict_json(result["json"]["text"])
    for fix in data["status"]["fixes"]:
        assert _words(fix["title"]) in _words(text), fix["title"]
    # The check's evidence (tensor shapes of the behavioural check) only with --verbose.
    shapes = re.compile(r"\(\d+, \d+, \d+, \d+\)")
    assert not shapes.search(text), text
    assert shapes.search(verbose), verbose
    rows = _fix_table(text)
    assert len(rows) == 1 + len(data["status"]["fixes"])
    assert any("not affected" in row for row in rows) and any(" affected " in row for row in rows)
    assert_aligned(rows)


def test_on_a_guards_only_release_it_says_first_what_it_still_guards() -> None:
    """0.42.1 needs no gradient correction for most runs, but the bool-mask bug (#14342) is open there (padded
    QwenImage prompts train 103% off without the package): the advice is "keep", and its first sentence names
    every fix still needed (the ring route's correction too) and the training runs that meet them."""
    result = doctor("0.42.1")
    data = strict_json(result["json"]["text"])
    assert data["advice"] == "keep" and "cudnn_bool_mask" in data["needs"]["guards"], data
    assert "ring_grad_route" in data["needs"]["only_for"], data
    text = result["text"]["text"]
    assert "can be removed" not in text.lower(), text
    first_sentence = _words(text).split(": keep it if")[0]
    assert first_sentence.startswith("advice keep: "), first_sentence
    advice = _first_paragraph(text)
    for case in ("attention masks", "fp32", "ring_degree >= 3", "removing it is safe"):
        assert case in advice, (case, advice)
    for fix_id in (*data["needs"]["guards"], *data["needs"]["only_for"]):
        assert fix_id in first_sentence, (fix_id, first_sentence)
    # One decision, said first; how to keep the guards active everywhere in the same paragraph; no other advice.
    assert "advice apply" not in text and "needs the guards" not in text, text
    assert "import diffusers_cudnn_fix" in advice and "diffusers-cudnn-fix run --" in advice, advice
    assert_aligned(_fix_table(text))


@SHARES_0_39_0
def test_without_a_gpu_the_doctor_did_what_it_could_and_says_so() -> None:
    """Everything needed active, no GPU on this machine: exit status 0 (a `set -e` set-up script goes on) and the
    verdict says it is not verified on a GPU; `--require-gpu` (CI on GPU hosts) exits 3 there. Where there is a
    GPU, the probe skipped by `--no-gpu` is exit status 3 either way."""
    result = doctor("0.39.0")
    data = strict_json(result["json"]["text"])
    assert data["status"]["ok"] is True and data["advice"] == "apply", data
    assert result["strict"]["code"] == 3, result["strict"]["text"]
    assert "not verified on a GPU" in result["strict"]["text"], result["strict"]["text"]
    last = result["text"]["text"].rstrip().splitlines()[-1]
    if data["environment"]["gpu"] is None:
        assert result["text"]["code"] == 0, result["text"]["text"]
        assert last == "verdict: OK on the check; not verified on a GPU: no GPU here (exit status 0)", last
    else:
        assert result["text"]["code"] == 3 and "not verified on a GPU" in last, last


@SHARES_0_39_0
def test_the_doctor_names_the_package_version() -> None:
    """In its text (next to the other versions) and in --json; and `--version` says it and exits 0."""
    from diffusers_cudnn_fix import __version__

    result = doctor("0.39.0")
    data = strict_json(result["json"]["text"])
    assert data["version"] == __version__
    lines = result["text"]["text"].splitlines()
    versions_line = next(line for line in lines if line.startswith("diffusers_cudnn_fix "))
    assert versions_line.startswith(f"diffusers_cudnn_fix {__version__}, diffusers 0.39.0, torch "), versions_line
    probed = strict_json(result["json_probe"]["text"])
    if probed["probe"]["state"] == "skipped":  # no GPU here: no table (not a header without rows)
        assert probed["probe_table"] is None, probed["probe_table"]
    else:
        assert len(probed["probe_table"].splitlines()) > 2, probed["probe_table"]
    for args in (["--version"], ["doctor", "--version"]):
        proc = _doctor_process(None, *args)
        assert proc.returncode == 0, (proc.returncode, proc.stderr)
        assert proc.stdout == f"diffusers-cudnn-fix {__version__}\n", proc.stdout


@SHARES_0_39_0
def test_long_messages_are_shown_whole() -> None:
    long_error = doctor("0.39.0")["long_error"]
    message = long_error["message"]
    assert "torch.float32/torch.float32/torch.float32" in message and len(message) > 200
    assert _words(message) in _words(long_error["text"]), long_error["text"]
    rows = [line for line in long_error["text"].splitlines() if line.split()[:1] == ["variant"]]
    start = long_error["text"].splitlines().index(rows[0])
    assert_aligned(long_error["text"].splitlines()[start : start + 4])
    assert all(len(line) <= 120 for line in long_error["text"].splitlines()), "a line was not wrapped"


def test_help_is_plain_text_with_exit_statuses_and_switches() -> None:
    proc = _doctor_process(None, "--help")
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "``" not in text and ":func:" not in text and ":class:" not in text, text
    for code in ("0", "1", "2", "3", str(EXIT_USAGE)):
        assert re.search(rf"^\s+{code}\s+\w", text, re.M), f"exit status {code} not listed:\n{text}"
    for switch in (
        "--json",
        "--no-gpu",
        "--require-gpu",
        "--verbose",
        "run",
        "DIFFUSERS_CUDNN_FIX=",
        "DIFFUSERS_CUDNN_FIX_SKIP=",
    ):
        assert switch in text, switch
    for switch in ("DIFFUSERS_CUDNN_FIX_MASK=convert|warn|error", "DIFFUSERS_CUDNN_FIX_PROBE=warn|strict|off"):
        assert switch in text, switch
    # Written from the switch table: every variable, every spelling it accepts, what it does.
    from diffusers_cudnn_fix import _switches

    for var, (spellings, _, says) in _switches.SWITCHES.items():
        assert f"  {var}=" in text and _words(says) in _words(text), var
        assert all(re.search(rf"[ |=]{re.escape(s)}[ |,\n]", text) for s in spellings), (var, text)
    for command in ("doctor", "run", "verify"):  # the subcommands
        assert re.search(rf"^\s+{command}\s+\w", text, re.M), (command, text)
    run_help = _doctor_process(None, "run", "--help")
    assert run_help.returncode == 0 and "COMMAND" in run_help.stdout, run_help.stderr
    for code in ("126", "127", str(EXIT_USAGE)):
        assert re.search(rf"^\s+{code}\s+\w", run_help.stdout, re.M), (code, run_help.stdout)


def test_a_usage_error_has_its_own_exit_status(tmp_path: Path) -> None:
    for args in (["--no-such-switch"], ["doctor", "--no-such-switch"], ["--no-such-switch", "doctor"]):
        bad = _doctor_process(None, *args)
        assert bad.returncode == EXIT_USAGE, (args, bad.returncode, bad.stderr)
        assert "--no-such-switch" in bad.stderr and bad.stdout == "", (args, bad.stderr)
    unknown = _doctor_process(None, "no-such-command")
    assert unknown.returncode == EXIT_USAGE and "no-such-command" in unknown.stderr, unknown.stderr
    verify_help = _doctor_process(None, "verify", "--help")  # verify's own options, forwarded to it
    assert verify_help.returncode == 0 and "--nproc" in verify_help.stdout, verify_help.stderr
    # diffusers cannot be imported here, whatever the interpreter running the tests has installed.
    no_diffusers = _doctor_process(None, "--no-gpu", hide_diffusers=tmp_path)
    assert no_diffusers.returncode == 2, (no_diffusers.returncode, no_diffusers.stdout, no_diffusers.stderr)
    assert "cannot import" in no_diffusers.stdout


def test_a_correction_for_some_runs_only_counts_where_its_check_is_not_sure(monkeypatch) -> None:
    """An ``only_for`` correction found broken makes the advice "keep", naming the runs it matters to; one whose
    check could not tell ("unknown") makes it "apply". One decision (``_advice.decide``), which the doctor and the
    registry's log both render. On a release outside its ``only_for_on`` (ring attention on 0.39.0, wrong at any
    degree) it counts as any correction."""
    import types

    from diffusers_cudnn_fix import _advice
    from diffusers_cudnn_fix.fixes import ALL_FIXES

    conditional = next(fix for fix in ALL_FIXES if fix.only_for_on)
    monkeypatch.setitem(sys.modules, "diffusers", types.SimpleNamespace(__version__="0.39.0"))
    assert conditional.only_for == ""  # 0.39's bug is fixed upstream
    monkeypatch.setitem(sys.modules, "diffusers", types.SimpleNamespace(__version__="0.42.1"))
    assert conditional.only_for == conditional.only_for_on[1]

    def needs(state: str) -> _advice.Advice:
        return _advice.decide({f.id: state if f is conditional else "ok" for f in ALL_FIXES}, "0.42.1")

    broken = needs("broken")
    assert broken.word == "keep" and broken.only_for == {conditional.id: conditional.only_for}, broken
    assert conditional.id not in broken.corrections and conditional.id in broken.sentence(), broken
    assert conditional.only_for in broken.sentence(), broken.sentence()
    unknown = needs("unknown")
    assert unknown.word == "apply" and conditional.id in unknown.corrections, unknown
    assert needs("ok").word == needs("absent").word == "remove"
    monkeypatch.setitem(sys.modules, "diffusers", types.SimpleNamespace(__version__="0.39.0"))
    on_039 = needs("broken")
    assert on_039.word == "apply" and conditional.id in on_039.corrections, on_039


def test_where_a_bug_is_open_the_doctor_points_at_its_upstream_folder() -> None:
    """0.42.1 as shipped: each fix found broken that has ``upstream/<id>/`` gets a line naming the command that
    prints its report from the installed package (``explain upstream/<id>``: a wheel carries it), in the text and
    in --json; a fix found fixed gets none."""
    from diffusers_cudnn_fix.fixes import ALL_FIXES

    result = doctor("0.42.1")
    data, text = strict_json(result["json"]["text"]), result["text"]["text"]
    assert "upstream: diffusers-cudnn-fix explain upstream/cudnn_bool_mask prints the report" in _words(text), text
    assert "huggingface/diffusers#14342" in _words(text), text
    with_folder = {fix.id for fix in ALL_FIXES if fix.upstream_issue is not None}
    broken = {i for i, state in data["shipped_check"].items() if state == "broken"}
    assert set(data["upstream"]) == with_folder & broken and "cudnn_bool_mask" in data["upstream"], data["upstream"]
    for fix_id, upstream in data["upstream"].items():
        assert upstream["issue"] == f"upstream/{fix_id}/ISSUE.md", upstream
        assert upstream["command"] == f"diffusers-cudnn-fix explain upstream/{fix_id}", upstream
        line = f"upstream: {upstream['command']} prints the report ({upstream['holds']})"
        assert _words(line) in _words(text), fix_id
    assert "kernel fault" in data["upstream"]["cudnn_masked_row_grads"]["holds"]
    assert_aligned(_fix_table(text))
    # 0.39.0: the ring's bug there is fixed upstream (0.40.0), so its folder (for 0.40+'s bug) is not pointed at.
    on_039 = doctor("0.39.0")
    data = strict_json(on_039["json"]["text"])
    assert "ring_grad_route" not in data["upstream"] and "upstream: None" not in on_039["text"]["text"], data[
        "upstream"
    ]
