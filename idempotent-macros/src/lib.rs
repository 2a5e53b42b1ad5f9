//! The `#[idempotent]` attribute. Depend on `idempotent-runtime`, which re-exports it and documents it.

mod args;
mod duration;
mod expand;
mod impl_block;

use proc_macro::TokenStream;

/// Makes an `async fn` returning `Result<T, E>` run at most once per key. See `idempotent_runtime`.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
