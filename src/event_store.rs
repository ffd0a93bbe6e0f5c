//! The event store in Postgres (`sql/event_store.sql`): append with an
//! expected version, read a stream, read everything in order.
//!
//! Guarantees:
//! - **Optimistic concurrency.** An append names the version it expects
//!   the stream to be at; any other version, including one a concurrent
//!   writer committed first, is [`AppendError::Conflict`] and nothing of the
//!   append is written (it runs under a savepoint, so the caller's
//!   transaction stays usable).
//! - **Append-only.** The table refuses updates, deletes and truncates.
//! - **One transaction with the caller's writes.** [`EventStore::append`]
//!   takes the caller's transaction, so events can be written atomically
//!   with other rows (the outbox pattern).
//!
//! ```text
//!  append(stream, Expected::Exact(3), [e4, e5]) ──► savepoint ──► current version = 3? ──► insert v4, v5
//!                                                                  └─ no / unique violation ──► Conflict
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, GenericClient, Row, Transaction};

use crate::source;
use crate::source::slot::quote_ident;

/// The table `sql/event_store.sql` creates.
pub const DEFAULT_TABLE: &str = "event_store.events";

/// Who wrote an event and why. Stored as the `metadata` object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Metadata {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub causation_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
    /// The actor's intent, in the domain's words ("fraud", "customer_request").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub intent: Option<String>,
}

/// An event to append.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub event_type: String,
    pub schema_version: i32,
    pub payload: serde_json::Value,
    pub metadata: Metadata,
}

impl NewEvent {
    pub fn new(event_type: &str, schema_version: i32, payload: serde_json::Value) -> NewEvent {
        NewEvent {
            event_type: event_type.to_string(),
            schema_version,
            payload,
            metadata: Metadata::default(),
        }
    }

    pub fn with_metadata(mut self, metadata: Metadata) -> NewEvent {
        self.metadata = metadata;
        self
    }
}

/// An event as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedEvent {
    /// Order in the whole store; `None` when the event came from a topic
    /// whose records do not carry it.
    pub global_position: Option<i64>,
    pub event_id: String,
    pub stream_type: String,
    pub stream_id: String,
    pub version: i64,
    pub event_type: String,
    pub schema_version: i32,
    pub payload: serde_json::Value,
    pub metadata: Metadata,
    pub recorded_at_ms: i64,
}

/// The version an append expects the stream to be at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// The stream has no event yet.
    NoStream,
    /// The stream's last event has this version.
    Exact(i64),
    /// No version check (the next version; two concurrent appends still
    /// cannot take the same one: the later gets a conflict).
    Any,
}

impl fmt::Display for Expected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expected::NoStream => f.write_str("no stream"),
            Expected::Exact(v) => write!(f, "version {v}"),
            Expected::Any => f.write_str("any version"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// Another writer got there first: re-read the stream and decide again.
    #[error("stream {stream_id}: expected {expected}, but it is at version {actual}")]
    Conflict {
        stream_id: String,
        expected: Expected,
        /// The version found; `None` when a concurrent append collided on
        /// the unique constraint (its version is not visible yet).
        actual: VersionFound,
    },
    #[error("stream {stream_id}: {message}")]
    Invalid { stream_id: String, message: String },
    #[error("event store: {}", source::error_text(.0))]
    Postgres(#[from] tokio_postgres::Error),
}

/// The version a conflicting append found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionFound {
    At(i64),
    /// A concurrent writer's append collided on `unique (stream_id, version)`.
    Concurrent,
}

impl fmt::Display for VersionFound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            VersionFound::At(v) => write!(f, "{v}"),
            VersionFound::Concurrent => f.write_str("a version a concurrent writer just took"),
        }
    }
}

/// An event store table.
#[derive(Debug, Clone)]
pub struct EventStore {
    /// `"schema"."table"`, quoted.
    table: String,
}

impl Default for EventStore {
    fn default() -> Self {
        EventStore::new(DEFAULT_TABLE).expect("the default table name is valid")
    }
}

const COLUMNS: &str = "global_position, event_id::text, stream_type, stream_id, version, \
     event_type, schema_version, payload::text, metadata::text, \
     (extract(epoch FROM recorded_at) * 1000)::bigint";

impl EventStore {
    /// `table` as `schema.table`.
    pub fn new(table: &str) -> Result<EventStore, String> {
        let (schema, name) = crate::config::split_table(table)
            .ok_or_else(|| format!("event store table {table:?} is not schema.table"))?;
        Ok(EventStore {
            table: format!("{}.{}", quote_ident(&schema), quote_ident(&name)),
        })
    }

    /// Appends `events` to `stream_id` inside `tx`; returns the stream's
    /// new version. On a conflict nothing is written and `tx` stays usable.
    pub async fn append(
        &self,
        tx: &mut Transaction<'_>,
        stream_type: &str,
        stream_id: &str,
        expected: Expected,
        events: &[NewEvent],
    ) -> Result<i64, AppendError> {
        if events.is_empty() {
            return Err(AppendError::Invalid {
                stream_id: stream_id.into(),
                message: "nothing to append".into(),
            });
        }
        let savepoint = tx.savepoint("pgcdc_append").await?;
        let last = savepoint
            .query_opt(
                &format!(
                    "SELECT version, stream_type FROM {} WHERE stream_id = $1 ORDER BY version DESC LIMIT 1",
                    self.table
                ),
                &[&stream_id],
            )
            .await?;
        let current: i64 = last.as_ref().map_or(0, |r| r.get(0));
        // A stream is routed by its type: one stream, one type, or its
        // events would land in two topics, out of order.
        if let Some(existing) = last.as_ref().map(|r| r.get::<_, String>(1)) {
            if existing != stream_type {
                savepoint.rollback().await?;
                return Err(AppendError::Invalid {
                    stream_id: stream_id.into(),
                    message: format!("its stream type is {existing}, not {stream_type}"),
                });
            }
        }
        let conflict = match expected {
            Expected::NoStream => current != 0,
            Expected::Exact(v) => current != v,
            Expected::Any => false,
        };
        if conflict {
            savepoint.rollback().await?;
            return Err(AppendError::Conflict {
                stream_id: stream_id.into(),
                expected,
                actual: VersionFound::At(current),
            });
        }
        let insert = format!(
            "INSERT INTO {} (stream_type, stream_id, version, event_type, schema_version, payload, metadata) \
             VALUES ($1, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb)",
            self.table
        );
        let statement = savepoint.prepare(&insert).await?;
        let mut version = current;
        for e in events {
            version += 1;
            let metadata =
                serde_json::to_string(&e.metadata).map_err(|err| AppendError::Invalid {
                    stream_id: stream_id.into(),
                    message: format!("metadata: {err}"),
                })?;
            let payload = e.payload.to_string();
            let done = savepoint
                .execute(
                    &statement,
                    &[
                        &stream_type,
                        &stream_id,
                        &version,
                        &e.event_type,
                        &e.schema_version,
                        &payload,
                        &metadata,
                    ],
                )
                .await;
            match done {
                Ok(_) => {}
                Err(err) if err.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
                    savepoint.rollback().await?;
                    return Err(AppendError::Conflict {
                        stream_id: stream_id.into(),
                        expected,
                        actual: VersionFound::Concurrent,
                    });
                }
                Err(err) => return Err(err.into()),
            }
        }
        savepoint.commit().await?;
        Ok(version)
    }

    /// [`EventStore::append`] in a transaction of its own.
    pub async fn append_now(
        &self,
        client: &mut Client,
        stream_type: &str,
        stream_id: &str,
        expected: Expected,
        events: &[NewEvent],
    ) -> Result<i64, AppendError> {
        let mut tx = client.transaction().await?;
        let version = self
            .append(&mut tx, stream_type, stream_id, expected, events)
            .await?;
        tx.commit().await?;
        Ok(version)
    }

    /// A stream's events in version order.
    pub async fn read_stream(
        &self,
        client: &impl GenericClient,
        stream_id: &str,
    ) -> Result<Vec<RecordedEvent>, tokio_postgres::Error> {
        let rows = client
            .query(
                &format!(
                    "SELECT {COLUMNS} FROM {} WHERE stream_id = $1 ORDER BY version",
                    self.table
                ),
                &[&stream_id],
            )
            .await?;
        Ok(rows.iter().map(recorded).collect())
    }

    /// Up to `limit` events after `after` (a global position; 0 for the
    /// first), in global order. Read pages of one snapshot (a
    /// `REPEATABLE READ` transaction) to see a consistent store: positions
    /// are taken at insert, so a later page can hold a smaller one that
    /// committed late.
    pub async fn read_all(
        &self,
        client: &impl GenericClient,
        after: i64,
        limit: i64,
    ) -> Result<Vec<RecordedEvent>, tokio_postgres::Error> {
        let rows = client
            .query(
                &format!(
                    "SELECT {COLUMNS} FROM {} WHERE global_position > $1 ORDER BY global_position LIMIT $2",
                    self.table
                ),
                &[&after, &limit],
            )
            .await?;
        Ok(rows.iter().map(recorded).collect())
    }
}

fn recorded(row: &Row) -> RecordedEvent {
    let payload: String = row.get(7);
    let metadata: String = row.get(8);
    RecordedEvent {
        global_position: Some(row.get(0)),
        event_id: row.get(1),
        stream_type: row.get(2),
        stream_id: row.get(3),
        version: row.get(4),
        event_type: row.get(5),
        schema_version: row.get(6),
        // Postgres produced both from jsonb: they parse.
        payload: serde_json::from_str(&payload).unwrap_or(serde_json::Value::Null),
        metadata: serde_json::from_str(&metadata).unwrap_or_default(),
        recorded_at_ms: row.get(9),
    }
}
