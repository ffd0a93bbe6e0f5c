//! `pgcdc check`: preflight against the live systems.
//!
//! Guarantee: every check yields exactly one [`Finding`] (pass, warn or
//! fail) with a fix hint for anything not passing; an unreachable system
//! fails its checks rather than skipping them, and the report fails if any
//! finding fails. Checks only read: they never create a slot, publication
//! or topic.
//!
//! ```text
//!  source Postgres ─► wal_level, slots, senders, role, tables, publication, slot state
//!  Kafka           ─► metadata, topic configs
//!  registry        ─► GET /config
//!  target Postgres ─► connect, CREATE privilege
//! ```

use std::fmt;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use tokio_postgres::Client;

use crate::config::{split_table, Config};
use crate::secret::Dsn;
use crate::sink;
use crate::sink::CreateClient as _;
use crate::source::slot::quote_ident;

/// How long one system may take to answer before its check fails.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Pass,
    Warn,
    Fail,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Pass => "PASS",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        })
    }
}

/// The outcome of one check.
#[derive(Debug, Clone)]
pub struct Finding {
    /// Stable dotted name, such as `postgres.wal_level`.
    pub check: String,
    pub status: Status,
    pub detail: String,
    /// What to do about a warning or failure.
    pub hint: Option<String>,
}

/// All findings of one `pgcdc check` run.
#[derive(Debug, Default)]
pub struct Report {
    pub findings: Vec<Finding>,
}

impl Report {
    fn pass(&mut self, check: &str, detail: impl Into<String>) {
        self.add(check, Status::Pass, detail, None::<String>);
    }

    fn warn(&mut self, check: &str, detail: impl Into<String>, hint: impl Into<String>) {
        self.add(check, Status::Warn, detail, Some(hint));
    }

    fn fail(&mut self, check: &str, detail: impl Into<String>, hint: impl Into<String>) {
        self.add(check, Status::Fail, detail, Some(hint));
    }

    fn add(
        &mut self,
        check: &str,
        status: Status,
        detail: impl Into<String>,
        hint: Option<impl Into<String>>,
    ) {
        self.findings.push(Finding {
            check: check.to_string(),
            status,
            detail: detail.into(),
            hint: hint.map(Into::into),
        });
    }

    pub fn failed(&self) -> bool {
        self.findings.iter().any(|f| f.status == Status::Fail)
    }

    /// One line per check, with the hint on an indented line below.
    pub fn render(&self) -> String {
        let width = self
            .findings
            .iter()
            .map(|f| f.check.len())
            .max()
            .unwrap_or(0);
        let mut out = String::new();
        for f in &self.findings {
            out.push_str(&format!("{}  {:width$}  {}\n", f.status, f.check, f.detail));
            if let Some(hint) = &f.hint {
                out.push_str(&format!("      {:width$}  fix: {hint}\n", ""));
            }
        }
        let (fails, warns) = self
            .findings
            .iter()
            .fold((0, 0), |(f, w), x| match x.status {
                Status::Fail => (f + 1, w),
                Status::Warn => (f, w + 1),
                Status::Pass => (f, w),
            });
        out.push_str(&format!(
            "{} checks: {} failed, {} warnings\n",
            self.findings.len(),
            fails,
            warns
        ));
        out
    }
}

/// Runs every check against the systems the config names.
pub async fn run(config: &Config) -> Report {
    let mut report = Report::default();
    check_source(config, &mut report).await;
    check_kafka(config, &mut report).await;
    check_registry(config, &mut report).await;
    check_target(config, &mut report).await;
    report
}

async fn connect_timed(dsn: &Dsn) -> Result<Client, String> {
    match tokio::time::timeout(CHECK_TIMEOUT, crate::source::connect(dsn)).await {
        Ok(Ok(c)) => Ok(c),
        // The server's message, not tokio-postgres' bare "db error".
        Ok(Err(e)) => Err(crate::source::error_text(&e)),
        Err(_) => Err(format!("no answer within {}s", CHECK_TIMEOUT.as_secs())),
    }
}

/// How the session is protected: `TLSv1.3, sslmode=verify-full`.
async fn encryption(client: &Client, dsn: &Dsn) -> String {
    let mode = crate::source::tls::Endpoint::parse(dsn)
        .map(|e| e.tls.mode.as_str())
        .unwrap_or("?");
    let tls = client
        .query_opt(
            "SELECT version FROM pg_stat_ssl WHERE pid = pg_backend_pid() AND ssl",
            &[],
        )
        .await;
    match tls {
        Ok(Some(row)) => format!("{}, sslmode={mode}", row.get::<_, String>(0)),
        Ok(None) => format!("not encrypted, sslmode={mode}"),
        Err(_) => format!("sslmode={mode}"),
    }
}

/// What to look at when connecting failed.
fn connect_hint(error: &str, field: &str) -> String {
    if error.contains("certificate") || error.contains("TLS") {
        format!(
            "check {field}'s sslrootcert (the CA that signed the server's certificate) and, \
             with sslmode=verify-full, that its host is a name in the certificate"
        )
    } else {
        format!("check {field}, that Postgres listens there, and pg_hba.conf")
    }
}

async fn check_source(config: &Config, r: &mut Report) {
    let src = &config.source;
    let client = match connect_timed(&src.url).await {
        Ok(c) => c,
        Err(e) => {
            let hint = connect_hint(&e, "source.url");
            r.fail(
                "postgres.connect",
                format!("cannot connect to {}: {e}", src.url.redacted()),
                hint,
            );
            // pg_hba.conf may refuse one kind and take the other: say both.
            check_replication(config, r).await;
            return;
        }
    };
    let version: String = match client.query_one("SHOW server_version", &[]).await {
        Ok(row) => row.get(0),
        Err(e) => {
            r.fail(
                "postgres.connect",
                format!("connected but cannot query: {e}"),
                "check the role's permissions",
            );
            return;
        }
    };
    let tls = encryption(&client, &src.url).await;
    r.pass(
        "postgres.connect",
        format!(
            "connected to {} (PostgreSQL {version}; {tls})",
            src.url.redacted()
        ),
    );
    check_replication(config, r).await;
    if let Err(e) = source_checks(&client, config, r).await {
        r.fail(
            "postgres.query",
            format!("a catalog query failed: {}", crate::source::error_text(&e)),
            "check that the role can read pg_catalog",
        );
    }
}

/// Opens the connector's own kind of connection (replication protocol,
/// its TLS settings) without starting it: pg_hba.conf and TLS may treat it
/// unlike a SQL session.
async fn check_replication(config: &Config, r: &mut Report) {
    let name = "postgres.replication";
    let hint = |e: &str| {
        format!(
            "{}; the connector's connection uses the replication protocol",
            connect_hint(e, "source.url")
        )
    };
    let settings = match crate::connector::replication_config(config) {
        Ok(s) => s,
        Err(e) => {
            let e = e.to_string();
            r.fail(
                name,
                format!("cannot open a replication connection: {e}"),
                hint(&e),
            );
            return;
        }
    };
    let attempt = async {
        let mut session = pgwire_replication::ReplicationClient::connect_gated(settings).await?;
        session.identify_system().await
    };
    match tokio::time::timeout(CHECK_TIMEOUT, attempt).await {
        Ok(Ok(system)) => r.pass(
            name,
            format!(
                "a replication connection opens (timeline {}, WAL at {})",
                system.timeline, system.xlogpos
            ),
        ),
        Ok(Err(e)) => {
            let e = e.to_string();
            r.fail(
                name,
                format!("cannot open a replication connection: {e}"),
                hint(&e),
            );
        }
        Err(_) => r.fail(
            name,
            format!("no answer within {}s", CHECK_TIMEOUT.as_secs()),
            hint(""),
        ),
    }
}

async fn source_checks(
    client: &Client,
    config: &Config,
    r: &mut Report,
) -> Result<(), tokio_postgres::Error> {
    let src = &config.source;

    let wal_level: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal_level == "logical" {
        r.pass("postgres.wal_level", "wal_level=logical");
    } else {
        r.fail(
            "postgres.wal_level",
            format!("wal_level is '{wal_level}', logical decoding needs 'logical'"),
            "ALTER SYSTEM SET wal_level = logical; then restart Postgres",
        );
    }

    let row = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int,
                    (SELECT count(*) FROM pg_replication_slots)::int,
                    EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1),
                    current_setting('max_wal_senders')::int,
                    (SELECT count(*) FROM pg_stat_replication)::int",
            &[&src.slot],
        )
        .await?;
    let (max_slots, used_slots, slot_exists): (i32, i32, bool) =
        (row.get(0), row.get(1), row.get(2));
    let (max_senders, used_senders): (i32, i32) = (row.get(3), row.get(4));
    if slot_exists {
        r.pass(
            "postgres.replication_slots",
            format!(
                "slot '{}' exists ({used_slots}/{max_slots} slots used)",
                src.slot
            ),
        );
    } else if used_slots < max_slots {
        r.pass(
            "postgres.replication_slots",
            format!(
                "{} of {max_slots} replication slots free",
                max_slots - used_slots
            ),
        );
    } else {
        r.fail(
            "postgres.replication_slots",
            format!("all {max_slots} replication slots are in use"),
            "drop an unused slot (SELECT pg_drop_replication_slot(name)) or raise max_replication_slots and restart",
        );
    }
    if used_senders < max_senders {
        r.pass(
            "postgres.wal_senders",
            format!(
                "{} of {max_senders} WAL senders free",
                max_senders - used_senders
            ),
        );
    } else {
        r.fail(
            "postgres.wal_senders",
            format!("all {max_senders} WAL senders are in use"),
            "raise max_wal_senders and restart Postgres",
        );
    }

    let row = client
        .query_one(
            "SELECT current_user::text, rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user",
            &[],
        )
        .await?;
    let (role, superuser, replication): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
    if superuser || replication {
        let how = if superuser {
            "is superuser"
        } else {
            "has REPLICATION"
        };
        r.pass("postgres.role", format!("role '{role}' {how}"));
    } else {
        r.fail(
            "postgres.role",
            format!("role '{role}' has neither REPLICATION nor superuser"),
            format!("ALTER ROLE {} WITH REPLICATION", quote_ident(&role)),
        );
    }

    for table in &src.tables {
        check_table(client, table, &role, r).await?;
    }
    for (partition, ancestor) in
        crate::source::catalog::listed_partitions(client, &src.tables).await?
    {
        r.fail(
            &format!("table.{partition}"),
            crate::source::catalog::listed_partition_problem(&partition, &ancestor),
            format!("remove {partition} (or {ancestor}) from source.tables"),
        );
    }
    for (table, column) in config.tenant_columns() {
        let name = format!("partitioning.{table}.tenant_column");
        match crate::source::catalog::tenant_column_problem(client, table, column).await? {
            None => r.pass(
                &name,
                format!("{table}.{column} names the tenant, and deletes carry it"),
            ),
            Some(problem) => r.fail(
                &name,
                problem,
                "make the column part of the replica identity, or set REPLICA IDENTITY FULL",
            ),
        }
    }
    for (table, c) in &src.columns {
        let name = format!("source.columns.\"{table}\"");
        match crate::source::catalog::excluded_column_problem(client, table, &c.exclude).await? {
            None => r.pass(
                &name,
                format!("{} left out of {table}'s events", c.exclude.join(", ")),
            ),
            Some(problem) => r.fail(
                &name,
                problem,
                "name columns the table has, outside its key",
            ),
        }
    }
    check_publication(client, config, superuser, r).await?;
    check_slot(client, config, r).await
}

async fn check_table(
    client: &Client,
    table: &str,
    role: &str,
    r: &mut Report,
) -> Result<(), tokio_postgres::Error> {
    let name = format!("table.{table}");
    let Some((schema, rel)) = split_table(table) else {
        return Ok(()); // validation already refused it
    };
    // The table as SQL spells it, for the fixes we suggest.
    let sql = crate::source::slot::sql_table(table);
    let row = client
        .query_one(
            "SELECT c.oid IS NOT NULL,
                    coalesce(has_table_privilege(c.oid, 'SELECT'), false),
                    coalesce(c.relreplident::text, ''),
                    EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary),
                    EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisreplident),
                    coalesce(c.relkind = 'p', false)
             FROM (SELECT to_regclass(format('%I.%I', $1::text, $2::text))::oid AS oid) r
             LEFT JOIN pg_class c ON c.oid = r.oid",
            &[&schema, &rel],
        )
        .await?;
    let (exists, select, ident, has_pk, has_ident_index): (bool, bool, String, bool, bool) =
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    let partitioned: bool = row.get(5);
    if !exists {
        r.fail(
            &name,
            format!("table {table} does not exist"),
            "create it, or remove it from source.tables",
        );
        return Ok(());
    }
    if !select {
        r.fail(
            &name,
            format!("role '{role}' lacks SELECT on {table}; the snapshot cannot read it"),
            format!("GRANT SELECT ON {sql} TO {}", quote_ident(role)),
        );
        return Ok(());
    }
    // Postgres checks each partition's (and inheritance child's) own
    // replica identity; a partitioned table's does not reach them.
    let bare: Vec<String> =
        crate::source::catalog::without_replica_identity(client, &[table.to_string()])
            .await?
            .into_iter()
            .filter_map(|(t, listed)| (!listed).then_some(t))
            .collect();
    if !bare.is_empty() {
        r.fail(
            &name,
            format!(
                "{table}: {} without a replica identity: their updates and deletes cannot be captured, and fail at the source once published",
                bare.join(", ")
            ),
            format!(
                "on each: add a primary key (to {sql}, which its partitions take), or ALTER TABLE <partition> REPLICA IDENTITY FULL"
            ),
        );
        return Ok(());
    }
    if partitioned {
        r.pass(
            &name,
            format!("{table}: SELECT granted, every partition has a replica identity"),
        );
        return Ok(());
    }
    match (ident.as_str(), has_pk, has_ident_index) {
        ("d", true, _) => r.pass(&name, format!("{table}: SELECT granted, primary key is the replica identity")),
        ("d", false, _) => r.fail(
            &name,
            format!("{table} has no primary key and REPLICA IDENTITY DEFAULT: its updates and deletes cannot be captured"),
            format!("add a primary key, or ALTER TABLE {sql} REPLICA IDENTITY USING INDEX <unique index>"),
        ),
        ("i", _, true) => r.pass(&name, format!("{table}: SELECT granted, replica identity is a unique index")),
        ("i", _, false) => r.fail(
            &name,
            format!("{table} has REPLICA IDENTITY USING INDEX but the index is gone"),
            format!("ALTER TABLE {sql} REPLICA IDENTITY USING INDEX <unique index>, or DEFAULT with a primary key"),
        ),
        ("f", _, _) => r.warn(
            &name,
            format!("{table} has REPLICA IDENTITY FULL: every update and delete writes the whole old row to WAL"),
            "prefer a primary key with REPLICA IDENTITY DEFAULT unless you need full before-images",
        ),
        _ => r.fail(
            &name,
            format!("{table} has REPLICA IDENTITY NOTHING: its updates and deletes cannot be captured"),
            format!("ALTER TABLE {sql} REPLICA IDENTITY DEFAULT (with a primary key)"),
        ),
    }
    Ok(())
}

async fn check_publication(
    client: &Client,
    config: &Config,
    superuser: bool,
    r: &mut Report,
) -> Result<(), tokio_postgres::Error> {
    let src = &config.source;
    let name = "postgres.publication";
    let row = client
        .query_opt(
            "SELECT puballtables, pubinsert, pubupdate, pubdelete, pubtruncate
             FROM pg_publication WHERE pubname = $1",
            &[&src.publication],
        )
        .await?;
    let Some(row) = row else {
        // CREATE PUBLICATION ... FOR TABLE needs CREATE on the database and
        // ownership of every table.
        let sql_names = crate::source::slot::sql_tables(&src.tables);
        let row = client
            .query_one(
                "SELECT has_database_privilege(current_database(), 'CREATE'),
                        coalesce(array_agg(t) FILTER (WHERE NOT pg_has_role(c.relowner, 'USAGE')), '{}')
                 FROM unnest($1::text[]) t
                 LEFT JOIN pg_class c ON c.oid = to_regclass(t)",
                &[&sql_names],
            )
            .await?;
        let (can_create, not_owned): (bool, Vec<String>) = (row.get(0), row.get(1));
        if superuser || (can_create && not_owned.is_empty()) {
            r.pass(
                name,
                format!(
                    "publication '{}' does not exist; `pgcdc run` will create it",
                    src.publication
                ),
            );
        } else {
            r.fail(
                name,
                format!(
                    "publication '{}' does not exist and this role cannot create it{}",
                    src.publication,
                    if not_owned.is_empty() {
                        String::new()
                    } else {
                        format!(" (it does not own {})", not_owned.join(", "))
                    }
                ),
                format!(
                    "as the tables' owner: CREATE PUBLICATION {} FOR TABLE {}",
                    src.publication,
                    sql_names.join(", ")
                ),
            );
        }
        return Ok(());
    };
    let all_tables: bool = row.get(0);
    let ops: [(bool, &str); 4] = [
        (row.get(1), "insert"),
        (row.get(2), "update"),
        (row.get(3), "delete"),
        (row.get(4), "truncate"),
    ];
    let shortfall = crate::source::slot::publication_gaps(client, config)
        .await?
        .shortfall(&src.publication);
    let missing_ops: Vec<&str> = ops
        .iter()
        .filter(|(on, _)| !on)
        .map(|(_, op)| *op)
        .collect();
    if let Some((problem, fix)) = shortfall {
        r.fail(name, problem, fix);
    } else if missing_ops.iter().any(|op| *op != "truncate") {
        r.fail(
            name,
            format!(
                "publication '{}' does not publish {}",
                src.publication,
                missing_ops.join(", ")
            ),
            format!(
                "ALTER PUBLICATION {} SET (publish = 'insert, update, delete, truncate')",
                src.publication
            ),
        );
    } else if !missing_ops.is_empty() {
        r.warn(
            name,
            format!(
                "publication '{}' does not publish truncate; truncates will not reach Kafka",
                src.publication
            ),
            format!(
                "ALTER PUBLICATION {} SET (publish = 'insert, update, delete, truncate')",
                src.publication
            ),
        );
    } else {
        let scope = if all_tables {
            "FOR ALL TABLES"
        } else {
            "the captured tables"
        };
        r.pass(
            name,
            format!("publication '{}' covers {scope}", src.publication),
        );
    }
    Ok(())
}

async fn check_slot(
    client: &Client,
    config: &Config,
    r: &mut Report,
) -> Result<(), tokio_postgres::Error> {
    let src = &config.source;
    let name = "postgres.slot";
    let Some(status) = crate::source::slot::status(client, &src.slot).await? else {
        let topic = crate::snapshot_marker::topic(config);
        let markers = crate::snapshot_marker::latest(&config.kafka, &topic, &src.slot).await;
        let gone = markers
            .as_ref()
            .ok()
            .and_then(|m| crate::source::slot::SlotError::vanished(config, m.as_slice()));
        match (gone, markers) {
            (Some(e), _) => {
                r.fail(
                    name,
                    e.to_string(),
                    crate::source::slot::recovery_hint(&src.slot),
                );
            }
            (_, Err(e)) => r.pass(name, format!("slot '{}' does not exist; `pgcdc run` creates it and takes the initial snapshot (whether it existed before could not be read from {topic}: {e})", src.slot)),
            _ => r.pass(name, format!("slot '{}' does not exist yet; `pgcdc run` creates it and takes the initial snapshot", src.slot)),
        }
        return Ok(());
    };
    let current_db: String = client
        .query_one("SELECT current_database()::text", &[])
        .await?
        .get(0);
    let (plugin, db, active) = (&status.plugin, &status.database, status.active);
    let wal_status = status.wal_status.clone().unwrap_or_default();
    let safe = status.safe_wal_size;
    let retained = status.retained_wal_bytes;
    let lag = status.lag_bytes;
    let confirmed = status.confirmed_flush_lsn.clone().unwrap_or_default();
    let recovery = crate::source::slot::recovery_hint(&src.slot);
    // A physical slot has no plugin, so this covers it too.
    if plugin != "pgoutput" {
        r.fail(
            name,
            format!(
                "slot '{}' has plugin '{plugin}', not a logical pgoutput slot",
                src.slot
            ),
            "choose another source.slot, or drop this slot if it is unused",
        );
    } else if *db != current_db {
        r.fail(
            name,
            format!(
                "slot '{}' belongs to database '{db}', not '{current_db}'",
                src.slot
            ),
            "choose another source.slot name for this database",
        );
    } else if wal_status == "lost" {
        r.fail(
            name,
            format!(
                "slot '{}' is invalidated (wal_status=lost): the WAL it needed was removed",
                src.slot
            ),
            recovery,
        );
    } else {
        let figures = format!(
            "confirmed_flush_lsn={confirmed}, lag {} bytes, WAL retained {} bytes, wal_status={wal_status}{}",
            lag.unwrap_or(0),
            retained.unwrap_or(0),
            safe.map(|s| format!(", safe_wal_size={s}")).unwrap_or_default()
        );
        if wal_status == "unreserved" {
            r.warn(
                name,
                format!("slot '{}' is about to be invalidated: {figures}", src.slot),
                "start `pgcdc run` now so the slot advances, or raise max_slot_wal_keep_size",
            );
        } else if active {
            r.warn(
                name,
                format!(
                    "slot '{}' is in use by another connection: {figures}",
                    src.slot
                ),
                "stop the other consumer before `pgcdc run`; a slot has one reader at a time",
            );
        } else {
            r.pass(name, format!("slot '{}' is healthy: {figures}", src.slot));
        }
    }
    Ok(())
}

async fn check_kafka(config: &Config, r: &mut Report) {
    let k = &config.kafka;
    let admin: AdminClient<sink::Quiet> = match sink::client_config(k).client() {
        Ok(a) => a,
        Err(e) => {
            r.fail(
                "kafka.connect",
                format!("cannot create a Kafka client: {e}"),
                "check kafka.properties",
            );
            return;
        }
    };
    let admin = std::sync::Arc::new(admin);
    let probe = admin.clone();
    let metadata =
        tokio::task::spawn_blocking(move || probe.inner().fetch_metadata(None, CHECK_TIMEOUT))
            .await;
    let metadata = match metadata {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            r.fail(
                "kafka.connect",
                format!("broker at {} unreachable: {e}", k.brokers),
                "check kafka.brokers and the SASL/SSL settings in kafka.properties",
            );
            return;
        }
        Err(e) => {
            r.fail(
                "kafka.connect",
                format!("metadata task failed: {e}"),
                "retry",
            );
            return;
        }
    };
    r.pass(
        "kafka.connect",
        format!(
            "{} broker(s) reachable at {}",
            metadata.brokers().len(),
            k.brokers
        ),
    );
    let existing: Vec<String> = metadata
        .topics()
        .iter()
        .map(|t| t.name().to_string())
        .collect();
    let partitions: std::collections::BTreeMap<String, i32> = metadata
        .topics()
        .iter()
        .map(|t| (t.name().to_string(), t.partitions().len() as i32))
        .collect();
    let opts = AdminOptions::new().request_timeout(Some(CHECK_TIMEOUT));
    for (table, o) in &config.outbox {
        r.pass(
            &format!("kafka.outbox.{table}"),
            format!(
                "{table} is routed to domain-event topics {} (created when first routed to, cleanup.policy=delete)",
                o.topic.replace("{prefix}", &k.topic_prefix)
            ),
        );
    }
    let topics = config
        .changelog_tables()
        .flat_map(|t| config.topics_of(t).into_iter().map(move |topic| (t, topic)));
    for (table, topic) in topics {
        let name = format!("kafka.topic.{topic}");
        if !existing.contains(&topic) {
            r.pass(
                &name,
                format!("topic {topic} does not exist yet; `pgcdc run` creates it ({} partitions, cleanup.policy={})", k.partitions, k.cleanup_policy.as_str()),
            );
            continue;
        }
        let count = partitions.get(&topic).copied().unwrap_or(0);
        partition_checks(config, table, &topic, count, r);
        let spec = ResourceSpecifier::Topic(&topic);
        match admin.describe_configs([&spec], &opts).await {
            Ok(results) => match results.into_iter().next() {
                Some(Ok(resource)) => {
                    let get = |key: &str| {
                        resource
                            .get(key)
                            .and_then(|e| e.value.clone())
                            .unwrap_or_else(|| "?".to_string())
                    };
                    // `pgcdc run` fits its bounds to such a topic.
                    let limit = get("max.message.bytes").parse::<usize>().ok();
                    let lowered = limit.and_then(|l| {
                        crate::sink::lowered_bound(k.max_message_bytes, l).map(|b| (l, b))
                    });
                    match lowered {
                        Some((limit, bound)) => r.warn(
                            &name,
                            format!(
                                "topic {topic} takes records of at most {limit} bytes (max.message.bytes), less than kafka.max_message_bytes ({}) and a record's framing: `pgcdc run` quarantines events over {bound} bytes as oversized and keeps its batches under the limit",
                                k.max_message_bytes,
                            ),
                            format!(
                                "set kafka.max_message_bytes to at most {bound} to say so, or raise the topic's max.message.bytes"
                            ),
                        ),
                        None => r.pass(
                            &name,
                            format!(
                                "topic {topic}: cleanup.policy={}, retention.ms={}, max.message.bytes={}",
                                get("cleanup.policy"),
                                get("retention.ms"),
                                get("max.message.bytes")
                            ),
                        ),
                    }
                }
                Some(Err(code)) => r.fail(
                    &name,
                    format!("cannot read the configs of topic {topic}: {code}"),
                    "grant DescribeConfigs on the topic to this principal",
                ),
                None => r.fail(
                    &name,
                    format!("no config returned for topic {topic}"),
                    "check the broker",
                ),
            },
            Err(e) => r.fail(
                &name,
                format!("cannot read the configs of topic {topic}: {e}"),
                "grant DescribeConfigs on the topic to this principal",
            ),
        }
    }
}

/// A changelog topic's partition count against `kafka.partitions` and the
/// table's salting: keys hash to `murmur2(key) mod partitions`, so a
/// different count puts every key's new events elsewhere.
fn partition_checks(config: &Config, table: &str, topic: &str, count: i32, r: &mut Report) {
    let name = format!("kafka.partitions.{topic}");
    let wanted = config.kafka.partitions;
    if count != wanted {
        r.warn(
            &name,
            format!(
                "topic {topic} has {count} partitions but kafka.partitions is {wanted}; pgcdc keeps \
                 the topic as it is. Adding partitions remaps keys (murmur2 of the key mod the \
                 partition count): a key's later changes land in another partition than its \
                 earlier ones, and consumers lose its order across the change"
            ),
            "follow the README's \"Changing a topic's partition count\": stop the connector, let \
             every consumer catch up, add partitions, restart; or set kafka.partitions to the \
             topic's count",
        );
    } else {
        r.pass(
            &name,
            format!("topic {topic} has {count} partitions, as kafka.partitions says"),
        );
    }
    if let Some(shards) = config.partitioning.get(table).and_then(|p| p.salt_shards) {
        let name = format!("partitioning.{table}");
        if (shards as i32) > count {
            r.warn(
                &name,
                format!(
                    "salt_shards is {} but topic {topic} has {count} partitions: a salted key \
                     spreads over {count} at most",
                    shards
                ),
                "add partitions before the topic holds data, or lower salt_shards",
            );
        } else {
            r.pass(
                &name,
                format!(
                    "salted keys of {table} spread over {} of {count} partitions (order across \
                     shards is lost; the materializer's position guard keeps the newest)",
                    shards
                ),
            );
        }
    }
}

async fn check_registry(config: &Config, r: &mut Report) {
    let reg = &config.registry;
    let name = "registry.connect";
    let url = format!("{}/config", reg.url.expose().trim_end_matches('/'));
    let client = match reqwest::Client::builder().timeout(CHECK_TIMEOUT).build() {
        Ok(c) => c,
        Err(e) => {
            r.fail(
                name,
                format!("cannot build an HTTP client: {e}"),
                "check the TLS setup",
            );
            return;
        }
    };
    let mut request = client.get(&url);
    if let Some(user) = &reg.username {
        request = request.basic_auth(user, reg.password.as_ref().map(|p| p.expose()));
    }
    match request.send().await {
        Ok(resp) if resp.status().is_success() => {
            let level = resp
                .json::<serde_json::Value>()
                .await
                .ok()
                .and_then(|v| {
                    v.get("compatibilityLevel")
                        .and_then(|l| l.as_str())
                        .map(str::to_string)
                })
                .unwrap_or_else(|| "?".to_string());
            r.pass(
                name,
                format!(
                    "registry at {} answers (compatibility {level})",
                    reg.url.redacted()
                ),
            );
        }
        Ok(resp) if resp.status().as_u16() == 401 || resp.status().as_u16() == 403 => r.fail(
            name,
            format!(
                "registry at {} refused the credentials ({})",
                reg.url.redacted(),
                resp.status()
            ),
            "check registry.username and registry.password",
        ),
        Ok(resp) => r.fail(
            name,
            format!(
                "registry at {} answered {} to GET /config",
                reg.url.redacted(),
                resp.status()
            ),
            "check registry.url points at a Confluent-compatible schema registry",
        ),
        Err(e) => r.fail(
            name,
            format!(
                "registry at {} unreachable: {}",
                reg.url.redacted(),
                e.without_url()
            ),
            "start it (`pgcdc registry`, or `scripts/stack up` locally) or fix registry.url",
        ),
    }
}

async fn check_target(config: &Config, r: &mut Report) {
    let Some(target) = &config.target else {
        return;
    };
    let name = "target.connect";
    let client = match connect_timed(&target.url).await {
        Ok(c) => c,
        Err(e) => {
            let hint = connect_hint(&e, "target.url");
            r.fail(
                name,
                format!("cannot connect to {}: {e}", target.url.redacted()),
                hint,
            );
            return;
        }
    };
    match client
        .query_one(
            "SELECT has_database_privilege(current_database(), 'CREATE')",
            &[],
        )
        .await
    {
        Ok(row) if row.get::<_, bool>(0) => r.pass(
            name,
            format!(
                "connected to {} ({}); the role can create schemas",
                target.url.redacted(),
                encryption(&client, &target.url).await
            ),
        ),
        Ok(_) => r.fail(
            name,
            format!(
                "connected to {}, but the role cannot create schemas",
                target.url.redacted()
            ),
            "GRANT CREATE ON DATABASE <target db> TO <role>",
        ),
        Err(e) => r.fail(
            name,
            format!("connected but cannot query: {e}"),
            "check the role",
        ),
    }
}
