"""Device resolution and device-dependent policy: which backend, which dtype, what is allowed.

`resolve_device("auto" | "cpu" | "cuda[:N]" | "mps")` picks the backend. A
backend that was asked for (explicitly, or through `DFLASH_REQUIRE_CUDA=1` /
`DFLASH_REQUIRE_MPS=1`) and is missing raises `DeviceError`; falling back to
the CPU happens only when the caller passes `allow_cpu_fallback=True`, never
under a REQUIRE variable, and is recorded in the returned `DeviceChoice` (and
in `provenance()`).

Also here: the MPS BF16 probe (`DFLASH_MPS_BF16=1|0` overrides it; float16 is
the fallback), RNG capture/restore for every generator a resumed run must replay, a
synchronised timer, memory figures labelled `snapshot` or `peak`, and the
provenance dict written into manifests (with, once a hybrid target was built in
the process, which Gated DeltaNet kernels it runs: `weights.linear_kernels`).
"""

from __future__ import annotations

import base64
import os
import platform
import random
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .errors import ConfigError, DeviceError, ResumeError

ENV_REQUIRE_CUDA = "DFLASH_REQUIRE_CUDA"
ENV_REQUIRE_MPS = "DFLASH_REQUIRE_MPS"
ENV_MPS_BF16 = "DFLASH_MPS_BF16"

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
RNG_STATE_VERSION = 1


# ---------------------------------------------------------------------- availability
# Module-level so tests can simulate machines by monkeypatching these two.
def cuda_available() -> bool:
    return torch.cuda.is_available()


def mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _flag(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"environment variable `{name}` has value `{env.get(name)}`\nhint: use `1` or `0`")


@dataclass(frozen=True)
class DeviceChoice:
    """Outcome of `resolve_device`: what was asked for, what runs, and whether that is a fallback."""

    requested: str
    device: str  # torch device string, e.g. "cuda:0", "mps", "cpu"
    fallback_used: bool = False
    fallback_reason: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def type(self) -> str:
        return torch.device(self.device).type

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["notes"] = list(self.notes)
        return out


def resolve_device(
    requested: str = "auto",
    *,
    allow_cpu_fallback: bool = False,
    env: Mapping[str, str] | None = None,
) -> DeviceChoice:
    """Resolve `--device`. Raises `DeviceError` when a required backend is missing."""
    env = os.environ if env is None else env
    text = (requested or "auto").strip().lower()
    kind, _, index = text.partition(":")
    if kind not in DEVICE_CHOICES or (index and (kind != "cuda" or not index.isdigit())):
        raise ConfigError(f"unknown device `{requested}`\nhint: use one of `auto`, `cpu`, `cuda`, `cuda:N`, `mps`")
    need_cuda = _flag(env, ENV_REQUIRE_CUDA)
    need_mps = _flag(env, ENV_REQUIRE_MPS)
    if need_cuda and need_mps:
        raise DeviceError(f"both `{ENV_REQUIRE_CUDA}` and `{ENV_REQUIRE_MPS}` are set\nhint: require at most one backend")
    if need_cuda and kind in ("cpu", "mps"):
        raise DeviceError(f"`--device {text}` conflicts with `{ENV_REQUIRE_CUDA}=1`\nhint: use `--device cuda` or unset `{ENV_REQUIRE_CUDA}`")
    if need_mps and kind in ("cpu", "cuda"):
        raise DeviceError(f"`--device {text}` conflicts with `{ENV_REQUIRE_MPS}=1`\nhint: use `--device mps` or unset `{ENV_REQUIRE_MPS}`")

    want = kind
    if kind == "auto":
        want = "cuda" if need_cuda else "mps" if need_mps else None
    if want is None:  # plain auto: best available, CPU is a normal outcome here
        if cuda_available():
            return DeviceChoice(requested=text, device="cuda:0")
        if mps_available():
            return DeviceChoice(requested=text, device="mps")
        return DeviceChoice(requested=text, device="cpu")
    if want == "cpu":
        return DeviceChoice(requested=text, device="cpu")

    present = cuda_available() if want == "cuda" else mps_available()
    if present and want == "cuda" and index and int(index) >= torch.cuda.device_count():
        raise DeviceError(f"`cuda:{index}` does not exist; this machine has `{torch.cuda.device_count()}` CUDA devices")
    if present:
        return DeviceChoice(requested=text, device=f"cuda:{index or 0}" if want == "cuda" else "mps")

    required_by_env = need_cuda or need_mps
    why = (
        f"CUDA was requested but torch reports no usable CUDA device (torch `{torch.__version__}`, built for CUDA `{torch.version.cuda}`)"
        if want == "cuda"
        else "MPS was requested but torch reports the Metal backend unavailable (needs Apple Silicon, macOS 12.3+, an MPS-enabled torch)"
    )
    if allow_cpu_fallback and not required_by_env:
        return DeviceChoice(requested=text, device="cpu", fallback_used=True, fallback_reason=why)
    source = f"`{ENV_REQUIRE_CUDA if need_cuda else ENV_REQUIRE_MPS}=1`" if required_by_env else f"`--device {text}`"
    raise DeviceError(
        f"{why.lower()}; required by {source}\n"
        "hint: fix the driver/install, or run with `--device cpu` (slow) if a CPU run is acceptable"
    )


# ---------------------------------------------------------------------- dtype / features
def mps_bf16_supported(env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """(supported, how we know). `DFLASH_MPS_BF16=1|0` overrides the probe."""
    env = os.environ if env is None else env
    raw = env.get(ENV_MPS_BF16, "").strip()
    if raw:
        if raw not in ("0", "1"):
            raise ConfigError(f"environment variable `{ENV_MPS_BF16}` has value `{raw}`\nhint: use `1` or `0`")
        return raw == "1", f"override {ENV_MPS_BF16}={raw}"
    if not mps_available():
        return False, "probe: mps unavailable"
    try:
        a = torch.ones(8, 8, dtype=torch.bfloat16, device="mps")
        ok = bool(torch.isfinite((a @ a).float().sum().cpu()))
        return ok, "probe: bf16 matmul ran on mps"
    except Exception as exc:  # older macOS raises on bf16 kernels
        return False, f"probe failed: {type(exc).__name__}"


def compute_dtype(choice: DeviceChoice, env: Mapping[str, str] | None = None) -> tuple[torch.dtype, str]:
    """Training/inference dtype for the device, with the reason.

    CUDA: bf16 where supported, else float16. MPS: bf16 if the probe (or
    override) says so, else float16. CPU: float32.
    """
    if choice.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "cuda bf16 supported"
        return torch.float16, "cuda without bf16: float16"
    if choice.type == "mps":
        ok, how = mps_bf16_supported(env)
        return (torch.bfloat16, how) if ok else (torch.float16, f"{how}: float16 fallback")
    return torch.float32, "cpu float32"


# ---------------------------------------------------------------------- RNG
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text.encode("ascii"), validate=True)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a run draws from, as a JSON-serialisable dict (python, numpy, torch CPU/CUDA/MPS)."""
    import numpy as np

    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "version": RNG_STATE_VERSION,
        "python": [version, list(words), gauss],
        "numpy": {"kind": kind, "keys": [int(x) for x in keys], "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch_cpu": _b64(torch.get_rng_state()),
        "cuda": [_b64(s) for s in torch.cuda.get_rng_state_all()] if cuda_available() else None,
        "mps": _b64(torch.mps.get_rng_state()) if mps_available() else None,
    }
    return state


def seed_rng_state(seed: int) -> None:
    """Seed every RNG `capture_rng_state` saves (python, numpy, torch CPU and accelerators) from `seed`.

    A fresh training run does this before its first step, so the RNG state its checkpoints hold
    depends on the recipe alone, not on what the process drew before: a replay from step 0 on
    another machine commits the same ``rng.json`` (verification by replay)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # (also every CUDA and MPS device)


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of `capture_rng_state`. Raises `ResumeError` on a malformed or mismatched state."""
    import numpy as np

    if not isinstance(state, Mapping) or state.get("version") != RNG_STATE_VERSION:
        found = state.get("version") if isinstance(state, Mapping) else type(state).__name__
        raise ResumeError(f"rng state has version `{found}`, expected `{RNG_STATE_VERSION}`")
    try:
        version, words, gauss = state["python"]
        npst = state["numpy"]
        cpu = _unb64(state["torch_cpu"])
        cuda = state.get("cuda")
        mps = state.get("mps")
        py_state = (int(version), tuple(int(w) for w in words), gauss)
        np_state = (
            str(npst["kind"]),
            np.asarray(npst["keys"], dtype=np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["cached_gaussian"]),
        )
        cuda_states = None if cuda is None else [_unb64(s) for s in cuda]
        mps_state = None if mps is None else _unb64(mps)
    except (KeyError, TypeError, ValueError) as exc:
        raise ResumeError(f"rng state is malformed: {type(exc).__name__}: {exc}") from exc
    # validate everything before touching any generator, so a bad state changes nothing
    if cpu.numel() != torch.get_rng_state().numel():
        raise ResumeError(f"rng state: torch cpu state has `{cpu.numel()}` bytes, expected `{torch.get_rng_state().numel()}`")
    if len(py_state[1]) != len(random.getstate()[1]) or np_state[1].shape != (624,):
        raise ResumeError("rng state: python or numpy generator state has the wrong size")
    if cuda is not None and not cuda_available():
        raise ResumeError("rng state holds CUDA generators but CUDA is unavailable\nhint: resume on the device the run started on")
    if cuda is not None and len(cuda) != torch.cuda.device_count():
        raise ResumeError(f"rng state holds `{len(cuda)}` CUDA generators, this machine has `{torch.cuda.device_count()}`")
    if mps is not None and not mps_available():
        raise ResumeError("rng state holds an MPS generator but MPS is unavailable\nhint: resume on the device the run started on")
    try:
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_rng_state(cpu)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ResumeError(f"rng state could not be restored: {exc}") from exc
    if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)
    if mps_state is not None:
        torch.mps.set_rng_state(mps_state)


# ---------------------------------------------------------------------- timing / memory
def synchronize(device: str | torch.device | DeviceChoice | None = None) -> None:
    """Wait for queued kernels so wall-clock timings cover the work."""
    dev = _as_device(device)
    if dev.type == "cuda" and cuda_available():
        torch.cuda.synchronize(dev)
    elif dev.type == "mps" and mps_available():
        torch.mps.synchronize()


class SyncTimer:
    """Context manager measuring seconds between two device synchronisations."""

    def __init__(self, device: str | torch.device | DeviceChoice | None = None) -> None:
        self.device = _as_device(device)
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> SyncTimer:
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._start


def now(device: str | torch.device | DeviceChoice | None = None) -> float:
    """`time.perf_counter()` after synchronising `device`."""
    synchronize(device)
    return time.perf_counter()


def _as_device(device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, DeviceChoice):
        return device.torch_device
    return torch.device(device)


def _rss_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return None


def _max_rss_bytes() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def memory_snapshot(device=None) -> dict[str, Any]:
    """Current memory use, labelled `snapshot` (not a peak)."""
    dev = _as_device(device)
    out: dict[str, Any] = {"kind": "snapshot", "device": str(dev), "process_rss_bytes": _rss_bytes()}
    if dev.type == "cuda" and cuda_available():
        out["allocated_bytes"] = int(torch.cuda.memory_allocated(dev))
        out["reserved_bytes"] = int(torch.cuda.memory_reserved(dev))
    elif dev.type == "mps" and mps_available():
        out["allocated_bytes"] = int(torch.mps.current_allocated_memory())
        out["driver_allocated_bytes"] = int(torch.mps.driver_allocated_memory())
    return out


def memory_peak(device=None) -> dict[str, Any]:
    """Peak memory since process start (RSS) or the last `reset_peak` (CUDA), labelled `peak`.

    MPS has no peak counter; only the process RSS peak is reported there.
    """
    dev = _as_device(device)
    out: dict[str, Any] = {"kind": "peak", "device": str(dev), "process_max_rss_bytes": _max_rss_bytes()}
    if dev.type == "cuda" and cuda_available():
        out["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(dev))
        out["max_reserved_bytes"] = int(torch.cuda.max_memory_reserved(dev))
    return out


def reset_peak(device=None) -> None:
    dev = _as_device(device)
    if dev.type == "cuda" and cuda_available():
        torch.cuda.reset_peak_memory_stats(dev)


# ---------------------------------------------------------------------- provenance
def provenance(choice: DeviceChoice | None = None) -> dict[str, Any]:
    """Software and device facts for manifests."""
    try:
        import transformers

        tf_version = transformers.__version__
    except Exception:
        tf_version = None
    dev = choice.device if choice else "cpu"
    out: dict[str, Any] = {
        "device": dev,
        "device_requested": choice.requested if choice else None,
        "fallback_used": bool(choice and choice.fallback_used),
        "fallback_reason": choice.fallback_reason if choice else None,
        # how the job runner placed this device (provider backend, downgrades): `worker.placement`
        "notes": list(choice.notes) if choice else [],
        "os": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": tf_version,
    }
    from .weights.linear_kernels import loaded_kernels

    kernels = loaded_kernels()  # hybrid targets built in this process: which Gated DeltaNet kernels run
    if kernels:
        out["linear_attention_kernels"] = kernels
    resolved = choice or DeviceChoice(requested="cpu", device="cpu")
    if resolved.type == "cuda" and cuda_available():
        out["device_name"] = torch.cuda.get_device_name(resolved.torch_device)
    elif resolved.type == "mps":
        out["device_name"] = "apple-mps"
    else:
        out["device_name"] = platform.processor() or platform.machine()
    return out
