"""`scripts/check-import-cycles.py` finds module import cycles in a Rust crate, and run-manager has none.

Fake crates in a temporary directory show the check can fail (and names the modules of the
cycle) and what it does not count (tests, comments, strings); the real `run-manager/src` must pass.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check-import-cycles.py"


def check(src: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(src)], capture_output=True, text=True, timeout=60)


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


@pytest.mark.parametrize("src", [REPO / "run-manager" / "src"], ids=["run-manager"])
def test_run_manager_has_no_import_cycles(src: Path) -> None:
    p = check(src)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 import cycle(s)" in p.stdout
