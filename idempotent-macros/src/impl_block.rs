//! `#[idempotent]` on an impl block: it names the `Self` type for the default scopes of the
//! `#[idempotent]` methods inside, so `Orders::create` and `Refunds::create` of one module get
//! `<module>.Orders.create` and `<module>.Refunds.create`, from the source text alone.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote};
use syn::spanned::Spanned;
use syn::{Attribute, ImplItem, ItemImpl, LitStr, Meta, Type};

use crate::args::SELF_TYPE;

/// Passes the impl's type name to every `#[idempotent(...)]` method of `block`.
pub fn name_methods(args: &TokenStream, mut block: ItemImpl) -> TokenStream {
    if !args.is_empty() {
        let error = syn::Error::new(
            args.span(),
            "`#[idempotent]` on an impl takes no options: it only names the type in the default scopes of the \
             `#[idempotent(...)]` methods inside; put the options on each method",
        );
        return with_error(block, &error);
    }
    let Some(name) = type_name(&block.self_ty) else {
        let error = syn::Error::new(
            block.self_ty.span(),
            "`#[idempotent]` on an impl needs a type named by a path (such as `Orders` or `shop::Orders<T>`); \
             give the methods an explicit `scope = \"...\"` instead",
        );
        return with_error(block, &error);
    };
    let name = LitStr::new(&name, Span::call_site());
    for item in &mut block.items {
        if let ImplItem::Fn(method) = item {
            for attr in method.attrs.iter_mut().filter(|attr| is_idempotent(attr)) {
                pass_type(attr, &name);
            }
        }
    }
    block.into_token_stream()
}

/// The last segment of the type's path, without generic arguments.
fn type_name(ty: &Type) -> Option<String> {
    match ty {
        Type::Path(path) if path.qself.is_none() => path.path.segments.last().map(|s| s.ident.to_string()),
        Type::Group(group) => type_name(&group.elem),
        Type::Paren(paren) => type_name(&paren.elem),
        _ => None,
    }
}

fn is_idempotent(attr: &Attribute) -> bool {
    attr.path().segments.last().is_some_and(|segment| segment.ident == "idempotent")
}

/// Appends `__self_type = "<name>"` to the attribute's arguments.
fn pass_type(attr: &mut Attribute, name: &LitStr) {
    let option = syn::Ident::new(SELF_TYPE, Span::call_site());
    match &mut attr.meta {
        Meta::List(list) => {
            let tokens = std::mem::take(&mut list.tokens);
            let separator = (!tokens.is_empty() && !tokens.to_string().trim_end().ends_with(',')).then(|| quote!(,));
            list.tokens = quote!(#tokens #separator #option = #name);
        }
        meta @ Meta::Path(_) => {
            let path = meta.path().clone();
            *meta = syn::parse_quote!(#path(#option = #name));
        }
        Meta::NameValue(_) => {}
    }
}

fn with_error(block: ItemImpl, error: &syn::Error) -> TokenStream {
    let mut out = block.into_token_stream();
    out.extend(error.to_compile_error());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impl_blocks_pass_their_type_name_to_the_methods() {
        let block: ItemImpl = syn::parse_quote! {
            impl<T: Send> shop::Orders<T> {
                #[idempotent(key = id, store = self.store)]
                async fn create(&self, id: &str) -> Result<u32, Error> { Ok(1) }
                #[idempotent_runtime::idempotent(key = id, store = self.store,)]
                async fn cancel(&self, id: &str) -> Result<u32, Error> { Ok(2) }
                async fn plain(&self) {}
            }
        };
        let out = name_methods(&TokenStream::new(), block).to_string();
        assert!(out.contains("# [idempotent (key = id , store = self . store , __self_type = \"Orders\")]"), "{out}");
        assert!(out.contains("store = self . store , __self_type = \"Orders\")]"), "{out}");
        assert_eq!(out.matches("__self_type").count(), 2, "{out}");
    }

    #[test]
    fn impl_blocks_take_no_options_and_need_a_path_type() {
        let block: ItemImpl = syn::parse_quote!(impl Orders {});
        let out = name_methods(&quote!(scope = "x"), block).to_string();
        assert!(out.contains("takes no options"), "{out}");
        let block: ItemImpl = syn::parse_quote!(impl Trait for &'static str {});
        let out = name_methods(&TokenStream::new(), block).to_string();
        assert!(out.contains("needs a type named by a path"), "{out}");
    }
}
