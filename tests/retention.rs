//! Rebuild reach (`pgcdc retention`) and `pgcdc rebuild` against the real
//! broker: an untouched log, a log that retention cut into, a compacted
//! log, and the slot's WAL piling up while the connector is stopped.

use std::time::Duration;

use serde_json::Value as Json;

use crate::materialize::{self as mat, checksum, differences};
use crate::support::{self, ConfigFile, ConnectorProcess, Run, ScratchCluster};
use pgcdc::sink::CreateClient as _;
use pgcdc::snapshot_marker::{self, Kind, Phase};

/// A read model declared after the fact: totals per order status.
const ORDER_STATUS: &str = r#"
[read_models.order_status]
table = "read_models.order_status"
key = ["status"]
query = """
SELECT o.status, count(*) AS orders, sum(o.amount) AS amount
FROM mirror.orders o WHERE o.status = ANY($1) GROUP BY o.status
"""
sources = [{ table = "public.orders", key_columns = ["status"] }]
"#;

/// `pgcdc retention --json`, parsed.
async fn report(config: &ConfigFile, extra: &[&str]) -> (Run, Json) {
    let mut rest = vec!["--json"];
    rest.extend_from_slice(extra);
    let run = pgcdc_on(config, "retention", &rest).await;
    let json: Json = serde_json::from_str(&run.stdout).unwrap_or_else(|e| {
        panic!(
            "retention --json printed no JSON ({e}): {}",
            run.all_output()
        )
    });
    (run, json)
}

/// Validates a report against the schema `pgcdc retention --json-schema`
/// prints, with Python's `jsonschema` (a validator that is not ours).
async fn assert_valid(report: &str) {
    let schema = support::pgcdc(&["retention", "--json-schema"]).await;
    assert_eq!(schema.code, 0, "{}", schema.all_output());
    let dir = tempfile::tempdir().expect("temp dir");
    let (schema_path, doc_path) = (
        dir.path().join("schema.json"),
        dir.path().join("report.json"),
    );
    std::fs::write(&schema_path, &schema.stdout).expect("write schema");
    std::fs::write(&doc_path, report).expect("write report");
    let python = std::env::var("PGCDC_PYTHON").expect("PGCDC_PYTHON: run through scripts/test");
    let script = support::repo_file("tests/interop/validate_json.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .arg(&schema_path)
        .arg(&doc_path)
        .output()
        .await
        .expect("run the validator");
    assert!(
        out.status.success(),
        "the report does not match its schema:\n{}{}\n{report}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read_model<'a>(report: &'a Json, name: &str) -> &'a Json {
    report["read_models"]
        .as_array()
        .and_then(|rms| rms.iter().find(|r| r["name"] == name))
        .unwrap_or_else(|| panic!("no read model {name} in {report}"))
}

fn topic<'a>(report: &'a Json, name: &str) -> &'a Json {
    report["topics"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["topic"] == name))
        .unwrap_or_else(|| panic!("no topic {name} in {report}"))
}

/// `pgcdc COMMAND --config FILE REST...`.
async fn pgcdc_on(config: &ConfigFile, command: &str, rest: &[&str]) -> Run {
    let mut args = vec![command, "--config", config.arg()];
    args.extend_from_slice(rest);
    support::pgcdc(&args).await
}

#[tokio::test]
async fn an_untouched_log_has_full_history_since_the_snapshot_and_rebuilds_a_read_model_added_later(
) {
    let stack = support::stack();
    let (source_db, target_db, source, target) =
        mat::databases(&stack, "ret_full", 200, 1000).await;
    let base = mat::pipeline(&stack, &source_db, &target_db);
    // Checked every second by the materializer; one requirement met, one not.
    let with_requirements = format!("{base}\n[retention]\ncheck_interval_secs = 1\n")
        .replace(
            "[read_models.order_summary]\n",
            "[read_models.order_summary]\nrequire_reach = \"1d\"\n",
        )
        .replace(
            "[read_models.customer_stats]\n",
            "[read_models.customer_stats]\nrequire_reach = \"current\"\n",
        );
    let config = ConfigFile::write(&with_requirements);
    let parsed = pgcdc::config::Config::load(&config.path).expect("config");
    let connector = ConnectorProcess::start(&config);
    let metrics = format!("127.0.0.1:{}", support::free_port());
    let log_dir = tempfile::tempdir().expect("temp dir");
    let log_path = log_dir.path().join("materialize.log");
    let materializer = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
        .args([
            "materialize",
            "--config",
            config.arg(),
            "--http-addr",
            &metrics,
        ])
        .stderr(std::fs::File::create(&log_path).expect("log file"))
        .kill_on_drop(true)
        .spawn()
        .expect("spawn pgcdc materialize");
    mat::workload(&source, 1500, 0x51ed_2701).await;
    mat::wait_converged(&source, &target).await;

    // The reach: full history since the initial snapshot's consistent point.
    let marker = support::initial_marker(&parsed).await;
    assert_eq!(marker.phase, Phase::Completed);
    let since = marker
        .consistent_ts_ms
        .expect("the marker records its consistent time");
    let (run, json) = report(&config, &["--require", "current"]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert_valid(&run.stdout).await;
    for name in ["order_summary", "customer_stats"] {
        let rm = read_model(&json, name);
        assert_eq!(rm["reach"]["kind"], "full_history", "{rm}");
        assert_eq!(rm["reach"]["since_ms"], since, "{rm}");
        assert_eq!(
            rm["reach"]["since_lsn"].as_str(),
            marker.consistent_point.as_deref()
        );
        assert_eq!(rm["requirement"]["met"], true);
    }
    for table in ["customers", "orders"] {
        let t = topic(&json, &format!("{}.public.{table}", source_db.name));
        assert_eq!(t["begins_with_complete_snapshot"], true, "{t}");
        assert_eq!(t["snapshot"]["kind"], "initial");
        assert_eq!(t["config"]["cleanup_policy"], "delete");
        let parts = t["partitions"].as_array().expect("partitions");
        assert_eq!(parts.len(), 3);
        for p in parts {
            assert_eq!(p["earliest_offset"], 0, "{p}");
            assert!(p["latest_offset"].as_i64() > Some(0), "{p}");
            assert!(
                p["earliest_timestamp_ms"].as_i64() >= Some(marker.ts_ms - 120_000),
                "{p}"
            );
        }
    }
    assert_eq!(json["slot"]["exists"], true);
    assert_eq!(json["slot"]["active"], true);

    // Requirements: exit 2 naming the shortfall when the reach is shorter.
    let short = pgcdc_on(&config, "retention", &["--require", "30d"]).await;
    assert_eq!(short.code, 2, "{}", short.all_output());
    assert!(
        short.stderr.contains("order_summary") && short.stderr.contains("short"),
        "{}",
        short.stderr
    );
    assert!(
        short.stdout.contains("full history since"),
        "{}",
        short.stdout
    );
    let met = pgcdc_on(&config, "retention", &["--require", "1s"]).await;
    assert_eq!(met.code, 0, "{}", met.all_output());
    let lsn = marker.consistent_point.clone().expect("consistent point");
    let at_lsn = pgcdc_on(&config, "retention", &["--require", &lsn]).await;
    assert_eq!(at_lsn.code, 0, "{}", at_lsn.all_output());
    let before_lsn = pgcdc_on(&config, "retention", &["--require", "0/1"]).await;
    assert_eq!(before_lsn.code, 2, "{}", before_lsn.all_output());
    // Without --require the configured requirements apply: 1d is not met.
    let configured = pgcdc_on(&config, "retention", &["--read-model", "customer_stats"]).await;
    assert_eq!(configured.code, 0, "{}", configured.all_output());
    let configured = pgcdc_on(&config, "retention", &[]).await;
    assert_eq!(configured.code, 2, "{}", configured.all_output());

    // The same figures as metrics, and a warning for the unmet requirement.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let met = mat::samples(&metrics, "pgcdc_rebuild_reach_requirement_met").await;
        let kind = mat::samples(&metrics, "pgcdc_rebuild_reach_kind").await;
        let value = |s: &[(String, f64)], rm: &str| {
            s.iter()
                .find(|(l, _)| l.contains(&format!("read_model=\"{rm}\"")))
                .map(|(_, v)| *v)
        };
        if value(&met, "order_summary") == Some(0.0)
            && value(&met, "customer_stats") == Some(1.0)
            && value(&kind, "order_summary") == Some(2.0)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "reach metrics: {met:?} {kind:?}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // One read model short of its requirement: the alert fires.
    assert_eq!(
        crate::operator::alert(&metrics, "rebuild_reach_short").await,
        Some(1.0)
    );
    let log = std::fs::read_to_string(&log_path).unwrap_or_default();
    assert!(
        log.lines().any(|l| l.contains("alert rebuild_reach_short")
            && l.contains("below its requirement")
            && l.contains("order_summary")),
        "no warning in the materializer's log:\n{log}"
    );
    // A rebuild while the materializer and the workload run: the swap
    // loses nothing and applies nothing twice.
    // Writers keep going until the rebuild has returned, so its catch-up
    // and its swap both run in the middle of changes.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let work = {
        let (url, stop) = (source_db.url.clone(), stop.clone());
        tokio::spawn(async move {
            let client = support::connect(&url).await;
            // A few hundred changes a second (what a debug build beside
            // the other tests replays faster than they arrive): new orders,
            // customer renames, orders paid.
            let mut i = 0i64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                client
                    .batch_execute(&format!(
                        "BEGIN;
                         INSERT INTO public.orders (id, customer_id, amount, status)
                         SELECT {id}, c.id, 10.50, 'new' FROM public.customers c ORDER BY c.id OFFSET {off} LIMIT 1;
                         UPDATE public.customers SET name = 'renamed {i}' WHERE id = (SELECT id FROM public.customers ORDER BY id OFFSET {off2} LIMIT 1);
                         UPDATE public.orders SET status = 'paid', amount = amount + 1 WHERE id = {prev};
                         COMMIT;",
                        id = 5_000_000 + i,
                        prev = 5_000_000 + i - 1,
                        off = i % 50,
                        off2 = (i * 7) % 50,
                    ))
                    .await
                    .expect("writer");
                i += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let orders = format!("{}.public.orders", source_db.name);
    let busy = mat::end_offsets(&stack, &orders).await;
    while mat::end_offsets(&stack, &orders).await < busy + 100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rebuilt = pgcdc_on(&config, "rebuild", &["--read-model", "customer_stats"]).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(rebuilt.code, 0, "{}", rebuilt.all_output());
    assert!(
        rebuilt.stdout.contains("read model customer_stats rebuilt"),
        "{}",
        rebuilt.stdout
    );
    work.await.expect("workload");
    mat::wait_converged(&source, &target).await;
    assert_eq!(mat::terminate(materializer).await, Some(0));

    // A read model declared after the fact, built from the log alone.
    let later = ConfigFile::write(&format!("{with_requirements}{ORDER_STATUS}"));
    let (run, json) = report(
        &later,
        &["--read-model", "order_status", "--require", "current"],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert_eq!(
        read_model(&json, "order_status")["reach"]["kind"],
        "full_history"
    );
    assert_eq!(json["read_models"].as_array().map(Vec::len), Some(1));
    let rebuilt = pgcdc_on(
        &later,
        "rebuild",
        &["--read-model", "order_status", "--json"],
    )
    .await;
    assert_eq!(rebuilt.code, 0, "{}", rebuilt.all_output());
    let outcome: Json = serde_json::from_str(&rebuilt.stdout).expect("rebuild --json");
    // Everything from the snapshot's first offsets to the end was read.
    let ranges: i64 = outcome["partitions"]
        .as_array()
        .expect("partitions")
        .iter()
        .map(|p| p["to_offset"].as_i64().unwrap_or(0) - p["from_offset"].as_i64().unwrap_or(0))
        .sum();
    assert!(ranges > 0);
    assert_eq!(outcome["records_read"].as_i64(), Some(ranges), "{outcome}");
    assert!(outcome["applied"].as_u64() > Some(0), "{outcome}");
    assert!(
        outcome["read_models"]["order_status"].as_i64() > Some(0),
        "{outcome}"
    );
    assert_eq!(
        checksum(
            &source,
            "SELECT status, count(*), sum(amount) FROM public.orders GROUP BY status"
        )
        .await,
        checksum(
            &target,
            "SELECT status, orders, amount FROM read_models.order_status"
        )
        .await,
        "the read model added later differs from its SQL on the source"
    );
    assert!(differences(&source, &target).await.is_empty());
    // No shadow is left behind.
    let left: i64 = target
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'pgcdc_rebuild'",
            &[],
        )
        .await
        .expect("shadows")
        .get(0);
    assert_eq!(left, 0);
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

/// Deletes every record below `offset` in one partition (what retention
/// does to old segments).
pub(crate) async fn delete_records(
    stack: &support::Stack,
    topic: &str,
    partition: i32,
    offset: i64,
) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let admin: AdminClient<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &stack.brokers)
        .client()
        .expect("admin");
    let mut tpl = rdkafka::TopicPartitionList::new();
    tpl.add_partition_offset(topic, partition, rdkafka::Offset::Offset(offset))
        .expect("tpl");
    let result = admin
        .delete_records(&tpl, &AdminOptions::new())
        .await
        .expect("delete records");
    for e in result.elements() {
        assert!(e.error().is_ok(), "delete records: {:?}", e.error());
    }
}

#[tokio::test]
async fn retention_cut_into_the_log_is_a_named_gap_and_a_rebuild_from_a_fresh_snapshot_equals_the_source(
) {
    let stack = support::stack();
    let (source_db, target_db, source, target) = mat::databases(&stack, "ret_gap", 200, 1000).await;
    let config = ConfigFile::write(&format!(
        "{}\n[source.snapshot]\nincremental_chunk_rows = 300\n",
        mat::pipeline(&stack, &source_db, &target_db)
    ));
    let parsed = pgcdc::config::Config::load(&config.path).expect("config");
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    mat::workload(&source, 600, 0x7777).await;
    support::wait_caught_up(&source, &parsed.source.slot).await;

    // Retention removes partition 0's snapshot rows of the orders topic.
    let marker = support::initial_marker(&parsed).await;
    let orders = format!("{}.public.orders", source_db.name);
    let cut = marker.end_offsets[&orders][&0];
    let start = marker.start_offsets[&orders][&0];
    assert!(mat::end_offsets(&stack, &orders).await > cut);
    delete_records(&stack, &orders, 0, cut).await;

    let (run, json) = report(&config, &[]).await;
    assert_eq!(
        run.code,
        0,
        "no requirement, no failure: {}",
        run.all_output()
    );
    assert_valid(&run.stdout).await;
    for name in ["order_summary", "customer_stats"] {
        let reach = &read_model(&json, name)["reach"];
        assert_eq!(reach["kind"], "none", "{reach}");
        let gap = reach["gaps"]
            .as_array()
            .and_then(|g| g.iter().find(|g| g["topic"] == orders.as_str()))
            .unwrap_or_else(|| panic!("no gap named for {orders}: {reach}"));
        assert_eq!(gap["partition"], 0);
        assert_eq!(gap["missing_from_offset"], start);
        assert_eq!(gap["missing_to_offset"], cut);
        assert_eq!(gap["missing_from_ms"], marker.since_ms());
        assert!(
            gap["missing_to_ms"].as_i64() >= Some(marker.since_ms()),
            "{gap}"
        );
    }
    let t = topic(&json, &orders);
    assert_eq!(t["begins_with_complete_snapshot"], false);
    assert_eq!(t["partitions"][0]["earliest_offset"], cut);
    // The customers topic alone is still whole.
    let customers = topic(&json, &format!("{}.public.customers", source_db.name));
    assert_eq!(customers["reach"]["kind"], "full_history");
    let text = pgcdc_on(&config, "retention", &["--read-model", "order_summary"]).await;
    assert!(text.stdout.contains("NOT REBUILDABLE"), "{}", text.stdout);
    assert!(
        text.stdout
            .contains(&format!("offsets {start}..{cut} of partition 0")),
        "{}",
        text.stdout
    );
    let required = pgcdc_on(&config, "retention", &["--require", "current"]).await;
    assert_eq!(required.code, 2, "{}", required.all_output());

    // The rebuild refuses, with the report's reason.
    let refused = pgcdc_on(&config, "rebuild", &["--read-model", "order_summary"]).await;
    assert_eq!(refused.code, 2, "{}", refused.all_output());
    assert!(
        refused
            .stderr
            .contains("cannot be rebuilt without a new snapshot"),
        "{}",
        refused.stderr
    );
    assert!(
        refused
            .stderr
            .contains(&format!("offsets {start}..{cut} of partition 0")),
        "{}",
        refused.stderr
    );
    assert!(
        refused.stderr.contains("--from snapshot"),
        "{}",
        refused.stderr
    );

    // From a fresh incremental snapshot, while the connector streams.
    mat::workload(&source, 300, 0x8888).await;
    let rebuilt = pgcdc_on(
        &config,
        "rebuild",
        &[
            "--read-model",
            "order_summary",
            "--from",
            "snapshot",
            "--snapshot-timeout-secs",
            "180",
        ],
    )
    .await;
    assert_eq!(rebuilt.code, 0, "{}", rebuilt.all_output());
    assert!(
        rebuilt.stdout.contains("incremental snapshot"),
        "{}",
        rebuilt.stdout
    );
    assert!(
        rebuilt.stdout.contains("is not in the rebuilt model"),
        "{}",
        rebuilt.stdout
    );
    assert!(
        differences(&source, &target).await.is_empty(),
        "the rebuilt model differs from the source: {:?}",
        differences(&source, &target).await
    );

    // The log holds a complete snapshot again: full history since it.
    let (_, json) = report(&config, &[]).await;
    let all = snapshot_marker::all(&parsed.kafka, &snapshot_marker::topic(&parsed))
        .await
        .expect("markers");
    let incremental = all
        .iter()
        .rfind(|m| m.kind == Kind::Incremental && m.phase == Phase::Completed)
        .expect("a completed incremental snapshot");
    let reach = &read_model(&json, "order_summary")["reach"];
    assert_eq!(reach["kind"], "full_history", "{reach}");
    assert_eq!(reach["since_ms"], incremental.since_ms());
    assert_eq!(topic(&json, &orders)["snapshot"]["kind"], "incremental");
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test]
async fn a_compacted_topic_reports_current_state_only_and_rebuilds_to_it() {
    let stack = support::stack();
    let (source_db, target_db, source, target) =
        mat::databases(&stack, "ret_compact", 100, 500).await;
    let config = ConfigFile::write(&mat::pipeline(&stack, &source_db, &target_db).replacen(
        "[kafka]\n",
        "[kafka]\ncleanup_policy = \"compact\"\n",
        1,
    ));
    let parsed = pgcdc::config::Config::load(&config.path).expect("config");
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    mat::workload(&source, 600, 0x4242).await;
    support::wait_caught_up(&source, &parsed.source.slot).await;

    let (run, json) = report(&config, &[]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert_valid(&run.stdout).await;
    for name in ["order_summary", "customer_stats"] {
        let reach = &read_model(&json, name)["reach"];
        assert_eq!(reach["kind"], "current_state", "{reach}");
        assert!(reach["since_ms"].is_null());
        assert!(
            reach["summary"]
                .as_str()
                .is_some_and(|s| s.contains("compacted")),
            "{reach}"
        );
    }
    assert_eq!(
        topic(&json, &format!("{}.public.orders", source_db.name))["config"]["cleanup_policy"],
        "compact"
    );
    let human = pgcdc_on(&config, "retention", &[]).await;
    assert!(
        human.stdout.contains("current state only (compacted)"),
        "{}",
        human.stdout
    );
    let time = pgcdc_on(&config, "retention", &["--require", "1s"]).await;
    assert_eq!(
        time.code,
        2,
        "history is required but only state is kept: {}",
        time.all_output()
    );
    let state = pgcdc_on(&config, "retention", &["--require", "current"]).await;
    assert_eq!(state.code, 0, "{}", state.all_output());

    let rebuilt = pgcdc_on(&config, "rebuild", &["--read-model", "order_summary"]).await;
    assert_eq!(rebuilt.code, 0, "{}", rebuilt.all_output());
    assert!(
        rebuilt.stdout.contains("current state"),
        "{}",
        rebuilt.stdout
    );
    let diff = differences(&source, &target).await;
    assert!(
        diff.is_empty(),
        "the rebuild differs from the current source state: {diff:?}"
    );
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test]
async fn the_slot_section_shows_wal_piling_up_while_the_connector_is_stopped() {
    let stack = support::stack();
    let cluster = ScratchCluster::start(&[
        "wal_level = logical",
        "max_replication_slots = 4",
        "max_wal_senders = 4",
        "max_slot_wal_keep_size = 160MB",
    ]);
    let url = cluster.url("postgres");
    let client = support::connect(&url).await;
    support::apply_sql_file(&client, "sql/demo/schema.sql").await;
    client
        .batch_execute("INSERT INTO public.customers SELECT g, 'c' || g, 'gold', 1 FROM generate_series(1, 50) g")
        .await
        .expect("seed");
    let name = support::unique("ret_slot");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &url,
        &name,
        &["public.customers", "public.orders"],
    ));
    let parsed = pgcdc::config::Config::load(&config.path).expect("config");
    let connector = ConnectorProcess::start(&config);
    support::wait_snapshot_completed(&parsed).await;
    support::wait_caught_up(&client, &name).await;
    let (_, before) = report(&config, &[]).await;
    let slot = &before["slot"];
    assert_eq!(slot["exists"], true, "{slot}");
    assert_eq!(slot["max_slot_wal_keep_size"], 160 * 1024 * 1024);
    assert_eq!(slot["risk"]["level"], "ok", "{slot}");
    assert_eq!(connector.terminate().await, 0);

    // The connector is stopped; WAL goes on: eight segment switches.
    for i in 0..8 {
        client
            .batch_execute(&format!(
                "INSERT INTO public.customers VALUES ({}, 'more', NULL, 1); SELECT pg_switch_wal();",
                1000 + i
            ))
            .await
            .expect("switch wal");
    }
    let (run, after) = report(&config, &[]).await;
    assert_valid(&run.stdout).await;
    let (a, b) = (&after["slot"], &before["slot"]);
    let grown = a["retained_wal_bytes"].as_i64().unwrap_or(0)
        - b["retained_wal_bytes"].as_i64().unwrap_or(0);
    assert!(
        grown >= 64 * 1024 * 1024,
        "retained WAL grew by {grown} bytes: {b} → {a}"
    );
    assert!(
        a["safe_wal_size"].as_i64().unwrap_or(i64::MAX)
            <= b["safe_wal_size"].as_i64().unwrap_or(0) - 64 * 1024 * 1024,
        "safe_wal_size did not shrink: {b} → {a}"
    );
    assert_eq!(a["active"], false);
    assert_eq!(a["risk"]["level"], "warning", "{a}");
    let human = pgcdc_on(&config, "retention", &[]).await;
    let risk = human
        .stdout
        .lines()
        .find(|l| l.trim_start().starts_with("risk"))
        .unwrap_or_default()
        .to_string();
    assert!(
        risk.contains("WARNING: the slot will be invalidated after about"),
        "{}",
        human.stdout
    );
    let status = support::pgcdc(&["slot", "status", "--config", config.arg()]).await;
    assert!(
        status.stdout.contains("will be invalidated after about"),
        "{}",
        status.stdout
    );
    drop(cluster);
}
