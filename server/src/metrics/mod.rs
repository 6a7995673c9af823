//! Prometheus metrics: operation counts and latency histograms per operation type, connections,
//! bytes, and the pool's own occupancy and counters, in the OpenMetrics text format (encoded by
//! `prometheus-client`), served over HTTP on `GET /metrics` by hyper. Per-namespace series name the
//! tenants, so they are shown only as `listen.metrics_namespaces` allows.
//!
//! - `series`: what the daemon counts, by label ([`Metrics`]);
//! - `scrape`: one scrape of the page, the daemon's series and the pool's snapshot encoded;
//! - `http`: the page served over HTTP (hyper).

mod http;
mod scrape;
mod series;

pub(crate) use crate::ledger::Limit;
pub(crate) use http::serve;
pub(crate) use series::PeerTraffic;
pub use series::{HandoffFailure, Metrics, OpKind, ReapCause, RespCommand, Transport};
