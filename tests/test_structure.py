"""The package's shape: imports flow one way, and nothing on the training path imports a module.

* The graph of imports between the package's own modules, imports inside functions included, has no
  cycle, and every edge goes down the layers (hook -> probe -> registry -> fixes -> detect -> the helpers).
* Modules whose code runs inside the corrected ops (on autograd's threads too) import nothing inside a
  function: an import there can wait forever for an import lock another thread holds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "diffusers_cudnn_fix"

# Lower numbers sit lower: a module may import only modules on a lower layer (or its own layer's fixes
# package parts, which import each other through fixes/__init__ only).
LAYERS = {
    "_explain": -1,  # the explain command and the command lines messages name: imports nothing of the package
    "_warnings": 0,
    "_target_names": 0,
    "_switches": 1,
    "_devices": 1,
    "_fix": 1,
    "_ledger": 1,  # what the policies ran (verify's accounting): torch only
    "fixes": 2,  # the fix table: plain data, no torch
    "_layout": 2,
    "_key_padding": 2,
    "_detect": 3,
    "_advice": 3,  # apply / keep / remove, from the fix table: plain data
    # One module per bug: its check and its policy. A fix module imports no other fix module.
    "fixes.cudnn_forward_lse": 4,
    "fixes.cudnn_backward_kv": 4,
    "fixes.flash_backward_kv": 4,
    "fixes.ulysses_grad_count": 4,
    "fixes.ring_grad_route": 4,
    "fixes.cudnn_bool_mask": 4,
    "fixes.cudnn_input_dtypes": 4,
    "fixes.cudnn_masked_row_grads": 4,
    "fixes.ulysses_mask_grad": 4,
    "fixes.qwen_joint_mask_order": 4,
    "fixes.flash_input_alignment": 4,
    "fixes.flash_cp_ignored": 4,
    "fixes.ulysses_head_mask": 4,
    "fixes.ulysses_kv_length": 4,
    "fixes.cp_gather_grads": 4,
    "fixes.ltx2_cp_plan": 4,
    "fixes.cp_split_warning_once": 4,
    "fixes.cp_no_accelerator": 4,
    # One replacement per target, built from the policies of the fixes found broken.
    "targets.ring": 5,
    "targets.cudnn": 6,
    "targets.flash": 6,
    "targets.ulysses": 6,
    "targets.models": 6,
    "targets": 7,
    "_report": 5,
    "_registry": 8,
    "_probe": 9,
    "_hook": 10,
    "__init__": 11,
    "_launcher": 11,  # imports nothing of the package: the CLI's launcher (``run -- COMMAND``)
    # ``verify``: a CLI subcommand (imported by ``__main__`` only when it runs); uses the public API.
    "_verify_models": 11,  # verify's table of tiny models: imports nothing of the package
    "_verify": 12,
    "__main__": 13,
    # The launcher's start-up hook, run in the command's processes: it imports the package from outside.
    "site-bootstrap.sitecustomize": 14,
}

# Code in these runs inside the corrected ops or the probe's trigger.
HOT_PATH = ["_warnings", "_switches", "_devices", "_layout", "_key_padding", "_probe"] + [
    m for m in LAYERS if m.startswith(("fixes.", "targets."))
]


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(imported package module, inside a function) for every import of the package's own modules."""
    name = _module_name(path)
    package_parts = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package_parts = []
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.ImportFrom) and child.level > 0:
                base = package_parts[: len(package_parts) - (child.level - 1)] if child.level > 1 else package_parts
                prefix = ".".join([*base, child.module] if child.module else base)
                for alias in child.names:
                    candidate = f"{prefix}.{alias.name}" if prefix else alias.name
                    found.append((candidate if _exists(candidate) else prefix or "__init__", inside))
            elif isinstance(child, ast.ImportFrom) and (child.module or "").startswith("diffusers_cudnn_fix"):
                found.append((child.module.removeprefix("diffusers_cudnn_fix").lstrip(".") or "__init__", inside))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def _exists(name: str) -> bool:
    base = PACKAGE.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_every_module_has_a_layer() -> None:
    assert set(MODULES) == set(LAYERS)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_down_the_layers(module: str) -> None:
    for target, _ in _imports(MODULES[module]):
        if target == module:
            continue
        assert LAYERS[target] < LAYERS[module] or (module == "targets" and target.startswith("targets.")), (
            f"{module} (layer {LAYERS[module]}) imports {target} (layer {LAYERS[target]})"
        )


def test_no_import_cycle() -> None:
    graph = {m: {t for t, _ in _imports(p) if t != m} for m, p in MODULES.items()}
    state: dict[str, int] = {}

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            assert state.get(nxt) != 1, f"import cycle: {' -> '.join([*path, node, nxt])}"
            if nxt not in state:
                walk(nxt, [*path, node])
        state[node] = 2

    for module in graph:
        if module not in state:
            walk(module, [])


@pytest.mark.parametrize("module", HOT_PATH)
def test_no_import_inside_functions_on_the_training_path(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = [n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert not inner, f"{module}.{node.name} imports {ast.unparse(inner[0])}"
