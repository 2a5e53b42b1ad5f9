//! Parsing `#[idempotent(...)]` arguments, with every error spanned on the token at fault.

use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, Lit, LitStr, Meta, Path, Token};

use crate::duration;

const OPTIONS: &str = "key, store, scope, fingerprint, lease, retention, wait, record_err, crate";

/// The attribute's arguments, validated.
pub struct Args {
    pub key: Expr,
    pub store: Expr,
    pub scope: Option<LitStr>,
    pub fingerprint: Option<Expr>,
    pub lease: Option<DurationArg>,
    pub retention: Option<DurationArg>,
    pub wait: Option<DurationArg>,
    pub record_err: RecordErr,
    pub krate: Option<Path>,
}

/// A duration given as a literal (checked here) or as an expression (checked by the type system).
pub enum DurationArg {
    Millis(u64, Span),
    Expr(Expr),
}

/// Which `Err` results are recorded.
pub enum RecordErr {
    Never,
    Always,
    If(Expr),
}

/// Collects errors so that one compile reports every mistake in the attribute.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, span: Span, message: impl std::fmt::Display) {
        let error = syn::Error::new(span, message);
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }
}

/// Parses and checks the arguments.
pub fn parse(tokens: TokenStream) -> Result<Args, syn::Error> {
    let metas = Punctuated::<Meta, Token![,]>::parse_terminated.parse2(tokens)?;
    let mut errors = Errors::default();
    let mut key = None;
    let mut store = None;
    let mut scope = None;
    let mut fingerprint = None;
    let mut lease = None;
    let mut retention = None;
    let mut wait = None;
    let mut record_err = None;
    let mut krate = None;

    for meta in metas {
        let path = meta.path();
        let name =
            path.get_ident().map_or_else(|| quote::quote!(#path).to_string().replace(' ', ""), ToString::to_string);
        let name_span = meta.path().span();
        macro_rules! once {
            ($slot:ident, $value:expr) => {{
                if $slot.is_some() {
                    errors.push(name_span, format_args!("`{name}` is given twice; keep one"));
                } else {
                    $slot = $value;
                }
            }};
        }
        match name.as_str() {
            "record_err" => {
                if let Some(value) = record_err_arg(&meta, &mut errors) {
                    once!(record_err, Some(value));
                }
            }
            known @ ("key" | "store" | "scope" | "fingerprint" | "lease" | "retention" | "wait" | "crate") => {
                let Meta::NameValue(nv) = meta else {
                    errors.push(name_span, format_args!("`{known}` needs a value: `{known} = ...`"));
                    continue;
                };
                let value = nv.value;
                match known {
                    "key" => once!(key, Some(value)),
                    "store" => once!(store, Some(value)),
                    "fingerprint" => once!(fingerprint, Some(value)),
                    "lease" => once!(lease, duration_arg(value, &mut errors)),
                    "retention" => once!(retention, duration_arg(value, &mut errors)),
                    "wait" => once!(wait, duration_arg(value, &mut errors)),
                    "scope" => once!(scope, scope_arg(&value, &mut errors)),
                    _ => once!(krate, crate_arg(&value, &mut errors)),
                }
            }
            unknown => errors.push(name_span, format_args!("unknown option `{unknown}`; expected one of: {OPTIONS}")),
        }
    }

    if let (Some(DurationArg::Millis(lease, _)), Some(DurationArg::Millis(retention, span))) = (&lease, &retention)
        && retention < lease
    {
        errors.push(
            *span,
            "`retention` is shorter than `lease`: a result would be forgotten sooner than a crashed call's \
             claim; make `retention` at least as long as `lease`",
        );
    }
    if key.is_none() {
        errors.push(
            Span::call_site(),
            "missing `key = ...`: name the expression that identifies a request, such as `key = request_id`",
        );
    }
    if store.is_none() {
        errors.push(
            Span::call_site(),
            "missing `store = ...`: name the store that keeps the records, such as `store = self.store`",
        );
    }
    if let Some(error) = errors.0 {
        return Err(error);
    }
    Ok(Args {
        key: key.expect("checked above"),
        store: store.expect("checked above"),
        scope,
        fingerprint,
        lease,
        retention,
        wait,
        record_err: record_err.unwrap_or(RecordErr::Never),
        krate,
    })
}

fn record_err_arg(meta: &Meta, errors: &mut Errors) -> Option<RecordErr> {
    match meta {
        Meta::Path(_) => Some(RecordErr::Always),
        Meta::NameValue(nv) => match &nv.value {
            Expr::Lit(ExprLit { lit: Lit::Bool(b), .. }) => {
                Some(if b.value { RecordErr::Always } else { RecordErr::Never })
            }
            Expr::Lit(lit) => {
                errors.push(
                    lit.span(),
                    "`record_err` takes `true`, `false`, or a function `fn(&E) -> bool` that says which errors to record",
                );
                None
            }
            other => Some(RecordErr::If(other.clone())),
        },
        Meta::List(list) => {
            errors.push(
                list.delimiter.span().join(),
                "write `record_err`, `record_err = true` or `record_err = some_fn`",
            );
            None
        }
    }
}

fn duration_arg(value: Expr, errors: &mut Errors) -> Option<DurationArg> {
    match value {
        Expr::Lit(ExprLit { lit: Lit::Str(text), .. }) => match duration::parse_millis(&text.value()) {
            Ok(millis) => Some(DurationArg::Millis(millis, text.span())),
            Err(message) => {
                errors.push(text.span(), message);
                None
            }
        },
        Expr::Lit(other) => {
            errors.push(
                other.span(),
                "a duration is a string such as \"30s\", \"500ms\" or \"24h\", or a `std::time::Duration` expression",
            );
            None
        }
        expr => Some(DurationArg::Expr(expr)),
    }
}

fn scope_arg(value: &Expr, errors: &mut Errors) -> Option<LitStr> {
    if let Expr::Lit(ExprLit { lit: Lit::Str(text), .. }) = value {
        let scope = text.value();
        if scope.is_empty() || scope.len() > 255 || scope.chars().any(|c| c == ':' || c.is_control()) {
            errors.push(text.span(), "a scope is non-empty printable text of at most 255 bytes, without ':'");
            return None;
        }
        return Some(text.clone());
    }
    errors.push(
        value.span(),
        "`scope` must be a string literal such as \"payments\": it names the keys' namespace and must stay stable",
    );
    None
}

fn crate_arg(value: &Expr, errors: &mut Errors) -> Option<Path> {
    if let Expr::Lit(ExprLit { lit: Lit::Str(text), .. }) = value {
        match text.parse::<Path>() {
            Ok(path) => return Some(path),
            Err(_) => errors.push(text.span(), "`crate` must be a path such as \"::idempotent_runtime\""),
        }
        return None;
    }
    errors.push(value.span(), "`crate` takes a string literal: `crate = \"::my_reexport::idempotent_runtime\"`");
    None
}

#[cfg(test)]
mod tests {
    use quote::quote;

    use super::*;

    fn error(tokens: TokenStream) -> String {
        match parse(tokens) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect::<Vec<_>>().join(" | "),
        }
    }

    #[test]
    fn all_options_parse() {
        let args = parse(quote!(
            key = request_id,
            store = self.store,
            scope = "pay",
            fingerprint = (user, amount),
            lease = "30s",
            retention = "1h",
            wait = Duration::from_secs(1),
            record_err,
            crate = "::x"
        ))
        .unwrap();
        assert!(matches!(args.lease, Some(DurationArg::Millis(30_000, _))));
        assert!(matches!(args.retention, Some(DurationArg::Millis(3_600_000, _))));
        assert!(matches!(args.wait, Some(DurationArg::Expr(_))));
        assert!(matches!(args.record_err, RecordErr::Always));
        assert_eq!(args.scope.unwrap().value(), "pay");
    }

    #[test]
    fn every_mistake_is_reported_at_once() {
        let message = error(quote!(key = k, key = j, colour = 1, lease = "soon"));
        assert!(message.contains("`key` is given twice"), "{message}");
        assert!(message.contains("unknown option `colour`; expected one of: key, store"), "{message}");
        assert!(message.contains("invalid duration \"soon\""), "{message}");
        assert!(message.contains("missing `store = ...`"), "{message}");
    }

    #[test]
    fn record_err_forms() {
        let some = |t| parse(t).unwrap().record_err;
        assert!(matches!(some(quote!(key = k, store = s, record_err = false)), RecordErr::Never));
        assert!(matches!(some(quote!(key = k, store = s, record_err = is_final)), RecordErr::If(_)));
        assert!(error(quote!(key = k, store = s, record_err = "yes")).contains("`record_err` takes"));
    }
}
