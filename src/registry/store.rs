//! The registry's durable state in Postgres (`sql/registry.sql`).
//!
//! Guarantees:
//! - Ids are global, never reused, and stable across restarts: the same
//!   canonical schema always maps to one id, enforced by a unique
//!   fingerprint, so concurrent registrations of one schema agree.
//! - Registrations under one subject are serialized by a transaction-scoped
//!   advisory lock, so two different schemas racing for the next version get
//!   distinct versions and neither is lost; the compatibility check runs
//!   under the same lock, against the history it will extend.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};

use super::compat::{self, Level, ParsedSchema};
use super::RegistryError;
use crate::secret::Dsn;

const MIGRATION: &str = include_str!("../../sql/registry.sql");
/// Arbitrary constant key: serializes concurrent migrations of one store.
const MIGRATION_LOCK: i64 = 0x7067_6364_6372_6567;
/// Connections to the store; registrations hold one for a short transaction.
pub const POOL_SIZE: usize = 16;

/// Which version of a subject a request names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionSpec {
    Latest,
    Number(i32),
}

impl VersionSpec {
    /// Parses `latest`, `-1` or a positive version number.
    pub fn parse(text: &str) -> Result<VersionSpec, RegistryError> {
        match text {
            "latest" | "-1" => Ok(VersionSpec::Latest),
            _ => match text.parse::<i32>() {
                Ok(n) if n > 0 => Ok(VersionSpec::Number(n)),
                _ => Err(RegistryError::InvalidVersion(text.to_string())),
            },
        }
    }
}

/// A registered version of a subject.
#[derive(Debug, Clone)]
pub struct SubjectVersion {
    pub subject: String,
    pub version: i32,
    pub id: i32,
    pub schema: String,
}

#[derive(Clone)]
pub struct Store {
    pool: Pool,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").finish_non_exhaustive()
    }
}

fn db(e: impl std::fmt::Display) -> RegistryError {
    RegistryError::Store(e.to_string())
}

impl Store {
    /// Opens a pool on `dsn` and applies the migration.
    pub async fn open(dsn: &Dsn) -> Result<Store, RegistryError> {
        let endpoint = crate::source::tls::Endpoint::parse(dsn).map_err(db)?;
        let manager = Manager::from_config(
            endpoint.pg,
            endpoint.tls.connector(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .build()
            .map_err(db)?;
        let store = Store { pool };
        let client = store.pool.get().await.map_err(db)?;
        client
            .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(db)?;
        let applied = client.batch_execute(MIGRATION).await.map_err(db);
        client
            .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(db)?;
        applied?;
        Ok(store)
    }

    /// Registers `schema` under `subject` and returns its global id and
    /// whether a new version was created; the same schema under the same
    /// subject returns the existing id.
    pub async fn register(
        &self,
        subject: &str,
        schema: &ParsedSchema,
    ) -> Result<(i32, bool), RegistryError> {
        let mut client = self.pool.get().await.map_err(db)?;
        let tx = client.transaction().await.map_err(db)?;
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('pgcdc_registry:' || $1, 0))",
            &[&subject],
        )
        .await
        .map_err(db)?;
        let existing = tx
            .query_opt(
                "SELECT s.id FROM pgcdc_registry.versions v
                 JOIN pgcdc_registry.schemas s ON s.id = v.schema_id
                 WHERE v.subject = $1 AND NOT v.deleted
                   AND s.fingerprint = sha256(convert_to($2, 'UTF8'))
                 ORDER BY v.version LIMIT 1",
                &[&subject, &schema.canonical],
            )
            .await
            .map_err(db)?;
        if let Some(row) = existing {
            return Ok((row.get(0), false));
        }
        let inner: &tokio_postgres::Transaction = &tx;
        let level = level_in(inner, subject).await?;
        if level != Level::None {
            let history = history_in(inner, subject).await?;
            let problems = compat::check(level, &schema.schema, &history);
            if !problems.is_empty() {
                return Err(RegistryError::Incompatible(problems));
            }
        }
        tx.execute(
            "INSERT INTO pgcdc_registry.schemas (fingerprint, canonical)
             VALUES (sha256(convert_to($1, 'UTF8')), $1)
             ON CONFLICT (fingerprint) DO NOTHING",
            &[&schema.canonical],
        )
        .await
        .map_err(db)?;
        let id: i32 = tx
            .query_one(
                "SELECT id FROM pgcdc_registry.schemas WHERE fingerprint = sha256(convert_to($1, 'UTF8'))",
                &[&schema.canonical],
            )
            .await
            .map_err(db)?
            .get(0);
        tx.execute(
            "INSERT INTO pgcdc_registry.versions (subject, version, schema_id)
             SELECT $1, coalesce(max(version), 0) + 1, $2
             FROM pgcdc_registry.versions WHERE subject = $1",
            &[&subject, &id],
        )
        .await
        .map_err(db)?;
        tx.commit().await.map_err(db)?;
        Ok((id, true))
    }

    /// Finds `schema` among the versions of `subject`.
    pub async fn lookup(
        &self,
        subject: &str,
        schema: &ParsedSchema,
        include_deleted: bool,
    ) -> Result<SubjectVersion, RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        let row = client
            .query_opt(
                "SELECT v.version, s.id, s.canonical FROM pgcdc_registry.versions v
                 JOIN pgcdc_registry.schemas s ON s.id = v.schema_id
                 WHERE v.subject = $1 AND (NOT v.deleted OR $3)
                   AND s.fingerprint = sha256(convert_to($2, 'UTF8'))
                 ORDER BY v.version LIMIT 1",
                &[&subject, &schema.canonical, &include_deleted],
            )
            .await
            .map_err(db)?;
        match row {
            Some(row) => Ok(SubjectVersion {
                subject: subject.to_string(),
                version: row.get(0),
                id: row.get(1),
                schema: row.get(2),
            }),
            None => {
                self.require_subject(subject, include_deleted).await?;
                Err(RegistryError::SchemaNotFound)
            }
        }
    }

    /// The schema text of a global id.
    pub async fn schema_by_id(&self, id: i32) -> Result<(String, String), RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        let row = client
            .query_opt(
                "SELECT schema_type, canonical FROM pgcdc_registry.schemas WHERE id = $1",
                &[&id],
            )
            .await
            .map_err(db)?
            .ok_or(RegistryError::SchemaNotFound)?;
        Ok((row.get(0), row.get(1)))
    }

    /// The (subject, version) pairs that use a global id.
    pub async fn usages_of_id(&self, id: i32) -> Result<Vec<(String, i32)>, RegistryError> {
        self.schema_by_id(id).await?;
        let client = self.pool.get().await.map_err(db)?;
        let rows = client
            .query(
                "SELECT subject, version FROM pgcdc_registry.versions
                 WHERE schema_id = $1 AND NOT deleted ORDER BY subject, version",
                &[&id],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    pub async fn subjects(&self, include_deleted: bool) -> Result<Vec<String>, RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        let rows = client
            .query(
                "SELECT DISTINCT subject FROM pgcdc_registry.versions
                 WHERE NOT deleted OR $1 ORDER BY subject",
                &[&include_deleted],
            )
            .await
            .map_err(db)?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Version numbers of a subject, oldest first; 40401 if it has none.
    pub async fn versions(
        &self,
        subject: &str,
        include_deleted: bool,
    ) -> Result<Vec<i32>, RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        let rows = client
            .query(
                "SELECT version FROM pgcdc_registry.versions
                 WHERE subject = $1 AND (NOT deleted OR $2) ORDER BY version",
                &[&subject, &include_deleted],
            )
            .await
            .map_err(db)?;
        if rows.is_empty() {
            return Err(RegistryError::SubjectNotFound(subject.to_string()));
        }
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    pub async fn version(
        &self,
        subject: &str,
        spec: VersionSpec,
        include_deleted: bool,
    ) -> Result<SubjectVersion, RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        let number = match spec {
            VersionSpec::Latest => None,
            VersionSpec::Number(n) => Some(n),
        };
        let row = client
            .query_opt(
                "SELECT v.version, s.id, s.canonical FROM pgcdc_registry.versions v
                 JOIN pgcdc_registry.schemas s ON s.id = v.schema_id
                 WHERE v.subject = $1 AND (NOT v.deleted OR $2)
                   AND ($3::int IS NULL OR v.version = $3)
                 ORDER BY v.version DESC LIMIT 1",
                &[&subject, &include_deleted, &number],
            )
            .await
            .map_err(db)?;
        match row {
            Some(row) => Ok(SubjectVersion {
                subject: subject.to_string(),
                version: row.get(0),
                id: row.get(1),
                schema: row.get(2),
            }),
            None => {
                self.require_subject(subject, include_deleted).await?;
                Err(RegistryError::VersionNotFound(subject.to_string(), spec))
            }
        }
    }

    async fn require_subject(
        &self,
        subject: &str,
        include_deleted: bool,
    ) -> Result<(), RegistryError> {
        self.versions(subject, include_deleted).await.map(|_| ())
    }

    /// Soft-deletes every version, or with `permanent` removes a subject
    /// that was soft-deleted first. Returns the versions affected.
    pub async fn delete_subject(
        &self,
        subject: &str,
        permanent: bool,
    ) -> Result<Vec<i32>, RegistryError> {
        let mut client = self.pool.get().await.map_err(db)?;
        let tx = client.transaction().await.map_err(db)?;
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('pgcdc_registry:' || $1, 0))",
            &[&subject],
        )
        .await
        .map_err(db)?;
        let rows = tx
            .query(
                "SELECT version, deleted FROM pgcdc_registry.versions WHERE subject = $1 ORDER BY version",
                &[&subject],
            )
            .await
            .map_err(db)?;
        if rows.is_empty() {
            return Err(RegistryError::SubjectNotFound(subject.to_string()));
        }
        let live: Vec<i32> = rows
            .iter()
            .filter(|r| !r.get::<_, bool>(1))
            .map(|r| r.get(0))
            .collect();
        let all: Vec<i32> = rows.iter().map(|r| r.get(0)).collect();
        let affected = if permanent {
            if !live.is_empty() {
                return Err(RegistryError::SubjectNotSoftDeleted(subject.to_string()));
            }
            tx.execute(
                "DELETE FROM pgcdc_registry.versions WHERE subject = $1",
                &[&subject],
            )
            .await
            .map_err(db)?;
            tx.execute(
                "DELETE FROM pgcdc_registry.config WHERE subject = $1",
                &[&subject],
            )
            .await
            .map_err(db)?;
            all
        } else {
            if live.is_empty() {
                return Err(RegistryError::SubjectSoftDeleted(subject.to_string()));
            }
            tx.execute(
                "UPDATE pgcdc_registry.versions SET deleted = true WHERE subject = $1 AND NOT deleted",
                &[&subject],
            )
            .await
            .map_err(db)?;
            live
        };
        tx.commit().await.map_err(db)?;
        Ok(affected)
    }

    /// Soft- or permanently deletes one version.
    pub async fn delete_version(
        &self,
        subject: &str,
        spec: VersionSpec,
        permanent: bool,
    ) -> Result<i32, RegistryError> {
        let target = self.version(subject, spec, permanent).await?;
        let client = self.pool.get().await.map_err(db)?;
        let deleted: bool = client
            .query_one(
                "SELECT deleted FROM pgcdc_registry.versions WHERE subject = $1 AND version = $2",
                &[&subject, &target.version],
            )
            .await
            .map_err(db)?
            .get(0);
        if permanent {
            if !deleted {
                return Err(RegistryError::VersionNotSoftDeleted(
                    subject.to_string(),
                    target.version,
                ));
            }
            client
                .execute(
                    "DELETE FROM pgcdc_registry.versions WHERE subject = $1 AND version = $2",
                    &[&subject, &target.version],
                )
                .await
                .map_err(db)?;
        } else {
            client
                .execute(
                    "UPDATE pgcdc_registry.versions SET deleted = true WHERE subject = $1 AND version = $2",
                    &[&subject, &target.version],
                )
                .await
                .map_err(db)?;
        }
        Ok(target.version)
    }

    /// The level set for a subject (`None` for the global level).
    pub async fn level(&self, subject: Option<&str>) -> Result<Option<Level>, RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        let row = client
            .query_opt(
                "SELECT compatibility FROM pgcdc_registry.config WHERE subject = $1",
                &[&subject.unwrap_or("")],
            )
            .await
            .map_err(db)?;
        row.map(|r| r.get::<_, String>(0).parse().map_err(RegistryError::Store))
            .transpose()
    }

    pub async fn set_level(
        &self,
        subject: Option<&str>,
        level: Level,
    ) -> Result<(), RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        client
            .execute(
                "INSERT INTO pgcdc_registry.config (subject, compatibility) VALUES ($1, $2)
                 ON CONFLICT (subject) DO UPDATE SET compatibility = excluded.compatibility",
                &[&subject.unwrap_or(""), &level.as_str()],
            )
            .await
            .map_err(db)?;
        Ok(())
    }

    /// Removes a subject's own level; returns what it was.
    pub async fn delete_level(&self, subject: &str) -> Result<Level, RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        let row = client
            .query_opt(
                "DELETE FROM pgcdc_registry.config WHERE subject = $1 RETURNING compatibility",
                &[&subject],
            )
            .await
            .map_err(db)?
            .ok_or_else(|| RegistryError::SubjectLevelNotConfigured(subject.to_string()))?;
        row.get::<_, String>(0)
            .parse()
            .map_err(RegistryError::Store)
    }

    /// Tests `schema` against a subject: one version, or (`None`) the
    /// versions its level demands. Returns the incompatibilities.
    pub async fn test_compatibility(
        &self,
        subject: &str,
        spec: Option<VersionSpec>,
        schema: &ParsedSchema,
    ) -> Result<Vec<String>, RegistryError> {
        let client = self.pool.get().await.map_err(db)?;
        let pg: &tokio_postgres::Client = &client;
        let level = level_in(pg, subject).await?;
        let history = match spec {
            Some(spec) => {
                let v = self.version(subject, spec, false).await?;
                vec![(v.version, parse_stored(&v.schema)?)]
            }
            None => history_in(pg, subject).await?,
        };
        // A single named version is checked as if it were the whole history.
        let level = match (spec, level) {
            (Some(_), Level::BackwardTransitive) => Level::Backward,
            (Some(_), Level::ForwardTransitive) => Level::Forward,
            (Some(_), Level::FullTransitive) => Level::Full,
            (_, l) => l,
        };
        Ok(compat::check(level, &schema.schema, &history))
    }
}

fn parse_stored(canonical: &str) -> Result<apache_avro::Schema, RegistryError> {
    compat::parse(canonical)
        .map(|p| p.schema)
        .map_err(|e| RegistryError::Store(format!("a stored schema no longer parses: {e}")))
}

async fn level_in<C: tokio_postgres::GenericClient>(
    client: &C,
    subject: &str,
) -> Result<Level, RegistryError> {
    let row = client
        .query_one(
            "SELECT coalesce(
                (SELECT compatibility FROM pgcdc_registry.config WHERE subject = $1),
                (SELECT compatibility FROM pgcdc_registry.config WHERE subject = ''),
                'BACKWARD')",
            &[&subject],
        )
        .await
        .map_err(db)?;
    row.get::<_, String>(0)
        .parse()
        .map_err(RegistryError::Store)
}

async fn history_in<C: tokio_postgres::GenericClient>(
    client: &C,
    subject: &str,
) -> Result<Vec<(i32, apache_avro::Schema)>, RegistryError> {
    let rows = client
        .query(
            "SELECT v.version, s.canonical FROM pgcdc_registry.versions v
             JOIN pgcdc_registry.schemas s ON s.id = v.schema_id
             WHERE v.subject = $1 AND NOT v.deleted ORDER BY v.version",
            &[&subject],
        )
        .await
        .map_err(db)?;
    rows.iter()
        .map(|r| Ok((r.get(0), parse_stored(&r.get::<_, String>(1))?)))
        .collect()
}
