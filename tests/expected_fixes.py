"""The test-side table of fix ids, collected from the fixes' own test files. Each ``tests/fixes/test_<id>.py``
declares at module level, written out by hand from docs/kernel-facts.md and upstream's release notes:
``CARRIES``, the releases that carry the bug (and so get the fix applied), and ``CORRECTION``, True for a
correction, False for a guard. The package's own table, ``fixes/__init__.py``, is checked against them, never read
to build them. The files are read with ``ast``, not imported: only those two expressions are evaluated, with
nothing in scope but ``WITH_OPS``, ``RELEASES`` and ``frozenset``; a file that lacks one or uses anything else fails
the import of this module, naming the file. The fix ids are the files' stems, sorted."""

from __future__ import annotations

import ast
from pathlib import Path

from releases import RELEASES, WITH_OPS

ROOT = Path(__file__).resolve().parents[1]
FIX_TESTS = ROOT / "tests" / "fixes"
#: The names each fix's test file declares, and what its expressions may use.
DECLARED = ("CARRIES", "CORRECTION")
SCOPE = {"WITH_OPS": WITH_OPS, "RELEASES": RELEASES, "frozenset": frozenset}


def declarations(path: Path) -> dict[str, object]:
    """``{"CARRIES": frozenset, "CORRECTION": bool}`` as ``path`` declares them; a ``ValueError`` naming the file
    where one is missing, assigned twice, or not what it should be."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found: dict[str, ast.expr] = {}
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for target in targets:
            if isinstance(target, ast.Name) and target.id in DECLARED:
                if target.id in found or isinstance(node, ast.AugAssign):
                    raise ValueError(f"{where}: {target.id} is assigned more than once; declare it once")
                found[target.id] = value
    missing = [name for name in DECLARED if name not in found]
    if missing:
        raise ValueError(
            f"{where} declares no {' and no '.join(missing)} at module level: a fix's test file says which releases "
            "carry its bug (CARRIES = a frozenset of releases) and whether it is a correction (CORRECTION = True) "
            "or a guard (False); docs/adding-a-fix.md"
        )
    values = {name: _evaluate(where, name, expr) for name, expr in found.items()}
    carries, correction = values["CARRIES"], values["CORRECTION"]
    if not isinstance(carries, frozenset) or not carries <= set(RELEASES):
        raise ValueError(f"{where}: CARRIES is {carries!r}, not a frozenset of releases.RELEASES")
    if not isinstance(correction, bool):
        raise ValueError(f"{where}: CORRECTION is {correction!r}, not True or False")
    return values


def _evaluate(where: Path, name: str, expr: ast.expr) -> object:
    """One declared expression, with nothing but ``SCOPE`` in reach (no builtins, attributes or other calls)."""
    allowed = (ast.Constant, ast.Set, ast.Tuple, ast.List, ast.Name, ast.Load, ast.BinOp, ast.operator, ast.Call)
    for node in ast.walk(expr):
        if not isinstance(node, allowed):
            raise ValueError(f"{where}: {name} uses {type(node).__name__}; only {', '.join(SCOPE)} and literals")
        if isinstance(node, ast.Name) and node.id not in SCOPE:
            raise ValueError(f"{where}: {name} uses {node.id}; only {', '.join(SCOPE)} and literals")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "frozenset"):
            raise ValueError(f"{where}: {name} calls something other than frozenset")
    return eval(compile(ast.Expression(expr), str(where), "eval"), {"__builtins__": {}}, dict(SCOPE))


def _collect() -> dict[str, dict[str, object]]:
    """Fix id -> its test file's declarations, for every ``tests/fixes/test_<id>.py``, sorted by id."""
    return {path.stem.removeprefix("test_"): declarations(path) for path in sorted(FIX_TESTS.glob("test_*.py"))}


_DECLARED = _collect()
#: fix id -> the releases that carry the bug (and so get the fix applied).
CARRIES: dict[str, frozenset[str]] = {fix: facts["CARRIES"] for fix, facts in _DECLARED.items()}
CORRECTIONS = tuple(fix for fix, facts in _DECLARED.items() if facts["CORRECTION"])
GUARDS = tuple(fix for fix in CARRIES if fix not in CORRECTIONS)
FIX_IDS = tuple(CARRIES)


def applied(version: str) -> list[str]:
    """The fixes the package applies on ``version``, sorted."""
    return sorted(i for i, releases in CARRIES.items() if version in releases)


def not_on(version: str) -> tuple[str, ...]:
    """The fixes ``version`` does not carry."""
    return tuple(i for i, releases in CARRIES.items() if version not in releases)
