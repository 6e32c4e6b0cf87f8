"""Print the size outliers of the project's Python code (docs/architecture.md, "Conventions the
structure keeps": no module over 600 lines, no function over 60 lines unless its docstring says why).

Modules over 600 lines and functions over 60 lines (docstrings included) are listed with
their sizes, plus the median function length. Informational: always exits 0.
"""
from __future__ import annotations

import ast
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tangram", "tangram_cli", "agent")
MODULE_LIMIT, FUNCTION_LIMIT = 600, 60


def main() -> int:
    modules, functions = [], []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            rel = path.relative_to(ROOT)
            modules.append((len(text.splitlines()), str(rel)))
            for node in ast.walk(ast.parse(text, filename=str(rel))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
                    functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
    lengths = [n for n, _ in functions]
    print(f"size report: {len(modules)} modules, {sum(n for n, _ in modules)} lines, "
          f"{len(functions)} functions, median function {statistics.median(lengths):.0f} lines")
    for n, name in sorted(modules, reverse=True):
        if n > MODULE_LIMIT:
            print(f"  module   {n:5d} lines  {name}")
    for n, name in sorted(functions, reverse=True):
        if n > FUNCTION_LIMIT:
            print(f"  function {n:5d} lines  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
