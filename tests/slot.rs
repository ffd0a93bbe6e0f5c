//! `pgcdc slot status|drop` against real slots.

use std::time::Duration;

use crate::support::{self, ConfigFile, ScratchCluster, TestDb};

#[tokio::test]
async fn slot_status_shows_the_slot_and_drop_needs_confirmation() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "slot_status").await;
    let client = db.client().await;
    support::apply_sql_file(&client, "sql/demo/schema.sql").await;
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.orders"],
    ));

    let missing = support::pgcdc(&["slot", "status", "--config", config.arg()]).await;
    assert_eq!(missing.code, 1, "{}", missing.all_output());
    assert!(
        missing
            .stderr
            .contains(&format!("slot '{}' does not exist", db.name)),
        "{}",
        missing.stderr
    );

    client
        .batch_execute(&format!(
            "SELECT pg_create_logical_replication_slot('{}', 'pgoutput')",
            db.name
        ))
        .await
        .expect("create slot");
    let run = support::pgcdc(&["slot", "status", "--config", config.arg()]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stdout.contains("plugin               pgoutput"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("wal_status           reserved"),
        "{}",
        run.stdout
    );
    let json = support::pgcdc(&["slot", "status", "--config", config.arg(), "--json"]).await;
    let parsed: serde_json::Value = serde_json::from_str(&json.stdout).expect("json");
    assert_eq!(parsed["slot"], db.name.as_str());
    assert_eq!(parsed["active"], false);
    assert!(
        parsed["confirmed_flush_lsn"]
            .as_str()
            .is_some_and(|l| l.contains('/')),
        "{parsed}"
    );

    let unconfirmed = support::pgcdc(&["slot", "drop", "--config", config.arg()]).await;
    assert_eq!(unconfirmed.code, 1);
    assert!(
        unconfirmed.stderr.contains("add --yes"),
        "{}",
        unconfirmed.stderr
    );
    let still: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&db.name],
        )
        .await
        .expect("query")
        .get(0);
    assert_eq!(still, 1, "the slot survived an unconfirmed drop");

    let dropped = support::pgcdc(&["slot", "drop", "--config", config.arg(), "--yes"]).await;
    assert_eq!(dropped.code, 0, "{}", dropped.all_output());
    let left: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1",
            &[&db.name],
        )
        .await
        .expect("query")
        .get(0);
    assert_eq!(left, 0);
    db.drop_db().await;
}

#[tokio::test]
async fn slot_drop_is_refused_while_a_consumer_holds_the_slot() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "slot_active").await;
    let client = db.client().await;
    support::apply_sql_file(&client, "sql/demo/schema.sql").await;
    for sql in [
        format!("CREATE PUBLICATION {} FOR TABLE public.orders", db.name),
        format!(
            "SELECT pg_create_logical_replication_slot('{}', 'pgoutput')",
            db.name
        ),
    ] {
        client.batch_execute(&sql).await.expect("setup");
    }
    let mut consumer = std::process::Command::new(stack.pg_bindir.join("pg_recvlogical"))
        .args([
            "-d",
            &db.url,
            "--slot",
            &db.name,
            "--start",
            "-f",
            "/dev/null",
        ])
        .args([
            "-o",
            "proto_version=1",
            "-o",
            &format!("publication_names={}", db.name),
        ])
        .spawn()
        .expect("start pg_recvlogical");
    let probe = db.client().await;
    let name = db.name.clone();
    support::wait_for("the slot to become active", Duration::from_secs(30), || {
        let (probe, name) = (&probe, &name);
        async move {
            probe
                .query_one(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                    &[name],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
        }
    })
    .await;
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.orders"],
    ));

    let run = support::pgcdc(&["slot", "drop", "--config", config.arg(), "--yes"]).await;

    let _ = consumer.kill();
    let _ = consumer.wait();
    assert_eq!(run.code, 1, "{}", run.all_output());
    assert!(
        run.stderr.contains("is in use by process"),
        "{}",
        run.stderr
    );
    db.drop_db().await;
}

#[tokio::test]
async fn an_invalidated_slot_is_reported_with_its_recovery() {
    let stack = support::stack();
    let cluster = ScratchCluster::start(&[
        "wal_level = logical",
        "max_replication_slots = 4",
        "max_wal_senders = 4",
        "max_slot_wal_keep_size = 1MB",
        "min_wal_size = 32MB",
        "max_wal_size = 64MB",
    ]);
    let url = cluster.url("postgres");
    let client = support::connect(&url).await;
    for sql in [
        "CREATE TABLE public.t (id bigint PRIMARY KEY, v text)",
        "CREATE PUBLICATION lost FOR TABLE public.t",
        "SELECT pg_create_logical_replication_slot('lost', 'pgoutput')",
    ] {
        client.batch_execute(sql).await.expect("setup");
    }
    // Write and switch WAL segments until a checkpoint invalidates the slot.
    let mut i = 0;
    support::wait_for("the slot to be invalidated", Duration::from_secs(60), || {
        i += 1;
        let client = &client;
        let i = i;
        async move {
            client
                .batch_execute(&format!(
                    "INSERT INTO public.t SELECT g + {i} * 1000, repeat('x', 200) FROM generate_series(1, 1000) g"
                ))
                .await
                .expect("insert");
            client.batch_execute("SELECT pg_switch_wal()").await.expect("switch");
            client.batch_execute("CHECKPOINT").await.expect("checkpoint");
            client
                .query_one("SELECT wal_status = 'lost' FROM pg_replication_slots WHERE slot_name = 'lost'", &[])
                .await
                .map(|r| r.get::<_, bool>(0))
                .unwrap_or(false)
        }
    })
    .await;
    let toml = support::pipeline_toml(&stack, &url, "lost", &["public.t"]);
    let config = ConfigFile::write(&toml);

    let status = support::pgcdc(&["slot", "status", "--config", config.arg()]).await;
    assert_eq!(status.code, 2, "{}", status.all_output());
    assert!(
        status.stdout.contains("wal_status           lost"),
        "{}",
        status.stdout
    );
    assert!(
        status.stderr.contains("is invalidated"),
        "{}",
        status.stderr
    );
    assert!(
        status.stderr.contains("pgcdc slot drop"),
        "{}",
        status.stderr
    );

    let check = support::pgcdc(&["check", "--config", config.arg()]).await;
    assert_eq!(check.code, 2);
    let line = check.check_line("postgres.slot").unwrap_or_default();
    assert!(
        line.starts_with("FAIL") && line.contains("invalidated"),
        "{}",
        check.stdout
    );
    assert!(check.stdout.contains("pgcdc slot drop"), "{}", check.stdout);

    // The documented recovery's first step works on a lost slot.
    let dropped = support::pgcdc(&["slot", "drop", "--config", config.arg(), "--yes"]).await;
    assert_eq!(dropped.code, 0, "{}", dropped.all_output());
}

#[tokio::test]
async fn publication_is_created_when_missing_and_never_silently_altered() {
    use pgcdc::config::Config;
    use pgcdc::source::slot;

    let stack = support::stack();
    let db = TestDb::create(&stack, "slot_pub").await;
    let client = db.client().await;
    support::apply_sql_file(&client, "sql/demo/schema.sql").await;
    let toml = support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.customers", "public.orders"],
    );
    let config = Config::from_toml(&toml, "test", &[]).expect("config");

    assert!(
        slot::ensure_publication(&client, &config)
            .await
            .expect("create"),
        "created"
    );
    assert!(
        !slot::ensure_publication(&client, &config)
            .await
            .expect("verify"),
        "left as it is"
    );
    let err = refusal_after(
        &client,
        &config,
        &format!("ALTER PUBLICATION {} DROP TABLE public.orders", db.name),
    )
    .await;
    assert_eq!(
        err,
        Some(format!(
            "publication '{0}' does not cover public.orders; fix: ALTER PUBLICATION {0} ADD TABLE public.orders",
            db.name
        ))
    );

    let missing = slot::verify_usable(&client, &config)
        .await
        .err()
        .map(|e| e.to_string());
    assert_eq!(missing, Some(format!("slot '{}' does not exist", db.name)));
    client
        .batch_execute(&format!(
            "SELECT pg_create_logical_replication_slot('{}', 'test_decoding')",
            db.name
        ))
        .await
        .expect("slot");
    let foreign = slot::verify_usable(&client, &config)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(foreign.contains("uses plugin 'test_decoding'"), "{foreign}");
    db.drop_db().await;
}

/// What `ensure_publication` says of the publication after `alter`.
async fn refusal_after(
    client: &tokio_postgres::Client,
    config: &pgcdc::config::Config,
    alter: &str,
) -> Option<String> {
    client.batch_execute(alter).await.expect("alter");
    pgcdc::source::slot::ensure_publication(client, config)
        .await
        .err()
        .map(|e| e.to_string())
}

/// A publication that publishes a partitioned table's changes under its
/// partitions' names (`publish_via_partition_root` off) is refused with
/// the fix, by the connector and by `pgcdc check`; one pgcdc creates
/// publishes through the root.
#[tokio::test]
async fn a_publication_that_names_partitions_instead_of_their_table_is_refused_with_the_fix() {
    use pgcdc::config::Config;
    use pgcdc::source::slot;

    let stack = support::stack();
    let db = TestDb::create(&stack, "slot_parted").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.ev (id bigint, region int, PRIMARY KEY (id, region))
                 PARTITION BY LIST (region);
             CREATE TABLE public.ev_1 PARTITION OF public.ev FOR VALUES IN (1);",
        )
        .await
        .expect("table");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.ev"]);
    let config = Config::from_toml(&toml, "test", &[]).expect("config");
    assert!(slot::ensure_publication(&client, &config)
        .await
        .expect("create"));
    let via_root: bool = client
        .query_one(
            "SELECT pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&db.name],
        )
        .await
        .expect("publication")
        .get(0);
    assert!(via_root, "pgcdc's publication publishes through the root");
    let err = refusal_after(
        &client,
        &config,
        &format!(
            "ALTER PUBLICATION {} SET (publish_via_partition_root = false)",
            db.name
        ),
    )
    .await;
    assert_eq!(
        err,
        Some(format!(
            "publication '{0}' publishes changes to the partitions of public.ev under the partitions' own names, to topics no snapshot fills; fix: ALTER PUBLICATION {0} SET (publish_via_partition_root = true)",
            db.name
        ))
    );
    let file = ConfigFile::write(&toml);
    let check = support::pgcdc(&["check", "--config", file.arg()]).await;
    let line = check.check_line("postgres.publication").unwrap_or_default();
    assert!(line.contains("FAIL"), "{}", check.all_output());
    assert!(
        check.all_output().contains(&format!(
            "ALTER PUBLICATION {} SET (publish_via_partition_root = true)",
            db.name
        )),
        "{}",
        check.all_output()
    );
    db.drop_db().await;
}
