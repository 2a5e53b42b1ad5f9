//! How the command fails: one variant per documented exit code.

use std::process::ExitCode;

use idempotent_runtime::StoreError;
use idempotent_runtime::stores::StoreUrlError;

/// A failed command, and the exit code it ends with.
#[derive(Debug)]
pub enum Failure {
    /// 1: the key has no record.
    NotFound(String),
    /// 2: bad arguments or a bad store URL.
    Usage(String),
    /// 3: the store could not be reached, opened or queried.
    Store(String),
    /// 4: the command refused to act.
    Refused(String),
}

impl Failure {
    fn code(&self) -> u8 {
        match self {
            Failure::NotFound(_) => 1,
            Failure::Usage(_) => 2,
            Failure::Store(_) => 3,
            Failure::Refused(_) => 4,
        }
    }

    fn message(&self) -> &str {
        match self {
            Failure::NotFound(m) | Failure::Usage(m) | Failure::Store(m) | Failure::Refused(m) => m,
        }
    }

    /// Prints the failure on stderr (as JSON with `--json`) and gives its exit code.
    pub fn report(&self, json: bool) -> ExitCode {
        if json {
            eprintln!("{}", serde_json::json!({ "error": self.message(), "exit": self.code() }));
        } else {
            eprintln!("idempotent: {}", self.message());
        }
        ExitCode::from(self.code())
    }
}

impl From<StoreUrlError> for Failure {
    fn from(error: StoreUrlError) -> Self {
        match error {
            StoreUrlError::Connect { .. } => Failure::Store(error.to_string()),
            _ => Failure::Usage(error.to_string()),
        }
    }
}

impl From<StoreError> for Failure {
    fn from(error: StoreError) -> Self {
        let mut message = error.to_string();
        let mut source = std::error::Error::source(&error);
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        if looks_like_missing_table(&message) {
            message.push_str(
                " (the records table is missing: is this the right database, and has the application created it?)",
            );
        }
        Failure::Store(message)
    }
}

/// The three backends' words for a table that does not exist.
fn looks_like_missing_table(message: &str) -> bool {
    ["does not exist", "doesn't exist", "no such table"].iter().any(|words| message.contains(words))
}
