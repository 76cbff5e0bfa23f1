//! Every shape the derive accepts, with `#![no_implicit_prelude]`-style paranoia:
//! generated code must not rely on names in the user's scope.
#![no_implicit_prelude]
// A test target of the workspace: its `extern crate`s are what a crate without the
// implicit prelude writes, and its types exist only for the derive.
#![allow(unused_extern_crates, missing_debug_implementations)]

extern crate outbox_core;
extern crate serde;
extern crate std;

use outbox_core::OutboxEvent;
use std::string::String;

outbox_core::destinations! {
    pub ORDER_EVENTS = "orders.events";
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = ORDER_EVENTS, key = id, version = 0)]
pub struct Named {
    id: String,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = self::ORDER_EVENTS, key = 0)]
pub struct Tuple(u8, bool);

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "unit")]
pub struct Unit;

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "generic", key = key)]
pub struct Generic<'a, K, T, const N: usize>
where
    T: std::fmt::Debug,
{
    key: &'a K,
    values: std::vec::Vec<T>,
    size: std::marker::PhantomData<[(); N]>,
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "enum", key = id)]
pub enum WithSharedKey<T> {
    A {
        id: T,
    },
    #[outbox(key = 1, event_type = "b.v2", version = 2)]
    B(String, char),
}

#[derive(serde::Serialize, OutboxEvent)]
#[outbox(destination = "empty")]
pub enum Empty {}

fn main() {
    fn assert_event<E: OutboxEvent>() {}
    assert_event::<Named>();
    assert_event::<Tuple>();
    assert_event::<Unit>();
    assert_event::<Generic<'static, u64, i32, 3>>();
    assert_event::<WithSharedKey<i64>>();
    assert_event::<Empty>();
    fn local_type() {
        #[derive(serde::Serialize, OutboxEvent)]
        #[outbox(destination = "local")]
        struct InsideAFunction;
        let _ = OutboxEvent::event_type(&InsideAFunction);
    }
    local_type();
}
