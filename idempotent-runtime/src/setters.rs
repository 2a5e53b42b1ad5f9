//! `setters!`: builder methods that each set one field and return the builder.

/// Writes, for each item, `$vis fn $name(mut self, $arg: $ty) -> Self { self.$field = $value; self }`
/// (or `self.$fields().$field = ...` after `in $fields:`), with the item's attributes (its docs),
/// marked `#[must_use]`. An item is `fn $name($field: $ty);` (the field of the argument's name set
/// to it) or `fn $name($arg: $ty) { $field = $value }` (set to an expression of the argument, or
/// of none: `fn $name() { $field = $value }`). A setter that checks its argument is written by
/// hand beside them.
macro_rules! setters {
    (@items [$($fields:ident)?]) => {};
    (@items [$($fields:ident)?] $(#[$attr:meta])* $vis:vis fn $name:ident($field:ident: $ty:ty); $($rest:tt)*) => {
        $crate::setters::setters!(@items [$($fields)?] $(#[$attr])* $vis fn $name($field: $ty) { $field = $field } $($rest)*);
    };
    (@items [$($fields:ident)?]
        $(#[$attr:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty)?) { $field:ident = $value:expr } $($rest:tt)*
    ) => {
        $(#[$attr])*
        #[must_use = "a setter returns the changed builder"]
        $vis fn $name(mut self $(, $arg: $ty)?) -> Self {
            self$(.$fields())?.$field = $value;
            self
        }
        $crate::setters::setters!(@items [$($fields)?] $($rest)*);
    };
    // The fields live behind `self.$fields()` (a shared configuration made unique on write).
    (in $fields:ident: $($items:tt)*) => {
        $crate::setters::setters!(@items [$fields] $($items)*);
    };
    ($($items:tt)*) => {
        $crate::setters::setters!(@items [] $($items)*);
    };
}
pub(crate) use setters;
