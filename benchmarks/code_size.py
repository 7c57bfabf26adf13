"""Code lines of the package: lines holding code, without blank lines, comments and docstrings.

python benchmarks/code_size.py [PACKAGE_DIR]     # default: diffusers_cudnn_fix
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def code_line_numbers(source: str) -> set[int]:
    """The numbers of the lines of ``source`` that hold code."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return lines


def code_lines(source: str) -> int:
    return len(code_line_numbers(source))


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "diffusers_cudnn_fix")
    total = 0
    for path in sorted(root.rglob("*.py")):
        count = code_lines(path.read_text())
        total += count
        print(f"{count:6d}  {path}")
    print(f"{total:6d}  total")


if __name__ == "__main__":
    main()
