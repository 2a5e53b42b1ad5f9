//! Default scopes for the attribute, and the check that two functions never share one by accident.
//!
//! A function without `scope = "..."` gets a scope from where it is defined: the module path and
//! the function's name (`shop.payments.pay`), with the `Self` type's name in between for the
//! methods of an impl marked `#[idempotent]` (`shop.Orders.create`). Every part is source text
//! (`module_path!()` and tokens the macro sees), so a new compiler never changes a scope. Rust's
//! `::` becomes `.` because a scope may not hold `:`.
//!
//! Two functions can still arrive at the same default: two types' methods of one name in one
//! module without `#[idempotent]` on their impls, or a trait's default method used by several
//! types. Each expansion therefore carries a [`Site`] (its file, line and column) and, for a
//! method, the `Self` type of the call; the first call registers the scope, and a call from
//! another site, or from the same site for another `Self` type, fails with
//! [`Error::ScopeCollision`] before it claims anything. The check covers one process; across
//! processes, name the scope explicitly.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::{Error, Key, KeyError, Scope};

fn dotted<const N: usize>(parts: [&str; N]) -> String {
    let mut scope = String::with_capacity(parts.iter().map(|p| p.len() + 1).sum());
    for part in parts {
        if !scope.is_empty() {
            scope.push('.');
        }
        scope.push_str(&part.replace("::", "."));
    }
    scope
}

/// Where an `#[idempotent]` function without `scope` is defined, and its default scope; one
/// `static` per expansion.
#[doc(hidden)]
#[derive(Debug)]
pub struct Site {
    location: &'static str,
    module_path: &'static str,
    name: &'static str,
    /// The default scope, made from `module_path` and `name` and checked by the first call: made
    /// per call, it cost a replay on the memory store more than the rest of the call (three
    /// allocations), and checked per call, 6 % of it. Its text lives as long as the `static` site.
    scope: OnceLock<(&'static str, Result<Scope<'static>, KeyError>)>,
    /// The scope (and `Self` type) this site registered first: later calls with them skip the
    /// registry.
    registered: OnceLock<(Box<str>, Option<&'static str>)>,
}

/// A site's location and, for a method, its `Self` type.
type Owner = (&'static str, Option<&'static str>);

/// Which site (and `Self` type) registered each scope in this process.
static REGISTRY: Mutex<Option<HashMap<Box<str>, Owner>>> = Mutex::new(None);

impl Site {
    /// The site at `location` (`file:line:column`) of the function `name` (with its `Self` type's
    /// name before it, dotted, for a method of an impl marked `#[idempotent]`) in the module
    /// `module_path`.
    #[must_use]
    pub const fn new(location: &'static str, module_path: &'static str, name: &'static str) -> Self {
        Site { location, module_path, name, scope: OnceLock::new(), registered: OnceLock::new() }
    }

    /// The function's default scope: its module path and name, dotted (`shop.payments.pay`).
    pub fn scope(&'static self) -> &'static str {
        self.made().0
    }

    /// The default scope, or why it cannot be one (a module path over 255 bytes, say).
    pub(crate) fn checked_scope(&'static self) -> Result<Scope<'static>, KeyError> {
        self.made().1.clone()
    }

    fn made(&'static self) -> &'static (&'static str, Result<Scope<'static>, KeyError>) {
        self.scope.get_or_init(|| {
            let text: &'static str = Box::leak(dotted([self.module_path, self.name]).into_boxed_str());
            (text, Scope::new(text))
        })
    }

    /// Registers the scope of `key` for this site and, for a method, its `Self` type (`self_type`,
    /// compared only within this process), or reports the other site or type that uses it.
    pub(crate) fn check(&'static self, key: &Key, self_type: Option<&'static str>) -> Result<(), Error> {
        // Compared as bytes: the scope's text is needed (and checked for UTF-8) only the first time.
        if self
            .registered
            .get()
            .is_some_and(|(registered, ty)| registered.as_bytes() == key.scope_bytes() && *ty == self_type)
        {
            return Ok(());
        }
        let scope = key.scope();
        let mut registry = REGISTRY.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let (owner, owner_type) =
            *registry.get_or_insert_with(HashMap::new).entry(scope.into()).or_insert((self.location, self_type));
        drop(registry);
        let described = |location: &str, ty: Option<&str>| match ty {
            Some(ty) => format!("{location} (for `{ty}`)"),
            None => location.to_owned(),
        };
        if owner != self.location || owner_type != self_type {
            return Err(Error::ScopeCollision {
                scope: scope.to_owned(),
                first: described(owner, owner_type),
                second: described(self.location, self_type),
            });
        }
        let _ = self.registered.set((scope.into(), self_type));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A key in `scope`.
    fn key(scope: &str) -> Key {
        Key::new(scope, &"k").unwrap()
    }

    #[test]
    fn memory_default_scopes_are_dotted_paths() {
        static PAY: Site = Site::new("p.rs:1:1", "shop::payments", "pay");
        static CREATE: Site = Site::new("o.rs:1:1", "shop::payments", "Orders.create");
        static HERE: Site = Site::new("h.rs:1:1", module_path!(), "pay");
        assert_eq!(PAY.scope(), "shop.payments.pay");
        assert!(std::ptr::eq(PAY.scope(), PAY.scope()), "made once");
        assert_eq!(CREATE.scope(), "shop.payments.Orders.create");
        assert!(crate::Key::new(HERE.scope(), &"k").is_ok());
    }

    /// A default scope is checked once per site, and a site whose default is not a scope (a
    /// module path over 255 bytes) refuses every call without running its body.
    #[tokio::test]
    async fn memory_a_site_whose_default_is_no_scope_refuses_every_call() {
        static NESTED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| ["deep"; 60].join("::"));
        static DEEP: std::sync::LazyLock<Site> = std::sync::LazyLock::new(|| Site::new("d.rs:1:1", &NESTED, "pay"));
        static FINE: Site = Site::new("f.rs:1:1", "shop", "pay");
        let deep: &'static Site = &DEEP;
        assert_eq!(deep.scope().len(), 60 * 5 - 1 + 4);
        let store = crate::MemoryStore::new();
        let runs = std::sync::atomic::AtomicU32::new(0);
        for _ in 0..2 {
            let refused = crate::Call::at_site(deep, &"k")
                .run(&store, async {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    Ok::<_, Error>(())
                })
                .await;
            assert!(
                matches!(refused, Err(Error::InvalidKey(KeyError::InvalidScope(ref s))) if s == deep.scope()),
                "{refused:?}"
            );
        }
        assert_eq!(runs.into_inner(), 0);
        assert_eq!(FINE.checked_scope().map(|s| s.as_str()), Ok("shop.pay"));
        assert!(std::ptr::eq(FINE.checked_scope().unwrap().as_str(), FINE.scope()), "made and checked once");
    }

    #[test]
    fn memory_sites_refuse_a_scope_another_site_registered() {
        static FIRST: Site = Site::new("a.rs:1:1", "a", "f");
        static SECOND: Site = Site::new("b.rs:2:2", "b", "f");
        FIRST.check(&key("scope-test.shared"), None).unwrap();
        FIRST.check(&key("scope-test.shared"), None).unwrap();
        let Err(Error::ScopeCollision { scope, first, second }) = SECOND.check(&key("scope-test.shared"), None) else {
            panic!("a second site was allowed the same scope")
        };
        assert_eq!((scope.as_str(), first.as_str(), second.as_str()), ("scope-test.shared", "a.rs:1:1", "b.rs:2:2"));
        SECOND.check(&key("scope-test.other"), None).unwrap();
    }

    #[test]
    fn memory_a_site_refuses_a_second_self_type() {
        static DEFAULT_METHOD: Site = Site::new("t.rs:3:3", "t", "f");
        DEFAULT_METHOD.check(&key("scope-test.method"), Some("a::Stripe")).unwrap();
        DEFAULT_METHOD.check(&key("scope-test.method"), Some("a::Stripe")).unwrap();
        let Err(Error::ScopeCollision { first, second, .. }) =
            DEFAULT_METHOD.check(&key("scope-test.method"), Some("a::Adyen"))
        else {
            panic!("a second Self type shared the default method's scope")
        };
        assert_eq!((first.as_str(), second.as_str()), ("t.rs:3:3 (for `a::Stripe`)", "t.rs:3:3 (for `a::Adyen`)"));
    }
}
