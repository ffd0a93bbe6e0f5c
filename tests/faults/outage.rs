//! Outages of what the pipeline depends on, each for [`OUTAGE`] under a
//! continuous workload: the broker, Postgres (source and target, and a
//! target refusing connections), and the schema registry. Connector and
//! materializer stay up throughout: they retry, they do not exit.

use std::time::{Duration, Instant};

use super::{Scenario, Writer, LOGICAL, OUTAGE};
use crate::support::{self, PrivateBroker, RegistryProcess, ScratchCluster, TestDb};

/// The slot's confirmed flush LSN, and the WAL it retains (current WAL
/// position minus its restart LSN), in bytes.
async fn slot_figures(client: &tokio_postgres::Client, slot: &str) -> (String, i64) {
    let row = client
        .query_one(
            "SELECT confirmed_flush_lsn::text,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("slot figures");
    (row.get(0), row.get(1))
}

async fn lsn_gt(client: &tokio_postgres::Client, a: &str, b: &str) -> bool {
    client
        .query_one("SELECT $1::text::pg_lsn > $2::text::pg_lsn", &[&a, &b])
        .await
        .expect("compare LSNs")
        .get(0)
}

/// Panics if a process exited: it was meant to ride the outage out.
fn still_running(child: &mut tokio::process::Child, what: &str) {
    if let Ok(Some(status)) = child.try_wait() {
        panic!("the {what} exited ({status}) instead of retrying");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_holds_the_slot_then_resumes_without_loss() {
    let stack = support::stack();
    let mut broker = PrivateBroker::start_persistent(&stack);
    let (s, source_db, target_db) = Scenario::on_stack(
        &stack,
        "fault_broker",
        &broker.address,
        &stack.registry_url,
        20_000,
    )
    .await;
    let source = source_db.client().await;
    let mut connector = s.connector();
    let mut materializer = s.materializer();
    support::wait_snapshot_completed(&s.parsed).await;
    let writer = Writer::start(&source_db.url, 0xb40c_e500);
    tokio::time::sleep(Duration::from_secs(2)).await;
    support::wait_caught_up(&source, &s.name).await;

    broker.stop();
    let down = Instant::now();
    // What librdkafka had acknowledged before the stop may still arrive.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (held, retained_early) = slot_figures(&source, &s.name).await;
    while down.elapsed() < OUTAGE {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (confirmed, _) = slot_figures(&source, &s.name).await;
        assert_eq!(
            confirmed, held,
            "the slot advanced while the broker was down"
        );
        still_running(&mut connector.child, "connector");
        still_running(&mut materializer, "materializer");
    }
    let (_, retained_late) = slot_figures(&source, &s.name).await;
    assert!(
        retained_late > retained_early,
        "the slot's retained WAL did not grow while the broker was down: {retained_early} then {retained_late} bytes"
    );

    broker.start_again();
    support::wait_caught_up(&source, &s.name).await;
    let (resumed, _) = slot_figures(&source, &s.name).await;
    assert!(
        lsn_gt(&source, &resumed, &held).await,
        "the slot never moved past {held}"
    );
    // The restart LSN follows once Postgres logs its running transactions
    // (at least every 15 s while it is busy).
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, retained) = slot_figures(&source, &s.name).await;
        if retained < retained_late {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot's retained WAL never shrank below {retained_late} bytes (now {retained})"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    writer.stop().await;
    s.verify("broker outage", 1).await;
    assert_eq!(connector.terminate().await, 0);
    assert_eq!(crate::materialize::terminate(materializer).await, Some(0));
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarts_and_a_target_refusing_connections_lose_nothing() {
    let stack = support::stack();
    let cluster = ScratchCluster::start(&LOGICAL);
    let admin = support::connect(&cluster.url("postgres")).await;
    for db in ["fault_src", "fault_tgt"] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .expect("database");
    }
    let (source_url, target_url) = (cluster.url("fault_src"), cluster.url("fault_tgt"));
    let name = support::unique("fault_pg");
    let s = Scenario::prepare(
        &name,
        &source_url,
        &source_url,
        &target_url,
        &target_url,
        &stack.brokers,
        &stack.registry_url,
        20_000,
    )
    .await;
    let mut connector = s.connector();
    let mut materializer = s.materializer();
    support::wait_snapshot_completed(&s.parsed).await;
    let writer = Writer::start(&source_url, 0x9057_9e55);
    tokio::time::sleep(Duration::from_secs(3)).await;

    // Source and target at once: every connection of both is cut.
    cluster.restart();
    tokio::time::sleep(Duration::from_secs(5)).await;
    still_running(&mut connector.child, "connector");
    still_running(&mut materializer, "materializer");
    let source = support::connect(&source_url).await;
    support::wait_caught_up(&source, &s.name).await;

    // The target refuses connections; the source goes on.
    let admin = support::connect(&cluster.url("postgres")).await;
    admin
        .batch_execute(
            "ALTER DATABASE fault_tgt ALLOW_CONNECTIONS false;
             SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = 'fault_tgt';",
        )
        .await
        .expect("refuse target connections");
    let down = Instant::now();
    while down.elapsed() < OUTAGE {
        tokio::time::sleep(Duration::from_secs(1)).await;
        still_running(&mut materializer, "materializer");
    }
    admin
        .batch_execute("ALTER DATABASE fault_tgt ALLOW_CONNECTIONS true")
        .await
        .expect("allow target connections");
    writer.stop().await;
    s.verify("postgres restart, target refusing", 2).await;
    still_running(&mut connector.child, "connector");
    assert_eq!(connector.terminate().await, 0);
    assert_eq!(crate::materialize::terminate(materializer).await, Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_outage_delays_new_schemas_and_restarts_and_loses_nothing() {
    let stack = support::stack();
    let store = TestDb::create(&stack, "fault_reg_store").await;
    let mut registry = RegistryProcess::start(&store.url).await;
    let (s, source_db, target_db) =
        Scenario::on_stack(&stack, "fault_reg", &stack.brokers, &registry.url, 20_000).await;
    let source = source_db.client().await;
    let target = target_db.client().await;
    let mut connector = s.connector();
    let materializer = s.materializer();
    support::wait_snapshot_completed(&s.parsed).await;
    let writer = Writer::start(&source_db.url, 0x4e61_5747);
    tokio::time::sleep(Duration::from_secs(2)).await;

    registry.stop();
    let down = Instant::now();
    // A new table shape needs a new schema registered, and a restarted
    // materializer needs every schema fetched: both wait for the registry.
    source
        .batch_execute("ALTER TABLE public.customers ADD COLUMN loyalty int NOT NULL DEFAULT 0")
        .await
        .expect("add column");
    let _ = crate::materialize::terminate(materializer).await;
    let mut materializer = s.materializer();
    while down.elapsed() < OUTAGE {
        tokio::time::sleep(Duration::from_secs(1)).await;
        still_running(&mut connector.child, "connector");
        still_running(&mut materializer, "materializer");
    }
    registry.start_again().await;
    writer.stop().await;
    s.verify("registry outage", 1).await;
    let added: i64 = target
        .query_one(
            "SELECT count(*) FROM information_schema.columns
             WHERE table_schema = 'mirror' AND table_name = 'customers' AND column_name = 'loyalty'",
            &[],
        )
        .await
        .expect("columns")
        .get(0);
    assert_eq!(
        added, 1,
        "the column added during the outage never reached the mirror"
    );
    assert_eq!(connector.terminate().await, 0);
    assert_eq!(crate::materialize::terminate(materializer).await, Some(0));
    source_db.drop_db().await;
    target_db.drop_db().await;
    store.drop_db().await;
}

/// `source.give_up_after_secs`: a connector whose source never answers
/// stops with the last error once the outage has lasted that long; one
/// without the setting still retries then.
#[tokio::test]
async fn a_connector_gives_up_once_an_outage_outlasts_give_up_after_secs() {
    let stack = support::stack();
    // Nothing listens there: every attempt is refused at once.
    let (closed, secret) = (support::free_port(), "give-up-secret");
    let url = format!("postgres://pgcdc:{secret}@127.0.0.1:{closed}/nowhere");
    let toml = support::pipeline_toml(&stack, &url, "give_up", &["public.t"]);
    let limited = support::ConfigFile::write(
        &toml.replace("[source]\n", "[source]\ngive_up_after_secs = 4\n"),
    );
    let unlimited = support::ConfigFile::write(&toml);
    let mut forever = support::ConnectorProcess::start(&unlimited);
    let started = Instant::now();
    let run = tokio::time::timeout(
        Duration::from_secs(60),
        support::pgcdc(&["run", "--config", limited.arg()]),
    )
    .await
    .expect("the connector did not give up within 60 s");
    let took = started.elapsed();
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stderr
            .contains("gave up after an outage of 4 s (source.give_up_after_secs = 4); the last error: postgres:"),
        "{}",
        run.stderr
    );
    // Attempts at 0, 1, 3 s, then one at the limit itself.
    assert_eq!(
        run.stderr
            .matches("restarting from the slot's confirmed LSN")
            .count(),
        3,
        "{}",
        run.stderr
    );
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(30),
        "gave up after {took:?}"
    );
    assert!(!run.all_output().contains(secret), "{}", run.all_output());
    still_running(&mut forever.child, "connector without give_up_after_secs");
    assert!(
        forever
            .log()
            .contains("restarting from the slot's confirmed LSN"),
        "{}",
        forever.log()
    );
    assert_eq!(forever.terminate().await, 0);
}

/// `target.give_up_after_secs`: a materializer whose target database
/// never answers at start-up stops with the last error once it has waited
/// that long; one without the setting still waits then.
#[tokio::test]
async fn a_materializer_gives_up_on_a_target_absent_at_start_up_after_give_up_after_secs() {
    let stack = support::stack();
    let (closed, secret) = (support::free_port(), "give-up-target-secret");
    let toml = format!(
        "{}\n[target]\nurl = \"postgres://pgcdc:{secret}@127.0.0.1:{closed}/nowhere\"\n",
        support::pipeline_toml(&stack, &stack.source_url, "give_up_target", &["public.t"])
    );
    let limited = support::ConfigFile::write(
        &toml.replace("[target]\n", "[target]\ngive_up_after_secs = 3\n"),
    );
    let unlimited = support::ConfigFile::write(&toml);
    let log = std::env::temp_dir().join(support::unique("give_up_target_log"));
    let mut forever = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
        .args(["materialize", "--config", unlimited.arg()])
        .stderr(std::fs::File::create(&log).expect("log file"))
        .kill_on_drop(true)
        .spawn()
        .expect("spawn pgcdc materialize");
    let started = Instant::now();
    let run = tokio::time::timeout(
        Duration::from_secs(60),
        support::pgcdc(&["materialize", "--config", limited.arg()]),
    )
    .await
    .expect("the materializer did not give up within 60 s");
    let took = started.elapsed();
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stderr.contains(
            "gave up after 3 s without the target database at start-up (target.give_up_after_secs = 3); the last error: target:"
        ),
        "{}",
        run.stderr
    );
    // Waits of 0.4, 0.8 and 1.6 s, then (unless the attempts took the
    // last 0.2 s) one cut to reach 3 s.
    let waits = run
        .stderr
        .matches("target database not reachable at start-up; waiting for it")
        .count();
    assert!((3..=4).contains(&waits), "{waits} waits: {}", run.stderr);
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(30),
        "gave up after {took:?}"
    );
    assert!(!run.all_output().contains(secret), "{}", run.all_output());
    still_running(&mut forever, "materializer without give_up_after_secs");
    let waited = std::fs::read_to_string(&log).expect("the log");
    assert!(
        waited.contains("target database not reachable at start-up; waiting for it"),
        "{waited}"
    );
    assert_eq!(crate::materialize::terminate(forever).await, Some(0));
    let _ = std::fs::remove_file(&log);
}
