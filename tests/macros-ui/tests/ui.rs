//! Compile-time behaviour of the macros: what compiles (`ui/pass`) and the errors users
//! see when they get something wrong (`ui/derive`, `ui/transactional`). Regenerate the
//! expected `.stderr` files with `TRYBUILD=overwrite cargo test -p outbox-macros-ui --test ui`
//! and read every one: the message must tell a user what to do.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("ui/pass/*.rs");
    t.compile_fail("ui/derive/*.rs");
    t.compile_fail("ui/transactional/*.rs");
}
