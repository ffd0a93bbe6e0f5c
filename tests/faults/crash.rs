//! Crash loop: SIGKILL the connector and the materializer at random
//! moments, the first time mid-snapshot, while a workload keeps writing.

use std::time::Duration;

use super::{count, Scenario, Writer};
use crate::materialize::Rng;
use crate::support;

/// Polls until the connector has created its slot (its snapshot begins).
async fn wait_slot(s: &Scenario, source: &tokio_postgres::Client) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while source
        .query_opt(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
            &[&s.name],
        )
        .await
        .expect("slot")
        .is_none()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the connector never created its slot"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_of_connector_and_materializer_loses_and_doubles_nothing() {
    let stack = support::stack();
    let kills = count(5, 20);
    // Large enough that the snapshot takes seconds in a debug build, small
    // enough that the materializer soon works through the snapshots the
    // kills make the connector take again.
    let (s, source_db, target_db) = Scenario::on_stack(
        &stack,
        "fault_crash",
        &stack.brokers,
        &stack.registry_url,
        20_000,
    )
    .await;
    let source = source_db.client().await;
    let writer = Writer::start(&source_db.url, 0x5eed_c4a5);

    let mut connector = s.connector();
    let mut materializer = s.materializer();
    // The first kill lands inside the initial snapshot.
    wait_slot(&s, &source).await;
    let _ = connector.child.start_kill();
    let _ = connector.child.wait().await;
    let mid_snapshot =
        support::initial_marker(&s.parsed).await.phase == pgcdc::snapshot_marker::Phase::Started;
    connector = s.connector();
    // Later kills land while it streams (each one during a snapshot would
    // only make it start the snapshot again).
    support::wait_snapshot_completed(&s.parsed).await;

    let mut rng = Rng(0xc0ff_ee00_d15e_a5e5);
    let (mut connector_kills, mut materializer_kills) = (1, 0);
    while connector_kills < kills || materializer_kills < kills {
        tokio::time::sleep(Duration::from_millis(300 + rng.below(2500))).await;
        let connector_next =
            materializer_kills >= kills || (connector_kills < kills && rng.below(2) == 0);
        if connector_next {
            let _ = connector.child.start_kill(); // SIGKILL
            let _ = connector.child.wait().await;
            connector = s.connector();
            connector_kills += 1;
        } else {
            let _ = materializer.start_kill();
            let _ = materializer.wait().await;
            materializer = s.materializer();
            materializer_kills += 1;
        }
    }
    let transactions = writer.stop().await;
    assert!(
        mid_snapshot,
        "the first kill was meant to land inside the snapshot"
    );
    let tally = s
        .verify("crash loop", connector_kills + materializer_kills)
        .await;
    assert!(tally.written > 0 && transactions > 0);
    assert_eq!(connector.terminate().await, 0);
    assert_eq!(crate::materialize::terminate(materializer).await, Some(0));
    source_db.drop_db().await;
    target_db.drop_db().await;
}
