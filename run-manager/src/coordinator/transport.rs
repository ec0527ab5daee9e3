//! How the run-manager reaches its coordinator: the address, TLS or plaintext,
//! and the channel.
//!
//! - `https://HOST:PORT` is TLS (rustls, `ring`), verified against the system
//!   roots or `--ca-file`; with `--client-cert`/`--client-key` this provider
//!   also proves who it is (mutual TLS: the certificate's subject CN must be
//!   the provider's name at the coordinator).
//! - `http://HOST:PORT` or a bare `HOST:PORT` is plaintext: allowed to this
//!   machine (127.0.0.0/8, `::1`, `localhost`), elsewhere only with
//!   `--insecure`, which logs a warning: the token would cross the network in
//!   the clear.
//!
//! Every TLS file is read and checked here, before any connection, so a bad
//! file is named by its flag and path (an expired client certificate too: the
//! coordinator would only close the connection). The channel itself is
//! `crate::coordinator::channel`'s, which names what goes wrong during a handshake
//! (`crate::coordinator::tls_fault`).

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::coordinator::cert;
use crate::coordinator::tls_fault::error_chain;
use crate::error::{Error, Result};

/// How long a TCP connect, and separately a TLS handshake, may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The TLS files named on the command line (`--ca-file`, `--client-cert`, `--client-key`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca_file: Option<PathBuf>,
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
}

impl TlsFiles {
    fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.client_cert.is_none() && self.client_key.is_none()
    }
}

/// A parsed coordinator address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    /// `https://` (true) or `http://` / bare (false).
    pub tls: bool,
    /// The host without IPv6 brackets (`::1`, `127.0.0.1`, `coord.example`).
    pub host: String,
    pub port: u16,
}

impl Address {
    /// Parse `https://HOST:PORT`, `http://HOST:PORT` or `HOST:PORT` (IPv6 in
    /// brackets; without a port, 443 for `https://` and 80 otherwise).
    pub fn parse(addr: &str) -> Result<Address> {
        let addr = addr.trim();
        let bad = |why: &str| {
            Error::Usage(format!(
                "coordinator address `{addr}` {why}\nhint: use `https://HOST:PORT` (TLS), or `http://HOST:PORT` / `HOST:PORT` (plaintext)"
            ))
        };
        if addr.is_empty() {
            return Err(Error::Usage("the coordinator address is empty".into()));
        }
        let (tls, rest) = if let Some(r) = addr.strip_prefix("https://") {
            (true, r)
        } else if let Some(r) = addr.strip_prefix("http://") {
            (false, r)
        } else if addr.contains("://") {
            return Err(bad("has a scheme other than `https://` or `http://`"));
        } else {
            (false, addr)
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.contains(['/', '?', '#', '@']) || authority.contains(char::is_whitespace) {
            return Err(bad("must be only a host and a port"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (host, after) = v6
                .split_once(']')
                .ok_or_else(|| bad("has an unclosed `[`"))?;
            match after {
                "" => (host, None),
                p => (
                    host,
                    Some(
                        p.strip_prefix(':')
                            .ok_or_else(|| bad("has junk after `]`"))?,
                    ),
                ),
            }
        } else {
            match authority.split_once(':') {
                Some(_) if authority.matches(':').count() > 1 => {
                    return Err(bad(
                        "has an IPv6 host without brackets (write `[::1]:PORT`)",
                    ))
                }
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(bad("has no host"));
        }
        let port = match port {
            None => {
                if tls {
                    443
                } else {
                    80
                }
            }
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|&p| p > 0)
                .ok_or_else(|| bad("has a bad port"))?,
        };
        Ok(Address {
            tls,
            host: host.to_string(),
            port,
        })
    }

    /// `HOST:PORT` (IPv6 hosts in brackets).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// The URL the channel connects to.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.authority())
    }

    /// Whether the host is this machine (see [`is_loopback`]).
    pub fn is_loopback(&self) -> bool {
        is_loopback(&self.host)
    }
}

/// Whether `host` is this machine only: `localhost`, an address in
/// 127.0.0.0/8, `::1`, or `::ffff:127.x.y.z` (brackets allowed).
pub fn is_loopback(host: &str) -> bool {
    let h = host.trim().trim_start_matches('[').trim_end_matches(']');
    if h.eq_ignore_ascii_case("localhost") {
        return true;
    }
    match h.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => v4.is_loopback(),
        Ok(IpAddr::V6(v6)) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
        Err(_) => false,
    }
}

/// The client certificate of mutual TLS, read and checked.
#[derive(Debug, Clone)]
pub struct ClientIdentity {
    pub cert_path: PathBuf,
    /// Its subject CN (the provider's name at the coordinator), when readable.
    pub common_name: Option<String>,
    cert_pem: Vec<u8>,
    key_pem: Vec<u8>,
}

/// TLS settings, every file read and checked.
#[derive(Debug, Clone)]
pub struct Tls {
    /// `--ca-file` and its PEM; None: the system roots.
    pub ca: Option<(PathBuf, Vec<u8>)>,
    pub identity: Option<ClientIdentity>,
}

/// Where the coordinator is and how to talk to it.
#[derive(Debug, Clone)]
pub struct Target {
    pub address: Address,
    /// Some for `https://`.
    pub tls: Option<Tls>,
}

impl Target {
    /// The target for `--coordinator ADDR` with the TLS files and `--insecure`:
    /// plaintext only to loopback unless `insecure` (then a warning is logged);
    /// TLS files only with a TLS address.
    pub fn new(addr: &str, files: &TlsFiles, insecure: bool) -> Result<Target> {
        let address = Address::parse(addr)?;
        if address.tls {
            let tls = load_tls(files)?;
            return Ok(Target {
                address,
                tls: Some(tls),
            });
        }
        let authority = address.authority();
        if !files.is_empty() {
            return Err(Error::Usage(format!(
                "`--ca-file`, `--client-cert` and `--client-key` are for a TLS coordinator, but `{addr}` is plaintext\nhint: use `--coordinator https://{authority}`"
            )));
        }
        if !address.is_loopback() {
            if !insecure {
                return Err(Error::Usage(format!(
                    "refusing plaintext to `{authority}`, which is not this machine: the provider token and job data would cross the network unencrypted\nhint: use `--coordinator https://{authority}` (the coordinator serves TLS with `--tls-cert`/`--tls-key`), or pass `--insecure` on a network you trust"
                )));
            }
            tracing::warn!(
                coordinator = %authority,
                "`--insecure`: plaintext connection to a coordinator that is not this machine; the provider token and job data cross the network unencrypted"
            );
        }
        Ok(Target { address, tls: None })
    }

    /// Plaintext to a loopback address: the embedded coordinator of `--local`, tests.
    pub fn loopback(addr: &str) -> Result<Target> {
        Target::new(addr, &TlsFiles::default(), false)
    }

    /// The endpoint to connect to: timeouts, keep-alive and, for `https://`,
    /// the TLS settings (`crate::coordinator::channel::open` connects it).
    pub fn endpoint(&self) -> Result<Endpoint> {
        let url = self.address.url();
        let mut endpoint = Endpoint::from_shared(url.clone())
            .map_err(|e| Error::Usage(format!("bad coordinator address `{url}`: {e}")))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            // Keep long-polls and heartbeat streams alive through NATs.
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_while_idle(true);
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(self.client_tls_config(tls))
                .map_err(|e| tls_setup_error(tls, &e))?;
        }
        Ok(endpoint)
    }

    fn client_tls_config(&self, tls: &Tls) -> ClientTlsConfig {
        let mut config = ClientTlsConfig::new()
            .domain_name(self.address.host.clone())
            .timeout(CONNECT_TIMEOUT);
        config = match &tls.ca {
            Some((_, pem)) => config.ca_certificate(Certificate::from_pem(pem)),
            None => config.with_native_roots(),
        };
        if let Some(id) = &tls.identity {
            config = config.identity(Identity::from_pem(&id.cert_pem, &id.key_pem));
        }
        config
    }
}

/// The error for a TLS configuration rustls would not build.
fn tls_setup_error(tls: &Tls, err: &tonic::transport::Error) -> Error {
    let inconsistent = error_chain(err).any(|e| {
        matches!(
            e.downcast_ref::<rustls::Error>(),
            Some(rustls::Error::InconsistentKeys(_))
        )
    });
    let text = error_chain(err)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ");
    match &tls.identity {
        Some(id) if inconsistent => Error::Usage(format!(
            "`--client-key` is not the private key of the client certificate `{}`\nhint: pass the key that was made with that certificate",
            id.cert_path.display()
        )),
        _ if tls.ca.is_none() && text.contains("no native certs found") => Error::Usage(
            "no CA certificates found on this system to verify the coordinator with\nhint: pass `--ca-file PATH` (the CA that signed the coordinator's certificate)".into(),
        ),
        _ => Error::Usage(format!("cannot set up TLS: {text}")),
    }
}

fn read_file(path: &Path, what: &str) -> Result<Vec<u8>> {
    let bytes = std::fs::read(path)
        .map_err(|e| Error::Usage(format!("cannot read {what} `{}`: {e}", path.display())))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(Error::Usage(format!(
            "{what} `{}` is empty",
            path.display()
        )));
    }
    Ok(bytes)
}

/// PEM certificates from `path`, at least one, each decoded.
fn read_certificates(path: &Path, what: &str) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>)> {
    let pem = read_file(path, what)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Usage(format!("{what} `{}` is not valid PEM: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(Error::Usage(format!(
            "{what} `{}` holds no PEM certificate (`-----BEGIN CERTIFICATE-----`)\nhint: pass the certificate file, not a key or a DER file",
            path.display()
        )));
    }
    Ok((pem, certs))
}

fn read_private_key(path: &Path) -> Result<Vec<u8>> {
    let what = "client key (`--client-key`)";
    let pem = read_file(path, what)?;
    if let Err(e) = PrivateKeyDer::from_pem_slice(&pem) {
        let hint = if String::from_utf8_lossy(&pem).contains("ENCRYPTED") {
            format!("\nhint: the key is encrypted; decrypt it (`openssl pkey -in {} -out KEY.pem`) and keep it mode 0600", path.display())
        } else {
            String::new()
        };
        return Err(Error::Usage(format!(
            "{what} `{}` holds no usable PEM private key ({e}){hint}",
            path.display()
        )));
    }
    warn_if_shared(path);
    Ok(pem)
}

/// A private key others can read is no longer this provider's alone: say so (it still works).
fn warn_if_shared(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            tracing::warn!(
                "client key `{}` has mode {mode:04o}: group or others can read it (hint: chmod 600 {})",
                path.display(),
                path.display()
            );
        }
    }
}

fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Refuse a client certificate outside its validity period: the coordinator
/// would close the connection without saying why.
pub fn check_validity(path: &Path, facts: &cert::CertFacts, now: i64) -> Result<()> {
    let cn = facts
        .common_name
        .as_deref()
        .map(|c| format!(" (CN `{c}`)"))
        .unwrap_or_default();
    if now > facts.not_after.unix {
        return Err(Error::Usage(format!(
            "client certificate `{}`{cn} expired on {}\nhint: ask the coordinator's admin for a new certificate",
            path.display(),
            facts.not_after.text
        )));
    }
    if now < facts.not_before.unix {
        return Err(Error::Usage(format!(
            "client certificate `{}`{cn} is not valid before {}\nhint: check this machine's clock",
            path.display(),
            facts.not_before.text
        )));
    }
    Ok(())
}

fn load_identity(cert_path: &Path, key_path: &Path) -> Result<ClientIdentity> {
    let (cert_pem, certs) = read_certificates(cert_path, "client certificate (`--client-cert`)")?;
    let key_pem = read_private_key(key_path)?;
    let facts = cert::facts(certs[0].as_ref());
    if let Some(f) = &facts {
        check_validity(cert_path, f, now_unix())?;
    }
    Ok(ClientIdentity {
        cert_path: cert_path.to_path_buf(),
        common_name: facts.and_then(|f| f.common_name),
        cert_pem,
        key_pem,
    })
}

fn load_tls(files: &TlsFiles) -> Result<Tls> {
    let ca = match &files.ca_file {
        Some(p) => Some((p.clone(), read_certificates(p, "CA file (`--ca-file`)")?.0)),
        None => None,
    };
    let identity = match (&files.client_cert, &files.client_key) {
        (Some(c), Some(k)) => Some(load_identity(c, k)?),
        (None, None) => None,
        _ => {
            return Err(Error::Usage(
                "`--client-cert` and `--client-key` go together\nhint: pass both for mutual TLS, or neither".into(),
            ))
        }
    };
    Ok(Tls { ca, identity })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> Address {
        Address::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    #[test]
    fn address_forms() {
        let a = addr("https://coord.example:50051");
        assert_eq!(
            (a.tls, a.host.as_str(), a.port),
            (true, "coord.example", 50051)
        );
        assert_eq!(a.url(), "https://coord.example:50051");
        let a = addr(" http://10.0.0.5:7/ ");
        assert_eq!((a.tls, a.host.as_str(), a.port), (false, "10.0.0.5", 7));
        let a = addr("127.0.0.1:5");
        assert_eq!((a.tls, a.url().as_str()), (false, "http://127.0.0.1:5"));
        let a = addr("https://[::1]:9");
        assert_eq!(
            (a.host.as_str(), a.authority().as_str()),
            ("::1", "[::1]:9")
        );
        assert_eq!(a.url(), "https://[::1]:9");
        // Default ports.
        assert_eq!(addr("https://c.example").port, 443);
        assert_eq!(addr("c.example").port, 80);
        for bad in [
            "",
            "ftp://h:1",
            "https://h:1/path",
            "h:port",
            "h:0",
            "h:70000",
            "::1:5",
            "[::1",
            "[::1]x",
            "https://user@h:1",
            "https://:5",
        ] {
            let err = Address::parse(bad).expect_err(bad);
            assert_eq!(err.exit_code(), 1, "{bad}");
        }
        assert!(Address::parse("ftp://h:1")
            .expect_err("ftp")
            .to_string()
            .contains("hint:"));
    }

    #[test]
    fn loopback_hosts() {
        for h in [
            "127.0.0.1",
            "127.1.2.3",
            "127.255.255.254",
            "::1",
            "[::1]",
            "localhost",
            "LocalHost",
            "::ffff:127.0.0.1",
        ] {
            assert!(is_loopback(h), "{h}");
        }
        for h in [
            "128.0.0.1",
            "10.0.0.1",
            "0.0.0.0",
            "::",
            "::2",
            "localhost.example.com",
            "notlocalhost",
            "coord.example",
            "::ffff:10.0.0.1",
        ] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn plaintext_only_to_loopback_unless_insecure() {
        let none = TlsFiles::default();
        for ok in [
            "127.0.0.1:5",
            "http://localhost:5",
            "[::1]:5",
            "http://127.9.9.9:5",
        ] {
            let t = Target::new(ok, &none, false).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert!(t.tls.is_none());
        }
        let err = Target::new("http://10.1.2.3:5", &none, false).expect_err("remote plaintext");
        let msg = err.to_string();
        assert!(
            msg.contains("refusing plaintext to `10.1.2.3:5`")
                && msg.contains("hint: use `--coordinator https://10.1.2.3:5`")
                && msg.contains("--insecure"),
            "{msg}"
        );
        assert_eq!(err.exit_code(), 1);
        assert!(Target::new("coord.example:5", &none, true).is_ok());
        // TLS files with a plaintext address are a mistake, even on loopback.
        let files = TlsFiles {
            ca_file: Some("/ca.pem".into()),
            ..TlsFiles::default()
        };
        let err = Target::new("127.0.0.1:5", &files, false).expect_err("files");
        assert!(
            err.to_string()
                .contains("hint: use `--coordinator https://127.0.0.1:5`"),
            "{err}"
        );
    }

    fn temp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rm-transport-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn tls_files_are_checked_before_connecting() {
        let dir = temp("files");
        let missing = TlsFiles {
            ca_file: Some(dir.join("nope.pem")),
            ..TlsFiles::default()
        };
        let err = Target::new("https://h:1", &missing, false).expect_err("missing");
        assert!(
            err.to_string()
                .starts_with("cannot read CA file (`--ca-file`)"),
            "{err}"
        );
        let not_pem = dir.join("key-not-cert.pem");
        std::fs::write(
            &not_pem,
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
        )
        .expect("write");
        let files = TlsFiles {
            ca_file: Some(not_pem.clone()),
            ..TlsFiles::default()
        };
        let err = Target::new("https://h:1", &files, false).expect_err("not a cert");
        assert!(
            err.to_string().contains("holds no PEM certificate"),
            "{err}"
        );
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "\n").expect("write");
        let files = TlsFiles {
            ca_file: Some(empty),
            ..TlsFiles::default()
        };
        let err = Target::new("https://h:1", &files, false).expect_err("empty");
        assert!(err.to_string().ends_with("is empty"), "{err}");
        let half = TlsFiles {
            client_cert: Some(not_pem),
            ..TlsFiles::default()
        };
        let err = Target::new("https://h:1", &half, false).expect_err("half");
        assert!(err.to_string().contains("go together"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn client_certificate_validity() {
        let t = |unix: i64, text: &str| cert::CertTime {
            unix,
            text: text.into(),
        };
        let facts = cert::CertFacts {
            common_name: Some("box-a".into()),
            not_before: t(1_000, "1970-01-01 00:16:40 UTC"),
            not_after: t(2_000, "1970-01-01 00:33:20 UTC"),
        };
        let p = Path::new("/etc/dflash/client.pem");
        assert!(check_validity(p, &facts, 1_500).is_ok());
        let err = check_validity(p, &facts, 2_001).expect_err("expired");
        assert_eq!(
            err.to_string(),
            "client certificate `/etc/dflash/client.pem` (CN `box-a`) expired on 1970-01-01 00:33:20 UTC\nhint: ask the coordinator's admin for a new certificate"
        );
        let err = check_validity(p, &facts, 999).expect_err("early");
        assert!(err.to_string().contains("not valid before"), "{err}");
    }
}
