"""`scripts/check-structure.py` reports the coordinator's largest class and file and fails on a class over
400 lines.

Fake packages in a temporary directory show the check can fail (naming the class and its length), where the
limit lies, what counts as a class's lines (nested classes, decorators), and its errors; the real coordinator
package must pass.
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


def test_the_coordinator_has_no_class_over_400_lines() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    m = re.search(r"largest class: python/dflash_worker/coordinator/\S+:\w[\w.]* \((\d+) lines\)", r.stdout)
    assert m and int(m.group(1)) <= 400, r.stdout
