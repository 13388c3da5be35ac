//! Integration tests: one binary (one link), a module per capability.

mod helpers;

mod configuration;
mod forwarding;
mod limiting;
mod stores;
