//! Values that copies of this process must never repeat, drawn from the operating system each
//! time: the owner tokens of calls on shared stores, and fresh outbound idempotency keys.
//!
//! A generator whose state lives in this process's memory (a thread's `rand` generator, or a
//! counter started from one) goes on identically in a `fork` child and in every virtual machine
//! restored from one snapshot. Two such copies would claim one key with the same token, or send
//! two different requests under the same `Idempotency-Key`, which the server then takes for one
//! request and its retry. The kernel's generator does not repeat across them: Linux reseeds it
//! when it learns of a VM fork (from the VM generation ID). It costs a system call per value
//! where glibc is older than 2.41 (0.22 to 0.55 µs with Debian 12's 2.36, on the machines it was
//! measured on), less where `getrandom` is served by the vDSO. A call draws its token only when
//! a store first reads it, so a replay answered from a local cache draws none.

/// 16 bytes from the operating system's random source, or `None` (logged) if it failed.
pub(crate) fn os_bytes() -> Option<[u8; 16]> {
    #[cfg(test)]
    DRAWS.with(|draws| draws.set(draws.get() + 1));
    let mut bytes = [0u8; 16];
    match getrandom::fill(&mut bytes) {
        Ok(()) => Some(bytes),
        Err(error) => {
            tracing::warn!(
                target: "idempotent", %error,
                "the operating system's random source failed; falling back to a per-thread generator, whose \
                 values a copy of this process (fork, a VM snapshot restored twice) would repeat"
            );
            None
        }
    }
}

/// A version 4 UUID from the operating system's random source (from uuid's per-thread
/// generator if that failed): a fresh outbound idempotency key.
#[cfg(any(feature = "reqwest", feature = "tonic"))]
pub(crate) fn fresh_uuid() -> uuid::Uuid {
    os_bytes().map_or_else(uuid::Uuid::new_v4, |bytes| uuid::Builder::from_random_bytes(bytes).into_uuid())
}

#[cfg(test)]
thread_local! {
    /// How many times this thread asked the operating system for bytes: what the tests of
    /// system calls saved count.
    pub(crate) static DRAWS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}
