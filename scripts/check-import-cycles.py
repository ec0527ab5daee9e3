#!/usr/bin/env python3
"""Find module import circles in the run-manager crate; exit 1 when there is one.

A circle (`error` uses `tls_fault`, which uses `transport`, which uses `error`) means no module in
it can be read, tested or moved without the others (issue 37). This check builds the crate's
module graph from the source text and prints every strongly connected component of more than one
module (Tarjan), each with one shortest circle through it and the references that make it.

- Modules: every `.rs` file under SRC is one (`a.rs` and `a/mod.rs` are `a`, `a/b.rs` is `a::b`;
  `lib.rs` and `main.rs` are the crate roots `crate` and `main`). Inline `mod x { ... }` blocks
  belong to their file's module.
- References: `use` trees and paths starting with `crate::`, `super::` or `self::`, and in files
  that declare `mod x;`, paths starting with `x::`. A path goes to the longest module it names;
  a name the module re-exports (`pub use error::{Error, Result};` in `lib.rs`) is followed to the
  module it comes from, so `crate::Error` is a use of `error`.
- Ignored: comments (doc comments too), string and char literals, and every item under
  `#[cfg(test)]` (`mod tests { ... }`, test helpers): tests may reach across layers.

Standard library only, so it runs before any environment is built.

Usage: scripts/check-import-cycles.py [--graph] [SRC]   (SRC defaults to run-manager/src;
`--graph` also prints every module's dependencies)
Exit codes: 0 no circle, 1 circles found, 2 bad SRC.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SRC = Path(__file__).resolve().parent.parent / "run-manager" / "src"
ROOT = "crate"

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# `pub(crate) use a::{b, c};` (the tree is parsed by `expand_use`).
USE_RE = re.compile(r"(?<![\w$])(?:pub\s*(?:\([^)]*\))?\s*)?use\s+([^;]*);")
# `crate::a::b`, `super::super::x`, `self::x`, `child::x` outside `use` (not `$crate::`, a macro's).
PATH_RE = re.compile(rf"(?<![\w$:])((?:crate|super|self|{IDENT})(?:\s*::\s*{IDENT})+)")
MOD_DECL_RE = re.compile(rf"(?<![\w$])(?:pub\s*(?:\([^)]*\))?\s*)?mod\s+({IDENT})\s*[;{{]")
RAW_RE = re.compile(r'b?r(#*)"')
CFG_TEST_RE = re.compile(r"#\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]")


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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="Find module import cycles in a Rust crate's src directory.")
    parser.add_argument("src", nargs="?", type=Path, default=DEFAULT_SRC, help="the crate's src directory (default: run-manager/src)")
    parser.add_argument("--graph", action="store_true", help="also print every module's dependencies")
    args = parser.parse_args(argv[1:])
    src: Path = args.src
    if not src.is_dir() or not any(src.rglob("*.rs")):
        print(f"error: no Rust files under `{src}`", file=sys.stderr)
        return 2
    modules = load(src)
    edges = graph(modules)
    cycles = [c for c in tarjan(edges) if len(c) > 1]
    n_edges = sum(len(e) for e in edges.values())
    print(f"{len(modules)} modules, {n_edges} module dependencies under `{src}`")
    if args.graph:
        for v in sorted(edges):
            print(f"  {v} -> {', '.join(sorted(edges[v])) or '(nothing)'}")
    for i, comp in enumerate(cycles, 1):
        print(f"cycle {i}: {' -> '.join(shortest_cycle(edges, comp))}  (modules: {', '.join(comp)})")
        for v in comp:
            for w in sorted(edges[v]):
                if w in comp:
                    print(f"    {v} -> {w}  ({', '.join(edges[v][w])})")
    print(f"{len(cycles)} import cycle(s)", flush=True)
    if cycles:
        print("hint: move the types both sides need into a module below them, or the code that needs both above them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
