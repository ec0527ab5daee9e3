"""`scripts/check-import-cycles.py` finds module import cycles in a Rust crate or a Python package, and
run-manager and dflash_worker have none.

Fake crates and packages in a temporary directory show the check can fail (and names the modules of the
cycle and the lines that close it) and what it does not count (Rust tests, comments, strings; Python
imports under `if TYPE_CHECKING:`); the real `run-manager/src` and `python/dflash_worker` must pass.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check-import-cycles.py"


def check(src: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *flags, str(src)], capture_output=True, text=True, timeout=60)


def crate(root: Path, files: dict[str, str]) -> Path:
    src = root / "src"
    for name, text in files.items():
        path = src / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return src


LIB = "pub mod a;\npub mod b;\npub mod c;\n"


def test_a_cycle_exits_1_and_names_its_modules(tmp_path: Path) -> None:
    src = crate(
        tmp_path,
        {
            "lib.rs": LIB,
            "a.rs": "use crate::b::Thing;\npub struct A(Thing);\n",
            "b.rs": "pub struct Thing;\npub fn f() -> crate::c::C { todo!() }\n",
            "c.rs": "use super::a::{self, A};\npub struct C(A);\n",
        },
    )
    p = check(src)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "cycle 1: a -> b -> c -> a  (modules: a, b, c)" in p.stdout, p.stdout
    assert "    c -> a  (c.rs:1)" in p.stdout, p.stdout
    assert "1 import cycle(s)" in p.stdout
    assert "hint:" in p.stderr


def test_an_acyclic_crate_exits_0(tmp_path: Path) -> None:
    src = crate(
        tmp_path,
        {
            "lib.rs": LIB + "pub use a::A;\n",
            "a.rs": "use crate::b::{self, Thing};\npub struct A(Thing);\npub fn g() { b::f(); crate::c::h(); }\n",
            "b.rs": "pub struct Thing;\npub fn f() {}\n",
            "c.rs": "pub fn h() {}\n",
        },
    )
    p = check(src)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 module dependencies" in p.stdout, p.stdout  # crate -> a, a -> b, a -> c
    assert "0 import cycle(s)" in p.stdout


def test_tests_comments_and_strings_do_not_count(tmp_path: Path) -> None:
    src = crate(
        tmp_path,
        {
            "lib.rs": LIB,
            "a.rs": "use crate::b::Thing;\npub fn a() {}\n",
            "b.rs": (
                "//! Used by `crate::a`, see [`crate::a::a`].\n"
                "pub struct Thing;\n"
                "/* crate::a::a() /* nested */ crate::c::h() */\n"
                'pub const S: &str = "crate::a::a()";\n'
                'pub const R: &str = r#"use crate::a;"#;\n'
                "pub const Q: char = '\"';\n"
                "pub fn brace() -> char { '}' }\n"
                "#[cfg(test)]\nmod tests {\n    use super::*;\n    use crate::a::a;\n"
                "    #[test]\n    fn t() { let _ = Thing; a(); }\n}\n"
                "#[cfg(test)]\npub(crate) mod testing {\n    pub fn x() { crate::a::a(); }\n}\n"
                "#[cfg(test)]\nuse crate::a as _;\n"
            ),
            "c.rs": "pub fn h() {}\n",
        },
    )
    p = check(src)
    assert p.returncode == 0, p.stdout + p.stderr


def test_re_exports_and_directory_modules_are_followed(tmp_path: Path) -> None:
    # `crate::Error` is `error::Error` (re-exported by lib.rs), so `error` -> `b` -> `error` is a cycle;
    # `cmd/x.rs` and `cmd/y.rs` reach each other through `super::` and `crate::cmd::`.
    src = crate(
        tmp_path,
        {
            "lib.rs": "pub mod b;\npub mod cmd;\npub mod error;\npub use error::{Error, Result as Res};\n",
            "error.rs": "pub struct Error(crate::b::Detail);\npub type Result<T> = std::result::Result<T, Error>;\n",
            "b.rs": "pub struct Detail;\npub fn f() -> Option<crate::Error> { None }\n",
            "cmd/mod.rs": "pub mod x;\npub mod y;\n",
            "cmd/x.rs": "pub fn x() { super::y::y(); }\n",
            "cmd/y.rs": "use crate::cmd::x;\npub fn y() { x::x(); }\n",
        },
    )
    p = check(src)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "(modules: b, error)" in p.stdout, p.stdout
    assert "(modules: cmd::x, cmd::y)" in p.stdout, p.stdout
    assert "2 import cycle(s)" in p.stdout


def test_no_source_is_an_error(tmp_path: Path) -> None:
    assert check(tmp_path).returncode == 2


def package(root: Path, files: dict[str, str]) -> Path:
    """A Python package `pkg` under `root` with `files` (paths relative to it)."""
    pkg = root / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_a_python_two_module_cycle_exits_1_naming_the_lines(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"a.py": "import os\nfrom pkg.b import B\nA = 1\n", "b.py": "B = 2\nimport pkg.a\n"})
    p = check(pkg)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "3 modules, 2 module dependencies under" in p.stdout, p.stdout
    assert "cycle 1: pkg.a -> pkg.b -> pkg.a  (modules: pkg.a, pkg.b)" in p.stdout, p.stdout
    assert re.search(r"    pkg\.a -> pkg\.b  \(\S*pkg/a\.py:2\)", p.stdout), p.stdout
    assert re.search(r"    pkg\.b -> pkg\.a  \(\S*pkg/b\.py:2\)", p.stdout), p.stdout
    assert "1 import cycle(s)" in p.stdout and "hint:" in p.stderr


def test_a_python_three_module_cycle_through_a_lazy_import_exits_1(tmp_path: Path) -> None:
    # `c` imports `a` only inside a function: still a dependency, marked with the function.
    pkg = package(
        tmp_path,
        {
            "a.py": "from pkg.b import f\n",
            "b.py": "from pkg.c import C\ndef f():\n    pass\n",
            "c.py": "class C:\n    def load(self):\n        from pkg.a import f\n        return f\n",
        },
    )
    p = check(pkg)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "cycle 1: pkg.a -> pkg.b -> pkg.c -> pkg.a  (modules: pkg.a, pkg.b, pkg.c)" in p.stdout, p.stdout
    assert re.search(r"    pkg\.c -> pkg\.a  \(\S*pkg/c\.py:3 in C\.load\(\)\)", p.stdout), p.stdout


def test_a_type_checking_only_back_import_is_not_a_cycle(tmp_path: Path) -> None:
    back = "from typing import TYPE_CHECKING\nimport typing\nif TYPE_CHECKING:\n    from pkg.a import A\nif typing.TYPE_CHECKING:\n    import pkg.a\n"
    pkg = package(tmp_path, {"a.py": "from pkg.b import B\nclass A: ...\n", "b.py": back + "class B: ...\n"})
    p = check(pkg)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "3 modules, 1 module dependencies" in p.stdout and "0 import cycle(s)" in p.stdout, p.stdout

    # The `else:` of `if TYPE_CHECKING:` runs, so it counts.
    (pkg / "b.py").write_text(back + "else:\n    from pkg import a\n")
    p = check(pkg)
    assert p.returncode == 1 and "(modules: pkg.a, pkg.b)" in p.stdout, p.stdout
    assert re.search(r"pkg\.b -> pkg\.a  \(\S*pkg/b\.py:8\)", p.stdout), p.stdout


def test_relative_imports_are_resolved(tmp_path: Path) -> None:
    # `sub.x` -> `sub.y` by `from . import y`; `sub.y` -> `sub.x` by `from .x import X`;
    # `sub.y` -> `pkg.top` by `from ..top import T`, which is acyclic; `sub/__init__` -> `sub.x` by `from .x import X`.
    pkg = package(
        tmp_path,
        {
            "top.py": "T = 1\n",
            "sub/__init__.py": "from .x import X\n",
            "sub/x.py": "from . import y\nX = 1\n",
            "sub/y.py": "from ..top import T\nfrom .x import X\n",
        },
    )
    p = check(pkg, "--graph")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "  pkg.sub -> pkg.sub.x\n" in p.stdout and "  pkg.sub.y -> pkg.sub.x, pkg.top\n" in p.stdout, p.stdout
    assert "cycle 1: pkg.sub.x -> pkg.sub.y -> pkg.sub.x  (modules: pkg.sub.x, pkg.sub.y)" in p.stdout, p.stdout
    assert "1 import cycle(s)" in p.stdout


def test_from_package_import_goes_to_the_submodule_or_the_package(tmp_path: Path) -> None:
    # `from pkg import b, helper`: `b` is the submodule `pkg.b`, `helper` a name in `pkg/__init__.py`.
    pkg = package(tmp_path, {"__init__.py": "def helper(): ...\n", "a.py": "from pkg import b, helper\n", "b.py": "X = 1\n"})
    p = check(pkg, "--graph")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "  pkg.a -> pkg, pkg.b\n" in p.stdout and "  pkg.b -> (nothing)\n" in p.stdout, p.stdout

    # A package's `__init__` is a module like any other: re-exporting from a module that imports the
    # package back is a cycle.
    (pkg / "__init__.py").write_text("from .b import X\ndef helper(): ...\n")
    (pkg / "b.py").write_text("X = 1\nfrom pkg import helper\n")
    p = check(pkg)
    assert p.returncode == 1 and "cycle 1: pkg -> pkg.b -> pkg  (modules: pkg, pkg.b)" in p.stdout, p.stdout


def test_an_unparsable_python_file_is_an_error_naming_it(tmp_path: Path) -> None:
    pkg = package(tmp_path, {"a.py": "import os\n", "broken.py": "import os\n\ndef f(:\n"})
    p = check(pkg)
    assert p.returncode == 2, p.stdout + p.stderr
    assert re.search(r"error: \S*pkg/broken\.py:3: not Python", p.stderr), p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.parametrize("src", [REPO / "run-manager" / "src", REPO / "python" / "dflash_worker"], ids=["run-manager", "dflash_worker"])
def test_the_tree_has_no_import_cycles(src: Path) -> None:
    p = check(src)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 import cycle(s)" in p.stdout


def test_with_no_argument_both_the_crate_and_the_package_are_checked() -> None:
    p = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert re.search(r"modules, \d+ module dependencies under `\S*run-manager/src`", p.stdout), p.stdout
    assert re.search(r"modules, \d+ module dependencies under `\S*python/dflash_worker`", p.stdout), p.stdout
