//! The command line: one binary, one subcommand per job.
//!
//! Every subcommand that talks to a pipeline takes `--config
//! connectors/NAME.toml` (or `PGCDC_CONFIG`); fields can be overridden from
//! the environment (see [`crate::config`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::config::{Config, ConfigError};
use crate::registry::{api, store::Store};
use crate::secret::Dsn;
use crate::source::{self, slot};
use crate::{exit, preflight};

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
    /// Run the connector: create the publication and slot if missing, take
    /// the initial snapshot, then stream every change to Kafka as Avro
    /// changelog events. SIGINT/SIGTERM flush, confirm and exit 0.
    Run(RunArgs),
    /// Build the mirror tables and read models in the target database from
    /// the changelog topics, in a consumer group, with exactly-once effects
    /// (position guard, offsets committed after the database transaction).
    /// SIGINT/SIGTERM finish the batch in hand and exit 0.
    Materialize(RunArgs),
    /// Print changelog events as JSON lines, decoded through the registry.
    /// Read-only: joins no consumer group, commits nothing.
    Tail(TailArgs),
    /// Serve a Confluent-compatible schema registry (Avro) backed by
    /// Postgres. Point pgcdc, Kafka clients and Confluent's serializers at
    /// http://LISTEN.
    Registry(RegistryArgs),
    /// Show or drop the pipeline's replication slot.
    Slot {
        #[command(subcommand)]
        action: SlotAction,
    },
}

#[derive(Debug, Subcommand)]
pub enum SlotAction {
    /// The slot's state: LSNs, retained WAL, wal_status, safe_wal_size.
    /// Exit 2 when the slot is invalidated (wal_status=lost).
    Status {
        #[command(flatten)]
        config: ConfigArg,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Drop the slot (refused while a connection holds it). Postgres then
    /// frees the WAL it retained; the next `pgcdc run` creates a new slot
    /// and, in snapshot mode `initial`, takes a new snapshot.
    Drop {
        #[command(flatten)]
        config: ConfigArg,
        /// Confirm: dropping a slot loses its position in the WAL.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Serve Prometheus metrics at http://ADDR/metrics.
    #[arg(long, env = "PGCDC_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
}

#[derive(Debug, clap::Args)]
pub struct TailArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Only this captured table (schema.table); default: all of them.
    #[arg(long)]
    pub table: Option<String>,
    /// Stop after this many events.
    #[arg(long, default_value_t = 100)]
    pub max: usize,
    /// Stop when nothing arrives for this many seconds.
    #[arg(long, default_value_t = 5)]
    pub idle_secs: u64,
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

/// Why a command stopped: a message for stderr, and the exit code.
#[derive(Debug)]
struct Failure(String);

impl<E: std::fmt::Display> From<E> for Failure {
    fn from(e: E) -> Failure {
        Failure(e.to_string())
    }
}

/// Runs one command to completion and returns its exit code.
pub async fn execute(command: Command) -> u8 {
    let outcome = match command {
        Command::Validate(args) => validate(&args),
        Command::Check(args) => check(&args).await,
        Command::Slot { action } => slot_command(action).await,
        Command::Run(args) => run(&args).await,
        Command::Materialize(args) => materialize(&args).await,
        Command::Registry(args) => registry(args).await,
        Command::Tail(args) => tail(&args).await,
    };
    match outcome {
        Ok(code) => code,
        Err(Failure(message)) => {
            eprintln!("error: {message}");
            exit::FAILURE
        }
    }
}

/// Loads a config, printing each field error on its own line.
fn load(args: &ConfigArg) -> Result<Config, ConfigError> {
    Config::load(&args.config).inspect_err(|e| {
        if !e.field_errors().is_empty() {
            eprintln!("error: {} is invalid:", args.config.display());
            for fe in e.field_errors() {
                eprintln!("  {fe}");
            }
        }
    })
}

fn config_failure(e: ConfigError) -> Failure {
    if e.field_errors().is_empty() {
        Failure(e.to_string())
    } else {
        Failure("the config is invalid (see above)".to_string())
    }
}

fn validate(args: &ConfigArg) -> Result<u8, Failure> {
    match load(args) {
        Ok(config) => {
            print!("{}", config.to_redacted_toml());
            Ok(exit::OK)
        }
        Err(e) if !e.field_errors().is_empty() => Ok(exit::CHECK_FAILED),
        Err(e) => Err(config_failure(e)),
    }
}

async fn check(args: &ConfigArg) -> Result<u8, Failure> {
    let config = load(args).map_err(config_failure)?;
    let report = preflight::run(&config).await;
    print!("{}", report.render());
    Ok(if report.failed() {
        exit::CHECK_FAILED
    } else {
        exit::OK
    })
}

async fn slot_command(action: SlotAction) -> Result<u8, Failure> {
    let (SlotAction::Status { config: args, .. } | SlotAction::Drop { config: args, .. }) = &action;
    let config = load(args).map_err(config_failure)?;
    let name = &config.source.slot;
    let client = source::connect(&config.source.url).await.map_err(|e| {
        Failure(format!(
            "cannot connect to {}: {e}",
            config.source.url.redacted()
        ))
    })?;
    match action {
        SlotAction::Status { json, .. } => {
            let status = slot::status(&client, name)
                .await?
                .ok_or_else(|| Failure(format!("slot '{name}' does not exist")))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                println!("{status}");
            }
            if status.wal_status.as_deref() == Some("lost") {
                eprintln!("error: {}", slot::SlotError::Lost { slot: name.clone() });
                return Ok(exit::CHECK_FAILED);
            }
            Ok(exit::OK)
        }
        SlotAction::Drop { yes: false, .. } => Err(Failure(format!(
            "dropping slot '{name}' loses its position in the WAL; add --yes to confirm"
        ))),
        SlotAction::Drop { yes: true, .. } => {
            slot::drop(&client, name).await?;
            println!("slot '{name}' dropped");
            Ok(exit::OK)
        }
    }
}

async fn registry(args: RegistryArgs) -> Result<u8, Failure> {
    let mut users = Vec::new();
    if let Some(pair) = &args.basic_auth {
        users.push(
            api::Credentials::parse(pair)
                .ok_or_else(|| Failure("--basic-auth must be USER:PASSWORD".to_string()))?,
        );
    }
    if let Some(path) = &args.basic_auth_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Failure(format!("cannot read {}: {e}", path.display())))?;
        for (n, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            users.push(api::Credentials::parse(line).ok_or_else(|| {
                Failure(format!(
                    "{} line {}: expected USER:PASSWORD",
                    path.display(),
                    n + 1
                ))
            })?);
        }
    }
    let dsn = Dsn::new(args.store);
    let store = Store::open(&dsn)
        .await
        .map_err(|e| Failure(format!("cannot open the store at {}: {e}", dsn.redacted())))?;
    api::serve(args.listen, store, users)
        .await
        .map_err(|e| Failure(format!("cannot serve on {}: {e}", args.listen)))?;
    Ok(exit::OK)
}

async fn tail(args: &TailArgs) -> Result<u8, Failure> {
    let config = load(&args.config).map_err(config_failure)?;
    let tables = match &args.table {
        Some(t) if config.source.tables.contains(t) => vec![t.clone()],
        Some(t) => return Err(Failure(format!("--table {t} is not one of source.tables"))),
        None => config.source.tables.clone(),
    };
    crate::tail::run(
        &config,
        &tables,
        args.max,
        std::time::Duration::from_secs(args.idle_secs),
    )
    .await
    .map_err(Failure)?;
    Ok(exit::OK)
}

async fn run(args: &RunArgs) -> Result<u8, Failure> {
    let config = load(&args.config).map_err(config_failure)?;
    if let Some(addr) = args.metrics_addr {
        crate::observe::install(addr).map_err(Failure)?;
    }
    crate::connector::run(config).await?;
    Ok(exit::OK)
}

async fn materialize(args: &RunArgs) -> Result<u8, Failure> {
    let config = load(&args.config).map_err(config_failure)?;
    if let Some(addr) = args.metrics_addr {
        crate::observe::install(addr).map_err(Failure)?;
    }
    crate::materialize::run(config).await?;
    Ok(exit::OK)
}
