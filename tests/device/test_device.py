"""Device resolution, required backends, BF16 probe override, RNG capture/restore, timers, memory, provenance."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from dflash_worker import device as dv
from dflash_worker.errors import ConfigError, DeviceError, ResumeError

HAS_CUDA = torch.cuda.is_available()
HAS_MPS = dv.mps_available()


@pytest.fixture
def no_gpu(monkeypatch):
    """Simulate a machine with neither CUDA nor MPS, whatever this one has."""
    monkeypatch.setattr(dv, "cuda_available", lambda: False)
    monkeypatch.setattr(dv, "mps_available", lambda: False)


@pytest.fixture
def mac(monkeypatch):
    monkeypatch.setattr(dv, "cuda_available", lambda: False)
    monkeypatch.setattr(dv, "mps_available", lambda: True)


def test_env_names_are_constants():
    assert (dv.ENV_REQUIRE_CUDA, dv.ENV_REQUIRE_MPS, dv.ENV_MPS_BF16) == (
        "DFLASH_REQUIRE_CUDA",
        "DFLASH_REQUIRE_MPS",
        "DFLASH_MPS_BF16",
    )


def test_auto_picks_cpu_without_accelerators(no_gpu):
    ch = dv.resolve_device("auto", env={})
    assert ch.device == "cpu" and not ch.fallback_used


def test_auto_prefers_mps_on_a_mac(mac):
    assert dv.resolve_device("auto", env={}).device == "mps"


@pytest.mark.parametrize("req", ["cuda", "cuda:0", "mps"])
def test_explicit_missing_backend_is_an_error(no_gpu, req):
    with pytest.raises(DeviceError) as err:
        dv.resolve_device(req, env={})
    msg = str(err.value)
    assert f"`--device {req}`" in msg and "hint:" in msg


@pytest.mark.parametrize("var,req", [("DFLASH_REQUIRE_MPS", "auto"), ("DFLASH_REQUIRE_CUDA", "auto"), ("DFLASH_REQUIRE_MPS", "mps")])
def test_required_backend_never_falls_back(no_gpu, var, req):
    # not even when the caller allows a CPU fallback
    with pytest.raises(DeviceError, match=var):
        dv.resolve_device(req, env={var: "1"}, allow_cpu_fallback=True)


def test_required_backend_reads_process_environment(no_gpu, monkeypatch):
    monkeypatch.setenv(dv.ENV_REQUIRE_MPS, "1")
    with pytest.raises(DeviceError, match="DFLASH_REQUIRE_MPS"):
        dv.resolve_device("auto")


def test_require_conflicting_with_explicit_device(no_gpu):
    with pytest.raises(DeviceError, match="conflicts"):
        dv.resolve_device("cpu", env={dv.ENV_REQUIRE_MPS: "1"})
    with pytest.raises(DeviceError, match="at most one"):
        dv.resolve_device("auto", env={dv.ENV_REQUIRE_MPS: "1", dv.ENV_REQUIRE_CUDA: "1"})


def test_require_satisfied(mac):
    assert dv.resolve_device("auto", env={dv.ENV_REQUIRE_MPS: "1"}).device == "mps"


def test_explicit_fallback_is_recorded(no_gpu):
    ch = dv.resolve_device("mps", allow_cpu_fallback=True, env={})
    assert ch.device == "cpu" and ch.fallback_used and "MPS" in ch.fallback_reason
    prov = dv.provenance(ch)
    assert prov["fallback_used"] is True and prov["device"] == "cpu" and prov["device_requested"] == "mps"
    json.dumps(prov)


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "mps:1", ""])
def test_unknown_device_names(bad):
    if bad == "":
        assert dv.resolve_device(bad, env={}).requested == "auto"
        return
    with pytest.raises(ConfigError, match="unknown device"):
        dv.resolve_device(bad, env={})


def test_bad_flag_value(no_gpu):
    with pytest.raises(ConfigError, match="DFLASH_REQUIRE_CUDA"):
        dv.resolve_device("auto", env={dv.ENV_REQUIRE_CUDA: "maybe"})


def test_mps_bf16_override_honoured(mac, monkeypatch):
    assert dv.mps_bf16_supported({dv.ENV_MPS_BF16: "1"}) == (True, "override DFLASH_MPS_BF16=1")
    assert dv.mps_bf16_supported({dv.ENV_MPS_BF16: "0"})[0] is False
    ch = dv.DeviceChoice(requested="mps", device="mps")
    assert dv.compute_dtype(ch, {dv.ENV_MPS_BF16: "1"})[0] == torch.bfloat16
    dtype, why = dv.compute_dtype(ch, {dv.ENV_MPS_BF16: "0"})
    assert dtype == torch.float16 and "float16 fallback" in why
    with pytest.raises(ConfigError, match="DFLASH_MPS_BF16"):
        dv.mps_bf16_supported({dv.ENV_MPS_BF16: "yes"})


def test_mps_bf16_probe_without_mps(no_gpu):
    assert dv.mps_bf16_supported({}) == (False, "probe: mps unavailable")


@pytest.mark.skipif(not HAS_MPS, reason="no MPS device on this machine")
@pytest.mark.mps
def test_mps_bf16_probe_runs_on_mps():
    ok, how = dv.mps_bf16_supported({})
    assert how.startswith("probe")


def test_cpu_policy():
    ch = dv.DeviceChoice(requested="cpu", device="cpu")
    assert dv.compute_dtype(ch)[0] == torch.float32


@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device on this machine")
@pytest.mark.cuda
def test_cuda_policy():
    ch = dv.resolve_device("cuda", env={})
    snap = dv.memory_snapshot(ch)
    assert snap["kind"] == "snapshot" and "allocated_bytes" in snap


def _draws():
    return (
        [random.random() for _ in range(3)],
        np.random.rand(3).tolist(),
        np.random.normal(size=2).tolist(),
        torch.rand(4).tolist(),
        torch.randint(0, 10**9, (3,)).tolist(),
    )


def test_rng_round_trip_reproduces_stream_exactly():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = dv.capture_rng_state()
    text = json.dumps(state)  # serialisable as a checkpoint field
    first = _draws()
    _draws()  # move every generator on
    dv.restore_rng_state(json.loads(text))
    assert _draws() == first  # exact values, every generator


def test_rng_restore_rejects_bad_state():
    good = dv.capture_rng_state()
    with pytest.raises(ResumeError, match="version"):
        dv.restore_rng_state({**good, "version": 99})
    with pytest.raises(ResumeError, match="malformed"):
        dv.restore_rng_state({k: v for k, v in good.items() if k != "numpy"})
    with pytest.raises(ResumeError):
        dv.restore_rng_state({**good, "torch_cpu": "not base64!"})
    with pytest.raises(ResumeError):
        dv.restore_rng_state("nope")  # type: ignore[arg-type]
    with pytest.raises(ResumeError, match="bytes"):
        dv.restore_rng_state({**good, "torch_cpu": good["torch_cpu"][:40]})
    # a failed restore leaves every generator untouched (python was not half-restored)
    random.seed(77)
    expect = random.getstate()
    with pytest.raises(ResumeError):
        dv.restore_rng_state({**good, "torch_cpu": good["torch_cpu"][:40]})
    assert random.getstate() == expect
    if not HAS_CUDA:
        with pytest.raises(ResumeError, match="CUDA"):
            dv.restore_rng_state({**good, "cuda": [good["torch_cpu"]]})
    # nothing was changed by the failed restores
    dv.restore_rng_state(good)
    a = torch.rand(2)
    dv.restore_rng_state(good)
    assert torch.equal(a, torch.rand(2))


def test_timer_and_memory_labels():
    with dv.SyncTimer("cpu") as t:
        sum(range(10000))
    assert t.seconds > 0
    snap, peak = dv.memory_snapshot(), dv.memory_peak()
    assert snap["kind"] == "snapshot" and peak["kind"] == "peak"
    assert snap["process_rss_bytes"] > 10 * 2**20
    assert peak["process_max_rss_bytes"] >= snap["process_rss_bytes"] * 0.5


def test_provenance_fields():
    prov = dv.provenance(dv.resolve_device("cpu", env={}))
    for key in ("device", "os", "python", "torch", "transformers", "fallback_used"):
        assert key in prov
    assert prov["torch"] == torch.__version__ and prov["fallback_used"] is False
