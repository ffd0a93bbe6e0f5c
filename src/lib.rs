//! pgcdc: Postgres change-data-capture to Kafka.
//!
//! ```text
//!  Postgres WAL ──► pgcdc run ──► Avro changelog topics ──► pgcdc materialize ──► read models
//! ```
//!
//! Modules are named for the domain things they own; `main.rs` only wires
//! the command line to them.

pub mod cli;
pub mod config;
pub mod connector;
pub mod dlq;
pub mod encode;
pub mod event_store;
pub mod exit;
pub mod materialize;
pub mod observe;
pub mod offsets;
pub mod partitioning;
pub mod preflight;
pub mod projection;
pub mod registry;
pub mod retention;
pub mod secret;
pub mod sink;
pub mod snapshot_marker;
pub mod source;
pub mod tail;
#[cfg(feature = "testkit")]
pub mod testkit;

/// Resolves on SIGINT or SIGTERM: the one shutdown trigger of every
/// long-running command.
/// SIGINT and SIGTERM, caught from the moment this is created (so a
/// signal during start-up is not fatal) and awaited later.
#[cfg(unix)]
#[derive(Debug)]
pub struct Shutdown {
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

#[cfg(unix)]
impl Shutdown {
    pub fn install() -> std::io::Result<Shutdown> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(Shutdown {
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Resolves once a signal arrived (or had arrived).
    pub async fn requested(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {},
            _ = self.int.recv() => {},
        }
        crate::observe::board::set_phase(crate::observe::board::Phase::Stopping);
        tracing::info!("shutdown requested");
    }
}

pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown requested");
}
