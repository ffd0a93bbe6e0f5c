//! The dead-letter workflow end to end: the seed's worked example (a
//! target outage quarantines 200 changes; 12 reach the target another way;
//! 3 predate a breaking change), every transition through the CLI, the
//! policies, poison messages, and the health figures.

use pgcdc::sink::CreateClient as _;
use std::time::Duration;

use serde_json::Value as Json;

use crate::materialize::{counter, materializer, terminate, wait_counter};
use crate::operator::alert;
use crate::support::{self, wait_for, ConfigFile, ConnectorProcess, Stack, TestDb};

const ITEMS: &str = "
CREATE TABLE public.items (id bigint PRIMARY KEY, owner int NOT NULL, qty bigint NOT NULL);
INSERT INTO public.items SELECT g, g % 7, g FROM generate_series(1, 20) g;";

const OWNER_TOTALS: &str = r#"
[read_models.owner_totals]
table = "read_models.owner_totals"
key = ["owner"]
query = "SELECT owner, count(*) AS items, sum(qty) AS qty FROM mirror.items WHERE owner = ANY($1) GROUP BY owner"
sources = [{ table = "public.items", key_columns = ["owner"] }]
"#;

/// The mirror and the read model against the source: `(what, source, target)`.
const CHECKS: &[(&str, &str, &str)] = &[
    (
        "items",
        "SELECT id, owner, qty FROM public.items",
        "SELECT id, owner, qty FROM mirror.items",
    ),
    (
        "owner_totals",
        "SELECT owner, count(*), sum(qty) FROM public.items GROUP BY owner",
        "SELECT owner, items, qty FROM read_models.owner_totals",
    ),
];

async fn differences(
    source: &tokio_postgres::Client,
    target: &tokio_postgres::Client,
) -> Vec<String> {
    let mut out = Vec::new();
    for (what, s, t) in CHECKS {
        let (a, b) = (
            crate::materialize::checksum(source, s).await,
            crate::materialize::checksum(target, t).await,
        );
        if a != b {
            out.push(format!("{what}: source {a:?}, target {b:?}"));
        }
    }
    out
}

async fn wait_equal(source: &tokio_postgres::Client, target_url: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    loop {
        let target = support::connect(target_url).await;
        let ready: bool = target
            .query_one(
                "SELECT to_regclass('read_models.owner_totals') IS NOT NULL",
                &[],
            )
            .await
            .expect("target")
            .get(0);
        if ready {
            let diff = differences(source, &target).await;
            if diff.is_empty() {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "not equal: {diff:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// A pipeline of `public.items` with one partition per topic (so a test
/// can say which records share a partition).
fn pipeline(stack: &Stack, source: &TestDb, target: &TestDb, dlq: &str) -> String {
    let base = support::pipeline_toml(stack, &source.url, &source.name, &["public.items"])
        .replace("[kafka]\n", "[kafka]\npartitions = 1\n");
    format!(
        "{base}[target]\nurl = \"{}\"\nbatch_size = 500\n[dlq]\n{dlq}\n{OWNER_TOTALS}",
        target.url
    )
}

/// A source database with `schema` applied, and an empty target.
async fn databases(
    stack: &Stack,
    prefix: &str,
    schema: &str,
) -> (TestDb, TestDb, tokio_postgres::Client) {
    let source_db = TestDb::create(stack, &format!("{prefix}_src")).await;
    let target_db = TestDb::create(stack, &format!("{prefix}_tgt")).await;
    let source = source_db.client().await;
    source.batch_execute(schema).await.expect("schema");
    (source_db, target_db, source)
}

/// Stops the materializer (still running, it must exit 0) and the
/// connector, then drops both databases.
async fn finish(
    materializer: Option<tokio::process::Child>,
    connector: ConnectorProcess,
    source_db: TestDb,
    target_db: TestDb,
) {
    if let Some(mut m) = materializer {
        assert!(
            m.try_wait().expect("status").is_none(),
            "the materializer exited"
        );
        assert_eq!(terminate(m).await, Some(0));
    }
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// A pipeline of one table with a target and no read model; `kafka`
/// adds lines to `[kafka]`.
fn single_table(
    stack: &Stack,
    source: &TestDb,
    target: &TestDb,
    table: &str,
    kafka: &str,
) -> ConfigFile {
    let toml = support::pipeline_toml(stack, &source.url, &source.name, &[table])
        .replace("[kafka]\n", &format!("[kafka]\n{kafka}"));
    ConfigFile::write(&format!(
        "{toml}[target]\nurl = \"{}\"\n[dlq]\ncheck_interval_secs = 0\n",
        target.url
    ))
}

/// `public.items` captured and materialized, with these `[dlq]` settings,
/// once the target equals the source.
struct Items {
    source_db: TestDb,
    target_db: TestDb,
    source: tokio_postgres::Client,
    /// The config's text, to extend with policies or mappings.
    base: String,
    config: ConfigFile,
    connector: ConnectorProcess,
    m: tokio::process::Child,
    /// The materializer's metrics.
    addr: String,
}

async fn items(stack: &Stack, prefix: &str, dlq: &str) -> Items {
    let (source_db, target_db, source) = databases(stack, prefix, ITEMS).await;
    let base = pipeline(stack, &source_db, &target_db, dlq);
    let config = ConfigFile::write(&base);
    let connector = ConnectorProcess::start(&config);
    let addr = format!("127.0.0.1:{}", support::free_port());
    let m = materializer(&config, &["--http-addr", &addr], &[]);
    wait_equal(&source, &target_db.url).await;
    Items {
        source_db,
        target_db,
        source,
        base,
        config,
        connector,
        m,
        addr,
    }
}

/// Refuses new connections to the target database and ends the open ones.
async fn target_down(stack: &Stack, db: &TestDb) {
    let admin = support::connect(&stack.admin_url).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS false",
            db.name
        ))
        .await
        .expect("refuse connections");
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            &[&db.name],
        )
        .await
        .expect("terminate");
}

async fn target_up(stack: &Stack, db: &TestDb) {
    let admin = support::connect(&stack.admin_url).await;
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} ALLOW_CONNECTIONS true",
            db.name
        ))
        .await
        .expect("allow connections");
}

/// Produces one raw record (a test's own producer: "another path").
async fn produce(stack: &Stack, topic: &str, key: Option<&[u8]>, value: &[u8]) {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let producer: FutureProducer<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &stack.brokers)
        .client()
        .expect("producer");
    let mut record = FutureRecord::<[u8], [u8]>::to(topic).payload(value);
    if let Some(k) = key {
        record = record.key(k);
    }
    producer
        .send(record, Duration::from_secs(30))
        .await
        .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
}

async fn cli(args: &[&str]) -> support::Run {
    support::pgcdc(args).await
}

/// `pgcdc dlq list --json` with extra filters.
async fn list(config: &ConfigFile, extra: &[&str]) -> Vec<Json> {
    let mut args = vec!["dlq", "list", "--json", "--config", config.arg()];
    args.extend_from_slice(extra);
    let run = cli(&args).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    run.stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect()
}

async fn show(config: &ConfigFile, id: i64) -> Json {
    let run = cli(&[
        "dlq",
        "show",
        "--json",
        "--config",
        config.arg(),
        &id.to_string(),
    ])
    .await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    serde_json::from_str(&run.stdout).expect("json")
}

fn ids(messages: &[Json]) -> Vec<i64> {
    messages
        .iter()
        .map(|m| m["id"].as_i64().expect("id"))
        .collect()
}

async fn set_compatibility(stack: &Stack, subject: &str, level: &str) {
    let r = reqwest::Client::new()
        .put(format!("{}/config/{subject}", stack.registry_url))
        .header("Content-Type", "application/vnd.schemaregistry.v1+json")
        .body(format!("{{\"compatibility\":\"{level}\"}}"))
        .send()
        .await
        .expect("registry");
    assert!(
        r.status().is_success(),
        "PUT /config/{subject}: {}",
        r.status()
    );
}

/// Waits until the dead-letter topic holds `n` records.
async fn dead_letters(stack: &Stack, topic: &str, n: usize) -> Vec<support::Record> {
    support::read_topic(stack, topic, n, Duration::from_secs(300)).await
}

#[tokio::test]
async fn the_worked_example_replays_185_finds_12_applied_and_archives_3() {
    let stack = support::stack();
    let Items {
        source_db,
        target_db,
        source,
        config,
        connector,
        mut m,
        addr,
        ..
    } = items(
        &stack,
        "dlq_ex",
        "max_attempts = 3\ncheck_interval_secs = 0",
    )
    .await;

    // The target goes down; 200 changes follow. The first 3 are written
    // with the schema of before a breaking change (bigint → int, which
    // Avro cannot read as the new reader), the next 197 after it.
    target_down(&stack, &target_db).await;
    let topic = format!("{}.public.items", source_db.name);
    set_compatibility(&stack, &format!("{topic}-value"), "NONE").await;
    source
        .batch_execute(
            "UPDATE public.items SET qty = qty + 100 WHERE id IN (1, 2, 3);
             ALTER TABLE public.items ALTER COLUMN qty TYPE int;
             BEGIN;
             UPDATE public.items SET qty = qty + 1000 WHERE id IN (1, 2, 3);
             INSERT INTO public.items SELECT g, g % 7, g FROM generate_series(1001, 1194) g;
             COMMIT;",
        )
        .await
        .expect("changes");
    let dlq = format!("{}.dlq", source_db.name);
    let dead = dead_letters(&stack, &dlq, 200).await;
    assert_eq!(dead.len(), 200);
    for r in &dead {
        assert_eq!(
            r.header("pgcdc.failure.class"),
            Some("sink_unavailable"),
            "{:?}",
            r.headers
        );
        assert_eq!(r.header("pgcdc.attempts"), Some("3"));
        assert_eq!(r.header("pgcdc.origin.topic"), Some(topic.as_str()));
        assert!(r
            .header("pgcdc.origin.offset")
            .is_some_and(|o| o.parse::<i64>().is_ok()));
        assert!(r.header("pgcdc.position").is_some_and(|p| p.contains(':')));
        let first: i64 = r
            .header("pgcdc.first_failure_ms")
            .unwrap_or("x")
            .parse()
            .expect("first");
        let last: i64 = r
            .header("pgcdc.last_failure_ms")
            .unwrap_or("x")
            .parse()
            .expect("last");
        assert!(
            first <= last && last - first >= 1000,
            "{first} {last}: backoff between attempts"
        );
        assert!(r.value.is_some());
    }
    assert!(
        m.try_wait().expect("status").is_none(),
        "the materializer exited"
    );
    target_up(&stack, &target_db).await;

    // 12 of the inserts reach the target by another path (a delayed
    // producer retry: the same record again on the changelog topic).
    let applied_before = counter(&addr, "pgcdc_materialize_applied_total").await;
    let inserts: Vec<&support::Record> = dead[6..].iter().collect();
    for r in inserts.iter().take(12) {
        produce(
            &stack,
            &topic,
            r.key.as_deref(),
            r.value.as_deref().expect("value"),
        )
        .await;
    }
    wait_counter(
        &addr,
        "pgcdc_materialize_applied_total",
        Duration::from_secs(120),
        |v| v >= applied_before + 12.0,
    )
    .await;

    let quarantined = list(
        &config,
        &["--class", "sink_unavailable", "--state", "quarantined"],
    )
    .await;
    assert_eq!(quarantined.len(), 200);
    assert!(quarantined
        .iter()
        .all(|q| q["source_table"] == "public.items"));

    // Nothing moves without a person: a replay before approval does nothing.
    let run = cli(&[
        "dlq",
        "replay",
        "--all",
        "--actor",
        "alice",
        "--config",
        config.arg(),
    ])
    .await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stdout.contains("200 waiting for approve"),
        "{}",
        run.stdout
    );
    // The dry run says what would happen, and changes nothing.
    let run = cli(&[
        "dlq",
        "replay",
        "--all",
        "--dry-run",
        "--actor",
        "alice",
        "--config",
        config.arg(),
    ])
    .await;
    assert!(
        run.stdout.contains("200 messages, 12 already applied, 3 would be archived (schema incompatible), 185 would be replayed"),
        "{}",
        run.stdout
    );
    assert_eq!(list(&config, &["--state", "quarantined"]).await.len(), 200);

    for step in ["review", "approve"] {
        let run = cli(&[
            "dlq",
            step,
            "--class",
            "sink_unavailable",
            "--actor",
            "alice",
            "--config",
            config.arg(),
        ])
        .await;
        assert_eq!(run.code, 0, "{step}: {}", run.all_output());
    }
    let run = cli(&[
        "dlq",
        "replay",
        "--all",
        "--actor",
        "alice",
        "--config",
        config.arg(),
    ])
    .await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stdout.contains(
            "200 messages, 12 already applied, 3 archived (schema incompatible), 185 replayed"
        ),
        "{}",
        run.stdout
    );

    // The views equal the source, and nothing was applied twice: the
    // materializer applied exactly the 12, and a second replay has nothing
    // to do.
    wait_equal(&source, &target_db.url).await;
    assert_eq!(
        counter(&addr, "pgcdc_materialize_applied_total").await,
        applied_before + 12.0
    );
    let run = cli(&[
        "dlq",
        "replay",
        "--all",
        "--actor",
        "alice",
        "--config",
        config.arg(),
    ])
    .await;
    assert!(run.stdout.contains("0 messages"), "{}", run.stdout);

    let replayed = list(&config, &["--state", "replayed"]).await;
    let outcome = |o: &str| replayed.iter().filter(|m| m["outcome"] == o).count();
    assert_eq!((outcome("applied"), outcome("already_applied")), (185, 12));
    let archived = list(&config, &["--state", "archived"]).await;
    assert_eq!(archived.len(), 3);
    for a in &archived {
        let reason = a["archived_reason"].as_str().unwrap_or_default();
        assert!(
            reason.starts_with("schema incompatible: writer schema"),
            "{reason}"
        );
        assert!(reason.contains("no safe mapping"), "{reason}");
        // The three written before the change are the ones archived.
        assert!(a["position"].is_array());
    }
    // Each replayed message went through both checks, audited, once.
    let shown = show(&config, ids(&replayed)[0]).await;
    let path: Vec<&str> = shown["audit"]
        .as_array()
        .expect("audit")
        .iter()
        .map(|a| a["to"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        path,
        [
            "quarantined",
            "under_review",
            "schema_check",
            "idempotency_check",
            "replayed"
        ]
    );
    assert!(shown["audit"][1]["actor"] == "alice");

    finish(Some(m), connector, source_db, target_db).await;
}

/// Runs `pgcdc dlq ACTION` with the config and more arguments.
async fn dlq_cmd(config: &ConfigFile, action: &str, extra: &[&str]) -> support::Run {
    let mut args = vec!["dlq", action, "--config", config.arg()];
    args.extend_from_slice(extra);
    cli(&args).await
}

fn by_id(messages: &[Json], id: i64) -> &Json {
    messages
        .iter()
        .find(|m| m["id"] == id)
        .unwrap_or_else(|| panic!("no message {id}"))
}

async fn mirror_has(target_url: &str, sql: &str) -> bool {
    let target = support::connect(target_url).await;
    target
        .query_one(&format!("SELECT EXISTS ({sql})"), &[])
        .await
        .map(|r| r.get::<_, bool>(0))
        .unwrap_or(false)
}

#[tokio::test]
async fn poison_messages_are_classified_the_partition_flows_and_every_transition_is_checked() {
    let stack = support::stack();
    let Items {
        source_db,
        target_db,
        source,
        config,
        connector,
        m,
        ..
    } = items(
        &stack,
        "dlq_poison",
        "max_attempts = 3\ncheck_interval_secs = 0",
    )
    .await;
    let topic = format!("{}.public.items", source_db.name);
    let good = support::read_topic(&stack, &topic, 20, Duration::from_secs(60)).await[0]
        .value
        .clone()
        .expect("a changelog value");

    // Poison on the one partition, between real changes.
    let mut wrong_magic = good.clone();
    wrong_magic[0] = 1;
    let mut unknown_id = good.clone();
    unknown_id[1..5].copy_from_slice(&0x7fff_ff00u32.to_be_bytes());
    let truncated = good[..good.len() / 2].to_vec();
    let noise: Vec<u8> = (0u32..64)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 | 0x80)
        .collect();
    for poison in [&noise, &wrong_magic, &unknown_id, &truncated] {
        produce(&stack, &topic, Some(b"poison"), poison).await;
    }
    let target = support::connect(&target_db.url).await;
    target
        .batch_execute("ALTER TABLE mirror.items ADD CONSTRAINT not_666 CHECK (qty <> 666)")
        .await
        .expect("constraint");
    source
        .batch_execute("UPDATE public.items SET qty = 666 WHERE id = 5; INSERT INTO public.items VALUES (500, 1, 1)")
        .await
        .expect("changes");
    // The partition kept flowing past all of them.
    wait_for(
        "row 500 in the mirror",
        Duration::from_secs(120),
        async || mirror_has(&target_db.url, "SELECT 1 FROM mirror.items WHERE id = 500").await,
    )
    .await;
    let dlq = format!("{}.dlq", source_db.name);
    dead_letters(&stack, &dlq, 5).await;
    let all = list(&config, &[]).await;
    let classes: Vec<&str> = all
        .iter()
        .map(|m| m["class"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        classes,
        [
            "deserialization",
            "deserialization",
            "unknown_schema",
            "deserialization",
            "constraint_violation"
        ],
        "{all:?}"
    );
    let errors: Vec<&str> = all
        .iter()
        .map(|m| m["error"].as_str().unwrap_or_default())
        .collect();
    assert!(errors[0].contains("not 0x00"), "{}", errors[0]);
    assert!(errors[1].contains("magic byte 0x01"), "{}", errors[1]);
    assert!(
        errors[3].contains("avro") || errors[3].contains("decode"),
        "{}",
        errors[3]
    );
    assert!(all
        .iter()
        .all(|m| m["origin_offset"].is_i64() && m["state"] == "quarantined"));
    let [random, magic, unknown, truncated, constraint] = ids(&all)[..] else {
        panic!("{all:?}")
    };
    let (s, r) = (|id: i64| id.to_string(), "--reason");

    // Forbidden: archive or approve before review; a second review.
    let run = dlq_cmd(
        &config,
        "archive",
        &[&s(random), "--actor", "bob", r, "junk"],
    )
    .await;
    assert_eq!(run.code, 2, "{}", run.all_output());
    assert!(
        run.stderr.contains("reviewed before it is archived"),
        "{}",
        run.stderr
    );
    let run = dlq_cmd(&config, "approve", &[&s(random), "--actor", "bob"]).await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("review the message first"),
        "{}",
        run.stderr
    );
    let run = dlq_cmd(&config, "review", &["--actor", "bob"]).await;
    assert_ne!(run.code, 0, "a bulk review without a filter or --all");
    let run = dlq_cmd(&config, "review", &["--all", "--actor", "auto:me"]).await;
    assert_ne!(run.code, 0, "auto: is the policies' prefix");
    let run = dlq_cmd(&config, "review", &["--all", "--actor", "bob"]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    let run = dlq_cmd(&config, "review", &[&s(random), "--actor", "bob"]).await;
    assert_eq!(run.code, 2);
    assert!(
        run.stderr.contains("under_review → under_review"),
        "{}",
        run.stderr
    );

    // under_review → archived, with its reason; archived is final.
    let run = dlq_cmd(&config, "archive", &[&s(magic), "--actor", "bob"]).await;
    assert_ne!(run.code, 0, "archive without a reason");
    let run = dlq_cmd(
        &config,
        "archive",
        &[&s(magic), "--actor", "bob", r, "a test producer's garbage"],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    for action in ["archive", "review", "approve"] {
        let run = dlq_cmd(&config, action, &[&s(magic), "--actor", "bob", r, "again"]).await;
        assert_eq!(run.code, 2, "{action}: {}", run.all_output());
        assert!(
            run.stderr.contains("archived is final"),
            "{action}: {}",
            run.stderr
        );
    }
    let shown = show(&config, magic).await;
    assert_eq!(
        shown["message"]["archived_reason"],
        "a test producer's garbage"
    );
    let audit: Vec<(String, String, String)> = shown["audit"]
        .as_array()
        .expect("audit")
        .iter()
        .map(|a| {
            (
                a["to"].as_str().unwrap_or_default().to_string(),
                a["actor"].as_str().unwrap_or_default().to_string(),
                a["reason"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(audit[0].0, "quarantined");
    assert_eq!(audit[0].1, "auto:quarantine");
    assert_eq!(
        (audit[1].0.as_str(), audit[1].1.as_str()),
        ("under_review", "bob")
    );
    assert_eq!(
        (
            audit[2].0.as_str(),
            audit[2].1.as_str(),
            audit[2].2.as_str()
        ),
        ("archived", "bob", "a test producer's garbage")
    );

    // The schema check archives what can never be read, with a note.
    let run = dlq_cmd(
        &config,
        "approve",
        &[
            &s(random),
            &s(unknown),
            &s(truncated),
            &s(constraint),
            "--actor",
            "bob",
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    let run = dlq_cmd(
        &config,
        "replay",
        &[&s(random), &s(unknown), &s(truncated), "--actor", "bob"],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stdout
            .contains("3 messages, 0 already applied, 3 archived"),
        "{}",
        run.stdout
    );
    let now = list(&config, &[]).await;
    let reason = |id| {
        by_id(&now, id)["archived_reason"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    assert!(
        reason(random).contains("not Confluent-framed"),
        "{}",
        reason(random)
    );
    assert!(
        reason(unknown).contains("unknown to the registry"),
        "{}",
        reason(unknown)
    );
    assert!(
        reason(truncated).contains("does not decode"),
        "{}",
        reason(truncated)
    );
    // The replay must not take an archived message back.
    let run = dlq_cmd(&config, "replay", &[&s(random), "--actor", "bob"]).await;
    assert!(
        run.stdout.contains("archived already; nothing to do"),
        "{}",
        run.stdout
    );

    // The target still refuses the change: it fails again and comes back
    // as a new quarantine linked to the old one.
    let run = dlq_cmd(&config, "replay", &[&s(constraint), "--actor", "bob"]).await;
    assert!(run.stdout.contains("1 failed again"), "{}", run.stdout);
    dead_letters(&stack, &dlq, 6).await;
    let now = list(&config, &[]).await;
    assert_eq!(by_id(&now, constraint)["outcome"], "refailed");
    let again = now
        .iter()
        .find(|m| m["replay_of"] == constraint)
        .expect("the new quarantine");
    assert_eq!(again["class"], "constraint_violation");
    assert_eq!(again["state"], "quarantined");
    // Fixed: the new one replays.
    target
        .batch_execute("ALTER TABLE mirror.items DROP CONSTRAINT not_666")
        .await
        .expect("drop constraint");
    let again = again["id"].as_i64().expect("id");
    for action in ["review", "approve", "replay"] {
        let run = dlq_cmd(&config, action, &[&s(again), "--actor", "bob"]).await;
        assert_eq!(run.code, 0, "{action}: {}", run.all_output());
    }
    wait_equal(&source, &target_db.url).await;
    // replayed is final too.
    let run = dlq_cmd(
        &config,
        "archive",
        &[&s(again), "--actor", "bob", r, "late"],
    )
    .await;
    assert_eq!(run.code, 2);
    assert!(run.stderr.contains("replayed is final"), "{}", run.stderr);

    // Health: one replay of two succeeded; a message left open is a slow
    // leak two days on, although depth does not move.
    produce(&stack, &topic, None, &noise).await;
    dead_letters(&stack, &dlq, 7).await;
    let stats = |at: Option<String>| {
        let config = &config;
        async move {
            let mut args = vec!["--json"];
            if let Some(at) = at.as_deref() {
                args.extend(["--at", at]);
            }
            let run = dlq_cmd(config, "stats", &args).await;
            assert_eq!(run.code, 0, "{}", run.all_output());
            serde_json::from_str::<Json>(&run.stdout).expect("stats json")
        }
    };
    let h = stats(None).await;
    assert_eq!(h["replays"]["success_rate"], 0.5);
    assert_eq!(h["open"], 1);
    assert_eq!(h["depth"]["archived"]["deserialization"], 3);
    let warnings = |h: &Json| h["warnings"].as_array().cloned().unwrap_or_default();
    assert!(!warnings(&h)
        .iter()
        .any(|w| w.as_str().unwrap_or_default().contains("slow leak")));
    let later = crate::support::rfc3339_in(Duration::from_secs(2 * 86_400));
    let h = stats(Some(later.clone())).await;
    assert_eq!(h["open"], 1, "depth is flat");
    assert!(
        warnings(&h)
            .iter()
            .any(|w| w.as_str().unwrap_or_default().starts_with("slow leak")),
        "{h}"
    );
    let run = dlq_cmd(&config, "stats", &["--at", &later, "--check"]).await;
    assert_eq!(run.code, 2, "{}", run.all_output());

    finish(Some(m), connector, source_db, target_db).await;
}

#[tokio::test]
async fn an_auto_replay_policy_keeps_to_its_class_and_window_and_still_checks() {
    let stack = support::stack();
    let Items {
        source_db,
        target_db,
        source,
        base,
        config,
        connector,
        m,
        addr,
    } = items(
        &stack,
        "dlq_auto",
        "max_attempts = 3\ncheck_interval_secs = 0",
    )
    .await;
    let dlq = format!("{}.dlq", source_db.name);
    let topic = format!("{}.public.items", source_db.name);

    // An outage before the window, then one inside it.
    target_down(&stack, &target_db).await;
    source
        .batch_execute("UPDATE public.items SET qty = qty + 10 WHERE id BETWEEN 1 AND 5")
        .await
        .expect("update");
    dead_letters(&stack, &dlq, 5).await;
    target_up(&stack, &target_db).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let from = support::rfc3339_in(Duration::ZERO);
    target_down(&stack, &target_db).await;
    source
        .batch_execute("UPDATE public.items SET qty = qty + 10 WHERE id BETWEEN 6 AND 10")
        .await
        .expect("update");
    let dead = dead_letters(&stack, &dlq, 10).await;
    target_up(&stack, &target_db).await;
    // Inside the window, but another class.
    let target = support::connect(&target_db.url).await;
    target
        .batch_execute("ALTER TABLE mirror.items ADD CONSTRAINT not_666 CHECK (qty <> 666)")
        .await
        .expect("constraint");
    source
        .batch_execute("UPDATE public.items SET qty = 666 WHERE id = 11")
        .await
        .expect("update");
    dead_letters(&stack, &dlq, 11).await;
    // One in the window reaches the target by another path.
    let applied_before = counter(&addr, "pgcdc_materialize_applied_total").await;
    produce(
        &stack,
        &topic,
        dead[5].key.as_deref(),
        dead[5].value.as_deref().expect("value"),
    )
    .await;
    wait_counter(
        &addr,
        "pgcdc_materialize_applied_total",
        Duration::from_secs(120),
        |v| v >= applied_before + 1.0,
    )
    .await;

    let until = support::rfc3339_in(Duration::from_secs(3600));
    let with_replay = ConfigFile::write(&format!(
        "{base}\n[dlq.policies.maint]\naction = \"replay\"\nclasses = [\"sink_unavailable\"]\nfrom = \"{from}\"\nuntil = \"{until}\"\n"
    ));
    // A round that approved one and stopped before replaying it (the
    // registry down, a crash): the next round takes it up again.
    let before = list(&config, &[]).await;
    let interrupted = before[6]["id"].as_i64().expect("id");
    target
        .execute(
            "WITH m AS (UPDATE pgcdc_dlq.messages SET state = 'schema_check' WHERE id = $1 RETURNING id)
             INSERT INTO pgcdc_dlq.audit (message_id, from_state, to_state, actor, reason)
             SELECT id, f, t, 'auto:maint', 'an interrupted round'
             FROM m, (VALUES ('quarantined', 'under_review'), ('under_review', 'schema_check')) v (f, t)",
            &[&interrupted],
        )
        .await
        .expect("interrupt");
    let run = dlq_cmd(&with_replay, "enforce", &[]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stdout.contains(
            "5 messages, 1 already applied, 0 archived (schema incompatible), 4 replayed"
        ),
        "{}",
        run.stdout
    );
    let all = list(&config, &[]).await;
    assert_eq!(all.len(), 11);
    let states: Vec<&str> = all
        .iter()
        .map(|m| m["state"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(&states[..5], ["quarantined"; 5], "outside the window");
    assert_eq!(&states[5..10], ["replayed"; 5], "inside the window");
    assert_eq!(states[10], "quarantined", "another class");
    assert_eq!(
        all[5]["outcome"], "already_applied",
        "the one applied meanwhile"
    );
    assert!(all[6..10].iter().all(|m| m["outcome"] == "applied"));
    // Applied once each: the materializer the one, the policy the four.
    assert_eq!(
        counter(&addr, "pgcdc_materialize_applied_total").await,
        applied_before + 1.0
    );
    assert!(
        mirror_has(
            &target_db.url,
            "SELECT 1 FROM mirror.items WHERE id BETWEEN 6 AND 10 HAVING sum(qty) = 6 + 7 + 8 + 9 + 10 + 50"
        )
        .await
    );
    assert!(
        mirror_has(
            &target_db.url,
            "SELECT 1 FROM mirror.items WHERE id BETWEEN 1 AND 5 HAVING sum(qty) = 1 + 2 + 3 + 4 + 5"
        )
        .await,
        "a message outside the window was replayed"
    );
    // The policy approved; both checks still ran, under its name.
    let shown = show(&config, all[5]["id"].as_i64().expect("id")).await;
    let audit = shown["audit"].as_array().expect("audit");
    let path: Vec<&str> = audit
        .iter()
        .map(|a| a["to"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        path,
        [
            "quarantined",
            "under_review",
            "schema_check",
            "idempotency_check",
            "replayed"
        ]
    );
    assert!(
        audit[1..].iter().all(|a| a["actor"] == "auto:maint"),
        "{audit:?}"
    );

    // An archive cutoff takes what nobody addressed, with its reason.
    let with_archive = ConfigFile::write(&format!(
        "{base}\n[dlq.policies.stale]\naction = \"archive\"\nafter = \"1s\"\n"
    ));
    let run = dlq_cmd(&with_archive, "enforce", &["--dry-run"]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert_eq!(
        list(&config, &["--state", "quarantined"]).await.len(),
        6,
        "a dry run changed something"
    );
    let run = dlq_cmd(&with_archive, "enforce", &[]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    let archived = list(&config, &["--state", "archived"]).await;
    assert_eq!(archived.len(), 6);
    assert!(archived
        .iter()
        .all(|m| m["archived_reason"] == "not addressed within 1s (policy stale)"));

    // A replay policy must be narrow: classes and a window.
    let loose = ConfigFile::write(&format!(
        "{base}\n[dlq.policies.loose]\naction = \"replay\"\n"
    ));
    let run = cli(&["validate", "--config", loose.arg()]).await;
    assert_eq!(run.code, 2, "{}", run.all_output());
    assert!(
        run.stderr.contains("dlq.policies.loose.classes"),
        "{}",
        run.stderr
    );
    assert!(run.stderr.contains("needs a window"), "{}", run.stderr);

    finish(Some(m), connector, source_db, target_db).await;
}

#[tokio::test]
async fn the_connector_quarantines_an_event_over_the_size_limit_in_parts_and_it_replays() {
    let stack = support::stack();
    let (source_db, target_db, source) = databases(
        &stack,
        "dlq_big",
        "CREATE TABLE public.docs (id bigint PRIMARY KEY, body text NOT NULL);
         INSERT INTO public.docs VALUES (1, 'small');",
    )
    .await;
    let config = single_table(
        &stack,
        &source_db,
        &target_db,
        "public.docs",
        "max_message_bytes = 20000\n",
    );
    let connector = ConnectorProcess::start(&config);
    let m = materializer(&config, &[], &[]);
    let has = |id: i64| {
        let url = target_db.url.clone();
        async move { mirror_has(&url, &format!("SELECT 1 FROM mirror.docs WHERE id = {id}")).await }
    };
    wait_for("doc 1", Duration::from_secs(120), async || has(1).await).await;
    // 60 kB of text (md5s do not compress away) between two small rows.
    source
        .batch_execute(
            "INSERT INTO public.docs SELECT 2, string_agg(md5(g::text), '') FROM generate_series(1, 1875) g;
             INSERT INTO public.docs VALUES (3, 'after');",
        )
        .await
        .expect("insert");
    // The stream goes on past it.
    wait_for("doc 3", Duration::from_secs(120), async || has(3).await).await;
    assert!(!has(2).await);
    let dlq = format!("{}.dlq", source_db.name);
    let parts = support::read_topic_until(&stack, &dlq, Duration::from_secs(120), |r| {
        r.first()
            .and_then(|p| p.header("pgcdc.part"))
            .and_then(|p| p.split_once('/'))
            .and_then(|(_, n)| n.parse::<usize>().ok())
            .is_some_and(|n| r.len() >= n)
    })
    .await;
    assert!(parts.len() > 1, "not split: {} records", parts.len());
    assert!(parts
        .iter()
        .all(|p| p.header("pgcdc.failure.class") == Some("oversized")));
    assert!(parts
        .iter()
        .all(|p| p.value.as_ref().is_some_and(|v| v.len() < 20000)));
    assert_eq!(
        parts[0]
            .header("pgcdc.part")
            .map(|p| p.ends_with(&format!("/{}", parts.len()))),
        Some(true)
    );
    assert!(parts[0]
        .header("pgcdc.origin.lsn")
        .is_some_and(|l| l.contains('/')));
    // The store holds it whole, once.
    let all = list(&config, &[]).await;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(all[0]["class"], "oversized");
    assert!(all[0]["origin_offset"].is_null() && all[0]["position"].is_array());
    let id = all[0]["id"].as_i64().expect("id").to_string();
    for action in ["review", "approve", "replay"] {
        let run = dlq_cmd(&config, action, &[&id, "--actor", "carol"]).await;
        assert_eq!(run.code, 0, "{action}: {}", run.all_output());
        if action == "replay" {
            assert!(
                run.stdout.contains(
                    "1 messages, 0 already applied, 0 archived (schema incompatible), 1 replayed"
                ),
                "{}",
                run.stdout
            );
        }
    }
    let target = support::connect(&target_db.url).await;
    let len: i32 = target
        .query_one("SELECT length(body) FROM mirror.docs WHERE id = 2", &[])
        .await
        .expect("doc 2 replayed")
        .get(0);
    assert_eq!(len, 1875 * 32);
    finish(Some(m), connector, source_db, target_db).await;
}

#[tokio::test]
async fn the_connector_quarantines_a_value_it_cannot_encode_with_the_row_as_text() {
    let stack = support::stack();
    // Without a primary key under REPLICA IDENTITY FULL every column is
    // the key, and a key cannot hold a NULL.
    let (source_db, target_db, source) = databases(
        &stack,
        "dlq_enc",
        "CREATE TABLE public.notes (a int, b text);
         ALTER TABLE public.notes REPLICA IDENTITY FULL;",
    )
    .await;
    let config = single_table(&stack, &source_db, &target_db, "public.notes", "");
    let connector = ConnectorProcess::start(&config);
    let slot = source_db.name.clone();
    support::wait_streaming(&source, &slot).await;
    source
        .batch_execute("INSERT INTO public.notes VALUES (1, 'x'), (2, NULL), (3, 'y')")
        .await
        .expect("insert");
    let topic = format!("{}.public.notes", source_db.name);
    let events = support::read_topic(&stack, &topic, 2, Duration::from_secs(120)).await;
    assert_eq!(events.len(), 2, "the rows around it are produced");
    let dlq = format!("{}.dlq", source_db.name);
    let dead = dead_letters(&stack, &dlq, 1).await;
    let r = &dead[0];
    assert_eq!(r.header("pgcdc.failure.class"), Some("unsupported_value"));
    let error = r.header("pgcdc.failure.error").unwrap_or_default();
    assert!(
        error.contains("column b") && error.contains("NULL"),
        "{error}"
    );
    assert!(!error.contains("'x'"), "no row values in the error");
    assert!(r
        .header("pgcdc.origin.lsn")
        .is_some_and(|l| l.contains('/')));
    let payload: Json = serde_json::from_slice(r.value.as_deref().expect("payload")).expect("json");
    assert_eq!(payload["table"], "public.notes");
    assert_eq!(payload["op"], "c");
    assert_eq!(payload["after"]["values"]["a"], "2");
    assert!(payload["after"]["values"]["b"].is_null());
    // The slot moves past it: the quarantine was acknowledged.
    let lsn = support::insert_lsn(&source).await;
    source
        .batch_execute("INSERT INTO public.notes VALUES (4, 'z')")
        .await
        .expect("insert");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !support::confirmed_reached(&source, &slot, &lsn).await {
        assert!(
            std::time::Instant::now() < deadline,
            "the slot did not move past {lsn}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let all = list(&config, &[]).await;
    assert_eq!(all.len(), 1);
    assert_eq!(all[0]["source_table"], "public.notes");
    assert!(all[0]["schema_id"].is_null(), "not Avro: the row as text");
    // A key change is a delete and a create at one position: both kept.
    source
        .batch_execute("UPDATE public.notes SET a = 20 WHERE a = 2")
        .await
        .expect("update");
    let dead = dead_letters(&stack, &dlq, 3).await;
    let ops: Vec<&str> = dead[1..]
        .iter()
        .map(|r| r.header("pgcdc.origin.op").unwrap_or_default())
        .collect();
    assert_eq!(ops, ["d", "c"]);
    assert_eq!(
        dead[1].header("pgcdc.position"),
        dead[2].header("pgcdc.position")
    );
    assert_eq!(
        list(&config, &[]).await.len(),
        3,
        "a quarantine was recorded over another"
    );
    finish(None, connector, source_db, target_db).await;
}

#[tokio::test]
async fn a_value_refused_because_the_writer_type_changed_is_schema_incompatible() {
    let stack = support::stack();
    let Items {
        source_db,
        target_db,
        source,
        connector,
        m,
        ..
    } = items(&stack, "dlq_type", "check_interval_secs = 0").await;
    let topic = format!("{}.public.items", source_db.name);
    set_compatibility(&stack, &format!("{topic}-value"), "NONE").await;
    // qty becomes text in the source; the mirror's column stays bigint.
    source
        .batch_execute(
            "ALTER TABLE public.items ALTER COLUMN qty TYPE text;
             UPDATE public.items SET qty = '12' WHERE id = 1;
             UPDATE public.items SET qty = 'twelve' WHERE id = 2;",
        )
        .await
        .expect("changes");
    let dlq = format!("{}.dlq", source_db.name);
    let dead = dead_letters(&stack, &dlq, 1).await;
    assert_eq!(
        dead[0].header("pgcdc.failure.class"),
        Some("schema_incompatible"),
        "{:?}",
        dead[0].headers
    );
    let error = dead[0].header("pgcdc.failure.error").unwrap_or_default();
    assert!(error.contains("has text, the mirror bigint"), "{error}");
    // A value the mirror can take still applies.
    wait_for("qty 12", Duration::from_secs(60), async || {
        mirror_has(
            &target_db.url,
            "SELECT 1 FROM mirror.items WHERE id = 1 AND qty = 12",
        )
        .await
    })
    .await;
    finish(Some(m), connector, source_db, target_db).await;
}

#[tokio::test]
async fn a_safe_mapping_transforms_what_the_reader_could_not_read_and_without_it_is_archived() {
    let stack = support::stack();
    let Items {
        source_db,
        target_db,
        source,
        base,
        config,
        connector,
        m,
        ..
    } = items(
        &stack,
        "dlq_map",
        "max_attempts = 2\ncheck_interval_secs = 0",
    )
    .await;
    target_down(&stack, &target_db).await;
    source
        .batch_execute("UPDATE public.items SET qty = 500 WHERE id IN (1, 2)")
        .await
        .expect("update");
    let dlq = format!("{}.dlq", source_db.name);
    dead_letters(&stack, &dlq, 2).await;
    target_up(&stack, &target_db).await;

    // The reader moves on: another producer's version of the subject
    // requires `region`, which the quarantined records' writer lacks.
    let subject = format!("{}.public.items-value", source_db.name);
    set_compatibility(&stack, &subject, "NONE").await;
    let mut schema: Json =
        serde_json::from_str(&support::latest_schema(&stack, &subject).await).expect("schema json");
    for f in schema["fields"].as_array_mut().expect("fields") {
        if f["name"] == "before" {
            let row = f["type"]
                .as_array_mut()
                .and_then(|b| b.iter_mut().find(|b| b["type"] == "record"))
                .expect("row record");
            row["fields"]
                .as_array_mut()
                .expect("row fields")
                .push(serde_json::json!({"name": "region", "type": "string"}));
        }
    }
    support::register_schema(&stack, &subject, &schema.to_string()).await;

    let all = list(&config, &[]).await;
    let [first, second] = ids(&all)[..] else {
        panic!("{all:?}")
    };
    let (first, second) = (first.to_string(), second.to_string());
    for action in ["review", "approve"] {
        let run = dlq_cmd(&config, action, &["--all", "--actor", "dana"]).await;
        assert_eq!(run.code, 0, "{}", run.all_output());
    }
    // No mapping: archived with the reason.
    let run = dlq_cmd(&config, "replay", &[&first, "--actor", "dana"]).await;
    assert!(
        run.stdout.contains("1 archived (schema incompatible)"),
        "{}",
        run.stdout
    );
    let shown = show(&config, first.parse().expect("id")).await;
    let reason = shown["message"]["archived_reason"]
        .as_str()
        .unwrap_or_default();
    assert!(
        reason.contains("region") && reason.contains("no safe mapping"),
        "{reason}"
    );
    // With a default for the new column: transformed and replayed.
    let mapped = ConfigFile::write(&format!(
        "{base}\n[dlq.mappings.\"public.items\"]\ndefaults = {{ region = \"eu\" }}\n"
    ));
    let run = dlq_cmd(&mapped, "replay", &[&second, "--actor", "dana"]).await;
    assert!(run.stdout.contains("1 replayed"), "{}", run.stdout);
    assert!(
        run.stdout.contains("transformed by dlq.mappings"),
        "{}",
        run.stdout
    );
    assert!(
        mirror_has(
            &target_db.url,
            "SELECT 1 FROM mirror.items WHERE id = 2 AND qty = 500 AND region = 'eu'"
        )
        .await
    );
    assert!(
        mirror_has(
            &target_db.url,
            "SELECT 1 FROM mirror.items WHERE id = 1 AND qty = 1"
        )
        .await,
        "the archived one was applied"
    );
    let shown = show(&config, second.parse().expect("id")).await;
    assert!(
        shown["message"]["note"]
            .as_str()
            .unwrap_or_default()
            .contains("region defaulted"),
        "{shown}"
    );
    finish(Some(m), connector, source_db, target_db).await;
}

#[tokio::test]
async fn a_compacted_dead_letter_topic_is_refused() {
    let stack = support::stack();
    let (source_db, target_db, _source) = databases(&stack, "dlq_compact", ITEMS).await;
    let config = single_table(&stack, &source_db, &target_db, "public.items", "");
    // Made by hand (or by an older pgcdc) with compaction: records of one
    // key would replace each other.
    support::create_topic(
        &stack,
        &format!("{}.dlq", source_db.name),
        &[("cleanup.policy", "compact")],
    )
    .await;
    let run = cli(&["dlq", "list", "--config", config.arg()]).await;
    assert_eq!(run.code, 1, "{}", run.all_output());
    assert!(
        run.stderr.contains("cleanup.policy=compact") && run.stderr.contains("retention.ms=-1"),
        "{}",
        run.stderr
    );
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test]
async fn a_later_change_leaving_a_toasted_column_unchanged_waits_behind_the_dead_letter() {
    let stack = support::stack();
    let big = |seed: &str| {
        format!("(SELECT string_agg(md5('{seed}' || g), '') FROM generate_series(1, 1875) g)")
    };
    let (source_db, target_db, source) = databases(
        &stack,
        "dlq_toast",
        &format!(
            "CREATE TABLE public.docs (id bigint PRIMARY KEY, title text, body text);
             INSERT INTO public.docs VALUES (1, 't0', {});",
            big("a")
        ),
    )
    .await;
    let toml = support::pipeline_toml(&stack, &source_db.url, &source_db.name, &["public.docs"]);
    // The rounds on (so keys are held) but not due during the test.
    let config = ConfigFile::write(&format!(
        "{toml}[target]\nurl = \"{}\"\n[dlq]\nmax_attempts = 2\ncheck_interval_secs = 3600\n",
        target_db.url
    ));
    let connector = ConnectorProcess::start(&config);
    let m = materializer(&config, &[], &[]);
    let same = "SELECT 1 FROM mirror.docs WHERE id = 1";
    wait_for("doc 1", Duration::from_secs(120), async || {
        mirror_has(&target_db.url, same).await
    })
    .await;
    target_down(&stack, &target_db).await;
    source
        .batch_execute(&format!(
            "UPDATE public.docs SET body = {} WHERE id = 1",
            big("b")
        ))
        .await
        .expect("update body");
    let dlq = format!("{}.dlq", source_db.name);
    dead_letters(&stack, &dlq, 1).await;
    target_up(&stack, &target_db).await;
    // Leaves the TOASTed body unchanged: applied now, it would keep the
    // mirror's old body, and the replay would find its key already past.
    source
        .batch_execute("UPDATE public.docs SET title = 't1' WHERE id = 1")
        .await
        .expect("update title");
    let dead = dead_letters(&stack, &dlq, 2).await;
    let error = dead[1].header("pgcdc.failure.error").unwrap_or_default();
    assert!(error.contains("held behind an open dead letter"), "{error}");
    assert!(
        mirror_has(
            &target_db.url,
            "SELECT 1 FROM mirror.docs WHERE id = 1 AND title = 't0'"
        )
        .await
    );
    let all = list(&config, &[]).await;
    let [body, title] = ids(&all)[..] else {
        panic!("{all:?}")
    };
    for action in ["review", "approve", "replay"] {
        if action == "replay" {
            // Alone, the later one waits for the earlier one of its key.
            let run = dlq_cmd(&config, "replay", &[&title.to_string(), "--actor", "erin"]).await;
            assert!(
                run.stdout.contains(&format!("waits for message {body}")),
                "{}",
                run.stdout
            );
            assert!(run.stdout.contains("1 waiting"), "{}", run.stdout);
        }
        let run = dlq_cmd(&config, action, &["--all", "--actor", "erin"]).await;
        assert_eq!(run.code, 0, "{action}: {}", run.all_output());
        if action == "replay" {
            assert!(
                run.stdout.contains(
                    "2 messages, 0 already applied, 0 archived (schema incompatible), 2 replayed"
                ),
                "{}",
                run.stdout
            );
        }
    }
    let want: String = source
        .query_one(
            "SELECT title || md5(body) FROM public.docs WHERE id = 1",
            &[],
        )
        .await
        .expect("source")
        .get(0);
    let target = support::connect(&target_db.url).await;
    let got: String = target
        .query_one(
            "SELECT title || md5(body) FROM mirror.docs WHERE id = 1",
            &[],
        )
        .await
        .expect("mirror")
        .get(0);
    assert_eq!(got, want, "the mirror kept a stale body");
    finish(Some(m), connector, source_db, target_db).await;
}

#[tokio::test]
async fn dead_letter_alerts_fire_on_a_burst_and_on_an_overdue_message() {
    let stack = support::stack();
    let Items {
        source_db,
        target_db,
        config,
        connector,
        m,
        addr,
        ..
    } = items(
        &stack,
        "dlq_alerts",
        "check_interval_secs = 1\n[dlq.health]\nmin_arrivals = 3\nmax_oldest_age = \"6s\"",
    )
    .await;
    // Calm first: both alerts exported, neither firing.
    wait_for(
        "both dead-letter alerts at 0",
        Duration::from_secs(60),
        async || {
            alert(&addr, "dlq_arrival_burst").await == Some(0.0)
                && alert(&addr, "dlq_oldest_overdue").await == Some(0.0)
        },
    )
    .await;
    let topic = format!("{}.public.items", source_db.name);
    for i in 0..3u8 {
        produce(&stack, &topic, Some(b"poison"), &[0xff, i, 0x13, 0x37]).await;
    }
    // Three arrivals in the last hour on a baseline of 0: a burst. The
    // oldest is young yet, so not overdue.
    wait_for(
        "dlq_arrival_burst firing",
        Duration::from_secs(60),
        async || alert(&addr, "dlq_arrival_burst").await == Some(1.0),
    )
    .await;
    let oldest_age = counter(&addr, "pgcdc_dlq_oldest_open_age_seconds").await;
    if oldest_age < 5.0 {
        assert_eq!(alert(&addr, "dlq_oldest_overdue").await, Some(0.0));
    }
    // Nobody addresses them: after 6 s the oldest is overdue.
    wait_for(
        "dlq_oldest_overdue firing",
        Duration::from_secs(60),
        async || alert(&addr, "dlq_oldest_overdue").await == Some(1.0),
    )
    .await;
    // The status (sampled every 2 s) says the same.
    let firing = |status: &Json| -> Vec<String> {
        status["alerts"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|a| a["firing"] == true)
                    .filter_map(|a| a["alert"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut status = Json::Null;
    wait_for(
        "both alerts in /status",
        Duration::from_secs(30),
        async || {
            let (_, body) = crate::operator::http_get(&addr, "/status").await;
            status = serde_json::from_str(&body).unwrap_or(Json::Null);
            firing(&status) == ["dlq_arrival_burst", "dlq_oldest_overdue"]
        },
    )
    .await;
    assert_eq!(status["dead_letters"]["open"], 3.0, "{status}");
    // No read model asks for a reach here: that alert stays quiet.
    assert_eq!(alert(&addr, "rebuild_reach_short").await, Some(0.0));
    // Archived, they stop counting: both alerts clear.
    for id in ids(&list(&config, &[]).await) {
        let s = id.to_string();
        let run = dlq_cmd(
            &config,
            "review",
            &[&s, "--actor", "ops", "--reason", "noise"],
        )
        .await;
        assert_eq!(run.code, 0, "{}", run.all_output());
        let run = dlq_cmd(
            &config,
            "archive",
            &[&s, "--actor", "ops", "--reason", "noise"],
        )
        .await;
        assert_eq!(run.code, 0, "{}", run.all_output());
    }
    wait_for(
        "dlq_oldest_overdue cleared",
        Duration::from_secs(60),
        async || alert(&addr, "dlq_oldest_overdue").await == Some(0.0),
    )
    .await;
    finish(Some(m), connector, source_db, target_db).await;
}
