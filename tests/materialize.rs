//! `pgcdc materialize` end to end on the demo schema: the connector streams
//! a random mixed workload, the materializer builds the mirrors and both
//! read models, and everything is compared with the source by checksum.

use pgcdc::sink::CreateClient as _;
use std::time::Duration;

use crate::support::{self, ConfigFile, ConnectorProcess, Stack, TestDb};

pub(crate) const READ_MODELS: &str = r#"
[read_models.order_summary]
table = "read_models.order_summary"
key = ["order_id"]
query = """
SELECT o.id AS order_id, o.customer_id, c.name AS customer_name, c.tier AS customer_tier,
       o.amount, o.status
FROM mirror.orders o LEFT JOIN mirror.customers c ON c.id = o.customer_id
WHERE o.id = ANY($1)
"""
sources = [
  { table = "public.orders", key_columns = ["id"] },
  { table = "public.customers", affected_keys = "SELECT id FROM mirror.orders WHERE customer_id = $1" },
]

[read_models.customer_stats]
table = "read_models.customer_stats"
key = ["customer_id"]
query = """
SELECT c.id AS customer_id, count(o.id) AS order_count, coalesce(sum(o.amount), 0) AS total_amount
FROM mirror.customers c LEFT JOIN mirror.orders o ON o.customer_id = c.id
WHERE c.id = ANY($1)
GROUP BY c.id
"""
sources = [
  { table = "public.customers", key_columns = ["id"] },
  { table = "public.orders", key_columns = ["customer_id"] },
]
"#;

/// Checksums of the same rows on both sides: `(what, source SQL, target SQL)`.
const CHECKS: &[(&str, &str, &str)] = &[
    (
        "customers",
        "SELECT id, name, tier, tenant_id FROM public.customers",
        "SELECT id, name, tier, tenant_id FROM mirror.customers",
    ),
    (
        "orders",
        "SELECT id, customer_id, amount, status, created_at, note FROM public.orders",
        "SELECT id, customer_id, amount, status, created_at, note FROM mirror.orders",
    ),
    (
        "order_summary",
        "SELECT o.id AS order_id, o.customer_id, c.name, c.tier, o.amount, o.status
         FROM public.orders o LEFT JOIN public.customers c ON c.id = o.customer_id",
        "SELECT order_id, customer_id, customer_name, customer_tier, amount, status
         FROM read_models.order_summary",
    ),
    (
        "customer_stats",
        "SELECT c.id, count(o.id), coalesce(sum(o.amount), 0)
         FROM public.customers c LEFT JOIN public.orders o ON o.customer_id = c.id GROUP BY c.id",
        "SELECT customer_id, order_count, total_amount FROM read_models.customer_stats",
    ),
];

pub(crate) async fn checksum(client: &tokio_postgres::Client, sql: &str) -> (i64, String) {
    let row = client
        .query_one(
            &format!(
                "SELECT count(*), coalesce(md5(string_agg(t::text, '|' ORDER BY t::text)), '')
                 FROM ({sql}) t"
            ),
            &[],
        )
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    (row.get(0), row.get(1))
}

/// Differences between source and target; empty when converged.
pub(crate) async fn differences(
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
) -> Vec<String> {
    differences_in(CHECKS, source, target).await
}

/// [`differences`] under other checks.
async fn differences_in(
    checks: &[(&str, &str, &str)],
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
) -> Vec<String> {
    let mut out = Vec::new();
    for (what, s, t) in checks {
        let (a, b) = (checksum(source, s).await, checksum(target, t).await);
        if a != b {
            out.push(format!("{what}: source {a:?}, target {b:?}"));
        }
    }
    out
}

pub(crate) async fn wait_converged(
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
) {
    let views = ["read_models.customer_stats", "read_models.order_summary"];
    wait_matching(source, target, CHECKS, &views).await
}

/// Waits until `checks` find no difference, once every table of `views`
/// exists (the materializer creates read models one after the other).
async fn wait_matching(
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
    checks: &[(&str, &str, &str)],
    views: &[&str],
) {
    // Generous: in debug builds, beside the other tests, on two cores.
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    loop {
        let ready = target
            .query_one(
                "SELECT bool_and(to_regclass(v) IS NOT NULL) FROM unnest($1::text[]) v",
                &[&views],
            )
            .await
            .expect("target")
            .get::<_, bool>(0);
        if ready {
            let diff = differences_in(checks, source, target).await;
            if diff.is_empty() {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "not converged: {diff:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A small deterministic generator, so a failure can be replayed.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The next unused order and customer ids, above every existing one, so
/// workloads can follow each other.
pub(crate) async fn next_ids(
    client: &tokio_postgres::Client,
) -> Result<(i64, i64), tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT greatest(2000000, (SELECT coalesce(max(id), 0) + 1 FROM public.orders)),
                    greatest(1000, (SELECT coalesce(max(id), 0) + 1 FROM public.customers))",
            &[],
        )
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// One random row change of the demo schema: an order insert, update or
/// delete, an order moving between customers, a customer renamed or
/// changing tier, or a new customer. Customers are never deleted, and
/// statements that could break a foreign key are guarded.
pub(crate) fn statement(rng: &mut Rng, next_order: &mut i64, next_customer: &mut i64) -> String {
    let customer = 1 + rng.below(*next_customer as u64 - 1) as i64;
    let order = 1_000_000 + rng.below((*next_order - 1_000_000) as u64) as i64;
    match rng.below(10) {
        0..=3 => {
            let sql = format!(
                "INSERT INTO public.orders (id, customer_id, amount, status, note)
                 SELECT {next_order}, {customer}, {}.{:02}, 'new', {} WHERE EXISTS (SELECT 1 FROM public.customers WHERE id = {customer});",
                rng.below(1000),
                rng.below(100),
                if rng.below(3) == 0 { "NULL".to_string() } else { format!("'note {}'", rng.below(100)) }
            );
            *next_order += 1;
            sql
        }
        4 | 5 => format!(
            "UPDATE public.orders SET amount = amount + {}, status = 'paid' WHERE id = {order};",
            rng.below(50)
        ),
        6 => format!("DELETE FROM public.orders WHERE id = {order};"),
        7 => format!(
            "UPDATE public.orders SET customer_id = {customer} WHERE id = {order}
             AND EXISTS (SELECT 1 FROM public.customers WHERE id = {customer});"
        ),
        8 => format!(
            "UPDATE public.customers SET name = 'renamed {}', tier = {} WHERE id = {customer};",
            rng.below(1000),
            if rng.below(2) == 0 { "'gold'" } else { "NULL" }
        ),
        _ => {
            let sql = format!(
                "INSERT INTO public.customers (id, name, tier, tenant_id) VALUES ({next_customer}, 'customer {next_customer}', 'silver', {});",
                rng.below(5)
            );
            *next_customer += 1;
            sql
        }
    }
}

/// About `changes` row changes ([`statement`]) in transactions of up to 50
/// statements, and one truncate of the orders halfway.
pub(crate) async fn workload(client: &tokio_postgres::Client, changes: usize, seed: u64) {
    let mut rng = Rng(seed);
    let (mut next_order, mut next_customer) = next_ids(client).await.expect("next ids");
    let mut done = 0;
    let mut truncated = false;
    while done < changes {
        let mut sql = String::from("BEGIN;");
        for _ in 0..(1 + rng.below(50)) {
            sql.push_str(&statement(&mut rng, &mut next_order, &mut next_customer));
            done += 1;
        }
        if !truncated && done >= changes / 2 {
            sql.push_str("TRUNCATE public.orders;");
            truncated = true;
        }
        sql.push_str("COMMIT;");
        client.batch_execute(&sql).await.expect("workload");
    }
}

pub(crate) fn pipeline(stack: &Stack, source: &TestDb, target: &TestDb) -> String {
    format!(
        "{}\n[target]\nurl = \"{}\"\nbatch_size = 200\n{READ_MODELS}",
        support::pipeline_toml(
            stack,
            &source.url,
            &source.name,
            &["public.customers", "public.orders"]
        ),
        target.url
    )
}

/// A `pgcdc materialize` process, killed when dropped.
pub(crate) fn materializer(
    config: &ConfigFile,
    extra: &[&str],
    env: &[(&str, &str)],
) -> tokio::process::Child {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
        .args(["materialize", "--config", config.arg()])
        .args(extra)
        .envs(env.iter().copied())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn pgcdc materialize")
}

pub(crate) async fn terminate(mut child: tokio::process::Child) -> Option<i32> {
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("materializer did not stop within 30 s")
        .expect("wait")
        .code()
}

/// A metric summed over its labels (0 while the endpoint is not up).
pub(crate) async fn counter(addr: &str, name: &str) -> f64 {
    samples(addr, name).await.iter().map(|(_, v)| v).sum()
}

#[tokio::test]
async fn mirrors_and_read_models_converge_and_a_replay_applies_nothing_twice() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat", 999, 2000).await;
    let config = ConfigFile::write(&pipeline(&stack, &source_db, &target_db));
    let connector = ConnectorProcess::start(&config);
    let first = materializer(&config, &[], &[("PGCDC__TARGET__GROUP_ID", "converge")]);
    workload(&source, 50_000, 0x9e37_79b9_7f4a_7c15).await;
    wait_converged(&source, &target).await;
    assert_eq!(terminate(first).await, Some(0));
    // A clean stop leaves the group's offsets at the end of every topic
    // (asynchronous commits, then a last synchronous one): a restart
    // redelivers nothing.
    for table in ["customers", "orders"] {
        let topic = format!("{}.public.{table}", source_db.name);
        assert_eq!(
            committed_offsets(&stack.brokers, "converge", &topic).await,
            end_offsets(&stack, &topic).await,
            "the group's committed offsets of {topic} after a clean stop"
        );
    }

    // Replay every topic from the beginning in a new consumer group: every
    // change is a duplicate, nothing is applied, nothing changes.
    let events = change_events(&stack, &source_db).await;
    let (applied, duplicates, _) = replay(&config, "replay", events).await;
    assert_eq!(applied, 0.0, "a replayed change was applied again");
    assert_eq!(duplicates, events as f64);
    assert!(differences(&source, &target).await.is_empty());
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// The target down when the materializer starts (a deploy that starts
/// both at once): it waits for the target, warning, and applies once it
/// answers, instead of exiting.
#[tokio::test]
async fn a_target_down_at_start_up_is_waited_for() {
    let stack = support::stack();
    let (source_db, target_db, source, _) = databases(&stack, "mat_late", 50, 200).await;
    let cluster = support::ScratchCluster::start(&[]);
    support::connect(&cluster.socket_url("postgres"))
        .await
        .batch_execute("CREATE DATABASE late")
        .await
        .expect("database");
    cluster.stop();
    let toml =
        pipeline(&stack, &source_db, &target_db).replace(&target_db.url, &cluster.url("late"));
    let config = ConfigFile::write(&toml);
    let connector = ConnectorProcess::start(&config);
    let mut late = materializer(&config, &[], &[]);
    tokio::time::sleep(std::time::Duration::from_secs(5)).await;
    assert!(
        late.try_wait().expect("status").is_none(),
        "the materializer exited while the target was down"
    );
    cluster.start_again();
    let target = support::connect(&cluster.url("late")).await;
    wait_converged(&source, &target).await;
    assert_eq!(terminate(late).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// Seeds the demo schema with `customers` customers and `orders` orders.
pub(crate) async fn seed(client: &tokio_postgres::Client, customers: i64, orders: i64) {
    support::apply_sql_file(client, "sql/demo/schema.sql").await;
    client
        .batch_execute(&format!(
            "INSERT INTO public.customers SELECT g, 'customer ' || g, 'bronze', g % 5 FROM generate_series(1, {customers}) g;
             INSERT INTO public.orders (id, customer_id, amount, status)
             SELECT 1000000 + g, 1 + g % {customers}, g % 500 + 0.25, 'new' FROM generate_series(0, {orders} - 1) g;"
        ))
        .await
        .expect("seed");
}

/// A source database seeded with the demo schema (see [`seed`]), an empty
/// target database, and a client of each.
pub(crate) async fn databases(
    stack: &Stack,
    prefix: &str,
    customers: i64,
    orders: i64,
) -> (
    TestDb,
    TestDb,
    tokio_postgres::Client,
    tokio_postgres::Client,
) {
    let source_db = TestDb::create(stack, &format!("{prefix}_src")).await;
    let target_db = TestDb::create(stack, &format!("{prefix}_tgt")).await;
    let source = source_db.client().await;
    seed(&source, customers, orders).await;
    let target = target_db.client().await;
    (source_db, target_db, source, target)
}

/// Runs the workload on its own connection in the background.
pub(crate) fn background_workload(
    url: &str,
    changes: usize,
    seed: u64,
) -> tokio::task::JoinHandle<()> {
    let url = url.to_string();
    tokio::spawn(async move {
        let client = support::connect(&url).await;
        workload(&client, changes, seed).await;
    })
}

#[tokio::test]
async fn a_materializer_killed_at_random_points_still_converges() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat_kill", 999, 2000).await;
    // With the Bloom filter: restarts seed it from the durable tier, and
    // its guarded inserts meet every kind of redelivery.
    let config = ConfigFile::write(&format!(
        "{}\n[target.dedup]\nbloom_keys = 100000\n",
        pipeline(&stack, &source_db, &target_db).replace("batch_size = 200", "batch_size = 50")
    ));
    let connector = ConnectorProcess::start(&config);
    let work = background_workload(&source_db.url, 20_000, 0x2545_f491_4f6c_dd1d);
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    for _ in 0..10 {
        let mut m = materializer(&config, &[], &[]);
        tokio::time::sleep(Duration::from_millis(800 + rng.below(2000))).await;
        let _ = m.start_kill(); // SIGKILL
        let _ = m.wait().await;
    }
    work.await.expect("workload");
    let last = materializer(&config, &[], &[]);
    wait_converged(&source, &target).await;
    assert_eq!(terminate(last).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test]
async fn two_materializers_in_one_group_never_both_apply_a_change() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat_race", 500, 1000).await;
    // With the Bloom filter: its guarded inserts race too.
    let config = ConfigFile::write(&format!(
        "{}\n[target.dedup]\nbloom_keys = 100000\n",
        pipeline(&stack, &source_db, &target_db)
    ));
    let connector = ConnectorProcess::start(&config);
    let (a_addr, b_addr) = (
        format!("127.0.0.1:{}", support::free_port()),
        format!("127.0.0.1:{}", support::free_port()),
    );
    let a = materializer(&config, &["--http-addr", &a_addr], &[]);
    let work = background_workload(&source_db.url, 10_000, 0x0123_4567_89ab_cdef);
    // B joins mid-stream, and a third instance comes and goes: each join
    // and leave is a rebalance while changes flow.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let b = materializer(&config, &["--http-addr", &b_addr], &[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let c_addr = format!("127.0.0.1:{}", support::free_port());
    let c = materializer(&config, &["--http-addr", &c_addr], &[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let c_applied = counter(&c_addr, "pgcdc_materialize_applied_total").await;
    let c_skips = counter(&c_addr, "pgcdc_materialize_bloom_skips_total").await;
    let c_copied = counter(&c_addr, "pgcdc_materialize_copied_total").await;
    assert_eq!(terminate(c).await, Some(0));
    work.await.expect("workload");
    wait_converged(&source, &target).await;
    let applied = c_applied
        + counter(&a_addr, "pgcdc_materialize_applied_total").await
        + counter(&b_addr, "pgcdc_materialize_applied_total").await;
    let bloom_skips = c_skips
        + counter(&a_addr, "pgcdc_materialize_bloom_skips_total").await
        + counter(&b_addr, "pgcdc_materialize_bloom_skips_total").await;
    assert!(bloom_skips > 0.0, "no insert took the Bloom filter's path");
    // The snapshot's batches are windows of hundreds of fresh keys.
    let copied = c_copied
        + counter(&a_addr, "pgcdc_materialize_copied_total").await
        + counter(&b_addr, "pgcdc_materialize_copied_total").await;
    assert!(copied > 0.0, "no fresh row went in by COPY");
    assert!(copied <= bloom_skips);
    assert_eq!(terminate(a).await, Some(0));
    assert_eq!(terminate(b).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    // Every change event, counted in the topics: if no change was applied
    // by two instances, the applied total cannot exceed it. (C stopped
    // cleanly, so its count covers everything it committed.)
    let events = change_events(&stack, &source_db).await;
    assert!(applied > 0.0);
    assert!(
        applied <= events as f64,
        "{applied} applications of {events} change events"
    );
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// Change events (records with a value) in the demo tables' topics.
async fn change_events(stack: &Stack, source_db: &TestDb) -> usize {
    let mut events = 0usize;
    for table in ["customers", "orders"] {
        let topic = format!("{}.public.{table}", source_db.name);
        let total = end_offsets(stack, &topic).await;
        let records =
            support::read_topic_until(stack, &topic, Duration::from_secs(120), move |r| {
                r.len() as i64 >= total
            })
            .await;
        events += records.iter().filter(|r| r.value.is_some()).count();
    }
    events
}

/// The sum of a topic's partition end offsets.
pub(crate) async fn end_offsets(stack: &Stack, topic: &str) -> i64 {
    end_offsets_at(&stack.brokers, topic).await
}

/// The sum of a topic's end offsets, on the brokers given.
pub(crate) async fn end_offsets_at(brokers: &str, topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let (brokers, topic) = (brokers.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .client()
            .expect("consumer");
        partition_ids(&consumer, &topic)
            .into_iter()
            .map(|p| {
                consumer
                    .fetch_watermarks(&topic, p, Duration::from_secs(10))
                    .expect("watermarks")
                    .1
            })
            .sum()
    })
    .await
    .expect("watermarks task")
}

/// A topic's partition ids, from the broker's metadata.
fn partition_ids(
    consumer: &rdkafka::consumer::BaseConsumer<pgcdc::sink::Quiet>,
    topic: &str,
) -> Vec<i32> {
    use rdkafka::consumer::Consumer;
    let md = consumer
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .expect("metadata");
    md.topics()
        .iter()
        .flat_map(|t| t.partitions())
        .map(|p| p.id())
        .collect()
}

/// The sum of a consumer group's committed offsets of a topic's
/// partitions (a partition with none counts 0).
pub(crate) async fn committed_offsets(brokers: &str, group: &str, topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let (brokers, group, topic) = (brokers.to_string(), group.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", &group)
            .client()
            .expect("consumer");
        let mut tpl = rdkafka::TopicPartitionList::new();
        for p in partition_ids(&consumer, &topic) {
            tpl.add_partition(&topic, p);
        }
        let committed = consumer
            .committed_offsets(tpl, Duration::from_secs(10))
            .expect("committed offsets");
        committed
            .elements()
            .iter()
            .map(|e| e.offset().to_raw().filter(|o| *o >= 0).unwrap_or(0))
            .sum()
    })
    .await
    .expect("committed offsets task")
}

/// Every sample of a labelled metric: `(labels, value)`.
pub(crate) async fn samples(addr: &str, name: &str) -> Vec<(String, f64)> {
    let Ok(r) = reqwest::get(format!("http://{addr}/metrics")).await else {
        return Vec::new();
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = rest.rsplit_once(' ')?;
            (labels.starts_with('{') || labels.is_empty())
                .then(|| (labels.to_string(), value.parse().ok()))
                .and_then(|(l, v)| Some((l, v?)))
        })
        .collect()
}

/// Polls until `cond` holds for a counter, or panics after `limit`.
pub(crate) async fn wait_counter(
    addr: &str,
    name: &str,
    limit: Duration,
    cond: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let v = counter(addr, name).await;
        if cond(v) {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "{name} stayed at {v}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// A Redis server of the test's own (so stopping it disturbs no other test).
struct PrivateRedis {
    child: std::process::Child,
    port: u16,
}

impl PrivateRedis {
    fn start(port: u16) -> PrivateRedis {
        let bin = std::env::var("PGCDC_REDIS_BIN")
            .ok()
            .filter(|b| !b.is_empty())
            .expect("PGCDC_REDIS_BIN is not set: run the tests through scripts/test");
        let child = std::process::Command::new(bin)
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(std::time::Instant::now() < deadline, "redis did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        PrivateRedis { child, port }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    async fn keys(&self) -> i64 {
        let client = redis::Client::open(self.url()).expect("redis url");
        let mut c = client
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection");
        redis::cmd("DBSIZE")
            .query_async(&mut c)
            .await
            .expect("DBSIZE")
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

fn with_redis(toml: &str, redis: &PrivateRedis, policy: &str, ttl_seconds: u64) -> String {
    format!(
        "{toml}\n[target.dedup]\nredis_url = \"{}\"\non_redis_failure = \"{policy}\"\nttl_seconds = {ttl_seconds}\n",
        redis.url()
    )
}

/// Redis stops mid-stream. Under `fail_open` the materializer goes on with
/// the durable tier only; under `fail_closed` it applies nothing until
/// Redis is back. Either way it stays up, and everything converges.
async fn redis_outage(policy: &str, prefix: &str) {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, prefix, 200, 500).await;
    let port = support::free_port();
    let mut redis = PrivateRedis::start(port);
    let config = ConfigFile::write(&with_redis(
        &pipeline(&stack, &source_db, &target_db),
        &redis,
        policy,
        3600,
    ));
    let connector = ConnectorProcess::start(&config);
    let addr = format!("127.0.0.1:{}", support::free_port());
    let mut m = materializer(&config, &["--http-addr", &addr], &[]);
    wait_converged(&source, &target).await;
    assert_eq!(counter(&addr, "pgcdc_materialize_fast_tier_up").await, 1.0);
    assert!(redis.keys().await > 0, "nothing reached the shared tier");

    redis.stop();
    workload(&source, 3_000, 0x5151_a0a0_1234_9876).await;
    match policy {
        "fail_open" => {
            // Converges while Redis is still down.
            wait_converged(&source, &target).await;
            assert_eq!(counter(&addr, "pgcdc_materialize_fast_tier_up").await, 0.0);
        }
        _ => {
            wait_counter(
                &addr,
                "pgcdc_materialize_retries_total{cause=\"redis\"}",
                Duration::from_secs(120),
                |v| v > 0.0,
            )
            .await;
            let applied = counter(&addr, "pgcdc_materialize_applied_total").await;
            tokio::time::sleep(Duration::from_secs(4)).await;
            assert_eq!(
                counter(&addr, "pgcdc_materialize_applied_total").await,
                applied,
                "fail_closed applied changes while Redis was down"
            );
            assert!(!differences(&source, &target).await.is_empty());
        }
    }
    assert!(
        m.try_wait().expect("status").is_none(),
        "the materializer exited"
    );

    // Back: the next batches use it again (under fail_open, once the
    // retry backoff, at most 30 s, has passed).
    let _redis = PrivateRedis::start(port);
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let mut round = 0;
    while counter(&addr, "pgcdc_materialize_fast_tier_up").await != 1.0 {
        assert!(std::time::Instant::now() < deadline, "redis not used again");
        round += 1;
        workload(&source, 100, 0x7777_1111_2222_3333 + round).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    wait_converged(&source, &target).await;
    assert_eq!(terminate(m).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test]
async fn redis_down_under_fail_open_goes_on_with_the_durable_tier() {
    redis_outage("fail_open", "mat_redis_open").await;
}

#[tokio::test]
async fn redis_down_under_fail_closed_halts_until_it_is_back() {
    redis_outage("fail_closed", "mat_redis_closed").await;
}

/// Replays every topic in a new group until all `events` change events
/// were handled (and a moment more, so that extra applications would
/// show); returns (applied, duplicates, fast-tier hits).
async fn replay(config: &ConfigFile, group: &str, events: usize) -> (f64, f64, f64) {
    let addr = format!("127.0.0.1:{}", support::free_port());
    let m = materializer(
        config,
        &["--http-addr", &addr],
        &[("PGCDC__TARGET__GROUP_ID", group)],
    );
    let handled = |addr: String| async move {
        counter(&addr, "pgcdc_materialize_duplicates_total").await
            + counter(&addr, "pgcdc_materialize_applied_total").await
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        let now = handled(addr.clone()).await;
        if now >= events as f64 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "replay stalled at {now} of {events}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = (
        counter(&addr, "pgcdc_materialize_applied_total").await,
        counter(&addr, "pgcdc_materialize_duplicates_total").await,
        counter(&addr, "pgcdc_materialize_fast_tier_hits_total").await,
    );
    assert_eq!(terminate(m).await, Some(0));
    got
}

#[tokio::test]
async fn redeliveries_are_skipped_by_the_shared_tier_and_after_its_ttl_by_the_durable_tier() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat_ttl", 100, 300).await;
    let redis = PrivateRedis::start(support::free_port());
    let config = ConfigFile::write(&with_redis(
        &pipeline(&stack, &source_db, &target_db),
        &redis,
        "fail_closed",
        20,
    ));
    let connector = ConnectorProcess::start(&config);
    let first = materializer(&config, &[], &[]);
    workload(&source, 1_000, 0x0bad_cafe_dead_beef).await;
    wait_converged(&source, &target).await;
    assert_eq!(terminate(first).await, Some(0));
    assert!(redis.keys().await > 0);

    // Another process, a new group: Redis answers for the keys it holds.
    let events = change_events(&stack, &source_db).await;
    let (applied, duplicates, hits) = replay(&config, "replay_shared", events).await;
    assert_eq!(duplicates, events as f64);
    assert_eq!(applied, 0.0, "a replayed change was applied again");
    assert!(
        hits > 0.0,
        "the shared tier answered nothing ({duplicates} duplicates)"
    );

    // Past the TTL, Redis holds nothing; the durable tier still skips all.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while redis.keys().await > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "entries did not expire"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (applied, duplicates, hits) = replay(&config, "replay_expired", events).await;
    assert_eq!(applied, 0.0, "a change was applied again after the TTL");
    assert_eq!(hits, 0.0, "expired entries answered");
    assert_eq!(
        duplicates, events as f64,
        "not all skipped by the durable tier"
    );
    assert!(differences(&source, &target).await.is_empty());
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test]
async fn a_lost_target_connection_is_retried_and_nothing_is_lost() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat_conn", 200, 500).await;
    let config = ConfigFile::write(&pipeline(&stack, &source_db, &target_db));
    let connector = ConnectorProcess::start(&config);
    let addr = format!("127.0.0.1:{}", support::free_port());
    let mut m = materializer(&config, &["--http-addr", &addr], &[]);
    let work = background_workload(&source_db.url, 5_000, 0x1357_9bdf_2468_ace0);
    wait_counter(
        &addr,
        "pgcdc_materialize_applied_total",
        Duration::from_secs(120),
        |v| v > 0.0,
    )
    .await;
    // Cut the materializer's target connection, three times, mid-stream.
    // After each cut a change of our own must be applied, so the cut
    // connection is used again even when the workload has already ended
    // (a materializer that keeps up could otherwise meet no cut at all).
    for round in 0..3 {
        let before = counter(&addr, "pgcdc_materialize_applied_total").await;
        target
            .execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .expect("terminate");
        source
            .execute(
                "UPDATE customers SET name = name || $1 WHERE id = (SELECT min(id) FROM customers)",
                &[&format!(" cut {round}")],
            )
            .await
            .expect("a change after the cut");
        wait_counter(
            &addr,
            "pgcdc_materialize_applied_total",
            Duration::from_secs(120),
            |v| v > before,
        )
        .await;
    }
    work.await.expect("workload");
    wait_converged(&source, &target).await;
    assert!(
        m.try_wait().expect("status").is_none(),
        "the materializer exited"
    );
    assert!(
        counter(&addr, "pgcdc_materialize_retries_total{cause=\"target\"}").await > 0.0,
        "no retry was counted"
    );
    // Lag per partition is reported, and is 0 once converged.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let lag = samples(&addr, "pgcdc_materialize_consumer_lag").await;
        if !lag.is_empty() && lag.iter().all(|(_, v)| *v == 0.0) {
            assert!(lag.iter().all(|(l, _)| l.contains("partition=")), "{lag:?}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "lag {lag:?}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(terminate(m).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

const ORDER_RATIO: &str = r#"
[read_models.order_ratio]
table = "read_models.order_ratio"
key = ["order_id"]
query = "SELECT o.id AS order_id, round(100 / (o.amount - 13.00), 4) AS ratio FROM mirror.orders o WHERE o.id = ANY($1)"
sources = [{ table = "public.orders", key_columns = ["id"] }]
"#;

#[tokio::test]
async fn changes_the_target_rejects_are_dead_lettered_and_the_partition_moves_on() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat_dlq", 20, 40).await;
    let config = ConfigFile::write(&format!(
        "{}{ORDER_RATIO}",
        pipeline(&stack, &source_db, &target_db)
    ));
    let connector = ConnectorProcess::start(&config);
    let addr = format!("127.0.0.1:{}", support::free_port());
    let mut m = materializer(&config, &["--http-addr", &addr], &[]);
    wait_converged(&source, &target).await;
    // A rule of the target's that the source does not have.
    target
        .batch_execute("ALTER TABLE mirror.orders ADD CONSTRAINT not_666 CHECK (amount <> 666.66)")
        .await
        .expect("constraint");
    // 9000001 breaks the mirror's constraint, 9000002 the view's SQL
    // (division by zero), 9000003 is fine.
    source
        .batch_execute(
            "INSERT INTO public.orders (id, customer_id, amount, status) VALUES
               (9000001, 1, 666.66, 'new'), (9000002, 2, 13.00, 'new'), (9000003, 3, 5.00, 'new')",
        )
        .await
        .expect("insert");
    let dlq = format!("{}.dlq", source_db.name);
    let dead = support::read_topic(&stack, &dlq, 2, Duration::from_secs(120)).await;
    let mut classes: Vec<&str> = dead
        .iter()
        .map(|r| r.header("pgcdc.failure.class").unwrap_or_default())
        .collect();
    classes.sort();
    assert_eq!(
        classes,
        ["constraint_violation", "unsupported_value"],
        "{dead:?}"
    );
    for r in &dead {
        assert!(r.value.is_some(), "the rejected record itself is kept");
        let position = r.header("pgcdc.position").unwrap_or_default();
        assert!(position.contains(':'), "no position: {:?}", r.headers);
        assert!(r
            .header("pgcdc.origin.offset")
            .is_some_and(|o| o.parse::<i64>().is_ok()));
        let topic = r.header("pgcdc.origin.topic").unwrap_or_default();
        assert!(topic.ends_with("public.orders"), "{topic}");
    }
    let view_error = dead
        .iter()
        .find(|r| r.header("pgcdc.failure.class") == Some("unsupported_value"))
        .and_then(|r| r.header("pgcdc.failure.error"))
        .unwrap_or_default()
        .to_string();
    assert!(
        view_error.contains("order_ratio") && view_error.contains("division by zero"),
        "{view_error}"
    );

    // The partition moved on: later changes of the same keys apply.
    source
        .batch_execute("UPDATE public.orders SET amount = 7 WHERE id IN (9000001, 9000002)")
        .await
        .expect("update");
    wait_converged(&source, &target).await;
    let ratios: i64 = target
        .query_one(
            "SELECT count(*) FROM read_models.order_ratio WHERE order_id IN (9000001, 9000002, 9000003)",
            &[],
        )
        .await
        .expect("order_ratio")
        .get(0);
    assert_eq!(ratios, 3);
    assert_eq!(
        counter(&addr, "pgcdc_materialize_dead_lettered_total").await,
        2.0
    );
    assert_eq!(
        end_offsets(&stack, &dlq).await,
        2,
        "a change dead-lettered twice"
    );
    assert!(
        m.try_wait().expect("status").is_none(),
        "the materializer exited"
    );
    assert_eq!(terminate(m).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test]
async fn unchanged_toast_keeps_the_mirror_value_and_old_tombstones_are_swept() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat_toast", 10, 10).await;
    let config = ConfigFile::write(&pipeline(&stack, &source_db, &target_db).replace(
        "batch_size = 200",
        "batch_size = 200\nredelivery_window_hours = 1",
    ));
    let connector = ConnectorProcess::start(&config);
    let first = materializer(&config, &[], &[]);
    wait_converged(&source, &target).await;
    // 160 kB of hex digits: compressed, still stored out of line, so an
    // update of another column carries the "unchanged TOAST" marker.
    source
        .batch_execute(
            "INSERT INTO public.orders (id, customer_id, amount, status, note)
             SELECT 9100001, 1, 1.00, 'new', string_agg(md5(g::text), '') FROM generate_series(1, 5000) g;
             UPDATE public.orders SET amount = 2.00 WHERE id = 9100001;",
        )
        .await
        .expect("toasted row");
    wait_converged(&source, &target).await;
    let (amount, note_len): (String, i32) = {
        let r = target
            .query_one(
                "SELECT amount::text, length(note) FROM mirror.orders WHERE id = 9100001",
                &[],
            )
            .await
            .expect("mirror row");
        (r.get(0), r.get(1))
    };
    assert_eq!((amount.as_str(), note_len), ("2.00", 160_000));

    // Three deletes leave three tombstones; inserting a key again clears
    // its own, and one of the other two is aged past the window.
    source
        .batch_execute("DELETE FROM public.orders WHERE id IN (1000001, 1000002, 1000003)")
        .await
        .expect("deletes");
    wait_converged(&source, &target).await;
    source
        .batch_execute(
            "INSERT INTO public.orders (id, customer_id, amount, status) VALUES (1000003, 1, 3.00, 'new')",
        )
        .await
        .expect("insert again");
    wait_converged(&source, &target).await;
    let keys = |rows: Vec<tokio_postgres::Row>| -> Vec<String> {
        rows.iter().map(|r| r.get::<_, String>(0)).collect()
    };
    let sql = "SELECT key FROM pgcdc_state.tombstones WHERE mirror LIKE '%orders%' ORDER BY key";
    assert_eq!(
        keys(target.query(sql, &[]).await.expect("tombstones")),
        ["[\"1000001\"]", "[\"1000002\"]"]
    );
    target
        .execute(
            "UPDATE pgcdc_state.tombstones SET deleted_at = now() - interval '2 hours' WHERE key = '[\"1000001\"]'",
            &[],
        )
        .await
        .expect("age");
    assert_eq!(terminate(first).await, Some(0));
    let second = materializer(&config, &[], &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let left = keys(target.query(sql, &[]).await.expect("tombstones"));
        if left == ["[\"1000002\"]"] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "tombstones left: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(terminate(second).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// A target database with the materializer's state schema and one mirror,
/// `schema.table` of `columns` (name, type) keyed by the first.
async fn target_with_mirror(
    stack: &Stack,
    prefix: &str,
    schema: &str,
    table: &str,
    columns: &[(&str, &str)],
) -> (
    TestDb,
    tokio_postgres::Client,
    pgcdc::materialize::mirror::Mirror,
) {
    use pgcdc::materialize::mirror::{self, Mirror};
    use pgcdc::materialize::shape::Column;
    let db = TestDb::create(stack, prefix).await;
    let client = db.client().await;
    client
        .batch_execute(&format!("{}\nCREATE SCHEMA {schema};", mirror::STATE_SQL))
        .await
        .expect("state");
    let key = [columns[0].0.to_string()];
    let columns = columns
        .iter()
        .map(|(name, sql_type)| Column {
            name: name.to_string(),
            sql_type: sql_type.to_string(),
        })
        .collect();
    let m = Mirror::new(schema, table, &format!("public.{table}"), columns, &key).expect("mirror");
    m.ensure(&client).await.expect("ensure");
    (db, client, m)
}

/// The Bloom filter's path: an insert guarded in one statement must refuse
/// whenever the durable tier holds a position for the key (a row, a
/// tombstone, a truncate at or after it), whatever the filter believed.
#[tokio::test]
async fn a_guarded_insert_never_passes_a_stored_position() {
    use pgcdc::materialize::mirror::{self, Statements};
    use pgcdc::materialize::shape::Cell;
    let stack = support::stack();
    let (db, mut client, m) = target_with_mirror(
        &stack,
        "mat_guard",
        "m",
        "t",
        &[("id", "bigint"), ("v", "text")],
    )
    .await;
    let row = |id: &str| vec![Cell::Text(id.into()), Cell::Text("x".into())];
    let mut statements = Statements::default();
    let tx = client.transaction().await.expect("tx");
    // A new key goes in; the same key again does not.
    assert!(
        mirror::insert_new(&tx, &mut statements, &m, &row("1"), (10, 0))
            .await
            .expect("1")
    );
    assert!(
        !mirror::insert_new(&tx, &mut statements, &m, &row("1"), (11, 0))
            .await
            .expect("1 again")
    );
    // A deleted key: its tombstone refuses even an older redelivery.
    mirror::delete(&tx, &mut statements, &m, &["1".to_string()], (12, 0))
        .await
        .expect("delete");
    assert!(
        !mirror::insert_new(&tx, &mut statements, &m, &row("1"), (10, 0))
            .await
            .expect("after delete")
    );
    // A truncate at or after the position refuses; one before it does not.
    mirror::truncate(&tx, &m, (20, 5)).await.expect("truncate");
    assert!(
        !mirror::insert_new(&tx, &mut statements, &m, &row("2"), (20, 5))
            .await
            .expect("at truncate")
    );
    assert!(
        mirror::insert_new(&tx, &mut statements, &m, &row("2"), (20, 6))
            .await
            .expect("after truncate")
    );
    let rows: Vec<(i64, i64)> = tx
        .query("SELECT id, _pgcdc_commit_lsn FROM m.t ORDER BY id", &[])
        .await
        .expect("rows")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(rows, [(2, 20)]);
    tx.rollback().await.expect("rollback");
    db.drop_db().await;
}

#[tokio::test]
async fn a_column_added_to_the_source_while_running_is_added_to_the_mirror() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat_evolve", 10, 10).await;
    let config = ConfigFile::write(&pipeline(&stack, &source_db, &target_db));
    let connector = ConnectorProcess::start(&config);
    let m = materializer(&config, &[], &[]);
    wait_converged(&source, &target).await;
    source
        .batch_execute(
            "ALTER TABLE public.orders ADD COLUMN priority int;
             UPDATE public.orders SET priority = 7 WHERE id = 1000001;
             INSERT INTO public.orders (id, customer_id, amount, status, priority) VALUES (9200001, 1, 3.00, 'new', 3);",
        )
        .await
        .expect("evolve the source");
    let sql = "SELECT id, priority FROM {}.orders";
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let has = target
            .query_one(
                "SELECT count(*) FROM information_schema.columns
                 WHERE table_schema = 'mirror' AND table_name = 'orders' AND column_name = 'priority'",
                &[],
            )
            .await
            .expect("columns")
            .get::<_, i64>(0)
            == 1;
        if has
            && checksum(&source, &sql.replace("{}", "public")).await
                == checksum(&target, &sql.replace("{}", "mirror")).await
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the new column never matched"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    wait_converged(&source, &target).await;
    assert_eq!(terminate(m).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

const ORDER_DOC: &str = r#"
[read_models.order_doc]
table = "read_models.order_doc"
key = ["order_id"]
query = "SELECT o.id AS order_id, json_build_object('status', o.status) AS doc FROM mirror.orders o WHERE o.id = ANY($1)"
sources = [{ table = "public.orders", key_columns = ["id"] }]
"#;

/// A recompute writes only the view rows that changed; a read model whose
/// columns cannot be compared (`json`) is still kept, by delete and insert.
#[tokio::test]
async fn a_recompute_leaves_unchanged_view_rows_unwritten() {
    let stack = support::stack();
    let (source_db, target_db, source, target) = databases(&stack, "mat_diff", 10, 20).await;
    let config = ConfigFile::write(&format!(
        "{}{ORDER_DOC}",
        pipeline(&stack, &source_db, &target_db)
    ));
    let connector = ConnectorProcess::start(&config);
    let m = materializer(&config, &[], &[]);
    wait_converged(&source, &target).await;
    let row = source
        .query_one(
            "SELECT id, customer_id FROM public.orders WHERE customer_id IS NOT NULL ORDER BY id LIMIT 1",
            &[],
        )
        .await
        .expect("an order");
    let (order, customer): (i64, i64) = (row.get(0), row.get(1));
    // The row version's creating transaction: a rewrite changes it.
    let version = |sql: &'static str, key: i64| {
        let target = &target;
        async move {
            target
                .query_one(sql, &[&key])
                .await
                .expect("view row")
                .get::<_, String>(0)
        }
    };
    const STATS: &str = "SELECT xmin::text FROM read_models.customer_stats WHERE customer_id = $1";
    const SUMMARY: &str = "SELECT xmin::text FROM read_models.order_summary WHERE order_id = $1";
    let (stats_before, summary_before) = (
        version(STATS, customer).await,
        version(SUMMARY, order).await,
    );
    // Its customer's count and total stay; its summary row changes.
    source
        .execute(
            "UPDATE public.orders SET status = 'diffed' WHERE id = $1",
            &[&order],
        )
        .await
        .expect("update");
    support::wait_for(
        "read_models.order_doc to show the new status",
        Duration::from_secs(120),
        async || {
            target
                .query_opt(
                    "SELECT doc->>'status' FROM read_models.order_doc WHERE order_id = $1",
                    &[&order],
                )
                .await
                .expect("order_doc")
                .and_then(|r| r.get::<_, Option<String>>(0))
                .as_deref()
                == Some("diffed")
        },
    )
    .await;
    wait_converged(&source, &target).await;
    assert_ne!(
        version(SUMMARY, order).await,
        summary_before,
        "the changed summary row was written"
    );
    assert_eq!(
        version(STATS, customer).await,
        stats_before,
        "customer_stats was recomputed for the order's customer, and its row, unchanged, was rewritten"
    );
    assert_eq!(terminate(m).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// The COPY path of fresh keys, against a real target: values that COPY's
/// text format must escape arrive intact; a tombstoned key and one at or
/// before the mirror's truncate are left to the caller's guarded path; and
/// a key already in the mirror (a racing instance's row) rolls the COPY
/// back and the rows go in by the guarded insert, which keeps that row.
#[tokio::test]
async fn fresh_rows_go_in_by_copy_intact_and_the_guard_still_holds() {
    use pgcdc::materialize::mirror::{self, SetRow, Statements};
    use pgcdc::materialize::shape::Cell;
    let stack = support::stack();
    let columns = [
        ("id", "bigint"),
        ("note", "text"),
        ("tags", "text[]"),
        ("at", "timestamptz"),
    ];
    let (db, mut client, m) =
        target_with_mirror(&stack, "mat_copy", "mirror", "notes", &columns).await;
    client
        .batch_execute("SET TimeZone = 'UTC'")
        .await
        .expect("time zone");
    let notes: [Option<&str>; 10] = [
        Some("tab\there"),
        Some("line\nbreak"),
        Some("cr\rx"),
        Some("back\\slash"),
        Some("\\N"),
        Some("\\."),
        Some(""),
        None,
        Some("naïve 東京 🚀"),
        Some("ends\\"),
    ];
    let text = |s: &str| Cell::Text(s.to_string());
    // Rows 1-10 carry the notes; 11 has a tombstone; 12 is not newer than
    // the truncate at (60, 0).
    let mut keys: Vec<Vec<String>> = Vec::new();
    let mut cells: Vec<Vec<Cell>> = Vec::new();
    for id in 1..=12i64 {
        keys.push(vec![id.to_string()]);
        let note = notes
            .get(id as usize - 1)
            .copied()
            .flatten()
            .map_or(Cell::Null, text);
        cells.push(vec![
            text(&id.to_string()),
            note,
            text(r#"{a,"b c","d\"e"}"#),
            text("2026-12-04 10:00:00.123456+00"),
        ]);
    }
    let position = |id: usize| {
        if id == 12 {
            (60, 0)
        } else {
            (100 + id as i64, 0)
        }
    };
    let rows: Vec<SetRow<'_>> = (0..12)
        .map(|i| SetRow {
            key: &keys[i],
            cells: Some(&cells[i]),
            position: position(i + 1),
        })
        .collect();
    client
        .execute(
            "INSERT INTO pgcdc_state.tombstones (mirror, key, commit_lsn, seq) VALUES ($1, $2, 200, 0)",
            &[&m.qualified, &m.key_text(&keys[10])],
        )
        .await
        .expect("tombstone");
    client
        .execute(
            "INSERT INTO pgcdc_state.truncations (mirror, commit_lsn, seq) VALUES ($1, 60, 0)",
            &[&m.qualified],
        )
        .await
        .expect("truncation");

    let mut statements = Statements::default();
    let tx = client.transaction().await.expect("begin");
    let (inserted, copied) = mirror::copy_new_many(&tx, &mut statements, &m, &rows)
        .await
        .expect("copy");
    tx.commit().await.expect("commit");
    assert!(copied, "the rows did not go in by COPY");
    assert_eq!(
        inserted,
        (0..10).collect::<Vec<_>>(),
        "tombstoned or truncated rows went in"
    );
    for (i, note) in notes.iter().enumerate() {
        let row = client
            .query_one(
                "SELECT note, tags::text, at::text, _pgcdc_commit_lsn FROM mirror.notes WHERE id = $1",
                &[&(i as i64 + 1)],
            )
            .await
            .expect("row");
        assert_eq!(
            row.get::<_, Option<&str>>(0),
            *note,
            "note of row {}",
            i + 1
        );
        assert_eq!(row.get::<_, &str>(1), r#"{a,"b c","d\"e"}"#);
        assert_eq!(row.get::<_, &str>(2), "2026-12-04 10:00:00.123456+00");
        assert_eq!(row.get::<_, i64>(3), 101 + i as i64);
    }
    let count: i64 = client
        .query_one("SELECT count(*) FROM mirror.notes", &[])
        .await
        .expect("count")
        .get(0);
    assert_eq!(count, 10);

    // Row 1 is there now: a COPY of rows 1 and 13-15 conflicts, is rolled
    // back, and the guarded insert writes 13-15 and leaves row 1 alone.
    let later: Vec<(Vec<String>, Vec<Cell>)> = [1i64, 13, 14, 15]
        .iter()
        .map(|id| {
            (
                vec![id.to_string()],
                vec![text(&id.to_string()), text("later"), Cell::Null, Cell::Null],
            )
        })
        .collect();
    let rows: Vec<SetRow<'_>> = later
        .iter()
        .map(|(k, c)| SetRow {
            key: k,
            cells: Some(c),
            position: (300, 0),
        })
        .collect();
    let tx = client.transaction().await.expect("begin");
    let (inserted, copied) = mirror::copy_new_many(&tx, &mut statements, &m, &rows)
        .await
        .expect("copy with a conflict");
    tx.commit().await.expect("commit");
    assert!(!copied, "a COPY over an existing key cannot have succeeded");
    let mut inserted = inserted;
    inserted.sort();
    assert_eq!(inserted, vec![1, 2, 3]);
    let notes: Vec<Option<String>> = client
        .query(
            "SELECT note FROM mirror.notes WHERE id IN (1, 13, 14, 15) ORDER BY id",
            &[],
        )
        .await
        .expect("rows")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        notes,
        vec![
            Some("tab\there".to_string()),
            Some("later".into()),
            Some("later".into()),
            Some("later".into())
        ]
    );
    db.drop_db().await;
}

/// Two tenants' tables keyed by (tenant, id): the same ids recur in every
/// tenant, and tenants are named to trip up a key written as text.
const TENANTS: [&str; 5] = ["acme", "it's", r#"a "b", c"#, r#"["x"]"#, "日本"];

const TENANT_MODELS: &str = r#"
[read_models.tenant_customer_stats]
table = "read_models.tenant_customer_stats"
key = ["tenant", "customer_id"]
query = """
SELECT c.tenant, c.id AS customer_id, c.name, count(o.id) AS order_count,
       coalesce(sum(o.amount), 0) AS total
FROM mirror.t_customers c
LEFT JOIN mirror.t_orders o ON o.tenant = c.tenant AND o.customer_id = c.id
WHERE (c.tenant, c.id) IN (SELECT * FROM unnest($1::text[], $2::int[]))
GROUP BY c.tenant, c.id, c.name
"""
sources = [
  { table = "public.t_customers", key_columns = ["tenant", "id"] },
  { table = "public.t_orders", key_columns = ["tenant", "customer_id"] },
]

[read_models.tenant_orders]
table = "read_models.tenant_orders"
key = ["order_id", "tenant"]
query = """
SELECT o.tenant, o.id AS order_id, c.name AS customer_name, o.amount
FROM mirror.t_orders o
LEFT JOIN mirror.t_customers c ON c.tenant = o.tenant AND c.id = o.customer_id
WHERE (o.id, o.tenant) IN (SELECT * FROM unnest($1::bigint[], $2::text[]))
"""
sources = [
  { table = "public.t_orders", key_columns = ["id", "tenant"] },
  { table = "public.t_customers", affected_keys = "SELECT id, tenant FROM mirror.t_orders WHERE tenant = $1 AND customer_id = $2" },
]

[read_models.tenant_order_doc]
table = "read_models.tenant_order_doc"
key = ["tenant", "order_id"]
query = """
SELECT o.tenant, o.id AS order_id, json_build_object('customer', o.customer_id) AS doc
FROM mirror.t_orders o
WHERE (o.tenant, o.id) IN (SELECT * FROM unnest($1::text[], $2::bigint[]))
"""
sources = [{ table = "public.t_orders", key_columns = ["tenant", "id"] }]

[read_models.order_notes]
table = "read_models.order_notes"
key = ["note_id"]
query = """
SELECT n.id AS note_id, n.body, o.amount
FROM mirror.t_notes n
LEFT JOIN mirror.t_orders o ON o.tenant = n.tenant AND o.id = n.order_id
WHERE n.id = ANY($1)
"""
sources = [
  { table = "public.t_notes", key_columns = ["id"] },
  { table = "public.t_orders", affected_keys = "SELECT id FROM mirror.t_notes WHERE tenant = $1" },
]
"#;

/// `(what, source SQL, target SQL)`, as [`CHECKS`].
const TENANT_CHECKS: [(&str, &str, &str); 4] = [
    (
        "order_notes",
        "SELECT n.id, n.body, o.amount FROM public.t_notes n
         LEFT JOIN public.t_orders o ON o.tenant = n.tenant AND o.id = n.order_id",
        "SELECT note_id, body, amount FROM read_models.order_notes",
    ),
    (
        "tenant_customer_stats",
        "SELECT c.tenant, c.id, c.name, count(o.id), coalesce(sum(o.amount), 0)
         FROM public.t_customers c
         LEFT JOIN public.t_orders o ON o.tenant = c.tenant AND o.customer_id = c.id
         GROUP BY c.tenant, c.id, c.name",
        "SELECT tenant, customer_id, name, order_count, total FROM read_models.tenant_customer_stats",
    ),
    (
        "tenant_orders",
        "SELECT o.tenant, o.id, c.name, o.amount FROM public.t_orders o
         LEFT JOIN public.t_customers c ON c.tenant = o.tenant AND c.id = o.customer_id",
        "SELECT tenant, order_id, customer_name, amount FROM read_models.tenant_orders",
    ),
    (
        "tenant_order_doc",
        "SELECT tenant, id, json_build_object('customer', customer_id)::text FROM public.t_orders",
        "SELECT tenant, order_id, doc::text FROM read_models.tenant_order_doc",
    ),
];

/// Waits until every [`TENANT_CHECKS`] view holds what its query gives on
/// the source.
async fn wait_tenant_views(source: &tokio_postgres::Client, target: &tokio_postgres::Client) {
    let views = TENANT_CHECKS.map(|(what, ..)| format!("read_models.{what}"));
    let views: Vec<&str> = views.iter().map(String::as_str).collect();
    wait_matching(source, target, &TENANT_CHECKS, &views).await
}

fn literal(text: &str) -> String {
    format!("'{}'", text.replace('\'', "''"))
}

/// One random change of the tenant tables, ids drawn from small ranges so
/// that every tenant holds the same ids and changes meet existing rows.
fn tenant_statement(rng: &mut Rng) -> String {
    let tenant = literal(TENANTS[rng.below(TENANTS.len() as u64) as usize]);
    let other = literal(TENANTS[rng.below(TENANTS.len() as u64) as usize]);
    let (order, customer) = (1 + rng.below(40), 1 + rng.below(6));
    match rng.below(10) {
        0..=2 => format!(
            "INSERT INTO public.t_orders VALUES ({tenant}, {order}, {customer}, {}.{:02})
             ON CONFLICT (tenant, id) DO UPDATE SET amount = excluded.amount;",
            rng.below(500),
            rng.below(100)
        ),
        3 => format!(
            "UPDATE public.t_orders SET amount = amount + 1 WHERE tenant = {tenant} AND id = {order};"
        ),
        // To no customer now and then: a NULL in a view key's column.
        4 => format!(
            "UPDATE public.t_orders SET customer_id = {} WHERE tenant = {tenant} AND id = {order};",
            if customer == 6 { "NULL".to_string() } else { customer.to_string() }
        ),
        5 => format!("DELETE FROM public.t_orders WHERE tenant = {tenant} AND id = {order};"),
        // A key change: the order moves to another tenant.
        6 => format!(
            "UPDATE public.t_orders SET tenant = {other} WHERE tenant = {tenant} AND id = {order}
             AND NOT EXISTS (SELECT 1 FROM public.t_orders WHERE tenant = {other} AND id = {order});"
        ),
        // A note on an order (uuid keys), perhaps on none yet.
        7 if rng.below(2) == 0 => format!(
            "INSERT INTO public.t_notes VALUES (gen_random_uuid(), {tenant}, {order}, 'note');"
        ),
        7 => format!(
            "DELETE FROM public.t_notes WHERE id = (SELECT id FROM public.t_notes ORDER BY id LIMIT 1 OFFSET {});",
            rng.below(10)
        ),
        8 => format!(
            "UPDATE public.t_customers SET name = 'renamed, \"{}\"' WHERE tenant = {tenant} AND id = {customer};",
            rng.below(100)
        ),
        _ if rng.below(2) == 0 => {
            format!("DELETE FROM public.t_customers WHERE tenant = {tenant} AND id = {customer};")
        }
        _ => format!(
            "INSERT INTO public.t_customers VALUES ({tenant}, {customer}, 'new {customer}')
             ON CONFLICT (tenant, id) DO NOTHING;"
        ),
    }
}

/// One source transaction of `n` [`tenant_statement`]s.
async fn tenant_transaction(source: &tokio_postgres::Client, rng: &mut Rng, n: u64) {
    let mut sql = String::from("BEGIN;");
    for _ in 0..n {
        sql.push_str(&tenant_statement(rng));
    }
    sql.push_str("COMMIT;");
    source.batch_execute(&sql).await.expect("workload");
}

/// Read models keyed by two columns, (tenant, id): a mapping by the
/// mirror's own composite key, one by two non-key columns (indexed as a
/// pair), one by a query taking both columns of the changed row's key,
/// and one recomputed by delete and insert (a `json` column); beside them
/// a read model keyed by a `uuid`. Snapshot, streamed changes, key
/// changes and a truncate all land, tenants sharing ids never mix, and
/// an unchanged view row is left unwritten. Mappings that cannot work are
/// refused at start-up, naming their field.
#[tokio::test]
async fn read_models_with_composite_keys_track_their_queries() {
    let stack = support::stack();
    let source_db = TestDb::create(&stack, "mat_composite_src").await;
    let target_db = TestDb::create(&stack, "mat_composite_tgt").await;
    let (source, target) = (source_db.client().await, target_db.client().await);
    source
        .batch_execute(
            "CREATE TABLE public.t_customers (tenant text, id int, name text, PRIMARY KEY (tenant, id));
             CREATE TABLE public.t_orders (tenant text, id bigint, customer_id int,
                                           amount numeric(10,2), PRIMARY KEY (tenant, id));
             CREATE TABLE public.t_notes (id uuid PRIMARY KEY, tenant text, order_id bigint, body text);",
        )
        .await
        .expect("schema");
    for tenant in TENANTS {
        let t = literal(tenant);
        source
            .batch_execute(&format!(
                "INSERT INTO public.t_customers SELECT {t}, i, 'customer ' || i FROM generate_series(1, 3) i;
                 INSERT INTO public.t_orders SELECT {t}, i, 1 + i % 3, i * 10 FROM generate_series(1, 5) i;
                 INSERT INTO public.t_notes SELECT gen_random_uuid(), {t}, i, 'seeded' FROM generate_series(1, 3) i;"
            ))
            .await
            .expect("seed");
    }
    let pipeline = format!(
        "{}\n[target]\nurl = \"{}\"\nbatch_size = 20\n",
        support::pipeline_toml(
            &stack,
            &source_db.url,
            &source_db.name,
            &["public.t_customers", "public.t_orders", "public.t_notes"]
        ),
        target_db.url
    );
    let config = ConfigFile::write(&format!("{pipeline}{TENANT_MODELS}"));
    let connector = ConnectorProcess::start(&config);
    let m = materializer(&config, &[], &[]);
    wait_tenant_views(&source, &target).await;

    let mut rng = Rng(0x7e4a47);
    for _ in 0..40 {
        let n = 1 + rng.below(20);
        tenant_transaction(&source, &mut rng, n).await;
    }
    wait_tenant_views(&source, &target).await;
    // Every tenant kept its own rows under the shared ids.
    let shared: i64 = source
        .query_one(
            "SELECT count(*) FROM (SELECT id FROM public.t_orders GROUP BY id HAVING count(*) > 1) s",
            &[],
        )
        .await
        .expect("shared ids")
        .get(0);
    assert!(shared > 0, "the workload left no order id in two tenants");
    let index: i64 = target
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = 'mirror' AND tablename = 't_orders'
             AND indexdef LIKE '%(tenant, customer_id)%'",
            &[],
        )
        .await
        .expect("indexes")
        .get(0);
    assert_eq!(index, 1, "the (tenant, customer_id) mapping is indexed");

    // Orders rewritten as they are: the views keyed by one statement leave
    // their rows unwritten, the `json` one deletes and reinserts them.
    let tenant = TENANTS[2];
    let versions = async |view: &str, column: &str| -> Vec<String> {
        target
            .query(
                &format!(
                    "SELECT xmin::text FROM read_models.{view} WHERE tenant = $1 ORDER BY {column}"
                ),
                &[&tenant],
            )
            .await
            .expect("versions")
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let stats = versions("tenant_customer_stats", "customer_id").await;
    let orders = versions("tenant_orders", "order_id").await;
    let docs = versions("tenant_order_doc", "order_id").await;
    assert!(!docs.is_empty(), "tenant {tenant} has orders");
    source
        .execute(
            "UPDATE public.t_orders SET amount = amount WHERE tenant = $1",
            &[&tenant],
        )
        .await
        .expect("rewrite");
    support::wait_for(
        "the json view to rewrite the tenant's orders",
        Duration::from_secs(120),
        async || {
            let now = versions("tenant_order_doc", "order_id").await;
            now.iter().zip(&docs).all(|(a, b)| a != b)
        },
    )
    .await;
    assert_eq!(versions("tenant_orders", "order_id").await, orders);
    assert_eq!(
        versions("tenant_customer_stats", "customer_id").await,
        stats
    );

    source
        .batch_execute(&format!(
            "TRUNCATE public.t_orders;
             INSERT INTO public.t_orders VALUES ({}, 1, 2, 5.50), ({}, 1, 2, 6.25);",
            literal(TENANTS[1]),
            literal(TENANTS[2])
        ))
        .await
        .expect("truncate");
    wait_tenant_views(&source, &target).await;
    assert_eq!(terminate(m).await, Some(0));

    // A new materializer takes up the tables the first one made.
    let m = materializer(&config, &[], &[]);
    for _ in 0..5 {
        tenant_transaction(&source, &mut rng, 10).await;
    }
    wait_tenant_views(&source, &target).await;
    assert_eq!(terminate(m).await, Some(0));

    for (what, from, to, said) in [
        (
            "$3 where the changed row's key has two columns",
            "WHERE tenant = $1 AND customer_id = $2\"",
            "WHERE tenant = $1 AND customer_id = $2 AND id = $3\"",
            "read_models.tenant_orders.sources[1].affected_keys: takes 3 parameters",
        ),
        (
            "an integer $1 given the tenant's text",
            "WHERE tenant = $1 AND customer_id = $2\"",
            "WHERE customer_id = $1\"",
            "read_models.tenant_orders.sources[1].affected_keys: $1 is a int4, but it is given public.t_customers's key column tenant (text)",
        ),
        (
            "a third column returned for a two-column key",
            "SELECT id, tenant FROM mirror.t_orders",
            "SELECT id, tenant, amount FROM mirror.t_orders",
            "read_models.tenant_orders.sources[1].affected_keys: returns 3 column(s)",
        ),
        (
            "a key unlike the existing table's primary key",
            "key = [\"tenant\", \"customer_id\"]",
            "key = [\"tenant\", \"name\"]",
            "read_models.tenant_customer_stats.key: read_models.tenant_customer_stats has the primary key (tenant, customer_id), not (tenant, name)",
        ),
    ] {
        let changed = TENANT_MODELS.replace(from, to);
        assert_ne!(changed, TENANT_MODELS, "{what}");
        let bad = ConfigFile::write(&format!("{pipeline}{changed}"));
        let run = tokio::time::timeout(
            Duration::from_secs(120),
            support::pgcdc(&["materialize", "--config", bad.arg()]),
        )
        .await
        .expect("a refused configuration stops the materializer");
        assert_ne!(run.code, 0, "{what}: {}", run.all_output());
        assert!(run.stderr.contains(said), "{what}: {}", run.all_output());
    }
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}
