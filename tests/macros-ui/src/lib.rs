//! Nothing here: the tests in `tests/ui.rs` compile the files under `ui/` with trybuild.
