//! A client of any Confluent-compatible registry (ours, Confluent's,
//! Karapace, Apicurio's compatibility API).
//!
//! Guarantee: schemas are registered explicitly on every new table shape,
//! never through a cache keyed by subject alone, so a schema change always
//! reaches the registry and its compatibility check before anything is
//! produced with it.

use serde_json::{json, Value};

use crate::config::RegistryConfig;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The registry refused the schema under the subject's compatibility
    /// level: a data error for that table, not a retryable one.
    #[error("subject {subject}: schema refused as incompatible: {message}")]
    Incompatible { subject: String, message: String },
    #[error("subject {subject}: registry answered {status}: {message}")]
    Refused {
        subject: String,
        status: u16,
        message: String,
    },
    #[error("registry unreachable: {0}")]
    Unreachable(String),
}

impl ClientError {
    /// The registry's HTTP status (`None` when it could not be reached),
    /// for [`crate::dlq::classify`].
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Incompatible { .. } => Some(409),
            ClientError::Refused { status, .. } => Some(*status),
            ClientError::Unreachable(_) => None,
        }
    }
}

#[derive(Debug, Clone)]
pub struct RegistryClient {
    http: reqwest::Client,
    config: RegistryConfig,
}

impl RegistryClient {
    pub fn new(config: &RegistryConfig) -> Result<RegistryClient, ClientError> {
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .map_err(|e| ClientError::Unreachable(e.without_url().to_string()))?;
        Ok(RegistryClient {
            http,
            config: config.clone(),
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let url = format!("{}{path}", self.config.url.expose().trim_end_matches('/'));
        let request = self.http.request(method, url);
        match &self.config.username {
            Some(user) => {
                request.basic_auth(user, self.config.password.as_ref().map(|p| p.expose()))
            }
            None => request,
        }
    }

    /// The schema text of a global id.
    pub async fn schema_by_id(&self, id: u32) -> Result<String, ClientError> {
        let response = self
            .request(reqwest::Method::GET, &format!("/schemas/ids/{id}"))
            .send()
            .await
            .map_err(|e| ClientError::Unreachable(e.without_url().to_string()))?;
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        match body["schema"].as_str() {
            Some(s) if status == 200 => Ok(s.to_string()),
            _ => Err(ClientError::Refused {
                subject: format!("schema id {id}"),
                status,
                message: body["message"].as_str().unwrap_or_default().to_string(),
            }),
        }
    }

    /// The latest version of `subject`: its id and schema text; `None`
    /// when the subject does not exist (yet).
    pub async fn latest(&self, subject: &str) -> Result<Option<(u32, String)>, ClientError> {
        let response = self
            .request(
                reqwest::Method::GET,
                &format!("/subjects/{subject}/versions/latest"),
            )
            .send()
            .await
            .map_err(|e| ClientError::Unreachable(e.without_url().to_string()))?;
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        if status == 404 {
            return Ok(None);
        }
        match (body["id"].as_u64(), body["schema"].as_str()) {
            (Some(id), Some(schema)) if status == 200 => {
                Ok(u32::try_from(id).ok().map(|id| (id, schema.to_string())))
            }
            _ => Err(ClientError::Refused {
                subject: subject.to_string(),
                status,
                message: body["message"].as_str().unwrap_or_default().to_string(),
            }),
        }
    }

    /// Registers `schema` under `subject` and returns its id.
    pub async fn register(&self, subject: &str, schema: &Value) -> Result<u32, ClientError> {
        let response = self
            .request(
                reqwest::Method::POST,
                &format!("/subjects/{subject}/versions"),
            )
            .header("Content-Type", "application/vnd.schemaregistry.v1+json")
            .body(json!({ "schema": schema.to_string() }).to_string())
            .send()
            .await
            .map_err(|e| ClientError::Unreachable(e.without_url().to_string()))?;
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        let message = body["message"].as_str().unwrap_or_default().to_string();
        match status {
            200 => body["id"]
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| ClientError::Refused {
                    subject: subject.to_string(),
                    status,
                    message: format!("no id in the answer: {body}"),
                }),
            409 => Err(ClientError::Incompatible {
                subject: subject.to_string(),
                message,
            }),
            _ => Err(ClientError::Refused {
                subject: subject.to_string(),
                status,
                message,
            }),
        }
    }
}
