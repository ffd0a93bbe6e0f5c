//! Wiring only: parse the command line, set up logging, call the library.

use std::process::ExitCode;

use clap::Parser;
use pgcdc::cli::{Cli, Command};
use pgcdc::config::{Config, ConfigError};
use pgcdc::registry::{api, store::Store};
use pgcdc::secret::Dsn;
use pgcdc::{exit, preflight};

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return exit::code(exit::FAILURE);
        }
    };
    match cli.command {
        Command::Validate(args) => match Config::load(&args.config) {
            Ok(config) => {
                print!("{}", config.to_redacted_toml());
                exit::code(exit::OK)
            }
            Err(e) => {
                report_config_error(&e);
                exit::code(exit::CHECK_FAILED)
            }
        },
        Command::Check(args) => {
            let config = match Config::load(&args.config) {
                Ok(c) => c,
                Err(e) => {
                    report_config_error(&e);
                    return exit::code(exit::FAILURE);
                }
            };
            let report = runtime.block_on(preflight::run(&config));
            print!("{}", report.render());
            exit::code(if report.failed() {
                exit::CHECK_FAILED
            } else {
                exit::OK
            })
        }
        Command::Registry(args) => {
            let mut users = Vec::new();
            if let Some(pair) = &args.basic_auth {
                match api::Credentials::parse(pair) {
                    Some(c) => users.push(c),
                    None => {
                        eprintln!("error: --basic-auth must be USER:PASSWORD");
                        return exit::code(exit::FAILURE);
                    }
                }
            }
            if let Some(path) = &args.basic_auth_file {
                let text = match std::fs::read_to_string(path) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("error: cannot read {}: {e}", path.display());
                        return exit::code(exit::FAILURE);
                    }
                };
                for (n, line) in text
                    .lines()
                    .enumerate()
                    .filter(|(_, l)| !l.trim().is_empty())
                {
                    match api::Credentials::parse(line) {
                        Some(c) => users.push(c),
                        None => {
                            eprintln!(
                                "error: {} line {}: expected USER:PASSWORD",
                                path.display(),
                                n + 1
                            );
                            return exit::code(exit::FAILURE);
                        }
                    }
                }
            }
            let dsn = Dsn::new(args.store);
            let served = runtime.block_on(async {
                let store = Store::open(&dsn)
                    .await
                    .map_err(|e| format!("cannot open the store at {}: {e}", dsn.redacted()))?;
                api::serve(args.listen, store, users)
                    .await
                    .map_err(|e| format!("cannot serve on {}: {e}", args.listen))
            });
            match served {
                Ok(()) => exit::code(exit::OK),
                Err(e) => {
                    eprintln!("error: {e}");
                    exit::code(exit::FAILURE)
                }
            }
        }
    }
}

fn report_config_error(e: &ConfigError) {
    match e.field_errors() {
        [] => eprintln!("error: {e}"),
        errors => {
            eprintln!("error: invalid config:");
            for fe in errors {
                eprintln!("  {fe}");
            }
        }
    }
}
