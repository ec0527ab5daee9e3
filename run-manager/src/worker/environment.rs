//! The environment a worker starts with: least privilege.
//!
//! The native worker parses user-supplied data (corpora, tokenizers, chat
//! templates, checkpoints), so it must not hold the run-manager's credentials.
//! It starts from an empty environment plus the variables named in
//! [`PASSED`] / [`PASSED_PREFIXES`] (whatever the worker and the native client
//! need to find Python, the GPUs and their caches) and nothing else; a name that
//! looks like a secret ([`is_secret`]) is dropped even if a list names it.
//!
//! Docker mode: the container's environment is only the `--env` pairs of
//! `docker::container_env` (HOME, TMPDIR, USER, LOGNAME, the cache directories,
//! all in the tmpfs scratch) and the image's own. The `docker run` CLI process itself gets this machine's
//! environment without the secrets ([`without_secrets`]): it needs the
//! provider's Docker settings (`DOCKER_HOST`, `DOCKER_CONFIG`, ...), never
//! forwards its environment into the container, and never needs a token.
//! `docker pull` (run separately, before) keeps the whole environment, since
//! registry credential helpers may read cloud credentials from it.

use std::ffi::{OsStr, OsString};

use crate::env_vars;

/// Variables the native worker gets, by exact name, when set here.
pub const PASSED: &[&str] = &[
    // Finding programs, the user's files, scratch space, the locale.
    "PATH",
    "HOME",
    "TMPDIR",
    "LANG",
    "LANGUAGE",
    env_vars::NO_COLOR,
    // Finding Python: the native client imports from this environment.
    env_vars::VIRTUAL_ENV,
    env_vars::PYTHON_HOME,
    env_vars::PYTHONHOME,
    env_vars::PYTHONUNBUFFERED,
    // Shared libraries (CUDA installs outside the default search path).
    "LD_LIBRARY_PATH",
    // Devices and threads.
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    // Caches and offline switches of torch, triton and the Hugging Face libraries.
    "XDG_CACHE_HOME",
    "TRITON_CACHE_DIR",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    // The documented worker knobs.
    env_vars::DEVICE,
    env_vars::MPS_BF16,
];

/// Variables the native worker gets by prefix: the locale (`LC_ALL`,
/// `LC_CTYPE`, ...) and the device requirements (`DFLASH_REQUIRE_CUDA`, `DFLASH_REQUIRE_MPS`).
pub const PASSED_PREFIXES: &[&str] = &["LC_", env_vars::REQUIRE_PREFIX];

/// The run-manager's own credentials, never given to any child it supervises
/// (and scrubbed from its own environment at start: `crate::lockdown`).
pub const CREDENTIALS: &[&str] = &[
    env_vars::PROVIDER_TOKEN,
    env_vars::PROVIDER_TOKEN_FILE,
    env_vars::ADMIN_TOKEN,
    env_vars::TLS_CLIENT_KEY,
];

/// Whether `name` is (or looks like) a secret: the run-manager's credentials,
/// `AWS_*`, anything ending in `_TOKEN`, `_TOKEN_FILE`, `_KEY`, `_PASSWORD` or
/// containing `SECRET` (case-insensitive).
pub fn is_secret(name: &OsStr) -> bool {
    let Some(name) = name.to_str() else {
        // Not UTF-8: no list names it, so it cannot be shown to be harmless.
        return true;
    };
    let upper = name.to_ascii_uppercase();
    CREDENTIALS.contains(&upper.as_str())
        || upper.starts_with("AWS_")
        || upper.contains("SECRET")
        || ["_TOKEN", "_TOKEN_FILE", "_KEY", "_PASSWORD"]
            .iter()
            .any(|s| upper.ends_with(s))
}

/// Whether the native worker gets `name`: listed by name or prefix, and not a secret.
pub fn passed(name: &OsStr) -> bool {
    let listed = name
        .to_str()
        .is_some_and(|n| PASSED.contains(&n) || PASSED_PREFIXES.iter().any(|p| n.starts_with(p)));
    listed && !is_secret(name)
}

/// The native worker's environment, from `vars` (this process's: `std::env::vars_os()`).
pub fn native(vars: impl IntoIterator<Item = (OsString, OsString)>) -> Vec<(OsString, OsString)> {
    vars.into_iter().filter(|(k, _)| passed(k)).collect()
}

/// `vars` without anything [`is_secret`] names: the `docker run` CLI's environment.
pub fn without_secrets(
    vars: impl IntoIterator<Item = (OsString, OsString)>,
) -> Vec<(OsString, OsString)> {
    vars.into_iter().filter(|(k, _)| !is_secret(k)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(OsString, OsString)> {
        pairs
            .iter()
            .map(|(k, v)| (OsString::from(k), OsString::from(v)))
            .collect()
    }

    fn names(v: &[(OsString, OsString)]) -> Vec<&str> {
        v.iter().map(|(k, _)| k.to_str().expect("utf8")).collect()
    }

    const PARENT: &[(&str, &str)] = &[
        ("PATH", "/usr/bin:/bin"),
        ("HOME", "/home/p"),
        ("LC_ALL", "C.UTF-8"),
        ("VIRTUAL_ENV", "/venv"),
        ("CUDA_VISIBLE_DEVICES", "0,1"),
        ("DFLASH_REQUIRE_CUDA", "1"),
        ("DFLASH_MPS_BF16", "0"),
        ("OMP_NUM_THREADS", "4"),
        ("DFLASH_PROVIDER_TOKEN", "tok-provider-secret"),
        ("DFLASH_PROVIDER_TOKEN_FILE", "/etc/dflash/token"),
        ("DFLASH_ADMIN_TOKEN", "tok-admin-secret"),
        ("DFLASH_TLS_CLIENT_KEY", "/etc/dflash/client.key"),
        ("AWS_SECRET_ACCESS_KEY", "aws-secret-value"),
        ("AWS_ACCESS_KEY_ID", "AKIA0000"),
        ("MY_API_TOKEN", "my-token-value"),
        ("GITHUB_TOKEN", "ghp_x"),
        ("DFLASH_COORDINATOR", "https://c:1"),
        ("SSH_AUTH_SOCK", "/run/ssh.sock"),
        ("DOCKER_HOST", "unix:///run/docker.sock"),
    ];

    #[test]
    fn native_worker_gets_only_the_allow_list() {
        let env = native(vars(PARENT));
        assert_eq!(
            names(&env),
            [
                "PATH",
                "HOME",
                "LC_ALL",
                "VIRTUAL_ENV",
                "CUDA_VISIBLE_DEVICES",
                "DFLASH_REQUIRE_CUDA",
                "DFLASH_MPS_BF16",
                "OMP_NUM_THREADS",
            ]
        );
        // No secret value survives under any name.
        for (_, v) in &env {
            let v = v.to_str().expect("utf8");
            assert!(!v.contains("secret") && !v.contains("token"), "{v}");
        }
    }

    #[test]
    fn docker_cli_keeps_everything_but_secrets() {
        let env = without_secrets(vars(PARENT));
        let got = names(&env);
        for gone in [
            "DFLASH_PROVIDER_TOKEN",
            "DFLASH_PROVIDER_TOKEN_FILE",
            "DFLASH_ADMIN_TOKEN",
            "DFLASH_TLS_CLIENT_KEY",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_ACCESS_KEY_ID",
            "MY_API_TOKEN",
            "GITHUB_TOKEN",
        ] {
            assert!(!got.contains(&gone), "{gone} in {got:?}");
        }
        for kept in ["PATH", "DOCKER_HOST", "SSH_AUTH_SOCK", "DFLASH_COORDINATOR"] {
            assert!(got.contains(&kept), "{kept} missing from {got:?}");
        }
    }

    #[test]
    fn secrets_by_shape_and_case() {
        for s in [
            "my_api_token",
            "Db_Password",
            "SIGNING_KEY",
            "CLIENT_SECRET_ID",
            "aws_region",
        ] {
            assert!(is_secret(OsStr::new(s)), "{s}");
        }
        for s in ["PATH", "TOKENIZERS_PARALLELISM", "KEYBOARD", "LC_ALL"] {
            assert!(!is_secret(OsStr::new(s)), "{s}");
        }
        // Every listed name is passed: none of them looks like a secret.
        for n in PASSED {
            assert!(passed(OsStr::new(n)), "{n}");
        }
    }

    #[test]
    fn non_utf8_names_are_dropped() {
        use std::os::unix::ffi::OsStrExt;
        let odd = OsStr::from_bytes(b"PATH\xff");
        assert!(is_secret(odd) && !passed(odd));
    }
}
