//! The REST API, as Confluent's clients call it.
//!
//! Request bodies are read as JSON whatever their content type (clients send
//! `application/vnd.schemaregistry.v1+json`, `application/json` or
//! `application/octet-stream`); responses are always
//! `application/vnd.schemaregistry.v1+json`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine;
use serde::Deserialize;
use serde_json::{json, Value};

use super::compat::{self, Level, ParsedSchema};
use super::store::{Store, SubjectVersion, VersionSpec};
use super::RegistryError;
use crate::secret::Secret;

pub const CONTENT_TYPE: &str = "application/vnd.schemaregistry.v1+json";

/// Credentials accepted by basic auth; the password never prints.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub username: String,
    pub password: Secret,
}

impl Credentials {
    /// Parses `user:password`.
    pub fn parse(text: &str) -> Option<Credentials> {
        let (user, password) = text.trim().split_once(':')?;
        (!user.is_empty()).then(|| Credentials {
            username: user.to_string(),
            password: Secret::new(password),
        })
    }
}

#[derive(Debug)]
struct AppState {
    store: Store,
    users: Vec<Credentials>,
}

type Shared = State<Arc<AppState>>;
type ApiResult = Result<Response, RegistryError>;

pub fn json_body(v: &Value) -> Response {
    let mut response = v.to_string().into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    response
}

fn ok(v: Value) -> ApiResult {
    Ok(json_body(&v))
}

/// The full router over a store; with `users` empty, no auth is required.
pub fn router(store: Store, users: Vec<Credentials>) -> Router {
    let state = Arc::new(AppState { store, users });
    Router::new()
        .route("/", get(|| async { json_body(&json!({})) }))
        .route(
            "/schemas/types",
            get(|| async { json_body(&json!(["AVRO"])) }),
        )
        .route("/schemas/ids/{id}", get(schema_by_id))
        .route("/schemas/ids/{id}/schema", get(raw_schema_by_id))
        .route("/schemas/ids/{id}/versions", get(versions_of_id))
        .route("/subjects", get(list_subjects))
        .route("/subjects/{subject}", post(lookup).delete(delete_subject))
        .route(
            "/subjects/{subject}/versions",
            get(list_versions).post(register),
        )
        .route(
            "/subjects/{subject}/versions/{version}",
            get(get_version).delete(delete_version),
        )
        .route(
            "/subjects/{subject}/versions/{version}/schema",
            get(get_raw_version),
        )
        .route("/config", get(get_global_config).put(put_global_config))
        .route(
            "/config/{subject}",
            get(get_subject_config)
                .put(put_subject_config)
                .delete(delete_subject_config),
        )
        .route(
            "/compatibility/subjects/{subject}/versions",
            post(test_against_level),
        )
        .route(
            "/compatibility/subjects/{subject}/versions/{version}",
            post(test_against_version),
        )
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                json_body(&json!({"error_code": 404, "message": "HTTP 404 Not Found"})),
            )
        })
        .layer(middleware::from_fn_with_state(state.clone(), authenticate))
        .with_state(state)
}

/// Serves until SIGINT or SIGTERM.
pub async fn serve(
    listen: SocketAddr,
    store: Store,
    users: Vec<Credentials>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    tracing::info!(%listen, auth = !users.is_empty(), "schema registry listening");
    axum::serve(listener, router(store, users))
        .with_graceful_shutdown(crate::shutdown_signal())
        .await
}

async fn authenticate(State(state): Shared, request: Request, next: Next) -> Response {
    if state.users.is_empty() {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b64| {
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .ok()
        })
        .and_then(|raw| String::from_utf8(raw).ok())
        .and_then(|text| Credentials::parse(&text));
    let allowed = given.is_some_and(|g| {
        state.users.iter().any(|u| {
            u.username == g.username && constant_time_eq(u.password.expose(), g.password.expose())
        })
    });
    if allowed {
        next.run(request).await
    } else {
        RegistryError::Unauthorized.into_response()
    }
}

fn constant_time_eq(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SchemaRequest {
    schema: String,
    #[serde(default)]
    schema_type: Option<String>,
    #[serde(default)]
    references: Option<Vec<Value>>,
}

/// Reads a `{"schema": ...}` body and parses the schema in it.
fn schema_from_body(body: &Bytes) -> Result<ParsedSchema, RegistryError> {
    let request: SchemaRequest = serde_json::from_slice(body)
        .map_err(|e| RegistryError::BadRequest(format!("Invalid request body: {e}")))?;
    match request.schema_type.as_deref() {
        None | Some("AVRO") => {}
        Some(other) => {
            return Err(RegistryError::InvalidSchema(format!(
                "Schema type {other} is not supported; this registry serves AVRO"
            )))
        }
    }
    if request.references.is_some_and(|r| !r.is_empty()) {
        return Err(RegistryError::InvalidSchema(
            "Schema references are not supported".to_string(),
        ));
    }
    compat::parse(&request.schema).map_err(RegistryError::InvalidSchema)
}

fn flag(query: &HashMap<String, String>, name: &str) -> bool {
    query
        .get(name)
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

fn parse_id(text: &str) -> Result<i32, RegistryError> {
    text.parse::<i32>()
        .map_err(|_| RegistryError::SchemaNotFound)
}

fn version_json(v: &SubjectVersion) -> Value {
    json!({"subject": v.subject, "version": v.version, "id": v.id, "schema": v.schema})
}

async fn schema_by_id(State(s): Shared, Path(id): Path<String>) -> ApiResult {
    let (schema_type, schema) = s.store.schema_by_id(parse_id(&id)?).await?;
    if schema_type == "AVRO" {
        ok(json!({ "schema": schema }))
    } else {
        ok(json!({ "schema": schema, "schemaType": schema_type }))
    }
}

async fn raw_schema_by_id(State(s): Shared, Path(id): Path<String>) -> ApiResult {
    let (_, schema) = s.store.schema_by_id(parse_id(&id)?).await?;
    raw(schema)
}

fn raw(schema: String) -> ApiResult {
    let mut response = schema.into_response();
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    Ok(response)
}

async fn versions_of_id(State(s): Shared, Path(id): Path<String>) -> ApiResult {
    let usages = s.store.usages_of_id(parse_id(&id)?).await?;
    ok(Value::Array(
        usages
            .into_iter()
            .map(|(subject, version)| json!({"subject": subject, "version": version}))
            .collect(),
    ))
}

async fn list_subjects(State(s): Shared, Query(q): Query<HashMap<String, String>>) -> ApiResult {
    ok(json!(s.store.subjects(flag(&q, "deleted")).await?))
}

async fn list_versions(
    State(s): Shared,
    Path(subject): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    ok(json!(
        s.store.versions(&subject, flag(&q, "deleted")).await?
    ))
}

async fn register(State(s): Shared, Path(subject): Path<String>, body: Bytes) -> ApiResult {
    let schema = schema_from_body(&body)?;
    let (id, created) = s.store.register(&subject, &schema).await?;
    if created {
        tracing::info!(subject = %subject, id, "schema registered");
    }
    ok(json!({ "id": id }))
}

async fn lookup(
    State(s): Shared,
    Path(subject): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> ApiResult {
    let schema = schema_from_body(&body)?;
    let found = s
        .store
        .lookup(&subject, &schema, flag(&q, "deleted"))
        .await?;
    ok(version_json(&found))
}

async fn get_version(
    State(s): Shared,
    Path((subject, version)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let spec = VersionSpec::parse(&version)?;
    ok(version_json(
        &s.store.version(&subject, spec, flag(&q, "deleted")).await?,
    ))
}

async fn get_raw_version(
    State(s): Shared,
    Path((subject, version)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let spec = VersionSpec::parse(&version)?;
    raw(s
        .store
        .version(&subject, spec, flag(&q, "deleted"))
        .await?
        .schema)
}

async fn delete_subject(
    State(s): Shared,
    Path(subject): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let permanent = flag(&q, "permanent");
    let versions = s.store.delete_subject(&subject, permanent).await?;
    tracing::info!(subject = %subject, permanent, "subject deleted");
    ok(json!(versions))
}

async fn delete_version(
    State(s): Shared,
    Path((subject, version)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let spec = VersionSpec::parse(&version)?;
    ok(json!(
        s.store
            .delete_version(&subject, spec, flag(&q, "permanent"))
            .await?
    ))
}

#[derive(Debug, Deserialize)]
struct LevelRequest {
    compatibility: String,
}

fn level_from_body(body: &Bytes) -> Result<Level, RegistryError> {
    let request: LevelRequest = serde_json::from_slice(body)
        .map_err(|e| RegistryError::BadRequest(format!("Invalid request body: {e}")))?;
    request
        .compatibility
        .parse()
        .map_err(RegistryError::InvalidLevel)
}

async fn get_global_config(State(s): Shared) -> ApiResult {
    let level = s.store.level(None).await?.unwrap_or(Level::Backward);
    ok(json!({ "compatibilityLevel": level.as_str() }))
}

async fn put_global_config(State(s): Shared, body: Bytes) -> ApiResult {
    let level = level_from_body(&body)?;
    s.store.set_level(None, level).await?;
    ok(json!({ "compatibility": level.as_str() }))
}

async fn get_subject_config(
    State(s): Shared,
    Path(subject): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult {
    let level = match s.store.level(Some(&subject)).await? {
        Some(level) => level,
        None if flag(&q, "defaultToGlobal") => {
            s.store.level(None).await?.unwrap_or(Level::Backward)
        }
        None => return Err(RegistryError::SubjectLevelNotConfigured(subject)),
    };
    ok(json!({ "compatibilityLevel": level.as_str() }))
}

async fn put_subject_config(
    State(s): Shared,
    Path(subject): Path<String>,
    body: Bytes,
) -> ApiResult {
    let level = level_from_body(&body)?;
    s.store.set_level(Some(&subject), level).await?;
    ok(json!({ "compatibility": level.as_str() }))
}

async fn delete_subject_config(State(s): Shared, Path(subject): Path<String>) -> ApiResult {
    let level = s.store.delete_level(&subject).await?;
    ok(json!({ "compatibilityLevel": level.as_str() }))
}

fn compatibility_answer(problems: Vec<String>, verbose: bool) -> ApiResult {
    if verbose {
        ok(json!({ "is_compatible": problems.is_empty(), "messages": problems }))
    } else {
        ok(json!({ "is_compatible": problems.is_empty() }))
    }
}

async fn test_against_version(
    State(s): Shared,
    Path((subject, version)): Path<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> ApiResult {
    let spec = VersionSpec::parse(&version)?;
    let schema = schema_from_body(&body)?;
    let problems = s
        .store
        .test_compatibility(&subject, Some(spec), &schema)
        .await?;
    compatibility_answer(problems, flag(&q, "verbose"))
}

async fn test_against_level(
    State(s): Shared,
    Path(subject): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    body: Bytes,
) -> ApiResult {
    let schema = schema_from_body(&body)?;
    let problems = s.store.test_compatibility(&subject, None, &schema).await?;
    compatibility_answer(problems, flag(&q, "verbose"))
}

/// Fuzzing: request parsing never panics, whatever the body.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// JSON built from Avro's schema vocabulary, nested.
    fn schemaish() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            proptest::sample::select(vec![
                "null", "boolean", "int", "long", "float", "double", "bytes", "string", "record",
                "enum", "array", "map", "fixed", "decimal", "uuid", "r", "a.b", "", "0",
            ])
            .prop_map(|s| json!(s)),
            any::<i64>().prop_map(|n| json!(n)),
            Just(json!(null)),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec(
                    (
                        proptest::sample::select(vec![
                            "type",
                            "name",
                            "namespace",
                            "fields",
                            "items",
                            "values",
                            "symbols",
                            "size",
                            "logicalType",
                            "precision",
                            "scale",
                            "default",
                            "aliases",
                        ]),
                        inner,
                    ),
                    0..5,
                )
                .prop_map(|kv| Value::Object(
                    kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
                )),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(5_000))]

        #[test]
        fn arbitrary_bodies_are_refused_or_parsed_without_panicking(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let body = Bytes::from(body);
            let _ = schema_from_body(&body);
            let _ = level_from_body(&body);
            let _ = Credentials::parse(&String::from_utf8_lossy(&body));
        }

        #[test]
        fn schema_shaped_bodies_are_refused_or_parsed_without_panicking(schema in schemaish()) {
            let body = Bytes::from(json!({ "schema": schema.to_string() }).to_string());
            let _ = schema_from_body(&body);
        }
    }
}
