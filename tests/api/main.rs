//! Integration tests: one binary (one link), a module per capability.

mod helpers;

mod admin;
mod configuration;
mod forwarding;
mod limiting;
mod resilience;
mod stores;
mod swagger_ui;
