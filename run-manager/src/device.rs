//! Device detection: which backend this machine offers the coordinator.
//!
//! `auto` picks CUDA when `nvidia-smi` lists GPUs, MPS on macOS arm64, else
//! CPU. An explicit `cuda`/`mps` that is not there is a user error, never a
//! silent fallback.

use std::process::Command;

use crate::error::{Error, Result};
use crate::proto::DeviceCapabilities;

/// The `--device` choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    Auto,
    Cuda,
    Mps,
    Cpu,
}

/// One GPU as `nvidia-smi` reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    pub memory_bytes: u64,
    pub compute_capability: (u32, u32),
}

/// Parse `nvidia-smi --query-gpu=memory.total,compute_cap --format=csv,noheader,nounits`
/// (lines like `81559, 9.0`; memory in MiB). Lines that do not parse are skipped.
pub fn parse_nvidia_smi(out: &str) -> Vec<Gpu> {
    out.lines()
        .filter_map(|line| {
            let mut parts = line.split(',').map(str::trim);
            let mib: u64 = parts.next()?.parse().ok()?;
            let cc = parts.next()?;
            let (major, minor) = cc.split_once('.')?;
            Some(Gpu {
                memory_bytes: mib.checked_mul(1 << 20)?,
                compute_capability: (major.parse().ok()?, minor.parse().ok()?),
            })
        })
        .collect()
}

/// `linux-x86_64`, `macos-arm64`, ...
pub fn platform() -> String {
    let arch = match std::env::consts::ARCH {
        "aarch64" if cfg!(target_os = "macos") => "arm64",
        other => other,
    };
    format!("{}-{}", std::env::consts::OS, arch)
}

fn query_gpus() -> Option<Vec<Gpu>> {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-gpu=memory.total,compute_cap",
            "--format=csv,noheader,nounits",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let gpus = parse_nvidia_smi(&String::from_utf8_lossy(&out.stdout));
    (!gpus.is_empty()).then_some(gpus)
}

fn total_memory_bytes() -> u64 {
    if cfg!(target_os = "macos") {
        Command::new("sysctl")
            .args(["-n", "hw.memsize"])
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(0)
    } else {
        std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|s| parse_meminfo_total(&s))
            .unwrap_or(0)
    }
}

/// `MemTotal:  16384 kB` -> bytes.
pub fn parse_meminfo_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn is_macos_arm64() -> bool {
    cfg!(all(target_os = "macos", target_arch = "aarch64"))
}

/// Capabilities for a CUDA machine with `gpus`.
pub fn cuda_capabilities(gpus: &[Gpu]) -> DeviceCapabilities {
    let memory = gpus.iter().map(|g| g.memory_bytes).min().unwrap_or(0);
    // BF16 tensor cores start at Ampere (compute capability 8.0).
    let bf16 = !gpus.is_empty() && gpus.iter().all(|g| g.compute_capability.0 >= 8);
    DeviceCapabilities {
        backend: "cuda".into(),
        device_count: u32::try_from(gpus.len()).unwrap_or(u32::MAX),
        memory_bytes: memory,
        supports_bf16: bf16,
        features: vec![
            "cuda".into(),
            "torch_compile".into(),
            JOB_GRAPH_FEATURE.into(),
        ],
        platform: platform(),
    }
}

/// Detect this machine's capabilities for `choice`.
pub fn detect(choice: DeviceChoice) -> Result<DeviceCapabilities> {
    match choice {
        DeviceChoice::Cuda => match query_gpus() {
            Some(gpus) => Ok(cuda_capabilities(&gpus)),
            None => Err(Error::Usage(
                "`--device cuda` but `nvidia-smi` lists no GPU\nhint: install the NVIDIA driver, or pass `--device auto`".into(),
            )),
        },
        DeviceChoice::Mps if !is_macos_arm64() => Err(Error::Usage(format!(
            "`--device mps` needs macOS on Apple Silicon; this is `{}`\nhint: pass `--device auto` or `--device cpu`",
            platform()
        ))),
        DeviceChoice::Mps => Ok(mps_capabilities()),
        DeviceChoice::Cpu => Ok(cpu_capabilities()),
        DeviceChoice::Auto => {
            if let Some(gpus) = query_gpus() {
                Ok(cuda_capabilities(&gpus))
            } else if is_macos_arm64() {
                Ok(mps_capabilities())
            } else {
                Ok(cpu_capabilities())
            }
        }
    }
}

fn mps_capabilities() -> DeviceCapabilities {
    // The worker probes BF16 on MPS itself; without `DFLASH_MPS_BF16=1` the
    // coordinator is told "no" so it does not hand out BF16-only work.
    let bf16 = std::env::var(crate::env_vars::MPS_BF16)
        .map(|v| v == "1")
        .unwrap_or(false);
    DeviceCapabilities {
        backend: "mps".into(),
        device_count: 1,
        memory_bytes: total_memory_bytes(),
        supports_bf16: bf16,
        features: vec!["mps".into(), JOB_GRAPH_FEATURE.into()],
        platform: platform(),
    }
}

/// The feature a CPU provider started with `--cpu-ranks N` (N > 1) offers: it runs up to
/// `device_count` gloo ranks (the coordinator's `policy.CPU_RANKS_FEATURE`).
pub const CPU_RANKS_FEATURE: &str = "cpu_ranks";

/// The feature every run-manager offers: it runs one job of a job graph (a lease whose
/// `kind` is `prepare`, `capture`, `train` or `evaluate`), downloading the lease's
/// `inputs` into the job directory and naming them in `spec.json`'s `graph`
/// (`crate::artifacts::inputs`). Graph runs require it (the coordinator's `policy.JOB_GRAPH_FEATURE`).
pub const JOB_GRAPH_FEATURE: &str = "job_graph";

/// `caps` of a CPU provider that offers `ranks` local ranks (`--cpu-ranks`).
pub fn with_cpu_ranks(mut caps: DeviceCapabilities, ranks: u32) -> DeviceCapabilities {
    if caps.backend == "cpu" && ranks > 1 {
        caps.device_count = ranks;
        caps.features.push(CPU_RANKS_FEATURE.into());
    }
    caps
}

fn cpu_capabilities() -> DeviceCapabilities {
    DeviceCapabilities {
        backend: "cpu".into(),
        device_count: 1,
        memory_bytes: total_memory_bytes(),
        supports_bf16: true,
        features: vec!["cpu".into(), JOB_GRAPH_FEATURE.into()],
        platform: platform(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvidia_smi_output() {
        let gpus = parse_nvidia_smi("81559, 9.0\n81559, 9.0\n");
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[0].memory_bytes, 81559 << 20);
        assert_eq!(gpus[0].compute_capability, (9, 0));
        let caps = cuda_capabilities(&gpus);
        assert_eq!(
            (caps.backend.as_str(), caps.device_count, caps.supports_bf16),
            ("cuda", 2, true)
        );

        let turing = parse_nvidia_smi("15360, 7.5");
        assert!(!cuda_capabilities(&turing).supports_bf16);
        // Garbage and a header line are skipped rather than guessed at.
        assert!(parse_nvidia_smi(
            "memory.total [MiB], compute_cap\nNo devices were found\n, \n1,2,3"
        )
        .is_empty());
    }

    #[test]
    fn meminfo() {
        assert_eq!(
            parse_meminfo_total("MemFree: 1 kB\nMemTotal:       16384 kB\n"),
            Some(16384 * 1024)
        );
        assert_eq!(parse_meminfo_total("nothing"), None);
    }

    #[test]
    fn cpu_is_one_rank() {
        let c = detect(DeviceChoice::Cpu).expect("cpu");
        assert_eq!((c.backend.as_str(), c.device_count), ("cpu", 1));
        assert!(c.platform.contains('-'));
    }

    #[test]
    fn every_backend_offers_job_graphs() {
        let offers = |c: &DeviceCapabilities| c.features.iter().any(|f| f == JOB_GRAPH_FEATURE);
        let cuda = cuda_capabilities(&parse_nvidia_smi("81559, 9.0"));
        assert_eq!(
            cuda.features,
            vec!["cuda", "torch_compile", JOB_GRAPH_FEATURE]
        );
        assert_eq!(mps_capabilities().features, vec!["mps", JOB_GRAPH_FEATURE]);
        let cpu = cpu_capabilities();
        assert_eq!(cpu.features, vec!["cpu", JOB_GRAPH_FEATURE]);
        let ranks = with_cpu_ranks(cpu, 4);
        assert_eq!(
            ranks.features,
            vec!["cpu", JOB_GRAPH_FEATURE, CPU_RANKS_FEATURE]
        );
        assert!([&cuda, &ranks].into_iter().all(offers));
    }
}
