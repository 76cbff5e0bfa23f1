//! Code shared by the runnable examples and their tests.
#![warn(missing_docs)]

pub mod orders;
