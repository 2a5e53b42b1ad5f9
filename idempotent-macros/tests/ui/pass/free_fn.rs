//! A free function; the store is a parameter; keys of several types.
#![deny(warnings)]

use idempotent_runtime::{Error, MemoryStore, idempotent};

/// Docs stay on the function.
#[idempotent(key = request_id, store = store)]
pub async fn by_str(store: &MemoryStore, request_id: &str) -> Result<u32, Error> {
    Ok(1)
}

#[idempotent(key = order, store = store)]
async fn by_integer(store: &MemoryStore, order: u64) -> Result<(), Error> {
    let _ = order;
    Ok(())
}

#[idempotent(key = id, store = store)]
async fn by_uuid(store: &MemoryStore, id: uuid_like::Id) -> Result<String, Error> {
    Ok(id.0.to_string())
}

#[idempotent(key = format!("{user}/{n}"), store = store)]
async fn by_expression(store: &MemoryStore, user: String, n: u8) -> Result<String, Error> {
    Ok(user)
}

mod uuid_like {
    pub struct Id(pub u128);

    impl idempotent_runtime::IdempotencyKey for Id {
        fn write_key(&self, out: &mut String) {
            self.0.write_key(out);
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let store = MemoryStore::new();
    assert_eq!(by_str(&store, "a").await.unwrap(), 1);
    by_integer(&store, 7).await.unwrap();
    assert_eq!(by_uuid(&store, uuid_like::Id(9)).await.unwrap(), "9");
    assert_eq!(by_expression(&store, "bo".into(), 1).await.unwrap(), "bo");
}
