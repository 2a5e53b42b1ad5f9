//! Default scopes: two functions never share records unless they name the same `scope`.
//! Functions are told apart by their module path and name, methods of an impl marked
//! `#[idempotent]` also by the impl's type name; every part is source text, never
//! `std::any::type_name`. Two functions (or two `Self` types of one default method) that arrive
//! at one default are refused (`Error::ScopeCollision`). Functions that name one `scope`
//! explicitly share its records, on purpose.

use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_runtime::{Call, Error, MemoryStore, idempotent};

struct Orders {
    store: MemoryStore,
    runs: AtomicU32,
}

struct Refunds {
    store: MemoryStore,
    runs: AtomicU32,
}

#[idempotent]
impl Orders {
    #[idempotent(key = id, store = self.store)]
    async fn create(&self, id: &str) -> Result<String, Error> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(format!("order {id}"))
    }

    /// No receiver: the default scope is this module's path and `lookup`, as for `Refunds::lookup`
    /// (the impls of `lookup` below are not marked).
    #[idempotent(key = id, store = store, scope = "scopes-test.orders-lookup")]
    async fn lookup_named(store: &MemoryStore, id: &str) -> Result<String, Error> {
        Ok(format!("order {id}"))
    }
}

#[idempotent]
impl Refunds {
    #[idempotent(key = id, store = self.store)]
    async fn create(&self, id: &str) -> Result<String, Error> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok(format!("refund {id}"))
    }
}

impl Orders {
    #[idempotent(key = id, store = store)]
    async fn lookup(store: &MemoryStore, id: &str) -> Result<String, Error> {
        Ok(format!("order {id}"))
    }
}

impl Refunds {
    #[idempotent(key = id, store = store)]
    async fn lookup(store: &MemoryStore, id: &str) -> Result<String, Error> {
        Ok(format!("refund {id}"))
    }
}

/// Two types whose impls are not marked, with a method of one name: one default scope.
struct Shipments(MemoryStore);
struct Returns(MemoryStore);

impl Shipments {
    #[idempotent(key = id, store = self.0)]
    async fn start(&self, id: &str) -> Result<String, Error> {
        Ok(format!("shipment {id}"))
    }
}

impl Returns {
    #[idempotent(key = id, store = self.0)]
    async fn start(&self, id: &str) -> Result<String, Error> {
        Ok(format!("return {id}"))
    }
}

/// A trait's default method, used by two types: one site, two `Self` types.
trait Provider {
    fn store(&self) -> &MemoryStore;
    fn name(&self) -> &'static str;

    #[idempotent(key = id, store = self.store())]
    async fn charge(&self, id: &str) -> Result<String, Error> {
        Ok(format!("{} {id}", self.name()))
    }
}

struct Stripe(MemoryStore);
struct Adyen(MemoryStore);

impl Provider for Stripe {
    fn store(&self) -> &MemoryStore {
        &self.0
    }
    fn name(&self) -> &'static str {
        "stripe"
    }
}

impl Provider for Adyen {
    fn store(&self) -> &MemoryStore {
        &self.0
    }
    fn name(&self) -> &'static str {
        "adyen"
    }
}

/// A generic type: its methods' default scope is the source text `Wrapper`, the same for every
/// instantiation (`std::any::type_name` would give `Wrapper<u32>`, text the compiler chooses).
struct Wrapper<T> {
    store: MemoryStore,
    value: T,
}

#[idempotent]
impl<T: Clone + serde::Serialize + serde::de::DeserializeOwned + Send + Sync> Wrapper<T> {
    #[idempotent(key = id, store = self.store)]
    async fn get(&self, id: &str) -> Result<T, Error> {
        Ok(self.value.clone())
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
async fn memory_default_scopes_are_source_text_not_type_names() {
    let store = MemoryStore::new();
    let module = module_path!().replace("::", ".");
    let wrapper = Wrapper { store: store.clone(), value: 7u32 };
    assert_eq!(wrapper.get("1").await.unwrap(), 7);
    // A call under the expected scope text replays the method's record.
    let replayed: Result<u32, Error> = Call::new(&format!("{module}.Wrapper.get"), "1")
        .run(&store, async { panic!("replayed, so the body does not run") })
        .await;
    assert_eq!(replayed.unwrap(), 7, "the default scope is `<module>.Wrapper.get`");
    let orders = Orders { store: store.clone(), runs: AtomicU32::new(0) };
    orders.create("2").await.unwrap();
    let replayed: Result<String, Error> = Call::new(&format!("{module}.Orders.create"), "2")
        .run(&store, async { panic!("replayed, so the body does not run") })
        .await;
    assert_eq!(replayed.unwrap(), "order 2");
}

#[tokio::test]
async fn memory_two_unmarked_impls_with_one_method_name_are_refused_not_shared() {
    let store = MemoryStore::new();
    assert_eq!(Shipments(store.clone()).start("9").await.unwrap(), "shipment 9");
    let refused = Returns(store.clone()).start("9").await;
    let Err(Error::ScopeCollision { scope, first, second }) = refused else {
        panic!("the second type's method shared the first one's records: {refused:?}");
    };
    assert_eq!(scope, format!("{}.start", module_path!().replace("::", ".")));
    assert!(first.contains("Shipments") && second.contains("Returns"), "{first} / {second}");
    let message = Error::ScopeCollision { scope, first, second }.to_string();
    assert!(message.contains("`#[idempotent]`") && message.contains("scope = "), "{message}");
}

#[tokio::test]
async fn memory_a_default_method_used_by_two_types_is_refused_for_the_second() {
    let store = MemoryStore::new();
    assert_eq!(Stripe(store.clone()).charge("5").await.unwrap(), "stripe 5");
    let refused = Adyen(store.clone()).charge("5").await;
    assert!(
        matches!(&refused, Err(Error::ScopeCollision { first, second, .. }) if first.contains("Stripe") && second.contains("Adyen")),
        "Adyen got Stripe's record or ran under its scope: {refused:?}"
    );
    assert_eq!(Stripe(store).charge("5").await.unwrap(), "stripe 5", "the first type keeps working");
}

#[tokio::test]
async fn memory_two_receiverless_functions_with_one_default_scope_are_refused() {
    let store = MemoryStore::new();
    assert_eq!(Orders::lookup_named(&store, "6").await.unwrap(), "order 6");
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
