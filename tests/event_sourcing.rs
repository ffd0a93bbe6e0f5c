//! CDC against event sourcing, side by side on the ledger scenario
//! (tests/ledger/): the event store, outbox routing, projections with
//! upcasters, and the test kit (`pgcdc::testkit`) that runs the pipeline
//! in-process and waits for it without sleeps.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use pgcdc::config::Config;
use pgcdc::event_store::{AppendError, EventStore, Expected, NewEvent, VersionFound};
use pgcdc::projection::{self, Projection, Upcasters};
use pgcdc::sink::CreateClient as _;
use pgcdc::testkit::{self, Pipeline, Rows};
use serde_json::json;

use crate::ledger::{self, AppVersions, Command, Intent, Writer};
use crate::support::{self, Stack, TestDb};

const WAIT: Duration = Duration::from_secs(180);

fn config(
    stack: &Stack,
    source: &TestDb,
    target: Option<&TestDb>,
    extra: &str,
) -> (Config, support::ConfigFile) {
    let mut toml = support::pipeline_toml(
        stack,
        &source.url,
        &source.name,
        &["public.accounts", "public.payments", "event_store.events"],
    );
    toml.push_str("\n[kafka.properties]\n\"linger.ms\" = \"5\"\n");
    toml.push_str(ledger::OUTBOX);
    if let Some(t) = target {
        toml.push_str(&format!(
            "\n[target]\nurl = \"{}\"\nbatch_size = 200\n",
            t.url
        ));
        toml.push_str(ledger::CDC_READ_MODELS);
    }
    toml.push_str(extra);
    let file = support::ConfigFile::write(&toml);
    let config = Config::load(&file.path).unwrap_or_else(|e| panic!("config: {e}"));
    (config, file)
}

async fn ledger_source(stack: &Stack, prefix: &str) -> (TestDb, tokio_postgres::Client) {
    let db = TestDb::create(stack, prefix).await;
    let client = db.client().await;
    Writer::setup(&client).await;
    (db, client)
}

fn domain_topics(config: &Config) -> Vec<String> {
    ["account", "payment"]
        .iter()
        .map(|r| format!("{}.events.{r}", config.kafka.topic_prefix))
        .collect()
}

/// `(CDC query, event-sourced query, key)` of the three read models.
fn pairs(es: &str) -> Vec<(String, String, &'static str)> {
    [
        ("statement", "payment_id"),
        ("fraud_queue", "payment_id"),
        ("regulatory_export", "payment_id"),
    ]
    .iter()
    .map(|(t, k)| {
        let cols = match *t {
            "statement" => "payment_id, account_id, customer, amount, status, status_day",
            "fraud_queue" => "payment_id, account_id, amount, rule",
            _ => "payment_id, account_id, customer, amount, settled_day",
        };
        (
            format!("SELECT {cols} FROM cdc.{t}"),
            format!("SELECT {cols} FROM {es}.{t}"),
            *k,
        )
    })
    .collect()
}

async fn compare(target: &tokio_postgres::Client, es: &str) {
    for (cdc, events, key) in pairs(es) {
        let left = Rows::read(target, &cdc, &cdc, &[key])
            .await
            .expect("cdc rows");
        let right = Rows::read(target, &events, &events, &[key])
            .await
            .expect("es rows");
        assert!(!left.is_empty(), "{cdc}: no rows, nothing compared");
        testkit::assert_same(&left, &right);
    }
}

#[tokio::test]
async fn the_event_store_appends_at_an_expected_version_and_refuses_changes() {
    let stack = support::stack();
    let (db, mut client) = ledger_source(&stack, "es_store").await;
    let store = EventStore::default();
    let e = |n: i64| NewEvent::new("Noted", 1, json!({"n": n}));
    assert_eq!(
        store
            .append_now(&mut client, "note", "s-1", Expected::NoStream, &[e(1)])
            .await
            .expect("first append"),
        1
    );
    assert_eq!(
        store
            .append_now(
                &mut client,
                "note",
                "s-1",
                Expected::Exact(1),
                &[e(2), e(3)]
            )
            .await
            .expect("second append"),
        3
    );
    // A stale expectation is a typed conflict, and the transaction goes on.
    let mut tx = client.transaction().await.expect("tx");
    match store
        .append(&mut tx, "note", "s-1", Expected::Exact(1), &[e(9)])
        .await
    {
        Err(AppendError::Conflict {
            expected: Expected::Exact(1),
            actual: VersionFound::At(3),
            ..
        }) => {}
        other => panic!("expected a conflict at version 3, got {other:?}"),
    }
    match store
        .append(&mut tx, "note", "s-1", Expected::NoStream, &[e(9)])
        .await
    {
        Err(AppendError::Conflict {
            actual: VersionFound::At(3),
            ..
        }) => {}
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(
        store
            .append(&mut tx, "note", "s-1", Expected::Exact(3), &[e(4)])
            .await
            .expect("the transaction is still usable"),
        4
    );
    tx.commit().await.expect("commit");

    // Two writers that read the same version: the second one conflicts.
    let mut other = db.client().await;
    let other_pid: i32 = other
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    let mut first = client.transaction().await.expect("tx");
    store
        .append(&mut first, "note", "s-1", Expected::Exact(4), &[e(5)])
        .await
        .expect("first writer");
    let store2 = store.clone();
    let second = tokio::spawn(async move {
        store2
            .append_now(&mut other, "note", "s-1", Expected::Exact(4), &[e(50)])
            .await
    });
    // Until the second writer waits on the first one's row (it read
    // version 4 and tries to insert version 5 too).
    let watch = db.client().await;
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let waiting: Option<String> = watch
            .query_one(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1",
                &[&other_pid],
            )
            .await
            .expect("activity")
            .get(0);
        if waiting.as_deref() == Some("Lock") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the second writer never blocked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.commit().await.expect("commit first");
    match second.await.expect("task") {
        Err(AppendError::Conflict {
            actual: VersionFound::Concurrent,
            ..
        }) => {}
        other => panic!("expected a concurrent conflict, got {other:?}"),
    }

    let stream = store.read_stream(&client, "s-1").await.expect("read");
    let versions: Vec<i64> = stream.iter().map(|e| e.version).collect();
    assert_eq!(versions, vec![1, 2, 3, 4, 5]);
    let ns: Vec<i64> = stream
        .iter()
        .map(|e| e.payload["n"].as_i64().unwrap_or(-1))
        .collect();
    assert_eq!(ns, vec![1, 2, 3, 4, 5]);
    let all = store.read_all(&client, 0, 100).await.expect("read all");
    assert_eq!(all.len(), 5);
    assert!(all
        .windows(2)
        .all(|w| w[0].global_position < w[1].global_position));

    for sql in [
        "UPDATE event_store.events SET payload = '{}'",
        "DELETE FROM event_store.events",
        "TRUNCATE event_store.events",
    ] {
        let err = client.batch_execute(sql).await.expect_err(sql);
        assert!(
            pgcdc::source::error_text(&err).contains("append-only"),
            "{sql}: {}",
            pgcdc::source::error_text(&err)
        );
    }
    db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_rows_become_domain_events_keyed_by_stream_in_stream_order() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "es_outbox").await;
    let client = db.client().await;
    // Two Debezium-style outboxes (rows are inserted, then deleted): one
    // keyed by a uuid and ordered by `seq`, one by an identity. Both heaps
    // are out of order before the snapshot (the first rows moved to the
    // end), so only the snapshot's ORDER BY keeps each stream in order.
    client
        .batch_execute(
            "CREATE TABLE public.outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
                 aggregatetype text, aggregateid text NOT NULL, type text NOT NULL, seq int NOT NULL, payload jsonb);
             INSERT INTO public.outbox (aggregatetype, aggregateid, type, seq, payload)
                 SELECT 'order', 'order-' || (i % 7), 'OrderNoted', i, jsonb_build_object('i', i) FROM generate_series(1, 30) i;
             UPDATE public.outbox SET payload = payload WHERE seq <= 15;
             CREATE TABLE public.invoice_outbox (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                 aggregatetype text, aggregateid text NOT NULL, type text NOT NULL, seq int NOT NULL, payload jsonb);
             INSERT INTO public.invoice_outbox (aggregatetype, aggregateid, type, seq, payload)
                 SELECT 'invoice', 'invoice-' || (i % 3), 'InvoiceNoted', i, jsonb_build_object('i', i) FROM generate_series(1, 20) i;
             UPDATE public.invoice_outbox SET payload = payload WHERE seq <= 10;",
        )
        .await
        .expect("outbox");
    let toml = support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.outbox", "public.invoice_outbox"],
    )
    // Domain topics stay `delete` even when changelogs compact.
    .replacen(
        "[kafka]\n",
        "[kafka]\npartitions = 3\ncleanup_policy = \"compact\"\n",
        1,
    ) + r#"
[outbox."public.outbox"]
route_by = "aggregatetype"
topic = "{prefix}.outbox.{route}"
key = "aggregateid"
payload = "payload"
headers = ["type", "seq"]
order_by = "seq"

[outbox."public.invoice_outbox"]
route_by = "aggregatetype"
topic = "{prefix}.outbox.{route}"
key = "aggregateid"
payload = "payload"
headers = ["type", "seq"]
"#;
    let file = support::ConfigFile::write(&toml);
    let config = Config::load(&file.path).unwrap_or_else(|e| panic!("config: {e}"));
    let mut pipeline = Pipeline::start(config.clone());
    // After the snapshot: a row inserted and deleted while the slot is
    // still looking for its consistent point is in neither the snapshot
    // nor the stream (as for any CDC tool).
    support::wait_snapshot_completed(&config).await;
    // Streamed: inserts (routed), deletes and updates (skipped, a key
    // change too), and a row without a route (quarantined, never dropped).
    for i in 31..=60 {
        client
            .batch_execute(&format!(
                "BEGIN;
                 INSERT INTO public.outbox (aggregatetype, aggregateid, type, seq, payload)
                     VALUES ('order', 'order-{}', 'OrderNoted', {i}, '{{\"i\": {i}}}');
                 DELETE FROM public.outbox WHERE seq = {i};
                 COMMIT;",
                i % 7
            ))
            .await
            .expect("outbox write");
    }
    client
        .batch_execute(
            "UPDATE public.outbox SET type = 'Changed' WHERE seq = 1;
             UPDATE public.outbox SET id = gen_random_uuid(), type = 'KeyChanged' WHERE seq = 2;
             INSERT INTO public.outbox (aggregatetype, aggregateid, type, seq, payload) VALUES (NULL, 'order-x', 'Unroutable', 61, '{\"i\": 61}');",
        )
        .await
        .expect("update and unroutable");
    let lsn = testkit::current_lsn(&client).await.expect("lsn");
    pipeline
        .wait_caught_up(&client, &lsn, WAIT)
        .await
        .expect("caught up");

    for (route, streams, count) in [("order", 7, 60), ("invoice", 3, 20)] {
        let topic = format!("{}.outbox.{route}", db.name);
        let records = support::read_topic(&stack, &topic, count, WAIT).await;
        assert_eq!(
            records.len(),
            count,
            "{topic}: every insert once; no update or delete"
        );
        let mut last: BTreeMap<String, i64> = BTreeMap::new();
        for r in &records {
            let key = String::from_utf8(r.key.clone().expect("key")).expect("utf-8 key");
            let seq: i64 = r.header("seq").expect("seq header").parse().expect("seq");
            assert!(
                r.header("type").is_some_and(|t| t.ends_with("Noted")),
                "{topic}: an update was routed: {:?}",
                r.headers
            );
            let value: serde_json::Value =
                serde_json::from_slice(r.value.as_deref().expect("value")).expect("JSON payload");
            assert_eq!(value, json!({"i": seq}), "the payload is the value");
            assert_eq!(key, format!("{route}-{}", seq % streams));
            assert_eq!(
                r.partition,
                pgcdc::sink::partition_for(key.as_bytes(), 3),
                "keyed by the aggregate id (murmur2)"
            );
            assert!(r.header("pgcdc.position").is_some() && r.header("pgcdc.lsn").is_some());
            // Within a stream, in the order written.
            if let Some(prev) = last.insert(key.clone(), seq) {
                assert!(prev < seq, "{topic} {key}: {seq} after {prev}");
            }
        }
        assert_eq!(last.len() as i64, streams);
        let cleanup = topic_config(&stack, &topic, "cleanup.policy").await;
        assert_eq!(cleanup.as_deref(), Some("delete"), "{topic}");
    }
    let dlq = support::read_topic(&stack, &format!("{}.dlq", db.name), 1, WAIT).await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(
        dlq[0].header("pgcdc.failure.class"),
        Some("unsupported_value")
    );
    assert!(
        dlq[0]
            .header("pgcdc.failure.error")
            .is_some_and(|e| e.contains("aggregatetype is NULL")),
        "{:?}",
        dlq[0].headers
    );
    // Nothing of the event is lost: its payload and its headers.
    assert_eq!(dlq[0].value.as_deref(), Some(&br#"{"i": 61}"#[..]));
    assert_eq!(dlq[0].header("pgcdc.event.type"), Some("Unroutable"));
    assert_eq!(dlq[0].header("pgcdc.event.seq"), Some("61"));
    pipeline.stop().await;
    db.drop_db().await;
}

/// A topic's config value, as the broker reports it.
async fn topic_config(stack: &Stack, topic: &str, name: &str) -> Option<String> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    let admin: AdminClient<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &stack.brokers)
        .client()
        .expect("admin");
    let found = admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &AdminOptions::new())
        .await
        .expect("describe");
    found
        .into_iter()
        .next()
        .and_then(Result::ok)
        .and_then(|r| r.get(name).and_then(|e| e.value.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kit_names_a_part_of_the_pipeline_that_stopped_instead_of_waiting() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "es_stopped").await;
    let client = db.client().await;
    // A uuid-keyed outbox with no order_by: its snapshot order would be
    // random, so the connector refuses it when it sees the table.
    client
        .batch_execute(
            "CREATE TABLE public.outbox (id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
                 aggregatetype text, aggregateid text, payload jsonb)",
        )
        .await
        .expect("outbox");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.outbox"])
        + "[outbox.\"public.outbox\"]\nroute_by = \"aggregatetype\"\nkey = \"aggregateid\"\nheaders = []\n";
    let file = support::ConfigFile::write(&toml);
    let config = Config::load(&file.path).unwrap_or_else(|e| panic!("config: {e}"));
    let mut pipeline = Pipeline::start(config);
    let lsn = testkit::current_lsn(&client).await.expect("lsn");
    let started = std::time::Instant::now();
    match pipeline.wait_caught_up(&client, &lsn, WAIT).await {
        Err(testkit::KitError::Stopped { part, error }) => {
            assert_eq!(part, "connector");
            assert!(
                error.contains("outbox.\"public.outbox\".order_by: is required"),
                "{error}"
            );
        }
        other => panic!("expected the stopped connector, got {other:?}"),
    }
    assert!(started.elapsed() < WAIT / 2, "it waited for the timeout");
    pipeline.stop().await;
    db.drop_db().await;
}

/// Runs `commands` through a full pipeline: CDC read models by the
/// materializer, projections over the domain topics into schema `es`.
async fn run_ledger(
    prefix: &str,
    commands: &[Command],
    app: AppVersions,
) -> (
    TestDb,
    TestDb,
    tokio_postgres::Client,
    tokio_postgres::Client,
    Pipeline,
) {
    let stack = support::stack();
    // The kit attaches to the same stack as our own support code.
    let kit = testkit::Stack::from_env().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (kit.brokers.as_str(), kit.registry_url.as_str()),
        (stack.brokers.as_str(), stack.registry_url.as_str())
    );
    let (source_db, mut source) = ledger_source(&stack, &format!("{prefix}_src")).await;
    let target_db = TestDb::create(&stack, &format!("{prefix}_tgt")).await;
    let target = target_db.client().await;
    let (config, _file) = config(&stack, &source_db, Some(&target_db), "");
    let mut pipeline = Pipeline::start(config.clone());
    let ups = Arc::new(ledger::upcasters());
    let dsn = config.target.as_ref().expect("target").url.clone();
    for p in ledger::projections("es") {
        let p: Arc<dyn Projection> = Arc::from(p);
        let group = format!("{}-{}", config.name, p.name());
        pipeline.project(p, ups.clone(), domain_topics(&config), &group, &dsn);
    }
    let mut writer = Writer::new(app);
    writer.write(&mut source, commands, 0).await;
    let lsn = testkit::current_lsn(&source).await.expect("lsn");
    pipeline
        .wait_caught_up(&source, &lsn, WAIT)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (source_db, target_db, source, target, pipeline)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_workload_gives_equal_read_models_through_cdc_and_through_events() {
    let commands = ledger::workload(0x1ed9e7, 25, 400);
    // The application moved to PaymentInitiated v2 halfway: the live
    // projections upcast the v1 events they consume.
    let app = AppVersions {
        reason_from: 0,
        v2_from: commands.len() / 2,
    };
    let (source_db, target_db, mut source, mut target, mut pipeline) =
        run_ledger("es_equal", &commands, app).await;
    compare(&target, "es").await;

    // Every event delivered again (new consumer groups read the topics
    // from the start): the checkpoints skip them all, nothing changes.
    let config = pipeline.config().clone();
    let dsn = config.target.as_ref().expect("target").url.clone();
    for p in ledger::projections("es") {
        let p: Arc<dyn Projection> = Arc::from(p);
        let group = format!("{}-{}-again", config.name, p.name());
        pipeline.project(
            p,
            Arc::new(ledger::upcasters()),
            domain_topics(&config),
            &group,
            &dsn,
        );
    }
    let lsn = testkit::current_lsn(&source).await.expect("lsn");
    pipeline
        .wait_caught_up(&source, &lsn, WAIT)
        .await
        .unwrap_or_else(|e| panic!("redelivered: {e}"));
    compare(&target, "es").await;

    // Rebuilt from the first event, twice: the same rows as the live
    // projections, both times.
    let store = EventStore::default();
    for round in 0..2 {
        for p in ledger::projections("es_rebuilt") {
            let done = projection::rebuild(
                &mut target,
                &mut source,
                &store,
                p.as_ref(),
                &ledger::upcasters(),
            )
            .await
            .unwrap_or_else(|e| panic!("rebuild round {round}: {e}"));
            assert!(done.applied > 0 && done.duplicates == 0, "{done:?}");
        }
        compare(&target, "es_rebuilt").await;
    }
    // A real difference is caught, and named by key.
    target
        .batch_execute("UPDATE es_rebuilt.statement SET status = 'lost' WHERE payment_id = 7")
        .await
        .expect("tamper");
    let (cdc, es, key) = pairs("es_rebuilt").remove(0);
    let left = Rows::read(&target, "cdc.statement", &cdc, &[key])
        .await
        .expect("rows");
    let right = Rows::read(&target, "es_rebuilt.statement", &es, &[key])
        .await
        .expect("rows");
    let diff = left.diff(&right).expect("a difference").to_string();
    assert!(diff.contains("payment_id=7: status:"), "{diff}");
    assert!(diff.contains("\"lost\""), "{diff}");
    pipeline.stop().await;
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn why_a_payment_was_reversed_is_in_the_events_and_in_cdc_only_where_reason_was_recorded() {
    let commands = ledger::workload(0xfa11, 20, 500);
    // The CRUD application recorded `reason` only from its second half on.
    let app = AppVersions {
        reason_from: commands.len() / 2,
        v2_from: 0,
    };
    let (source_db, target_db, source, target, pipeline) =
        run_ledger("es_intent", &commands, app).await;
    let truth = ledger::reversals(&commands, Intent::Fraud, 0);
    let recorded = ledger::reversals(&commands, Intent::Fraud, app.reason_from);
    assert!(
        !recorded.is_empty() && recorded.len() < truth.len(),
        "the workload must have fraud reversals on both sides of the release: {} of {}",
        recorded.len(),
        truth.len()
    );

    // From the events: the intent is in every reversal's metadata.
    let from_events: BTreeSet<i64> = source
        .query(
            "SELECT (payload->>'payment')::bigint FROM event_store.events
             WHERE event_type = 'PaymentReversed' AND metadata->>'intent' = 'fraud'",
            &[],
        )
        .await
        .expect("events")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(from_events, truth);

    // From CDC (the mirror): only where the reason column captured it.
    let from_cdc: BTreeSet<i64> = target
        .query(
            "SELECT id FROM mirror.payments WHERE status = 'reversed' AND reason = 'fraud'",
            &[],
        )
        .await
        .expect("mirror")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(from_cdc, recorded);
    let unknown: i64 = target
        .query_one(
            "SELECT count(*) FROM mirror.payments WHERE status = 'reversed' AND reason IS NULL",
            &[],
        )
        .await
        .expect("unknown")
        .get(0);
    let before_release = commands[..app.reason_from]
        .iter()
        .filter(|c| matches!(c, Command::Reverse { .. }))
        .count() as i64;
    assert_eq!(
        unknown, before_release,
        "reversals whose why CDC cannot tell"
    );
    pipeline.stop().await;
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test]
async fn a_v1_event_is_upcast_during_replay_to_the_projection_written_as_v2() {
    let stack = support::stack();
    let commands = ledger::workload(0x5c4e, 10, 200);
    let target_db = TestDb::create(&stack, "es_upcast_tgt").await;
    let mut target = target_db.client().await;
    let store = EventStore::default();
    let mut sources = Vec::new();
    // The same workload twice: once written by an application that
    // upgraded to PaymentInitiated v2 halfway, once by v2 throughout.
    for (schema, v2_from) in [("es_mixed", commands.len() / 2), ("es_v2", 0)] {
        let (db, mut client) = ledger_source(&stack, schema).await;
        let mut writer = Writer::new(AppVersions {
            reason_from: 0,
            v2_from,
        });
        writer.write(&mut client, &commands, 0).await;
        let v1: i64 = client
            .query_one(
                "SELECT count(*) FROM event_store.events WHERE event_type = 'PaymentInitiated' AND schema_version = 1",
                &[],
            )
            .await
            .expect("count")
            .get(0);
        assert_eq!(v1 > 0, v2_from > 0, "{schema}: v1 events {v1}");
        let mut models = ledger::projections(schema);
        models.push(Box::new(ledger::Tax::new(schema)));
        for p in models {
            projection::rebuild(
                &mut target,
                &mut client,
                &store,
                p.as_ref(),
                &ledger::upcasters(),
            )
            .await
            .unwrap_or_else(|e| panic!("{schema}: {e}"));
        }
        sources.push((db, client));
    }
    for table in ["statement", "fraud_queue", "regulatory_export", "tax_lines"] {
        let key: &[&str] = if table == "tax_lines" {
            &["payment_id", "kind"]
        } else {
            &["payment_id"]
        };
        let mixed = Rows::read(
            &target,
            &format!("es_mixed.{table}"),
            &format!("SELECT * FROM es_mixed.{table}"),
            key,
        )
        .await
        .expect("rows");
        let v2 = Rows::read(
            &target,
            &format!("es_v2.{table}"),
            &format!("SELECT * FROM es_v2.{table}"),
            key,
        )
        .await
        .expect("rows");
        assert!(!v2.is_empty(), "{table}: nothing compared");
        testkit::assert_same(&mixed, &v2);
    }
    // Without the upcaster the v1 events do not make the same model.
    let without = projection::rebuild(
        &mut target,
        &mut sources[0].1,
        &store,
        &ledger::Statement::new("es_mixed"),
        &Upcasters::new(),
    )
    .await;
    // A v1 PaymentInitiated has no amount: the projection refuses it
    // (Postgres will not read '' as a numeric), it does not guess.
    match &without {
        Err(projection::ProjectionError::Postgres { source, .. })
            if source.code()
                == Some(&tokio_postgres::error::SqlState::INVALID_TEXT_REPRESENTATION) => {}
        other => panic!("expected the v1 amount to be refused, got {other:?}"),
    }
    // The failed rebuild changed nothing: it is one transaction.
    let after = Rows::read(
        &target,
        "es_mixed.statement",
        "SELECT * FROM es_mixed.statement",
        &["payment_id"],
    )
    .await
    .expect("rows");
    let v2 = Rows::read(
        &target,
        "es_v2.statement",
        "SELECT * FROM es_v2.statement",
        &["payment_id"],
    )
    .await
    .expect("rows");
    testkit::assert_same(&after, &v2);
    // One v1 event upcast equals its v2 form.
    let v1 = pgcdc::event_store::RecordedEvent {
        global_position: None,
        event_id: "e".into(),
        stream_type: "payment".into(),
        stream_id: "payment-1".into(),
        version: 1,
        event_type: "PaymentInitiated".into(),
        schema_version: 1,
        payload: json!({"payment": 1, "account": 2, "amount_cents": 123456, "day": 3}),
        metadata: Default::default(),
        recorded_at_ms: 0,
    };
    let up = ledger::upcasters().upcast(v1).expect("upcast");
    assert_eq!(up.schema_version, 2);
    assert_eq!(
        up.payload,
        json!({"payment": 1, "account": 2, "amount": "1234.56", "currency": "EUR", "day": 3})
    );
    for (db, _) in sources {
        db.drop_db().await;
    }
    target_db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_model_added_later_rebuilds_fully_from_events_and_from_cdc_only_as_far_as_retention_reports(
) {
    let stack = support::stack();
    let commands = ledger::workload(0x7a8, 15, 300);
    let half = commands.len() / 2;
    let (source_db, mut source) = ledger_source(&stack, "es_later").await;
    let target_db = TestDb::create(&stack, "es_later_tgt").await;
    let (config, file) = config(&stack, &source_db, Some(&target_db), "");
    let mut pipeline = Pipeline::start(config.clone());
    let mut writer = Writer::new(AppVersions {
        reason_from: 0,
        v2_from: 0,
    });
    writer.write(&mut source, &commands[..half], 0).await;
    let lsn = testkit::current_lsn(&source).await.expect("lsn");
    pipeline
        .wait_caught_up(&source, &lsn, WAIT)
        .await
        .expect("phase 1");

    // Retention cuts the payments topic at the end of the first half.
    let payments = config.topic_for("public.payments");
    let cut = pgcdc::sink::watermarks(&config.kafka, std::slice::from_ref(&payments))
        .await
        .expect("watermarks")
        .remove(&payments)
        .expect("payments topic");
    for (p, (_, high)) in &cut {
        crate::retention::delete_records(&stack, &payments, *p, *high).await;
    }
    writer.write(&mut source, &commands[half..], half).await;
    let lsn = testkit::current_lsn(&source).await.expect("lsn");
    pipeline
        .wait_caught_up(&source, &lsn, WAIT)
        .await
        .expect("phase 2");

    // What the report predicts: nothing complete; the payments history
    // retained from the cut on.
    let run = support::pgcdc(&["retention", "--config", file.arg(), "--json"]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    let report: serde_json::Value = serde_json::from_str(&run.stdout).expect("report JSON");
    let topic = report["topics"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["topic"] == payments.as_str()))
        .expect("the payments topic in the report");
    assert_eq!(topic["begins_with_complete_snapshot"], false, "{topic}");
    let retained: BTreeMap<i32, i64> = topic["partitions"]
        .as_array()
        .expect("partitions")
        .iter()
        .map(|p| {
            (
                p["partition"].as_i64().unwrap_or(-1) as i32,
                p["earliest_offset"].as_i64().unwrap_or(-1),
            )
        })
        .collect();
    let expected_cut: BTreeMap<i32, i64> = cut.iter().map(|(p, (_, h))| (*p, *h)).collect();
    assert_eq!(
        retained, expected_cut,
        "the report names where retention cut"
    );
    let statement = report["read_models"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["name"] == "statement"))
        .expect("statement in the report");
    assert_eq!(statement["reach"]["kind"], "none", "{statement}");
    // And `pgcdc rebuild` does what the report says: no rebuild of a CDC
    // read model from this log without a new snapshot.
    let refused = support::pgcdc(&[
        "rebuild",
        "--config",
        file.arg(),
        "--read-model",
        "statement",
    ])
    .await;
    assert_eq!(refused.code, 2, "{}", refused.all_output());
    assert!(
        refused
            .stderr
            .contains("cannot be rebuilt without a new snapshot"),
        "{}",
        refused.stderr
    );

    // The CDC path: the tax lines need history, which CDC has only in the
    // changelog; folded from what is retained, they are exactly the
    // second half's.
    let end: usize = pgcdc::sink::watermarks(&config.kafka, std::slice::from_ref(&payments))
        .await
        .expect("watermarks")[&payments]
        .values()
        .map(|(low, high)| (high - low) as usize)
        .sum();
    let records = support::read_topic(&stack, &payments, end, WAIT).await;
    assert_eq!(records.len(), end, "the retained range, whole");
    let mut decoder = support::Decoder::new(&stack);
    let mut from_cdc = BTreeMap::new();
    for r in &records {
        let Some(v) = r.value.as_deref() else {
            continue;
        };
        let envelope = decoder.decode(v).await;
        if !matches!(support::field(&envelope, "op"), apache_avro::types::Value::String(op) if op == "u")
        {
            continue;
        }
        let before = support::field(&envelope, "before");
        let after = support::field(&envelope, "after");
        let status = |row: &apache_avro::types::Value| match support::field(row, "status") {
            apache_avro::types::Value::String(s) => s.clone(),
            other => panic!("status {other:?}"),
        };
        // A line per status transition (a flag repeats the status).
        if status(before) == status(after) {
            continue;
        }
        let kind = match status(after).as_str() {
            "settled" => "settlement",
            "reversed" => "reversal",
            _ => continue,
        };
        let id = match support::field(after, "id") {
            apache_avro::types::Value::Long(n) => *n,
            other => panic!("id {other:?}"),
        };
        let day = match support::field(after, "status_day") {
            apache_avro::types::Value::Int(n) => *n,
            other => panic!("status_day {other:?}"),
        };
        let cents = match support::field(after, "amount") {
            apache_avro::types::Value::Decimal(d) => {
                let bytes: Vec<u8> = d.try_into().expect("decimal bytes");
                let text = pgcdc::tail::format_decimal(&bytes, 2);
                (text.parse::<f64>().expect("amount") * 100.0).round() as i64
            }
            other => panic!("amount {other:?}"),
        };
        let sign = if kind == "reversal" { -1 } else { 1 };
        from_cdc.insert((id, kind.to_string()), (day, sign * cents));
    }
    let second_half = ledger::expected_tax_lines(&commands, half);
    let everything = ledger::expected_tax_lines(&commands, 0);
    assert!(
        second_half.len() < everything.len(),
        "the cut removed history"
    );
    assert_eq!(
        from_cdc, second_half,
        "CDC reproduces exactly what the report kept"
    );

    // The event-sourced path rebuilds all of it from the event store.
    let mut target = target_db.client().await;
    projection::rebuild(
        &mut target,
        &mut source,
        &EventStore::default(),
        &ledger::Tax::new("es"),
        &ledger::upcasters(),
    )
    .await
    .expect("rebuild tax lines");
    let from_events: BTreeMap<(i64, String), (i32, i64)> = target
        .query(
            "SELECT payment_id, kind, day, (amount * 100)::bigint FROM es.tax_lines",
            &[],
        )
        .await
        .expect("tax lines")
        .iter()
        .map(|r| ((r.get(0), r.get(1)), (r.get(2), r.get(3))))
        .collect();
    assert_eq!(from_events, everything);
    pipeline.stop().await;
    source_db.drop_db().await;
    target_db.drop_db().await;
}
