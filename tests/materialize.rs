//! `pgcdc materialize` end to end on the demo schema: the connector streams
//! a random mixed workload, the materializer builds the mirrors and both
//! read models, and everything is compared with the source by checksum.

use std::time::Duration;

use crate::support::{self, ConfigFile, ConnectorProcess, Stack, TestDb};

const READ_MODELS: &str = r#"
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

async fn checksum(client: &tokio_postgres::Client, sql: &str) -> (i64, String) {
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
async fn differences(
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
) -> Vec<String> {
    let mut out = Vec::new();
    for (what, s, t) in CHECKS {
        let (a, b) = (checksum(source, s).await, checksum(target, t).await);
        if a != b {
            out.push(format!("{what}: source {a:?}, target {b:?}"));
        }
    }
    out
}

async fn wait_converged(source: &tokio_postgres::Client, target: &tokio_postgres::Client) {
    // Generous: in debug builds, beside the other tests, on two cores.
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    loop {
        // Target tables appear once the materializer has started.
        let ready = target
            .query_one(
                "SELECT to_regclass('read_models.customer_stats') IS NOT NULL",
                &[],
            )
            .await
            .expect("target")
            .get::<_, bool>(0);
        if ready {
            let diff = differences(source, target).await;
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
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// About `changes` row changes in transactions of up to 50 statements:
/// order inserts, updates and deletes, orders moving between customers,
/// customer renames and tier changes, new customers, and one truncate of
/// the orders halfway.
async fn workload(client: &tokio_postgres::Client, changes: usize, seed: u64) {
    let mut rng = Rng(seed);
    let mut next_order = 2_000_000i64;
    let mut next_customer = 1_000i64;
    let mut done = 0;
    let mut truncated = false;
    while done < changes {
        let mut sql = String::from("BEGIN;");
        for _ in 0..(1 + rng.below(50)) {
            let customer = 1 + rng.below(next_customer as u64 - 1) as i64;
            let order = 1_000_000 + rng.below((next_order - 1_000_000) as u64) as i64;
            match rng.below(10) {
                0..=3 => {
                    sql.push_str(&format!(
                        "INSERT INTO public.orders (id, customer_id, amount, status, note)
                         SELECT {next_order}, {customer}, {}.{:02}, 'new', {} WHERE EXISTS (SELECT 1 FROM public.customers WHERE id = {customer});",
                        rng.below(1000),
                        rng.below(100),
                        if rng.below(3) == 0 { "NULL".to_string() } else { format!("'note {}'", rng.below(100)) }
                    ));
                    next_order += 1;
                }
                4 | 5 => sql.push_str(&format!(
                    "UPDATE public.orders SET amount = amount + {}, status = 'paid' WHERE id = {order};",
                    rng.below(50)
                )),
                6 => sql.push_str(&format!("DELETE FROM public.orders WHERE id = {order};")),
                7 => sql.push_str(&format!(
                    "UPDATE public.orders SET customer_id = {customer} WHERE id = {order}
                     AND EXISTS (SELECT 1 FROM public.customers WHERE id = {customer});"
                )),
                8 => sql.push_str(&format!(
                    "UPDATE public.customers SET name = 'renamed {}', tier = {} WHERE id = {customer};",
                    rng.below(1000),
                    if rng.below(2) == 0 { "'gold'" } else { "NULL" }
                )),
                _ => {
                    sql.push_str(&format!(
                        "INSERT INTO public.customers (id, name, tier, tenant_id) VALUES ({next_customer}, 'customer {next_customer}', 'silver', {});",
                        rng.below(5)
                    ));
                    next_customer += 1;
                }
            }
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

fn pipeline(stack: &Stack, source: &TestDb, target: &TestDb) -> String {
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
fn materializer(
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

async fn terminate(mut child: tokio::process::Child) -> Option<i32> {
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

/// A counter from a Prometheus text page (0 when absent).
async fn counter(addr: &str, name: &str) -> f64 {
    let Ok(r) = reqwest::get(format!("http://{addr}/metrics")).await else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test]
async fn mirrors_and_read_models_converge_and_a_replay_applies_nothing_twice() {
    let stack = support::stack();
    let source_db = TestDb::create(&stack, "mat_src").await;
    let target_db = TestDb::create(&stack, "mat_tgt").await;
    let source = source_db.client().await;
    support::apply_sql_file(&source, "sql/demo/schema.sql").await;
    source
        .batch_execute(
            "INSERT INTO public.customers SELECT g, 'customer ' || g, 'bronze', g % 5 FROM generate_series(1, 999) g;
             INSERT INTO public.orders (id, customer_id, amount, status)
             SELECT 1000000 + g, 1 + g % 999, g % 500 + 0.25, 'new' FROM generate_series(0, 1999) g;",
        )
        .await
        .expect("seed");
    let target = target_db.client().await;
    let config = ConfigFile::write(&pipeline(&stack, &source_db, &target_db));
    let connector = ConnectorProcess::start(&config);
    let first = materializer(&config, &[], &[]);
    workload(&source, 50_000, 0x9e37_79b9_7f4a_7c15).await;
    wait_converged(&source, &target).await;
    assert_eq!(terminate(first).await, Some(0));

    // Replay every topic from the beginning in a new consumer group: every
    // change is a duplicate, nothing is applied, nothing changes.
    let port = support::free_port();
    let addr = format!("127.0.0.1:{port}");
    let replay = materializer(
        &config,
        &["--metrics-addr", &addr],
        &[("PGCDC__TARGET__GROUP_ID", "replay")],
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    let mut last = -1.0;
    loop {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let now = counter(&addr, "pgcdc_materialize_duplicates_total").await;
        if now > 1_000.0 && now == last {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "replay stalled at {now}"
        );
        last = now;
    }
    assert_eq!(
        counter(&addr, "pgcdc_materialize_applied_total").await,
        0.0,
        "a replayed change was applied again"
    );
    assert!(differences(&source, &target).await.is_empty());
    assert_eq!(terminate(replay).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// Seeds the demo schema with `customers` customers and `orders` orders.
async fn seed(client: &tokio_postgres::Client, customers: i64, orders: i64) {
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

/// Runs the workload on its own connection in the background.
fn background_workload(url: &str, changes: usize, seed: u64) -> tokio::task::JoinHandle<()> {
    let url = url.to_string();
    tokio::spawn(async move {
        let client = support::connect(&url).await;
        workload(&client, changes, seed).await;
    })
}

#[tokio::test]
async fn a_materializer_killed_at_random_points_still_converges() {
    let stack = support::stack();
    let source_db = TestDb::create(&stack, "mat_kill_src").await;
    let target_db = TestDb::create(&stack, "mat_kill_tgt").await;
    let source = source_db.client().await;
    seed(&source, 999, 2000).await;
    let target = target_db.client().await;
    let config = ConfigFile::write(
        &pipeline(&stack, &source_db, &target_db).replace("batch_size = 200", "batch_size = 50"),
    );
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
    let source_db = TestDb::create(&stack, "mat_race_src").await;
    let target_db = TestDb::create(&stack, "mat_race_tgt").await;
    let source = source_db.client().await;
    seed(&source, 500, 1000).await;
    let target = target_db.client().await;
    let config = ConfigFile::write(&pipeline(&stack, &source_db, &target_db));
    let connector = ConnectorProcess::start(&config);
    let (a_addr, b_addr) = (
        format!("127.0.0.1:{}", support::free_port()),
        format!("127.0.0.1:{}", support::free_port()),
    );
    let a = materializer(&config, &["--metrics-addr", &a_addr], &[]);
    let work = background_workload(&source_db.url, 10_000, 0x0123_4567_89ab_cdef);
    // B joins mid-stream, and a third instance comes and goes: each join
    // and leave is a rebalance while changes flow.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let b = materializer(&config, &["--metrics-addr", &b_addr], &[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let c_addr = format!("127.0.0.1:{}", support::free_port());
    let c = materializer(&config, &["--metrics-addr", &c_addr], &[]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let c_applied = counter(&c_addr, "pgcdc_materialize_applied_total").await;
    assert_eq!(terminate(c).await, Some(0));
    work.await.expect("workload");
    wait_converged(&source, &target).await;
    let applied = c_applied
        + counter(&a_addr, "pgcdc_materialize_applied_total").await
        + counter(&b_addr, "pgcdc_materialize_applied_total").await;
    assert_eq!(terminate(a).await, Some(0));
    assert_eq!(terminate(b).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    // Every change event, counted in the topics: if no change was applied
    // by two instances, the applied total cannot exceed it. (C stopped
    // cleanly, so its count covers everything it committed.)
    let mut events = 0usize;
    for table in ["customers", "orders"] {
        let topic = format!("{}.public.{table}", source_db.name);
        let total = end_offsets(&stack, &topic).await;
        let records =
            support::read_topic_until(&stack, &topic, Duration::from_secs(120), move |r| {
                r.len() as i64 >= total
            })
            .await;
        events += records.iter().filter(|r| r.value.is_some()).count();
    }
    assert!(applied > 0.0);
    assert!(
        applied <= events as f64,
        "{applied} applications of {events} change events"
    );
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// The sum of a topic's partition end offsets.
async fn end_offsets(stack: &Stack, topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let (brokers, topic) = (stack.brokers.clone(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()
            .expect("consumer");
        let md = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .expect("metadata");
        md.topics()
            .iter()
            .flat_map(|t| t.partitions())
            .map(|p| {
                consumer
                    .fetch_watermarks(&topic, p.id(), Duration::from_secs(10))
                    .expect("watermarks")
                    .1
            })
            .sum()
    })
    .await
    .expect("watermarks task")
}
