use idempotent_runtime::{MemoryStore, idempotent};

#[idempotent(key = key, store = store)]
async fn read(store: &MemoryStore, key: &str) -> std::io::Result<u32> {
    Ok(1)
}

#[derive(Debug)]
struct AppError;

type AppResult<T> = Result<T, AppError>;

#[idempotent(key = key, store = store)]
async fn write(store: &MemoryStore, key: &str) -> AppResult<u32> {
    Ok(1)
}

fn main() {}
