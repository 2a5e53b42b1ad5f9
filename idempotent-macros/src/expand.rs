//! Rewriting the annotated function: the body becomes a future handed to `Call::run_with`.

use proc_macro2::TokenStream;
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{ItemFn, ReturnType, Type};

use crate::args::{self, Args, DurationArg, RecordErr};

/// The attribute's entry point. On any error it emits the user's function unchanged next to the
/// errors, so one mistake does not turn into a cascade of "function not found" errors.
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(error) => return with_error(item, &error),
    };
    let args = args::parse(args);
    let checked = check_signature(&function);
    match (args, checked) {
        (Ok(args), Ok(())) => expand(&args, function),
        (Err(mut error), Err(more)) => {
            error.combine(more);
            with_error(function.into_token_stream(), &error)
        }
        (Err(error), _) | (_, Err(error)) => with_error(function.into_token_stream(), &error),
    }
}

/// The function is emitted as written, with unused-variable warnings silenced: the arguments the
/// attribute would have used are otherwise reported as unused, burying the real error.
fn with_error(item: TokenStream, error: &syn::Error) -> TokenStream {
    let mut out = quote!(#[allow(unused_variables)]);
    out.extend(item);
    out.extend(error.to_compile_error());
    out
}

fn check_signature(function: &ItemFn) -> Result<(), syn::Error> {
    let sig = &function.sig;
    if sig.asyncness.is_none() {
        return Err(syn::Error::new(
            sig.fn_token.span,
            "`#[idempotent]` works on an `async fn`: add `async` (the claim and the record are awaited)",
        ));
    }
    let ReturnType::Type(_, ty) = &sig.output else {
        return Err(syn::Error::new(
            sig.paren_token.span.join(),
            "`#[idempotent]` needs a function that returns `Result<T, E>`: the `Ok` value is recorded and \
             replayed, and `E` carries `idempotent_runtime::Error`",
        ));
    };
    check_return_type(ty)
}

fn check_return_type(ty: &Type) -> Result<(), syn::Error> {
    match ty {
        Type::ImplTrait(_) => Err(syn::Error::new(
            ty.span(),
            "`#[idempotent]` cannot record an `impl Trait` result: return a nameable type, \
             `Result<T, E>` with `T: Serialize + DeserializeOwned`",
        )),
        Type::Paren(inner) => check_return_type(&inner.elem),
        Type::Group(inner) => check_return_type(&inner.elem),
        Type::Path(path) if path.path.segments.last().is_some_and(|s| s.ident.to_string().ends_with("Result")) => {
            Ok(())
        }
        _ => Err(syn::Error::new(
            ty.span(),
            "`#[idempotent]` needs a function that returns `Result<T, E>`: the `Ok` value is recorded and \
             replayed, and `E: From<idempotent_runtime::Error>` carries the idempotency errors",
        )),
    }
}

fn expand(args: &Args, function: ItemFn) -> TokenStream {
    let ItemFn { attrs, vis, sig, block } = function;
    let krate = args.krate.as_ref().map_or_else(|| quote!(::idempotent_runtime), ToTokens::to_token_stream);
    let private = quote!(#krate::__private);

    let scope = args.scope.as_ref().map_or_else(|| sig.ident.to_string(), syn::LitStr::value);
    let key = &args.key;
    let store = &args.store;

    let mut call = quote_spanned!(key.span()=> #private::Call::new(#scope, &(#key)));
    if let Some(fingerprint) = &args.fingerprint {
        call = quote_spanned!(fingerprint.span()=> #call.fingerprint(&(#fingerprint)));
    }
    for (method, value) in [("lease", &args.lease), ("retention", &args.retention), ("wait", &args.wait)] {
        if let Some(value) = value {
            let method = syn::Ident::new(method, proc_macro2::Span::call_site());
            let value = duration_tokens(value, &private);
            call = quote!(#call.#method(#value));
        }
    }

    let ReturnType::Type(_, output) = &sig.output else { unreachable!("checked by check_signature") };
    let policy = match &args.record_err {
        RecordErr::Never => quote!(#private::ReleaseErrors),
        RecordErr::Always => quote!(#private::RecordErrors),
        RecordErr::If(predicate) => quote_spanned!(predicate.span()=>
            #private::record_errors_if(::core::marker::PhantomData::<fn() -> #output>, #predicate)
        ),
    };

    // Spans chosen so type errors point at the user's tokens: a non-store at `store = ...`, a
    // non-serialisable `T` or an `E` without `From<Error>` at the return type.
    let store = quote_spanned!(store.span()=> &(#store));
    let run_with = quote_spanned!(output.span()=> run_with);
    quote! {
        #(#attrs)*
        #vis #sig {
            #call.#run_with(#store, #policy, async #block).await
        }
    }
}

fn duration_tokens(value: &DurationArg, private: &TokenStream) -> TokenStream {
    match value {
        DurationArg::Millis(millis, _) => quote!(#private::Duration::from_millis(#millis)),
        DurationArg::Expr(expr) => expr.to_token_stream(),
    }
}

#[cfg(test)]
mod tests {
    use quote::quote;

    #[test]
    fn expansion_keeps_signature_and_attributes() {
        let out = super::idempotent(
            quote!(key = id, store = self.store, lease = "2s"),
            quote!(
                /// Docs.
                #[allow(dead_code)]
                pub async fn pay(&self, id: &str) -> Result<u32, E> {
                    Ok(1)
                }
            ),
        )
        .to_string();
        assert!(out.starts_with("# [doc = r\" Docs.\"] # [allow (dead_code)] pub async fn pay (& self , id : & str) -> Result < u32 , E >"), "{out}");
        assert!(out.contains("Call :: new (\"pay\" , & (id))"), "{out}");
        assert!(
            out.contains(". lease (:: idempotent_runtime :: __private :: Duration :: from_millis (2000u64))"),
            "{out}"
        );
        assert!(
            out.contains("run_with (& (self . store) , :: idempotent_runtime :: __private :: ReleaseErrors , async {"),
            "{out}"
        );
    }

    #[test]
    fn errors_keep_the_function() {
        let out = super::idempotent(
            quote!(key = id),
            quote!(
                fn pay(id: &str) -> u32 {
                    1
                }
            ),
        )
        .to_string();
        assert!(out.starts_with("# [allow (unused_variables)] fn pay (id : & str) -> u32 { 1 }"), "{out}");
        assert!(out.contains("missing `store = ...`"), "{out}");
        assert!(out.contains("works on an `async fn`"), "{out}");
    }
}
