//! `pgcdc registry`: a Confluent-compatible schema registry for Avro, kept
//! in Postgres.
//!
//! Guarantees: ids are global across subjects and stable across restarts;
//! registration is idempotent; every bad request gets Confluent's error
//! code and body (never a 500); a 500 (`50001`) means the store itself
//! failed. Basic-auth credentials are compared, never logged.
//!
//! ```text
//!  HTTP (axum) ──► api: parse path/body, auth ──► store: one transaction per write
//!                                                   │ advisory lock per subject
//!                                                   ▼
//!                                      compat: canonical form, Avro resolution
//! ```

pub mod api;
pub mod client;
pub mod compat;
pub mod store;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use store::VersionSpec;

/// Every outcome that is not a success, with its Confluent error code.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("Subject '{0}' not found.")]
    SubjectNotFound(String),
    #[error("Version {} not found.", match .1 { VersionSpec::Latest => "latest".to_string(), VersionSpec::Number(n) => n.to_string() })]
    VersionNotFound(String, VersionSpec),
    #[error("Schema not found")]
    SchemaNotFound,
    #[error("Subject '{0}' was soft deleted.Set permanent=true to delete permanently")]
    SubjectSoftDeleted(String),
    #[error("Subject '{0}' was not deleted first before being permanently deleted")]
    SubjectNotSoftDeleted(String),
    #[error("Subject '{0}' Version {1} was not deleted first before being permanently deleted")]
    VersionNotSoftDeleted(String, i32),
    #[error("Subject '{0}' does not have subject-level compatibility configured")]
    SubjectLevelNotConfigured(String),
    #[error("Schema being registered is incompatible with an earlier schema for subject; details: {}", .0.join("; "))]
    Incompatible(Vec<String>),
    #[error("{0}")]
    InvalidSchema(String),
    #[error("The specified version '{0}' is not a valid version id. Allowed values are between [1, 2^31-1] and the string \"latest\"")]
    InvalidVersion(String),
    #[error("{0}")]
    InvalidLevel(String),
    #[error("{0}")]
    BadRequest(String),
    #[error("Unauthorized")]
    Unauthorized,
    #[error("Store error: {0}")]
    Store(String),
}

impl RegistryError {
    /// Confluent's `error_code` and the HTTP status it travels with.
    pub fn code(&self) -> (u32, StatusCode) {
        use RegistryError::*;
        match self {
            SubjectNotFound(_) => (40401, StatusCode::NOT_FOUND),
            VersionNotFound(..) => (40402, StatusCode::NOT_FOUND),
            SchemaNotFound => (40403, StatusCode::NOT_FOUND),
            SubjectSoftDeleted(_) => (40404, StatusCode::NOT_FOUND),
            SubjectNotSoftDeleted(_) => (40405, StatusCode::NOT_FOUND),
            VersionNotSoftDeleted(..) => (40407, StatusCode::NOT_FOUND),
            SubjectLevelNotConfigured(_) => (40408, StatusCode::NOT_FOUND),
            Incompatible(_) => (409, StatusCode::CONFLICT),
            InvalidSchema(_) => (42201, StatusCode::UNPROCESSABLE_ENTITY),
            InvalidVersion(_) => (42202, StatusCode::UNPROCESSABLE_ENTITY),
            InvalidLevel(_) => (42203, StatusCode::UNPROCESSABLE_ENTITY),
            BadRequest(_) => (400, StatusCode::BAD_REQUEST),
            Unauthorized => (40101, StatusCode::UNAUTHORIZED),
            Store(_) => (50001, StatusCode::INTERNAL_SERVER_ERROR),
        }
    }
}

impl IntoResponse for RegistryError {
    fn into_response(self) -> Response {
        let (code, status) = self.code();
        if let RegistryError::Store(e) = &self {
            tracing::error!(error = %e, "registry store failed");
        }
        let mut response = (
            status,
            api::json_body(&serde_json::json!({ "error_code": code, "message": self.to_string() })),
        )
            .into_response();
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                axum::http::header::WWW_AUTHENTICATE,
                axum::http::HeaderValue::from_static("Basic realm=\"pgcdc-registry\""),
            );
        }
        response
    }
}
