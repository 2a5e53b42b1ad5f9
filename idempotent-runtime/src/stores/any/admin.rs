//! [`Admin`] for [`AnyStore`]: the operator's methods of the store it holds, if it has them.
//!
//! A store opened by [`AnyStore::from_url`] keeps its admin; one wrapped with [`AnyStore::new`] has none, since `Admin` is not
//! part of `Store`: wrap it with [`AnyStore::with_admin`] instead. Without one, every method
//! fails with [`StoreError::Rejected`] saying so.

use std::sync::Arc;

use super::{AnyStore, BoxFuture};
use crate::admin::{Admin, Entry, ListQuery, Page, Released, Stats};
use crate::{Key, StoreError};

/// [`Admin`] in object-safe form, implemented for every `Admin`.
pub(super) trait ErasedAdmin: Send + Sync {
    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Entry>, StoreError>>;
    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<Page, StoreError>>;
    fn release<'a>(&'a self, key: &'a Key, seen: &'a Entry) -> BoxFuture<'a, Result<Released, StoreError>>;
    fn stats(&self) -> BoxFuture<'_, Result<Stats, StoreError>>;
}

impl<A: Admin> ErasedAdmin for A {
    fn inspect<'a>(&'a self, key: &'a Key) -> BoxFuture<'a, Result<Option<Entry>, StoreError>> {
        Box::pin(Admin::inspect(self, key))
    }

    fn list<'a>(&'a self, query: &'a ListQuery) -> BoxFuture<'a, Result<Page, StoreError>> {
        Box::pin(Admin::list(self, query))
    }

    fn release<'a>(&'a self, key: &'a Key, seen: &'a Entry) -> BoxFuture<'a, Result<Released, StoreError>> {
        Box::pin(Admin::release(self, key, seen))
    }

    fn stats(&self) -> BoxFuture<'_, Result<Stats, StoreError>> {
        Box::pin(Admin::stats(self))
    }
}

impl AnyStore {
    fn admin(&self) -> Result<&Arc<dyn ErasedAdmin>, StoreError> {
        self.admin.as_ref().ok_or_else(|| {
            StoreError::rejected(
                "any",
                format!(
                    "the store {} was wrapped without its admin methods (use AnyStore::with_admin), or has none",
                    self.type_name()
                ),
            )
        })
    }

    /// `true` if this store has the operator's methods of [`Admin`].
    #[must_use]
    pub fn has_admin(&self) -> bool {
        self.admin.is_some()
    }
}

impl Admin for AnyStore {
    async fn inspect(&self, key: &Key) -> Result<Option<Entry>, StoreError> {
        self.admin()?.inspect(key).await
    }

    async fn list(&self, query: &ListQuery) -> Result<Page, StoreError> {
        self.admin()?.list(query).await
    }

    async fn release(&self, key: &Key, seen: &Entry) -> Result<Released, StoreError> {
        self.admin()?.release(key, seen).await
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        self.admin()?.stats().await
    }
}
