//! The fault suite: crashes, outages and slot trouble under a continuous
//! workload, each scenario ending with the same three checks.
//!
//! ```text
//!  source triggers ──► audit.changes (every committed row change, its txid)
//!        │                         │
//!  pgcdc run ──► Kafka ────────────┴─► 1. every audited change is in Kafka (or in the last snapshot)
//!        │
//!  pgcdc materialize ──► mirrors, read models ──► 2. equal to the source (checksums)
//!        └─► target triggers ──► audit.applied ──► 3. no (key, position) applied twice
//! ```
//!
//! `scripts/test` runs reduced counts; `PGCDC_SOAK=1` (see `scripts/soak`)
//! runs the full ones, and every scenario appends its figures to the file
//! named by `PGCDC_FAULT_REPORT` for the summary table.

mod crash;
mod outage;
mod slot_trouble;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use apache_avro::types::Value;

use crate::materialize as mat;
use crate::support::{self, ConfigFile, Decoder};

/// Whether the full soak runs (`PGCDC_SOAK=1`).
pub(crate) fn soak() -> bool {
    std::env::var("PGCDC_SOAK").is_ok_and(|v| v == "1")
}

/// `ci` iterations in `scripts/test`, `full` in the soak.
pub(crate) fn count(ci: usize, full: usize) -> usize {
    if soak() {
        full
    } else {
        ci
    }
}

/// Settings of a scratch cluster that can be a source.
pub(crate) const LOGICAL: [&str; 4] = [
    "wal_level = logical",
    "max_replication_slots = 8",
    "max_wal_senders = 8",
    "max_connections = 60",
];

/// How long an outage lasts.
pub(crate) const OUTAGE: Duration = Duration::from_secs(30);

/// Every committed row change of the captured tables, with its
/// transaction and the WAL insert position at the time, written by
/// triggers in the same transaction (so exactly the committed ones stay).
const SOURCE_AUDIT: &str = r#"
CREATE SCHEMA audit;
CREATE TABLE audit.changes (
    tbl  text NOT NULL,
    op   text NOT NULL,
    id   bigint,
    txid bigint NOT NULL,
    lsn  pg_lsn NOT NULL
);
CREATE FUNCTION audit.change() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE
    op text := 't';
    id bigint;
BEGIN
    IF TG_OP = 'INSERT' THEN op := 'c'; id := NEW.id;
    ELSIF TG_OP = 'UPDATE' THEN op := 'u'; id := NEW.id;
    ELSIF TG_OP = 'DELETE' THEN op := 'd'; id := OLD.id;
    END IF;
    INSERT INTO audit.changes
    VALUES (TG_TABLE_NAME, op, id, txid_current() % 4294967296, pg_current_wal_insert_lsn());
    RETURN NULL;
END $$;
GRANT USAGE ON SCHEMA audit TO PUBLIC;
GRANT SELECT ON audit.changes TO PUBLIC;
CREATE TRIGGER audit_row AFTER INSERT OR UPDATE OR DELETE ON public.customers
    FOR EACH ROW EXECUTE FUNCTION audit.change();
CREATE TRIGGER audit_truncate AFTER TRUNCATE ON public.customers
    FOR EACH STATEMENT EXECUTE FUNCTION audit.change();
CREATE TRIGGER audit_row AFTER INSERT OR UPDATE OR DELETE ON public.orders
    FOR EACH ROW EXECUTE FUNCTION audit.change();
CREATE TRIGGER audit_truncate AFTER TRUNCATE ON public.orders
    FOR EACH STATEMENT EXECUTE FUNCTION audit.change();
"#;

/// Every row the materializer writes to a mirror or a tombstone, with its
/// position, written by triggers that an event trigger attaches to each
/// table as the materializer creates it. Run as a superuser. A rebuild's
/// swap (`pgcdc rebuild`, under its EXCLUSIVE locks on the mirrors)
/// re-inserts rows already applied; it is no application of a change.
const TARGET_AUDIT: &str = r#"
CREATE SCHEMA audit;
CREATE TABLE audit.applied (
    tbl        text NOT NULL,
    key        text NOT NULL,
    commit_lsn bigint NOT NULL,
    seq        bigint NOT NULL
);
GRANT USAGE ON SCHEMA audit TO PUBLIC;
GRANT SELECT ON audit.applied TO PUBLIC;
CREATE FUNCTION audit.rebuilding() RETURNS boolean LANGUAGE sql
SET search_path = pg_catalog AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_locks l
        JOIN pg_class c ON c.oid = l.relation
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation'
          AND l.mode = 'ExclusiveLock' AND n.nspname = 'mirror')
$$;
CREATE FUNCTION audit.row_applied() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog AS $$
BEGIN
    IF NOT audit.rebuilding() THEN
        INSERT INTO audit.applied
        VALUES (TG_TABLE_NAME, NEW.id::text, NEW._pgcdc_commit_lsn, NEW._pgcdc_seq);
    END IF;
    RETURN NULL;
END $$;
CREATE FUNCTION audit.tombstone_applied() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog AS $$
BEGIN
    IF NOT audit.rebuilding() THEN
        INSERT INTO audit.applied VALUES ('tombstone ' || NEW.mirror, NEW.key, NEW.commit_lsn, NEW.seq);
    END IF;
    RETURN NULL;
END $$;
CREATE FUNCTION audit.attach() RETURNS event_trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog AS $$
DECLARE r record;
BEGIN
    FOR r IN SELECT * FROM pg_event_trigger_ddl_commands() WHERE command_tag = 'CREATE TABLE' LOOP
        IF r.schema_name = 'mirror' THEN
            EXECUTE format('CREATE TRIGGER audit_applied AFTER INSERT OR UPDATE ON %s
                FOR EACH ROW EXECUTE FUNCTION audit.row_applied()', r.object_identity);
        ELSIF r.object_identity = 'pgcdc_state.tombstones' THEN
            EXECUTE format('CREATE TRIGGER audit_applied AFTER INSERT OR UPDATE ON %s
                FOR EACH ROW EXECUTE FUNCTION audit.tombstone_applied()', r.object_identity);
        END IF;
    END LOOP;
END $$;
CREATE EVENT TRIGGER audit_attach ON ddl_command_end WHEN TAG IN ('CREATE TABLE')
    EXECUTE FUNCTION audit.attach();
"#;

/// Where a scenario's pipeline runs, and its config.
pub(crate) struct Scenario {
    pub name: String,
    pub source_url: String,
    pub target_url: String,
    pub brokers: String,
    pub registry: String,
    pub config: ConfigFile,
    pub parsed: pgcdc::config::Config,
}

impl Scenario {
    /// Seeds the demo schema in the source (`orders` orders), installs the
    /// audit triggers on both sides (`*_admin` as superuser), and writes
    /// the pipeline's config.
    #[allow(clippy::too_many_arguments)]
    pub async fn prepare(
        name: &str,
        source_url: &str,
        source_admin: &str,
        target_url: &str,
        target_admin: &str,
        brokers: &str,
        registry: &str,
        orders: i64,
    ) -> Scenario {
        let source = support::connect(source_url).await;
        mat::seed(&source, 999, orders).await;
        support::connect(source_admin)
            .await
            .batch_execute(SOURCE_AUDIT)
            .await
            .expect("source audit");
        support::connect(target_admin)
            .await
            .batch_execute(TARGET_AUDIT)
            .await
            .expect("target audit");
        let toml = format!(
            r#"name = "{name}"
[source]
url = "{source_url}"
slot = "{name}"
publication = "{name}"
tables = ["public.customers", "public.orders"]
[kafka]
brokers = "{brokers}"
topic_prefix = "{name}"
[registry]
url = "{registry}"
[target]
url = "{target_url}"
batch_size = 100
{}"#,
            mat::READ_MODELS
        );
        let config = ConfigFile::write(&toml);
        let parsed = pgcdc::config::Config::load(&config.path).expect("config");
        Scenario {
            name: name.to_string(),
            source_url: source_url.to_string(),
            target_url: target_url.to_string(),
            brokers: brokers.to_string(),
            registry: registry.to_string(),
            config,
            parsed,
        }
    }

    /// [`Scenario::prepare`] in two fresh databases of the stack's
    /// cluster, `<prefix>_src` and `<prefix>_tgt`, with the broker and the
    /// registry given.
    pub async fn on_stack(
        stack: &support::Stack,
        prefix: &str,
        brokers: &str,
        registry: &str,
        orders: i64,
    ) -> (Scenario, support::TestDb, support::TestDb) {
        let source = support::TestDb::create(stack, &format!("{prefix}_src")).await;
        let target = support::TestDb::create(stack, &format!("{prefix}_tgt")).await;
        let s = Scenario::prepare(
            &source.name,
            &source.url,
            &source.admin_url,
            &target.url,
            &target.admin_url,
            brokers,
            registry,
            orders,
        )
        .await;
        (s, source, target)
    }

    pub fn connector(&self) -> support::ConnectorProcess {
        support::ConnectorProcess::start(&self.config)
    }

    pub fn materializer(&self) -> tokio::process::Child {
        mat::materializer(&self.config, &[], &[])
    }

    /// A materializer whose log goes to `log`.
    pub fn materializer_logging_to(&self, log: &std::path::Path) -> tokio::process::Child {
        let file = std::fs::File::create(log).expect("the materializer's log file");
        tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
            .args(["materialize", "--config", self.config.arg()])
            .stderr(file)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn pgcdc materialize")
    }

    /// Runs the three checks once the pipeline has caught up, and returns
    /// (and records) the scenario's figures.
    pub async fn verify(&self, scenario: &str, faults: usize) -> Tally {
        let source = support::connect(&self.source_url).await;
        let target = support::connect(&self.target_url).await;
        support::wait_caught_up(&source, &self.name).await;
        mat::wait_converged(&source, &target).await;

        let (kafka, duplicates) = self.kafka_changes().await;
        let consistent_point = support::initial_marker(&self.parsed)
            .await
            .consistent_point
            .expect("the last snapshot's consistent point");
        let mut audited: BTreeMap<i64, Vec<Change>> = BTreeMap::new();
        let mut written = 0;
        for row in source
            .query(
                "SELECT txid, tbl, op, id, lsn >= $1::text::pg_lsn FROM audit.changes",
                &[&consistent_point],
            )
            .await
            .expect("audit")
        {
            written += 1;
            let after_snapshot: bool = row.get(4);
            audited.entry(row.get(0)).or_default().push(Change {
                table: row.get(1),
                op: row.get(2),
                id: row.get(3),
                after_snapshot,
            });
        }
        let mut tally = Tally {
            scenario: scenario.to_string(),
            faults,
            written,
            duplicates,
            ..Tally::default()
        };
        let mut problems = Vec::new();
        for (txid, changes) in &audited {
            match kafka.get(txid) {
                Some(found) => {
                    let mut want: Vec<_> = changes.iter().map(Change::identity).collect();
                    let mut got: Vec<_> = found.iter().map(Change::identity).collect();
                    want.sort();
                    got.sort();
                    let before_snapshot = changes.iter().all(|c| !c.after_snapshot);
                    let missing = want.iter().filter(|c| !got.contains(c)).count();
                    if want == got {
                        tally.verified += want.len();
                    } else if before_snapshot && got.iter().all(|c| want.contains(c)) {
                        // Partly streamed by a slot that is gone (the
                        // connector stopped inside it, and the slot that
                        // would have replayed it was lost): the last
                        // snapshot holds the rest.
                        tally.verified += want.len() - missing;
                        tally.in_snapshot += missing;
                    } else {
                        tally.lost += missing;
                        problems.push(format!(
                            "transaction {txid}: audited {want:?}, in Kafka {got:?}"
                        ));
                    }
                }
                // Committed before the last snapshot's consistent point:
                // its effect is in that snapshot, not in the stream. (An
                // older slot may have streamed part of it before a stop
                // inside it, the rest never: see below.)
                None if changes.iter().all(|c| !c.after_snapshot) => {
                    tally.in_snapshot += changes.len()
                }
                None => {
                    tally.lost += changes.len();
                    problems.push(format!(
                        "transaction {txid} ({} changes, after the snapshot) is not in Kafka",
                        changes.len()
                    ));
                }
            }
        }
        for txid in kafka.keys().filter(|t| !audited.contains_key(t)) {
            problems.push(format!(
                "transaction {txid} is in Kafka but was never committed"
            ));
        }
        let twice = target
            .query(
                "SELECT tbl, key, commit_lsn, seq, count(*) FROM audit.applied
                 GROUP BY 1, 2, 3, 4 HAVING count(*) > 1 LIMIT 5",
                &[],
            )
            .await
            .expect("applied audit");
        for r in &twice {
            problems.push(format!(
                "{} key {} position ({}, {}) applied {} times",
                r.get::<_, String>(0),
                r.get::<_, String>(1),
                r.get::<_, i64>(2),
                r.get::<_, i64>(3),
                r.get::<_, i64>(4)
            ));
        }
        let applied: i64 = target
            .query_one("SELECT count(*) FROM audit.applied", &[])
            .await
            .expect("applied count")
            .get(0);
        assert!(
            applied > 0,
            "the target audit saw nothing: it checks nothing"
        );
        tally.record();
        assert!(
            problems.is_empty() && tally.lost == 0,
            "{scenario}: {tally:?}\n{}",
            problems.join("\n")
        );
        tally
    }

    /// Every distinct change event in the changelog topics, by source
    /// transaction, and how many records repeated a position already seen.
    async fn kafka_changes(&self) -> (BTreeMap<i64, Vec<Change>>, usize) {
        let mut decoder = Decoder::at(&self.registry);
        let mut by_txid: BTreeMap<i64, Vec<Change>> = BTreeMap::new();
        let mut seen = HashSet::new();
        let mut duplicates = 0;
        for table in ["customers", "orders"] {
            let topic = format!("{}.public.{table}", self.name);
            let end = mat::end_offsets_at(&self.brokers, &topic).await;
            let records =
                support::read_topic_at(&self.brokers, &topic, Duration::from_secs(300), move |r| {
                    r.len() as i64 >= end
                })
                .await;
            for r in records {
                let Some(value) = &r.value else { continue }; // tombstone
                let value = decoder.decode(value).await;
                let op = text(support::field(&value, "op"));
                if op == "r" {
                    continue;
                }
                let source = support::field(&value, "source");
                let (commit_lsn, seq, txid) = (
                    long(support::field(source, "commit_lsn")),
                    long(support::field(source, "seq")),
                    long(support::field(source, "txId")),
                );
                let id = match &r.key {
                    Some(k) => Some(long(support::field(&decoder.decode(k).await, "id"))),
                    None => None,
                };
                // A key change's delete and create share a position.
                if !seen.insert((table, commit_lsn, seq, op.clone())) {
                    duplicates += 1;
                    continue;
                }
                by_txid.entry(txid).or_default().push(Change {
                    table: table.to_string(),
                    op,
                    id,
                    after_snapshot: true,
                });
            }
        }
        (by_txid, duplicates)
    }
}

fn long(v: &Value) -> i64 {
    match v {
        Value::Long(n) => *n,
        Value::Int(n) => i64::from(*n),
        other => panic!("not a long: {other:?}"),
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) | Value::Enum(_, s) => s.clone(),
        other => panic!("not a string: {other:?}"),
    }
}

#[derive(Debug)]
struct Change {
    table: String,
    op: String,
    id: Option<i64>,
    /// Whether it was written after the last snapshot's consistent point
    /// began (so it must be in the stream).
    after_snapshot: bool,
}

impl Change {
    fn identity(&self) -> (String, String, Option<i64>) {
        (self.table.clone(), self.op.clone(), self.id)
    }
}

/// A scenario's figures, for the soak's summary table.
#[derive(Debug, Default, serde::Serialize)]
pub(crate) struct Tally {
    pub scenario: String,
    pub faults: usize,
    /// Row changes committed at the source (audited).
    pub written: usize,
    /// Of those, found in Kafka with their transaction.
    pub verified: usize,
    /// Committed before the last snapshot: covered by it (and by the
    /// checksums), not by the stream.
    pub in_snapshot: usize,
    pub lost: usize,
    /// Records repeating a position already in the log (replays after a
    /// fault), which the materializer absorbed.
    pub duplicates: usize,
}

impl Tally {
    fn record(&self) {
        println!(
            "fault scenario {}: faults {}, written {}, verified {}, in snapshot {}, lost {}, duplicates absorbed {}",
            self.scenario, self.faults, self.written, self.verified, self.in_snapshot, self.lost, self.duplicates
        );
        if let Ok(path) = std::env::var("PGCDC_FAULT_REPORT") {
            use std::io::Write;
            let line = serde_json::to_string(self).expect("tally json");
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .expect("fault report");
            writeln!(f, "{line}").expect("write fault report");
        }
    }
}

/// Whether an error is the source going away (closed, refused, shutting
/// down) rather than a fault of the statement.
fn outage(e: &tokio_postgres::Error) -> bool {
    match e.code().map(|c| c.code()) {
        None => true,
        Some(code) => code.starts_with("08") || code.starts_with("57"),
    }
}

/// A continuous mixed workload on the demo schema ([`mat::statement`]),
/// one transaction of 1 to 20 changes at a time. It reconnects when the
/// source goes away: a transaction whose commit was cut off either
/// committed (and is audited) or did not (and is not).
pub(crate) struct Writer {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Writer {
    pub fn start(url: &str, seed: u64) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, url) = (stop.clone(), url.to_string());
        let task = tokio::spawn(async move {
            let mut rng = mat::Rng(seed);
            let mut committed = 0u64;
            let mut client: Option<tokio_postgres::Client> = None;
            let mut ids = None;
            while !flag.load(Ordering::Relaxed) {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                        Ok((c, conn)) => {
                            tokio::spawn(conn);
                            ids = mat::next_ids(&c).await.ok();
                            ids.map(|_| c)
                        }
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            None
                        }
                    };
                    continue;
                }
                let c = client.as_ref().expect("connected");
                let (next_order, next_customer) = ids.as_mut().expect("ids");
                let mut sql = String::from("BEGIN;");
                for _ in 0..(1 + rng.below(20)) {
                    sql.push_str(&mat::statement(&mut rng, next_order, next_customer));
                }
                sql.push_str("COMMIT;");
                match c.batch_execute(&sql).await {
                    Ok(()) => committed += 1,
                    // The source went away. Whether its ids were taken is
                    // unknown: reconnect, and read them again.
                    Err(e) if outage(&e) => client = None,
                    Err(e) => panic!("the writer's transaction failed: {e:?}"),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            committed
        });
        Writer { stop, task }
    }

    /// Stops writing; returns the transactions committed.
    pub async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let committed = self.task.await.expect("writer");
        assert!(committed > 0, "the writer committed nothing");
        committed
    }
}
