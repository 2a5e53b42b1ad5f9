//! The subcommands: open the store, do one thing, print it.

use std::io::{BufRead as _, IsTerminal as _, Write as _};

use idempotent_runtime::admin::{Admin, ListQuery, Released, State};
use idempotent_runtime::{AnyStore, Key, Store as _};

use crate::args::{Cli, Command};
use crate::exit::Failure;
use crate::show;

/// Runs the command `cli` names.
pub async fn run(cli: Cli) -> Result<(), Failure> {
    let store = open(cli.store.as_deref()).await?;
    let json = cli.json;
    match cli.command {
        Command::Inspect { scope, key } => {
            let key = key_of(&scope, &key)?;
            let entry = store.inspect(&key).await?.ok_or_else(|| absent(&key))?;
            print(json, || show::entry_json(&entry), || show::entry_text(&entry));
        }
        Command::List { scope, state, expiring_within, older_than, limit, after, all } => {
            if older_than.is_some() {
                return Err(Failure::Usage(
                    "--older-than is not available: no store records when a key was claimed, only when its \
                     lease or retention ends; use --expiring-within (a crashed claim's lease only runs down)"
                        .into(),
                ));
            }
            let mut query = ListQuery::new(limit);
            query.scope = scope;
            query.state = state;
            query.expiring_within = expiring_within;
            query.cursor = after;
            let mut first = true;
            loop {
                let page = store.list(&query).await?;
                print(json, || show::page_json(&page), || show::page_text(&page, first));
                first = false;
                match page.next {
                    Some(next) if all => query.cursor = Some(next),
                    Some(next) if !json => {
                        println!("more: --after {next}");
                        break;
                    }
                    _ => break,
                }
            }
        }
        Command::Release { scope, key, force, yes } => {
            let key = key_of(&scope, &key)?;
            let seen = store.inspect(&key).await?.ok_or_else(|| absent(&key))?;
            if let Some(refusal) = needs_force(&key, &seen).filter(|_| !force) {
                return Err(Failure::Refused(refusal));
            }
            if !yes && !confirm(&key, &seen)? {
                return Err(Failure::Refused(format!("not confirmed: {key} left alone")));
            }
            match Admin::release(&store, &key, &seen).await? {
                Released::Deleted => print(
                    json,
                    || show::released_json(&seen, Released::Deleted),
                    || format!("released {key} ({} record of token {})\n", seen.state, seen.token),
                ),
                _ => {
                    return Err(Failure::Refused(format!(
                        "{key} changed since it was inspected (another claim, a completion, or gone): nothing deleted"
                    )));
                }
            }
        }
        Command::Purge { expired: _ } => {
            let purged = store.purge_expired().await?;
            print(json, || serde_json::json!({ "purged": purged }), || format!("purged {purged} expired records\n"));
        }
        Command::Stats => {
            let stats = store.stats().await?;
            print(json, || show::stats_json(&stats), || show::stats_text(&stats));
        }
    }
    Ok(())
}

/// Opens the store a URL names; a `sqlite://` file must exist (the tool never creates one).
async fn open(url: Option<&str>) -> Result<AnyStore, Failure> {
    let url = url.ok_or_else(|| Failure::Usage("no store: pass --store URL or set IDEMPOTENT_STORE".into()))?;
    if let Some(path) = url.strip_prefix("sqlite://") {
        let path = path.split_once('?').map_or(path, |(path, _)| path);
        if !path.is_empty() && !std::path::Path::new(path).exists() {
            return Err(Failure::Store(format!("no SQLite database at {path:?} (the tool does not create one)")));
        }
    }
    Ok(AnyStore::from_url(url).await?)
}

fn key_of(scope: &str, key: &str) -> Result<Key, Failure> {
    Key::new(scope, key).map_err(|e| Failure::Usage(e.to_string()))
}

fn absent(key: &Key) -> Failure {
    Failure::NotFound(format!("{key} has no record (never claimed, expired and deleted, or another store/prefix)"))
}

/// Why deleting `seen` could run a body twice, so that `release` wants `--force`: a completed
/// record runs its key again, and a running claim whose lease is live may belong to a call that
/// is still running (a live call renews its lease), which a duplicate would then run beside. An
/// expired record holds nothing and is deleted without it.
fn needs_force(key: &Key, seen: &idempotent_runtime::admin::Entry) -> Option<String> {
    match seen.state {
        State::Done => Some(format!(
            "{key} is completed: deleting it makes the next call with this key run its body again; \
             pass --force to delete it anyway"
        )),
        State::Running => Some(format!(
            "{key} is a running claim ({} of lease left): if its call still runs, releasing it lets a \
             duplicate run the body beside it; a claim whose process died frees itself when its lease ends. \
             Pass --force to release it now",
            seen.remaining.map_or_else(|| "some".to_owned(), show::duration)
        )),
        _ => None,
    }
}

/// Asks on the terminal; without one, refuses (pass `--yes`).
fn confirm(key: &Key, seen: &idempotent_runtime::admin::Entry) -> Result<bool, Failure> {
    if !std::io::stdin().is_terminal() {
        return Err(Failure::Refused("not confirmed: stdin is not a terminal; pass --yes".into()));
    }
    eprint!("delete the {} record of {key} (token {})? [y/N] ", seen.state, seen.token);
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer).map_err(|e| Failure::Refused(format!("no answer: {e}")))?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// Prints JSON or text.
fn print(json: bool, as_json: impl FnOnce() -> serde_json::Value, as_text: impl FnOnce() -> String) {
    if json {
        println!("{}", as_json());
    } else {
        print!("{}", as_text());
    }
}
