//! The Redis store: one hash per key, each step one Lua script.
//!
//! # Layout
//!
//! Each idempotency key is **one Redis hash** named `<prefix><scope>:<key>`, for example
//! `idempotent:payments:req-42` with the default prefix `idempotent:`. Its fields:
//!
//! | field     | while the call runs          | after it completed                           |
//! |-----------|------------------------------|----------------------------------------------|
//! | `state`   | `running`                    | `done`                                       |
//! | `token`   | the owner token (32 hex)     | the token of the call that recorded it       |
//! | `fp`      | the request fingerprint (64 hex), absent when the call has none | same          |
//! | `outcome` | absent                       | the recorded outcome (JSON, see the crate docs) |
//!
//! The hash's expiry is the claim's lease while it runs, and the retention once completed, so
//! Redis itself forgets abandoned claims and old records; nothing needs sweeping. An operator can
//! inspect a key with `redis-cli HGETALL 'idempotent:payments:req-42'` and `redis-cli PTTL ...`,
//! and free a stuck claim with `DEL` (the running call then gets [`Error::LeaseLost`](crate::Error::LeaseLost)
//! when it finishes).
//!
//! The key text is appended to the prefix verbatim and passed to the scripts as `KEYS[1]`, never
//! spliced into script text, so keys holding `*`, `{`, `:` or spaces stay inside the prefix.
//!
//! # Round trips and atomicity
//!
//! Each step is a single `EVALSHA` of a small script on a single key, so it is atomic on the
//! server: a first execution costs two round trips (claim, complete), a replay one. When the
//! server does not know a script yet (after a restart or `SCRIPT FLUSH`), it is loaded once and
//! the call is repeated. Because every script touches exactly one key, the store is safe for Redis
//! Cluster by construction, but cluster mode is **untested**.
//!
//! # Connections and failures
//!
//! The store holds a [`ConnectionManager`], which multiplexes every call over one connection and
//! reconnects by itself after the connection is lost: a store outlives a Redis restart. During an
//! outage, calls fail with [`StoreError::Backend`] (`backend == "redis"`), which the protocol
//! reports as [`Error::Store`](crate::Error::Store) without running the body. A call whose body
//! ran but whose completion failed keeps its claim until the lease ends. With the settings of
//! [`RedisStore::connect`], a call during an outage fails after the manager's reconnection attempts,
//! about 1 to 2.5 s on a refused connection (measured on loopback). A call refused before reaching
//! any server (connection refused) is retried once, so the first call after the server comes back
//! reconnects and succeeds instead of failing on the manager's last failed attempt.
//!
//! [`RedisStore::connect`] configures the manager with a response timeout of
//! [`DEFAULT_RESPONSE_TIMEOUT`] (a hung server gives a timeout error instead of a call that never
//! returns), a connection timeout of [`DEFAULT_CONNECTION_TIMEOUT`] and
//! [`DEFAULT_RECONNECT_RETRIES`] reconnection attempts per failed call. Build your own manager and
//! pass it to [`RedisStore::new`] to choose otherwise.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{RedisError, Script, Value};

use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::{Claim, ClaimRequest, Detached, Fingerprint, Key, Record, Store, StoreError, Token};

/// The `redis` crate this store is built on, to build a [`ConnectionManager`] of the same version.
pub use redis;

/// The key prefix used unless [`RedisStore::with_prefix`] sets another.
pub const DEFAULT_PREFIX: &str = "idempotent:";
/// The longest prefix [`RedisStore::with_prefix`] accepts, in bytes.
pub const MAX_PREFIX_BYTES: usize = 256;
/// How long [`RedisStore::connect`] waits for a reply before failing the call (2 s).
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long [`RedisStore::connect`] waits for a TCP connection to open (1 s).
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
/// How many times [`RedisStore::connect`]'s manager retries a lost connection (with exponential
/// back-off from 100 ms) before the waiting call fails.
pub const DEFAULT_RECONNECT_RETRIES: usize = 3;

/// Longest expiry passed to Redis (about 31 700 years): longer durations are capped so that
/// `PEXPIRE` cannot overflow.
const MAX_EXPIRY_MILLIS: u64 = 1_000_000_000_000_000;

/// `KEYS[1]`: the record. `ARGV`: token, fingerprint (`""` for none), lease in ms.
/// Returns `{1}` when claimed, `{2, fp, outcome}` when completed, `{3, fp, pttl}` when running,
/// `{0, what}` when the key holds something this store did not write.
const CLAIM_LUA: &str = r"
local kind = redis.call('TYPE', KEYS[1]).ok
if kind == 'none' then
  if ARGV[2] == '' then
    redis.call('HSET', KEYS[1], 'state', 'running', 'token', ARGV[1])
  else
    redis.call('HSET', KEYS[1], 'state', 'running', 'token', ARGV[1], 'fp', ARGV[2])
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1}
end
if kind ~= 'hash' then
  return {0, 'the key holds a ' .. kind .. ', not a hash'}
end
local f = redis.call('HMGET', KEYS[1], 'state', 'fp', 'outcome')
if f[1] == 'done' and f[3] then
  return {2, f[2] or '', f[3]}
end
if f[1] == 'running' then
  return {3, f[2] or '', redis.call('PTTL', KEYS[1])}
end
return {0, 'the hash has no valid state/outcome fields'}
";

/// `KEYS[1]`: the record. `ARGV`: token, outcome, retention in ms. Returns 1, or 0 if not owner.
/// A record this token already completed answers 1 and is left as it is.
const COMPLETE_LUA: &str = r"
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return 0 end
local f = redis.call('HMGET', KEYS[1], 'state', 'token')
if f[2] ~= ARGV[1] then return 0 end
if f[1] == 'done' then return 1 end
if f[1] ~= 'running' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'outcome', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
";

/// `KEYS[1]`: the record. `ARGV`: token, lease in ms. Returns 1, or 0 if not owner.
const EXTEND_LUA: &str = r"
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return 0 end
local f = redis.call('HMGET', KEYS[1], 'state', 'token')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
";

/// `KEYS[1]`: the record. `ARGV`: token. Returns 1, or 0 if not owner.
const RELEASE_LUA: &str = r"
if redis.call('TYPE', KEYS[1]).ok ~= 'hash' then return 0 end
local f = redis.call('HMGET', KEYS[1], 'state', 'token')
if f[1] ~= 'running' or f[2] ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
";

static CLAIM: LazyLock<Script> = LazyLock::new(|| Script::new(CLAIM_LUA));
static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(COMPLETE_LUA));
static RELEASE: LazyLock<Script> = LazyLock::new(|| Script::new(RELEASE_LUA));
static EXTEND: LazyLock<Script> = LazyLock::new(|| Script::new(EXTEND_LUA));

/// A store in Redis: records shared by every process that uses the same server and prefix.
///
/// See the [module docs](self) for the key layout, timeouts and behaviour during outages.
/// Cloning is cheap and gives another handle to the same connection.
///
/// ```no_run
/// use idempotent_runtime::{idempotent, Error};
/// use idempotent_runtime::stores::redis::RedisStore;
///
/// #[idempotent(key = order, store = store)]
/// async fn ship(store: &RedisStore, order: u64) -> Result<String, Error> {
///     Ok(format!("shipped {order}"))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379").await?.with_prefix("shop:idem:")?;
/// assert_eq!(ship(&store, 7).await?, "shipped 7");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    manager: ConnectionManager,
    prefix: Arc<str>,
    max_record_bytes: usize,
}

/// Why [`RedisStore::with_prefix`] refused a prefix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid Redis key prefix {prefix:?}: {reason}; use non-empty printable text of at most \
     {MAX_PREFIX_BYTES} bytes, such as \"myapp:idempotent:\""
)]
pub struct InvalidPrefix {
    /// The refused prefix.
    pub prefix: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl RedisStore {
    /// A store over an existing connection manager, with the default prefix and record limit.
    ///
    /// The manager's own settings (response timeout, reconnection) apply to every call.
    #[must_use]
    pub fn new(manager: ConnectionManager) -> Self {
        RedisStore { manager, prefix: DEFAULT_PREFIX.into(), max_record_bytes: DEFAULT_MAX_RECORD_BYTES }
    }

    /// Connects to `url` (such as `redis://127.0.0.1:6379/0` or `rediss://...`) with the timeouts
    /// described in the [module docs](self).
    ///
    /// Fails if the URL is malformed or the server cannot be reached now.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(backend)?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(DEFAULT_RESPONSE_TIMEOUT))
            .set_connection_timeout(Some(DEFAULT_CONNECTION_TIMEOUT))
            .set_number_of_retries(DEFAULT_RECONNECT_RETRIES);
        let manager = ConnectionManager::new_with_config(client, config).await.map_err(backend)?;
        Ok(Self::new(manager))
    }

    /// Names keys `<prefix><scope>:<key>` (default [`DEFAULT_PREFIX`]).
    ///
    /// Stores with different prefixes never see each other's records. The prefix must be
    /// non-empty, at most [`MAX_PREFIX_BYTES`] long and free of control characters.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Result<Self, InvalidPrefix> {
        let prefix = prefix.into();
        if let Some(reason) = prefix_problem(&prefix) {
            return Err(InvalidPrefix { prefix, reason });
        }
        self.prefix = prefix.into();
        Ok(self)
    }

    /// Records outcomes of at most `limit` encoded bytes (default [`DEFAULT_MAX_RECORD_BYTES`]).
    #[must_use]
    pub fn with_max_record_bytes(mut self, limit: usize) -> Self {
        self.max_record_bytes = limit;
        self
    }

    /// The key prefix.
    #[must_use]
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The Redis key that holds `key`'s record: `<prefix><scope>:<key>`.
    #[must_use]
    pub fn redis_key(&self, key: &Key) -> String {
        let mut name = String::with_capacity(self.prefix.len() + key.as_str().len());
        name.push_str(&self.prefix);
        name.push_str(key.as_str());
        name
    }

    /// A clone of the connection manager, to send commands of your own.
    #[must_use]
    pub fn connection(&self) -> ConnectionManager {
        self.manager.clone()
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("max_record_bytes", &self.max_record_bytes)
            .finish_non_exhaustive()
    }
}

fn prefix_problem(prefix: &str) -> Option<&'static str> {
    if prefix.is_empty() {
        Some("it is empty")
    } else if prefix.len() > MAX_PREFIX_BYTES {
        Some("it is too long")
    } else if prefix.chars().any(char::is_control) {
        Some("it holds a control character")
    } else {
        None
    }
}

fn backend(error: RedisError) -> StoreError {
    StoreError::backend("redis", error)
}

/// Milliseconds for `PEXPIRE`: rounded up (Redis refuses 0) and capped.
fn expiry_millis(duration: Duration) -> u64 {
    let millis = duration.as_nanos().div_ceil(1_000_000).max(1);
    u64::try_from(millis).unwrap_or(u64::MAX).min(MAX_EXPIRY_MILLIS)
}

/// Runs a script, retrying once if the connection was refused: then the command never reached a
/// server, and the retry makes the manager reconnect (after a restart, the first call would
/// otherwise fail on the manager's last, failed, reconnection attempt).
async fn invoke(manager: &ConnectionManager, script: &Script, key: &str, args: &[&[u8]]) -> Result<Value, StoreError> {
    let mut invocation = script.key(key);
    for arg in args {
        invocation.arg(*arg);
    }
    let mut connection = manager.clone();
    match invocation.invoke_async(&mut connection).await {
        Err(e) if e.is_connection_refusal() => invocation.invoke_async(&mut connection).await.map_err(backend),
        result => result.map_err(backend),
    }
}

/// A fenced script's reply: 1 done, 0 not the owner.
fn owner_reply(value: &Value) -> Result<(), StoreError> {
    match value {
        Value::Int(1) => Ok(()),
        Value::Int(0) => Err(StoreError::NotOwner),
        other => Err(StoreError::Corrupt(format!("unexpected reply from the Redis script: {other:?}"))),
    }
}

fn parse_claim(reply: Value, redis_key: &str) -> Result<Claim, StoreError> {
    let corrupt = |what: &str| {
        StoreError::Corrupt(format!(
            "Redis key {redis_key:?} {what}; it was not written by this store (or by an incompatible \
             version): inspect it with HGETALL and delete it, or use another prefix"
        ))
    };
    let Value::Array(items) = reply else {
        return Err(corrupt("gave an unexpected script reply"));
    };
    let bytes = |index: usize, field: &str| match items.get(index) {
        Some(Value::BulkString(b)) => Ok(b.clone()),
        Some(Value::SimpleString(s)) => Ok(s.clone().into_bytes()),
        _ => Err(corrupt(&format!("has no readable {field}"))),
    };
    match items.first() {
        Some(Value::Int(1)) => Ok(Claim::Claimed),
        Some(Value::Int(2)) => {
            let fingerprint = fingerprint(bytes(1, "fp")?, &corrupt)?;
            Ok(Claim::Completed(Record { fingerprint, outcome: bytes(2, "outcome")? }))
        }
        Some(Value::Int(3)) => {
            let fingerprint = fingerprint(bytes(1, "fp")?, &corrupt)?;
            let Some(Value::Int(pttl)) = items.get(2) else {
                return Err(corrupt("gave no PTTL"));
            };
            // -1 (no expiry) cannot happen with this store's writes; report it as unknown.
            let lease_remaining = u64::try_from(*pttl).ok().map(Duration::from_millis);
            Ok(Claim::InProgress { fingerprint, lease_remaining })
        }
        Some(Value::Int(0)) => Err(corrupt(&String::from_utf8_lossy(&bytes(1, "description")?))),
        _ => Err(corrupt("gave an unexpected script reply")),
    }
}

fn fingerprint(bytes: Vec<u8>, corrupt: &impl Fn(&str) -> StoreError) -> Result<Option<Fingerprint>, StoreError> {
    if bytes.is_empty() {
        return Ok(None);
    }
    String::from_utf8(bytes).map(|fp| Some(Fingerprint::from_stored(fp))).map_err(|_| corrupt("has a non-UTF-8 fp"))
}

impl Store for RedisStore {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        let name = self.redis_key(request.key);
        let fingerprint = request.fingerprint.map_or("", Fingerprint::as_str);
        let lease = expiry_millis(request.lease).to_string();
        let args: [&[u8]; 3] = [request.token.as_str().as_bytes(), fingerprint.as_bytes(), lease.as_bytes()];
        let reply = invoke(&self.manager, &CLAIM, &name, &args).await?;
        parse_claim(reply, &name)
    }

    async fn complete(&self, key: &Key, token: &Token, outcome: &[u8], retention: Duration) -> Result<(), StoreError> {
        let name = self.redis_key(key);
        let retention = expiry_millis(retention).to_string();
        let args: [&[u8]; 3] = [token.as_str().as_bytes(), outcome, retention.as_bytes()];
        owner_reply(&invoke(&self.manager, &COMPLETE, &name, &args).await?)
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        let name = self.redis_key(key);
        owner_reply(&invoke(&self.manager, &RELEASE, &name, &[token.as_str().as_bytes()]).await?)
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        let name = self.redis_key(key);
        let lease = expiry_millis(lease).to_string();
        owner_reply(&invoke(&self.manager, &EXTEND, &name, &[token.as_str().as_bytes(), lease.as_bytes()]).await?)
    }

    fn detach(&self, step: Detached) {
        crate::stores::spawn_detached(self.clone(), step);
    }

    fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_expiry_is_rounded_up_and_capped() {
        assert_eq!(expiry_millis(Duration::ZERO), 1);
        assert_eq!(expiry_millis(Duration::from_micros(1)), 1);
        assert_eq!(expiry_millis(Duration::from_micros(1500)), 2);
        assert_eq!(expiry_millis(Duration::from_mins(1)), 60_000);
        assert_eq!(expiry_millis(Duration::MAX), MAX_EXPIRY_MILLIS);
    }

    #[test]
    fn redis_claim_replies_are_parsed_strictly() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        assert_eq!(parse_claim(Value::Array(vec![Value::Int(1)]), "k").unwrap(), Claim::Claimed);
        let done = Value::Array(vec![Value::Int(2), bulk(""), bulk("{\"Ok\":1}")]);
        assert_eq!(
            parse_claim(done, "k").unwrap(),
            Claim::Completed(Record { fingerprint: None, outcome: b"{\"Ok\":1}".to_vec() })
        );
        let running = Value::Array(vec![Value::Int(3), bulk("ab"), Value::Int(1500)]);
        assert_eq!(
            parse_claim(running, "k").unwrap(),
            Claim::InProgress {
                fingerprint: Some(Fingerprint::from_stored("ab")),
                lease_remaining: Some(Duration::from_millis(1500))
            }
        );
        let no_ttl = Value::Array(vec![Value::Int(3), bulk(""), Value::Int(-1)]);
        assert!(matches!(parse_claim(no_ttl, "k").unwrap(), Claim::InProgress { lease_remaining: None, .. }));
        for bad in [Value::Nil, Value::Array(vec![]), Value::Array(vec![Value::Int(2), bulk("")])] {
            assert!(matches!(parse_claim(bad, "k"), Err(StoreError::Corrupt(_))));
        }
        let foreign = Value::Array(vec![Value::Int(0), bulk("the key holds a string, not a hash")]);
        let Err(StoreError::Corrupt(message)) = parse_claim(foreign, "idempotent:s:k") else { panic!() };
        assert!(message.contains("holds a string") && message.contains("idempotent:s:k"), "{message}");
    }

    #[test]
    fn redis_prefixes_are_validated() {
        assert_eq!(prefix_problem(DEFAULT_PREFIX), None);
        assert_eq!(prefix_problem("app:{idem}:* ключ "), None);
        assert_eq!(prefix_problem(""), Some("it is empty"));
        assert_eq!(prefix_problem("a\nb"), Some("it holds a control character"));
        assert_eq!(prefix_problem("a\0"), Some("it holds a control character"));
        assert_eq!(prefix_problem(&"p".repeat(MAX_PREFIX_BYTES + 1)), Some("it is too long"));
        let e = InvalidPrefix { prefix: "a\nb".into(), reason: "it holds a control character" };
        assert!(e.to_string().contains("control character"), "{e}");
    }
}
