//! Incremental snapshots (`pgcdc snapshot`) against the real stack: taken
//! in chunks while writers keep changing the table, a snapshot row never
//! overwrites a newer change, and reading the topic from the snapshot's
//! start offsets gives exactly the table; a crash mid-snapshot resumes.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use apache_avro::types::Value;

use crate::support::{self, field, ConfigFile, ConnectorProcess, Decoder, Stack, TestDb};
use pgcdc::snapshot_marker::{self, Kind, Marker, Phase};

const ROWS: i64 = 3000;

/// A table of `ROWS` rows whose `v` only ever grows, and a pipeline over
/// it with small incremental chunks.
async fn setup(stack: &Stack, prefix: &str) -> (TestDb, ConfigFile, pgcdc::config::Config) {
    let db = TestDb::create(stack, prefix).await;
    db.client()
        .await
        .batch_execute(&format!(
            "CREATE TABLE public.items (id bigint PRIMARY KEY, v bigint NOT NULL, pad text);
             INSERT INTO public.items SELECT g, 0, repeat('x', 40) FROM generate_series(1, {ROWS}) g;"
        ))
        .await
        .expect("items");
    let config = ConfigFile::write(&format!(
        "{}\n[source.snapshot]\nincremental_chunk_rows = 100\n",
        support::pipeline_toml(stack, &db.url, &db.name, &["public.items"])
    ));
    let parsed = pgcdc::config::Config::load(&config.path).expect("config");
    (db, config, parsed)
}

/// Writers that bump `v` of random rows, delete a few and insert new ids
/// (never reusing one), until stopped; returns the statements run.
fn writers(url: &str, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    let url = url.to_string();
    tokio::spawn(async move {
        let client = support::connect(&url).await;
        let (mut x, mut next, mut n) = (0x2545_f491_4f6c_dd1du64, ROWS + 1, 0u64);
        while !stop.load(Ordering::Relaxed) {
            let mut sql = String::from("BEGIN;");
            // Now and then a run of 40 neighbours: chunks are read in key
            // order, so runs hit keys inside a chunk's window often.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x % 3 == 0 {
                let from = 1 + (x % ROWS as u64) as i64;
                sql.push_str(&format!(
                    "UPDATE public.items SET v = v + 1 WHERE id BETWEEN {from} AND {};",
                    from + 39
                ));
            }
            for _ in 0..20 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let id = 1 + (x % ROWS as u64) as i64;
                match x % 20 {
                    0 => sql.push_str(&format!("DELETE FROM public.items WHERE id = {id};")),
                    1 => {
                        sql.push_str(&format!(
                            "INSERT INTO public.items VALUES ({next}, 0, 'new');"
                        ));
                        next += 1;
                    }
                    _ => sql.push_str(&format!(
                        "UPDATE public.items SET v = v + 1 WHERE id = {id};"
                    )),
                }
                n += 1;
            }
            sql.push_str("COMMIT;");
            client.batch_execute(&sql).await.expect("writer");
            // About 1,000 changes a second: busy, but not faster than a
            // debug build beside the other tests can stream, so that
            // watermarks arrive while the writers still write.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        n
    })
}

/// One decoded change event of the items topic.
#[derive(Debug, Clone)]
struct Event {
    partition: i32,
    offset: i64,
    id: i64,
    op: String,
    v: Option<i64>,
    position: (i64, i64),
    snapshot: String,
}

fn long(v: &Value) -> i64 {
    match v {
        Value::Long(n) => *n,
        Value::Int(n) => i64::from(*n),
        other => panic!("not a number: {other:?}"),
    }
}

async fn events(stack: &Stack, topic: &str) -> Vec<Event> {
    let total = crate::materialize::end_offsets(stack, topic).await;
    let records = support::read_topic_until(stack, topic, Duration::from_secs(120), move |r| {
        r.len() as i64 >= total
    })
    .await;
    let mut decoder = Decoder::new(stack);
    let mut out = Vec::new();
    for r in records {
        let Some(value) = &r.value else { continue };
        let envelope = decoder.decode(value).await;
        let op = match field(&envelope, "op") {
            Value::String(s) => s.clone(),
            other => panic!("op {other:?}"),
        };
        let image = if op == "d" {
            field(&envelope, "before")
        } else {
            field(&envelope, "after")
        };
        let source = field(&envelope, "source");
        out.push(Event {
            partition: r.partition,
            offset: r.offset,
            id: long(field(image, "id")),
            v: (op != "d").then(|| long(field(image, "v"))),
            position: (
                long(field(source, "commit_lsn")),
                long(field(source, "seq")),
            ),
            snapshot: match field(source, "snapshot") {
                Value::String(s) => s.clone(),
                Value::Enum(_, s) => s.clone(),
                other => format!("{other:?}"),
            },
            op,
        });
    }
    out.sort_by_key(|e| (e.partition, e.offset));
    out
}

/// `pgcdc snapshot --config FILE --table TABLE EXTRA...`, and the id it
/// printed.
async fn request(config: &ConfigFile, table: &str, extra: &[&str]) -> (support::Run, String) {
    let mut args = vec!["snapshot", "--config", config.arg(), "--table", table];
    args.extend_from_slice(extra);
    let run = support::pgcdc(&args).await;
    let id = run
        .stdout
        .split_whitespace()
        .nth(2)
        .unwrap_or_default()
        .to_string();
    (run, id)
}

/// The latest marker of incremental snapshot `id`.
async fn marker(config: &pgcdc::config::Config, id: &str) -> Option<Marker> {
    snapshot_marker::all(&config.kafka, &snapshot_marker::topic(config))
        .await
        .expect("markers")
        .into_iter()
        .rfind(|m| m.kind == Kind::Incremental && m.id.as_deref() == Some(id))
}

/// Per key, by position (the order a consumer's position guard applies
/// them in), `v` never goes back: no older image overwrote a newer one.
/// Without a crash the log order itself is that order (`replays`: false).
/// Then, applying the events from the snapshot's start offsets by
/// position gives exactly the table.
async fn assert_consistent(
    events: &[Event],
    done: &Marker,
    topic: &str,
    client: &tokio_postgres::Client,
    replays: bool,
) {
    let mut by_key: HashMap<i64, Vec<&Event>> = HashMap::new();
    for e in events {
        by_key.entry(e.id).or_default().push(e);
    }
    for (id, list) in by_key.iter_mut() {
        if !replays {
            for w in list.windows(2) {
                assert!(
                    w[1].position > w[0].position,
                    "key {id}: position {:?} at offset {} follows {:?} at offset {}",
                    w[1].position,
                    w[1].offset,
                    w[0].position,
                    w[0].offset
                );
            }
        }
        list.sort_by_key(|e| e.position);
        for w in list.windows(2) {
            if let (Some(a), Some(b)) = (w[0].v, w[1].v) {
                assert!(
                    b >= a,
                    "key {id}: {} event (snapshot={}) at position {:?} carries v={b} after v={a}: an older image overwrote a newer one",
                    w[1].op, w[1].snapshot, w[1].position
                );
            }
        }
    }
    let start = &done.start_offsets[topic];
    let mut newest: HashMap<i64, &Event> = HashMap::new();
    for e in events
        .iter()
        .filter(|e| e.offset >= start.get(&e.partition).copied().unwrap_or(0))
    {
        if newest.get(&e.id).is_none_or(|n| e.position > n.position) {
            newest.insert(e.id, e);
        }
    }
    let replayed: BTreeMap<i64, i64> = newest
        .values()
        .filter_map(|e| e.v.map(|v| (e.id, v)))
        .collect();
    let table: BTreeMap<i64, i64> = client
        .query("SELECT id, v FROM public.items", &[])
        .await
        .expect("items")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        replayed.len(),
        table.len(),
        "rows from the start offsets vs the table"
    );
    assert!(
        replayed == table,
        "applying the log from the snapshot's start offsets does not give the table"
    );
}

#[tokio::test]
async fn an_incremental_snapshot_under_concurrent_writes_never_overwrites_a_newer_change() {
    let stack = support::stack();
    let (db, config, parsed) = setup(&stack, "incr").await;
    let client = db.client().await;
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;

    let stop = Arc::new(AtomicBool::new(false));
    let work = writers(&db.url, stop.clone());
    let (run, id) = request(&config, "public.items", &["--timeout-secs", "240"]).await;
    stop.store(true, Ordering::Relaxed);
    let written = work.await.expect("writers");
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(run.stdout.contains("completed"), "{}", run.stdout);
    assert!(written > 0);
    support::wait_caught_up(&client, &parsed.source.slot).await;

    let done = marker(&parsed, &id).await.expect("the snapshot's marker");
    assert_eq!(done.phase, Phase::Completed);
    assert!(done.chunks["public.items"] >= 30, "{done:?}");
    let topic = format!("{}.public.items", db.name);
    let events = events(&stack, &topic).await;
    let incremental: Vec<&Event> = events
        .iter()
        .filter(|e| e.snapshot == "incremental")
        .collect();
    assert_eq!(incremental.len() as u64, done.rows["public.items"]);
    assert!(incremental.iter().all(|e| e.op == "r"));
    assert!(!incremental.is_empty());
    assert_consistent(&events, &done, &topic, &client, false).await;
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

#[tokio::test]
async fn an_incremental_snapshot_resumes_after_the_connector_is_killed() {
    let stack = support::stack();
    let (db, config, parsed) = setup(&stack, "incr_kill").await;
    let client = db.client().await;
    let mut connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    let (run, id) = request(&config, "public.items", &["--no-wait"]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());

    // Killed once a few chunks are recorded, while writers go on.
    let stop = Arc::new(AtomicBool::new(false));
    let work = writers(&db.url, stop.clone());
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let m = marker(&parsed, &id).await;
        if m.as_ref()
            .is_some_and(|m| m.chunks.get("public.items").copied().unwrap_or(0) >= 3)
        {
            assert_eq!(
                m.map(|m| m.phase),
                Some(Phase::Started),
                "finished before the kill"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no chunk was recorded"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = connector.child.start_kill();
    let _ = connector.child.wait().await;
    let connector = ConnectorProcess::start(&config);
    let done =
        pgcdc::connector::incremental::wait(&parsed, &id, Some(Duration::from_secs(240)), |_| {})
            .await
            .expect("the snapshot completes after the restart");
    stop.store(true, Ordering::Relaxed);
    work.await.expect("writers");
    support::wait_caught_up(&client, &parsed.source.slot).await;
    let topic = format!("{}.public.items", db.name);
    let events = events(&stack, &topic).await;
    assert_consistent(&events, &done, &topic, &client, true).await;
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

#[tokio::test]
async fn a_snapshot_that_cannot_run_is_refused_or_recorded_as_failed_while_streaming_goes_on() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "incr_fail").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.items (id bigint PRIMARY KEY, v bigint NOT NULL, pad text);
             CREATE TABLE public.other (id int PRIMARY KEY);
             CREATE TABLE public.nokey (v int);
             ALTER TABLE public.nokey REPLICA IDENTITY FULL;
             INSERT INTO public.other SELECT generate_series(1, 10);",
        )
        .await
        .expect("tables");
    let all = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.items", "public.other", "public.nokey"],
    ));
    let connector = ConnectorProcess::start(&all);
    let parsed = pgcdc::config::Config::load(&all.path).expect("config");
    support::wait_snapshot_completed(&parsed).await;

    // No unique key to read it in order: refused before anything is asked.
    let (refused, _) = request(&all, "public.nokey", &[]).await;
    assert_eq!(refused.code, 1, "{}", refused.all_output());
    assert!(
        refused.stderr.contains("public.nokey") && refused.stderr.contains("primary key"),
        "{}",
        refused.stderr
    );
    assert_eq!(connector.terminate().await, 0);

    // Asked while no connector streams; by the time one does, the table
    // is no longer captured.
    let (asked, id) = request(&all, "public.other", &["--no-wait"]).await;
    assert_eq!(asked.code, 0, "{}", asked.all_output());
    assert!(
        asked.stderr.contains("no connector is streaming"),
        "{}",
        asked.stderr
    );
    let items_only = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.items"],
    ));
    let narrowed = pgcdc::config::Config::load(&items_only.path).expect("config");
    let connector = ConnectorProcess::start(&items_only);
    let failed =
        pgcdc::connector::incremental::wait(&narrowed, &id, Some(Duration::from_secs(120)), |_| {})
            .await
            .expect_err("a snapshot of a table no longer captured cannot complete");
    assert!(
        failed.contains("failed") && failed.contains("not captured"),
        "{failed}"
    );
    assert_eq!(
        marker(&narrowed, &id).await.map(|m| m.phase),
        Some(Phase::Failed)
    );

    // The connector did not stop for it: changes still stream.
    client
        .batch_execute("INSERT INTO public.items VALUES (1, 1, 'after')")
        .await
        .expect("insert");
    support::wait_caught_up(&client, &narrowed.source.slot).await;
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}

/// `pgcdc snapshot --stop`: ends the snapshots of the tables named,
/// waiting ones before they began and the running one mid-table, each
/// recorded as failed with the reason; the queue goes on, and with
/// nothing left it says so.
#[tokio::test]
async fn snapshots_running_or_waiting_are_stopped_on_request() {
    let stack = support::stack();
    let (db, _, _) = setup(&stack, "incr_stop").await;
    db.client()
        .await
        .batch_execute("CREATE TABLE public.small (id int PRIMARY KEY); INSERT INTO public.small SELECT generate_series(1, 5);")
        .await
        .expect("small");
    // One row per chunk: the 3,000 rows of items take long enough.
    let config = ConfigFile::write(&format!(
        "{}\n[source.snapshot]\nincremental_chunk_rows = 1\n",
        support::pipeline_toml(&stack, &db.url, &db.name, &["public.items", "public.small"])
    ));
    let parsed = pgcdc::config::Config::load(&config.path).expect("config");
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    let stop = |tables: &[&str]| {
        let mut args = vec!["snapshot", "--config", config.arg(), "--stop"];
        for t in tables {
            args.extend(["--table", t]);
        }
        let args: Vec<String> = args.into_iter().map(String::from).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            support::pgcdc(&args).await
        }
    };

    let (_, running) = request(&config, "public.items", &["--no-wait"]).await;
    let (_, first) = request(&config, "public.small", &["--no-wait"]).await;
    let (_, second) = request(&config, "public.small", &["--no-wait"]).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while marker(&parsed, &running)
        .await
        .is_none_or(|m| m.chunks.get("public.items").copied().unwrap_or(0) < 3)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no chunk was recorded"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for id in [&first, &second] {
        assert_eq!(
            marker(&parsed, id).await.map(|m| m.phase),
            Some(Phase::Started),
            "{id} waits behind {running}"
        );
    }

    // The waiting ones only: items goes on.
    let run = stop(&["public.small"]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    for id in [&first, &second] {
        assert!(
            run.stdout
                .contains(&format!("incremental snapshot {id} stopped")),
            "{}",
            run.all_output()
        );
        let m = marker(&parsed, id).await.expect("marker");
        assert_eq!(m.phase, Phase::Failed);
        assert_eq!(
            m.error.as_deref(),
            Some(pgcdc::connector::incremental::STOPPED)
        );
    }
    let items = marker(&parsed, &running).await.expect("marker");
    assert_eq!(
        items.phase,
        Phase::Started,
        "{running} was not asked to stop"
    );

    // The running one, mid-table.
    let run = stop(&[]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stdout
            .contains(&format!("incremental snapshot {running} stopped")),
        "{}",
        run.all_output()
    );
    let stopped = marker(&parsed, &running).await.expect("marker");
    assert_eq!(stopped.phase, Phase::Failed);
    let read = stopped.rows.get("public.items").copied().unwrap_or(0);
    assert!(
        read < ROWS as u64,
        "{read} rows: it finished before the stop"
    );
    // What it produced is what its marker counts: the chunk being read
    // when the stop came was dropped, not produced later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let topic = format!("{}.public.items", db.name);
    let produced = events(&stack, &topic)
        .await
        .iter()
        .filter(|e| e.snapshot == "incremental")
        .count() as u64;
    assert_eq!(produced, read);
    let run = stop(&[]).await;
    assert!(
        run.stdout
            .contains("no incremental snapshot is running or waiting"),
        "{}",
        run.all_output()
    );

    // The engine is free for the next one.
    let (done, _) = request(&config, "public.small", &["--timeout-secs", "120"]).await;
    assert_eq!(done.code, 0, "{}", done.all_output());
    assert!(
        done.stdout.contains("public.small 5 rows"),
        "{}",
        done.all_output()
    );
    assert_eq!(connector.terminate().await, 0);
    db.drop_db().await;
}
