"""Smoke run of `bench/coordinator.py` with a few providers in both transports, so the benchmark cannot rot.

The figures of 20 providers mean nothing; what is checked is that both coordinators (plaintext
and TLS) served every phase without errors and that the closing comparison is printed.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from coordinator_helpers import REPO, subprocess_env


@pytest.mark.slow
def test_coordinator_bench_runs_plaintext_and_tls():
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "coordinator.py"), "--providers", "20", "--procs", "1", "--rates", "2", "--seconds", "1", "--modes", "plaintext,tls"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "== plaintext:" in text and "(tls False)" in text and "== tls:" in text and "(tls True)" in text, text
    assert len(re.findall(r"^heartbeat @ 40/s offered .* errors 0$", text, re.M)) == 2, text
    assert re.search(r"^@ +40/s offered +plaintext: .* tls: .* \(rate x\d+\.\d\d, p99 x\d+\.\d\d\)$", text, re.M), text


@pytest.mark.slow
def test_coordinator_bench_page_mode_compares_p99_with_and_without_pages_open():
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "coordinator.py"), "--providers", "20", "--procs", "1", "--rates", "2", "--seconds", "2",
         "--modes", "page", "--pages", "2", "--page-refresh", "0.5", "--page-repeats", "1"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"^heartbeat @ 40/s offered .* errors 0$", text, re.M), text
    assert re.search(r"^heartbeat @ 40/s offered, 2 pages open .* errors 0$", text, re.M), text
    # The pages really refreshed throughout the phase (about 2 s / 0.5 s each), without errors.
    m = re.search(r"^page refresh \(2 pages\) +(\d+) ops .* errors 0$", text, re.M)
    assert m and int(m.group(1)) >= 4, text
    assert re.search(r"^@ +40/s offered +no page: p99 +\d+\.\d\d ms +pages open: p99 +\d+\.\d\d ms +\(p99 x\d+\.\d\d, (NOT )?within 10%\) +errors 0$", text, re.M), text


@pytest.mark.slow
def test_artifacts_bench_moves_bytes_both_ways_and_prints_every_figure():
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "artifacts.py"), "--sizes", "3M", "--repeats", "2", "--heartbeats", "10", "--hb-size", "4M", "--hb-seconds", "1"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "== 3 MiB, 2 rounds" in text and "median of 2 rounds (sha256 verified):" in text, text
    rounds = re.findall(r"^round (\d): cp +\d+\.\d\d s +user-space copy +\d+\.\d\d s +grpc sink +\d+\.\d\d s +upload +\d+\.\d\d s +download +\d+\.\d\d s +run-manager upload +\d+\.\d\d s +\(sha256 verified\)$", text, re.M)
    assert rounds == ["1", "2"], text
    assert re.search(r"^cp \+ fsync \(baseline\) +\d+\.\d\d s .* \(rounds \d+\.\d\d-\d+\.\d\d s\)$", text, re.M), text
    assert re.search(r"^grpc sink \(no disk, hash\) +\d+\.\d\d s .* x\d+\.\d\d of cp$", text, re.M), text
    assert re.search(r"^user-space copy \+ fsync +\d+\.\d\d s .* x\d+\.\d\d of cp$", text, re.M), text
    for way in ("upload", "download"):
        assert re.search(rf"^{way} +\d+\.\d\d s .* x\d+\.\d\d of cp +x\d+\.\d\d of the user-space copy$", text, re.M), text
    # The run-manager's own uploader (`run-manager --upload-file`) moved the same file, in the same run.
    assert re.search(r"^run-manager upload +\d+\.\d\d s .* x\d+\.\d\d of cp +x\d+\.\d\d of the Python client's upload$", text, re.M), text
    assert re.search(r"^  its hash pass before +\d+\.\d\d s +\d+\.\d MiB/s", text, re.M), text
    assert re.search(r"^peak RSS, run-manager +\d+\.\d MiB +\(the whole process, highest of the rounds\)$", text, re.M), text
    assert "goal, run-manager upload >= 0.8 of the Python client's for files of 1 GiB and more: not measured (no size >= 1G)" in text, text
    assert re.search(r"^goal, run-manager peak RSS < 64 MiB at every size: (met|NOT met)$", text, re.M), text
    assert re.search(r"^peak RSS over baseline +coordinator +\d+\.\d MiB +client +\d+\.\d MiB +\(highest of the rounds\)$", text, re.M), text
    assert "goal, throughput >= 0.5 of cp each way for files of 1 GiB and more: not measured (no size >= 1G)" in text, text
    assert re.search(r"^goal, peak RSS < 64 MiB over baseline at every size, sha256 verified: (met|NOT met)$", text, re.M), text
    assert re.search(r"^heartbeat, during upload .* errors 0$", text, re.M) and "sha256 ok" in text, text
