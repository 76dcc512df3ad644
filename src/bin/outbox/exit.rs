//! How the tool and the lab end: parse the command line, run, and turn the result into
//! an exit status (both binaries share this module).

use std::process::ExitCode;

use clap::Parser;

use crate::render::clean;

/// Exit status when the command could not do its job (Nagios' "unknown"), usage errors
/// included.
pub const EXIT_ERROR: u8 = 3;

/// What a command returns: its exit status, or the error to print.
pub type CliResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// Parses the command line as `C`, runs it, and exits with its status (`EXIT_ERROR`
/// after printing the error, or a usage error).
pub fn main<C: Parser>(run: impl FnOnce(C) -> CliResult<u8>) -> ExitCode {
    let cli = match C::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_ERROR } else { 0 });
        }
    };
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {}", clean(&e.to_string()));
            ExitCode::from(EXIT_ERROR)
        }
    }
}
