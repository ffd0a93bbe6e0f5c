//! The opt-in exactly-once mode (`kafka.exactly_once = true`) against
//! librdkafka's `MockCluster`, the only broker with Kafka transactions we
//! can run here. Postgres and the registry are the real ones.
//!
//! What the mock does and does not do matters for reading these tests: it
//! accepts the transactional protocol (InitProducerId, AddPartitionsToTxn,
//! EndTxn), but it keeps no transaction markers, so a `read_committed`
//! consumer also sees records of transactions that never committed
//! (`the_mock_cluster_does_not_hide_uncommitted_records` pins that down).

use std::collections::HashMap;
use std::time::Duration;

use apache_avro::types::Value;
use pgcdc::sink::CreateClient as _;
use pgcdc::source::pgoutput::Lsn;
use rdkafka::mocking::MockCluster;
use rdkafka::producer::DefaultProducerContext;
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use crate::support::{self, field, ConfigFile, ConnectorProcess, Decoder, Stack, TestDb};

type Mock = MockCluster<'static, DefaultProducerContext>;

/// A mock cluster with the pipeline's topics already created (the mock
/// has no CreateTopics; `pgcdc run` leaves existing topics alone).
fn mock_cluster(prefix: &str) -> Mock {
    let mock = MockCluster::new(1).expect("mock cluster");
    for (topic, partitions) in [
        (format!("{prefix}.public.t"), 3),
        (format!("{prefix}.transaction"), 3),
        (format!("{prefix}.snapshots"), 1),
        (format!("{prefix}.offsets"), 1),
    ] {
        mock.create_topic(&topic, partitions, 1)
            .expect("create topic");
    }
    mock
}

fn eos_toml(stack: &Stack, db: &TestDb, mock: &Mock) -> String {
    support::pipeline_toml(stack, &db.url, &db.name, &["public.t"])
        .replace(&stack.brokers, &mock.bootstrap_servers())
        .replace(
            &format!("topic_prefix = \"{}\"\n", db.name),
            &format!(
                "topic_prefix = \"{}\"\nexactly_once = true\ntransaction_interval_ms = 50\n",
                db.name
            ),
        )
}

async fn insert_lsn(client: &tokio_postgres::Client) -> u64 {
    let lsn: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .expect("lsn")
        .get(0);
    lsn.parse::<Lsn>().expect("lsn").0
}

/// Inserts `txns` transactions of `rows` rows each, ids from `first`;
/// returns the WAL position before the last one commits, so that a commit
/// LSN above it belongs to the last transaction (or a later one).
async fn insert_txns(client: &tokio_postgres::Client, first: i64, txns: i64, rows: i64) -> u64 {
    let mut before_last = 0;
    for t in 0..txns {
        if t == txns - 1 {
            before_last = insert_lsn(client).await;
        }
        let from = first + t * rows;
        client
            .batch_execute(&format!(
                "INSERT INTO public.t SELECT g, 0 FROM generate_series({from}, {}) g",
                from + rows - 1
            ))
            .await
            .expect("insert");
    }
    before_last
}

/// Waits until the committed offset record covers a transaction whose
/// commit LSN is above `lsn`.
async fn wait_offset_beyond(config: &pgcdc::config::Config, lsn: u64) {
    let topic = pgcdc::offsets::topic(config);
    // Generous: a replay of 200,000 rows in a debug build, beside the
    // other tests, on two cores.
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        let latest = pgcdc::offsets::latest(&config.kafka, &topic, &config.source.slot)
            .await
            .expect("read offsets");
        if latest.as_ref().is_some_and(|o| o.commit() > lsn) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no offset record beyond {} (latest {latest:?})",
            Lsn(lsn)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn confirmed_flush(client: &tokio_postgres::Client, slot: &str) -> u64 {
    let lsn: String = client
        .query_one(
            "SELECT coalesce(confirmed_flush_lsn, '0/0')::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("slot")
        .get(0);
    lsn.parse::<Lsn>().expect("lsn").0
}

async fn wait_inactive(client: &tokio_postgres::Client, slot: &str) {
    for _ in 0..300 {
        let active: bool = client
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .expect("slot")
            .get(0);
        if !active {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("slot {slot} stayed active");
}

/// Reads the changelog as a `read_committed` consumer until `ids`
/// distinct keys arrived; returns id → every (op, commit LSN, seq) seen.
async fn changelog(
    stack: &Stack,
    mock: &Mock,
    topic: &str,
    ids: usize,
) -> HashMap<i64, Vec<(String, i64, i64)>> {
    let records = support::read_topic_at(
        &mock.bootstrap_servers(),
        topic,
        Duration::from_secs(120),
        move |records| {
            records
                .iter()
                .filter_map(|r| r.key.as_deref())
                .collect::<std::collections::HashSet<_>>()
                .len()
                >= ids
        },
    )
    .await;
    let mut decoder = Decoder::new(stack);
    let mut out: HashMap<i64, Vec<(String, i64, i64)>> = HashMap::new();
    for r in records {
        let (Some(k), Some(v)) = (&r.key, &r.value) else {
            continue;
        };
        let key = decoder.decode(k).await;
        let value = decoder.decode(v).await;
        let src = field(&value, "source");
        let (Value::Long(id), Value::String(op), Value::Long(c), Value::Long(s)) = (
            field(&key, "id"),
            field(&value, "op"),
            field(src, "commit_lsn"),
            field(src, "seq"),
        ) else {
            panic!("event shape: {value:?}")
        };
        out.entry(*id).or_default().push((op.clone(), *c, *s));
    }
    out
}

fn assert_each_once(
    events: &HashMap<i64, Vec<(String, i64, i64)>>,
    ids: std::ops::RangeInclusive<i64>,
) {
    for id in ids {
        let seen = events.get(&id).map(Vec::as_slice).unwrap_or_default();
        assert_eq!(seen.len(), 1, "id {id}: {seen:?}");
    }
}

#[tokio::test]
async fn exactly_once_skips_what_kafka_holds_when_the_slot_replays_it() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "eos_skip").await;
    let client = db.client().await;
    let admin = db.admin().await;
    client
        .batch_execute(
            "CREATE TABLE public.t (id bigint PRIMARY KEY, v int NOT NULL);
             INSERT INTO public.t SELECT g, 0 FROM generate_series(1, 100) g;",
        )
        .await
        .expect("table");
    let mock = mock_cluster(&db.name);
    let toml = eos_toml(&stack, &db, &mock);
    let (config, parsed) = ConfigFile::parsed(&toml);
    let slot = parsed.source.slot.clone();
    let saved = format!("{slot}_saved");

    let mut connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;

    // A: committed in Kafka and confirmed to Postgres.
    let a_last = insert_txns(&client, 101, 10, 20).await;
    wait_offset_beyond(&parsed, a_last).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while confirmed_flush(&client, &slot).await <= a_last {
        assert!(std::time::Instant::now() < deadline, "A never confirmed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A copy of the slot as it stands now: confirmed up to A.
    admin
        .execute(
            "SELECT pg_copy_logical_replication_slot($1, $2)",
            &[&slot, &saved],
        )
        .await
        .expect("copy slot");

    // D: committed in Kafka with its offset record.
    let d_first = insert_lsn(&client).await;
    let d_last = insert_txns(&client, 301, 10, 20).await;
    wait_offset_beyond(&parsed, d_last).await;
    let _ = connector.child.start_kill(); // SIGKILL
    let _ = connector.child.wait().await;

    // The state a crash between the Kafka commit and the confirmation to
    // Postgres leaves: the slot still before D, Kafka holding D.
    wait_inactive(&client, &slot).await;
    admin
        .batch_execute(&format!(
            "SELECT pg_drop_replication_slot('{slot}');
             SELECT pg_copy_logical_replication_slot('{saved}', '{slot}');
             SELECT pg_drop_replication_slot('{saved}');"
        ))
        .await
        .expect("rewind slot");
    assert!(
        confirmed_flush(&client, &slot).await <= d_first,
        "the slot must replay D for this test to mean anything"
    );

    // F while the connector is down (replayed after D, and not in Kafka),
    // E after the restart.
    insert_txns(&client, 501, 5, 10).await;
    let connector = ConnectorProcess::start(&config);
    let e_last = insert_txns(&client, 551, 5, 10).await;
    wait_offset_beyond(&parsed, e_last).await;
    assert_eq!(connector.terminate().await, 0);

    let topic = format!("{}.public.t", db.name);
    let events = changelog(&stack, &mock, &topic, 600).await;
    assert_each_once(&events, 1..=600);
    for id in 1..=600 {
        let op = &events[&id][0].0;
        assert_eq!(op, if id <= 100 { "r" } else { "c" }, "id {id}");
    }
    db.drop_db().await;
}

#[tokio::test]
async fn exactly_once_confirms_only_after_the_kafka_commit_and_a_crash_before_it_duplicates_nothing(
) {
    let stack = support::stack();
    let db = TestDb::create(&stack, "eos_crash").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE public.t (id bigint PRIMARY KEY, v int NOT NULL)")
        .await
        .expect("table");
    let mock = mock_cluster(&db.name);
    let toml = eos_toml(&stack, &db, &mock);
    let (config, parsed) = ConfigFile::parsed(&toml);
    let slot = parsed.source.slot.clone();

    let mut connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    let a_last = insert_txns(&client, 1, 5, 20).await;
    wait_offset_beyond(&parsed, a_last).await;
    // The mock shows the offset record before its commit completes; the
    // confirmation to Postgres comes only after it, so wait for that: the
    // stall below must hit B's commit, not A's.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while confirmed_flush(&client, &slot).await <= a_last {
        assert!(std::time::Instant::now() < deadline, "A never confirmed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Every commit now stalls (the coordinator answers "loading", which
    // librdkafka retries): B's first events reach the broker, their commit
    // never happens, and reading from the slot waits behind it.
    mock.request_errors(
        RDKafkaApiKey::EndTxn,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_COORDINATOR_LOAD_IN_PROGRESS; 5000],
    );
    insert_txns(&client, 101, 5, 20).await;
    let topic = format!("{}.public.t", db.name);
    let produced = changelog(&stack, &mock, &topic, 120).await;
    let b_first_commit = (101..=120)
        .map(|id| produced[&id][0].1 as u64)
        .min()
        .expect("B's first transaction");
    // Status updates go out every second: give a wrong confirmation time
    // to show.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let confirmed = confirmed_flush(&client, &slot).await;
    assert!(
        confirmed <= b_first_commit,
        "the slot was confirmed to {} past B's commit at {} before its Kafka transaction committed",
        Lsn(confirmed),
        Lsn(b_first_commit)
    );
    let _ = connector.child.start_kill(); // SIGKILL while the commit stalls
    let _ = connector.child.wait().await;
    mock.clear_request_errors(RDKafkaApiKey::EndTxn);

    let connector = ConnectorProcess::start(&config);
    let c_last = insert_txns(&client, 201, 5, 20).await;
    wait_offset_beyond(&parsed, c_last).await;
    assert_eq!(connector.terminate().await, 0);

    // On a broker with transactions the restart aborts B's open Kafka
    // transaction (its events and its offset record vanish for
    // read_committed readers) and produces B again from the slot. The mock
    // keeps B's uncommitted records visible, offset record included, so
    // here the restart skips B. Either way a read_committed reader sees
    // every change exactly once, which is what this asserts.
    let events = changelog(&stack, &mock, &topic, 300).await;
    assert_each_once(&events, 1..=300);
    db.drop_db().await;
}

/// Pins down the mock's limitation described in the module doc: if this
/// starts failing, the mock hides aborted records and the crash test above
/// can assert the re-production of an aborted transaction directly.
#[tokio::test]
async fn the_mock_cluster_does_not_hide_uncommitted_records() {
    use rdkafka::producer::{BaseRecord, Producer, ThreadedProducer};
    let mock = MockCluster::new(1).expect("mock");
    mock.create_topic("t", 1, 1).expect("topic");
    let producer: ThreadedProducer<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", mock.bootstrap_servers())
        .set("transactional.id", "probe")
        .client()
        .expect("producer");
    let timeout = Duration::from_secs(10);
    producer.init_transactions(timeout).expect("init");
    producer.begin_transaction().expect("begin");
    producer
        .send(BaseRecord::<str, str>::to("t").key("k").payload("aborted"))
        .expect("send");
    producer.flush(timeout).expect("flush");
    producer.abort_transaction(timeout).expect("abort");
    let records = support::read_topic_at(
        &mock.bootstrap_servers(),
        "t",
        Duration::from_secs(30),
        |r| !r.is_empty(),
    )
    .await;
    assert_eq!(records[0].value.as_deref(), Some(&b"aborted"[..]));
}

#[tokio::test]
async fn exactly_once_stops_cleanly_inside_a_source_transaction_and_replays_it() {
    const ROWS: i64 = 200_000;
    let stack = support::stack();
    let db = TestDb::create(&stack, "eos_term").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE public.t (id bigint PRIMARY KEY, v int NOT NULL)")
        .await
        .expect("table");
    let mock = mock_cluster(&db.name);
    let toml = eos_toml(&stack, &db, &mock);
    let (config, parsed) = ConfigFile::parsed(&toml);
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    insert_txns(&client, 1, 1, ROWS).await;
    let topic = format!("{}.public.t", db.name);
    // Part of the transaction is in the open Kafka transaction: stop now.
    let partial = changelog(&stack, &mock, &topic, 1_000).await;
    assert_eq!(connector.terminate().await, 0, "SIGTERM exits 0");
    let commit = partial.values().next().expect("an event")[0].1 as u64;
    // (Heartbeats written while the insert ran may be confirmed: they lie
    // before the transaction's commit, which the slot still replays.)
    let confirmed = confirmed_flush(&client, &parsed.source.slot).await;
    assert!(
        confirmed <= commit,
        "confirmed {} past the commit at {} of a transaction not committed in Kafka",
        Lsn(confirmed),
        Lsn(commit)
    );
    // The restart replays the whole transaction and commits it in Kafka.
    let connector = ConnectorProcess::start(&config);
    wait_offset_beyond(&parsed, commit - 1).await;
    assert_eq!(connector.terminate().await, 0);
    // (Reading 200,000 records back from the mock is slow; the partitions'
    // end offsets tell that the replay produced every row again.)
    let produced: i64 = {
        use rdkafka::consumer::{BaseConsumer, Consumer};
        let consumer: BaseConsumer<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", mock.bootstrap_servers())
            .client()
            .expect("consumer");
        (0..3)
            .map(|p| {
                consumer
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .expect("watermarks")
                    .1
            })
            .sum()
    };
    assert!(
        produced >= ROWS + 1_000,
        "{produced} records: the partial copy and a whole replay"
    );
    db.drop_db().await;
}
