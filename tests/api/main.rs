//! Integration tests: one binary (one link), a module per capability.

mod helpers;

mod admin;
mod admin_limits;
mod admin_redis;
mod breaker;
mod catalog;
mod cluster;
mod configuration;
mod costs;
mod durability;
mod edge_http;
mod failed_keys;
mod faults;
mod forwarding;
mod key_lifecycle;
mod key_sources;
mod limiting;
mod operating;
mod outage_start;
mod overload;
mod own_view;
mod paths;
mod plans;
mod public;
mod quotas;
mod regions;
mod reload;
mod resilience;
mod shadow;
mod slow_redis;
mod stopping;
mod stores;
mod swagger_ui;
mod traces;
mod upstreams;
