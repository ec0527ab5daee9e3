//! SIGINT/SIGTERM to the run-manager: one watch channel that turns
//! `Some(signal)` on the first one, and the wait every loop selects on.

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::worker::process;

/// The receiving end: `None` until a signal arrives, then `Some(signal)`.
pub type Shutdown = watch::Receiver<Option<i32>>;

/// Watch SIGINT and SIGTERM; the receiver turns `Some(signal)` on the first one.
pub fn shutdown_signals() -> Result<Shutdown> {
    let (tx, rx) = watch::channel(None);
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| Error::Internal(format!("cannot watch SIGINT: {e}")))?;
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Error::Internal(format!("cannot watch SIGTERM: {e}")))?;
    tokio::spawn(async move {
        loop {
            let sig = tokio::select! {
                _ = int.recv() => libc::SIGINT,
                _ = term.recv() => libc::SIGTERM,
            };
            tracing::warn!(
                "received {}; stopping after the worker",
                process::signal_name(sig)
            );
            if tx.send(Some(sig)).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Resolves with the signal once one has been received (at once if one
/// already was); never resolves when none can arrive any more.
pub async fn signalled(shutdown: &mut Shutdown) -> i32 {
    loop {
        if let Some(sig) = *shutdown.borrow_and_update() {
            return sig;
        }
        if shutdown.changed().await.is_err() {
            // The sender is gone: no signal can arrive any more.
            std::future::pending::<()>().await;
        }
    }
}

/// Resolves with the next signal that arrives (one received before and
/// already seen by [`signalled`] does not count; one not yet seen does);
/// never resolves when none can arrive any more.
pub async fn next_signal(shutdown: &mut Shutdown) -> i32 {
    loop {
        if shutdown.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        if let Some(sig) = *shutdown.borrow_and_update() {
            return sig;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn signalled_sees_a_signal_sent_before_or_while_waiting() {
        let (tx, mut rx) = watch::channel(None);
        let waiting = tokio::spawn(async move { signalled(&mut rx).await });
        tx.send(Some(libc::SIGTERM)).expect("send");
        assert_eq!(waiting.await.expect("join"), libc::SIGTERM);
        let (_tx, mut already) = watch::channel(Some(libc::SIGINT));
        assert_eq!(signalled(&mut already).await, libc::SIGINT);
    }

    #[tokio::test]
    async fn next_signal_waits_for_one_not_yet_seen() {
        let (tx, mut rx) = watch::channel(None);
        tx.send(Some(libc::SIGTERM)).expect("send");
        assert_eq!(signalled(&mut rx).await, libc::SIGTERM);
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(30), next_signal(&mut rx)).await;
        assert!(waited.is_err(), "a seen signal counted again");
        tx.send(Some(libc::SIGINT)).expect("send");
        assert_eq!(next_signal(&mut rx).await, libc::SIGINT);
        drop(tx);
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(30), next_signal(&mut rx)).await;
        assert!(waited.is_err());
    }

    #[tokio::test]
    async fn signalled_never_resolves_once_the_sender_is_gone() {
        let (tx, mut rx) = watch::channel(None::<i32>);
        drop(tx);
        let waited =
            tokio::time::timeout(std::time::Duration::from_millis(50), signalled(&mut rx)).await;
        assert!(waited.is_err());
    }
}
