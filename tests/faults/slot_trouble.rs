//! Slot trouble: a slot dropped outside pgcdc, and a slot Postgres
//! invalidated. Each stops the connector with a clear error, `pgcdc check`
//! reports it, and the documented recovery (README, "Slot trouble") brings
//! the read models back to the source:
//!
//! ```text
//!  pgcdc slot drop --yes ──► pgcdc run (new slot, new snapshot) ──► the materializer's sweep
//!                                                             (or pgcdc rebuild --from snapshot)
//! ```

use std::time::Duration;

use super::{Scenario, Writer, LOGICAL};
use crate::support::{self, ScratchCluster, TestDb};

/// Streams for a while under the writer (seeded `seed`), then stops the
/// connector; the materializer (logging to `log`, if given) and the
/// writer go on.
async fn streamed_then_stopped(
    s: &Scenario,
    seed: u64,
    log: Option<&std::path::Path>,
) -> (tokio::process::Child, Writer) {
    let connector = s.connector();
    let materializer = match log {
        Some(log) => s.materializer_logging_to(log),
        None => s.materializer(),
    };
    support::wait_snapshot_completed(&s.parsed).await;
    let writer = Writer::start(&s.source_url, seed);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(connector.terminate().await, 0);
    (materializer, writer)
}

/// How the read models get rid of rows deleted while no slot captured.
#[derive(PartialEq)]
enum Recovery {
    /// The materializer removes them once the new snapshot is applied.
    Sweep,
    /// `pgcdc rebuild` from the new snapshot, as well.
    Rebuild,
}

/// `pgcdc run` refuses with `error`, and `pgcdc check` fails its slot
/// line with `check`; then the recovery, with the writer still writing.
async fn refused_then_recovered(
    s: &Scenario,
    scenario: &str,
    error: &str,
    check: &str,
    writer: Writer,
    recovery: Recovery,
) {
    let config = s.config.arg();
    let run = support::pgcdc(&["run", "--config", config]).await;
    assert_ne!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stderr.contains(error) && run.stderr.contains("pgcdc slot drop"),
        "{}",
        run.stderr
    );
    let checked = support::pgcdc(&["check", "--config", config]).await;
    assert_eq!(checked.code, 2, "{}", checked.all_output());
    let line = checked.check_line("postgres.slot").unwrap_or_default();
    assert!(
        line.starts_with("FAIL") && line.contains(check),
        "{}",
        checked.stdout
    );

    let dropped = support::pgcdc(&["slot", "drop", "--config", config, "--yes"]).await;
    assert_eq!(dropped.code, 0, "{}", dropped.all_output());
    assert!(dropped.stdout.contains("recorded"), "{}", dropped.stdout);
    let connector = s.connector();
    // The drop's marker first, then the new snapshot's.
    support::wait_snapshot_completed(&s.parsed).await;
    writer.stop().await;
    let source = support::connect(&s.source_url).await;
    support::wait_caught_up(&source, &s.name).await;
    // Rows deleted while no slot captured them are in no snapshot and
    // have no delete in the log.
    if recovery == Recovery::Rebuild {
        // The rebuild from the new slot's snapshot removes them from the
        // mirrors, while the materializer (still catching up on the old
        // history, which is the point) keeps running.
        let rebuilt = support::pgcdc(&[
            "rebuild",
            "--config",
            config,
            "--read-model",
            "customer_stats",
        ])
        .await;
        assert_eq!(rebuilt.code, 0, "{}", rebuilt.all_output());
        println!("{}", rebuilt.stdout);
    }
    // Otherwise the materializer removes them once it has applied the new
    // snapshot: the mirrors and read models converge on the source.
    s.verify(scenario, 1).await;
    // Under a truncate watermark at the new snapshot's floor.
    let lsn = support::initial_marker(&s.parsed)
        .await
        .consistent_point
        .expect("the new snapshot's consistent point");
    // (After a rebuild, the sweep's round may come later.)
    let target = support::connect(&s.target_url).await;
    support::wait_for(
        "the mirrors' watermarks at the new snapshot",
        Duration::from_secs(120),
        async || {
            target
                .query_one(
                    "SELECT count(*) FROM pgcdc_state.truncations
                     WHERE mirror IN ('\"mirror\".\"orders\"', '\"mirror\".\"customers\"')
                       AND commit_lsn = ($1::text::pg_lsn - '0/0'::pg_lsn)::bigint AND seq = -1",
                    &[&lsn],
                )
                .await
                .expect("truncations")
                .get::<_, i64>(0)
                == 2
        },
    )
    .await;
    assert_eq!(connector.terminate().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_dropped_outside_pgcdc_is_refused_reported_and_recovered() {
    let stack = support::stack();
    let (s, source_db, target_db) = Scenario::on_stack(
        &stack,
        "fault_drop",
        &stack.brokers,
        &stack.registry_url,
        20_000,
    )
    .await;
    let log = tempfile::NamedTempFile::new().expect("a log file");
    let (materializer, writer) = streamed_then_stopped(&s, 0xd209_5107, Some(log.path())).await;
    source_db
        .admin()
        .await
        .execute("SELECT pg_drop_replication_slot($1)", &[&s.name])
        .await
        .expect("drop the slot");
    // Changes go on (deletes among them) while no slot captures them;
    // these orders surely had mirror rows. More of them than one sweep
    // transaction removes (10,000): the sweep goes in chunks.
    let deleted = support::connect(&s.source_url)
        .await
        .execute(
            "DELETE FROM orders WHERE id IN (SELECT id FROM orders ORDER BY id LIMIT 12000)",
            &[],
        )
        .await
        .expect("delete");
    assert_eq!(deleted, 12_000);
    tokio::time::sleep(Duration::from_secs(3)).await;
    refused_then_recovered(
        &s,
        "dropped slot",
        "is gone",
        "dropped outside pgcdc",
        writer,
        Recovery::Sweep,
    )
    .await;
    assert_eq!(crate::materialize::terminate(materializer).await, Some(0));
    let logged = std::fs::read_to_string(log.path()).expect("the materializer's log");
    assert!(
        logged.contains("removing rows the new snapshot did not read, in chunks"),
        "the sweep did not go in chunks:\n{logged}"
    );
    source_db.drop_db().await;
    target_db.drop_db().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_is_refused_reported_and_recovered() {
    let stack = support::stack();
    let cluster = ScratchCluster::start(
        &[
            &LOGICAL[..],
            &[
                "max_slot_wal_keep_size = 1MB",
                "min_wal_size = 32MB",
                "max_wal_size = 64MB",
            ],
        ]
        .concat(),
    );
    let source_url = cluster.url("postgres");
    let target_db = TestDb::create(&stack, "fault_lost_tgt").await;
    let name = support::unique("fault_lost");
    let s = Scenario::prepare(
        &name,
        &source_url,
        &source_url,
        &target_db.url,
        &target_db.admin_url,
        &stack.brokers,
        &stack.registry_url,
        20_000,
    )
    .await;
    let (materializer, writer) = streamed_then_stopped(&s, 0x1057_51a7, None).await;
    // WAL grows past max_slot_wal_keep_size while the connector is
    // stopped, until a checkpoint invalidates the slot.
    let client = support::connect(&source_url).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        client
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS public.filler (v text);
                 INSERT INTO public.filler SELECT repeat('x', 500) FROM generate_series(1, 2000);
                 SELECT pg_switch_wal(); CHECKPOINT;",
            )
            .await
            .expect("grow WAL");
        let lost: bool = client
            .query_one(
                "SELECT wal_status = 'lost' FROM pg_replication_slots WHERE slot_name = $1",
                &[&s.name],
            )
            .await
            .expect("wal_status")
            .get(0);
        if lost {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the slot was never invalidated"
        );
    }
    refused_then_recovered(
        &s,
        "invalidated slot",
        "is invalidated",
        "invalidated",
        writer,
        Recovery::Rebuild,
    )
    .await;
    assert_eq!(crate::materialize::terminate(materializer).await, Some(0));
    target_db.drop_db().await;
}
