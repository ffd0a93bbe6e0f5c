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
pub mod encode;
pub mod exit;
pub mod materialize;
pub mod observe;
pub mod offsets;
pub mod preflight;
pub mod registry;
pub mod secret;
pub mod sink;
pub mod snapshot_marker;
pub mod source;
pub mod tail;

/// Resolves on SIGINT or SIGTERM: the one shutdown trigger of every
/// long-running command.
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
