"""The upstream patches (``upstream/<fix_id>/``): one per bug still open on the newest release, each standalone.

Cheap checks of what ``.ci/upstream`` relies on (that script runs the reproducers and the added tests, shipped and
patched, without this package): every fix open on 0.42.1 has its folder with the four files; no file there imports
this package; each ``fix.patch`` names paths under ``diffusers/`` and applies to 0.42.1 exactly (no fuzz, no
offset); docs/fixes.md points at each ISSUE.md. Marked slow: all the patches applied to one copy of 0.42.1, which
must import.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from diffusers_cudnn_fix.fixes import ALL_FIXES

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM = ROOT / "upstream"
NEWEST = "0.42.1"
#: The bugs open on the newest release that have an upstream report (every one).
OPEN = sorted(
    fix.id for fix in ALL_FIXES if Version(NEWEST) in SpecifierSet(fix.affected) and fix.upstream_issue is not None
)
FILES = ("reproduce.py", "fix.patch", "test_{id}.py", "ISSUE.md")


def _release() -> Path:
    import releases  # tests/releases.py: installs the release on first use

    return releases.release_dir(NEWEST)


def _apply(patch: Path, target: Path, *, dry_run: bool) -> subprocess.CompletedProcess[str]:
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch", "-d", str(target), "-i", str(patch)]
        return subprocess.run([*cmd, *(["--dry-run"] if dry_run else [])], capture_output=True, text=True)
    cmd = ["git", "apply", "-p1", *(["--check"] if dry_run else []), str(patch)]
    return subprocess.run(cmd, cwd=target, capture_output=True, text=True)


def test_every_fix_open_on_the_newest_release_has_an_upstream_folder() -> None:
    assert sorted(p.name for p in UPSTREAM.iterdir() if p.is_dir()) == OPEN


@pytest.mark.parametrize("fix_id", OPEN)
def test_upstream_folder_is_standalone(fix_id: str) -> None:
    folder = UPSTREAM / fix_id
    for name in FILES:
        assert (folder / name.format(id=fix_id)).is_file(), f"upstream/{fix_id}/{name.format(id=fix_id)} is missing"
    for script in folder.glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text(), str(script))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "diffusers_cudnn_fix" for n in names), f"{script} imports the package"
    patch = (folder / "fix.patch").read_text()
    headers = [line.split()[1] for line in patch.splitlines() if line.startswith(("--- ", "+++ "))]
    assert headers and all(h.startswith(("a/diffusers/", "b/diffusers/")) for h in headers), headers
    assert f"upstream/{fix_id}/ISSUE.md" in (ROOT / "docs" / "fixes.md").read_text()


@pytest.mark.parametrize("fix_id", OPEN)
def test_fix_patch_applies_exactly_to_the_newest_release(fix_id: str) -> None:
    result = _apply(UPSTREAM / fix_id / "fix.patch", _release(), dry_run=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "offset" not in result.stdout.lower() and "fuzz" not in result.stdout.lower(), result.stdout


@pytest.mark.slow
def test_all_patches_together_apply_and_import(tmp_path: Path) -> None:
    shutil.copytree(_release() / "diffusers", tmp_path / "diffusers", ignore=shutil.ignore_patterns("__pycache__"))
    for fix_id in OPEN:
        result = _apply(UPSTREAM / fix_id / "fix.patch", tmp_path, dry_run=False)
        assert result.returncode == 0, f"{fix_id}: {result.stdout}{result.stderr}"
    code = "import diffusers.models.attention_dispatch as m; print(m.__file__)"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "DIFFUSERS_CUDNN_FIX": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path))


def test_the_fix_records_name_the_upstream_folders() -> None:
    """The doctor points at ``upstream/<id>/ISSUE.md`` from the fix record (``Fix.upstream_issue``): the records
    that have one are exactly the folders, which are exactly the fixes open on the newest release."""
    assert sorted(fix.id for fix in ALL_FIXES if fix.upstream_issue is not None) == OPEN
    for fix in ALL_FIXES:
        if fix.upstream_folder is not None:
            assert (ROOT / fix.upstream_folder).is_file(), fix.upstream_folder


#: The fixes whose bug is in diffusers' Python code (the other one, cudnn_masked_row_grads, is a cuDNN kernel fault
#: whose fix.patch is the workaround diffusers could carry).
PYTHON_LEVEL = (
    "cudnn_bool_mask",
    "ring_grad_route",
    "flash_input_alignment",
    "cudnn_input_dtypes",
    "ulysses_mask_grad",
    "ulysses_head_mask",
    "ulysses_kv_length",
    "cp_split_warning_once",
    "cp_gather_grads",
    "cp_no_accelerator",
)
#: Fixed by its patch, but found so only where LTX2's module is imported (the check reads its plan then and does not
#: import it): the doctor and the import-time check still apply it, and its policy then leaves the patched plan alone.
SEEN_WITH_ITS_MODEL = ("ltx2_cp_plan",)

STATUS = """
import json, diffusers_cudnn_fix, diffusers.models.attention_dispatch
print(json.dumps(diffusers_cudnn_fix.status().to_dict()))
"""


@pytest.mark.slow
def test_on_the_patched_release_the_checks_find_the_bugs_fixed(tmp_path: Path) -> None:
    """All the patches applied to a copy of 0.42.1: each fix's check finds its bug gone by behaviour (the version
    string still says 0.42.1), nothing is applied for it and the doctor points at no upstream folder for it; only a
    bug with no upstream patch is left, and the advice names it alone (#32). cudnn_bool_mask included: its patch
    converts the mask before Ulysses all-gathers it (torch.compile mistypes a gathered bool tensor)."""
    shutil.copytree(_release() / "diffusers", tmp_path / "diffusers", ignore=shutil.ignore_patterns("__pycache__"))
    for fix_id in OPEN:
        result = _apply(UPSTREAM / fix_id / "fix.patch", tmp_path, dry_run=False)
        assert result.returncode == 0, f"{fix_id}: {result.stdout}{result.stderr}"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{ROOT}", "PYTHONWARNINGS": "ignore"}

    def run(*args: str) -> str:
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
        return proc.stdout

    doctor = json.loads(run("-m", "diffusers_cudnn_fix", "--json", "--no-gpu"))
    status = json.loads(run("-c", STATUS))
    assert status["diffusers_version"] == NEWEST and status["ok"] is True, status
    fixes = {f["id"]: f for f in status["fixes"]}
    for fix_id in (*PYTHON_LEVEL, "cudnn_masked_row_grads"):
        assert fixes[fix_id]["detected"] == "ok" and not fixes[fix_id]["applied"], fixes[fix_id]
        assert doctor["shipped_check"][fix_id] == "ok", (fix_id, doctor["shipped_check"])
    # What is found fixed only where its model is imported (ltx2_cp_plan) is still applied on the patched copy:
    # the advice is "keep", naming it alone.
    no_patch = sorted(
        f.id
        for f in ALL_FIXES
        if Version(NEWEST) in SpecifierSet(f.affected) and (f.upstream_issue is None or f.id in SEEN_WITH_ITS_MODEL)
    )
    assert doctor["applied"] == no_patch, doctor
    assert set(doctor["upstream"]) <= set(SEEN_WITH_ITS_MODEL), doctor
    assert doctor["advice"] == ("keep" if no_patch else "remove") and doctor["exit_status"] == 0, doctor
    needed = [*doctor["needs"]["corrections"], *doctor["needs"]["only_for"], *doctor["needs"]["guards"]]
    assert sorted(needed) == no_patch, doctor["needs"]
    advice = " ".join(run("-m", "diffusers_cudnn_fix", "--no-gpu").split())
    assert doctor["advice_text"] in advice, advice
