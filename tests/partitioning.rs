//! Hot keys and salting end to end: one order takes half of the changes,
//! the connector detects it and salts it over 8 shards of an 8-partition
//! topic, a declared customer is salted from its first change, and the
//! read models converge, both from the topics as they are and from every
//! record delivered again in shuffled order.

use pgcdc::sink::CreateClient as _;
use std::collections::BTreeSet;
use std::time::Duration;

use apache_avro::types::Value;
use serde_json::Value as Json;

use crate::materialize::{self, Rng};
use crate::support::{self, ConfigFile, ConnectorProcess, Decoder, Record, Stack, TestDb};

const HOT_ORDER: i64 = 1_000_000;
const DECLARED_CUSTOMER: i64 = 7;

/// Half the changes are updates of the hot order; the rest spread over
/// the other orders and the customers, with inserts and deletes. The
/// declared customer is renamed now and then. The hot order is deleted
/// and inserted again at the end, so its tombstones and its new life
/// cross the shards too. Runs at least `changes`, and on until `stop`.
async fn hot_workload(
    client: &tokio_postgres::Client,
    changes: usize,
    seed: u64,
    stop: &std::sync::atomic::AtomicBool,
) {
    let mut rng = Rng(seed);
    let (mut next_order, mut next_customer) = materialize::next_ids(client).await.expect("ids");
    let mut done = 0;
    while done < changes || !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let mut sql = String::from("BEGIN;");
        for _ in 0..20 {
            if rng.below(2) == 0 {
                // An upsert: the random statements may delete it.
                sql.push_str(&format!(
                    "INSERT INTO public.orders (id, customer_id, amount, status) VALUES ({HOT_ORDER}, 1, 1.00, 'hot')
                     ON CONFLICT (id) DO UPDATE SET amount = orders.amount + 1, status = 'hot {done}';"
                ));
            } else if rng.below(10) == 0 {
                sql.push_str(&format!(
                    "UPDATE public.customers SET name = 'declared {done}' WHERE id = {DECLARED_CUSTOMER};"
                ));
            } else {
                sql.push_str(&materialize::statement(
                    &mut rng,
                    &mut next_order,
                    &mut next_customer,
                ));
            }
            done += 1;
        }
        sql.push_str("COMMIT;");
        client.batch_execute(&sql).await.expect("workload");
    }
    client
        .batch_execute(&format!(
            "DELETE FROM public.orders WHERE id = {HOT_ORDER};
             INSERT INTO public.orders (id, customer_id, amount, status) VALUES ({HOT_ORDER}, 1, 1.00, 'reborn');
             UPDATE public.orders SET amount = 2.00 WHERE id = {HOT_ORDER};"
        ))
        .await
        .expect("rebirth");
}

fn config_toml(stack: &Stack, source: &TestDb, target: &TestDb) -> String {
    let base = materialize::pipeline(stack, source, target)
        .replace("[kafka]\n", "[kafka]\npartitions = 8\n");
    format!(
        r#"{base}
[hot_keys]
window_secs = 2
report_per_sec = 20

[partitioning."public.orders"]
salt_shards = 8
salt_above_per_sec = 40

[partitioning."public.customers"]
salt_shards = 4
salt_keys = ["{DECLARED_CUSTOMER}"]
"#
    )
}

/// Every record of a topic.
async fn all_records(stack: &Stack, topic: &str) -> Vec<Record> {
    let n = materialize::end_offsets(stack, topic).await as usize;
    support::read_topic(stack, topic, n, Duration::from_secs(120)).await
}

fn long(v: &Value) -> i64 {
    match v {
        Value::Long(n) => *n,
        Value::Int(n) => i64::from(*n),
        Value::Union(_, inner) => long(inner),
        other => panic!("not a long: {other:?}"),
    }
}

/// `(id, position)` of a changelog record; no position for a tombstone.
async fn id_and_position(decoder: &mut Decoder, r: &Record) -> (i64, Option<(i64, i64)>) {
    let key = decoder.decode(r.key.as_ref().expect("keyed")).await;
    let id = long(support::field(&key, "id"));
    let position = match &r.value {
        Some(v) => {
            let v = decoder.decode(v).await;
            let src = support::field(&v, "source");
            Some((
                long(support::field(src, "commit_lsn")),
                long(support::field(src, "seq")),
            ))
        }
        None => None,
    };
    (id, position)
}

#[tokio::test]
async fn a_hot_key_salted_over_8_shards_spreads_and_the_read_models_still_converge() {
    let stack = support::stack();
    let (source_db, target_db, source, target) =
        materialize::databases(&stack, "salt", 200, 2000).await;
    let config = ConfigFile::write(&config_toml(&stack, &source_db, &target_db));
    let addr = format!("127.0.0.1:{}", support::free_port());
    let connector = ConnectorProcess::start_with(&config, &["--http-addr", &addr]);
    let consumer = materialize::materializer(&config, &[], &[]);
    support::wait_streaming(&source, &source_db.name).await;

    // While the hot order burns, `pgcdc status` names it, salted.
    let url = source_db.url.clone();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_load = stop.clone();
    let load = tokio::spawn(async move {
        let client = support::connect(&url).await;
        hot_workload(&client, 40_000, 0x5eed_0001, &stop_load).await;
    });
    let mut seen = String::new();
    support::wait_for(
        "pgcdc status to show the hot order salted",
        Duration::from_secs(120),
        async || {
            let run = support::pgcdc(&["status", "--http-addr", &addr]).await;
            seen = run.all_output();
            let line = seen
                .lines()
                .find(|l| l.starts_with("public.orders") && l.contains(&format!(" {HOT_ORDER} ")));
            line.is_some_and(|l| l.ends_with("yes"))
        },
    )
    .await;
    let json = support::pgcdc(&["status", "--http-addr", &addr, "--json"]).await;
    let status: Json = serde_json::from_str(&json.stdout).expect("status json");
    let orders = status["tables"]
        .as_array()
        .expect("tables")
        .iter()
        .find(|t| t["table"] == "public.orders")
        .expect("orders");
    let hot = &orders["hot_keys"][0];
    assert_eq!(hot["key"], HOT_ORDER.to_string(), "{seen}");
    assert!(
        hot["share"].as_f64().expect("share") > 0.4,
        "about half of the changes: {hot}"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.expect("workload");
    materialize::wait_converged(&source, &target).await;

    // The hot order's events spread over the topic's partitions; every
    // other key stays in its own partition (Java's murmur2 partitioner).
    let mut decoder = Decoder::new(&stack);
    let orders_topic = format!("{}.public.orders", source_db.name);
    let records = all_records(&stack, &orders_topic).await;
    let mut hot_partitions = BTreeSet::new();
    let mut salted = 0;
    for r in &records {
        let key = r.key.as_deref().expect("keyed");
        let own = pgcdc::sink::partition_for(key, 8);
        let (id, _) = id_and_position(&mut decoder, r).await;
        let shards = pgcdc::partitioning::shard_partitions(key, 8, 8);
        if r.value.is_none() {
            assert!(
                shards.contains(&r.partition),
                "a tombstone outside its key's shards"
            );
            continue;
        }
        match r.header(pgcdc::partitioning::SHARD_HEADER) {
            Some(shard) => {
                assert_eq!(id, HOT_ORDER, "only the hot order is salted");
                let shard: usize = shard.parse().expect("shard number");
                assert_eq!(
                    r.partition, shards[shard],
                    "shard s goes to (own + s) mod n"
                );
                salted += 1;
            }
            None => assert_eq!(r.partition, own, "order {id} left its partition unsalted"),
        }
        if id == HOT_ORDER {
            hot_partitions.insert(r.partition);
        }
    }
    assert!(
        hot_partitions.len() >= 4,
        "the hot order reached only partitions {hot_partitions:?}"
    );
    assert!(salted > 10_000, "{salted} salted events");
    // The delete's tombstones reached every shard of the hot order.
    let hot_key = records
        .iter()
        .find(|r| r.header(pgcdc::partitioning::SHARD_HEADER).is_some())
        .and_then(|r| r.key.clone())
        .expect("a salted record");
    let tombstones: BTreeSet<i32> = records
        .iter()
        .filter(|r| r.value.is_none() && r.key.as_ref() == Some(&hot_key))
        .map(|r| r.partition)
        .collect();
    assert_eq!(tombstones.len(), 8, "tombstones in {tombstones:?}");

    // The declared customer is salted from its first change, over 4.
    let customers_topic = format!("{}.public.customers", source_db.name);
    let customers = all_records(&stack, &customers_topic).await;
    let mut declared = BTreeSet::new();
    for r in customers.iter().filter(|r| r.value.is_some()) {
        let (id, _) = id_and_position(&mut decoder, r).await;
        let is_salted = r.header(pgcdc::partitioning::SHARD_HEADER).is_some();
        if id == DECLARED_CUSTOMER && is_salted {
            declared.insert(r.partition);
        } else {
            assert!(!is_salted, "customer {id} salted");
        }
    }
    assert_eq!(declared.len(), 4, "declared customer in {declared:?}");

    // The same records delivered again in shuffled order, into a fresh
    // target: the position guard keeps the newest change of every key.
    let shuffled = format!("{}_shuf", source_db.name);
    let mut rng = Rng(0xdead_beef);
    let mut inversions = 0;
    for (topic, mut all) in [
        (orders_topic.as_str(), records.clone()),
        (customers_topic.as_str(), customers.clone()),
    ] {
        for i in (1..all.len()).rev() {
            all.swap(i, rng.below(i as u64 + 1) as usize);
        }
        if topic == orders_topic {
            let mut last: Option<(i64, i64)> = None;
            for r in &all {
                if let (HOT_ORDER, Some(p)) = id_and_position(&mut decoder, r).await {
                    inversions += usize::from(last.is_some_and(|l| l > p));
                    last = Some(p);
                }
            }
        }
        let copy = topic.replacen(&source_db.name, &shuffled, 1);
        support::create_topic(&stack, &copy, &[]).await;
        copy_subjects(&stack, topic, &copy).await;
        produce_in_order(&stack, &copy, &all).await;
    }
    assert!(
        inversions > 1000,
        "the shuffle put only {inversions} older hot-order changes after newer ones"
    );
    let again = TestDb::create(&stack, "salt_again").await;
    let replay_toml = materialize::pipeline(&stack, &source_db, &again)
        .replace(
            &format!("topic_prefix = \"{}\"", source_db.name),
            &format!("topic_prefix = \"{shuffled}\""),
        )
        .replace(
            &format!("name = \"{}\"", source_db.name),
            &format!("name = \"{shuffled}\""),
        );
    let replay_config = ConfigFile::write(&replay_toml);
    let replayer = materialize::materializer(&replay_config, &[], &[]);
    let again_client = again.client().await;
    materialize::wait_converged(&source, &again_client).await;

    // A partition count that differs from the topic's is flagged.
    let wrong = ConfigFile::write(
        &config_toml(&stack, &source_db, &target_db)
            .replace("partitions = 8\n", "partitions = 3\n"),
    );
    let check = support::pgcdc(&["check", "--config", wrong.arg()]).await;
    let line = check
        .check_line(&format!("kafka.partitions.{orders_topic}"))
        .unwrap_or_else(|| panic!("{}", check.all_output()));
    assert!(line.starts_with("WARN"), "{line}");
    assert!(line.contains("remaps keys"), "{line}");

    assert_eq!(materialize::terminate(replayer).await, Some(0));
    assert_eq!(materialize::terminate(consumer).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
    again.drop_db().await;
}

/// Registers the latest schemas of `from`'s subjects under `to`'s.
async fn copy_subjects(stack: &Stack, from: &str, to: &str) {
    for part in ["key", "value"] {
        let schema = support::latest_schema(stack, &format!("{from}-{part}")).await;
        support::register_schema(stack, &format!("{to}-{part}"), &schema).await;
    }
}

/// Produces `records` to partition 0 of `topic` in the order given.
async fn produce_in_order(stack: &Stack, topic: &str, records: &[Record]) {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &stack.brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .client()
        .expect("producer");
    let mut pending = Vec::new();
    for r in records {
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(topic).partition(0);
        if let Some(k) = &r.key {
            record = record.key(k.as_slice());
        }
        if let Some(v) = &r.value {
            record = record.payload(v.as_slice());
        }
        pending.push(producer.send_result(record).expect("queue"));
        if pending.len() >= 10_000 {
            for p in pending.drain(..) {
                p.await.expect("delivery").expect("acknowledged");
            }
        }
    }
    for p in pending {
        p.await.expect("delivery").expect("acknowledged");
    }
}

/// A key (of tenant `t9`) declared in `dedicated_keys` in the routed run.
const DEDICATED_KEY: i64 = 0;
/// The noisy tenant; the nine others are `t1` to `t9`.
const NOISY: &str = "t0";
/// The noisy tenant's rows already in Kafka when the materializer starts.
const BACKLOG: i64 = 120_000;
/// Others' rows per tenant per tick, and the noisy tenant's (20 times).
const TICK: Duration = Duration::from_millis(100);
const TICKS: i64 = 60;
/// The bound the others' p99 time to visible stays within under quotas
/// (in the README): far below what the backlog alone costs without them.
const FAIR_P99: Duration = Duration::from_millis(2500);

/// How one fairness run is set up.
struct Fairness {
    label: &'static str,
    quota: bool,
    /// The noisy tenant routed to the dedicated topic, with a buffer
    /// small enough to fill, so that its partitions pause.
    dedicated: bool,
}

/// What one run measured.
struct FairRun {
    /// The others' times from commit to visible in the mirror, sorted.
    others: Vec<Duration>,
    paused_seen: bool,
}

fn p99(sorted: &[Duration]) -> Duration {
    sorted[(sorted.len() * 99 / 100).min(sorted.len() - 1)]
}

/// One tenant floods (a backlog of [`BACKLOG`] rows in Kafka, then 20
/// times each other tenant's rate) while nine others trickle; returns
/// the others' times to visible.
async fn fairness_run(stack: &Stack, run: &Fairness) -> FairRun {
    let source_db = TestDb::create(stack, &format!("fair_{}_src", run.label)).await;
    let target_db = TestDb::create(stack, &format!("fair_{}_tgt", run.label)).await;
    let source = source_db.client().await;
    let target = target_db.client().await;
    source
        .batch_execute(
            "CREATE TABLE public.events (id bigint PRIMARY KEY, tenant text NOT NULL, n int NOT NULL, note text);
             ALTER TABLE public.events REPLICA IDENTITY FULL;
             INSERT INTO public.events VALUES (0, 't9', 0, 'a declared key');",
        )
        .await
        .expect("schema");
    let mut toml = format!(
        "{}\n[target]\nurl = \"{}\"\nbatch_size = 500\n",
        support::pipeline_toml(stack, &source_db.url, &source_db.name, &["public.events"])
            .replace("[kafka]\n", "[kafka]\npartitions = 4\n"),
        target_db.url
    );
    if run.quota {
        let max = if run.dedicated { 2_000 } else { 200_000 };
        toml.push_str(&format!(
            "[target.tenant_quota]\nrate_per_sec = 200\nmax_deferred = {max}\n"
        ));
    }
    toml.push_str("[partitioning.\"public.events\"]\ntenant_column = \"tenant\"\n");
    if run.dedicated {
        toml.push_str(&format!(
            "dedicated_tenants = [\"{NOISY}\"]\ndedicated_keys = [\"{DEDICATED_KEY}\"]\n"
        ));
    }
    let config = ConfigFile::write(&toml);
    let connector = ConnectorProcess::start(&config);
    support::wait_streaming(&source, &source_db.name).await;

    // The flood's backlog, in Kafka before the materializer starts.
    for chunk in 0..BACKLOG / 4_000 {
        source
            .batch_execute(&format!(
                "INSERT INTO public.events SELECT g, '{NOISY}', 0, repeat('x', 100)
                 FROM generate_series({} + 1, {}) g",
                chunk * 4_000,
                (chunk + 1) * 4_000
            ))
            .await
            .expect("backlog");
    }
    let topics: Vec<String> = {
        let own = format!("{}.public.events", source_db.name);
        match run.dedicated {
            true => vec![own.clone(), format!("{own}.dedicated")],
            false => vec![own],
        }
    };
    support::wait_for(
        "the backlog to reach Kafka",
        Duration::from_secs(300),
        async || {
            let mut n = 0;
            for t in &topics {
                n += materialize::end_offsets(stack, t).await;
            }
            n >= BACKLOG
        },
    )
    .await;
    let addr = format!("127.0.0.1:{}", support::free_port());
    let consumer = materialize::materializer(&config, &["--http-addr", &addr], &[]);
    support::wait_for(
        "the materializer to apply the first rows",
        Duration::from_secs(300),
        async || {
            target
                .query_one(
                    "SELECT to_regclass('mirror.events') IS NOT NULL
                        AND EXISTS (SELECT 1 FROM mirror.events)",
                    &[],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
        },
    )
    .await;

    // The live phase: per tick, one row of each other tenant and twenty
    // of the noisy one, each tick one transaction.
    let url = source_db.url.clone();
    let mut writer = tokio::spawn(async move {
        let client = support::connect(&url).await;
        let mut committed = std::collections::HashMap::new();
        let mut next = BACKLOG + 1;
        let mut ticker = tokio::time::interval(TICK);
        for _ in 0..TICKS {
            ticker.tick().await;
            let mut sql = String::from("BEGIN;");
            let mut ours = Vec::new();
            for t in 1..=9 {
                sql.push_str(&format!(
                    "INSERT INTO public.events VALUES ({next}, 't{t}', 1, 'other');"
                ));
                ours.push(next);
                next += 1;
            }
            sql.push_str(&format!(
                "INSERT INTO public.events SELECT g, '{NOISY}', 1, repeat('x', 100) FROM generate_series({next}, {}) g;",
                next + 179
            ));
            next += 180;
            sql.push_str(&format!(
                "UPDATE public.events SET n = n + 1 WHERE id = {DEDICATED_KEY};COMMIT;"
            ));
            client.batch_execute(&sql).await.expect("live");
            let at = std::time::Instant::now();
            for id in ours {
                committed.insert(id, at);
            }
        }
        committed
    });
    // Polls the mirror for the others' rows as they appear.
    let mut visible: std::collections::HashMap<i64, std::time::Instant> = Default::default();
    let mut paused_seen = false;
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let mut written = None;
    let committed = loop {
        let rows = target
            .query(
                "SELECT id FROM mirror.events WHERE tenant <> $1 AND id > $2",
                &[&NOISY, &BACKLOG],
            )
            .await
            .expect("poll");
        let now = std::time::Instant::now();
        for r in rows {
            visible.entry(r.get::<_, i64>(0)).or_insert(now);
        }
        if !paused_seen && run.dedicated {
            paused_seen =
                materialize::counter(&addr, "pgcdc_materialize_paused_partitions").await > 0.0;
        }
        if written.is_none() && writer.is_finished() {
            written = Some((&mut writer).await.expect("writer"));
        }
        if written.is_some() && visible.len() as i64 >= 9 * TICKS {
            break written.take().expect("written");
        }
        assert!(
            now < deadline,
            "only {} of the others' rows visible",
            visible.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut others: Vec<Duration> = committed
        .iter()
        .map(|(id, at)| visible[id].saturating_duration_since(*at))
        .collect();
    others.sort();

    // Nothing lost: the mirror converges to the source, the flood too.
    support::wait_for(
        "the mirror to hold every row",
        Duration::from_secs(600),
        async || {
            let count = "SELECT count(*), coalesce(sum(n), 0)::bigint FROM ";
            let s = source
                .query_one(&format!("{count} public.events"), &[])
                .await
                .expect("source");
            let t = target
                .query_one(&format!("{count} mirror.events"), &[])
                .await
                .expect("target");
            (s.get::<_, i64>(0), s.get::<_, i64>(1)) == (t.get::<_, i64>(0), t.get::<_, i64>(1))
        },
    )
    .await;
    if run.dedicated {
        // Every event of the noisy tenant and of the declared key (its
        // snapshot row included), and only those, went to the dedicated
        // topic; the others' stayed in the table's own.
        let mut decoder = Decoder::new(stack);
        let mut declared = 0;
        for (i, topic) in topics.iter().enumerate() {
            let n = materialize::end_offsets(stack, topic).await as usize;
            let records = support::read_topic(stack, topic, n, Duration::from_secs(120)).await;
            assert!(!records.is_empty(), "{topic} is empty");
            for r in records.iter().filter(|r| r.value.is_some()) {
                let tenant = r.header(pgcdc::partitioning::TENANT_HEADER);
                assert!(tenant.is_some(), "an event without its tenant in {topic}");
                let (id, _) = id_and_position(&mut decoder, r).await;
                declared += usize::from(id == DEDICATED_KEY);
                assert_eq!(
                    tenant == Some(NOISY) || id == DEDICATED_KEY,
                    i == 1,
                    "row {id} of {tenant:?} in {topic}"
                );
            }
        }
        assert_eq!(declared as i64, 1 + TICKS, "the declared key's events");
    }
    // Lag is exported per tenant, quotas or not.
    let lagging: BTreeSet<String> = materialize::samples(&addr, "pgcdc_tenant_lag_seconds")
        .await
        .into_iter()
        .map(|(labels, _)| labels)
        .collect();
    let expected: BTreeSet<String> = (0..=9).map(|t| format!("{{tenant=\"t{t}\"}}")).collect();
    assert_eq!(lagging, expected);
    let waited = materialize::counter(&addr, "pgcdc_tenant_deferred_total").await;
    assert_eq!(waited > 0.0, run.quota, "records that waited: {waited}");
    assert_eq!(materialize::terminate(consumer).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
    FairRun {
        others,
        paused_seen,
    }
}

#[tokio::test]
async fn with_quotas_a_tenant_flooding_at_20x_does_not_hold_back_nine_others() {
    let stack = support::stack();
    let without = fairness_run(
        &stack,
        &Fairness {
            label: "none",
            quota: false,
            dedicated: false,
        },
    )
    .await;
    let with = fairness_run(
        &stack,
        &Fairness {
            label: "quota",
            quota: true,
            dedicated: false,
        },
    )
    .await;
    let routed = fairness_run(
        &stack,
        &Fairness {
            label: "routed",
            quota: true,
            dedicated: true,
        },
    )
    .await;
    let (none, quota, dedicated) = (p99(&without.others), p99(&with.others), p99(&routed.others));
    for (name, run) in [
        ("no quota", &without),
        ("quota", &with),
        ("quota, noisy tenant on a dedicated topic", &routed),
    ] {
        let o = &run.others;
        eprintln!(
            "others' time to visible, {name}: p50 {:?}, p99 {:?}, max {:?} ({} rows)",
            o[o.len() / 2],
            p99(o),
            o[o.len() - 1],
            o.len()
        );
    }
    assert!(
        quota < FAIR_P99,
        "with quotas the others' p99 was {quota:?}"
    );
    assert!(
        dedicated < FAIR_P99,
        "routed, the others' p99 was {dedicated:?}"
    );
    assert!(
        routed.paused_seen,
        "the dedicated topic's partitions never paused"
    );
    // Without quotas the others wait behind the flood's backlog.
    assert!(
        none > FAIR_P99 && none > quota * 3,
        "without quotas the others' p99 was {none:?} (with them {quota:?})"
    );
}

#[tokio::test]
async fn a_tenant_column_a_delete_would_not_carry_stops_the_connector_before_it_produces() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "tenant_identity").await;
    db.client()
        .await
        .batch_execute(
            "CREATE TABLE public.events (id bigint PRIMARY KEY, tenant text NOT NULL);
             INSERT INTO public.events VALUES (1, 'a');",
        )
        .await
        .expect("schema");
    let toml = format!(
        "{}\n[partitioning.\"public.events\"]\ntenant_column = \"tenant\"\n",
        support::pipeline_toml(&stack, &db.url, &db.name, &["public.events"])
    );
    let file = ConfigFile::write(&toml);
    let run = tokio::time::timeout(
        Duration::from_secs(120),
        support::pgcdc(&["run", "--config", file.arg()]),
    )
    .await
    .expect("pgcdc run kept going");
    assert_ne!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stderr.contains(
            "partitioning.\"public.events\".tenant_column: tenant is not in the replica identity of public.events"
        ) && run.stderr.contains("REPLICA IDENTITY FULL"),
        "{}",
        run.all_output()
    );
    // Nothing was produced: the check comes before the snapshot.
    let topic = format!("{}.public.events", db.name);
    assert_eq!(materialize::end_offsets(&stack, &topic).await, 0);
    // `pgcdc check` says so too, and passes once deletes carry it.
    let check_line = async |expected: &str| {
        let check = support::pgcdc(&["check", "--config", file.arg()]).await;
        let line = check
            .check_line("partitioning.public.events.tenant_column")
            .unwrap_or_else(|| panic!("{}", check.all_output()));
        assert!(line.starts_with(expected), "{line}");
    };
    check_line("FAIL").await;
    // A replica identity index without the tenant is no better.
    db.client()
        .await
        .batch_execute(
            "CREATE UNIQUE INDEX events_id ON public.events (id);
             ALTER TABLE public.events REPLICA IDENTITY USING INDEX events_id;",
        )
        .await
        .expect("identity index");
    let run = support::pgcdc(&["run", "--config", file.arg()]).await;
    assert!(
        run.code != 0 && run.stderr.contains("tenant is not in the replica identity"),
        "{}",
        run.all_output()
    );
    db.client()
        .await
        .batch_execute("ALTER TABLE public.events REPLICA IDENTITY FULL")
        .await
        .expect("full");
    check_line("PASS").await;
    let missing =
        ConfigFile::write(&toml.replace("tenant_column = \"tenant\"", "tenant_column = \"nope\""));
    let run = support::pgcdc(&["run", "--config", missing.arg()]).await;
    assert!(
        run.stderr.contains(
            "partitioning.\"public.events\".tenant_column: public.events has no column nope"
        ),
        "{}",
        run.all_output()
    );
    // A rebuild does not read dedicated topics yet: it refuses, rather
    // than rebuild without the keys routed there.
    let routed = ConfigFile::write(&format!(
        "{}\n[target]\nurl = \"{}\"\n[read_models.ev]\ntable = \"read_models.ev\"\nkey = [\"id\"]\nquery = \"SELECT id FROM mirror.events WHERE id = ANY($1)\"\nsources = [{{ table = \"public.events\", key_columns = [\"id\"] }}]\n[partitioning.\"public.events\"]\ndedicated_keys = [\"1\"]\n",
        support::pipeline_toml(&stack, &db.url, &db.name, &["public.events"]),
        db.url
    ));
    let rebuild =
        support::pgcdc(&["rebuild", "--config", routed.arg(), "--read-model", "ev"]).await;
    assert_eq!(rebuild.code, 2, "{}", rebuild.all_output());
    assert!(
        rebuild.stderr.contains(&format!(
            "public.events routes keys or tenants to the dedicated topic {}.public.events.dedicated",
            db.name
        )),
        "{}",
        rebuild.all_output()
    );
    db.drop_db().await;
}
