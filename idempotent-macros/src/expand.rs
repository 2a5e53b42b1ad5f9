//! Rewriting the annotated function: the body becomes a future handed to `Call::run_with`.
//!
//! Two shapes are accepted, with one code path: an `async fn`, whose block is the body, and a fn
//! that returns a boxed future and ends in `Box::pin(async move { .. })`, which is what
//! `#[async_trait]` on the enclosing impl or trait makes of an `async fn` before this attribute
//! runs. There the body is the inside of that async block (the probe follows tracing-attributes).

use proc_macro2::{Span, TokenStream, TokenTree};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{
    Block, Expr, ExprAsync, GenericArgument, ItemFn, ItemImpl, Pat, PathArguments, ReturnType, Signature, Stmt, Type,
    TypeParamBound,
};

use crate::args::{self, Args, DurationArg, OnCancel, RecordErr};

/// The attribute's entry point. On any error it emits the user's function unchanged next to the
/// errors, so one mistake does not turn into a cascade of "function not found" errors.
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let function: ItemFn = match syn::parse2(item.clone()) {
        Ok(function) => function,
        Err(error) => {
            if let Ok(block) = syn::parse2::<ItemImpl>(item.clone()) {
                return crate::impl_block::name_methods(&args, block);
            }
            if let Ok(def) = syn::parse2::<syn::ItemTrait>(item.clone()) {
                let error = syn::Error::new(
                    def.ident.span(),
                    "`#[idempotent]` on a trait cannot give its default methods a scope of their own per \
                     implementor; give each `#[idempotent]` default method an explicit `scope = \"...\"` \
                     (every implementor then shares its records: put what tells them apart into the `key`)",
                );
                return with_error(item, &error);
            }
            return with_error(item, &error);
        }
    };
    let args = args::parse(args);
    let output = output_type(&function);
    match (args, output) {
        (Ok(args), Ok(output)) => expand(&args, &output, function),
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

/// The `Result<T, E>` the body produces: the declared return type of an `async fn`, or the
/// `Output` of the boxed future an `#[async_trait]` method returns.
fn output_type(function: &ItemFn) -> Result<Type, syn::Error> {
    let sig = &function.sig;
    let ReturnType::Type(_, declared) = &sig.output else {
        if sig.asyncness.is_none() {
            return Err(not_async(function));
        }
        return Err(syn::Error::new(
            sig.paren_token.span.join(),
            "`#[idempotent]` needs a function that returns `Result<T, E>`: the `Ok` value is recorded and \
             replayed, and `E` carries `idempotent_runtime::Error`",
        ));
    };
    let output = if sig.asyncness.is_some() {
        (**declared).clone()
    } else {
        match (future_output(declared), boxed_block(&function.block)) {
            (Some(output), Some(_)) => output.clone(),
            _ => return Err(not_async(function)),
        }
    };
    check_return_type(&output)?;
    Ok(output)
}

fn not_async(function: &ItemFn) -> syn::Error {
    syn::Error::new(
        function.sig.fn_token.span,
        "`#[idempotent]` works on an `async fn` (also inside an `#[async_trait]` impl or trait): add `async` \
         (the claim and the record are awaited)",
    )
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

/// `R` in `Pin<Box<dyn Future<Output = R> + ..>>`, the return type `#[async_trait]` writes.
fn future_output(ty: &Type) -> Option<&Type> {
    fn type_arg<'a>(ty: &'a Type, name: &str) -> Option<&'a PathArguments> {
        let Type::Path(path) = ty else { return None };
        Some(&path.path.segments.last().filter(|s| s.ident == name)?.arguments)
    }
    fn first_type(args: &PathArguments) -> Option<&Type> {
        let PathArguments::AngleBracketed(args) = args else { return None };
        args.args.iter().find_map(|arg| if let GenericArgument::Type(ty) = arg { Some(ty) } else { None })
    }
    let boxed = first_type(type_arg(ty, "Pin")?)?;
    let Type::TraitObject(object) = first_type(type_arg(boxed, "Box")?)? else { return None };
    let future = object.bounds.iter().find_map(|bound| match bound {
        TypeParamBound::Trait(t) => t.path.segments.last().filter(|s| s.ident == "Future"),
        _ => None,
    })?;
    let PathArguments::AngleBracketed(args) = &future.arguments else { return None };
    args.args.iter().find_map(|arg| match arg {
        GenericArgument::AssocType(assoc) if assoc.ident == "Output" => Some(&assoc.ty),
        _ => None,
    })
}

/// The async block of a body ending in `Box::pin(async move { .. })` or `async move { .. }`.
fn boxed_block(block: &Block) -> Option<&ExprAsync> {
    let Some(Stmt::Expr(last, None)) = block.stmts.last() else { return None };
    match last {
        Expr::Async(inner) => Some(inner),
        Expr::Call(call) => {
            let Expr::Path(func) = &*call.func else { return None };
            let mut segments = func.path.segments.iter().rev();
            let is_box_pin =
                segments.next().is_some_and(|s| s.ident == "pin") && segments.next().is_some_and(|s| s.ident == "Box");
            match call.args.first() {
                Some(Expr::Async(inner)) if is_box_pin && call.args.len() == 1 => Some(inner),
                _ => None,
            }
        }
        _ => None,
    }
}

fn boxed_block_mut(block: &mut Block) -> Option<&mut ExprAsync> {
    match block.stmts.last_mut() {
        Some(Stmt::Expr(Expr::Async(inner), None)) => Some(inner),
        Some(Stmt::Expr(Expr::Call(call), None)) => match call.args.first_mut() {
            Some(Expr::Async(inner)) => Some(inner),
            _ => None,
        },
        _ => None,
    }
}

fn expand(args: &Args, output: &Type, mut function: ItemFn) -> TokenStream {
    if function.sig.asyncness.is_some() {
        let block = &function.block;
        let run = run(args, &function.sig, output, &quote!(async #block), false);
        function.block = Box::new(syn::parse_quote!({ #run }));
    } else {
        let inner = boxed_block_mut(&mut function.block).expect("checked by output_type");
        // `#[async_trait]` writes `let __self = self;`, rebinds the arguments, then `let __ret: R =
        // { body }; __ret`. The call goes after those bindings, so the store may borrow what the
        // body moves; the attribute's `self` then means `__self`.
        let stmts = std::mem::take(&mut inner.block.stmts);
        let split = stmts.iter().position(|s| binds(s, "__ret")).unwrap_or(0);
        let (bindings, body) = stmts.split_at(split);
        let renamed = bindings.iter().any(|s| binds(s, "__self"));
        let run = run(args, &function.sig, output, &quote!(async { #(#body)* }), renamed);
        inner.block.stmts = syn::parse_quote!(#(#bindings)* #run);
    }
    function.into_token_stream()
}

/// Whether `stmt` is `let <name>... = ..;`.
fn binds(stmt: &Stmt, name: &str) -> bool {
    let Stmt::Local(local) = stmt else { return false };
    let pat = match &local.pat {
        Pat::Type(typed) => &*typed.pat,
        pat => pat,
    };
    matches!(pat, Pat::Ident(ident) if ident.ident == name)
}

/// `Call::new(..)...run_with(store, policy, body).await`, the body being a future expression.
fn run(args: &Args, sig: &Signature, output: &Type, body: &TokenStream, renamed: bool) -> TokenStream {
    let krate = args.krate.as_ref().map_or_else(|| quote!(::idempotent_runtime), ToTokens::to_token_stream);
    let private = quote!(#krate::__private);
    let user = |expr: &Expr| if renamed { rename_self(expr.to_token_stream()) } else { expr.to_token_stream() };

    // Without `scope`, the default is the module path and the name, with the `Self` type's name
    // in between when `#[idempotent]` on the impl passed it down: text the compiler cannot change.
    // The site lets the runtime refuse two functions that arrive at one default, and, for a
    // method, two `Self` types that share one site (a trait's default method). An explicit
    // scope is a decision to share (or not): no site, no check.
    let name = match &args.self_type {
        Some(ty) => format!("{}.{}", ty.value(), sig.ident),
        None => sig.ident.to_string(),
    };
    // A literal scope was checked above (`args::scope_arg`), so it becomes a `Scope` in a `const`;
    // a default one is checked by its site's first call.
    let key = user(&args.key);
    let mut call = match (&args.scope, sig.receiver()) {
        (Some(scope), _) => quote_spanned!(args.key.span()=>
            #private::Call::in_scope(const { #private::Scope::from_static(#scope) }, &(#key))
        ),
        (None, None) => quote_spanned!(args.key.span()=> #private::Call::at_site(&__IDEMPOTENT_SITE, &(#key))),
        (None, Some(_)) => quote_spanned!(args.key.span()=>
            #private::Call::at_site(&__IDEMPOTENT_SITE, &(#key)).self_type::<Self>()
        ),
    };
    if let Some(fingerprint) = &args.fingerprint {
        let value = user(fingerprint);
        call = quote_spanned!(fingerprint.span()=> #call.fingerprint(&(#value)));
    }
    for (method, value) in [("lease", &args.lease), ("retention", &args.retention), ("wait", &args.wait)] {
        if let Some(value) = value {
            let method = syn::Ident::new(method, Span::call_site());
            let value = match value {
                DurationArg::Millis(millis, _) => quote!(#private::Duration::from_millis(#millis)),
                DurationArg::Expr(expr) => user(expr),
            };
            call = quote!(#call.#method(#value));
        }
    }
    if let Some(on_cancel) = &args.on_cancel {
        let variant = match on_cancel {
            OnCancel::Keep => quote!(Keep),
            OnCancel::Release => quote!(Release),
        };
        call = quote!(#call.on_cancel(#private::OnCancel::#variant));
    }

    // `record_err` is a method on the named return type: an error type that cannot be recorded
    // is one error at the option, and a closure's argument type is inferred from it.
    let output_of = quote!(#private::Output::<#output>::new());
    let policy = match &args.record_err {
        RecordErr::Never => quote!(#private::ReleaseErrors),
        RecordErr::Always(span) => {
            let method = syn::Ident::new("record_errors", *span);
            quote_spanned!(*span=> #output_of.#method())
        }
        RecordErr::If(predicate) => {
            let value = user(predicate);
            let method = syn::Ident::new("record_errors_if", predicate.span());
            quote_spanned!(predicate.span()=> #output_of.#method(#value))
        }
    };

    // Spans chosen so type errors point at the user's tokens: a non-store at `store = ...`, a
    // non-serialisable `T` or an `E` without `From<Error>` at the return type.
    let store = user(&args.store);
    let store = quote_spanned!(args.store.span()=> (&(#store)).idempotent_store());
    let run_with = quote_spanned!(output.span()=> run_with);
    // The call expression, its `.await` and `run_with` share one span: rustc reports a failed bound
    // once per span, so an unsatisfied bound on `T` or `E` appears once, at the return type.
    // The local is hygienic (mixed-site): the body neither sees it nor has it shadow a name.
    let span = output.span();
    let local = syn::Ident::new("idempotent_call", Span::mixed_site().located_at(span));
    let records = (!matches!(args.record_err, RecordErr::Never)).then(|| quote!(use #private::RecordsErrors as _;));
    // Its own check of `E: From<Error>` reports an alias such as `io::Result<T>` in words; spanned
    // like `run_with`'s, rustc reports it once.
    let checked = respan(output.to_token_stream(), span);
    let site = args.scope.is_none().then(|| {
        quote! {
            static __IDEMPOTENT_SITE: #private::Site = #private::Site::new(
                ::core::concat!(::core::file!(), ":", ::core::line!(), ":", ::core::column!()),
                ::core::module_path!(),
                #name,
            );
        }
    });
    quote_spanned!(span=> {
        #site
        use #private::AsStore as _;
        #records
        #private::check_result::<#checked>();
        let #local = #call;
        (#local).#run_with(#store, #policy, #body).await
    })
}

/// `tokens` with every span set to `span`, so that rustc sees one span for them.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            if let TokenTree::Group(group) = &token {
                let mut inner = proc_macro2::Group::new(group.delimiter(), respan(group.stream(), span));
                inner.set_span(span);
                token = TokenTree::Group(inner);
            }
            token.set_span(span);
            token
        })
        .collect()
}

/// Replaces `self` (not `self::`) with `__self`, for code placed after `#[async_trait]`'s
/// `let __self = self;`.
fn rename_self(tokens: TokenStream) -> TokenStream {
    let mut out = Vec::new();
    let mut tokens = tokens.into_iter().peekable();
    while let Some(token) = tokens.next() {
        out.push(match token {
            TokenTree::Ident(ident) if ident == "self" => {
                let path = matches!(tokens.peek(), Some(TokenTree::Punct(p)) if p.as_char() == ':');
                if path { TokenTree::Ident(ident) } else { TokenTree::Ident(syn::Ident::new("__self", ident.span())) }
            }
            TokenTree::Group(group) => {
                let mut renamed = proc_macro2::Group::new(group.delimiter(), rename_self(group.stream()));
                renamed.set_span(group.span());
                TokenTree::Group(renamed)
            }
            other => other,
        });
    }
    out.into_iter().collect()
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
        assert!(out.contains("Call :: at_site (& __IDEMPOTENT_SITE , & (id)) . self_type :: < Self > ()"), "{out}");
        assert!(out.contains("static __IDEMPOTENT_SITE : :: idempotent_runtime :: __private :: Site = :: idempotent_runtime :: __private :: Site :: new (:: core :: concat ! (:: core :: file ! () , \":\" , :: core :: line ! () , \":\" , :: core :: column ! ()) , :: core :: module_path ! () , \"pay\" ,)"), "{out}");
        assert!(
            out.contains(". lease (:: idempotent_runtime :: __private :: Duration :: from_millis (2000u64))"),
            "{out}"
        );
        assert!(
            out.contains(
                "run_with ((& (self . store)) . idempotent_store () , :: idempotent_runtime :: __private :: ReleaseErrors , async {"
            ),
            "{out}"
        );
    }

    /// What `#[async_trait]` makes of `async fn pay(&self, id: &str) -> Result<u32, E>`.
    #[test]
    fn async_trait_body_is_wrapped_after_its_bindings() {
        let out = super::idempotent(
            quote!(key = id, store = self.store, fingerprint = self::helper(self)),
            quote!(
                fn pay<'life0, 'life1, 'async_trait>(
                    &'life0 self,
                    id: &'life1 str,
                ) -> ::core::pin::Pin<
                    Box<dyn ::core::future::Future<Output = Result<u32, E>> + ::core::marker::Send + 'async_trait>,
                >
                where
                    'life0: 'async_trait,
                    'life1: 'async_trait,
                    Self: 'async_trait,
                {
                    Box::pin(async move {
                        if let ::core::option::Option::Some(__ret) = ::core::option::Option::None::<Result<u32, E>> {
                            #[allow(unreachable_code)]
                            return __ret;
                        }
                        let __self = self;
                        let __ret: Result<u32, E> = { Ok(__self.n) };
                        #[allow(unreachable_code)]
                        __ret
                    })
                }
            ),
        )
        .to_string();
        let bindings = out.find("let __self = self ;").expect(&out);
        let call = out.find("Call :: at_site (& __IDEMPOTENT_SITE , & (id))").expect(&out);
        let body = out.find("async { let __ret : Result < u32 , E > = { Ok (__self . n) } ;").expect(&out);
        assert!(bindings < call && call < body, "{out}");
        assert!(out.contains("fingerprint (& (self :: helper (__self)))"), "{out}");
        assert!(out.contains("(& (__self . store)) . idempotent_store ()"), "{out}");
        assert!(out.trim_end().ends_with(". await } }) }"), "{out}");
    }

    #[test]
    fn scopes_without_a_receiver_and_explicit_ones() {
        let free = super::idempotent(
            quote!(key = id, store = s, on_cancel = "release"),
            quote!(
                async fn pay(s: &S, id: &str) -> Result<u32, E> {
                    Ok(1)
                }
            ),
        )
        .to_string();
        assert!(
            free.contains("Call :: at_site (& __IDEMPOTENT_SITE , & (id)) . on_cancel (:: idempotent_runtime :: __private :: OnCancel :: Release)"),
            "{free}"
        );
        let named = super::idempotent(
            quote!(key = id, store = self.s, scope = "payments"),
            quote!(
                async fn pay(&self, id: &str) -> Result<u32, E> {
                    Ok(1)
                }
            ),
        )
        .to_string();
        assert!(
            named.contains(
                "Call :: in_scope (const { :: idempotent_runtime :: __private :: Scope :: from_static (\"payments\") } , & (id)) ;"
            ),
            "{named}"
        );
        assert!(!named.contains("__IDEMPOTENT_SITE"), "an explicit scope may be shared on purpose: {named}");
    }

    #[test]
    fn a_plain_fn_is_refused() {
        let out = super::idempotent(
            quote!(key = id, store = s),
            quote!(
                fn pay(id: &str) -> Result<u32, E> {
                    Box::pin(make(id))
                }
            ),
        )
        .to_string();
        assert!(out.contains("works on an `async fn`"), "{out}");
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
