#!/usr/bin/env python3
"""Find module import circles in the run-manager crate and the Python package; exit 1 when there is one.

A circle (`error` uses `tls_fault`, which uses `transport`, which uses `error`) means no module in
it can be read, tested or moved without the others (issues 37 and 55). This check builds a module
graph from the source text and prints every strongly connected component of more than one module
(Tarjan), each with one shortest circle through it and the references that make it. Each SRC is a
Rust crate's `src` directory (it holds `.rs` files) or a Python package (it holds `.py` files).

Rust:
- Modules: every `.rs` file under SRC is one (`a.rs` and `a/mod.rs` are `a`, `a/b.rs` is `a::b`;
  `lib.rs` and `main.rs` are the crate roots `crate` and `main`). Inline `mod x { ... }` blocks
  belong to their file's module.
- References: `use` trees and paths starting with `crate::`, `super::` or `self::`, and in files
  that declare `mod x;`, paths starting with `x::`. A path goes to the longest module it names;
  a name the module re-exports (`pub use error::{Error, Result};` in `lib.rs`) is followed to the
  module it comes from, so `crate::Error` is a use of `error`.
- Ignored: comments (doc comments too), string and char literals, and every item under
  `#[cfg(test)]` (`mod tests { ... }`, test helpers): tests may reach across layers.

Python:
- Modules: every `.py` file under SRC, named from SRC's own name (`pkg/a/b.py` is `pkg.a.b`); a
  package's `__init__.py` is the package's module (`pkg.a`), importing it runs it like any other.
- References: every `import` and `from ... import` statement, absolute (`pkg.*`) or relative
  (`from . import x`, `from ..a import y`), at module level and inside functions alike: a lazy
  import in a function is still a dependency, and the usual way a circle is hidden (the report
  marks them `in f()`). `from a import x` goes to the module `a.x` when there is one, else to `a`
  (a name defined or re-exported there, which goes through `a`'s `__init__.py` when `a` is a
  package); `import a.b` goes to the longest module it names. Importing `a.b` also runs `a`'s
  `__init__.py`, but that is not counted as a use of `a`.
- Ignored: imports in the body of `if TYPE_CHECKING:` (type-only; its `else:` counts), modules
  outside SRC, and names imported by string (`importlib.import_module`).

Standard library only, so it runs before any environment is built.

Usage: scripts/check-import-cycles.py [--graph] [SRC ...]   (SRC defaults to run-manager/src and
python/dflash_worker; `--graph` also prints every module's dependencies)
Exit codes: 0 no circle, 1 circles found, 2 a SRC with no Rust or Python file, or a Python file
that does not parse (named with its line).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SRCS = [REPO / "run-manager" / "src", REPO / "python" / "dflash_worker"]
ROOT = "crate"

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# `pub(crate) use a::{b, c};` (the tree is parsed by `expand_use`).
USE_RE = re.compile(r"(?<![\w$])(?:pub\s*(?:\([^)]*\))?\s*)?use\s+([^;]*);")
# `crate::a::b`, `super::super::x`, `self::x`, `child::x` outside `use` (not `$crate::`, a macro's).
PATH_RE = re.compile(rf"(?<![\w$:])((?:crate|super|self|{IDENT})(?:\s*::\s*{IDENT})+)")
MOD_DECL_RE = re.compile(rf"(?<![\w$])(?:pub\s*(?:\([^)]*\))?\s*)?mod\s+({IDENT})\s*[;{{]")
RAW_RE = re.compile(r'b?r(#*)"')
CFG_TEST_RE = re.compile(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")


# Rust -----------------------------------------------------------------------------------------


def strip_comments_and_literals(text: str) -> str:
    """`text` with comments and the insides of string/char literals blanked (newlines kept)."""
    out: list[str] = []
    i, n = 0, len(text)

    def blank(s: str) -> str:
        return "".join(c if c == "\n" else " " for c in s)

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(blank(text[i:j]))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(blank(text[i:j]))
            i = j
        elif c in "br" and (m := RAW_RE.match(text, i)) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = text.find('"' + m.group(1), m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""' + blank(text[i + 2 : j]))
            i = j
        elif c == '"' or (c == "b" and text.startswith('b"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_"))):
            j = i + (2 if c == "b" else 1)
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append('""' + blank(text[i + 2 : j]))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{1F600}') or a lifetime ('a, 'static).
            if text.startswith("\\", i + 1):
                j = text.find("'", i + 3)
                j = n if j < 0 else j + 1
            elif i + 2 < n and text[i + 2] == "'":
                j = i + 3
            else:
                out.append(c)
                i += 1
                continue
            out.append("' '" + blank(text[i + 3 : j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(text: str, open_at: int) -> int:
    """Index just past the `}` that closes the `{` at `open_at` (the end when unbalanced)."""
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def strip_cfg_test(text: str) -> str:
    """`text` (already without comments and literals) with every `#[cfg(test)]` item blanked."""
    while m := CFG_TEST_RE.search(text):
        # The item ends at its `;` or at the brace closing its first `{`, whichever comes first.
        semi = text.find(";", m.end())
        brace = text.find("{", m.end())
        if brace >= 0 and (semi < 0 or brace < semi):
            end = matching_brace(text, brace)
        else:
            end = len(text) if semi < 0 else semi + 1
        text = text[: m.start()] + "".join(c if c == "\n" else " " for c in text[m.start() : end]) + text[end:]
    return text


def expand_use(tree: str) -> list[tuple[list[str], str | None]]:
    """The paths of a use tree with their `as` names:
    `a::{b, c::{self, d as e}, *}` -> `a::b`, `a::c`, `a::c::d` (as `e`), `a`."""
    tree = re.sub(rf"\s+as\s+({IDENT})", r"@\1", tree)
    tree = re.sub(r"\s+", "", tree).removeprefix("::")
    paths: list[tuple[list[str], str | None]] = []

    def walk(prefix: list[str], t: str) -> None:
        if "{" not in t:
            t, _, alias = t.partition("@")
            segs = [s for s in t.split("::") if s and s != "*"]
            if segs and segs[-1] == "self":
                segs = segs[:-1]
            paths.append((prefix + segs, alias or None))
            return
        head, _, rest = t.partition("{")
        head_segs = [s for s in head.split("::") if s]
        inner = rest[: rest.rfind("}")]
        depth, start = 0, 0
        for j, ch in enumerate(inner + ","):
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            elif ch == "," and depth == 0:
                part = inner[start:j]
                if part:
                    walk(prefix + head_segs, part)
                start = j + 1

    walk([], tree)
    return paths


@dataclass
class Module:
    name: str
    path: Path
    text: str = ""
    children: set[str] = field(default_factory=set)
    # `pub use` names: re-exported name -> the absolute path it comes from.
    reexports: dict[str, list[str]] = field(default_factory=dict)
    # (absolute path, line) of every reference.
    refs: list[tuple[list[str], int]] = field(default_factory=list)


def module_name(rel: Path) -> str:
    rel = rel.with_suffix("")
    parts = list(rel.parts)
    if parts == ["lib"]:
        return ROOT
    if parts[-1] == "mod":
        parts = parts[:-1]
    return "::".join(parts)


def absolute(mod: Module, segs: list[str]) -> list[str] | None:
    """`segs` as a path from the crate root, or None when it names an external crate."""
    here = [] if mod.name in (ROOT, "main") else mod.name.split("::")
    if not segs:
        return None
    if segs[0] == "crate":
        return segs[1:]
    if segs[0] in ("super", "self"):
        while segs and segs[0] in ("super", "self"):
            if segs[0] == "super":
                here = here[:-1]
            segs = segs[1:]
        return here + segs
    if segs[0] in mod.children:
        return here + segs
    return None


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def load(src: Path) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for path in sorted(src.rglob("*.rs")):
        rel = path.relative_to(src)
        text = strip_cfg_test(strip_comments_and_literals(path.read_text(encoding="utf-8")))
        mod = Module(module_name(rel), rel, text)
        mod.children = {m.group(1) for m in MOD_DECL_RE.finditer(text)}
        modules[mod.name] = mod
    for mod in modules.values():
        text = mod.text
        for m in USE_RE.finditer(text):
            public = text[m.start() : m.start() + 3] == "pub"
            for segs, alias in expand_use(m.group(1)):
                path = absolute(mod, segs)
                if path is None:
                    continue
                mod.refs.append((path, line_of(text, m.start())))
                if public and path:
                    mod.reexports[alias or path[-1]] = path
        # Paths outside `use` statements (blanked first so they are not counted twice).
        rest = USE_RE.sub(lambda m: "".join(c if c == "\n" else " " for c in m.group(0)), text)
        for m in PATH_RE.finditer(rest):
            segs = [s.strip() for s in m.group(1).split("::")]
            path = absolute(mod, segs)
            if path is not None:
                mod.refs.append((path, line_of(text, m.start())))
    return modules


def target(modules: dict[str, Module], path: list[str]) -> str:
    """The module an absolute path uses: the longest module prefix, re-exports followed."""
    for _ in range(16):
        for k in range(len(path), 0, -1):
            name = "::".join(path[:k])
            if name in modules:
                break
        else:
            name, k = ROOT, 0
        item = path[k] if k < len(path) else None
        source = modules[name].reexports.get(item) if item and name in modules else None
        if source is None or source == path[: len(source)]:
            return name
        path = source + path[k + 1 :]
    return name


def graph(modules: dict[str, Module]) -> dict[str, dict[str, list[str]]]:
    """module -> used module -> where (`file:line`)."""
    edges: dict[str, dict[str, list[str]]] = {name: {} for name in modules}
    for mod in modules.values():
        for path, line in mod.refs:
            to = target(modules, path)
            where = f"{mod.path}:{line}"
            if to != mod.name and to in modules and where not in edges[mod.name].get(to, []):
                edges[mod.name].setdefault(to, []).append(where)
    return edges


# Python ---------------------------------------------------------------------------------------


class Unparsable(Exception):
    """A Python file `ast` cannot read; the message names it with its line."""


def display(path: Path) -> str:
    """`path` relative to the working directory when under it (as the report names files)."""
    resolved = path.resolve()
    return str(resolved.relative_to(Path.cwd())) if resolved.is_relative_to(Path.cwd()) else str(path)


def python_module_name(rel: Path, package: str) -> str:
    """`a/b.py` -> `package.a.b`; `a/__init__.py` -> `package.a`."""
    parts = [package, *rel.with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_type_checking(test: ast.expr) -> bool:
    """`if TYPE_CHECKING:` or `if typing.TYPE_CHECKING:`."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def python_imports(tree: ast.Module) -> list[tuple[ast.Import | ast.ImportFrom, str | None]]:
    """Every import statement with the function it sits in (None outside functions),
    the bodies of `if TYPE_CHECKING:` left out."""
    out: list[tuple[ast.Import | ast.ImportFrom, str | None]] = []

    def visit(node: ast.AST, scope: str, function: str | None) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append((node, function))
            return
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = f"{scope}{node.name}."
            if not isinstance(node, ast.ClassDef):
                function = scope[:-1]
        children = node.orelse if isinstance(node, ast.If) and is_type_checking(node.test) else ast.iter_child_nodes(node)
        for child in children:
            visit(child, scope, function)

    visit(tree, "", None)
    return out


def longest_module(modules: set[str], dotted: str) -> str | None:
    """The longest module that `dotted` names (`a.b.Thing` -> `a.b`), or None outside the package."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        if ".".join(parts[:k]) in modules:
            return ".".join(parts[:k])
    return None


def imported_modules(modules: set[str], here: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of the package that one import statement in module `here` uses."""
    if isinstance(node, ast.Import):
        found = [longest_module(modules, alias.name) for alias in node.names]
        return [m for m in found if m]
    base = node.module or ""
    if node.level:
        # `from . import x` is relative to the package `here` belongs to (`here` itself for an `__init__`).
        package = here.split(".") if is_package else here.split(".")[:-1]
        if node.level - 1 >= len(package):
            return []
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found = sub if sub in modules else longest_module(modules, base)
        if found:
            out.append(found)
    return out


def python_graph(src: Path) -> dict[str, dict[str, list[str]]]:
    """module -> used module -> where (`file:line`, `in f()` for an import inside a function)."""
    files = {python_module_name(path.relative_to(src), src.name): path for path in sorted(src.rglob("*.py"))}
    modules = set(files)
    edges: dict[str, dict[str, list[str]]] = {name: {} for name in files}
    for here, path in files.items():
        shown = display(path)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        except SyntaxError as exc:
            raise Unparsable(f"{shown}:{exc.lineno}: not Python this check can read: {exc.msg}") from exc
        for node, function in python_imports(tree):
            where = f"{shown}:{node.lineno}" + (f" in {function}()" if function else "")
            for to in imported_modules(modules, here, path.name == "__init__.py", node):
                if to != here and where not in edges[here].get(to, []):
                    edges[here].setdefault(to, []).append(where)
    return edges


# Both ------------------------------------------------------------------------------------------


def tarjan(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components (iterative Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                components.append(sorted(comp))
    return components


def shortest_cycle(edges: dict[str, dict[str, list[str]]], comp: list[str]) -> list[str]:
    """One shortest circle through the component's first module (breadth-first)."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w not in members:
                    continue
                if w == start:
                    cycle = [v]
                    while cycle[-1] != start:
                        cycle.append(prev[cycle[-1]])
                    return [start, *reversed(cycle[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def report(src: Path, edges: dict[str, dict[str, list[str]]], show_graph: bool) -> int:
    """Print the graph's size and every cycle in it; the number of cycles."""
    cycles = [c for c in tarjan(edges) if len(c) > 1]
    n_edges = sum(len(e) for e in edges.values())
    print(f"{len(edges)} modules, {n_edges} module dependencies under `{src}`")
    if show_graph:
        for v in sorted(edges):
            print(f"  {v} -> {', '.join(sorted(edges[v])) or '(nothing)'}")
    for i, comp in enumerate(cycles, 1):
        print(f"cycle {i}: {' -> '.join(shortest_cycle(edges, comp))}  (modules: {', '.join(comp)})")
        for v in comp:
            for w in sorted(edges[v]):
                if w in comp:
                    print(f"    {v} -> {w}  ({', '.join(edges[v][w])})")
    print(f"{len(cycles)} import cycle(s)", flush=True)
    return len(cycles)


def check(src: Path, show_graph: bool) -> int:
    """Check one crate or package: 0 no cycle, 1 cycles, 2 nothing to read or a file that does not parse."""
    if src.is_dir() and any(src.rglob("*.rs")):
        edges = graph(load(src))
    elif src.is_dir() and any(src.rglob("*.py")):
        try:
            edges = python_graph(src)
        except Unparsable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        print(f"error: no Rust or Python files under `{src}`", file=sys.stderr)
        return 2
    if report(src, edges, show_graph):
        print("hint: move the types both sides need into a module below them, or the code that needs both above them", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Find module import cycles in a Rust crate's src directory or a Python package.")
    help_src = "a crate's src directory or a Python package (default: run-manager/src and python/dflash_worker)"
    parser.add_argument("srcs", nargs="*", type=Path, default=DEFAULT_SRCS, metavar="SRC", help=help_src)
    parser.add_argument("--graph", action="store_true", help="also print every module's dependencies")
    args = parser.parse_args(argv[1:])
    return max(check(src, args.graph) for src in args.srcs)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
