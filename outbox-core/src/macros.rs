//! The crate's own `macro_rules!`, declared before every other module so that all of
//! them can use these.

/// The old paths of public types that moved, kept for one release as deprecated aliases
/// (the developers' guide; CHANGELOG.md lists each under **Breaking**). Each line names
/// the type, the module it moved to (`crate::<module>::<Type>`, same name) and the
/// deprecation note the compiler shows (a literal: `deprecated` takes no macro); its
/// attributes (a `cfg`, more doc) go on the alias.
///
/// ```ignore
/// moved! {
///     #[cfg(feature = "postgres")]
///     Health => postgres, "moved to `outbox_core::postgres::Health`";
/// }
/// ```
macro_rules! moved {
    ($($(#[$attr:meta])* $name:ident => $module:ident, $note:literal;)*) => {$(
        #[doc = concat!(
            "Moved: [`outbox_core::", stringify!($module), "::", stringify!($name), "`](crate::",
            stringify!($module), "::", stringify!($name), ")."
        )]
        $(#[$attr])*
        #[deprecated(since = "0.2.0", note = $note)]
        pub type $name = crate::$module::$name;
    )*};
}

/// Builder methods that each set the field named as the method and return the builder:
/// a field of `self`, or with `config:` first, of `self.config`. `name(arg: Type)` stores
/// `arg`; `name(arg: Type) => value` stores `value` (the argument bounded or converted).
///
/// ```ignore
/// setters! { config:
///     /// Rows per batch (at least 1).
///     batch_size(n: usize) => n.max(1);
/// }
/// ```
macro_rules! setters {
    (@value $arg:ident) => { $arg };
    (@value $arg:ident, $value:expr) => { $value };
    (@field $this:ident [] $name:ident) => { $this.$name };
    (@field $this:ident [$path:ident] $name:ident) => { $this.$path.$name };
    (@in $path:tt $($(#[$attr:meta])* $name:ident($arg:ident: $ty:ty) $(=> $value:expr)?;)*) => {$(
        $(#[$attr])*
        pub fn $name(mut self, $arg: $ty) -> Self {
            setters!(@field self $path $name) = setters!(@value $arg $(, $value)?);
            self
        }
    )*};
    (config: $($setters:tt)*) => { setters!(@in [config] $($setters)*); };
    ($($setters:tt)*) => { setters!(@in [] $($setters)*); };
}

/// The methods of a handle to a spawned task, on its `task` field (a
/// [`TaskHandle`](crate::task::TaskHandle)): `shutdown`, `abort` and `is_finished`, each
/// with the docs given (what it means for that task).
macro_rules! controls_task {
    (
        $(#[$shutdown:meta])* shutdown;
        $(#[$abort:meta])* abort;
        $(#[$finished:meta])* is_finished;
    ) => {
        $(#[$shutdown])*
        pub async fn shutdown(self) {
            self.task.shutdown().await;
        }

        $(#[$abort])*
        pub fn abort(&self) {
            self.task.abort();
        }

        $(#[$finished])*
        pub fn is_finished(&self) -> bool {
            self.task.is_finished()
        }
    };
}
