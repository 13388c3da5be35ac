//! Integration tests: one binary (one link), a module per capability.

mod helpers;

mod admin;
mod cluster;
mod configuration;
mod forwarding;
mod limiting;
mod regions;
mod resilience;
mod slow_redis;
mod stores;
mod swagger_ui;
