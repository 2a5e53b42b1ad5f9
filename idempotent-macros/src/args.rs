//! Parsing `#[idempotent(...)]` arguments on syn's `meta::parser`, with every error spanned on the
//! token at fault and every mistake in one attribute reported at once.

use proc_macro2::{Span, TokenStream};
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::spanned::Spanned;
use syn::{Expr, ExprLit, Lit, LitStr, Path, Token};

use crate::duration;

const OPTIONS: [&str; 10] =
    ["key", "store", "scope", "fingerprint", "lease", "retention", "wait", "record_err", "on_cancel", "crate"];

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
    pub on_cancel: Option<OnCancel>,
    pub krate: Option<Path>,
    /// The `Self` type's name, passed down by `#[idempotent]` on the enclosing impl (hidden).
    pub self_type: Option<LitStr>,
}

/// A duration given as a literal (checked here) or as an expression (checked by the type system).
pub enum DurationArg {
    Millis(u64, Span),
    Expr(Expr),
}

/// Which `Err` results are recorded; `Always` keeps the option's span for type errors about `E`.
pub enum RecordErr {
    Never,
    Always(Span),
    If(Expr),
}

/// What a cancelled call does with its claim.
#[derive(Debug, PartialEq, Eq)]
pub enum OnCancel {
    Keep,
    Release,
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
    let mut errors = Errors::default();
    let (mut key, mut store, mut scope, mut fingerprint, mut record_err, mut on_cancel, mut krate) =
        (None, None, None, None, None, None, None);
    let (mut lease, mut retention, mut wait, mut self_type) = (None, None, None, None);

    syn::meta::parser(|meta: ParseNestedMeta| {
        let path = &meta.path;
        let name =
            path.get_ident().map_or_else(|| quote::quote!(#path).to_string().replace(' ', ""), ToString::to_string);
        let span = path.span();
        macro_rules! once {
            ($slot:ident, $value:expr) => {{
                let value = $value;
                if $slot.is_some() {
                    errors.push(span, format_args!("`{name}` is given twice; keep one"));
                } else if value.is_some() {
                    $slot = value;
                }
            }};
        }
        if !meta.input.peek(Token![=]) {
            let list =
                meta.input.peek(syn::token::Paren).then(|| meta.input.parse::<proc_macro2::Group>()).transpose()?;
            match (name.as_str(), list) {
                ("record_err", None) => once!(record_err, Some(RecordErr::Always(span))),
                ("record_err", Some(list)) => {
                    errors.push(list.span(), "write `record_err`, `record_err = true` or `record_err = some_fn`");
                }
                (known, _) if OPTIONS.contains(&known) => {
                    errors.push(span, format_args!("`{known}` needs a value: `{known} = ...`"));
                }
                (unknown, _) => errors.push(span, unknown_option(unknown)),
            }
            return Ok(());
        }
        let value: Expr = meta.value()?.parse()?;
        match name.as_str() {
            "key" => once!(key, Some(value)),
            "store" => once!(store, Some(value)),
            "fingerprint" => once!(fingerprint, Some(value)),
            "lease" => once!(lease, duration_arg(value, &mut errors)),
            "retention" => once!(retention, duration_arg(value, &mut errors)),
            "wait" => once!(wait, duration_arg(value, &mut errors)),
            "scope" => once!(scope, scope_arg(&value, &mut errors)),
            "record_err" => once!(record_err, record_err_arg(value, span, &mut errors)),
            "on_cancel" => once!(on_cancel, on_cancel_arg(&value, &mut errors)),
            "crate" => once!(krate, crate_arg(&value, &mut errors)),
            SELF_TYPE => once!(self_type, self_type_arg(&value)),
            unknown => errors.push(span, unknown_option(unknown)),
        }
        Ok(())
    })
    .parse2(tokens)?;

    check_durations(lease.as_ref(), retention.as_ref(), wait.as_ref(), &mut errors);
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
        on_cancel,
        krate,
        self_type,
    })
}

/// The hidden option through which `#[idempotent]` on an impl names its `Self` type.
pub const SELF_TYPE: &str = "__self_type";

/// The runtime's bounds (`MAX_LEASE`, `MAX_RETENTION`, `MAX_WAIT`, the default lease; a zero
/// duration is refused by the parser),
/// checked on literals so a call that would always be refused does not compile.
const DEFAULT_LEASE_MS: u64 = 60_000;
const MAX_LEASE_MS: u64 = 24 * 3_600_000;
const MAX_RETENTION_MS: u64 = 3650 * 24 * 3_600_000;
const MAX_WAIT_MS: u64 = MAX_LEASE_MS;

fn check_durations(
    lease: Option<&DurationArg>,
    retention: Option<&DurationArg>,
    wait: Option<&DurationArg>,
    errors: &mut Errors,
) {
    let literal = |arg: Option<&DurationArg>| match arg {
        Some(DurationArg::Millis(millis, span)) => Some((*millis, *span)),
        _ => None,
    };
    if let Some((millis, span)) = literal(lease)
        && millis > MAX_LEASE_MS
    {
        errors.push(
            span,
            "`lease` is longer than the maximum of 24h: it is how long a crashed call blocks its key, not how \
             long the body may run (the lease is renewed while the body runs); use seconds or minutes",
        );
    }
    if let Some((millis, span)) = literal(retention) {
        if millis > MAX_RETENTION_MS {
            errors.push(span, "`retention` is longer than the maximum of 3650d; keep records for days or weeks");
        }
        let (lease_ms, from_default) = match lease {
            None => (Some(DEFAULT_LEASE_MS), true),
            Some(DurationArg::Millis(millis, _)) => (Some(*millis), false),
            Some(DurationArg::Expr(_)) => (None, false),
        };
        if let Some(lease_ms) = lease_ms.filter(|lease_ms| millis < *lease_ms) {
            let lease = if from_default { "the default `lease` of 60s" } else { "`lease`" };
            errors.push(
                span,
                format_args!(
                    "`retention` ({millis} ms) is shorter than {lease} ({lease_ms} ms): a result would be forgotten \
                     sooner than a crashed call's claim, and every call would be refused; make `retention` at \
                     least as long as the lease"
                ),
            );
        }
    }
    if let Some((millis, span)) = literal(wait)
        && millis > MAX_WAIT_MS
    {
        errors
            .push(span, "`wait` is longer than the maximum of 24h; a duplicate should wait seconds for the first call");
    }
}

fn self_type_arg(value: &Expr) -> Option<LitStr> {
    match value {
        Expr::Lit(ExprLit { lit: Lit::Str(text), .. }) => Some(text.clone()),
        _ => None,
    }
}

fn unknown_option(name: &str) -> String {
    format!("unknown option `{name}`; expected one of: {}", OPTIONS.join(", "))
}

fn record_err_arg(value: Expr, span: Span, errors: &mut Errors) -> Option<RecordErr> {
    match value {
        Expr::Lit(ExprLit { lit: Lit::Bool(b), .. }) => {
            Some(if b.value { RecordErr::Always(span) } else { RecordErr::Never })
        }
        Expr::Lit(lit) => {
            errors.push(
                lit.span(),
                "`record_err` takes `true`, `false`, or a function `fn(&E) -> bool` that says which errors to record",
            );
            None
        }
        other => Some(RecordErr::If(other)),
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
    let Expr::Lit(ExprLit { lit: Lit::Str(text), .. }) = value else {
        errors.push(
            value.span(),
            "`scope` must be a string literal such as \"payments\": it names the keys' namespace and must stay stable",
        );
        return None;
    };
    let scope = text.value();
    if scope.is_empty() || scope.len() > 255 || scope.chars().any(|c| c == ':' || c.is_control()) {
        errors.push(text.span(), "a scope is non-empty printable text of at most 255 bytes, without ':'");
        return None;
    }
    Some(text.clone())
}

fn on_cancel_arg(value: &Expr, errors: &mut Errors) -> Option<OnCancel> {
    if let Expr::Lit(ExprLit { lit: Lit::Str(text), .. }) = value {
        match text.value().as_str() {
            "keep" => return Some(OnCancel::Keep),
            "release" => return Some(OnCancel::Release),
            _ => {}
        }
    }
    errors.push(
        value.span(),
        "`on_cancel` is \"keep\" (the default: a cancelled call keeps its claim until its lease ends, as a \
         crash does) or \"release\" (the key is freed at once, for bodies that are safe to run again)",
    );
    None
}

fn crate_arg(value: &Expr, errors: &mut Errors) -> Option<Path> {
    let Expr::Lit(ExprLit { lit: Lit::Str(text), .. }) = value else {
        errors.push(value.span(), "`crate` takes a string literal: `crate = \"::my_reexport::idempotent_runtime\"`");
        return None;
    };
    let path = text.parse::<Path>();
    if path.is_err() {
        errors.push(text.span(), "`crate` must be a path such as \"::idempotent_runtime\"");
    }
    path.ok()
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
        assert!(matches!(args.record_err, RecordErr::Always(_)));
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
        assert!(matches!(some(quote!(key = k, store = s, record_err = true)), RecordErr::Always(_)));
        assert!(matches!(some(quote!(key = k, store = s, record_err = is_final)), RecordErr::If(_)));
        assert!(error(quote!(key = k, store = s, record_err = "yes")).contains("`record_err` takes"));
    }
}
