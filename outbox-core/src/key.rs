//! [`PartitionKey`]: what a field named by `#[outbox(key = ...)]` must be.

use std::borrow::Cow;
use std::rc::Rc;
use std::sync::Arc;

use uuid::Uuid;

/// A value that can be an event's partition key: events with the same key are published
/// in the order they were written.
///
/// `#[derive(OutboxEvent)]` converts the field named by `#[outbox(key = field)]` with this
/// trait. It is implemented for `String`, `str`, all integer types, `bool`, `char`,
/// [`Uuid`], references and smart pointers (`&T`, `Box<T>`, `Arc<T>`, `Rc<T>`, `Cow<T>`)
/// to those, and `Option<T>`, where `None` means "no key". Implement it for your own id
/// types:
///
/// ```
/// use outbox_core::PartitionKey;
///
/// struct OrderId(u64);
///
/// impl PartitionKey for OrderId {
///     fn to_partition_key(&self) -> Option<String> {
///         Some(format!("order-{}", self.0))
///     }
/// }
/// assert_eq!(OrderId(7).to_partition_key().as_deref(), Some("order-7"));
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be used as an outbox partition key",
    label = "the field named by `#[outbox(key = ...)]` has type `{Self}`, which does not implement `outbox::PartitionKey`",
    note = "pick a field of type String, &str, an integer, bool, char or uuid::Uuid (or an Option of one), \
            or implement `outbox::PartitionKey` for `{Self}`"
)]
pub trait PartitionKey {
    /// The key as text, or `None` for "no key".
    fn to_partition_key(&self) -> Option<String>;
}

impl PartitionKey for str {
    fn to_partition_key(&self) -> Option<String> {
        Some(self.to_owned())
    }
}

impl PartitionKey for String {
    fn to_partition_key(&self) -> Option<String> {
        Some(self.clone())
    }
}

macro_rules! display_keys {
    ($($ty:ty),* $(,)?) => {$(
        impl PartitionKey for $ty {
            fn to_partition_key(&self) -> Option<String> {
                Some(self.to_string())
            }
        }
    )*};
}

display_keys!(
    i8, i16, i32, i64, i128, isize, u8, u16, u32, u64, u128, usize, bool, char, Uuid
);

impl<T: PartitionKey + ?Sized> PartitionKey for &T {
    fn to_partition_key(&self) -> Option<String> {
        (**self).to_partition_key()
    }
}

impl<T: PartitionKey + ?Sized> PartitionKey for &mut T {
    fn to_partition_key(&self) -> Option<String> {
        (**self).to_partition_key()
    }
}

impl<T: PartitionKey + ?Sized> PartitionKey for Box<T> {
    fn to_partition_key(&self) -> Option<String> {
        (**self).to_partition_key()
    }
}

impl<T: PartitionKey + ?Sized> PartitionKey for Arc<T> {
    fn to_partition_key(&self) -> Option<String> {
        (**self).to_partition_key()
    }
}

impl<T: PartitionKey + ?Sized> PartitionKey for Rc<T> {
    fn to_partition_key(&self) -> Option<String> {
        (**self).to_partition_key()
    }
}

impl<T: PartitionKey + ToOwned + ?Sized> PartitionKey for Cow<'_, T> {
    fn to_partition_key(&self) -> Option<String> {
        (**self).to_partition_key()
    }
}

impl<T: PartitionKey> PartitionKey for Option<T> {
    fn to_partition_key(&self) -> Option<String> {
        self.as_ref().and_then(PartitionKey::to_partition_key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert_eq!("a".to_partition_key().as_deref(), Some("a"));
        assert_eq!(String::from("b").to_partition_key().as_deref(), Some("b"));
        assert_eq!((-3_i64).to_partition_key().as_deref(), Some("-3"));
        assert_eq!(u128::MAX.to_partition_key(), Some(u128::MAX.to_string()));
        assert_eq!(true.to_partition_key().as_deref(), Some("true"));
        assert_eq!('x'.to_partition_key().as_deref(), Some("x"));
        let id = Uuid::now_v7();
        assert_eq!(id.to_partition_key(), Some(id.to_string()));
        assert_eq!(Some(5_u8).to_partition_key().as_deref(), Some("5"));
        assert_eq!(None::<u8>.to_partition_key(), None);
        assert_eq!(Some(None::<String>).to_partition_key(), None);
        assert_eq!(Box::new(1_u8).to_partition_key().as_deref(), Some("1"));
        assert_eq!(
            Arc::<str>::from("s").to_partition_key().as_deref(),
            Some("s")
        );
        assert_eq!(Rc::new(2_i8).to_partition_key().as_deref(), Some("2"));
        assert_eq!(Cow::Borrowed("c").to_partition_key().as_deref(), Some("c"));
        assert_eq!((&&7_u16).to_partition_key().as_deref(), Some("7"));
    }
}
