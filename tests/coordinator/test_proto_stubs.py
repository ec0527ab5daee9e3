"""The committed gRPC stubs are exactly what scripts/gen-proto.sh generates from proto/."""

from __future__ import annotations

import subprocess
import sys

from coordinator_helpers import REPO

STUBS = REPO / "python" / "dflash_worker" / "proto" / "dflash" / "v1"


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    out = tmp_path / "v1"
    subprocess.run([str(REPO / "scripts" / "gen-proto.sh"), str(out)], check=True, capture_output=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    fresh = {p.name: p.read_bytes() for p in out.iterdir()}
    committed = {p.name: p.read_bytes() for p in STUBS.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "stub file set drifted; run `make proto`"
    drifted = [name for name in fresh if fresh[name] != committed[name]]
    assert not drifted, f"stubs drifted from proto/: {drifted}\nhint: run `make proto` and commit the result"


def test_generation_is_deterministic(tmp_path):
    outs = []
    for i in range(2):
        out = tmp_path / f"v1-{i}"
        subprocess.run([str(REPO / "scripts" / "gen-proto.sh"), str(out)], check=True, capture_output=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
        outs.append({p.name: p.read_bytes() for p in out.iterdir()})
    assert outs[0] == outs[1]


def test_stubs_import_as_package_modules():
    from dflash_worker.proto.dflash.v1 import admin_pb2, admin_pb2_grpc, provider_pb2, provider_pb2_grpc

    # admin.proto imports provider.proto: the cross-import must resolve to our package
    assert admin_pb2.DESCRIPTOR.dependencies[0].name == "dflash/v1/provider.proto"
    assert admin_pb2.JobInfo().export.__class__ is provider_pb2.Artifact
    assert hasattr(provider_pb2_grpc, "ProviderServiceStub") and hasattr(admin_pb2_grpc, "AdminServiceStub")
    for f in STUBS.glob("*.py"):
        assert "from dflash.v1 import" not in f.read_text(), f.name
