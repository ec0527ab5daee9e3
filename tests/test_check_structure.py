"""`scripts/check-structure.py` reports the package's largest class, longest function and largest file,
and fails on a class over 400 lines, a function over 80 or a file over 600.

Fake packages in a temporary directory show the check can fail (naming the class, function or file and
its length), where each limit lies, what counts as a class's or function's lines (nested definitions,
decorators), that generated code is left out, and its errors; the real `python/dflash_worker` must pass.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "check-structure.py"


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), str(root)], capture_output=True, text=True, timeout=60, cwd=REPO)


def klass(name: str, lines: int, indent: str = "") -> str:
    """A class of exactly `lines` lines (its `class` line included)."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}class {name}:\n{body}"


def test_a_class_of_401_lines_fails_naming_it_and_400_passes(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "ok.py").write_text(klass("Fits", 400))
    r = check(pkg)
    assert r.returncode == 0, r.stderr
    assert re.search(r"largest class: .*ok\.py:Fits \(400 lines\)", r.stdout), r.stdout

    (pkg / "big.py").write_text("import os\n\n\n" + klass("TooBig", 401))
    r = check(pkg)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert re.search(r"class `.*big\.py:TooBig` is 401 lines, more than 400", r.stderr), r.stderr
    assert re.search(r"largest file: .*big\.py \(404 lines\)", r.stdout), r.stdout


def test_nested_classes_and_decorators_count(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    # The outer class is 1 + 401 + 1 lines; its nested class alone is over the limit too.
    (pkg / "n.py").write_text("class Outer:\n" + klass("Inner", 401, indent="    ") + "    y = 1\n")
    r = check(pkg)
    assert r.returncode == 1
    assert "n.py:Outer` is 403 lines" in r.stderr and "n.py:Outer.Inner` is 401 lines" in r.stderr, r.stderr

    (pkg / "n.py").write_text("import dataclasses\n\n\n@dataclasses.dataclass\n" + klass("Decorated", 400))
    r = check(pkg)
    assert r.returncode == 1 and "n.py:Decorated` is 401 lines" in r.stderr, r.stderr


def test_no_python_or_a_file_that_does_not_parse_is_an_error(tmp_path: Path) -> None:
    r = check(tmp_path)
    assert r.returncode == 2 and f"no Python files under `{tmp_path}`" in r.stderr, r.stderr
    (tmp_path / "broken.py").write_text("class A:\n    pass\n\ndef f(:\n")
    r = check(tmp_path)
    assert r.returncode == 2 and re.search(r"broken\.py:4: not Python", r.stderr), r.stderr
    assert "Traceback" not in r.stderr


def function(name: str, lines: int, indent: str = "") -> str:
    """A function of exactly `lines` lines (its `def` line included)."""
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(lines - 1))
    return f"{indent}def {name}() -> None:\n{body}"


def test_a_function_of_81_lines_fails_naming_it_and_80_passes(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "f.py").write_text("import os\n\n\n" + function("fits", 80))
    r = check(pkg)
    assert r.returncode == 0, r.stderr
    assert re.search(r"longest function: .*f\.py:fits \(80 lines\)", r.stdout), r.stdout

    (pkg / "g.py").write_text("class Holder:\n" + function("too_long", 81, indent="    "))
    r = check(pkg)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert re.search(r"error: function `.*g\.py:Holder\.too_long` is 81 lines, more than 80\nhint: ", r.stderr), r.stderr
    assert re.search(r"longest function: .*g\.py:Holder\.too_long \(81 lines\)", r.stdout), r.stdout
    assert "f.py:fits" not in r.stderr and "class `" not in r.stderr, r.stderr


def test_nested_functions_async_and_decorators_count(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    # The outer function is 1 + 81 + 1 lines; its nested function alone is over the limit too.
    (pkg / "n.py").write_text("def outer() -> None:\n" + function("inner", 81, indent="    ") + "    return None\n")
    r = check(pkg)
    assert r.returncode == 1
    assert "n.py:outer` is 83 lines" in r.stderr and "n.py:outer.inner` is 81 lines" in r.stderr, r.stderr

    # Three decorator lines (one spans two) on a 79-line method make 82; `async def` counts like `def`.
    method = function("m", 79, indent="    ").replace(
        "    def m", "    @staticmethod\n    @some.decorator(\n        1)\n    async def m", 1
    )
    (pkg / "n.py").write_text("class C:\n" + method)
    r = check(pkg)
    assert r.returncode == 1 and "n.py:C.m` is 82 lines" in r.stderr, r.stderr


def test_a_file_of_601_lines_fails_naming_it_and_600_passes(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "long.py").write_text("".join(f"x{i} = {i}\n" for i in range(600)))
    r = check(pkg)
    assert r.returncode == 0, r.stderr
    assert re.search(r"largest file: .*long\.py \(600 lines\)", r.stdout), r.stdout

    (pkg / "long.py").write_text("".join(f"x{i} = {i}\n" for i in range(601)))
    r = check(pkg)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert re.search(r"error: file `.*long\.py` is 601 lines, more than 600\nhint: ", r.stderr), r.stderr


def test_generated_files_are_left_out(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "proto").mkdir(parents=True)
    (pkg / "small.py").write_text(function("small", 3))
    # protoc's and the gRPC plugin's headers, on a file that breaks every limit.
    huge = klass("Stub", 450) + function("stub", 200)
    (pkg / "proto" / "a_pb2.py").write_text("# -*- coding: utf-8 -*-\n# Generated by the protocol buffer compiler.  DO NOT EDIT!\n" + huge)
    (pkg / "proto" / "a_pb2_grpc.py").write_text("# Generated by the gRPC Python protocol compiler plugin. DO NOT EDIT!\n" + huge)
    (pkg / "proto" / "a_pb2.pyi").write_text(huge)
    r = check(pkg)
    assert r.returncode == 0, r.stderr
    assert "pb2" not in r.stdout, r.stdout
    assert re.search(r"largest file: .*small\.py \(3 lines\)", r.stdout), r.stdout

    # A file that only mentions the words lower down is not generated.
    (pkg / "proto" / "hand.py").write_text("import os\n\n\n\n\n# Generated by hand. DO NOT EDIT!\n" + huge)
    r = check(pkg)
    assert r.returncode == 1 and "hand.py:Stub` is 450 lines" in r.stderr and "pb2" not in r.stderr, r.stderr


def test_the_package_is_within_the_limits() -> None:
    """Over the whole of `python/dflash_worker` (the default root): the gate `make lint` runs."""
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    for label, limit in (("largest class", 400), ("longest function", 80), ("largest file", 600)):
        m = re.search(rf"{label}: +python/dflash_worker/\S+ \((\d+) lines\)", r.stdout)
        assert m and int(m.group(1)) <= limit, r.stdout
