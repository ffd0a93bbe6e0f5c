//! A steady insert load for `scripts/bench` (row 5, latency): RATE rows a
//! second into the demo's `orders` for SECONDS, as one transaction every
//! 10 ms (ids from FIRST on, customers 1..=CUSTOMERS). Prints `<rows>
//! <seconds>`: what was written and how long it took, so the caller sees
//! whether the rate held.
//!
//! ```text
//! cargo run --release --example bench_load -- URL RATE SECONDS FIRST CUSTOMERS
//! ```

use std::time::{Duration, Instant};

use tokio_postgres::NoTls;

fn usage() -> ! {
    eprintln!("usage: bench_load URL RATE SECONDS FIRST CUSTOMERS");
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() != 5 {
        usage();
    }
    let url = &args[0];
    let number = |i: usize| -> i64 { args[i].parse().unwrap_or_else(|_| usage()) };
    let (rate, seconds, first, customers) = (number(1), number(2), number(3), number(4));
    let per_tick = (rate / 100).max(1);

    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    tokio::spawn(connection);
    // The stack runs synchronous_commit = off, under which the walsender
    // sees a commit only once the WAL writer flushes it (every 200 ms by
    // default): that would be measured as pgcdc's latency. On is also
    // what a production server runs.
    client
        .batch_execute("SET synchronous_commit = on")
        .await
        .unwrap_or_else(|e| panic!("synchronous_commit: {e}"));
    let insert = client
        .prepare(
            "INSERT INTO orders (id, customer_id, amount, status)
             SELECT g, 1 + g % $3, 1.25, 'new' FROM generate_series($1::int8, $2::int8) g",
        )
        .await
        .unwrap_or_else(|e| panic!("prepare: {e}"));

    // Burst: a late tick is made up at once, so the mean rate holds.
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    let mut next = first;
    for _ in 0..seconds * 100 {
        tick.tick().await;
        client
            .execute(&insert, &[&next, &(next + per_tick - 1), &customers])
            .await
            .unwrap_or_else(|e| panic!("insert: {e}"));
        next += per_tick;
    }
    println!("{} {}", next - first, started.elapsed().as_secs_f64());
}
