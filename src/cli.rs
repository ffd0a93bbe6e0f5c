//! The command line: one binary, one subcommand per job.
//!
//! Every subcommand that talks to a pipeline takes `--config
//! connectors/NAME.toml` (or `PGCDC_CONFIG`); fields can be overridden from
//! the environment (see [`crate::config`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "pgcdc",
    version,
    about = "Postgres change-data-capture to Kafka: Avro changelogs, read models, dead letters",
    long_about = "Postgres change-data-capture to Kafka: Avro changelogs, read models, dead letters.\n\n\
Exit codes: 0 ok, 1 failure, 2 a check or requirement did not hold.\n\
Logging: RUST_LOG (default info). Row values are never logged."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Parse and validate a connector definition, then print the effective
    /// config with secrets redacted. Exit 2 when it is invalid.
    Validate(ConfigArg),
    /// Preflight against the live systems: Postgres (wal_level, slots, WAL
    /// senders, role, tables, replica identity, publication, slot state),
    /// Kafka (reachability, topic configs), the schema registry and the
    /// target database. One line per check with a fix hint; exit 2 if any
    /// check fails.
    Check(ConfigArg),
    /// Serve a Confluent-compatible schema registry (Avro) backed by
    /// Postgres. Point pgcdc, Kafka clients and Confluent's serializers at
    /// http://LISTEN.
    Registry(RegistryArgs),
}

#[derive(Debug, clap::Args)]
pub struct RegistryArgs {
    /// Address to listen on.
    #[arg(long, env = "PGCDC_REGISTRY_LISTEN", default_value = "127.0.0.1:8081")]
    pub listen: SocketAddr,
    /// Postgres connection string of the store; the `pgcdc_registry`
    /// schema is created there.
    #[arg(long, env = "PGCDC_REGISTRY_STORE", hide_env_values = true)]
    pub store: String,
    /// Require basic auth with USER:PASSWORD. Prefer the environment
    /// variable or --basic-auth-file: command lines are visible to other
    /// users of the machine.
    #[arg(long, env = "PGCDC_REGISTRY_BASIC_AUTH", hide_env_values = true)]
    pub basic_auth: Option<String>,
    /// File of USER:PASSWORD lines, each an accepted credential.
    #[arg(long)]
    pub basic_auth_file: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct ConfigArg {
    /// Connector definition, e.g. connectors/demo.toml.
    #[arg(long, short = 'c', env = "PGCDC_CONFIG")]
    pub config: PathBuf,
}
