//! The admin server of `pgcdc run` and `pgcdc materialize` (`--http-addr`).
//!
//! Guarantee: it only reads. `/healthz` answers 200 while the process
//! serves at all (liveness); `/readyz` answers 200 only while streaming or
//! consuming, and 503 with the phase otherwise (see [`super::board`]);
//! `/metrics` is the Prometheus exposition; `/status` and `/` show the
//! same figures as JSON and as a page. Nothing it serves holds a row value
//! or a secret: it is built from metrics and names alone.
//!
//! ```text
//!  GET /metrics  ──► exporter.render()
//!  GET /healthz  ──► 200 "ok"
//!  GET /readyz   ──► phase ready? 200 : 503
//!  GET /status   ──► board.status() as JSON
//!  GET /         ──► page::render(board.status())
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;

use super::board::{self, Board, Role};
use crate::config::Config;

#[derive(Clone)]
struct Admin {
    metrics: PrometheusHandle,
    board: Arc<Board>,
}

/// Installs the metrics recorder, starts sampling it, and serves the admin
/// endpoints on `addr`. Fails at once when the address cannot be bound.
pub async fn start(addr: SocketAddr, role: Role, config: &Config) -> Result<(), String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("--http-addr {addr}: cannot listen: {e}"))?;
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
    super::describe();
    super::Alert::reset_for(role);
    let board = Arc::new(Board::new(role, config));
    Board::install(board.clone());
    tokio::spawn(sample(metrics.clone(), board.clone()));
    let app = router(Admin { metrics, board });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the admin server stopped");
        }
    });
    tracing::info!(%addr, "admin server at http://{addr}/ (metrics, healthz, readyz, status)");
    Ok(())
}

/// Renders the exporter into the board's history every
/// [`board::SAMPLE_EVERY`]; also drains the summaries' buckets, which an
/// exporter without its own listener leaves to its owner.
async fn sample(metrics: PrometheusHandle, board: Arc<Board>) {
    let mut tick = tokio::time::interval(board::SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        metrics.run_upkeep();
        board.record(&metrics.render());
    }
}

fn router(admin: Admin) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/metrics", get(prometheus))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .with_state(admin)
}

async fn prometheus(State(a): State<Admin>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        a.metrics.render(),
    )
        .into_response()
}

async fn readyz() -> Response {
    let phase = board::phase();
    if phase.is_ready() {
        (StatusCode::OK, format!("ready: {}\n", phase.as_str())).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", phase.as_str()),
        )
            .into_response()
    }
}

async fn status(State(a): State<Admin>) -> Response {
    axum::Json(a.board.status()).into_response()
}

async fn page(State(a): State<Admin>) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        super::page::render(&a.board.status()),
    )
        .into_response()
}
