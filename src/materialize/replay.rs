//! Replaying dead letters: the two checks, then the normal apply path.
//!
//! Guarantees:
//! - **Schema check** ([`resolve`]): the writer schema (by the id in the
//!   record's frame) is resolved against the reader, the subject's latest
//!   value schema, which the mirror follows and the read models read. A
//!   record it cannot read continues only through a configured safe
//!   mapping (`dlq.mappings`: renamed fields, defaults for columns the
//!   writer lacked).
//! - **Idempotency check** ([`Replayer::already_applied`]): the record's
//!   position against the durable position of its key (row, tombstone,
//!   truncate), the same look-up the materializer's guard makes.
//! - **Apply** ([`Replayer::apply`]) runs the materializer's own
//!   [`apply_in`] in one serializable transaction that also records the
//!   outcome, so "applied" is never written for a change that was not,
//!   and the position guard still stops a change applied meanwhile.
//!   A change the target refuses again goes back to the dead-letter topic
//!   (acknowledged before the outcome commits), linked to the old message.

use std::collections::HashMap;

use apache_avro::Schema;
use rdkafka::message::{OwnedMessage, Timestamp};
use serde_json::Value as Json;

use super::*;
use crate::config::{DedupConfig, DlqMappingConfig};
use crate::dlq::store::{self, DeadLetter, Extra};
use crate::dlq::{Outcome, State as DlqState};

/// What the schema check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaVerdict {
    Compatible,
    /// Readable through the table's mapping; says what it changes.
    Transformed(String),
    /// Not readable; says why.
    Incompatible(String),
}

/// How an apply ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    Applied,
    /// The guard found it applied meanwhile.
    AlreadyApplied,
    /// Refused again; it is a new quarantine now.
    Refailed {
        class: String,
        error: String,
    },
}

/// The materializer's apply path, opened for replays.
pub struct Replayer {
    state: State,
    db: Client,
    producer: sink::Producer,
    dlq: String,
    mappings: std::collections::BTreeMap<String, DlqMappingConfig>,
    max_message_bytes: usize,
}

impl std::fmt::Debug for Replayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replayer").field("dlq", &self.dlq).finish()
    }
}

impl Replayer {
    /// Connects to the target (mirrors and read models made ready as the
    /// materializer makes them) and to Kafka for re-quarantines.
    pub async fn open(config: &Config) -> Result<Replayer, MaterializeError> {
        let target = config
            .target
            .as_ref()
            .ok_or_else(|| MaterializeError::Config("target: is required".into()))?;
        let db = crate::source::connect(&target.url).await?;
        let Prepared {
            registry,
            mirrors,
            views,
        } = prepare(config, &db).await?;
        let dlq = dlq_topic(config);
        sink::ensure_dlq_topic(&config.kafka, &dlq).await?;
        let producer = sink::Producer::create(&config.kafka, None).await?;
        // No fast tier: every check reads the durable positions.
        let fast = fast_tier::FastTier::new(
            &DedupConfig {
                cache_keys: 0,
                bloom_keys: 0,
                redis_url: None,
                on_redis_failure: None,
                ..DedupConfig::default()
            },
            "replay",
        )
        .map_err(MaterializeError::Config)?;
        let mappings = config
            .dlq
            .mappings
            .iter()
            .map(|(table, m)| (config.topic_for(table), m.clone()))
            .collect();
        Ok(Replayer {
            state: State {
                homes: config.homes(),
                ..State::new(registry, mirrors, views, fast)
            },
            db,
            producer,
            dlq,
            mappings,
            max_message_bytes: config.kafka.max_message_bytes,
        })
    }

    /// The target connection (the store lives there too).
    pub fn db(&mut self) -> &mut Client {
        &mut self.db
    }

    /// The Kafka keys of every open dead letter, with its class (for
    /// [`super::Held`]).
    pub async fn open_keys(
        &mut self,
    ) -> Result<HashMap<super::HeldKey, &'static str>, MaterializeError> {
        let rows = self
            .db
            .query(
                "SELECT origin_topic, key, class FROM pgcdc_dlq.messages
                 WHERE key IS NOT NULL AND state NOT IN ('replayed', 'archived')",
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| {
                let class = crate::dlq::Class::parse(r.get(2))
                    .unwrap_or(crate::dlq::Class::Deserialization);
                (
                    (r.get::<_, String>(0), r.get::<_, Vec<u8>>(1)),
                    class.as_str(),
                )
            })
            .collect())
    }

    pub async fn schema_check(
        &mut self,
        m: &DeadLetter,
    ) -> Result<SchemaVerdict, MaterializeError> {
        use SchemaVerdict::Incompatible;
        let Some(value) = m.value.as_deref() else {
            return Ok(Incompatible("the record has no payload".into()));
        };
        let Some((id, datum)) = unframe(value) else {
            return Ok(Incompatible(
                "not Confluent-framed Avro: there is no writer schema to resolve".into(),
            ));
        };
        if !self
            .state
            .mirrors
            .contains_key(super::home(&self.state.homes, &m.origin_topic))
        {
            return Ok(Incompatible(format!(
                "{} is not the topic of a captured table: nothing reads it",
                m.origin_topic
            )));
        }
        let writer = match self.state.registry.schema_by_id(id).await {
            Ok(text) => text,
            Err(ClientError::Refused { status: 404, .. }) => {
                return Ok(Incompatible(format!(
                    "writer schema {id} is unknown to the registry"
                )))
            }
            Err(e) => return Err(e.into()),
        };
        let subject = format!("{}-value", m.origin_topic);
        let Some((reader_id, reader)) = self.state.registry.latest(&subject).await? else {
            return Ok(Incompatible(format!("subject {subject} has no schema")));
        };
        match Schema::parse_str(&writer) {
            Ok(w) => {
                if let Err(e) = decode_datum(&w, datum) {
                    return Ok(Incompatible(format!(
                        "the body does not decode with writer schema {id}: {e}"
                    )));
                }
            }
            Err(e) => return Ok(Incompatible(format!("writer schema {id}: {e}"))),
        }
        let table = m.source_table.as_deref().unwrap_or(&m.origin_topic);
        Ok(resolve(
            (id, writer.as_str()),
            (subject.as_str(), reader_id, reader.as_str()),
            self.mappings.get(&m.origin_topic).map(|mp| (table, mp)),
        ))
    }

    /// Adds to the mirror the columns the message's writer has and the
    /// mirror not yet (as the live path does), so none of its values is
    /// dropped.
    async fn evolve(&mut self, m: &DeadLetter) -> Result<(), MaterializeError> {
        if let Some((id, _)) = m.value.as_deref().and_then(unframe) {
            if let Ok(w) = self.state.writer(id).await {
                self.state.evolve(&self.db, &m.origin_topic, &w).await?;
            }
        }
        Ok(())
    }

    /// Decodes the message for the apply path, through the mapping when
    /// the schema check needed it.
    async fn change(&mut self, m: &DeadLetter, mapped: bool) -> Result<Option<Change>, Failure> {
        let Some(value) = m.value.as_deref() else {
            return Ok(None);
        };
        self.state.mapping = mapped
            .then(|| self.mappings.get(&m.origin_topic).cloned())
            .flatten();
        let c = self.state.decode(&m.origin_topic, value).await;
        self.state.mapping = None;
        c.map(Some)
    }

    /// Whether the message's change (or a newer one of its key) is
    /// applied; `None` when it cannot be decoded (the apply says why).
    pub async fn already_applied(
        &mut self,
        m: &DeadLetter,
        mapped: bool,
    ) -> Result<Option<bool>, MaterializeError> {
        // No evolve: the position and key need no new column, and a dry
        // run changes nothing.
        let change = match self.change(m, mapped).await {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(None),
            Err(f) if f.class == REGISTRY_UNAVAILABLE => {
                return Err(MaterializeError::RegistryUnavailable(f.error))
            }
            Err(_) => return Ok(None),
        };
        let Some(mirror) = self
            .state
            .mirrors
            .get(super::home(&self.state.homes, &m.origin_topic))
        else {
            return Ok(None);
        };
        let tx = self.db.transaction().await?;
        let applied = if change.op == "t" {
            tx.query_opt(
                "SELECT 1 FROM pgcdc_state.truncations WHERE mirror = $1 AND (commit_lsn, seq) >= ($2, $3)",
                &[&mirror.qualified, &change.position.0, &change.position.1],
            )
            .await?
            .is_some()
        } else {
            !mirror::is_new(
                &tx,
                &mut self.state.statements,
                mirror,
                &change.key,
                change.position,
            )
            .await?
        };
        tx.commit().await?;
        Ok(Some(applied))
    }

    /// Applies the message through the apply path and moves it from
    /// `idempotency_check` to `replayed` with its outcome, in the same
    /// transaction; a refusal re-quarantines it, linked to `m`.
    pub async fn apply(
        &mut self,
        m: &DeadLetter,
        mapped: bool,
        actor: &str,
    ) -> Result<Applied, MaterializeError> {
        let record = OwnedMessage::new(
            m.value.clone(),
            m.key.clone(),
            m.origin_topic.clone(),
            Timestamp::NotAvailable,
            m.origin_partition.unwrap_or(-1),
            m.origin_offset.unwrap_or(-1),
            None,
        );
        let batch = [record];
        self.evolve(m).await?;
        let failure = match self.change(m, mapped).await {
            Err(f) if f.class == REGISTRY_UNAVAILABLE => {
                return Err(MaterializeError::RegistryUnavailable(f.error))
            }
            Err(f) => Some(f),
            Ok(None) => Some(Failure {
                class: crate::dlq::Class::Deserialization.as_str(),
                error: "the record has no payload".into(),
                position: None,
            }),
            Ok(Some(change)) => {
                let changes = [(0usize, change)];
                let lookups = Lookups {
                    known: HashMap::new(),
                    fresh: Default::default(),
                };
                let (mut attempt, mut careful) = (0u32, false);
                loop {
                    attempt += 1;
                    let tx = super::serializable(&mut self.db).await?;
                    match apply_in(&tx, &mut self.state, &batch, &changes, &lookups, careful).await
                    {
                        Err(MaterializeError::Rejected) => careful = true,
                        Err(MaterializeError::Postgres(e)) if is_retryable(&e) && attempt < 20 => {
                            tokio::time::sleep(Duration::from_millis(10 * u64::from(attempt)))
                                .await;
                        }
                        Err(MaterializeError::ViewRejected { class, error }) => {
                            break Some(Failure {
                                class,
                                error,
                                position: Some(changes[0].1.position),
                            });
                        }
                        Err(e) => return Err(e),
                        Ok(mut done) => {
                            if let Some((_, f)) = done.dead.pop() {
                                break Some(f);
                            }
                            let (outcome, reason) = if done.applied > 0 {
                                (Applied::Applied, "applied through the apply path")
                            } else {
                                (
                                    Applied::AlreadyApplied,
                                    "already applied: the guard found it (or a newer change of its key) applied meanwhile",
                                )
                            };
                            let o = match outcome {
                                Applied::Applied => Outcome::Applied,
                                _ => Outcome::AlreadyApplied,
                            };
                            let recorded = store::transition(
                                &tx,
                                m.id,
                                DlqState::IdempotencyCheck,
                                DlqState::Replayed,
                                actor,
                                reason,
                                Extra {
                                    outcome: Some(o),
                                    note: None,
                                },
                            )
                            .await;
                            match recorded {
                                Ok(()) => {}
                                // A conflict with another transaction: redo.
                                Err(store::StoreError::Db(e))
                                    if is_retryable(&e) && attempt < 20 =>
                                {
                                    continue
                                }
                                Err(e) => return Err(MaterializeError::DeadLetter(e.to_string())),
                            }
                            match tx.commit().await {
                                Ok(()) => return Ok(outcome),
                                Err(e) if is_retryable(&e) && attempt < 20 => continue,
                                Err(e) => return Err(e.into()),
                            }
                        }
                    }
                }
            }
        };
        let Some(f) = failure else {
            return Ok(Applied::AlreadyApplied);
        };
        // Back to the topic first (the new quarantine is durable), then the
        // old message's outcome.
        let dead_letters = DeadLetters {
            producer: Some(&self.producer),
            topic: &self.dlq,
            sent: Default::default(),
            replay_of: Some(m.id),
            max_message_bytes: self.max_message_bytes,
        };
        dead_letters.send(&batch[0], &f).await?;
        store::transition(
            &self.db,
            m.id,
            DlqState::IdempotencyCheck,
            DlqState::Replayed,
            actor,
            &format!("failed again ({}): came back as a new quarantine", f.class),
            Extra {
                outcome: Some(Outcome::Refailed),
                note: Some(&f.error),
            },
        )
        .await
        .map_err(|e| MaterializeError::DeadLetter(e.to_string()))?;
        Ok(Applied::Refailed {
            class: f.class.to_string(),
            error: f.error,
        })
    }
}

/// The schema check proper (pure): `writer` (id, text) against `reader`
/// (subject, id, text), through the table's mapping when it has one.
pub fn resolve(
    (writer_id, writer): (u32, &str),
    (subject, reader_id, reader): (&str, u32, &str),
    mapping: Option<(&str, &DlqMappingConfig)>,
) -> SchemaVerdict {
    let parse = |t: &str| Schema::parse_str(t).map_err(|e| e.to_string());
    let plain = match (parse(writer), parse(reader)) {
        (Ok(w), Ok(r)) => crate::registry::compat::can_read(&w, &r),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    let Err(why) = plain else {
        return SchemaVerdict::Compatible;
    };
    let fields = field_differences(writer, reader);
    let why = if fields.is_empty() {
        why
    } else {
        format!("{} ({why})", fields.join("; "))
    };
    let head = format!(
        "writer schema {writer_id} cannot be read as {subject} (schema {reader_id}): {why}"
    );
    let Some((table, mapping)) = mapping else {
        return SchemaVerdict::Incompatible(format!(
            "{head}; no safe mapping is configured (dlq.mappings)"
        ));
    };
    let mapped = (|| -> Result<(), String> {
        let mut w: Json = serde_json::from_str(writer).map_err(|e| e.to_string())?;
        let mut r: Json = serde_json::from_str(reader).map_err(|e| e.to_string())?;
        // Mappings name source columns; Avro resolves by field name, so a
        // renamed column takes the reader's field name for its new column.
        let reader_field = |r: &mut Json, column: &str| {
            row_fields(r)
                .into_iter()
                .find(|f| shape::column_name(f) == Some(column))
                .and_then(|f| f["name"].as_str().map(String::from))
        };
        let renames: Vec<(usize, String)> = row_fields(&mut w)
            .iter()
            .enumerate()
            .filter_map(|(i, f)| {
                let to = mapping.renames.get(shape::column_name(f)?)?;
                let name = reader_field(&mut r, to).unwrap_or_else(|| crate::encode::avro_name(to));
                Some((i, name))
            })
            .collect();
        let mut fields = row_fields(&mut w);
        for (i, name) in renames {
            fields[i]["name"] = Json::String(name);
        }
        for field in row_fields(&mut r) {
            if let Some(d) = shape::column_name(field).and_then(|c| mapping.defaults.get(c)) {
                field["default"] = avro_default(&field["type"], d);
            }
        }
        let (w, r) = (parse(&w.to_string())?, parse(&r.to_string())?);
        crate::registry::compat::can_read(&w, &r)
    })();
    match mapped {
        Ok(()) => SchemaVerdict::Transformed(describe(table, mapping)),
        Err(e) => SchemaVerdict::Incompatible(format!(
            "{head}; the mapping dlq.mappings.\"{table}\" does not make it readable ({e})"
        )),
    }
}

/// What differs between the writer's and the reader's row fields, in
/// terms an operator can act on (Avro's own message names no field when a
/// union branch is what fails).
fn field_differences(writer: &str, reader: &str) -> Vec<String> {
    let (Ok(mut w), Ok(mut r)) = (
        serde_json::from_str::<Json>(writer),
        serde_json::from_str::<Json>(reader),
    ) else {
        return Vec::new();
    };
    let label = |t: &Json| -> String {
        let branch = match t {
            Json::Array(b) => b
                .iter()
                .find(|b| *b != "null")
                .cloned()
                .unwrap_or(Json::Null),
            other => other.clone(),
        };
        match &branch {
            Json::String(s) => s.clone(),
            other => other["logicalType"]
                .as_str()
                .or_else(|| other["type"].as_str())
                .unwrap_or("?")
                .to_string(),
        }
    };
    let writer_fields: Vec<Json> = row_fields(&mut w).into_iter().map(|f| f.clone()).collect();
    let mut out = Vec::new();
    for rf in row_fields(&mut r) {
        let name = rf["name"].as_str().unwrap_or_default();
        match writer_fields.iter().find(|wf| wf["name"] == name) {
            None if rf.get("default").is_none() => out.push(format!(
                "field {name} is required by the reader and missing in the writer"
            )),
            None => {}
            Some(wf) if wf["type"] != rf["type"] => out.push(format!(
                "field {name} is {} in the writer, {} in the reader",
                label(&wf["type"]),
                label(&rf["type"])
            )),
            Some(_) => {}
        }
    }
    out
}

/// The fields of the row record (the `before`/`after` record) of an
/// envelope schema.
fn row_fields(envelope: &mut Json) -> Vec<&mut Json> {
    let Some(fields) = envelope["fields"].as_array_mut() else {
        return Vec::new();
    };
    for f in fields.iter_mut() {
        if f["name"] != "before" {
            continue;
        }
        if let Some(branches) = f["type"].as_array_mut() {
            for b in branches.iter_mut() {
                if b["type"] == "record" {
                    if let Some(fs) = b["fields"].as_array_mut() {
                        return fs.iter_mut().collect();
                    }
                }
            }
        }
    }
    Vec::new()
}

/// A mapping's default (Postgres text) as an Avro default of the field's
/// first branch.
fn avro_default(ty: &Json, text: &str) -> Json {
    let first = match ty {
        Json::Array(a) => a.first().cloned().unwrap_or(Json::Null),
        other => other.clone(),
    };
    let name = first
        .as_str()
        .map(String::from)
        .or_else(|| first["type"].as_str().map(String::from))
        .unwrap_or_default();
    match name.as_str() {
        "int" | "long" => text.parse::<i64>().map(Json::from).unwrap_or(Json::Null),
        "float" | "double" => text.parse::<f64>().map(Json::from).unwrap_or(Json::Null),
        "boolean" => Json::Bool(matches!(text, "t" | "true")),
        _ => Json::String(text.to_string()),
    }
}

fn describe(table: &str, m: &DlqMappingConfig) -> String {
    let mut parts: Vec<String> = m
        .renames
        .iter()
        .map(|(f, t)| format!("{f} renamed to {t}"))
        .collect();
    parts.extend(m.defaults.keys().map(|c| format!("{c} defaulted")));
    format!(
        "transformed by dlq.mappings.\"{table}\": {}",
        parts.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(fields: Json) -> String {
        serde_json::json!({
            "type": "record", "name": "Envelope", "namespace": "t",
            "fields": [
                {"name": "before", "type": ["null", {"type": "record", "name": "Value", "fields": fields}], "default": null},
                {"name": "after", "type": ["null", "Value"], "default": null},
                {"name": "op", "type": "string"}
            ]
        })
        .to_string()
    }

    #[test]
    fn a_compatible_writer_continues_and_a_narrowed_type_is_archived() {
        let v1 = envelope(serde_json::json!([
            {"name": "id", "type": "long"},
            {"name": "qty", "type": ["null", "long"], "default": null}
        ]));
        let v2 = envelope(serde_json::json!([
            {"name": "id", "type": "long"},
            {"name": "qty", "type": ["null", "int"], "default": null},
            {"name": "note", "type": ["null", "string"], "default": null}
        ]));
        // An added nullable column is readable; long into int is not.
        assert_eq!(
            resolve((1, &v1), ("s", 2, &v1), None),
            SchemaVerdict::Compatible
        );
        match resolve((1, &v1), ("t-value", 2, &v2), None) {
            SchemaVerdict::Incompatible(note) => {
                assert!(
                    note.contains("writer schema 1 cannot be read as t-value (schema 2)"),
                    "{note}"
                );
                assert!(note.contains("no safe mapping"), "{note}");
                assert!(
                    note.contains("field qty is long in the writer, int in the reader"),
                    "{note}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_mapping_makes_a_renamed_field_and_a_required_column_readable() {
        let old = envelope(serde_json::json!([
            {"name": "id", "type": "long"},
            {"name": "nickname", "type": "string"}
        ]));
        // A reader that requires `label` (the renamed column) and `region`.
        let new = envelope(serde_json::json!([
            {"name": "id", "type": "long"},
            {"name": "label", "type": "string"},
            {"name": "region", "type": "string"}
        ]));
        assert!(matches!(
            resolve((1, &old), ("t-value", 2, &new), None),
            SchemaVerdict::Incompatible(_)
        ));
        let mut m = DlqMappingConfig::default();
        m.renames.insert("nickname".into(), "label".into());
        // Half a mapping is not enough.
        match resolve((1, &old), ("t-value", 2, &new), Some(("public.t", &m))) {
            SchemaVerdict::Incompatible(note) => {
                assert!(note.contains("does not make it readable"), "{note}")
            }
            other => panic!("{other:?}"),
        }
        m.defaults.insert("region".into(), "eu".into());
        assert_eq!(
            resolve((1, &old), ("t-value", 2, &new), Some(("public.t", &m))),
            SchemaVerdict::Transformed(
                "transformed by dlq.mappings.\"public.t\": nickname renamed to label, region defaulted".into()
            )
        );
    }
}
