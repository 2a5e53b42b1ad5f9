//! The Redis store: one string per key, claimed and replayed with one native `SET`.
//!
//! # Layout
//!
//! Each idempotency key is **one Redis string** named `<prefix><scope>:<key>`, for example
//! `idempotent:payments:req-42` with the default prefix `idempotent:`. Its value is a header line,
//! then (once completed) the recorded outcome:
//!
//! ```text
//! idempotent/1 running <owner token> <fingerprint or ->\n
//! idempotent/1 done <owner token> <fingerprint or ->\n<outcome>
//! ```
//!
//! The owner token is 32 lowercase hex digits, the fingerprint 64 (or `-` when the call has none),
//! and the outcome is the encoded result, byte for byte (JSON, see the crate docs). A completed
//! record keeps the token of the call that completed it. `redis-cli GET 'idempotent:payments:req-42'`
//! shows, for example:
//!
//! ```text
//! "idempotent/1 done 5f0c5a3e6f2d4b8e9a1c7d3b2e4f6a80 -\n{\"Ok\":\"receipt 42\"}"
//! ```
//!
//! The key's expiry is the claim's lease while it runs and the retention once completed, so Redis
//! itself forgets abandoned claims and old records (`redis-cli PTTL ...`); nothing needs sweeping.
//! An operator frees a stuck claim with `DEL`. If its call is in fact still running, a duplicate
//! may now claim the key; the running call then gets
//! [`Error::LeaseLost`](crate::Error::LeaseLost) when it finishes, or, if nobody claimed the key
//! meanwhile, records its result. A value that does not parse
//! (another program's key under the prefix, another format version) is never overwritten: calls on
//! it fail with [`StoreError::Corrupt`], naming the key.
//!
//! The key text is appended to the prefix verbatim and sent as a command argument, never spliced
//! into script text, so keys holding `*`, `{`, `:` or spaces stay inside the prefix.
//!
//! # Commands and round trips
//!
//! - **claim and replay**: one native `SET key <running record> NX PX <lease> GET` (Redis ≥ 7.0).
//!   It writes the running record if the key is free and returns nothing, or leaves a taken key
//!   alone and returns its value: the completed record to replay, or the running one. A replay is
//!   therefore exactly one `SET`, the same command as a plain `SET NX PX`. Only when another call
//!   is running does the claim make a second, read-only, step (a script reading the value and its
//!   `PTTL` together) to report the running call's remaining lease in [`Claim::InProgress`].
//! - **complete**: on a server whose `SET` has the `IFEQ` option (Valkey 8.1 and newer; Redis
//!   8.4 has the same option, untested here), one native `SET key <completed record> PX
//!   <retention> IFEQ <running record> GET`: it writes the record only if the key still holds
//!   this call's claim byte for byte, and returns what it found either way. That is the usual
//!   case, a completion in one native command. Anything else it finds (nothing, the record this
//!   token already wrote, a claim made with another fingerprint, another token's claim) leaves the
//!   key as it was and goes to the completion script below, a second step. A server without
//!   `IFEQ` refuses the command with a syntax error, having done nothing: the store then completes
//!   by the script, and sends the script only from then on ([`RedisStore::with_native_completion`]).
//!   Any other refusal of the command (a proxy that does not pass the option on, say) also leaves
//!   that completion to the script; a failed connection or a server that cannot write now
//!   (`LOADING`, `READONLY`, a redirection) fails the completion, as the script would.
//! - **complete** (the script), **release**, **extend**: one `EVALSHA` each, of a script that reads
//!   the value once, compares its start with `idempotent/1 running <token> `, and then makes one
//!   write (`SET ... PX <retention>`, `DEL`, `PEXPIRE`). So each is atomic and fenced by the owner
//!   token. A completion finding the record already completed *by the same token* succeeds
//!   without writing (its earlier attempt's reply was lost). A lease that ran out is Redis's own
//!   expiry: the key is gone, so a late renewal or release gets [`StoreError::NotOwner`], while a
//!   late completion writes its record (nobody holds the key; the request's fingerprint travels
//!   with the completion for that case). A completion is refused only when another token holds
//!   the key.
//!   A claim whose `SET` finds the caller's *own* running record (the client resent it after
//!   losing the first reply, as the cluster client does) is that caller's claim.
//!
//! - **batches** ([`Store::claim_many`], [`Store::complete_many`]): the same commands for every
//!   key, in one pipeline sent and answered as one (a claim that finds another call running then
//!   probes it, as a single claim does; with [`RedisStore::with_replica_acks`], one `WAIT` at the
//!   pipeline's end). What it saves is mostly the client's work per call: the single steps, sent
//!   concurrently, share the multiplexed connection's round trips too, but cost this process
//!   twice to two and a half times the CPU per key (`batch_load`, BENCHMARKS.md). On a cluster,
//!   whose keys live on different nodes, a batch is its single steps, sent concurrently.
//!
//! A first execution costs two round trips (claim, complete), a replay one; on a server with
//! `IFEQ` both of a first execution's steps are native commands (BENCHMARKS.md measures them
//! beside the script). When a server does not know a script yet (after a restart, a failover or
//! `SCRIPT FLUSH`), the step is sent once more as `EVAL` with the script's text, which also
//! caches it.
//!
//! # Redis Cluster
//!
//! With the `redis-cluster` feature, [`RedisClusterStore`] is the same store over the redis
//! crate's asynchronous cluster connection (see [`RedisClusterStore::connect_cluster`]). Every
//! step touches exactly one key, so each record lives on one slot, keys spread over all masters by
//! their hash slot, and the client follows `MOVED` and `ASK` redirections and topology changes. A
//! prefix holding a hash tag (`{...}`) would put every record on one slot, and so on one master.
//!
//! # Durability: what a failover can lose
//!
//! Redis replicates asynchronously. By default ([`RedisStore::with_replica_acks`] not set) a
//! completion is acknowledged as soon as the master has it. If the master then dies before its
//! replica received the record and the replica is promoted, the record is gone: the next call with
//! that key runs the body again, although the first call's completion was acknowledged. A claim
//! can be lost the same way, letting a duplicate run while the first call still runs (that first
//! call then gets [`Error::LeaseLost`](crate::Error::LeaseLost) instead of recording).
//!
//! With `with_replica_acks(n, timeout)`, each completion is followed by `WAIT n timeout` on the
//! record's master (sent with it, in one round trip), and is acknowledged only once `n` replicas have the record; otherwise it fails
//! with [`StoreError::Backend`] and the protocol retries it within the lease (a retry with the
//! same token is accepted by the record it already wrote, and writes the record's expiry again so
//! that its `WAIT` waits for the replicas to have the record). A promoted replica that acknowledged the
//! record then still has it. `WAIT` does not make Redis strongly consistent (a replica that
//! acknowledged can still lose the election to one that did not, with more than one replica per
//! master), and claims are not waited for. BENCHMARKS.md and RELIABILITY.md give the measured
//! losses of both modes and the cost of `WAIT`.
//!
//! # Server requirements
//!
//! - **Redis 7.0 or newer** ([`MIN_REDIS_VERSION`]): the claim is `SET ... NX PX ... GET`.
//!   [`RedisStore::connect`] and [`RedisClusterStore::connect_cluster`] read the server's `INFO`
//!   and refuse an older server with [`StoreError::Rejected`]. Tested by `.ci/run` on Redis
//!   7.0.15 and 8.2.3 (completions by the script) and Valkey 8.1.1 (completions by `SET ...
//!   IFEQ`), and the cluster on 7.0.15 and Valkey 8.1.1.
//! - **`maxmemory-policy noeviction`** (Redis's default). Under any evicting policy (`allkeys-*`,
//!   and `volatile-*` too: every key of this store has an expiry) a server short of memory drops
//!   keys: a dropped record makes its key run again, and a dropped claim lets a duplicate run
//!   while the first call still runs. The connect functions log a warning (target `idempotent`)
//!   when the policy is another. With `noeviction`, a full server refuses writes: claims fail
//!   with [`StoreError::Backend`] and nothing runs.
//! - **Persistence** if records must survive a restart of the server: without AOF or RDB
//!   snapshots, a restart forgets every record and claim (keys then run again), and so does a
//!   failover to a replica that had not received them (see the next section). With
//!   `appendfsync everysec`, up to a second of completions can be lost in a crash.
//! - **A clock that does not jump**: leases and retentions are Redis's own key expiries, which
//!   follow the server's clock. A clock stepped forward ends leases early (a duplicate may then
//!   run while the first call still runs, as after a lease lost to an outage) and records early;
//!   stepped back, it keeps them longer. Keep servers on NTP with slewing, not stepping.
//!
//! # Connections and failures
//!
//! [`RedisStore::connect`] builds a [`ConnectionManager`], which multiplexes every call over one
//! connection and reconnects by itself after the connection is lost: a store outlives a Redis
//! restart. During an outage, calls fail with [`StoreError::Backend`] (`backend == "redis"`), which
//! the protocol reports as [`Error::Store`](crate::Error::Store) without running the body. A call
//! whose body ran but whose completion failed keeps its claim until the lease ends. With the
//! settings of [`RedisStore::connect`], a call during an outage fails after the manager's
//! reconnection attempts, about 1 to 2.5 s on a refused connection (measured on loopback). A step
//! refused before reaching any server (connection refused) is sent once more, so the first call
//! after the server comes back reconnects and succeeds instead of failing on the manager's last
//! failed attempt. A step whose connection was lost while it was in flight (the server may have
//! done it, and its reply never came) is also sent once more, on the reconnected link: with the
//! same token, each step finds its own first send and answers as it would have, so a lost reply
//! does not fail the call (`tests/tests/redis.rs`, `redis_steps_whose_reply_was_lost_are_sent_again`).
//! The cluster client resends such steps by itself.
//!
//! Every step is also bounded by the store's own [`RedisStore::with_timeout`] (default
//! [`DEFAULT_STEP_TIMEOUT`], 10 s), whatever the connection does underneath: a step whose reply
//! never comes fails with [`TimedOut`] instead of waiting for ever. After a step that timed out
//! or lost its connection, the cluster store replaces its connection with a new one (in the
//! background, one at a time). A cluster client
//! was seen sending nothing at all after a master was killed mid-run: its connections stayed idle
//! for good, the cluster healthy, every step waiting on it (`tests/tests/redis_cluster.rs` kills
//! masters mid-run; see RELIABILITY.md).
//!
//! [`RedisStore::connect`] configures the manager with a response timeout of
//! [`DEFAULT_RESPONSE_TIMEOUT`] (a hung server gives a timeout error instead of a call that never
//! returns), a connection timeout of [`DEFAULT_CONNECTION_TIMEOUT`] and
//! [`DEFAULT_RECONNECT_RETRIES`] reconnection attempts per failed call. Build your own manager and
//! pass it to [`RedisStore::new`] to choose otherwise.

mod admin;
mod batch;
#[cfg(feature = "redis-cluster")]
mod cluster;
mod connection;
mod record;
mod server;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, RedisError, RedisResult, RedisWrite, ToRedisArgs, Value};

use crate::store::DEFAULT_MAX_RECORD_BYTES;
use crate::stores::TimedOut;
use crate::{Claim, ClaimRequest, Completion, Detached, Key, Store, StoreError, Token};

#[cfg(feature = "redis-cluster")]
pub use cluster::{DEFAULT_CLUSTER_RETRIES, RedisClusterStore};
pub use connection::RedisConnection;
/// The `redis` crate this store is built on, to build a [`ConnectionManager`] of the same version.
pub use redis;
pub use server::MIN_REDIS_VERSION;

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
/// The longest a store step may take, whatever the connection does underneath (10 s; change it
/// with [`RedisStore::with_timeout`]): past it the step fails with [`TimedOut`].
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest expiry passed to Redis (about 31 700 years): longer durations are capped so that
/// `PX` cannot overflow.
const MAX_EXPIRY_MILLIS: u64 = 1_000_000_000_000_000;

/// `KEYS[1]`: the record. `ARGV`: this call's claim as the claim wrote it
/// (`idempotent/1 running <token> <fp|->\n`), the whole completed record (`idempotent/1 done
/// <token> <fp|->\n<outcome>`), the retention in ms, and `1` when a `WAIT` follows (else `0`).
/// Returns 1 when recorded (now, or by this token before), 0 if another token holds the key, -1
/// if the key holds another type than a string. A key that is gone (its lease ended and Redis
/// dropped it) is nobody's: the record is written.
///
/// The usual case, the key still holding this call's claim, is one comparison (Lua interns its
/// strings, so two equal strings are one) and the record is stored as the client sent it. Until
/// 2026-12-05 the script took six arguments and joined the record in Lua from the claim's header
/// and the outcome, which copies the outcome into a new Lua string; the usual case now costs the
/// server 16 % less time for a 42-byte outcome and 27 % less for a 1-KB one
/// (`scripts/complete_script_bench.py`). The rarer cases read the completed and running prefixes
/// (`idempotent/1 done <token> `, `idempotent/1 running <token> `) out of the two arguments, and
/// cost 5 to 34 % more than they did (a resent completion, another token's key, a claim with
/// another fingerprint). A claim made with another fingerprint than the completion
/// names (a direct caller of the `Store` trait may complete without one) keeps its own, as
/// before, through that join.
///
/// A record this token wrote before (an earlier attempt whose reply was lost) is left as it is,
/// unless a `WAIT` follows. On Redis 8, `WAIT` counts the replicas that have this connection's
/// own writes, and a new connection that wrote nothing has none to wait for; so the record's
/// expiry is set again (to the retention), a write that the replicas must acknowledge, and with
/// it, in the replication stream's order, the record itself.
const COMPLETE_LUA: &str = r"
local v = redis.pcall('GET', KEYS[1])
if v == ARGV[1] or v == false then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
if type(v) ~= 'string' then return -1 end
local done = string.match(ARGV[2], '^%S+ %S+ %S+ ')
if string.sub(v, 1, #done) == done then
  if ARGV[4] == '1' then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
  return 1
end
local running = string.match(ARGV[1], '^%S+ %S+ %S+ ')
if string.sub(v, 1, #running) == running then
  local outcome = string.sub(ARGV[2], string.find(ARGV[2], '\n', 1, true) + 1)
  redis.call('SET', KEYS[1], done .. string.sub(v, #running + 1) .. outcome, 'PX', ARGV[3])
  return 1
end
return 0
";

/// `KEYS[1]`: the record. `ARGV[1]`: the header prefix it must still start with (`idempotent/1 running
/// <token> ` for a release; the inspected state and token for the admin's fenced release). Deletes
/// it and returns 1, or returns 0.
const RELEASE_LUA: &str = r"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'string' and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
";

/// `KEYS[1]`: the record. `ARGV`: `idempotent/1 running <token> `, the lease in ms. Returns 1, or
/// 0 if not owner.
const EXTEND_LUA: &str = r"
local v = redis.pcall('GET', KEYS[1])
if type(v) == 'string' and string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// The buffer a claim or script command starts with: its header arguments, the key and a small
/// outcome fit, so building it does not grow the buffer step by step (a larger outcome grows it).
const COMMAND_BYTES: usize = 512;

/// A script's text and its SHA-1, for `EVALSHA` with a fallback to `EVAL`.
struct Lua {
    source: &'static str,
    sha: OnceLock<String>,
}

impl Lua {
    const fn new(source: &'static str) -> Self {
        Lua { source, sha: OnceLock::new() }
    }

    fn sha(&self) -> &str {
        self.sha.get_or_init(|| redis::Script::new(self.source).get_hash().to_owned())
    }
}

/// `KEYS[1]`: the record. Returns `{value or false, PTTL}` read at one instant (for a running
/// claim's remaining lease).
const PROBE_LUA: &str = r"
local v = redis.pcall('GET', KEYS[1])
if type(v) ~= 'string' then v = false end
return {v, redis.call('PTTL', KEYS[1])}
";

static PROBE: Lua = Lua::new(PROBE_LUA);
static COMPLETE: Lua = Lua::new(COMPLETE_LUA);
static RELEASE: Lua = Lua::new(RELEASE_LUA);
static EXTEND: Lua = Lua::new(EXTEND_LUA);

/// A store in Redis: records shared by every process that uses the same server and prefix.
///
/// See the [module docs](self) for the key layout, the commands, timeouts and behaviour during
/// outages and failovers. Cloning is cheap and gives another handle to the same connection.
///
/// The connection type `C` is a [`ConnectionManager`] (one server) by default; with the
/// `redis-cluster` feature, [`RedisClusterStore`] is the same store over a cluster connection.
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
pub struct RedisStore<C = ConnectionManager> {
    connection: connection::Shared<C>,
    prefix: Arc<str>,
    max_record_bytes: usize,
    replica_acks: Option<ReplicaAcks>,
    timeout: Duration,
    /// Whether completions try the server's `SET ... IFEQ ... GET` first; shared by clones, and
    /// turned off for good when the server refuses the option.
    native_completion: Arc<AtomicBool>,
}

/// How many replicas must acknowledge each completion, and for how long to wait for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ReplicaAcks {
    replicas: u32,
    timeout_ms: u64,
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

/// A completion that fewer replicas acknowledged than [`RedisStore::with_replica_acks`] asks for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the record was written on the master, but only {acknowledged} of the {wanted} replicas asked for \
     acknowledged it within {timeout_ms} ms; a failover now could lose it (check the replicas' \
     links, or lower the number of replicas waited for)"
)]
pub struct ReplicasMissing {
    /// Replicas that acknowledged.
    pub acknowledged: i64,
    /// Replicas asked for.
    pub wanted: u32,
    /// How long `WAIT` waited.
    pub timeout_ms: u64,
}

impl RedisStore<ConnectionManager> {
    /// Connects to `url` (such as `redis://127.0.0.1:6379/0` or `rediss://...`) with the timeouts
    /// described in the [module docs](self), and checks the server (see
    /// [Server requirements](self#server-requirements)).
    ///
    /// Fails if the URL is malformed, the server cannot be reached now, or it is older than
    /// [`MIN_REDIS_VERSION`] ([`StoreError::Rejected`], naming the version found); warns if the
    /// server may evict keys.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        let client = redis::Client::open(url).map_err(backend)?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(DEFAULT_RESPONSE_TIMEOUT))
            .set_connection_timeout(Some(DEFAULT_CONNECTION_TIMEOUT))
            .set_number_of_retries(DEFAULT_RECONNECT_RETRIES);
        let mut manager = ConnectionManager::new_with_config(client, config).await.map_err(backend)?;
        server::check(&mut manager, &redacted(url)).await?;
        Ok(Self::new(manager))
    }
}

impl<C: RedisConnection> RedisStore<C> {
    /// A store over an existing connection, with the default prefix and record limit.
    ///
    /// The connection's own settings (response timeout, reconnection) apply to every call.
    #[must_use]
    pub fn new(connection: C) -> Self {
        Self::renewable(connection, None)
    }

    /// A store whose connection is replaced by `renew` after a step timed out on it.
    fn renewable(connection: C, renew: Option<connection::Renew<C>>) -> Self {
        RedisStore {
            connection: connection::Shared::new(connection, renew),
            prefix: DEFAULT_PREFIX.into(),
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            replica_acks: None,
            timeout: DEFAULT_STEP_TIMEOUT,
            native_completion: Arc::new(AtomicBool::new(true)),
        }
    }

    /// Whether a completion first tries the server's own compare-and-set, `SET <key> <record> PX
    /// <retention> IFEQ <claim> GET` (default `true`; see [Commands and round
    /// trips](self#commands-and-round-trips)).
    ///
    /// A server without the `IFEQ` option answers that command with a syntax error and does
    /// nothing; the store then completes by its script, and from then on this store and its
    /// clones send the script only, so an older server costs one refused command per store. Any
    /// other refusal (a proxy that does not pass the option on) leaves that one completion to the
    /// script. Turn it off to measure the script beside it, or to spare a server that refuses
    /// the command its refusals.
    #[must_use]
    pub fn with_native_completion(mut self, enabled: bool) -> Self {
        self.native_completion = Arc::new(AtomicBool::new(enabled));
        self
    }

    /// Bounds every store step by `timeout` (default [`DEFAULT_STEP_TIMEOUT`]), on top of the
    /// connection's own response timeout: a step whose reply never comes (a connection to a
    /// killed master the client has not given up on) fails with [`TimedOut`] as the source of
    /// [`StoreError::Backend`] instead of waiting for ever. Keep it below the lease.
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs one store step within the step timeout.
    async fn bounded<T>(
        &self,
        operation: &'static str,
        step: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let result = tokio::time::timeout(self.timeout, step).await.unwrap_or_else(|_| {
            let backend = <C as connection::sealed::Sealed>::NAME;
            Err(StoreError::backend(backend, TimedOut { backend, operation, after: self.timeout }))
        });
        // A connection that timed out or lost its link may be wedged for good (a cluster client
        // was seen so after a failover): the store makes a new one, if it knows how.
        if let Err(StoreError::Backend { source, .. }) = &result {
            let wedged = source.downcast_ref::<TimedOut>().is_some()
                || source.downcast_ref::<RedisError>().is_some_and(|e| {
                    e.is_timeout() || e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal()
                });
            if wedged {
                self.connection.renew();
            }
        }
        result
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

    /// Acknowledges a completion only once `replicas` replicas of the record's master have it
    /// (`WAIT replicas timeout` after each completion), so that a failover to one of them keeps it.
    ///
    /// `WAIT` travels with the completion in one pipeline, so it adds no round trip, but the reply
    /// waits for the replicas; replays are not affected. `replicas == 0` turns it off. See the [module docs](self#durability-what-a-failover-can-lose)
    /// for what this does and does not promise.
    #[must_use]
    pub fn with_replica_acks(mut self, replicas: u32, timeout: Duration) -> Self {
        self.replica_acks = (replicas > 0).then(|| ReplicaAcks {
            replicas,
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX).max(1),
        });
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

    /// A clone of the connection, to send commands of your own.
    #[must_use]
    pub fn connection(&self) -> C {
        self.connection.get()
    }

    fn key_arg<'a>(&'a self, key: &'a Key) -> KeyArg<'a> {
        KeyArg { prefix: &self.prefix, key: key.as_bytes() }
    }

    /// Sends `cmd`, and once more if the connection failed under it (see [`resend`]).
    async fn query(&self, cmd: &Cmd) -> RedisResult<Value> {
        self.query_sent(cmd).await.reply
    }

    /// Like [`query`](Self::query), saying whether the first send was lost.
    async fn query_sent(&self, cmd: &Cmd) -> Sent<Value> {
        let mut connection = self.connection.get();
        match cmd.query_async(&mut connection).await {
            Err(e) => match resend::<C>(&e) {
                Some(lost) => Sent { reply: cmd.query_async(&mut connection).await, lost },
                None => Sent { reply: Err(e), lost: false },
            },
            reply => Sent { reply, lost: false },
        }
    }

    /// Runs a script on one key by `EVALSHA`, or by `EVAL` if the server does not know it yet.
    async fn eval(&self, script: &Lua, key: &KeyArg<'_>, args: impl Fn(&mut Cmd)) -> RedisResult<Value> {
        self.eval_sent(script, key, args).await.reply
    }

    /// Like [`eval`](Self::eval), saying whether a send was lost on the way.
    async fn eval_sent(&self, script: &Lua, key: &KeyArg<'_>, args: impl Fn(&mut Cmd)) -> Sent<Value> {
        let sent = self.query_sent(&script_cmd(script, false, key, &args)).await;
        match &sent.reply {
            Err(e) if is_noscript(e) => {
                let again = self.query_sent(&script_cmd(script, true, key, &args)).await;
                Sent { reply: again.reply, lost: sent.lost || again.lost }
            }
            _ => sent,
        }
    }

    /// Like [`eval`](Self::eval), followed in the same round trip and on the same node by `WAIT`
    /// for the replicas [`with_replica_acks`](Self::with_replica_acks) asks for. Returns the
    /// script's reply, or an error if fewer replicas acknowledged.
    async fn eval_and_wait(
        &self,
        script: &Lua,
        key: &KeyArg<'_>,
        acks: ReplicaAcks,
        args: impl Fn(&mut Cmd),
    ) -> Result<Value, StoreError> {
        let replies = self.with_wait(|eval| script_cmd(script, eval, key, &args), acks).await.map_err(backend)?;
        let [reply, waited] = step_and_wait(replies)?;
        match waited {
            // Not recorded by us (another owner, or another type): nothing to wait for.
            Value::Int(_) if matches!(reply, Value::Int(0 | -1)) => Ok(reply),
            waited => replicas_have_it(acks, Some(&Ok(waited))).map(|()| reply),
        }
    }

    /// Sends `step` (built for `EVAL` when given `true`, after a `NOSCRIPT`) and then `WAIT` for
    /// the replicas `acks` asks for, in one pipeline: one round trip, on the same node.
    async fn with_wait(&self, step: impl Fn(bool) -> Cmd, acks: ReplicaAcks) -> RedisResult<Vec<Value>> {
        // A cluster connection sends a pipeline to the node of its first keyed command: the
        // record's master, on the connection that wrote it, which is what `WAIT` counts.
        let pipeline = |eval: bool| {
            let mut pipeline = redis::pipe();
            pipeline.add_command(step(eval));
            pipeline.cmd("WAIT").arg(acks.replicas).arg(acks.timeout_ms);
            pipeline
        };
        let mut connection = self.connection.get();
        let mut send = async |pipeline: redis::Pipeline| -> RedisResult<Vec<Value>> {
            match pipeline.query_async(&mut connection).await {
                Err(e) if resend::<C>(&e).is_some() => pipeline.query_async(&mut connection).await,
                result => result,
            }
        };
        match send(pipeline(false)).await {
            Err(e) if is_noscript(&e) => send(pipeline(true)).await,
            result => result,
        }
    }

    /// Whether completions still try `SET ... IFEQ ... GET` first.
    fn completes_natively(&self) -> bool {
        self.native_completion.load(Ordering::Relaxed)
    }

    /// What a native completion's reply (or error) means: `Some` answer when it decided the
    /// completion (recorded, or failed on the way), `None` when the script must decide: the key
    /// did not hold this call's claim, or the server refused the command (see
    /// [`NativeRefusal`]; a server without `IFEQ` stops the store trying it).
    fn natively_completed(&self, reply: RedisResult<Value>, args: &CompleteArgs<'_>) -> Option<Result<(), StoreError>> {
        match reply {
            Ok(Value::BulkString(old)) if args.claimed.is(&old) => Some(Ok(())),
            Ok(_) => None,
            Err(e) => match NativeRefusal::of(&e) {
                NativeRefusal::NoIfeq => {
                    if self.native_completion.swap(false, Ordering::Relaxed) {
                        tracing::info!(
                            target: "idempotent", error = %e,
                            "this Redis server has no `SET ... IFEQ` (Redis 8.4, Valkey 8.1); the store completes \
                             calls with its script from now on"
                        );
                    }
                    None
                }
                NativeRefusal::Refused => None,
                NativeRefusal::NotRefused => Some(Err(backend(e))),
            },
        }
    }
}

/// Why a native completion failed, which decides whether the script is sent after it.
#[derive(Debug, PartialEq, Eq)]
enum NativeRefusal {
    /// `ERR syntax error`: Redis before 8.4 and Valkey before 8.1 have no `IFEQ`; the command did
    /// nothing, and the store stops trying it.
    NoIfeq,
    /// Another reply the server (or a proxy in front of it) refused the command with: a key of
    /// another type (the script names it), an option a proxy does not pass on, a permission.
    /// The command did nothing; the script decides, as it would have without the attempt.
    Refused,
    /// The connection failed or timed out, or the server cannot write now (`LOADING`,
    /// `READONLY`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, a redirection): the script would meet
    /// the same, and the completion fails as it would have.
    NotRefused,
}

impl NativeRefusal {
    /// `error`'s kind. The native completion is the first command of its pipeline when `WAIT`
    /// follows it, and a pipeline's error lists its commands' errors by position.
    fn of(error: &RedisError) -> Self {
        use redis::ServerErrorKind as Kind;
        let Some(errors) = error.clone().into_server_errors() else { return NativeRefusal::NotRefused };
        let Some((_, first)) = errors.iter().find(|(at, _)| *at == 0) else { return NativeRefusal::NotRefused };
        match first.kind() {
            Some(Kind::ResponseError) if first.details().is_some_and(|detail| detail.contains("syntax error")) => {
                NativeRefusal::NoIfeq
            }
            Some(
                Kind::BusyLoading
                | Kind::TryAgain
                | Kind::ClusterDown
                | Kind::MasterDown
                | Kind::ReadOnly
                | Kind::Moved
                | Kind::Ask,
            ) => NativeRefusal::NotRefused,
            _ => NativeRefusal::Refused,
        }
    }
}

/// The replies of a step sent with `WAIT`.
fn step_and_wait(replies: Vec<Value>) -> Result<[Value; 2], StoreError> {
    <[Value; 2]>::try_from(replies)
        .map_err(|r| StoreError::Corrupt(format!("unexpected replies to a step and WAIT: {r:?}")))
}

/// Whether `WAIT`'s reply says enough replicas acknowledged the records written before it.
fn replicas_have_it(acks: ReplicaAcks, waited: Option<&RedisResult<Value>>) -> Result<(), StoreError> {
    match waited {
        Some(Ok(Value::Int(n))) if *n >= i64::from(acks.replicas) => Ok(()),
        Some(Ok(Value::Int(acknowledged))) => Err(StoreError::backend(
            "redis",
            ReplicasMissing { acknowledged: *acknowledged, wanted: acks.replicas, timeout_ms: acks.timeout_ms },
        )),
        other => Err(StoreError::backend("redis", format!("unexpected reply to WAIT: {other:?}"))),
    }
}

/// A step's reply, and whether its connection was lost with a send in flight, so that the step
/// was sent again and the first send may have taken effect.
struct Sent<T> {
    reply: RedisResult<T>,
    lost: bool,
}

/// Whether a step that failed with `error` is sent once more, and if so whether the first send
/// may have taken effect (`Some(true)`: lost in flight):
///
/// - **the connection was refused** (`Some(false)`): the step never reached a server, and sending
///   it again makes the connection reconnect (after a restart, the first step would otherwise
///   fail on the manager's last, failed, reconnection attempt);
/// - **the connection was lost with the step in flight** (`Some(true)`, over a
///   [`ConnectionManager`]; the cluster client resends by itself): the server may have done the
///   step. Sent again on the reconnected link, with the same token, each step meets its own first
///   send and answers as that would have: a claim that finds its own running record has the key,
///   a completion that finds its own record succeeds, a renewal renews again, and a release that
///   finds the claim gone is done ([`Sent::lost`] tells it so).
///
/// A step that timed out is not sent again: its time is spent.
fn resend<C: RedisConnection>(error: &RedisError) -> Option<bool> {
    if error.is_connection_refusal() {
        Some(false)
    } else if <C as connection::sealed::Sealed>::RESENDS_LOST
        && (error.is_connection_dropped() || error.is_io_error())
        && !error.is_timeout()
    {
        tracing::debug!(target: "idempotent", %error, "a Redis step lost its connection; sending it again");
        Some(true)
    } else {
        None
    }
}

/// `request`'s claim of `key`: `SET <key> <running record> NX PX <lease> GET`.
fn claim_cmd(key: &KeyArg<'_>, request: &ClaimRequest<'_>) -> Cmd {
    let running = record::Header {
        state: record::RUNNING,
        token: request.token.as_bytes(),
        fingerprint: request.fingerprint.map(crate::Fingerprint::as_bytes),
    };
    let mut cmd = Cmd::with_capacity(7, COMMAND_BYTES);
    cmd.arg("SET").arg(key).arg(&running).arg("NX").arg("PX").arg(expiry_millis(request.lease)).arg("GET");
    cmd
}

/// The usual completion as one native command: `SET <key> <completed record> PX <retention> IFEQ
/// <running record> GET`. It writes the record only if the key still holds this call's claim,
/// byte for byte, and returns the value it found whatever it did; any other value leaves the
/// completion to the script.
fn native_complete_cmd(key: &KeyArg<'_>, args: &CompleteArgs<'_>) -> Cmd {
    let mut cmd = Cmd::with_capacity(9, COMMAND_BYTES);
    cmd.arg("SET")
        .arg(key)
        .arg(&args.completed)
        .arg("PX")
        .arg(args.retention)
        .arg("IFEQ")
        .arg(&args.claimed)
        .arg("GET");
    cmd
}

/// `EVALSHA <sha> 1 <key> <args...>`, or `EVAL <script> 1 <key> <args...>`.
fn script_cmd(script: &Lua, eval: bool, key: &KeyArg<'_>, args: &impl Fn(&mut Cmd)) -> Cmd {
    let mut cmd = Cmd::with_capacity(8, COMMAND_BYTES);
    cmd.arg(if eval { "EVAL" } else { "EVALSHA" }).arg(if eval { script.source } else { script.sha() }).arg(1).arg(key);
    args(&mut cmd);
    cmd
}

fn is_noscript(error: &RedisError) -> bool {
    error.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
}

impl<C> std::fmt::Debug for RedisStore<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.prefix)
            .field("max_record_bytes", &self.max_record_bytes)
            .field("replica_acks", &self.replica_acks)
            .field("timeout", &self.timeout)
            .field("native_completion", &self.native_completion.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// `<prefix><scope>:<key>` written straight into a command, without building a `String`.
struct KeyArg<'a> {
    prefix: &'a str,
    key: &'a [u8],
}

impl KeyArg<'_> {
    /// The key's bytes, for error messages.
    fn bytes(&self) -> Vec<u8> {
        [self.prefix.as_bytes(), self.key].concat()
    }
}

impl ToRedisArgs for KeyArg<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let mut arg = out.writer_for_next_arg();
        // Writing into a Vec cannot fail.
        let _ = arg.write_all(self.prefix.as_bytes());
        let _ = arg.write_all(self.key);
    }
}

/// `url` without its password, for messages.
fn redacted(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => format!("{}://…@{}", &url[..scheme], &url[at + 1..]),
        _ => url.to_owned(),
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

/// A Redis error as a store error: a refusal of the command itself (`ERR ...`, such as a value
/// over `proto-max-bulk-len`, or a missing ACL permission) cannot succeed when sent again and is
/// [`StoreError::Rejected`]; everything else (I/O, timeouts, `LOADING`, `TRYAGAIN`, `OOM`, a
/// failover's `READONLY` or `CLUSTERDOWN`) may, and is [`StoreError::Backend`].
fn backend(error: RedisError) -> StoreError {
    let refused = error.code() == Some("ERR")
        || matches!(
            error.kind(),
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm | redis::ServerErrorKind::CrossSlot)
        );
    if refused { StoreError::rejected("redis", error) } else { StoreError::backend("redis", error) }
}

/// Milliseconds for `PX`/`PEXPIRE`: rounded up (Redis refuses 0) and capped.
fn expiry_millis(duration: Duration) -> u64 {
    let millis = duration.as_nanos().div_ceil(1_000_000).max(1);
    u64::try_from(millis).unwrap_or(u64::MAX).min(MAX_EXPIRY_MILLIS)
}

/// `ARGV` of the completion script ([`COMPLETE_LUA`]).
struct CompleteArgs<'a> {
    claimed: record::Header<'a>,
    completed: record::Completed<'a>,
    retention: u64,
    waits: &'static str,
}

impl CompleteArgs<'_> {
    fn write(&self, cmd: &mut Cmd) {
        cmd.arg(&self.claimed).arg(&self.completed).arg(self.retention).arg(self.waits);
    }
}

/// The completion script's reply: 1 recorded, 0 another token holds the key, -1 another type.
fn completed(reply: Value, key: &KeyArg<'_>) -> Result<(), StoreError> {
    match reply {
        Value::Int(-1) => {
            Err(record::corrupt(&key.bytes(), b"", "holds another type than a string (see `redis-cli TYPE`)"))
        }
        reply => owner_reply(&reply),
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

/// The reply of the claiming `SET ... NX PX ... GET`.
fn parse_claim(reply: RedisResult<Value>, key: &KeyArg<'_>, ours: &Token) -> Result<Claim, StoreError> {
    match reply {
        Ok(Value::Nil) => Ok(Claim::Claimed),
        Ok(Value::BulkString(value)) => Ok(record::parse(value, || key.bytes())?.into_claim(ours)),
        Ok(other) => Err(StoreError::Corrupt(format!(
            "unexpected reply to SET ... GET on Redis key {:?}: {other:?}",
            String::from_utf8_lossy(&key.bytes())
        ))),
        Err(e) if e.code() == Some("WRONGTYPE") => {
            Err(record::corrupt(&key.bytes(), b"", "holds another type than a string (see `redis-cli TYPE`)"))
        }
        Err(e) => Err(backend(e)),
    }
}

/// The probe's reply: the record with its remaining lease, or `None` if the key is gone.
fn parse_probe(reply: Value, key: &KeyArg<'_>, ours: &Token) -> Result<Option<Claim>, StoreError> {
    let unexpected = |reply: &dyn std::fmt::Debug| {
        StoreError::Corrupt(format!(
            "unexpected reply from the Redis probe of key {:?}: {reply:?}",
            String::from_utf8_lossy(&key.bytes())
        ))
    };
    let Value::Array(items) = reply else { return Err(unexpected(&reply)) };
    let mut items = items.into_iter();
    match (items.next(), items.next(), items.next()) {
        (Some(Value::Nil | Value::Boolean(false)), Some(_), None) => Ok(None),
        (Some(Value::BulkString(value)), Some(Value::Int(pttl)), None) => {
            match record::parse(value, || key.bytes())?.into_claim(ours) {
                Claim::InProgress { fingerprint, .. } => {
                    // -1 (no expiry) cannot happen with this store's writes; report it as unknown.
                    let lease_remaining = u64::try_from(pttl).ok().map(Duration::from_millis);
                    Ok(Some(Claim::InProgress { fingerprint, lease_remaining }))
                }
                done => Ok(Some(done)),
            }
        }
        other => Err(unexpected(&other)),
    }
}

impl<C: RedisConnection> Store for RedisStore<C> {
    async fn claim(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        self.bounded("claim", self.claim_now(request)).await
    }

    async fn complete(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        self.bounded("complete", self.complete_now(completion)).await
    }

    /// One pipeline on one server; a cluster's keys spread over its nodes, and its batch is the
    /// default: the single claims, concurrently.
    async fn claim_many(&self, requests: &[ClaimRequest<'_>]) -> Result<Vec<Result<Claim, StoreError>>, StoreError> {
        if !<C as connection::sealed::Sealed>::PIPELINES_ANY_KEYS || requests.is_empty() {
            return Ok(crate::store::claim_each(self, requests).await);
        }
        self.bounded("claim", self.claim_many_now(requests)).await
    }

    /// One pipeline (with one `WAIT` at its end if replicas must acknowledge) on one server; on a
    /// cluster, the default.
    async fn complete_many(&self, completions: &[Completion<'_>]) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        if !<C as connection::sealed::Sealed>::PIPELINES_ANY_KEYS || completions.is_empty() {
            return Ok(crate::store::complete_each(self, completions).await);
        }
        self.bounded("complete", self.complete_many_now(completions)).await
    }

    async fn release(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        self.bounded("release", self.release_now(key, token)).await
    }

    async fn extend(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        self.bounded("extend", self.extend_now(key, token, lease)).await
    }

    fn detach(&self, step: Detached) {
        crate::stores::spawn_detached(self.clone(), step);
    }

    fn max_record_bytes(&self) -> usize {
        self.max_record_bytes
    }

    fn name(&self) -> &'static str {
        <C as connection::sealed::Sealed>::NAME
    }
}

/// The steps, unbounded; [`Store`]'s methods bound them by the step timeout.
impl<C: RedisConnection> RedisStore<C> {
    async fn claim_now(&self, request: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        record::check_token(request.token)?;
        let key = self.key_arg(request.key);
        let claim = parse_claim(self.query(&claim_cmd(&key, request)).await, &key, request.token)?;
        self.lease_of_running(request, claim).await
    }

    /// What a claim whose `SET` answered `claim` reports: `claim` itself, unless another call
    /// runs. Rare path: read that call's remaining lease (and the value again, in the same
    /// instant, since it may have finished meanwhile); if the key is gone by now, claim again.
    async fn lease_of_running(&self, request: &ClaimRequest<'_>, mut claim: Claim) -> Result<Claim, StoreError> {
        let key = self.key_arg(request.key);
        for _ in 0..3 {
            let Claim::InProgress { .. } = claim else { return Ok(claim) };
            let probe = self.eval(&PROBE, &key, |_| {}).await.map_err(backend)?;
            match parse_probe(probe, &key, request.token)? {
                Some(found) => return Ok(found),
                None => claim = parse_claim(self.query(&claim_cmd(&key, request)).await, &key, request.token)?,
            }
        }
        Ok(claim)
    }

    async fn complete_now(&self, completion: &Completion<'_>) -> Result<(), StoreError> {
        let args = self.complete_args(completion)?;
        let key = self.key_arg(completion.key);
        if self.completes_natively() {
            let answer = match self.replica_acks {
                None => self.natively_completed(self.query(&native_complete_cmd(&key, &args)).await, &args),
                Some(acks) => match self.with_wait(|_| native_complete_cmd(&key, &args), acks).await.map(step_and_wait)
                {
                    Ok(Ok([reply, waited])) => self
                        .natively_completed(Ok(reply), &args)
                        .map(|answer| answer.and_then(|()| replicas_have_it(acks, Some(&Ok(waited))))),
                    Ok(Err(unexpected)) => Some(Err(unexpected)),
                    Err(e) => self.natively_completed(Err(e), &args),
                },
            };
            if let Some(answer) = answer {
                return answer;
            }
        }
        self.complete_by_script(&key, &args).await
    }

    /// A completion by [`COMPLETE_LUA`], which decides every case.
    async fn complete_by_script(&self, key: &KeyArg<'_>, args: &CompleteArgs<'_>) -> Result<(), StoreError> {
        let reply = match self.replica_acks {
            None => self.eval(&COMPLETE, key, |cmd| args.write(cmd)).await.map_err(backend)?,
            Some(acks) => self.eval_and_wait(&COMPLETE, key, acks, |cmd| args.write(cmd)).await?,
        };
        completed(reply, key)
    }

    /// The completion script's arguments for `completion`.
    fn complete_args<'a>(&self, completion: &'a Completion<'_>) -> Result<CompleteArgs<'a>, StoreError> {
        record::check_token(completion.token)?;
        let token = completion.token.as_bytes();
        let fingerprint = completion.fingerprint.map(crate::Fingerprint::as_bytes);
        Ok(CompleteArgs {
            claimed: record::Header { state: record::RUNNING, token, fingerprint },
            completed: record::Completed {
                header: record::Header { state: record::DONE, token, fingerprint },
                outcome: completion.outcome,
            },
            retention: expiry_millis(completion.retention),
            waits: if self.replica_acks.is_some() { "1" } else { "0" },
        })
    }

    async fn release_now(&self, key: &Key, token: &Token) -> Result<(), StoreError> {
        let key = self.key_arg(key);
        let running = record::Owned { state: record::RUNNING, token: token.as_bytes() };
        let sent = self
            .eval_sent(&RELEASE, &key, |cmd| {
                cmd.arg(&running);
            })
            .await;
        match sent.reply.map_err(backend)? {
            // Sent again after the connection was lost: the first send may have deleted the claim,
            // and the key is not ours either way.
            Value::Int(0) if sent.lost => Ok(()),
            reply => owner_reply(&reply),
        }
    }

    async fn extend_now(&self, key: &Key, token: &Token, lease: Duration) -> Result<(), StoreError> {
        let key = self.key_arg(key);
        let owner = record::Owned { state: record::RUNNING, token: token.as_bytes() };
        let reply = self
            .eval(&EXTEND, &key, |cmd| {
                cmd.arg(&owner).arg(expiry_millis(lease));
            })
            .await;
        owner_reply(&reply.map_err(backend)?)
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

    /// A native completion's error sends the script after it only when the server answered with
    /// a refusal of the command itself; a server without `IFEQ` also stops the attempts.
    #[test]
    fn redis_native_completion_refusals_go_to_the_script() {
        let error = |reply: &[u8]| redis::parse_redis_value(reply).unwrap().extract_error().unwrap_err();
        assert_eq!(NativeRefusal::of(&error(b"-ERR syntax error\r\n")), NativeRefusal::NoIfeq);
        for refused in [
            &b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"[..],
            b"-ERR unknown option for SET\r\n",
            b"-NOPERM this user has no permissions to run the 'set' command\r\n",
            b"-OOM command not allowed when used memory > 'maxmemory'.\r\n",
        ] {
            assert_eq!(
                NativeRefusal::of(&error(refused)),
                NativeRefusal::Refused,
                "{}",
                String::from_utf8_lossy(refused)
            );
        }
        for transient in [
            &b"-LOADING Redis is loading the dataset in memory\r\n"[..],
            b"-READONLY You can't write against a read only replica.\r\n",
            b"-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
            b"-CLUSTERDOWN The cluster is down\r\n",
            b"-MOVED 3999 127.0.0.1:6381\r\n",
        ] {
            assert_eq!(
                NativeRefusal::of(&error(transient)),
                NativeRefusal::NotRefused,
                "{}",
                String::from_utf8_lossy(transient)
            );
        }
        let io = RedisError::from(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"));
        assert_eq!(NativeRefusal::of(&io), NativeRefusal::NotRefused);
    }

    #[test]
    fn redis_claim_replies_are_parsed_strictly() {
        let key = KeyArg { prefix: "idempotent:", key: b"s:k" };
        let ours = Token::from_stored("0b");
        assert_eq!(parse_claim(Ok(Value::Nil), &key, &ours).unwrap(), Claim::Claimed);
        let done = b"idempotent/1 done 0a -\n{\"Ok\":1}".to_vec();
        assert_eq!(
            parse_claim(Ok(Value::BulkString(done)), &key, &ours).unwrap(),
            Claim::Completed(crate::Record::new(None, b"{\"Ok\":1}".to_vec()))
        );
        let running = format!("idempotent/1 running 0a {}\n", "ab".repeat(32)).into_bytes();
        assert_eq!(
            parse_claim(Ok(Value::BulkString(running.clone())), &key, &ours).unwrap(),
            Claim::InProgress {
                fingerprint: Some(crate::Fingerprint::parse("ab".repeat(32)).unwrap()),
                lease_remaining: None
            }
        );
        // A resent claim that finds its own running record has the key.
        let mine = Token::from_stored("0a");
        assert_eq!(parse_claim(Ok(Value::BulkString(running)), &key, &mine).unwrap(), Claim::Claimed);
        for bad in [Value::Int(1), Value::Okay, Value::BulkString(b"1".to_vec())] {
            let Err(StoreError::Corrupt(message)) = parse_claim(Ok(bad), &key, &ours) else { panic!() };
            assert!(message.contains("idempotent:s:k"), "{message}");
        }
    }

    #[test]
    fn redis_keys_are_written_verbatim_after_the_prefix() {
        let key = Key::new("odd", &"{tag} *:x").unwrap();
        let arg = KeyArg { prefix: "p:", key: key.as_bytes() };
        assert_eq!(arg.to_redis_args(), vec![b"p:odd:{tag} *:x".to_vec()]);
        assert_eq!(arg.bytes(), b"p:odd:{tag} *:x");
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
