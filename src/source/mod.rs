//! The Postgres side of the connector.
//!
//! - [`pgoutput`]: decoding of logical replication messages.

pub mod pgoutput;
