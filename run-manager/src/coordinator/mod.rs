//! The connection to the coordinator: where it is and how it is reached
//! (`transport`: address, TLS or plaintext), the channel that names what went
//! wrong below gRPC (`channel`, `tls_fault`), the provider and admin clients
//! with the retry loop (`client`), the client certificate's checks (`cert`)
//! and the provider token (`token`).

pub mod cert;
pub mod channel;
pub mod client;
pub mod tls_fault;
pub mod token;
pub mod transport;
