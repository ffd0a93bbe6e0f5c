//! Wiring only: parse the command line, set up logging, run the command.

use std::process::ExitCode;

use clap::Parser;
use pgcdc::cli::{self, Cli};
use pgcdc::exit;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

// Every change event allocates a few short-lived buffers; glibc's malloc
// spent a fifth of the connector's samples on them (unlink, consolidate).
// The `override` feature makes mimalloc the C `malloc` too: librdkafka
// allocates each message on a copy worker and frees it on its broker
// thread, which cost glibc another tenth of the snapshot's samples.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let parsed = Cli::parse();
    // Colours only on a terminal: a log file or a collector gets plain text.
    let colours = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none();
    let lines = tracing_subscriber::fmt::layer()
        .with_ansi(colours)
        .with_writer(std::io::stderr);
    let logs = tracing_subscriber::registry()
        .with(pgcdc::observe::log_filter(
            std::env::var("RUST_LOG").ok().as_deref(),
        ))
        .with(pgcdc::observe::row_value_guard());
    match parsed.log_format {
        cli::LogFormat::Text => logs.with(lines).init(),
        cli::LogFormat::Json => logs.with(lines.json().flatten_event(true)).init(),
    }
    match tokio::runtime::Runtime::new() {
        Ok(runtime) => {
            let outcome = runtime.block_on(cli::execute(parsed.command));
            // Whatever still runs on a blocking thread (a Kafka metadata
            // wait of up to 30 s, say) has no one left to await it: a stop
            // must not wait for it.
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
            exit::code(outcome)
        }
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            exit::code(exit::FAILURE)
        }
    }
}
