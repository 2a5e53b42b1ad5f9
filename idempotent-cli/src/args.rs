//! The command line: global options and one subcommand per operator task.

use std::time::Duration;

use clap::{Parser, Subcommand};
use idempotent_runtime::admin::State;

/// What `--help` says about exit codes (scripts may rely on them).
const EXIT_CODES: &str = "\
Exit codes:
  0  done
  1  not found (the key has no record)
  2  usage: bad arguments, a malformed or unknown store URL
  3  the store could not be reached, opened or queried
  4  refused: a completed record or a live running claim without --force, not confirmed, or the record changed since it was inspected";

/// Inspect, list, release and count the records of an idempotency store.
#[derive(Debug, Parser)]
#[command(name = "idempotent", version, after_help = EXIT_CODES)]
pub struct Cli {
    /// The store, as `AnyStore::from_url` takes it: `redis://HOST[:PORT][/DB]`, `postgres://USER@HOST/DB`,
    /// `mysql://USER@HOST/DB`, `sqlite://PATH` (must exist), `memory://`.
    #[arg(long, env = "IDEMPOTENT_STORE", global = true, hide_env_values = true)]
    pub store: Option<String>,

    /// Print JSON for scripts instead of text.
    #[arg(long, global = true)]
    pub json: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show one key's record: state, owner token, time left, fingerprint, outcome.
    Inspect {
        /// The key's scope (the function's `scope`, or its module path and name).
        scope: String,
        /// The key.
        key: String,
    },
    /// List records, one page at a time.
    List {
        /// Only this scope.
        #[arg(long)]
        scope: Option<String>,
        /// Only records in this state.
        #[arg(long, value_parser = state)]
        state: Option<State>,
        /// Only records whose lease or retention ends within this time, such as 30s, 5m, 2h.
        #[arg(long, value_parser = duration)]
        expiring_within: Option<Duration>,
        /// Not available: no store records when a key was claimed (use --expiring-within).
        #[arg(long, value_name = "DURATION", hide = true)]
        older_than: Option<String>,
        /// At most this many records per page (at most 1000).
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Start after this cursor (printed at the end of the previous page).
        #[arg(long)]
        after: Option<String>,
        /// Follow every page to the end.
        #[arg(long)]
        all: bool,
    },
    /// End a stuck claim, so that the next call with the key runs its body.
    Release {
        /// The key's scope.
        scope: String,
        /// The key.
        key: String,
        /// Also delete a completed record (its key then runs again) or a running claim whose lease
        /// is live (its call, if still running, would then run beside a duplicate).
        #[arg(long)]
        force: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// Delete expired claims and records now (Redis expires them itself: 0).
    Purge {
        /// Delete the expired ones (the only kind this command deletes; required).
        #[arg(long, required = true)]
        expired: bool,
    },
    /// Count records per scope and state, and show the running claim closest to its end.
    Stats,
}

fn state(text: &str) -> Result<State, String> {
    State::parse(text).ok_or_else(|| format!("{text:?} is not a state: use running, done or expired"))
}

/// `90`, `90s`, `500ms`, `5m`, `2h`, `1d`.
pub fn duration(text: &str) -> Result<Duration, String> {
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration such as 30s, 5m or 2h"))?;
    let seconds = match unit {
        "ms" => return Ok(Duration::from_millis(value)),
        "" | "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{text:?} has an unknown unit: use ms, s, m, h or d")),
    };
    Ok(Duration::from_secs(value.saturating_mul(seconds)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_durations_parse() {
        assert_eq!(duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(duration("90"), Ok(Duration::from_secs(90)));
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(duration("5x").is_err() && duration("m").is_err());
    }

    #[test]
    fn cli_arguments_are_consistent() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
    }
}
