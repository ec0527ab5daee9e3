//! What went wrong when a call to the coordinator failed below gRPC, named:
//! plaintext meeting TLS (either way round), a coordinator certificate this
//! provider does not trust, a client certificate the coordinator refused.
//!
//! A failed call's `tonic::Status` carries its [`TlsFault`] as its source
//! ([`fault_of`]) with the **same code** tonic would have given: `Error::Rpc`
//! adds the fault's `hint:` line and `client::retry` knows not to retry a fault
//! that cannot heal by itself. The faults are found by `crate::coordinator::channel`'s
//! [`Diagnosed`](crate::coordinator::channel::Diagnosed) channel.
//!
//! Types only: this module uses nothing else of the crate, so the error type
//! (`crate::error`) and the transport can both depend on it.

use std::error::Error as StdError;
use std::path::PathBuf;

/// A TLS-level reason a call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsFault {
    #[error("the coordinator at `{authority}` speaks TLS, but this connection is plaintext")]
    PlaintextToTls { authority: String },
    #[error("the coordinator at `{authority}` does not speak TLS (it answered the TLS handshake with something else)")]
    TlsToPlaintext { authority: String },
    #[error("the coordinator's TLS certificate was not accepted: {reason}")]
    ServerCertificate {
        reason: String,
        why: ServerCertProblem,
        authority: String,
        ca_file: Option<PathBuf>,
    },
    #[error("the coordinator refused this provider's TLS handshake (alert `{alert}`)")]
    Refused {
        alert: String,
        client_cert: Option<PathBuf>,
    },
    #[error("the coordinator closed the connection during the TLS handshake ({detail})")]
    ClosedInHandshake {
        detail: String,
        client_cert: Option<PathBuf>,
    },
    #[error("the server at `{authority}` did not negotiate HTTP/2 (ALPN `h2`) over TLS")]
    NoHttp2 { authority: String },
}

/// Why the coordinator's certificate was refused, for the hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerCertProblem {
    UnknownIssuer,
    Expired,
    NotValidYet,
    WrongName,
    Other,
}

impl TlsFault {
    /// What to do about it.
    pub fn hint(&self) -> String {
        match self {
            TlsFault::PlaintextToTls { authority } => format!(
                "use `--coordinator https://{authority}` (add `--ca-file PATH` when its certificate is not signed by a CA this system trusts)"
            ),
            TlsFault::TlsToPlaintext { authority } => format!(
                "the coordinator serves plaintext: ask its admin to serve TLS (`dflash-coordinator serve --tls-cert ... --tls-key ...`), or on a network you trust use `--coordinator http://{authority}` (with `--insecure` unless it is this machine)"
            ),
            TlsFault::ServerCertificate {
                why,
                authority,
                ca_file,
                ..
            } => match (why, ca_file) {
                (ServerCertProblem::UnknownIssuer, None) => "pass the CA that signed the coordinator's certificate with `--ca-file PATH` (it is not signed by a CA this system trusts)".into(),
                (ServerCertProblem::UnknownIssuer, Some(ca)) => format!(
                    "`--ca-file {}` did not sign the coordinator's certificate: pass the CA that did",
                    ca.display()
                ),
                (ServerCertProblem::Expired, _) => "the coordinator's certificate has expired: its admin must renew it".into(),
                (ServerCertProblem::NotValidYet, _) => "the coordinator's certificate is not valid yet: check this machine's clock".into(),
                (ServerCertProblem::WrongName, _) => {
                    let host = authority.rsplit_once(':').map(|(h, _)| h).unwrap_or(authority);
                    format!("the certificate does not name `{host}`: connect with a name it holds, or ask the coordinator's admin for one that names `{host}`")
                }
                (ServerCertProblem::Other, _) => "ask the coordinator's admin to check its `--tls-cert`".into(),
            },
            TlsFault::Refused { alert, client_cert } => match (alert.as_str(), client_cert) {
                ("CertificateRequired", _) | (_, None) => "the coordinator requires mutual TLS: pass `--client-cert PATH --client-key PATH` (a certificate from its client CA whose CN is this provider's name)".into(),
                (_, Some(c)) => format!(
                    "it refused the client certificate `{}`: it must be signed by the coordinator's client CA (`--tls-client-ca`), be valid now, and its CN must be this provider's name",
                    c.display()
                ),
            },
            TlsFault::ClosedInHandshake { client_cert, .. } => match client_cert {
                Some(c) => format!(
                    "this is how a refused client certificate shows under mutual TLS: `{}` must be signed by the coordinator's client CA (`--tls-client-ca`) and be valid now",
                    c.display()
                ),
                None => "if the coordinator requires mutual TLS, pass `--client-cert PATH --client-key PATH`".into(),
            },
            TlsFault::NoHttp2 { .. } => "a TLS proxy in front of the coordinator must pass gRPC (HTTP/2) through".into(),
        }
    }

    /// Whether retrying cannot help: configuration on one side or the other must change.
    pub fn permanent(&self) -> bool {
        !matches!(self, TlsFault::ClosedInHandshake { .. })
    }
}

/// The [`TlsFault`] a status carries, if `crate::coordinator::channel::Diagnosed` put one there.
pub fn fault_of(status: &tonic::Status) -> Option<&TlsFault> {
    StdError::source(status).and_then(|s| s.downcast_ref::<TlsFault>())
}

/// `err` and its sources, outermost first.
pub fn error_chain<'a>(
    err: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(err), |e: &&'a (dyn StdError + 'static)| (*e).source())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn faults_ride_in_the_status_source() {
        let fault = TlsFault::PlaintextToTls {
            authority: "h:1".into(),
        };
        let mut status = tonic::Status::unknown(fault.to_string());
        status.set_source(Arc::new(fault.clone()));
        assert_eq!(fault_of(&status), Some(&fault));
        assert_eq!(fault_of(&tonic::Status::unknown("x")), None);
    }
}
