//! `pgcdc run` end to end: snapshot, every operation, tombstones, keys,
//! partitions, shutdown and resume, read back with our decoder and with
//! Python's confluent-kafka AvroDeserializer.

use std::time::Duration;

use apache_avro::types::Value;

use crate::operator::{alert, http_get, wait_ready, wait_until};
use crate::support::{
    self, confirmed_reached, insert_lsn, ConfigFile, ConnectorProcess, Decoder, TestDb,
};

/// A record field, with unions unwrapped.
fn get<'a>(v: &'a Value, name: &str) -> &'a Value {
    let v = unwrap(v);
    let Value::Record(fields) = v else {
        panic!("not a record: {v:?}");
    };
    unwrap(
        fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
            .unwrap_or_else(|| panic!("no field {name} in {v:?}")),
    )
}

fn unwrap(v: &Value) -> &Value {
    match v {
        Value::Union(_, inner) => inner,
        other => other,
    }
}

fn text(v: &Value) -> String {
    match unwrap(v) {
        Value::String(s) => s.clone(),
        other => panic!("not a string: {other:?}"),
    }
}

struct Event {
    partition: i32,
    key: Option<Value>,
    key_bytes: Option<Vec<u8>>,
    value: Option<Value>,
}

impl Event {
    fn op(&self) -> String {
        self.value
            .as_ref()
            .map(|v| text(get(v, "op")))
            .unwrap_or_else(|| "tombstone".into())
    }
    fn after(&self, column: &str) -> &Value {
        get(get(self.value.as_ref().expect("value"), "after"), column)
    }
    fn before(&self, column: &str) -> &Value {
        get(get(self.value.as_ref().expect("value"), "before"), column)
    }
    fn key_id(&self) -> i64 {
        match self.key.as_ref().map(|k| get(k, "id")) {
            Some(Value::Long(n)) => *n,
            other => panic!("key id: {other:?}"),
        }
    }
}

async fn events(stack: &support::Stack, topic: &str, count: usize) -> Vec<Event> {
    let records = support::read_topic(stack, topic, count, Duration::from_secs(60)).await;
    let mut decoder = Decoder::new(stack);
    let mut out = Vec::new();
    for r in records {
        let key = match &r.key {
            Some(k) => Some(decoder.decode(k).await),
            None => None,
        };
        let value = match &r.value {
            Some(v) => Some(decoder.decode(v).await),
            None => None,
        };
        out.push(Event {
            partition: r.partition,
            key,
            key_bytes: r.key,
            value,
        });
    }
    // Per-key order is what Kafka guarantees; sort by position for the test.
    out.sort_by_key(|e| {
        e.value
            .as_ref()
            .map(|v| {
                let src = get(v, "source");
                let (Value::Long(c), Value::Long(s)) = (get(src, "commit_lsn"), get(src, "seq"))
                else {
                    panic!("position")
                };
                // A key change's delete and create share one position;
                // the delete comes first.
                let rank = i64::from(text(get(v, "op")) != "d");
                (*c, *s, rank)
            })
            .unwrap_or((i64::MAX, i64::MAX, 2))
    });
    out
}

#[tokio::test]
async fn run_streams_snapshot_and_changes_as_debezium_envelopes() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_demo").await;
    let client = db.client().await;
    support::apply_sql_file(&client, "sql/demo/schema.sql").await;
    support::apply_sql_file(&client, "sql/demo/seed.sql").await;
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.customers", "public.orders"],
    ));
    let orders_topic = format!("{}.public.orders", db.name);
    let customers_topic = format!("{}.public.customers", db.name);

    let connector = ConnectorProcess::start(&config);
    let snapshot = events(&stack, &orders_topic, 4).await;
    assert!(
        snapshot.iter().all(|e| e.op() == "r"),
        "snapshot events are reads"
    );
    let first = snapshot
        .iter()
        .find(|e| e.key_id() == 1001)
        .expect("order 1001");
    assert_eq!(first.after("status"), &Value::String("paid".into()));
    let amount = first.after("amount");
    assert!(
        matches!(amount, Value::Decimal(_)),
        "numeric(12,2) is an Avro decimal: {amount:?}"
    );

    client
        .batch_execute(
            "BEGIN;
             INSERT INTO customers VALUES (10, 'Barbara Liskov', NULL, 3);
             INSERT INTO orders (id, customer_id, amount, status, note) VALUES (2001, 10, 5.25, 'new', NULL);
             COMMIT;
             UPDATE orders SET status = 'shipped' WHERE id = 1001;
             DELETE FROM orders WHERE id = 1004;
             UPDATE orders SET id = 3003 WHERE id = 1003;",
        )
        .await
        .expect("workload");

    // 4 reads + insert + update + delete + tombstone + key change (delete,
    // tombstone, create).
    let all = events(&stack, &orders_topic, 11).await;
    let streamed: Vec<&Event> = all.iter().filter(|e| e.op() != "r").collect();
    let ops: Vec<String> = streamed.iter().map(|e| e.op()).collect();
    assert_eq!(
        ops,
        ["c", "u", "d", "d", "c", "tombstone", "tombstone"],
        "{ops:?}"
    );
    let insert = streamed[0];
    assert_eq!(insert.key_id(), 2001);
    assert_eq!(insert.after("note"), &Value::Null, "NULL stays NULL");
    assert_eq!(insert.after("customer_id"), &Value::Long(10));
    let tx = get(insert.value.as_ref().expect("value"), "transaction");
    assert!(
        matches!(get(tx, "id"), Value::String(id) if id.contains(':')),
        "{tx:?}"
    );
    assert_eq!(
        streamed[1].after("status"),
        &Value::String("shipped".into())
    );
    let delete = streamed[2];
    assert_eq!(delete.key_id(), 1004);
    assert_eq!(delete.before("id"), &Value::Long(1004));
    assert_eq!(
        get(delete.value.as_ref().expect("value"), "after"),
        &Value::Null
    );
    let (moved_from, moved_to) = (streamed[3], streamed[4]);
    assert_eq!(
        (moved_from.key_id(), moved_to.key_id()),
        (1003, 3003),
        "a key change deletes the old key and creates the new"
    );
    let tombstones: Vec<i64> = streamed[5..].iter().map(|e| e.key_id()).collect();
    assert!(
        tombstones.contains(&1004) && tombstones.contains(&1003),
        "{tombstones:?}"
    );

    // Keys land where Java's default partitioner puts them.
    for e in &all {
        let key = e.key_bytes.as_deref().expect("keyed");
        assert_eq!(
            e.partition,
            pgcdc::sink::partition_for(key, 3),
            "partition of {:?}",
            e.key
        );
    }
    let customers = events(&stack, &customers_topic, 4).await;
    let liskov = customers
        .iter()
        .find(|e| e.key_id() == 10)
        .expect("customer 10");
    assert_eq!(liskov.after("tier"), &Value::Null);
    assert_eq!(
        get(
            get(liskov.value.as_ref().expect("value"), "source"),
            "table"
        ),
        &Value::String("customers".into())
    );

    // The transaction topic brackets the multi-table transaction.
    let tx_id = text(get(tx, "id"));
    let txn_records = support::read_topic(
        &stack,
        &format!("{}.transaction", db.name),
        // Two transactions: the explicit one, then the implicit one of the
        // remaining statements of the same simple query.
        4,
        Duration::from_secs(60),
    )
    .await;
    let mut decoder = Decoder::new(&stack);
    let mut statuses = Vec::new();
    for r in &txn_records {
        let v = decoder.decode(r.value.as_deref().expect("value")).await;
        if text(get(&v, "id")) == tx_id {
            statuses.push(text(get(&v, "status")));
            if text(get(&v, "status")) == "END" {
                assert_eq!(get(&v, "event_count"), &Value::Long(2));
                let Value::Array(collections) = get(&v, "data_collections") else {
                    panic!("data_collections")
                };
                let mut names: Vec<String> = collections
                    .iter()
                    .map(|c| text(get(c, "data_collection")))
                    .collect();
                names.sort();
                assert_eq!(names, [customers_topic.clone(), orders_topic.clone()]);
            }
        }
    }
    assert_eq!(statuses, ["BEGIN", "END"], "transaction {tx_id}");

    // A graceful stop confirms everything; a restart resumes without replay.
    // Measured against the last streamed commit, not the server's current
    // LSN, which other databases' WAL moves on after the stop.
    let last_commit = all
        .iter()
        .filter_map(|e| e.value.as_ref())
        .map(|v| match get(get(v, "source"), "commit_lsn") {
            Value::Long(c) => *c,
            other => panic!("commit_lsn: {other:?}"),
        })
        .max()
        .expect("streamed changes");
    let last_commit = format!("{:X}/{:X}", last_commit >> 32, last_commit & 0xFFFF_FFFF);
    assert_eq!(connector.terminate().await, 0);
    let row = client
        .query_one(
            "SELECT confirmed_flush_lsn > $2::text::pg_lsn, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&db.name, &last_commit],
        )
        .await
        .expect("slot");
    let (past, confirmed): (bool, String) = (row.get(0), row.get(1));
    assert!(
        past,
        "the slot was confirmed past the last commit {last_commit} on shutdown (confirmed {confirmed})"
    );
    client
        .batch_execute(
            "INSERT INTO orders (id, customer_id, amount, status) VALUES (4004, 1, 1, 'new')",
        )
        .await
        .expect("insert while stopped");
    let connector = ConnectorProcess::start(&config);
    let resumed = events(&stack, &orders_topic, 12).await;
    assert_eq!(
        resumed.iter().filter(|e| e.op() == "r").count(),
        4,
        "no second snapshot"
    );
    assert_eq!(
        resumed
            .iter()
            .filter(|e| e.op() == "c" && e.key_id() == 4004)
            .count(),
        1
    );
    assert_eq!(connector.terminate().await, 0);

    // Python's confluent-kafka decodes every record through our registry.
    let python = std::env::var("PGCDC_PYTHON").expect("PGCDC_PYTHON (set by scripts/test)");
    let out = tokio::process::Command::new(python)
        .arg(support::repo_file("tests/interop/read_changelog.py"))
        .args([orders_topic.as_str(), "12", "amount"])
        .env("PGCDC_REGISTRY_URL", &stack.registry_url)
        .env("PGCDC_KAFKA_BROKERS", &stack.brokers)
        .output()
        .await
        .expect("python reader");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("decoded 12 records"), "{stdout}");
    assert!(stdout.contains("2001 c amount=5.25"), "{stdout}");
    db.drop_db().await;
}

#[tokio::test]
async fn a_connector_killed_mid_stream_loses_nothing_and_replays_identical_positions() {
    const TXNS: i64 = 100;
    const ROWS: i64 = 1000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_kill").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE public.bulk (id bigint PRIMARY KEY, v int NOT NULL)")
        .await
        .expect("table");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.bulk"],
    ));
    let topic = format!("{}.public.bulk", db.name);

    let mut connector = ConnectorProcess::start(&config);
    // Kill mid-stream, not mid-snapshot: wait for the completed marker.
    let parsed = pgcdc::config::Config::from_toml(
        &support::pipeline_toml(&stack, &db.url, &db.name, &["public.bulk"]),
        "test",
        &[],
    )
    .expect("config");
    support::wait_snapshot_completed(&parsed).await;

    for t in 0..TXNS {
        client
            .batch_execute(&format!(
                "INSERT INTO public.bulk SELECT g, g % 7 FROM generate_series({}, {}) g",
                t * ROWS + 1,
                (t + 1) * ROWS
            ))
            .await
            .expect("insert");
        if t == TXNS / 3 {
            let _ = connector.child.start_kill(); // SIGKILL
            let _ = connector.child.wait().await;
            connector = ConnectorProcess::start(&config);
        }
    }

    let total = (TXNS * ROWS) as usize;
    // Distinct key bytes are distinct ids.
    let records =
        support::read_topic_until(&stack, &topic, Duration::from_secs(300), move |records| {
            records
                .iter()
                .filter_map(|r| r.key.as_deref())
                .collect::<std::collections::HashSet<_>>()
                .len()
                >= total
        })
        .await;
    assert_eq!(connector.terminate().await, 0);
    let mut decoder = Decoder::new(&stack);
    let mut seen = Vec::with_capacity(records.len());
    for r in &records {
        let (Some(k), Some(v)) = (&r.key, &r.value) else {
            continue;
        };
        let key = decoder.decode(k).await;
        let value = decoder.decode(v).await;
        let src = get(&value, "source");
        let (Value::Long(id), Value::Long(c), Value::Long(s)) =
            (get(&key, "id"), get(src, "commit_lsn"), get(src, "seq"))
        else {
            panic!("event shape")
        };
        seen.push((*id, text(get(&value, "op")), *c, *s));
    }

    // Every committed change is there, and a duplicate is the same event.
    let mut by_id: std::collections::HashMap<i64, (i64, i64)> = std::collections::HashMap::new();
    for (id, op, commit, seq) in &seen {
        assert_eq!(op, "c");
        let first = *by_id.entry(*id).or_insert((*commit, *seq));
        assert_eq!(
            first,
            (*commit, *seq),
            "id {id} replayed with a different position"
        );
    }
    assert_eq!(by_id.len(), total);
    // The positions of each transaction are complete: seq 1..=ROWS.
    let mut per_txn: std::collections::BTreeMap<i64, std::collections::BTreeSet<i64>> =
        Default::default();
    for (commit, seq) in by_id.values() {
        per_txn.entry(*commit).or_default().insert(*seq);
    }
    assert_eq!(per_txn.len(), TXNS as usize);
    for (commit, seqs) in &per_txn {
        assert_eq!(seqs.len() as i64, ROWS, "transaction {commit}");
        assert_eq!(
            (seqs.first(), seqs.last()),
            (Some(&1), Some(&ROWS)),
            "transaction {commit}"
        );
    }
    db.drop_db().await;
}

#[tokio::test]
async fn the_slot_advances_while_captured_tables_idle_and_others_are_busy() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_idle").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.quiet (id bigint PRIMARY KEY);
             CREATE TABLE public.busy (id bigserial PRIMARY KEY, v text)",
        )
        .await
        .expect("tables");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.quiet"])
        .replace("tables = [", "heartbeat_interval_secs = 1\ntables = [");
    let config = ConfigFile::write(&toml);
    let metrics_port = support::free_port();
    let metrics_addr = format!("127.0.0.1:{metrics_port}");
    let connector = ConnectorProcess::start_with(&config, &["--http-addr", &metrics_addr]);
    support::wait_streaming(&client, &db.name).await;

    // Busy WAL that the captured table did not write.
    for _ in 0..50 {
        client
            .batch_execute(
                "INSERT INTO public.busy (v) SELECT repeat('x', 500) FROM generate_series(1, 200)",
            )
            .await
            .expect("busy");
    }
    let target = insert_lsn(&client).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !confirmed_reached(&client, &db.name, &target).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the slot did not advance past {target} while only other tables were busy"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Prometheus metrics: events by table and op, the confirmed LSN, the lag.
    client
        .batch_execute("INSERT INTO public.quiet VALUES (1)")
        .await
        .expect("insert");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let body = loop {
        let body = reqwest::get(format!("http://{metrics_addr}/metrics"))
            .await
            .expect("metrics endpoint")
            .text()
            .await
            .unwrap_or_default();
        let counted = body.lines().any(|l| {
            l.starts_with("pgcdc_events_total")
                && l.contains("table=\"public.quiet\"")
                && l.contains("op=\"c\"")
                && l.ends_with(" 1")
        });
        if counted {
            break body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no event counted:\n{body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let confirmed = body
        .lines()
        .find(|l| l.starts_with("pgcdc_confirmed_lsn "))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_default();
    assert!(confirmed > 0.0, "{body}");
    assert!(body.contains("pgcdc_replication_lag_bytes"), "{body}");
    assert!(body.contains("pgcdc_event_bytes_total"), "{body}");
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// A table with inheritance children (partitioning the old way) is its
/// own rows to its topic: Postgres publishes a child's changes under the
/// child's name, so the snapshots, initial and incremental, read the
/// table `ONLY`; read whole, its topic would hold the children's rows and
/// none of their changes.
#[tokio::test]
async fn a_parent_table_is_snapshotted_without_its_inheritance_children() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_inherit").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.parent (id bigint PRIMARY KEY, v text);
             CREATE TABLE public.child (extra int) INHERITS (public.parent);
             ALTER TABLE public.child ADD PRIMARY KEY (id);
             INSERT INTO public.parent SELECT g, 'p' FROM generate_series(1, 3) g;
             INSERT INTO public.child SELECT g, 'c', 0 FROM generate_series(100, 104) g;
             ANALYZE public.parent;",
        )
        .await
        .expect("tables");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.parent"]);
    let (config, parsed) = ConfigFile::parsed(&toml);
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    let marker = completed_marker(&parsed, &db).await;
    assert_eq!(marker.rows.get("public.parent"), Some(&3));
    support::wait_streaming(&client, &db.name).await;
    let run = support::pgcdc(&[
        "snapshot",
        "--config",
        config.arg(),
        "--table",
        "public.parent",
    ])
    .await;
    assert!(
        run.stdout.contains("public.parent 3 rows"),
        "{}",
        run.all_output()
    );
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// A publication that covers more than `source.tables` (created by hand
/// here; `FOR ALL TABLES` is the same): changes of the other tables are
/// skipped, also inside transactions and truncates shared with a captured
/// one, and get no topic nor subjects; a captured table renamed out of
/// the list stops the connector with both names instead of losing its
/// changes, after a restart too (when no Relation message named it yet).
#[tokio::test]
async fn only_captured_tables_are_streamed_and_a_renamed_one_stops_the_connector() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_wide").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.kept (id bigint PRIMARY KEY, v text);
             CREATE TABLE public.other (id bigint PRIMARY KEY);
             CREATE PUBLICATION {} FOR TABLE public.kept, public.other",
            db.name
        ))
        .await
        .expect("tables");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.kept"],
    ));
    let connector = ConnectorProcess::start(&config);
    support::wait_streaming(&client, &db.name).await;
    client
        .batch_execute(
            "BEGIN; INSERT INTO public.other VALUES (1); INSERT INTO public.kept VALUES (1, 'a'); COMMIT;
             INSERT INTO public.other VALUES (2);
             TRUNCATE public.other, public.kept;
             INSERT INTO public.kept VALUES (2, 'b');",
        )
        .await
        .expect("changes");
    let read = events(&stack, &format!("{}.public.kept", db.name), 3).await;
    let ops: Vec<String> = read.iter().map(Event::op).collect();
    assert_eq!(ops, ["c", "t", "c"]);
    let log = connector.log();
    assert!(!log.contains(".public.other"), "{log}");
    assert_eq!(connector.terminate().await, 0);

    let mut connector = ConnectorProcess::start(&config);
    support::wait_streaming(&client, &db.name).await;
    client
        .batch_execute(
            "ALTER TABLE public.kept RENAME TO kept2;
             INSERT INTO public.kept2 VALUES (3, 'c');",
        )
        .await
        .expect("rename");
    let log = failed_log(&mut connector).await;
    assert!(
        log.contains("a captured table is named public.kept2 from LSN"),
        "{log}"
    );
    db.drop_db().await;
}

#[tokio::test]
async fn toast_full_identity_truncate_and_schema_changes_are_carried_faithfully() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_shapes").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.docs (id bigint PRIMARY KEY, title text, body text);
             ALTER TABLE public.docs ALTER COLUMN body SET STORAGE EXTERNAL;
             CREATE TABLE public.audit (id bigint PRIMARY KEY, note text);
             ALTER TABLE public.audit REPLICA IDENTITY FULL;",
        )
        .await
        .expect("tables");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.docs", "public.audit"],
    ));
    let docs = format!("{}.public.docs", db.name);
    let audit = format!("{}.public.audit", db.name);
    let connector = ConnectorProcess::start(&config);
    support::wait_streaming(&client, &db.name).await;

    client
        .batch_execute(
            "INSERT INTO public.docs VALUES (1, 'a', repeat('0123456789', 10000));
             UPDATE public.docs SET title = 'b' WHERE id = 1;
             INSERT INTO public.audit VALUES (1, 'first');
             UPDATE public.audit SET note = 'second' WHERE id = 1;
             ALTER TABLE public.docs ADD COLUMN pages int NOT NULL DEFAULT 7;
             INSERT INTO public.docs (id, title, body) VALUES (2, 'c', 'short');
             ALTER TABLE public.docs DROP COLUMN title;
             INSERT INTO public.docs (id, body, pages) VALUES (3, 'x', 9);
             TRUNCATE public.audit;",
        )
        .await
        .expect("workload");

    let doc_events = events(&stack, &docs, 4).await;
    // The update left the TOASTed body out: it is marked, never faked.
    let update = doc_events.iter().find(|e| e.op() == "u").expect("update");
    assert_eq!(update.after("title"), &Value::String("b".into()));
    assert_eq!(
        update.after("body"),
        &Value::Enum(0, "UNCHANGED_TOAST".into())
    );
    let insert = doc_events
        .iter()
        .find(|e| e.op() == "c" && e.key_id() == 1)
        .expect("insert");
    assert!(matches!(insert.after("body"), Value::String(b) if b.len() == 100_000));
    // ADD COLUMN: a new value schema version carries the column.
    let second = doc_events.iter().find(|e| e.key_id() == 2).expect("row 2");
    assert_eq!(second.after("pages"), &Value::Int(7));
    // DROP COLUMN: the next shape no longer has it.
    let third = doc_events.iter().find(|e| e.key_id() == 3).expect("row 3");
    assert_eq!(third.after("pages"), &Value::Int(9));
    let Value::Record(fields) = get(third.value.as_ref().expect("value"), "after") else {
        panic!("after")
    };
    assert!(fields.iter().all(|(n, _)| n != "title"), "{fields:?}");
    let versions: serde_json::Value = reqwest::get(format!(
        "{}/subjects/{docs}-value/versions",
        stack.registry_url
    ))
    .await
    .expect("versions")
    .json()
    .await
    .expect("json");
    assert_eq!(
        versions,
        serde_json::json!([1, 2, 3]),
        "one value schema version per shape"
    );

    // REPLICA IDENTITY FULL: updates carry the whole old row; truncate is an event.
    let audit_events = events(&stack, &audit, 3).await;
    let upd = audit_events
        .iter()
        .find(|e| e.op() == "u")
        .expect("audit update");
    assert_eq!(upd.before("note"), &Value::String("first".into()));
    assert_eq!(upd.after("note"), &Value::String("second".into()));
    let truncate = audit_events
        .iter()
        .find(|e| e.op() == "t")
        .expect("truncate event");
    assert!(truncate.key.is_none(), "a truncate has no key");
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// `public.big`: `rows` rows, analyzed so the planner's estimate is right.
async fn big_table(client: &tokio_postgres::Client, rows: i64) {
    client
        .batch_execute(&format!(
            "CREATE TABLE public.big (id bigint PRIMARY KEY, v text);
             INSERT INTO public.big SELECT g, md5(g::text) FROM generate_series(1, {rows}) g;
             ANALYZE public.big;"
        ))
        .await
        .expect("table");
}

/// The snapshot marker the connector of `parsed` last wrote for `db`.
async fn completed_marker(
    parsed: &pgcdc::config::Config,
    db: &TestDb,
) -> pgcdc::snapshot_marker::Marker {
    pgcdc::snapshot_marker::latest(
        &parsed.kafka,
        &pgcdc::snapshot_marker::topic(parsed),
        &db.name,
    )
    .await
    .expect("marker")
    .expect("a marker")
}

/// A pipeline of `public.big` copied in chunks of `chunk_rows`, `workers`
/// at a time.
fn chunked_pipeline(
    stack: &support::Stack,
    db: &TestDb,
    chunk_rows: u64,
    workers: usize,
) -> (ConfigFile, pgcdc::config::Config) {
    let toml = support::pipeline_toml(stack, &db.url, &db.name, &["public.big"]).replace(
        "[kafka]",
        &format!("[source.snapshot]\nchunk_rows = {chunk_rows}\nworkers = {workers}\n[kafka]"),
    );
    ConfigFile::parsed(&toml)
}

#[tokio::test]
async fn an_interrupted_snapshot_is_taken_again_and_never_skipped() {
    const ROWS: i64 = 200_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_snapkill").await;
    let client = db.client().await;
    big_table(&client, ROWS).await;
    // Chunks of about 30,000 rows, copied two at a time.
    let (config, parsed) = chunked_pipeline(&stack, &db, 30_000, 2);
    let topic = format!("{}.public.big", db.name);
    let markers = pgcdc::snapshot_marker::topic(&parsed);

    let mut connector = ConnectorProcess::start(&config);
    support::read_topic(&stack, &topic, 1000, Duration::from_secs(120)).await;
    let _ = connector.child.start_kill(); // SIGKILL mid-snapshot
    let _ = connector.child.wait().await;
    let marker = pgcdc::snapshot_marker::latest(&parsed.kafka, &markers, &db.name)
        .await
        .expect("marker");
    assert_eq!(
        marker.map(|m| m.phase),
        Some(pgcdc::snapshot_marker::Phase::Started),
        "the kill must land mid-snapshot for this test to mean anything"
    );

    let connector = ConnectorProcess::start(&config);
    let total = ROWS as usize;
    let records =
        support::read_topic_until(&stack, &topic, Duration::from_secs(300), move |records| {
            records
                .iter()
                .filter_map(|r| r.key.as_deref())
                .collect::<std::collections::HashSet<_>>()
                .len()
                >= total
        })
        .await;
    assert!(records.len() >= total);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let completed = loop {
        let m = pgcdc::snapshot_marker::latest(&parsed.kafka, &markers, &db.name)
            .await
            .expect("marker");
        if let Some(m) = m.filter(|m| m.phase == pgcdc::snapshot_marker::Phase::Completed) {
            break m;
        }
        assert!(std::time::Instant::now() < deadline, "no completed marker");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(completed.rows.get("public.big"), Some(&(ROWS as u64)));
    assert_eq!(
        completed.chunks.get("public.big"),
        Some(&7),
        "200,000 rows in chunks of 30,000"
    );
    assert!(completed.consistent_point.is_some());
    let start: i64 = completed.start_offsets[&topic].values().sum();
    let end: i64 = completed.end_offsets[&topic].values().sum();
    assert_eq!(
        end - start,
        ROWS,
        "the marker brackets exactly the snapshot's rows"
    );
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// The snapshot's rows go through an untracked producer (failed
/// deliveries reported only) and a flush: a broker outage that makes rows
/// time out in librdkafka must fail the snapshot, never complete it short.
#[tokio::test]
async fn a_broker_outage_mid_snapshot_fails_it_and_the_retaken_snapshot_loses_no_row() {
    const ROWS: i64 = 400_000;
    let stack = support::stack();
    let mut broker = support::PrivateBroker::start_persistent(&stack);
    let db = TestDb::create(&stack, "run_snapout").await;
    let client = db.client().await;
    big_table(&client, ROWS).await;
    let private = support::Stack {
        brokers: broker.address.clone(),
        ..stack.clone()
    };
    let toml = support::pipeline_toml(&private, &db.url, &db.name, &["public.big"]).replace(
        "[kafka]",
        "[source.snapshot]\nchunk_rows = 50000\nworkers = 2\n[kafka]",
    );
    let parsed = pgcdc::config::Config::from_toml(&toml, "test", &[]).expect("config");
    // Rows left undelivered for 2 s fail instead of waiting five minutes.
    let impatient = ConfigFile::write(&toml.replace(
        "[registry]",
        "[kafka.properties]\n\"message.timeout.ms\" = \"2000\"\n[registry]",
    ));
    let config = ConfigFile::write(&toml);
    let topic = format!("{}.public.big", db.name);
    let markers = pgcdc::snapshot_marker::topic(&parsed);

    let connector = ConnectorProcess::start(&impatient);
    broker.read_topic(&stack, &topic, 1000).await;
    broker.stop();
    // Past message.timeout.ms: what librdkafka held has failed by now.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(
        connector.log().contains("Kafka delivery failed"),
        "the outage must land mid-snapshot for this test to mean anything:\n{}",
        connector.log()
    );
    // librdkafka reports every failed connection attempt of each broker
    // thread, several a second (18 lines in these 6 s before they were
    // folded); a kind's repeats are folded for 30 s.
    let log = connector.log();
    let refused = log.matches("Connection refused").count();
    assert!(
        (1..=8).contains(&refused),
        "{refused} lines of refused connections:\n{log}"
    );
    // It retries by itself; the slow SQLite broker would time rows out
    // again at 2 s, so the snapshot is retaken by a patient connector.
    connector.terminate().await;
    broker.start_again();
    let connector = ConnectorProcess::start(&config);
    let total = ROWS as usize;
    let records = support::read_topic_at(
        &broker.address,
        &topic,
        Duration::from_secs(300),
        move |records| {
            records
                .iter()
                .filter_map(|r| r.key.as_deref())
                .collect::<std::collections::HashSet<_>>()
                .len()
                >= total
        },
    )
    .await;
    assert!(records.len() >= total);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let completed = loop {
        let m = pgcdc::snapshot_marker::latest(&parsed.kafka, &markers, &db.name)
            .await
            .expect("marker");
        if let Some(m) = m.filter(|m| m.phase == pgcdc::snapshot_marker::Phase::Completed) {
            break m;
        }
        assert!(std::time::Instant::now() < deadline, "no completed marker");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(completed.rows.get("public.big"), Some(&(ROWS as u64)));
    let start: i64 = completed.start_offsets[&topic].values().sum();
    let end: i64 = completed.end_offsets[&topic].values().sum();
    assert_eq!(
        end - start,
        ROWS,
        "the completed marker brackets a whole snapshot taken after the outage"
    );
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// Sessions opened in the test database, and index scans of `public.big`'s
/// key, as the statistics hold them (a backend adds its own when it ends
/// or goes idle).
async fn sessions_and_key_scans(client: &tokio_postgres::Client, db: &str) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT (SELECT sessions FROM pg_stat_database WHERE datname = $1),
                    (SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelname = 'big_pkey')",
            &[&db],
        )
        .await
        .expect("statistics");
    (row.get(0), row.get(1))
}

/// Twenty chunks, two at a time: the copy workers reuse their source
/// sessions from chunk to chunk (before, each chunk opened two), copy in
/// binary, and on Postgres 14 and later copy heap block ranges even of a
/// table with an integer key, without touching its index.
#[tokio::test]
async fn a_chunked_snapshot_reuses_its_sessions_and_copies_block_ranges() {
    const ROWS: i64 = 40_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_reuse").await;
    let client = db.client().await;
    big_table(&client, ROWS).await;
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int4", &[])
        .await
        .expect("version")
        .get(0);
    let (config, parsed) = chunked_pipeline(&stack, &db, 2_000, 2);
    let (sessions_before, scans_before) = sessions_and_key_scans(&client, &db.name).await;
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    let planned = connector
        .log()
        .lines()
        .find(|l| l.contains("table snapshot planned") && l.contains("public.big"))
        .map(str::to_string);
    assert_eq!(connector.terminate().await, 0);
    let planned = planned.expect("the table's plan is logged");
    assert!(
        planned.contains("chunks=20") && planned.contains("format=\"binary\""),
        "an integer table copies in binary: {planned}"
    );
    assert!(
        !planned.contains('\x1b'),
        "colours in a log file: {planned}"
    );
    let marker = completed_marker(&parsed, &db).await;
    assert_eq!(
        marker.chunks.get("public.big"),
        Some(&20),
        "40,000 rows in chunks of 2,000"
    );
    assert_eq!(marker.rows.get("public.big"), Some(&(ROWS as u64)));
    // The connector's backends have ended; their statistics land shortly.
    let mut counts = sessions_and_key_scans(&client, &db.name).await;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let again = sessions_and_key_scans(&client, &db.name).await;
        if again == counts && counts.0 > sessions_before {
            break;
        }
        counts = again;
    }
    let (sessions, scans) = counts;
    // Besides the copies' four (two workers, each with a session on the
    // snapshot and one that checks the columns), the connector's own:
    // replication, preflight, the stream's. One pair per chunk would be 40.
    assert!(
        sessions - sessions_before <= 12,
        "{} sessions for a snapshot of 20 chunks",
        sessions - sessions_before
    );
    if version >= 140_000 {
        assert_eq!(scans, scans_before, "a chunk scanned the key's index");
    }
    db.drop_db().await;
}

/// A table loaded and never analysed (no statistics: `reltuples` -1) is
/// cut into chunks by the planner's estimate from its size, not copied
/// whole by one worker.
#[tokio::test]
async fn a_table_never_analysed_is_still_cut_into_chunks() {
    const ROWS: i64 = 40_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_noanalyze").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.big (id bigint PRIMARY KEY, v text) WITH (autovacuum_enabled = false);
             INSERT INTO public.big SELECT g, md5(g::text) FROM generate_series(1, {ROWS}) g;"
        ))
        .await
        .expect("table");
    let stats: f32 = client
        .query_one(
            "SELECT reltuples FROM pg_class WHERE oid = 'public.big'::regclass",
            &[],
        )
        .await
        .expect("reltuples")
        .get(0);
    assert!(stats <= 0.0, "the table has statistics already: {stats}");
    let (config, parsed) = chunked_pipeline(&stack, &db, 2_000, 2);
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    assert_eq!(connector.terminate().await, 0);
    let marker = completed_marker(&parsed, &db).await;
    let chunks = marker.chunks.get("public.big").copied().unwrap_or(0);
    assert!(
        chunks >= 10,
        "{chunks} chunks for 40,000 rows in chunks of 2,000"
    );
    assert_eq!(marker.rows.get("public.big"), Some(&(ROWS as u64)));
    db.drop_db().await;
}

/// Waits until the connector has logged a table's snapshot plan (its
/// chunks start right after).
async fn wait_planned(connector: &ConnectorProcess) {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !connector.log().contains("table snapshot planned") {
        assert!(
            std::time::Instant::now() < deadline,
            "no plan logged: {}",
            connector.log()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The log of a connector that must stop with a failure within a minute.
async fn failed_log(connector: &mut ConnectorProcess) -> String {
    let status = tokio::time::timeout(Duration::from_secs(60), connector.child.wait())
        .await
        .expect("the connector stops")
        .expect("wait");
    let log = connector.log();
    assert!(!status.success(), "{log}");
    log
}

/// A column's type changed between two chunks without a table rewrite
/// (`text` to `varchar`: the exported snapshot still reads every row):
/// the next chunk's check under its lock sees it and stops the connector
/// with the table named, instead of reading the rest by the planned types.
#[tokio::test]
async fn a_column_type_changed_during_a_snapshot_stops_it_with_the_table_named() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_ddl").await;
    let client = db.client().await;
    big_table(&client, 100_000).await;
    // Fifty chunks, one at a time: the change lands between two of them.
    let (config, _) = chunked_pipeline(&stack, &db, 2_000, 1);
    let mut connector = ConnectorProcess::start(&config);
    wait_planned(&connector).await;
    // Waits for the chunk in progress (its ACCESS SHARE lock); the next
    // chunk's lock queues behind it.
    client
        .batch_execute("ALTER TABLE public.big ALTER COLUMN v TYPE varchar")
        .await
        .expect("alter");
    let log = failed_log(&mut connector).await;
    assert!(
        log.contains("snapshot of public.big: its columns changed during the snapshot"),
        "{log}"
    );
    db.drop_db().await;
}

/// The log of a connector that stopped after `rewrite` ran between two
/// chunks of a block-range snapshot of `public.big` (100,000 rows, then
/// `before`); `None` before Postgres 14, where chunks are key ranges.
async fn log_after_rewrite(prefix: &str, before: &str, rewrite: &str) -> Option<String> {
    let stack = support::stack();
    let db = TestDb::create(&stack, prefix).await;
    let client = db.client().await;
    big_table(&client, 100_000).await;
    client.batch_execute(before).await.expect("before");
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int4", &[])
        .await
        .expect("version")
        .get(0);
    if version < 140_000 {
        db.drop_db().await;
        return None;
    }
    // Dozens of chunks, one at a time: the rewrite lands between two.
    let (config, _) = chunked_pipeline(&stack, &db, 2_000, 1);
    let mut connector = ConnectorProcess::start(&config);
    wait_planned(&connector).await;
    client.batch_execute(rewrite).await.expect("rewrite");
    let log = failed_log(&mut connector).await;
    db.drop_db().await;
    Some(log)
}

/// A table rewritten between two chunks (VACUUM FULL after deletes packs
/// the rows the snapshot still sees into the first blocks of a new file):
/// block ranges planned on the old file would copy some rows twice and
/// skip others, so the next chunk stops the connector with the table
/// named, and the next start takes the snapshot again.
#[tokio::test]
async fn a_table_rewritten_during_a_block_range_snapshot_stops_it_with_the_table_named() {
    let Some(log) = log_after_rewrite(
        "run_rewrite",
        "DELETE FROM public.big WHERE id % 2 = 0; ANALYZE public.big;",
        "VACUUM FULL public.big",
    )
    .await
    else {
        return;
    };
    assert!(
        log.contains("snapshot of public.big: it was rewritten during the snapshot"),
        "{log}"
    );
}

/// A rewrite between two chunks that keeps every column's type (a type
/// changed to itself `USING` an expression) copies the rows into a new
/// file under its own transaction, which the snapshot cannot see, and
/// carries no truncate: later chunks would read nothing and the rest of
/// the table would be missing, so the next chunk stops the connector.
#[tokio::test]
async fn a_type_keeping_rewrite_during_a_block_range_snapshot_stops_it_with_the_table_named() {
    let Some(log) = log_after_rewrite(
        "run_rewrite_same",
        "SELECT 1",
        "ALTER TABLE public.big ALTER COLUMN v TYPE text USING v || ''",
    )
    .await
    else {
        return;
    };
    assert!(
        log.contains(
            "snapshot of public.big: it was rewritten during the snapshot with its columns' types kept"
        ),
        "{log}"
    );
}

#[tokio::test]
async fn a_large_table_without_an_integer_key_is_copied_in_block_range_chunks() {
    const ROWS: usize = 50_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_blocks").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.words (w text PRIMARY KEY, n int NOT NULL);
             INSERT INTO public.words SELECT md5(g::text), g FROM generate_series(1, {ROWS}) g;
             DELETE FROM public.words WHERE n % 10 = 0;
             ANALYZE public.words;"
        ))
        .await
        .expect("table");
    let expected = ROWS - ROWS / 10;
    let config_toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.words"])
        .replace("[kafka]", "[source.snapshot]\nchunk_rows = 10000\n[kafka]");
    let (config, parsed) = ConfigFile::parsed(&config_toml);
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    let marker = completed_marker(&parsed, &db).await;
    assert_eq!(
        marker.chunks.get("public.words"),
        Some(&5),
        "45,000 rows in chunks of 10,000"
    );
    assert_eq!(marker.rows.get("public.words"), Some(&(expected as u64)));
    let topic = format!("{}.public.words", db.name);
    let records = support::read_topic(&stack, &topic, expected, Duration::from_secs(120)).await;
    assert_eq!(connector.terminate().await, 0);
    let keys: std::collections::HashSet<_> =
        records.iter().filter_map(|r| r.key.as_deref()).collect();
    assert_eq!(records.len(), expected, "no row copied twice");
    assert_eq!(keys.len(), expected, "every row copied");
    db.drop_db().await;
}

/// A partitioned table (one partition itself partitioned) is one table to
/// its consumers: its snapshot is cut partition by partition into chunks
/// (the parent has no blocks of its own), its changes go to the table's
/// topic under its name, no partition gets a topic or registry subjects,
/// and a restart finds the publication covering it.
#[tokio::test]
async fn a_partitioned_table_is_snapshotted_by_partition_and_streamed_as_one_table() {
    const ROWS: i64 = 30_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_parted").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.ev (id bigint, region int, v text, PRIMARY KEY (id, region))
                 PARTITION BY LIST (region);
             CREATE TABLE public.ev_1 PARTITION OF public.ev FOR VALUES IN (1);
             CREATE TABLE public.ev_2 PARTITION OF public.ev FOR VALUES IN (2)
                 PARTITION BY RANGE (id);
             CREATE TABLE public.ev_2a PARTITION OF public.ev_2 FOR VALUES FROM (MINVALUE) TO (15000);
             CREATE TABLE public.ev_2b PARTITION OF public.ev_2 FOR VALUES FROM (15000) TO (MAXVALUE);
             INSERT INTO public.ev SELECT g, 1 + g % 2, md5(g::text) FROM generate_series(1, {ROWS}) g;
             ANALYZE public.ev;"
        ))
        .await
        .expect("table");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.ev"]).replace(
        "[kafka]",
        "[source.snapshot]\nchunk_rows = 2000\nworkers = 2\n[kafka]",
    );
    let (config, parsed) = ConfigFile::parsed(&toml);
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    let marker = completed_marker(&parsed, &db).await;
    let chunks = marker.chunks.get("public.ev").copied().unwrap_or(0);
    assert!(
        chunks >= 10,
        "{chunks} chunks for 30,000 rows in three partitions, in chunks of 2,000"
    );
    assert_eq!(marker.rows.get("public.ev"), Some(&(ROWS as u64)));
    support::wait_streaming(&client, &db.name).await;
    client
        .batch_execute(
            "INSERT INTO public.ev VALUES (30001, 2, 'new');
             UPDATE public.ev SET v = 'changed' WHERE id = 7 AND region = 2;
             DELETE FROM public.ev WHERE id = 20000 AND region = 1;",
        )
        .await
        .expect("changes");
    let topic = format!("{}.public.ev", db.name);
    // The rows, three changes and the delete's tombstone.
    let read = events(&stack, &topic, ROWS as usize + 4).await;
    let keys: std::collections::HashSet<_> = read[..ROWS as usize]
        .iter()
        .filter_map(|e| e.key_bytes.clone())
        .collect();
    assert_eq!(keys.len(), ROWS as usize, "every row copied once");
    let streamed: Vec<String> = read[ROWS as usize..].iter().map(Event::op).collect();
    assert_eq!(streamed, ["c", "u", "d", "tombstone"]);
    assert_eq!(text(read[ROWS as usize].after("v")), "new");
    assert_eq!(text(read[ROWS as usize + 1].after("v")), "changed");
    let log = connector.log();
    assert!(
        !log.contains(".public.ev_"),
        "a partition got a topic: {log}"
    );
    assert_eq!(connector.terminate().await, 0);

    let connector = ConnectorProcess::start(&config);
    support::wait_streaming(&client, &db.name).await;
    client
        .batch_execute("INSERT INTO public.ev VALUES (30002, 1, 'after restart')")
        .await
        .expect("insert");
    let read = events(&stack, &topic, ROWS as usize + 5).await;
    assert!(
        read.iter()
            .any(|e| e.op() == "c" && text(e.after("v")) == "after restart"),
        "the change after the restart"
    );
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

#[tokio::test]
async fn an_incompatible_schema_change_stops_the_connector_before_producing_it() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_incompat").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.t (id bigint PRIMARY KEY, v int);
             INSERT INTO public.t VALUES (1, 1);",
        )
        .await
        .expect("table");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.t"],
    ));
    let topic = format!("{}.public.t", db.name);
    let subject = format!("{topic}-value");
    let connector = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
        .args(["run", "--config", config.arg()])
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn pgcdc run");
    support::read_topic(&stack, &topic, 1, Duration::from_secs(60)).await;

    // int -> text: a reader of the new schema cannot read the old records,
    // so the subject's default BACKWARD level refuses it.
    client
        .batch_execute(
            "ALTER TABLE public.t ALTER COLUMN v TYPE text;
             INSERT INTO public.t VALUES (2, 'two');",
        )
        .await
        .expect("change");
    let failing = insert_lsn(&client).await;
    let out = tokio::time::timeout(Duration::from_secs(60), connector.wait_with_output())
        .await
        .expect("the connector must stop")
        .expect("wait");
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&format!(
            "subject {subject}: schema refused as incompatible"
        )),
        "{stderr}"
    );
    // Nothing was produced with the refused shape, and the slot will
    // replay the change.
    let records =
        support::read_topic_until(&stack, &topic, Duration::from_secs(30), |r| !r.is_empty()).await;
    assert_eq!(records.len(), 1, "only the snapshot row");
    assert!(
        !confirmed_reached(&client, &db.name, &failing).await,
        "the slot was confirmed past a change that was never produced"
    );

    // The operator's decision (here: no compatibility for this subject),
    // then a restart produces the change.
    let http = reqwest::Client::new();
    let put = http
        .put(format!("{}/config/{subject}", stack.registry_url))
        .header("content-type", "application/vnd.schemaregistry.v1+json")
        .body(r#"{"compatibility":"NONE"}"#)
        .send()
        .await
        .expect("put config");
    assert!(put.status().is_success());
    let connector = ConnectorProcess::start(&config);
    let records = support::read_topic(&stack, &topic, 2, Duration::from_secs(60)).await;
    assert_eq!(records.len(), 2);
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

#[tokio::test]
async fn a_truncate_during_the_snapshot_neither_deadlocks_nor_loses_the_truncate() {
    const ROWS: i64 = 200_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_snapddl").await;
    let client = db.client().await;
    big_table(&client, ROWS).await;
    // Ten chunks, one at a time: the truncate lands between or during them.
    let (config, parsed) = chunked_pipeline(&stack, &db, 20_000, 1);
    let topic = format!("{}.public.big", db.name);
    let connector = ConnectorProcess::start(&config);
    support::read_topic(&stack, &topic, 1000, Duration::from_secs(120)).await;
    // An application's TRUNCATE, mid-snapshot. It waits at most for the
    // chunk being copied; the snapshot must go on and complete.
    tokio::time::timeout(
        Duration::from_secs(60),
        client.batch_execute("TRUNCATE public.big"),
    )
    .await
    .expect("the TRUNCATE waited for more than the chunk in progress")
    .expect("truncate");
    tokio::time::timeout(
        Duration::from_secs(120),
        support::wait_snapshot_completed(&parsed),
    )
    .await
    .expect("the snapshot stalled after a TRUNCATE");
    // The stream carries the truncate after the snapshot's rows.
    let records = support::read_topic_until(&stack, &topic, Duration::from_secs(60), |r| {
        r.iter().any(|r| r.key.is_none() && r.value.is_some())
    })
    .await;
    assert!(!records.is_empty());
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// Peak resident memory of a process, in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// The bound this test holds the connector to while a 1M-row transaction
/// streams through: in-flight messages (100,000 at most) plus librdkafka's
/// 64 MiB queue plus the process's fixed cost, with room to spare. A
/// connector that buffered the transaction would need several times this.
const MEMORY_BOUND_KIB: u64 = 400 * 1024;

#[tokio::test]
async fn a_one_million_row_transaction_streams_with_bounded_memory() {
    const ROWS: i64 = 1_000_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_bigtx").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE public.wide (id bigint PRIMARY KEY, payload text NOT NULL)")
        .await
        .expect("table");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.wide"],
    ));
    let connector = ConnectorProcess::start(&config);
    let pid = connector.child.id().expect("pid");
    support::wait_streaming(&client, &db.name).await;
    let baseline = peak_rss_kib(pid);

    // One transaction, about 200 MB of row data. The target is the insert
    // position: with synchronous_commit=off the write position may not yet
    // include the commit record.
    client
        .batch_execute(&format!(
            "INSERT INTO public.wide SELECT g, repeat(md5(g::text), 6) FROM generate_series(1, {ROWS}) g"
        ))
        .await
        .expect("insert");
    let target = insert_lsn(&client).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(900);
    let mut peak = baseline;
    loop {
        peak = peak.max(peak_rss_kib(pid));
        if confirmed_reached(&client, &db.name, &target).await {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the transaction was not confirmed in time"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    peak = peak.max(peak_rss_kib(pid));
    assert_eq!(connector.terminate().await, 0);
    assert!(
        peak < MEMORY_BOUND_KIB,
        "peak RSS {peak} KiB over the bound {MEMORY_BOUND_KIB} KiB (before the transaction: {baseline} KiB)"
    );
    // Confirmed means Kafka holds all of it.
    let end: i64 = pgcdc::snapshot_marker::end_offsets(
        &pgcdc::config::Config::from_toml(
            &support::pipeline_toml(&stack, &db.url, &db.name, &["public.wide"]),
            "test",
            &[],
        )
        .expect("config")
        .kafka,
        &[format!("{}.public.wide", db.name)],
    )
    .await
    .expect("offsets")
    .values()
    .flat_map(|p| p.values())
    .sum();
    assert!(end >= ROWS, "{end} records for {ROWS} rows");
    eprintln!("1M-row transaction: peak RSS {peak} KiB (baseline {baseline} KiB)");
    db.drop_db().await;
}

#[tokio::test]
async fn a_connector_stopped_during_its_initial_snapshot_exits_at_once_and_takes_it_again() {
    const ROWS: i64 = 400_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_snapstop").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.big (id bigint PRIMARY KEY, v text NOT NULL);
             INSERT INTO public.big SELECT g, md5(g::text) FROM generate_series(1, {ROWS}) g"
        ))
        .await
        .expect("table");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.big"]);
    let (config, parsed) = ConfigFile::parsed(&toml);
    let topic = format!("{}.public.big", db.name);
    let produced = |parsed: pgcdc::config::Config, topic: String| async move {
        pgcdc::snapshot_marker::end_offsets(&parsed.kafka, &[topic])
            .await
            .map(|o| o.values().flat_map(|p| p.values()).sum::<i64>())
            .unwrap_or(0)
    };

    let connector = ConnectorProcess::start(&config);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while produced(parsed.clone(), topic.clone()).await < 1000 {
        assert!(
            std::time::Instant::now() < deadline,
            "the snapshot produced nothing"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let asked = std::time::Instant::now();
    assert_eq!(connector.terminate().await, 0);
    let took = asked.elapsed();
    // Before the fix it stopped only once the snapshot was done.
    assert!(
        took < Duration::from_secs(5),
        "stopping during the snapshot took {took:?}"
    );
    // Stopped inside the snapshot, not after it.
    let marker = support::initial_marker(&parsed).await;
    assert_eq!(
        marker.phase,
        pgcdc::snapshot_marker::Phase::Started,
        "the snapshot finished before the stop arrived; make the table bigger"
    );

    // The next start takes the whole snapshot again.
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    let marker = support::initial_marker(&parsed).await;
    assert_eq!(marker.rows.get("public.big"), Some(&(ROWS as u64)));
    assert!(produced(parsed.clone(), topic.clone()).await >= ROWS);
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// A broker address nothing listens on: the operator hears of it within
/// seconds, not after the 30 s metadata timeout (as before).
#[tokio::test]
async fn a_broker_that_never_answers_is_reported_within_seconds() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_no_broker").await;
    db.client()
        .await
        .batch_execute("CREATE TABLE public.t (id bigint PRIMARY KEY)")
        .await
        .expect("table");
    let nowhere = format!("127.0.0.1:{}", support::free_port());
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.t"])
        .replace(&stack.brokers, &nowhere);
    let config = ConfigFile::write(&toml);
    let started = std::time::Instant::now();
    let connector = ConnectorProcess::start(&config);
    let deadline = started + Duration::from_secs(15);
    while !connector.log().contains("Kafka is not answering yet") {
        assert!(
            std::time::Instant::now() < deadline,
            "no warning within 15 s:\n{}",
            connector.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(connector.log().contains(&nowhere), "{}", connector.log());
    // A stop does not wait for the metadata request to time out.
    let stopping = std::time::Instant::now();
    assert_eq!(connector.terminate().await, 0);
    assert!(
        stopping.elapsed() < Duration::from_secs(10),
        "the stop took {:?}",
        stopping.elapsed()
    );
    db.drop_db().await;
}

#[tokio::test]
async fn a_frozen_broker_stalls_the_slot_with_alerts_and_nothing_is_lost() {
    let stack = support::stack();
    let broker = support::PrivateBroker::start(&stack);
    let db = TestDb::create(&stack, "run_stall").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.t (id bigint PRIMARY KEY);
             CREATE TABLE public.filler (v text)",
        )
        .await
        .expect("table");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.t"])
        .replace(&stack.brokers, &broker.address)
        .replace(
            "tables = [",
            "heartbeat_interval_secs = 1\nstall_warning_secs = 2\nretained_wal_warning_bytes = 8388608\ntables = [",
        );
    let config = ConfigFile::write(&toml);
    let addr = format!("127.0.0.1:{}", support::free_port());
    let connector = ConnectorProcess::start_with(&config, &["--http-addr", &addr]);
    wait_ready(&addr).await;
    // Healthy: both slot alerts exported at 0.
    wait_until("slot alerts at 0", async || {
        alert(&addr, "slot_stalled").await == Some(0.0)
            && alert(&addr, "slot_wal_at_risk").await == Some(0.0)
    })
    .await;

    broker.freeze();
    let before = insert_lsn(&client).await;
    client
        .batch_execute("INSERT INTO public.t SELECT generate_series(1, 100)")
        .await
        .expect("insert");
    // WAL grows past the 8 MiB threshold while nothing can be confirmed.
    for _ in 0..4 {
        client
            .batch_execute(
                "INSERT INTO public.filler SELECT repeat('x', 1000) FROM generate_series(1, 4000)",
            )
            .await
            .expect("filler");
    }
    // While Kafka cannot acknowledge, the slot must not move past the rows,
    // and both alerts fire, each with its warning.
    wait_until("slot_stalled and slot_wal_at_risk firing", async || {
        alert(&addr, "slot_stalled").await == Some(1.0)
            && alert(&addr, "slot_wal_at_risk").await == Some(1.0)
    })
    .await;
    let logged = connector.log();
    for line in [
        "alert slot_stalled: the slot's confirmed LSN has not moved while WAL grows",
        "alert slot_wal_at_risk",
    ] {
        assert!(logged.contains(line), "no {line:?} in the log:\n{logged}");
    }
    let after_insert = insert_lsn(&client).await;
    assert!(
        !confirmed_reached(&client, &db.name, &after_insert).await,
        "the slot advanced past rows Kafka never acknowledged (from {before})"
    );
    // The page says so too (it samples every 2 s).
    wait_until("the stall banner on the page", async || {
        let page = http_get(&addr, "/").await.1;
        page.contains("id=\"stall-warning\"") && page.contains("data-alert=\"slot_wal_at_risk\"")
    })
    .await;
    let status: serde_json::Value =
        serde_json::from_str(&http_get(&addr, "/status").await.1).expect("status");
    assert_eq!(status["slot"]["stalled"], true, "{status}");
    assert!(
        status["slot"]["retained_wal_bytes"].as_f64() > Some(8388608.0),
        "{status}"
    );

    broker.thaw();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !confirmed_reached(&client, &db.name, &after_insert).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the slot did not resume after the broker came back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Confirmed again: the stall clears at once; the retained WAL once
    // restart_lsn follows (a checkpoint logs what it needs).
    wait_until("slot_stalled cleared", async || {
        alert(&addr, "slot_stalled").await == Some(0.0)
    })
    .await;
    let admin = support::connect(&stack.admin_url).await;
    wait_until("slot_wal_at_risk cleared", async || {
        let _ = admin.batch_execute("CHECKPOINT").await;
        alert(&addr, "slot_wal_at_risk").await == Some(0.0)
    })
    .await;
    let records = broker
        .read_topic(&stack, &format!("{}.public.t", db.name), 100)
        .await;
    assert_eq!(records.len(), 100);
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// The field names of a record (unions unwrapped).
fn field_names(v: &Value) -> Vec<String> {
    match unwrap(v) {
        Value::Record(fields) => fields.iter().map(|(n, _)| n.clone()).collect(),
        other => panic!("not a record: {other:?}"),
    }
}

/// `source.columns.<table>.exclude`: the left-out column's values reach no
/// record, in the initial snapshot (in chunks), the stream (new and old
/// images under REPLICA IDENTITY FULL), after DDL moves its position or
/// renames it, and in `pgcdc snapshot`; its name reaches no registered
/// schema. A key column, or a name the table does not have, is refused at
/// start-up and by `pgcdc check`, naming the field.
#[tokio::test]
async fn excluded_columns_never_leave_the_source() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_exclude").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.users (id bigint PRIMARY KEY, email text, secret text, note text);
             ALTER TABLE public.users REPLICA IDENTITY FULL;
             INSERT INTO public.users SELECT g, 'u' || g || '@x', 'HUSH-snap-' || g, 'n' FROM generate_series(1, 30) g;
             ANALYZE public.users;",
        )
        .await
        .expect("table");
    let base = support::pipeline_toml(&stack, &db.url, &db.name, &["public.users"]).replace(
        "[kafka]",
        "[source.snapshot]\nchunk_rows = 10\n[source.columns.\"public.users\"]\nexclude = [\"secret\"]\n[kafka]",
    );
    let (config, parsed) = ConfigFile::parsed(&base);
    let args = [
        "snapshot",
        "--config",
        config.arg(),
        "--table",
        "public.users",
    ];
    let snapshot = || support::pgcdc(&args);

    // Refusals first: nothing is created for them.
    for (exclude, expected) in [
        (
            "\"id\"",
            "source.columns.\"public.users\".exclude[0]: id is a column of public.users's key",
        ),
        (
            "\"secret\", \"scret\"",
            "source.columns.\"public.users\".exclude[1]: public.users has no column scret",
        ),
    ] {
        let bad = ConfigFile::write(
            &base.replace("exclude = [\"secret\"]", &format!("exclude = [{exclude}]")),
        );
        let run = support::pgcdc(&["run", "--config", bad.arg()]).await;
        assert_eq!(run.code, 1, "{}", run.all_output());
        assert!(run.stderr.contains(expected), "{}", run.all_output());
        let check = support::pgcdc(&["check", "--config", bad.arg()]).await;
        assert!(check.stdout.contains(expected), "{}", check.all_output());
    }

    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    support::wait_streaming(&client, &db.name).await;
    client
        .batch_execute(
            "INSERT INTO public.users VALUES (100, 'a@x', 'HUSH-new', 'n');
             UPDATE public.users SET secret = 'HUSH-upd', note = 'm' WHERE id = 100;
             DELETE FROM public.users WHERE id = 1;
             ALTER TABLE public.users ADD COLUMN extra text;
             ALTER TABLE public.users DROP COLUMN note;
             INSERT INTO public.users (id, email, secret, extra) VALUES (101, 'b@x', 'HUSH-moved', 'e');
             UPDATE public.users SET secret = 'HUSH-moved2' WHERE id = 101;",
        )
        .await
        .expect("changes");
    let topic = format!("{}.public.users", db.name);
    // 30 snapshot rows, then c, u, d + tombstone, c, u.
    let read = events(&stack, &topic, 36).await;
    let run = snapshot().await;
    assert!(
        run.stdout.contains("public.users 31 rows"),
        "{}",
        run.all_output()
    );
    let raw = support::read_topic(&stack, &topic, 67, Duration::from_secs(60)).await;
    assert_eq!(raw.len(), 67);
    for r in &raw {
        for bytes in [&r.key, &r.value].into_iter().flatten() {
            assert!(
                !bytes.windows(4).any(|w| w == b"HUSH"),
                "a left-out value at offset {}",
                r.offset
            );
        }
    }
    let ops: Vec<String> = read.iter().map(Event::op).collect();
    assert_eq!(ops[..30], vec!["r".to_string(); 30][..]);
    assert_eq!(ops[30..], ["c", "u", "d", "c", "u", "tombstone"]);
    let values: Vec<&Value> = read.iter().filter_map(|e| e.value.as_ref()).collect();
    for v in &values {
        let image = if text(get(v, "op")) == "d" {
            "before"
        } else {
            "after"
        };
        let names = field_names(get(v, image));
        assert!(!names.contains(&"secret".to_string()), "{names:?}");
        assert!(names.contains(&"email".to_string()), "{names:?}");
    }
    // Positions moved by the DDL: the columns after the left-out one keep
    // their own values.
    assert_eq!(read[30].after("note"), &Value::String("n".into()));
    assert_eq!(read[31].before("email"), &Value::String("a@x".into()));
    assert_eq!(read[31].after("note"), &Value::String("m".into()));
    assert_eq!(read[33].after("email"), &Value::String("b@x".into()));
    assert_eq!(read[33].after("extra"), &Value::String("e".into()));
    assert_eq!(read[34].before("extra"), &Value::String("e".into()));
    let schema = support::latest_schema(&stack, &format!("{topic}-value")).await;
    assert!(!schema.contains("secret"), "{schema}");
    assert!(schema.contains("extra"), "{schema}");

    // Renamed while streaming: left out under its new name too, and a
    // snapshot, which could not tell the new name, refuses.
    client
        .batch_execute(
            "ALTER TABLE public.users RENAME COLUMN secret TO hidden;
             INSERT INTO public.users (id, email, hidden, extra) VALUES (102, 'c@x', 'HUSH-renamed', 'f');
             UPDATE public.users SET hidden = 'HUSH-renamed2', extra = 'g' WHERE id = 102;",
        )
        .await
        .expect("rename");
    let raw = support::read_topic(&stack, &topic, 69, Duration::from_secs(60)).await;
    assert_eq!(raw.len(), 69);
    assert!(
        raw.iter()
            .flat_map(|r| [&r.key, &r.value])
            .flatten()
            .all(|bytes| !bytes.windows(4).any(|w| w == b"HUSH")),
        "a renamed left-out column's value was produced"
    );
    let schema = support::latest_schema(&stack, &format!("{topic}-value")).await;
    assert!(!schema.contains("hidden"), "{schema}");
    assert!(
        connector.log().contains("a left-out column was renamed"),
        "{}",
        connector.log()
    );
    let run = snapshot().await;
    assert_ne!(run.code, 0, "{}", run.all_output());
    assert!(
        run.all_output().contains(
            "source.columns.\"public.users\".exclude[0]: public.users has no column secret now"
        ),
        "{}",
        run.all_output()
    );
    assert_eq!(connector.terminate().await, 0);
    // A restart names the column the list still calls by its old name.
    let restart = support::pgcdc(&["run", "--config", config.arg()]).await;
    assert_eq!(restart.code, 1, "{}", restart.all_output());
    assert!(
        restart.stderr.contains(
            "source.columns.\"public.users\".exclude[0]: public.users has no column secret"
        ),
        "{}",
        restart.all_output()
    );
    db.drop_db().await;
}

/// A publication made by hand with a column list (Postgres 15) streams
/// only those columns: one that leaves out a column `source.columns` does
/// not is refused by `pgcdc check` and `pgcdc run` (a snapshot would read
/// it), and accepted once the column is left out there too.
#[tokio::test]
async fn a_publication_column_list_must_match_the_left_out_columns() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_collist").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "CREATE TABLE public.cards (id bigint PRIMARY KEY, holder text, pan text);
             INSERT INTO public.cards VALUES (1, 'ann', 'HUSH-1');
             CREATE PUBLICATION {} FOR TABLE public.cards (id, holder)",
            db.name
        ))
        .await
        .expect("table");
    let base = support::pipeline_toml(&stack, &db.url, &db.name, &["public.cards"]);
    let expected = format!(
        "publication '{}' publishes only some columns of public.cards (a column list), without pan, which a snapshot would still read",
        db.name
    );
    let short = ConfigFile::write(&base);
    let check = support::pgcdc(&["check", "--config", short.arg()]).await;
    assert!(check.stdout.contains(&expected), "{}", check.all_output());
    assert!(
        check
            .stdout
            .contains("source.columns.\"public.cards\".exclude = [\"pan\"]"),
        "{}",
        check.all_output()
    );
    let run = support::pgcdc(&["run", "--config", short.arg()]).await;
    assert_eq!(run.code, 1, "{}", run.all_output());
    assert!(run.stderr.contains(&expected), "{}", run.all_output());

    let (config, parsed) = ConfigFile::parsed(&base.replace(
        "[kafka]",
        "[source.columns.\"public.cards\"]\nexclude = [\"pan\"]\n[kafka]",
    ));
    let check = support::pgcdc(&["check", "--config", config.arg()]).await;
    assert!(!check.stdout.contains(&expected), "{}", check.all_output());
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    support::wait_streaming(&client, &db.name).await;
    client
        .batch_execute("INSERT INTO public.cards VALUES (2, 'bob', 'HUSH-2')")
        .await
        .expect("insert");
    let topic = format!("{}.public.cards", db.name);
    let read = events(&stack, &topic, 2).await;
    let ops: Vec<String> = read.iter().map(Event::op).collect();
    assert_eq!(ops, ["r", "c"]);
    for e in &read {
        let names = field_names(get(e.value.as_ref().expect("value"), "after"));
        assert_eq!(names, ["id", "holder"]);
    }
    assert_eq!(read[1].after("holder"), &Value::String("bob".into()));
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// A changelog topic made by hand with a smaller `max.message.bytes`
/// than `kafka.max_message_bytes`: the connector keeps to the topic's
/// limit, so a transaction of many small rows (batches over the limit
/// would be refused) streams, and an event over it is quarantined as
/// oversized rather than refused by the broker.
#[tokio::test]
async fn a_topic_with_a_smaller_record_limit_bounds_events_and_batches() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "run_msglimit").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE public.docs (id bigint PRIMARY KEY, body text NOT NULL)")
        .await
        .expect("table");
    let topic = format!("{}.public.docs", db.name);
    support::create_topic(&stack, &topic, &[("max.message.bytes", "50000")]).await;
    let config = ConfigFile::write(
        &support::pipeline_toml(&stack, &db.url, &db.name, &["public.docs"])
            .replace("[kafka]\n", "[kafka]\npartitions = 1\n"),
    );
    let connector = ConnectorProcess::start(&config);
    support::wait_streaming(&client, &db.name).await;
    // 300 rows of 1 kB of md5s (which do not compress away) in one
    // transaction, then one of 60 kB, then a small one.
    client
        .batch_execute(
            "INSERT INTO public.docs SELECT n, (SELECT string_agg(md5((n * 100 + g)::text), '') FROM generate_series(1, 32) g) FROM generate_series(1, 300) n;
             INSERT INTO public.docs SELECT 1000, string_agg(md5(g::text), '') FROM generate_series(1, 1875) g;
             INSERT INTO public.docs VALUES (1001, 'after');",
        )
        .await
        .expect("rows");
    let read = events(&stack, &topic, 301).await;
    let ids: Vec<i64> = read.iter().map(Event::key_id).collect();
    assert_eq!(ids, (1..=300).chain([1001]).collect::<Vec<_>>());
    // Quarantined whole: pgcdc made the dead-letter topic, with room.
    let dlq = format!("{}.dlq", db.name);
    let quarantined = support::read_topic(&stack, &dlq, 1, Duration::from_secs(60)).await;
    assert!(
        quarantined
            .iter()
            .all(|p| p.header("pgcdc.failure.class") == Some("oversized")
                && p.value.as_ref().is_some_and(|v| v.len() > 60_000)),
        "{quarantined:?}"
    );
    let log = connector.log();
    assert!(
        log.contains("a topic takes smaller records than kafka.max_message_bytes")
            && log.contains("effective=48976")
            && log.contains("over 48976, the bound of topic"),
        "{log}"
    );
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}
