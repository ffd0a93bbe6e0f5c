//! `pgcdc check` against live systems: it passes on the demo schema and
//! fails precisely on each broken prerequisite.

use crate::support::{self, ConfigFile, ScratchCluster, TestDb};

#[tokio::test]
async fn check_passes_on_the_demo_schema() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "check_demo").await;
    support::apply_sql_file(&db.client().await, "sql/demo/schema.sql").await;
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.customers", "public.orders"],
    ));

    let run = support::pgcdc(&["check", "--config", config.arg()]).await;

    assert_eq!(
        run.code,
        0,
        "check failed on the demo schema:\n{}",
        run.all_output()
    );
    for check in [
        "postgres.connect",
        "postgres.wal_level",
        "postgres.replication_slots",
        "postgres.wal_senders",
        "postgres.role",
        "table.public.customers",
        "table.public.orders",
        "postgres.publication",
        "postgres.slot",
        "kafka.connect",
        "registry.connect",
    ] {
        let line = run
            .check_line(check)
            .unwrap_or_else(|| panic!("no line for {check}:\n{}", run.stdout));
        assert!(line.starts_with("PASS"), "{line}");
    }
    db.drop_db().await;
}

#[tokio::test]
async fn check_fails_when_wal_level_is_replica() {
    let stack = support::stack();
    let cluster = ScratchCluster::start(&["wal_level = replica"]);
    let admin = support::connect(&cluster.url("postgres")).await;
    admin
        .batch_execute("CREATE TABLE public.t (id int PRIMARY KEY)")
        .await
        .expect("create table");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &cluster.url("postgres"),
        "walcheck",
        &["public.t"],
    ));

    let run = support::pgcdc(&["check", "--config", config.arg()]).await;

    assert_eq!(run.code, 2, "{}", run.all_output());
    let line = run.check_line("postgres.wal_level").unwrap_or_default();
    assert!(
        line.starts_with("FAIL")
            && line.contains("wal_level is 'replica', logical decoding needs 'logical'"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("ALTER SYSTEM SET wal_level = logical"),
        "{}",
        run.stdout
    );
}

#[tokio::test]
async fn check_fails_on_a_table_without_primary_key() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "check_nopk").await;
    db.client()
        .await
        .batch_execute("CREATE TABLE public.events_nopk (at timestamptz, body text)")
        .await
        .expect("create table");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.events_nopk"],
    ));

    let run = support::pgcdc(&["check", "--config", config.arg()]).await;

    assert_eq!(run.code, 2, "{}", run.all_output());
    let line = run
        .check_line("table.public.events_nopk")
        .unwrap_or_default();
    assert!(
        line.starts_with("FAIL")
            && line.contains("public.events_nopk has no primary key and REPLICA IDENTITY DEFAULT"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout
            .contains("ALTER TABLE public.events_nopk REPLICA IDENTITY USING INDEX"),
        "{}",
        run.stdout
    );
    db.drop_db().await;
}

/// A partitioned table without a primary key: `REPLICA IDENTITY FULL` on
/// the table does not reach its partitions, whose own settings Postgres
/// checks, so the check fails naming the partition that lacks one, and
/// `pgcdc run` creates no publication that would make its UPDATEs fail;
/// with every partition FULL, both go ahead.
#[tokio::test]
async fn a_partition_without_a_replica_identity_fails_the_check_and_blocks_the_publication() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "check_parts").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.ev (id bigint, region int, v text) PARTITION BY LIST (region);
             CREATE TABLE public.ev_1 PARTITION OF public.ev FOR VALUES IN (1);
             CREATE TABLE public.ev_2 PARTITION OF public.ev FOR VALUES IN (2);
             ALTER TABLE public.ev REPLICA IDENTITY FULL;
             ALTER TABLE public.ev_1 REPLICA IDENTITY FULL;
             INSERT INTO public.ev VALUES (1, 1, 'a'), (2, 2, 'b');",
        )
        .await
        .expect("tables");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.ev"]);
    let config = ConfigFile::write(&toml);
    let run = support::pgcdc(&["check", "--config", config.arg()]).await;
    let line = run.check_line("table.public.ev").unwrap_or_default();
    assert!(
        line.starts_with("FAIL") && line.contains("public.ev_2 without a replica identity"),
        "{}",
        run.stdout
    );
    assert!(!line.contains("public.ev_1"), "{line}");

    let parsed = pgcdc::config::Config::from_toml(&toml, "test", &[]).expect("config");
    let err = pgcdc::source::slot::ensure_publication(&client, &parsed)
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(
        err.starts_with("public.ev_2: no replica identity")
            && err.contains("did not create publication"),
        "{err}"
    );
    let publications: i64 = client
        .query_one("SELECT count(*) FROM pg_publication", &[])
        .await
        .expect("publications")
        .get(0);
    assert_eq!(publications, 0);
    // The application's writes still work.
    client
        .batch_execute("UPDATE public.ev SET v = 'c' WHERE id = 2")
        .await
        .expect("update");

    client
        .batch_execute("ALTER TABLE public.ev_2 REPLICA IDENTITY FULL")
        .await
        .expect("identity");
    let run = support::pgcdc(&["check", "--config", config.arg()]).await;
    let line = run.check_line("table.public.ev").unwrap_or_default();
    assert!(
        line.starts_with("PASS") && line.contains("every partition has a replica identity"),
        "{}",
        run.stdout
    );
    assert!(pgcdc::source::slot::ensure_publication(&client, &parsed)
        .await
        .expect("publication"));
    client
        .batch_execute("UPDATE public.ev SET v = 'd' WHERE id = 2")
        .await
        .expect("update once published");
    db.drop_db().await;
}

/// A partitioned table listed with one of its partitions: the partition's
/// changes are published under the table's name only, so its own topic
/// would get a snapshot and nothing after. `pgcdc check` fails it and
/// `pgcdc run` stops before creating anything.
#[tokio::test]
async fn a_partition_listed_with_its_table_is_refused() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "check_listed").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.ev (id bigint, region int, PRIMARY KEY (id, region))
                 PARTITION BY LIST (region);
             CREATE TABLE public.ev_1 PARTITION OF public.ev FOR VALUES IN (1)
                 PARTITION BY RANGE (id);
             CREATE TABLE public.ev_1a PARTITION OF public.ev_1 FOR VALUES FROM (0) TO (100);",
        )
        .await
        .expect("tables");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.ev_1a", "public.ev"],
    ));
    let said = "source.tables lists public.ev_1a, a partition of public.ev, which it lists too";
    let run = support::pgcdc(&["check", "--config", config.arg()]).await;
    assert!(
        run.stdout
            .lines()
            .any(|l| l.starts_with("FAIL  table.public.ev_1a") && l.contains(said)),
        "{}",
        run.stdout
    );
    let run = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        support::pgcdc(&["run", "--config", config.arg()]),
    )
    .await
    .expect("pgcdc run stops");
    assert_ne!(run.code, 0);
    assert!(run.stderr.contains(said), "{}", run.all_output());
    let publications: i64 = client
        .query_one("SELECT count(*) FROM pg_publication", &[])
        .await
        .expect("publications")
        .get(0);
    assert_eq!(publications, 0, "nothing created");
    db.drop_db().await;
}

#[tokio::test]
async fn check_fails_on_a_missing_select_grant() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "check_grant").await;
    let role = support::unique("nogrant");
    db.admin()
        .await
        .batch_execute(&format!(
            "CREATE TABLE public.secrets (id int PRIMARY KEY, value text);
             CREATE ROLE {role} LOGIN REPLICATION PASSWORD 'nogrant-pw';"
        ))
        .await
        .expect("setup");
    let url = support::with_user(&db.url, &role, "nogrant-pw");
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &url,
        &db.name,
        &["public.secrets"],
    ));

    let run = support::pgcdc(&["check", "--config", config.arg()]).await;

    assert_eq!(run.code, 2, "{}", run.all_output());
    let line = run.check_line("table.public.secrets").unwrap_or_default();
    assert!(
        line.starts_with("FAIL")
            && line.contains(&format!("role '{role}' lacks SELECT on public.secrets")),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout
            .contains(&format!("GRANT SELECT ON public.secrets TO \"{role}\"")),
        "{}",
        run.stdout
    );
    // Nor can a role that owns none of the tables create the publication.
    let publication = run.check_line("postgres.publication").unwrap_or_default();
    assert!(
        publication.starts_with("FAIL") && publication.contains("cannot create it"),
        "{}",
        run.stdout
    );
    assert!(
        !run.all_output().contains("nogrant-pw"),
        "password leaked:\n{}",
        run.all_output()
    );
    db.admin()
        .await
        .batch_execute(&format!("DROP OWNED BY {role}"))
        .await
        .ok();
    db.drop_db().await;
    support::connect(&stack.admin_url)
        .await
        .batch_execute(&format!("DROP ROLE IF EXISTS {role}"))
        .await
        .ok();
}

#[tokio::test]
async fn check_fails_on_unreachable_broker_and_registry_without_leaking_passwords() {
    let stack = support::stack();
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    let toml = format!(
        r#"name = "unreachable"
[source]
url = "postgres://pgcdc:very-secret-pw@127.0.0.1:{closed}/nowhere"
slot = "s"
publication = "p"
tables = ["public.t"]
[kafka]
brokers = "127.0.0.1:{closed}"
topic_prefix = "u"
[registry]
url = "http://127.0.0.1:{closed}"
"#
    );
    let _ = stack;
    let config = ConfigFile::write(&toml);

    let run = support::pgcdc(&["check", "--config", config.arg()]).await;

    assert_eq!(run.code, 2, "{}", run.all_output());
    for check in ["postgres.connect", "kafka.connect", "registry.connect"] {
        let line = run.check_line(check).unwrap_or_default();
        assert!(line.starts_with("FAIL"), "{check}: {}", run.stdout);
    }
    assert!(
        run.stdout
            .contains(&format!("broker at 127.0.0.1:{closed} unreachable")),
        "{}",
        run.stdout
    );
    assert!(
        !run.all_output().contains("very-secret-pw"),
        "password leaked:\n{}",
        run.all_output()
    );
}

#[tokio::test]
async fn check_reports_existing_slot_publication_and_replica_identity() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "check_state").await;
    let client = db.client().await;
    support::apply_sql_file(&client, "sql/demo/schema.sql").await;
    // One statement per call: a slot cannot be created in a transaction
    // that has written.
    for sql in [
        "ALTER TABLE public.customers REPLICA IDENTITY FULL".to_string(),
        format!("CREATE PUBLICATION {} FOR TABLE public.customers", db.name),
        format!(
            "SELECT pg_create_logical_replication_slot('{}', 'pgoutput')",
            db.name
        ),
        format!(
            "SELECT pg_create_logical_replication_slot('{}_td', 'test_decoding')",
            db.name
        ),
    ] {
        client
            .batch_execute(&sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let config = ConfigFile::write(&support::pipeline_toml(
        &stack,
        &db.url,
        &db.name,
        &["public.customers", "public.orders"],
    ));

    let run = support::pgcdc(&["check", "--config", config.arg()]).await;

    assert_eq!(run.code, 2, "{}", run.all_output());
    let line = |c: &str| run.check_line(c).unwrap_or_default().to_string();
    assert!(
        line("table.public.customers").starts_with("WARN"),
        "{}",
        run.stdout
    );
    assert!(
        line("table.public.customers").contains("REPLICA IDENTITY FULL"),
        "{}",
        run.stdout
    );
    let publication = line("postgres.publication");
    assert!(
        publication.starts_with("FAIL") && publication.contains("does not cover public.orders"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains(&format!(
        "ALTER PUBLICATION {} ADD TABLE public.orders",
        db.name
    )));
    let slot = line("postgres.slot");
    assert!(
        slot.starts_with("PASS")
            && slot.contains("is healthy: confirmed_flush_lsn=")
            && slot.contains("wal_status=reserved"),
        "{}",
        run.stdout
    );

    // A slot of another plugin under our name is refused.
    let wrong_plugin = support::pipeline_toml(&stack, &db.url, &db.name, &["public.customers"])
        .replace(
            &format!("slot = \"{}\"", db.name),
            &format!("slot = \"{}_td\"", db.name),
        );
    let config = ConfigFile::write(&wrong_plugin);
    let run = support::pgcdc(&["check", "--config", config.arg()]).await;
    let slot = run.check_line("postgres.slot").unwrap_or_default();
    assert!(
        slot.starts_with("FAIL") && slot.contains("plugin 'test_decoding'"),
        "{}",
        run.stdout
    );
    db.drop_db().await;
}

/// A changelog topic that takes smaller records than
/// `kafka.max_message_bytes` (its own `max.message.bytes`) is warned
/// about, naming the limit that `pgcdc run` then keeps to; a setting
/// under it passes.
#[tokio::test]
async fn a_topic_smaller_than_max_message_bytes_is_warned_about() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "check_msgsize").await;
    db.client()
        .await
        .batch_execute("CREATE TABLE public.t (id int PRIMARY KEY)")
        .await
        .expect("table");
    let topic = format!("{}.public.t", db.name);
    support::create_topic(&stack, &topic, &[("max.message.bytes", "50000")]).await;
    let base = support::pipeline_toml(&stack, &db.url, &db.name, &["public.t"])
        .replace("[kafka]\n", "[kafka]\npartitions = 1\n");
    let check = format!("kafka.topic.{topic}");

    let too_big = ConfigFile::write(&base);
    let run = support::pgcdc(&["check", "--config", too_big.arg()]).await;
    assert_eq!(run.code, 0, "{}", run.all_output());
    let line = run.check_line(&check).unwrap_or_default();
    assert!(
        line.starts_with("WARN")
            && line.contains("takes records of at most 50000 bytes (max.message.bytes), less than kafka.max_message_bytes (1000000)"),
        "{}",
        run.stdout
    );
    assert!(
        line.contains("quarantines events over 48976 bytes as oversized")
            && run
                .stdout
                .contains("set kafka.max_message_bytes to at most 48976"),
        "{}",
        run.stdout
    );

    let fitting =
        ConfigFile::write(&base.replace("[kafka]\n", "[kafka]\nmax_message_bytes = 48976\n"));
    let run = support::pgcdc(&["check", "--config", fitting.arg()]).await;
    let line = run.check_line(&check).unwrap_or_default();
    assert!(
        line.starts_with("PASS") && line.contains("max.message.bytes=50000"),
        "{}",
        run.stdout
    );
    db.drop_db().await;
}
