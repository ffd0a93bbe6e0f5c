//! Integration tests against the real local stack (`scripts/test` brings it
//! up). One binary; a module per area.

mod support;

mod check;
mod connector;
mod dlq;
mod event_sourcing;
mod exactly_once;
mod faults;
mod identifiers;
mod incremental;
mod ledger;
mod materialize;
mod operator;
mod partitioning;
mod registry;
mod retention;
mod security;
mod slot;
mod tls;
mod types;
mod validate;
