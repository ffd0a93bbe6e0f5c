//! The Postgres side of the connector.
//!
//! - [`catalog`]: table shapes and keys; COPY text parsing.
//! - [`pgoutput`]: decoding of logical replication messages.
//! - [`slot`]: replication slot and publication management.

pub mod catalog;
pub mod pgoutput;
pub mod slot;

use tokio_postgres::{Client, NoTls};

use crate::secret::Dsn;

/// Connects without TLS and drives the connection on its own task.
pub async fn connect(dsn: &Dsn) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(dsn.expose(), NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "postgres connection closed");
        }
    });
    Ok(client)
}

/// A Postgres error with the server's message and SQLSTATE; tokio-postgres
/// displays a server error as just "db error".
pub fn error_text(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}
