//! The provider's channel to its coordinator: the [`Target`]'s endpoint,
//! connected lazily ([`open`]), and wrapped so that what goes wrong below gRPC
//! is named.
//!
//! [`Diagnosed`] wraps the channel: when a call fails with a transport error,
//! the error is examined once and, if it has a TLS cause, replaced by a
//! `tonic::Status` with the **same code** whose message names the cause and
//! whose source is the [`TlsFault`] (`crate::coordinator::tls_fault`: so `Error::Rpc` can
//! add its `hint:` and `client::retry` knows not to retry a fault that cannot
//! heal by itself).
//!
//! The causes come from rustls's typed errors (found in the transport error's
//! source chain), except plaintext meeting TLS: the coordinator just closes a
//! plaintext connection, which looks like a crash, so then a TLS ClientHello is
//! sent to the same address and a TLS record in reply settles it ([`speaks_tls`]).

use std::error::Error as StdError;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rustls::{AlertDescription, CertificateError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::body::Body;
use tonic::codegen::http;
use tonic::codegen::{BoxFuture, Context, Poll, Service};
use tonic::transport::Channel;

use crate::coordinator::tls_fault::{error_chain, ServerCertProblem, TlsFault};
use crate::coordinator::transport::{Address, Target};
use crate::error::Result;

/// How long the plaintext-meets-TLS probe may take, connect and reply together.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

type BoxError = Box<dyn StdError + Send + Sync>;

/// A lazily connecting channel to `target` whose failures name their TLS
/// cause ([`Diagnosed`]); connection failures surface on the first call.
pub fn open(target: &Target) -> Result<Diagnosed> {
    Ok(Diagnosed::new(target.endpoint()?.connect_lazy(), target))
}

/// The rustls error in a transport error's chain (rustls reports through `std::io::Error`).
fn rustls_error<'a>(err: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    error_chain(err).find_map(|e| {
        e.downcast_ref::<rustls::Error>().or_else(|| {
            e.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        })
    })
}

/// Whether the chain says the peer closed or reset the connection (not: refused it).
fn closed_by_peer(err: &(dyn StdError + 'static)) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    error_chain(err).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| matches!(io.kind(), BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof))
            // hyper's "connection closed" before a response (its error types are private).
            || e.to_string() == "connection closed"
    })
}

fn server_cert_problem(e: &CertificateError) -> ServerCertProblem {
    match e {
        CertificateError::UnknownIssuer => ServerCertProblem::UnknownIssuer,
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            ServerCertProblem::Expired
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            ServerCertProblem::NotValidYet
        }
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
            ServerCertProblem::WrongName
        }
        _ => ServerCertProblem::Other,
    }
}

/// What [`Diagnosed`] knows about its target.
#[derive(Debug)]
struct Facts {
    address: Address,
    ca_file: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    /// Set once a call got a response: a closed connection after that is not a handshake refusal.
    connected: AtomicBool,
}

/// What a failed call's error says, before any probe.
enum Verdict {
    Fault(TlsFault),
    /// A plaintext connection the peer closed: ask whether it speaks TLS.
    Probe,
}

impl Facts {
    /// The TLS fault behind a failed call, if it has one.
    async fn diagnose(&self, err: &(dyn StdError + Send + Sync + 'static)) -> Option<TlsFault> {
        // Classified first, so no borrow of the error lives across the probe.
        match self.classify(err)? {
            Verdict::Fault(f) => Some(f),
            Verdict::Probe => speaks_tls(&self.address)
                .await
                .then(|| TlsFault::PlaintextToTls {
                    authority: self.address.authority(),
                }),
        }
    }

    fn classify(&self, err: &(dyn StdError + 'static)) -> Option<Verdict> {
        let authority = self.address.authority();
        if let Some(r) = rustls_error(err) {
            let fault = match r {
                rustls::Error::InvalidMessage(_) => TlsFault::TlsToPlaintext { authority },
                rustls::Error::InvalidCertificate(e) => TlsFault::ServerCertificate {
                    reason: r.to_string(),
                    why: server_cert_problem(e),
                    authority,
                    ca_file: self.ca_file.clone(),
                },
                rustls::Error::AlertReceived(a) => TlsFault::Refused {
                    alert: alert_name(*a),
                    client_cert: self.client_cert.clone(),
                },
                _ => return None,
            };
            return Some(Verdict::Fault(fault));
        }
        if error_chain(err).any(|e| e.to_string() == "HTTP/2 was not negotiated.") {
            return Some(Verdict::Fault(TlsFault::NoHttp2 { authority }));
        }
        if !closed_by_peer(err) {
            return None;
        }
        if !self.address.tls {
            return Some(Verdict::Probe);
        }
        if self.connected.load(Ordering::Relaxed) {
            return None;
        }
        let detail = error_chain(err)
            .last()
            .map(|e| e.to_string())
            .unwrap_or_default();
        // rustls's text points at its manual; the first clause is the news.
        let detail = detail
            .split(": http")
            .next()
            .unwrap_or_default()
            .to_string();
        Some(Verdict::Fault(TlsFault::ClosedInHandshake {
            detail,
            client_cert: self.client_cert.clone(),
        }))
    }
}

fn alert_name(a: AlertDescription) -> String {
    format!("{a:?}")
}

/// The provider's channel with TLS causes named (see the module docs).
#[derive(Debug, Clone)]
pub struct Diagnosed {
    inner: Channel,
    facts: Arc<Facts>,
}

impl Diagnosed {
    /// Wrap `channel`, which connects to `target`.
    pub fn new(channel: Channel, target: &Target) -> Self {
        let tls = target.tls.as_ref();
        Diagnosed {
            inner: channel,
            facts: Arc::new(Facts {
                address: target.address.clone(),
                ca_file: tls.and_then(|t| t.ca.as_ref().map(|(p, _)| p.clone())),
                client_cert: tls.and_then(|t| t.identity.as_ref().map(|i| i.cert_path.clone())),
                connected: AtomicBool::new(false),
            }),
        }
    }
}

impl Service<http::Request<Body>> for Diagnosed {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let call = self.inner.call(req);
        let facts = self.facts.clone();
        Box::pin(async move {
            match call.await {
                Ok(resp) => {
                    facts.connected.store(true, Ordering::Relaxed);
                    Ok(resp)
                }
                Err(err) => match facts.diagnose(&err).await {
                    None => Err(err.into()),
                    Some(fault) => {
                        // The code tonic would have given this error, the message naming the cause.
                        let code = tonic::Status::from_error(Box::new(err)).code();
                        let mut status = tonic::Status::new(code, fault.to_string());
                        status.set_source(Arc::new(fault));
                        Err(Box::new(status) as BoxError)
                    }
                },
            }
        })
    }
}

/// A TLS ClientHello for `host`: the first flight of any TLS connection.
fn client_hello(host: &str) -> Option<Vec<u8>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .ok()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).ok()?;
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
    let mut hello = Vec::new();
    conn.write_tls(&mut hello).ok()?;
    Some(hello)
}

/// Whether the server at `address` answers a TLS ClientHello with a TLS
/// record (a handshake or an alert: content type 22 or 21, version 3.x).
/// Nothing is verified and nothing but the hello is sent.
pub async fn speaks_tls(address: &Address) -> bool {
    let Some(hello) = client_hello(&address.host) else {
        return false;
    };
    let probe = async {
        let mut s = tokio::net::TcpStream::connect((address.host.as_str(), address.port)).await?;
        s.write_all(&hello).await?;
        let mut head = [0u8; 2];
        s.read_exact(&mut head).await?;
        Ok::<_, std::io::Error>(head)
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, probe).await,
        Ok(Ok([21 | 22, 3]))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    async fn server_replying(reply: &'static [u8]) -> Address {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        tokio::spawn(async move {
            if let Ok((mut s, _)) = listener.accept().await {
                let mut buf = [0u8; 5];
                // The hello starts with a handshake record (22, 3, x).
                let _ = s.read_exact(&mut buf).await;
                assert_eq!(&buf[..2], &[22, 3]);
                let _ = s.write_all(reply).await;
            }
        });
        Address {
            tls: false,
            host: "127.0.0.1".into(),
            port,
        }
    }

    #[tokio::test]
    async fn the_probe_tells_tls_from_plaintext() {
        // A TLS alert (handshake_failure) is TLS; an HTTP/2 GOAWAY frame or HTTP/1 is not.
        assert!(speaks_tls(&server_replying(&[21, 3, 3, 0, 2, 2, 40]).await).await);
        assert!(speaks_tls(&server_replying(&[22, 3, 3, 0, 1, 2]).await).await);
        assert!(!speaks_tls(&server_replying(&[0, 0, 8, 7, 0, 0, 0, 0, 0]).await).await);
        assert!(!speaks_tls(&server_replying(b"HTTP/1.1 400 Bad Request\r\n").await).await);
        assert!(!speaks_tls(&server_replying(b"").await).await);
        // Nobody listening.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").port()
        };
        let nobody = Address {
            tls: false,
            host: "127.0.0.1".into(),
            port: closed,
        };
        assert!(!speaks_tls(&nobody).await);
    }

    fn io_wrapped(e: rustls::Error) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }

    fn facts(tls: bool, ca: Option<&str>, client: Option<&str>) -> Facts {
        Facts {
            address: Address {
                tls,
                host: "coord.example".into(),
                port: 443,
            },
            ca_file: ca.map(PathBuf::from),
            client_cert: client.map(PathBuf::from),
            connected: AtomicBool::new(false),
        }
    }

    #[tokio::test]
    async fn rustls_errors_become_named_faults() {
        let f = facts(true, Some("/ca.pem"), Some("/c.pem"));
        let unknown = io_wrapped(rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer,
        ));
        let fault = f.diagnose(&unknown).await.expect("fault");
        assert!(matches!(
            fault,
            TlsFault::ServerCertificate {
                why: ServerCertProblem::UnknownIssuer,
                ..
            }
        ));
        assert_eq!(
            fault.to_string(),
            "the coordinator's TLS certificate was not accepted: invalid peer certificate: UnknownIssuer"
        );
        assert!(
            fault.hint().contains("`--ca-file /ca.pem` did not sign"),
            "{}",
            fault.hint()
        );
        assert!(fault.permanent());

        let plain = io_wrapped(rustls::Error::InvalidMessage(
            rustls::InvalidMessage::InvalidContentType,
        ));
        let fault = f.diagnose(&plain).await.expect("fault");
        assert_eq!(
            fault,
            TlsFault::TlsToPlaintext {
                authority: "coord.example:443".into()
            }
        );
        assert!(
            fault.hint().contains("http://coord.example:443"),
            "{}",
            fault.hint()
        );

        let alert = io_wrapped(rustls::Error::AlertReceived(AlertDescription::UnknownCA));
        let fault = f.diagnose(&alert).await.expect("fault");
        assert!(fault.to_string().contains("alert `UnknownCA`"), "{fault}");
        assert!(
            fault
                .hint()
                .contains("refused the client certificate `/c.pem`"),
            "{}",
            fault.hint()
        );

        let name = io_wrapped(rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName,
        ));
        let fault = f.diagnose(&name).await.expect("fault");
        assert!(
            fault.hint().contains("does not name `coord.example`"),
            "{}",
            fault.hint()
        );
    }

    #[tokio::test]
    async fn a_closed_connection_is_a_refusal_only_before_any_response() {
        let f = facts(true, None, Some("/c.pem"));
        let eof = std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "peer closed connection without sending TLS close_notify: https://docs.rs/rustls/",
        );
        let fault = f.diagnose(&eof).await.expect("fault");
        assert_eq!(
            fault.to_string(),
            "the coordinator closed the connection during the TLS handshake (peer closed connection without sending TLS close_notify)"
        );
        assert!(!fault.permanent());
        f.connected.store(true, Ordering::Relaxed);
        assert_eq!(f.diagnose(&eof).await, None);
        // A refused TCP connection is the coordinator being down, not TLS.
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert_eq!(facts(true, None, None).diagnose(&refused).await, None);
    }
}
