"""docker/Dockerfile installs exactly the pins of requirements/lock.txt (which agree with pyproject.toml),
and in the CUDA flavor alone the GPU kernels pinned in requirements/cuda.txt.

These tests read the Dockerfile as text and check what each flavor would do. The CPU flavor is
built and run for real by tests/e2e/test_e2e_docker.py; the CUDA flavor needs PyPI, a CUDA base
image and a GPU (scripts/gpu-check-docker.sh).
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
LOCK = ROOT / "requirements" / "lock.txt"
CUDA = ROOT / "requirements" / "cuda.txt"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins() -> dict[str, str]:
    pins = {}
    for n, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;]+)", line)
        assert m, f"{LOCK}:{n}: `{line}` is not `name==version`"
        pins[norm(m.group(1))] = m.group(3)
    return pins


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = {}
    for dep in project["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*==\s*([^\s;]+)", dep)
        if m:
            pins[norm(m.group(1))] = m.group(2)
    return pins


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not buf and (not s or s.startswith("#")):
            continue
        if s.startswith("#"):
            continue
        if s.endswith("\\"):
            buf += s[:-1] + " "
            continue
        buf += s
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def pip_installs(text: str) -> list[list[str]]:
    """Argument lists of every `pip install` the RUN instructions execute."""
    calls = []
    for word, rest in instructions(text):
        if word != "RUN":
            continue
        # Tokenize with quotes respected, then cut the command list at shell operators.
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        argv: list[str] = []
        for tok in [*lexer, ";"]:
            if tok in ("&&", "||", ";", "|", "&"):
                if len(argv) > 1 and argv[0].endswith("pip") and argv[1] == "install":
                    calls.append(argv[2:])
                argv = []
            else:
                argv.append(tok)
    return calls


def test_lock_and_pyproject_agree_on_every_pin():
    lock, py = lock_pins(), pyproject_pins()
    assert py, "pyproject.toml pins nothing with `==`"
    for name, version in py.items():
        assert lock.get(name) == version, f"pyproject pins `{name}=={version}`, lock has `{lock.get(name)}`"
    assert (lock["torch"], lock["transformers"]) == ("2.13.0", "5.24.0")
    assert (py["torch"], py["transformers"]) == ("2.13.0", "5.24.0")


def test_dockerfile_installs_exactly_the_lock():
    text = DOCKERFILE.read_text()
    copies = [rest.split() for word, rest in instructions(text) if word == "COPY"]
    # The lock file goes into the runtime stage, and pip installs from that copy.
    lock_dests = [c[-1] for c in copies if c[:-1] == ["requirements/lock.txt"]]
    assert lock_dests, copies
    installs = pip_installs(text)
    from_lock = [a for a in installs if "-r" in a and a[a.index("-r") + 1] in lock_dests]
    assert from_lock, installs
    for args in installs:
        if args in from_lock:
            # No extra package names beside the lock, no constraint or index overrides; the offline
            # CPU flavor reads the same pins from a directory of wheels instead of an index.
            links = {args[i + 1] for i, a in enumerate(args[:-1]) if a == "--find-links"}
            assert not links or "--no-index" in args, args
            extra = [a for a in args if not a.startswith("-") and a not in lock_dests and a not in links]
            assert not extra, args
            assert not {"-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-U", "--upgrade"} & set(args), args
            continue
        if "-r" in args and args[args.index("-r") + 1] in cuda_dests(text):
            continue  # the CUDA flavor's kernels: test_cuda_kernels_are_pinned_apart_and_cuda_only
        pkgs = [a for a in args if not a.startswith("-")]
        if "--no-deps" in args:
            # This package's own wheel, built in the image: brings nothing else.
            assert all(p.startswith("/tmp/dist/dflash_worker-") for p in pkgs), args
        else:
            # Anything else must be pinned to the lock's exact version (e.g. maturin in the build stage).
            lock = lock_pins()
            for p in pkgs:
                m = re.fullmatch(r'"?\$\(grep -i \'\^([a-z0-9_.\-]+)==\' \S+\)"?', p) or re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", p)
                assert m, f"unpinned install `{p}` in {args}"
                name = norm(m.group(1))
                assert name in lock, name
                if m.lastindex == 2:
                    assert lock[name] == m.group(2), (name, m.group(2), lock[name])
    assert "pip check" in text


def cuda_dests(text: str) -> list[str]:
    """Where the Dockerfile copies requirements/cuda.txt."""
    return [c[-1] for c in (rest.split() for word, rest in instructions(text) if word == "COPY") if c[:-1] == ["requirements/cuda.txt"]]


def test_cuda_kernels_are_pinned_apart_and_cuda_only():
    """requirements/cuda.txt (flash-linear-attention, GPU-only) pins every package it adds, overrides no
    pin of the lock, and is installed `--no-deps` in the CUDA flavor's dependency stage alone."""
    pins = {}
    for n, line in enumerate(CUDA.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
            assert m, f"{CUDA}:{n}: `{line}` is not `name==version`"
            pins[norm(m.group(1))] = m.group(2)
    assert {"flash-linear-attention", "fla-core"} <= set(pins), pins
    assert not set(pins) & set(lock_pins()), "requirements/cuda.txt repeats a pin of the lock"
    text = DOCKERFILE.read_text()
    stage, holders = None, []
    for word, rest in instructions(text):  # the stages whose instructions name the file
        stage = rest if word == "FROM" else stage
        if word != "FROM" and "cuda.txt" in rest and stage not in holders:
            holders.append(stage)
    assert holders == ["python AS deps-cuda"], holders
    dests = cuda_dests(text)
    installs = [a for a in pip_installs(text) if "-r" in a and a[a.index("-r") + 1] in dests]
    assert len(installs) == 1 and "--no-deps" in installs[0], installs
    assert not {"-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-U", "--upgrade"} & set(installs[0])


def test_dockerfile_shape():
    text = DOCKERFILE.read_text()
    ins = instructions(text)
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"nvidia/cuda:[0-9.]+-runtime-ubuntu[0-9.]+", base.group(1)), base
    debian = re.search(r"^ARG DEBIAN_IMAGE=(\S+)$", text, re.M)
    assert debian and debian.group(1).startswith("dflash-debian-base:"), debian
    assert re.search(r"^ARG FLAVOR=cuda$", text, re.M), "the default flavor must be the CUDA image"
    stages = {rest.split()[-1] for w, rest in ins if w == "FROM" and " AS " in rest}
    froms = [rest.split()[0] for w, rest in ins if w == "FROM"]
    assert all(f in ("${CUDA_IMAGE}", "${DEBIAN_IMAGE}", "scratch", "deps-${FLAVOR}", "dist-${FLAVOR}") or f in stages for f in froms), froms
    # Each flavor has the stages `deps-${FLAVOR}` and `dist-${FLAVOR}` name, and the default target is the runtime.
    assert {"deps-cuda", "dist-cuda", "deps-cpu", "dist-cpu", "runtime"} <= stages, stages
    assert [rest for w, rest in ins if w == "FROM"][-1] == "deps AS runtime"
    # No `# syntax=` frontend: BuildKit would pull it, and the CPU build is offline.
    assert not re.search(r"^#\s*syntax=", text, re.M | re.I)
    assert "python3.11" in text
    # The runtime stage runs as a non-root user with the native client as entrypoint.
    last_stage = text[text.rindex("\nFROM ") :]
    users = [rest for w, rest in instructions(last_stage) if w == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    entry = [rest for w, rest in instructions(last_stage) if w == "ENTRYPOINT"]
    assert entry and entry[-1].endswith('/dflash-native-client"]'), entry
    assert "maturin build --release --locked" in text
    # The image never asks for privileges; the run-manager adds the hardening flags.
    assert "privileged" not in text.replace("no-new-privileges", "")


def test_helpers_can_fail():
    bad = "FROM x\nRUN pip install torch && pip install -r /l.txt\n"
    assert pip_installs(bad) == [["torch"], ["-r", "/l.txt"]]
    assert instructions("RUN a \\\n  b\n# c\nUSER me\n") == [("RUN", "a  b"), ("USER", "me")]
