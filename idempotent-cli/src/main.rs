//! `idempotent`: look at and mend the records of an idempotency store, opened by URL.
//!
//! The entry point: parse the arguments, run the command on a single-threaded runtime, exit with
//! the code of [`exit::Failure`] (documented in `--help`).

mod args;
mod commands;
mod exit;
mod show;

use clap::Parser as _;

fn main() -> std::process::ExitCode {
    let cli = args::Cli::parse();
    let json = cli.json;
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => return exit::Failure::Store(format!("could not start the async runtime: {e}")).report(json),
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(failure) => failure.report(json),
    }
}
