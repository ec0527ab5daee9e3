#!/usr/bin/env python3
"""Report the largest Python class and file under the coordinator; fail when a class grows too big.

The coordinator's state was once one 1,200-line class (issue 37); it is split by aggregate so
each part can be read on its own. This check keeps it that way: it prints the largest class
and the largest file under `python/dflash_worker/coordinator/` (in lines) and exits 1 if any
class there is longer than `MAX_CLASS_LINES`. Standard library only (`ast`), so it runs
before any environment is built.

Usage: scripts/check-structure.py [ROOT]   (ROOT defaults to the coordinator package)
Exit codes: 0 every class within the limit, 1 a class over it, 2 no Python file under ROOT or one
that does not parse (named with its line).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MAX_CLASS_LINES = 400
DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "python" / "dflash_worker" / "coordinator"


def classes(path: Path) -> list[tuple[int, str]]:
    """`(lines, qualified name)` of every class in `path`, nested ones included (decorators count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((child.end_lineno - start + 1, f"{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else DEFAULT_ROOT
    files = sorted(root.rglob("*.py"))
    if not files:
        print(f"no Python files under `{root}`", file=sys.stderr)
        return 2
    all_classes: list[tuple[int, str]] = []
    sizes: list[tuple[int, str]] = []
    for path in files:
        rel = path.resolve().relative_to(Path.cwd()) if path.resolve().is_relative_to(Path.cwd()) else path
        sizes.append((len(path.read_text(encoding="utf-8").splitlines()), str(rel)))
        try:
            all_classes += [(n, f"{rel}:{name}") for n, name in classes(path)]
        except SyntaxError as exc:
            print(f"error: {rel}:{exc.lineno}: not Python this check can read: {exc.msg}", file=sys.stderr)
            return 2
    lines, name = max(sizes)
    print(f"largest file:  {name} ({lines} lines)")
    if all_classes:
        lines, name = max(all_classes)
        print(f"largest class: {name} ({lines} lines)")
    too_big = sorted((c for c in all_classes if c[0] > MAX_CLASS_LINES), reverse=True)
    for lines, name in too_big:
        print(f"error: class `{name}` is {lines} lines, more than {MAX_CLASS_LINES}\nhint: split it by concern", file=sys.stderr)
    return 1 if too_big else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
