//! Default scopes: two functions never share records unless they name the same `scope`.
//! Methods with a receiver are told apart by their `Self` type, functions by their module path;
//! two receiverless functions that arrive at one default are refused (`Error::ScopeCollision`).
//! Functions that name one `scope` explicitly share its records, on purpose.

use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_runtime::{Error, MemoryStore, idempotent};

struct Orders {
    store: MemoryStore,
    runs: AtomicU32,
}

struct Refunds {
    store: MemoryStore,
    runs: AtomicU32,
}

impl Orders {
    #[idempotent(key = id, store = self.store)]
    async fn create(&self, id: &str) -> Result<String, Error> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(format!("order {id}"))
    }

    /// No receiver: the default scope is this module's path and `lookup`, as for `Refunds::lookup`.
    #[idempotent(key = id, store = store)]
    async fn lookup(store: &MemoryStore, id: &str) -> Result<String, Error> {
        Ok(format!("order {id}"))
    }
}

impl Refunds {
    #[idempotent(key = id, store = self.store)]
    async fn create(&self, id: &str) -> Result<String, Error> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(format!("refund {id}"))
    }

    #[idempotent(key = id, store = store)]
    async fn lookup(store: &MemoryStore, id: &str) -> Result<String, Error> {
        Ok(format!("refund {id}"))
    }
}

static RUNS: AtomicU32 = AtomicU32::new(0);

mod shop {
    use idempotent_runtime::{Error, MemoryStore, idempotent};

    #[idempotent(key = id, store = store)]
    pub async fn pay(store: &MemoryStore, id: &str) -> Result<String, Error> {
        super::RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(format!("shop {id}"))
    }
}

mod bank {
    use idempotent_runtime::{Error, MemoryStore, idempotent};

    #[idempotent(key = id, store = store)]
    pub async fn pay(store: &MemoryStore, id: &str) -> Result<String, Error> {
        super::RUNS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(format!("bank {id}"))
    }
}

#[tokio::test]
async fn memory_two_impls_methods_with_one_name_keep_their_own_records() {
    let store = MemoryStore::new();
    let orders = Orders { store: store.clone(), runs: AtomicU32::new(0) };
    let refunds = Refunds { store, runs: AtomicU32::new(0) };
    assert_eq!(orders.create("42").await.unwrap(), "order 42");
    assert_eq!(refunds.create("42").await.unwrap(), "refund 42", "the refund ran, not the order's replay");
    assert_eq!(orders.create("42").await.unwrap(), "order 42");
    assert_eq!(refunds.create("42").await.unwrap(), "refund 42");
    assert_eq!((orders.runs.load(Ordering::SeqCst), refunds.runs.load(Ordering::SeqCst)), (1, 1));
}

#[tokio::test]
async fn memory_two_modules_functions_with_one_name_keep_their_own_records() {
    let store = MemoryStore::new();
    assert_eq!(shop::pay(&store, "42").await.unwrap(), "shop 42");
    assert_eq!(bank::pay(&store, "42").await.unwrap(), "bank 42", "bank::pay ran, not shop's replay");
    assert_eq!(shop::pay(&store, "42").await.unwrap(), "shop 42");
    assert_eq!(RUNS.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn memory_two_receiverless_functions_with_one_default_scope_are_refused() {
    let store = MemoryStore::new();
    assert_eq!(Orders::lookup(&store, "7").await.unwrap(), "order 7");
    let Err(Error::ScopeCollision { scope, first, second }) = Refunds::lookup(&store, "7").await else {
        panic!("the second function with the same default scope was allowed to run");
    };
    assert_eq!(scope, format!("{}.lookup", module_path!().replace("::", ".")));
    assert!(
        first.starts_with("idempotent-macros/tests/scopes.rs:")
            && second.starts_with("idempotent-macros/tests/scopes.rs:"),
        "{first} {second}"
    );
    assert_ne!(first, second);
    assert_eq!(Orders::lookup(&store, "7").await.unwrap(), "order 7", "the first keeps working");
    assert!(
        matches!(Refunds::lookup(&store, "8").await, Err(Error::ScopeCollision { .. })),
        "and the second stays refused"
    );
}

#[idempotent(key = id, store = store, scope = "scopes-test.shared")]
async fn place(store: &MemoryStore, id: &str) -> Result<String, Error> {
    Ok(format!("placed {id}"))
}

#[idempotent(key = id, store = store, scope = "scopes-test.shared")]
async fn place_again(store: &MemoryStore, id: &str) -> Result<String, Error> {
    Ok(format!("placed again {id}"))
}

#[tokio::test]
async fn memory_functions_naming_one_scope_share_its_records() {
    let store = MemoryStore::new();
    assert_eq!(place(&store, "1").await.unwrap(), "placed 1");
    assert_eq!(place_again(&store, "1").await.unwrap(), "placed 1", "replayed from the shared scope");
    assert_eq!(place_again(&store, "2").await.unwrap(), "placed again 2");
}
