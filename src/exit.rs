//! Process exit codes, one meaning each, shared by every command.

use std::process::ExitCode;

/// Success.
pub const OK: u8 = 0;
/// The command could not do its job (bad config, unreachable system, bug).
pub const FAILURE: u8 = 1;
/// The command ran, and a check or requirement it evaluates did not hold
/// (`check`, `validate`, `retention --require`).
pub const CHECK_FAILED: u8 = 2;

pub fn code(c: u8) -> ExitCode {
    ExitCode::from(c)
}
