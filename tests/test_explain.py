"""``diffusers-cudnn-fix explain``: every reference a message or the doctor makes prints something, from a wheel too.

The references are collected from the code, not listed here: the section of every ``explain(...)`` call in the
package (each problem message ends naming ``diffusers-cudnn-fix explain <section>``), ``fixes.md#<id>`` for every
fix (the registry's messages name the fix's own section), and ``upstream/<id>`` for every fix with an upstream
report (``Fix.upstream_command``, the doctor's pointer). In process, each resolves through ``_explain`` to a
non-empty section (read from the checkout here). The wheel test builds the wheel as the release does (the sdist,
then the wheel from it), installs it into a fresh virtual environment outside the checkout, and follows every
reference there, from a directory outside the checkout.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest
from releases import ROOT

from diffusers_cudnn_fix import _explain
from diffusers_cudnn_fix.__main__ import EXIT_USAGE, _Parser
from diffusers_cudnn_fix.fixes import ALL_FIXES

PACKAGE = ROOT / "diffusers_cudnn_fix"


def _section_arguments() -> list[tuple[str, ast.expr]]:
    """(module, the section argument) of every ``explain(...)`` call in the package: its last positional argument
    or its ``section=`` keyword."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if called != "explain":
                continue
            keyword = [k.value for k in node.keywords if k.arg == "section"]
            found.append((module, keyword[0] if keyword else node.args[-1]))
    return found


def _sections_of(module: str, argument: ast.expr) -> list[str]:
    """What ``argument`` evaluates to in ``module``'s namespace; an f-string on a name bound only where the call
    runs (``f"fixes.md#{fix.id}"``) stands for every fix id."""
    namespace = vars(importlib.import_module(module))
    try:
        return [eval(compile(ast.Expression(argument), module, "eval"), dict(namespace))]
    except NameError:
        assert isinstance(argument, ast.JoinedStr), f"{module}: cannot follow {ast.unparse(argument)}"
        values = [v for v in argument.values if isinstance(v, ast.FormattedValue)]
        assert len(values) == 1, f"{module}: cannot follow {ast.unparse(argument)}"
        parts = ast.unparse(argument)[2:-1].split("{" + ast.unparse(values[0].value) + "}")
        return [f"{parts[0]}{fix.id}{parts[1]}" for fix in ALL_FIXES]


def references() -> list[str]:
    """Every topic a message or the doctor names (see the module docstring)."""
    found = {section for module, arg in _section_arguments() for section in _sections_of(module, arg)}
    found |= {f"fixes.md#{fix.id}" for fix in ALL_FIXES}
    found |= {f"upstream/{fix.id}" for fix in ALL_FIXES if fix.upstream_issue is not None}
    return sorted(found)


def test_the_references_are_collected_from_the_code() -> None:
    """The collection sees what it must: the constant sections, the per-fix ones and the upstream reports."""
    calls = _section_arguments()
    assert len(calls) >= 20, calls
    found = references()
    for expected in ("behaviour.md#switches", "doctor.md#the-gpu-probe", "api.md#what-importing-it-does"):
        assert expected in found, found
    assert {f"fixes.md#{fix.id}" for fix in ALL_FIXES} <= set(found)
    assert sum(t.startswith("upstream/") for t in found) == sum(f.upstream_issue is not None for f in ALL_FIXES) > 0


@pytest.mark.parametrize("topic", references())
def test_every_reference_prints_its_section(topic: str) -> None:
    text = _explain.text_of(topic)
    assert text is not None and text.strip(), f"{_explain.command_for(topic)} prints nothing"
    if "#" in topic:
        heading = text.splitlines()[0]
        assert heading.startswith("#") and len(text.splitlines()) > 1, text[:300]
    if topic.startswith("upstream/"):
        fix_id = topic.removeprefix("upstream/")
        issue = (ROOT / "upstream" / fix_id / "ISSUE.md").read_text().strip()
        patch = (ROOT / "upstream" / fix_id / "fix.patch").read_text().rstrip()
        assert issue in text and patch in text, text[:300]
        assert "reproduce.py" in text and f"test_{fix_id}.py" in text, text[-500:]


def test_the_doctor_names_the_upstream_command_where_it_names_a_folder() -> None:
    for fix in ALL_FIXES:
        if fix.upstream_folder is None:
            assert fix.upstream_command is None, fix.id
        else:
            assert fix.upstream_command is not None and _explain.text_of(fix.upstream_command.split()[-1]), fix.id


def _explain_main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = _explain.main(list(argv), _Parser)
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_explain_alone_lists_every_topic(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _explain_main(capsys)
    listed = {line.strip() for line in out.splitlines()[1:]}
    assert code == 0 and set(references()) <= listed, sorted(set(references()) - listed)
    assert "fixes.md" in listed and "upstream" in listed


def test_a_page_a_section_and_an_older_spelling(capsys: pytest.CaptureFixture[str]) -> None:
    page = (ROOT / "docs" / "fixes.md").read_text()
    assert _explain_main(capsys, "fixes.md") == (0, page, "")
    code, section, _ = _explain_main(capsys, "fixes.md#cudnn_bool_mask")
    assert code == 0 and section.startswith("## `cudnn_bool_mask`") and section.strip() in page
    assert "\n## " not in section  # ends before the next section
    # What older messages and the doctor named: a path into the source tree, a full stop copied with it.
    assert _explain_main(capsys, "docs/fixes.md#cudnn_bool_mask.")[1] == section
    issue = _explain_main(capsys, "upstream/cudnn_bool_mask")
    assert _explain_main(capsys, "upstream/cudnn_bool_mask/ISSUE.md") == issue and issue[0] == 0


@pytest.mark.parametrize("fix_id", [fix.id for fix in ALL_FIXES])
def test_a_fix_id_alone_prints_its_section(capsys: pytest.CaptureFixture[str], fix_id: str) -> None:
    """The doctor's table names each fix by its id: ``explain <id>`` prints what ``explain fixes.md#<id>`` does."""
    code, section, _ = _explain_main(capsys, fix_id)
    assert code == 0 and section.startswith(f"## `{fix_id}`"), section[:80]
    assert (code, section) == _explain_main(capsys, f"fixes.md#{fix_id}")[:2]


def test_a_heading_inside_a_code_block_is_no_section() -> None:
    text = "# Page\n\n## One\n\n```bash\n# a comment\n```\n\n### Sub\n\nx\n\n## One\n\ny\n"
    found = _explain.sections(text)
    assert list(found) == ["page", "one", "sub", "one-1"], found  # repeated headings numbered as on GitHub
    assert "# a comment" in found["one"] and "### Sub" in found["one"] and "y" not in found["one"]


@pytest.mark.parametrize(
    ("topic", "names"),
    [("fixes.md#no_such_fix", "fixes.md#cudnn_bool_mask"), ("nope.md", "upstream/cudnn_bool_mask")],
)
def test_an_unknown_topic_is_a_usage_error_naming_the_valid_ones(
    capsys: pytest.CaptureFixture[str], topic: str, names: str
) -> None:
    code, out, err = _explain_main(capsys, topic)
    assert code == EXIT_USAGE and out == "", out
    assert f"unknown topic {topic!r}" in err and f"\n  {names}\n" in err, err


# ------------------------------------------------------------------------------------------------------------
# From the wheel, installed outside the checkout
# ------------------------------------------------------------------------------------------------------------
IGNORE_IN_COPY = shutil.ignore_patterns(
    ".git", ".venv", ".cache", ".whl", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache", ".hypothesis",
    ".mypy_cache", ".ruff_cache",
)  # fmt: skip


def _explain_command(venv_dir: Path) -> list[str]:
    """``explain`` as the messages name it, run from the installed package's console script."""
    return [str(venv_dir / "bin" / "diffusers-cudnn-fix"), "explain"]


def _checked(args: list[str], **kwargs: object) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180, **kwargs)
    assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc.stdout


def _wheel(tmp_path: Path) -> Path:
    """The wheel as the release builds it: the sdist of a copy of the checkout, then the wheel from the unpacked
    sdist (offline, with this environment's setuptools)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=IGNORE_IN_COPY)
    build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path / 'sdist')!r}))"
    sdist = tmp_path / "sdist" / _checked([sys.executable, "-c", build_sdist], cwd=src).split()[-1]
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp_path / "from-sdist", filter="data")
    (unpacked,) = (tmp_path / "from-sdist").iterdir()
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    _checked([*pip, "-w", str(tmp_path / "dist"), str(unpacked)])
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return wheel


def _fresh_venv(where: Path, wheel: Path) -> Path:
    """A virtual environment without the system's packages, the wheel installed (``--no-deps``, no index), and
    its two dependencies copied from this one: its Python."""
    venv.create(where, with_pip=False, system_site_packages=False)
    python = where / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    _checked([*pip, str(wheel)])
    site = Path(_checked([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    for name in ("wrapt", "packaging"):
        dist = importlib.metadata.distribution(name)
        for file in dist.files or ():
            source = Path(str(dist.locate_file(file)))
            if file.parts[0] != ".." and "__pycache__" not in file.parts and source.is_file():
                (site / file).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, site / file)
    return python


def test_the_installed_wheel_follows_every_reference(tmp_path: Path) -> None:
    """Built, installed into a fresh venv under tmp_path, run from a directory outside the checkout with no
    PYTHONPATH: `explain` lists every reference, and each prints what it prints from the checkout (an upstream
    report names the installed reproducer and test, which exist)."""
    python = _fresh_venv(tmp_path / "venv", _wheel(tmp_path))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    where = _checked([str(python), "-c", "import diffusers_cudnn_fix as d; print(d.__file__)"], cwd=elsewhere, env=env)
    assert Path(where.strip()).is_relative_to(tmp_path / "venv"), where
    explain = _explain_command(tmp_path / "venv")
    listed = {line.strip() for line in _checked(explain, cwd=elsewhere, env=env).splitlines()}
    missing = [topic for topic in references() if topic not in listed]
    assert not missing, f"the installed wheel lists no {missing}"
    for topic in references():
        out = _checked([*explain, topic], cwd=elsewhere, env=env)
        in_checkout = _explain.text_of(topic)
        assert in_checkout is not None and out.strip(), topic
        if not topic.startswith("upstream/"):
            assert out == in_checkout, topic
            continue
        fix_id = topic.removeprefix("upstream/")
        report, _, files = out.partition("The folder's other files")
        assert report == in_checkout.partition("The folder's other files")[0], topic
        shipped = [Path(line.strip()) for line in files.splitlines()[1:]]
        assert {p.name for p in shipped} == {"reproduce.py", f"test_{fix_id}.py"}, out[-500:]
        for path in shipped:
            assert path.is_relative_to(tmp_path / "venv") and path.is_file(), path
            assert path.read_bytes() == (ROOT / "upstream" / fix_id / path.name).read_bytes(), path
