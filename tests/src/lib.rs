//! Shared pieces of the integration tests: finding the servers, and the store conformance suite
//! that every store must pass.

#[cfg(feature = "redis-cluster")]
pub mod cluster;
pub mod conformance;
#[cfg(feature = "postgres")]
pub mod consume;
pub mod fresh;
#[cfg(feature = "grpc")]
pub mod grpc;
pub mod proxy;
pub mod python;
#[cfg(feature = "redis")]
pub mod replicated;
pub mod services;
pub mod simulation;
pub mod stress;
pub mod unrecorded;

use std::future::Future;
use std::time::Duration;

/// Runs a test program (a `CARGO_BIN_EXE_*` path) with `args` to its end, and returns the lines
/// of its standard output.
///
/// # Panics
///
/// When it cannot be started or exits with a failure; the message holds what it printed.
#[must_use]
pub fn output_lines(program: &str, args: &[&str]) -> Vec<String> {
    let output = std::process::Command::new(program).args(args).output();
    let output = output.unwrap_or_else(|error| panic!("cannot run {program}: {error}"));
    let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{program} {args:?} failed ({}): {stdout}{stderr}", output.status);
    stdout.lines().map(str::to_owned).collect()
}

/// Polls `future` up to `polls` times, `gap` apart (the thread sleeps between polls, so a
/// server's reply arrives in pieces meanwhile); `true` if it finished, else it is dropped
/// unfinished, as a caller's `timeout` would drop it.
pub async fn poll_then_drop<F: Future>(future: F, polls: u32, gap: Duration) -> bool {
    let mut future = std::pin::pin!(future);
    for _ in 0..polls {
        if std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx).is_ready())).await {
            return true;
        }
        std::thread::sleep(gap);
    }
    false
}

use idempotent_runtime::{Completion, Key, Store, StoreError, Token};

/// Direct store steps in the short form the tests use.
pub trait StoreSteps: Store {
    /// [`Store::complete`] of `token`'s claim on `key` with `outcome`, without a fingerprint.
    fn complete_as<'a>(
        &'a self,
        key: &'a Key,
        token: &'a Token,
        outcome: &'a [u8],
        retention: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        async move { self.complete(&Completion::new(key, token, None, outcome, retention)).await }
    }
}

impl<S: Store + ?Sized> StoreSteps for S {}

/// An event as text: `LEVEL target: field=value ...`.
#[must_use]
pub fn event_text(event: &tracing::Event<'_>) -> String {
    struct Fields(String);
    impl tracing::field::Visit for Fields {
        fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
            use std::fmt::Write as _;
            let _ = write!(self.0, " {}={value:?}", field.name());
        }
    }
    let metadata = event.metadata();
    let mut fields = Fields(format!("{} {}:", metadata.level(), metadata.target()));
    event.record(&mut fields);
    fields.0
}
