use idempotent_runtime::{Error, MemoryStore, idempotent};

struct Orders {
    store: MemoryStore,
}

// On an impl, the attribute takes no options.
#[idempotent(scope = "orders")]
impl Orders {
    #[idempotent(key = id, store = self.store)]
    async fn create(&self, id: &str) -> Result<u32, Error> {
        Ok(1)
    }
}

// A trait's default methods cannot get a scope per implementor.
#[idempotent]
trait Payments {
    fn store(&self) -> &MemoryStore;
}

fn main() {}
