//! Compile-time behaviour of the macros: the errors users see when they get something
//! wrong (`ui/derive`, `ui/transactional`). Regenerate the expected `.stderr` files with
//! `TRYBUILD=overwrite cargo test -p outbox-macros-ui --test ui` and read every one: the
//! message must tell a user what to do. What compiles (`ui/pass`) are test targets of
//! their own (Cargo.toml): only `compile_fail` cases here, so that trybuild checks its
//! dependencies instead of building them, and checks every case in one cargo run.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("ui/derive/*.rs");
    t.compile_fail("ui/transactional/*.rs");
}
