//! `setters!`: builder methods that each set one field to their argument and return the builder.

/// Writes `$vis fn $name(mut self, $field: $ty) -> Self { self.$field = $field; self }` (or
/// `self.$fields().$field = ...` after `in $fields:`) for each line, with the line's attributes (its docs), marked `#[must_use]`. A setter that checks or
/// converts its argument is written by hand beside them.
macro_rules! setters {
    ($($(#[$attr:meta])* $vis:vis fn $name:ident($field:ident: $ty:ty);)+) => {$(
        $(#[$attr])*
        #[must_use = "a setter returns the changed builder"]
        $vis fn $name(mut self, $field: $ty) -> Self {
            self.$field = $field;
            self
        }
    )+};
    // The fields live behind `self.$fields()` (a shared configuration made unique on write).
    (in $fields:ident: $($(#[$attr:meta])* $vis:vis fn $name:ident($field:ident: $ty:ty);)+) => {$(
        $(#[$attr])*
        #[must_use = "a setter returns the changed builder"]
        $vis fn $name(mut self, $field: $ty) -> Self {
            self.$fields().$field = $field;
            self
        }
    )+};
}
pub(crate) use setters;
