//! Default scopes for the attribute, and the check that two functions never share one by accident.
//!
//! A function without `scope = "..."` gets a scope from where it is defined: the module path and
//! the function's name (`shop.payments.pay`), or, for a method with a receiver, the path of the
//! `Self` type and the method's name (`shop.Orders.create`), so two impls' `create` in one module
//! stay apart. Rust's `::` becomes `.` because a scope may not hold `:`.
//!
//! Two functions can still arrive at the same default, for example two associated functions
//! without a receiver, of two types in one module. Each expansion therefore carries a [`Site`]
//! (its file, line and column); the first call from a site registers its scope, and a call from
//! another site with the same scope fails with [`Error::ScopeCollision`] before it claims
//! anything. The check covers one process; across processes, name the scope explicitly.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use crate::Error;

/// The default scope of a function without a receiver: `module_path` and `name`, dotted.
#[doc(hidden)]
#[must_use]
pub fn fn_scope(module_path: &str, name: &str) -> String {
    dotted([module_path, name])
}

/// The default scope of a method with a receiver: the `Self` type's path and `name`, dotted.
#[doc(hidden)]
#[must_use]
pub fn method_scope<T: ?Sized>(name: &str) -> String {
    dotted([std::any::type_name::<T>(), name])
}

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

/// Where an `#[idempotent]` function is defined; one `static` per expansion.
#[doc(hidden)]
#[derive(Debug)]
pub struct Site {
    location: &'static str,
    /// The scope this site registered first: later calls with it skip the registry.
    registered: OnceLock<Box<str>>,
}

/// Which site registered each scope in this process.
static REGISTRY: Mutex<Option<HashMap<Box<str>, &'static str>>> = Mutex::new(None);

impl Site {
    /// A site at `location` (`file:line:column`).
    #[must_use]
    pub const fn new(location: &'static str) -> Self {
        Site { location, registered: OnceLock::new() }
    }

    /// Registers `scope` for this site, or reports the other site that uses it.
    pub(crate) fn check(&'static self, scope: &str) -> Result<(), Error> {
        if self.registered.get().is_some_and(|registered| **registered == *scope) {
            return Ok(());
        }
        let mut registry = REGISTRY.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let owner = *registry.get_or_insert_with(HashMap::new).entry(scope.into()).or_insert(self.location);
        drop(registry);
        if owner != self.location {
            return Err(Error::ScopeCollision {
                scope: scope.to_owned(),
                first: owner.to_owned(),
                second: self.location.to_owned(),
            });
        }
        let _ = self.registered.set(scope.into());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Orders;

    #[test]
    fn memory_default_scopes_are_dotted_paths() {
        assert_eq!(fn_scope("shop::payments", "pay"), "shop.payments.pay");
        assert_eq!(method_scope::<Orders>("create"), format!("{}.Orders.create", module_path!().replace("::", ".")));
        assert!(crate::Key::new(&fn_scope(module_path!(), "pay"), &"k").is_ok());
    }

    #[test]
    fn memory_sites_refuse_a_scope_another_site_registered() {
        static FIRST: Site = Site::new("a.rs:1:1");
        static SECOND: Site = Site::new("b.rs:2:2");
        FIRST.check("scope-test.shared").unwrap();
        FIRST.check("scope-test.shared").unwrap();
        let Err(Error::ScopeCollision { scope, first, second }) = SECOND.check("scope-test.shared") else {
            panic!("a second site was allowed the same scope")
        };
        assert_eq!((scope.as_str(), first.as_str(), second.as_str()), ("scope-test.shared", "a.rs:1:1", "b.rs:2:2"));
        SECOND.check("scope-test.other").unwrap();
    }
}
