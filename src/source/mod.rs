//! The Postgres side of the connector.
//!
//! - [`catalog`]: table shapes and keys; COPY text parsing.
//! - [`pgoutput`]: decoding of logical replication messages.
//! - [`slot`]: replication slot and publication management.

pub mod catalog;
pub mod pgoutput;
pub mod slot;
pub mod tls;

use tokio_postgres::Client;

use crate::secret::Dsn;

/// Connects with the connection string's `sslmode` (see [`tls`]) and
/// drives the connection on its own task.
pub async fn connect(dsn: &Dsn) -> Result<Client, tokio_postgres::Error> {
    let endpoint = tls::Endpoint::parse(dsn)?;
    let (client, connection) = endpoint.pg.connect(endpoint.tls.connector()).await?;
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
        None => {
            // "error performing TLS handshake" alone does not say which check failed.
            let mut text = e.to_string();
            let mut cause = std::error::Error::source(e);
            while let Some(c) = cause {
                text.push_str(&format!(": {c}"));
                cause = c.source();
            }
            text
        }
    }
}
