//! The broker's ingest ceiling, for `scripts/bench stream`: COUNT
//! pre-built keyed messages of SIZE bytes produced with rdkafka to a new
//! topic of PARTITIONS partitions, under the connector's producer settings
//! (idempotent, `acks=all`, `linger.ms=5`), timed from the first send to
//! the last acknowledgement. Prints `<acknowledged> <seconds>`.
//!
//! ```text
//! cargo run --release --example bench_ingest -- BROKERS TOPIC COUNT SIZE [PARTITIONS]
//! ```
//!
//! An example rather than a bench target: `cargo test` builds examples,
//! so this cannot rot between benchmark runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::ClientContext;

#[derive(Default)]
struct Acks {
    ok: AtomicU64,
    failed: AtomicU64,
}

struct Counter(Arc<Acks>);

impl ClientContext for Counter {}

impl ProducerContext for Counter {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        let n = if result.is_ok() {
            &self.0.ok
        } else {
            &self.0.failed
        };
        n.fetch_add(1, Ordering::Relaxed);
    }
}

fn usage() -> ! {
    eprintln!("usage: bench_ingest BROKERS TOPIC COUNT SIZE [PARTITIONS]");
    std::process::exit(2)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.len() < 4 {
        usage();
    }
    let (brokers, topic) = (&args[0], &args[1]);
    let count: u64 = args[2].parse().unwrap_or_else(|_| usage());
    let size: usize = args[3].parse().unwrap_or_else(|_| usage());
    let partitions: i32 = args
        .get(4)
        .map(|p| p.parse().unwrap_or_else(|_| usage()))
        .unwrap_or(3);

    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap_or_else(|e| panic!("admin client: {e}"));
    let created = admin
        .create_topics(
            &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new(),
        )
        .await
        .unwrap_or_else(|e| panic!("create topic {topic}: {e}"));
    for r in created {
        if let Err((t, e)) = r {
            panic!("create topic {t}: {e}");
        }
    }

    let acks = Arc::new(Acks::default());
    let producer: ThreadedProducer<Counter> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "5")
        .create_with_context(Counter(acks.clone()))
        .unwrap_or_else(|e| panic!("producer: {e}"));
    let payload = vec![0x5a_u8; size];
    let started = Instant::now();
    for i in 0..count {
        let key = i.to_be_bytes();
        let mut record = BaseRecord::to(topic).key(&key[..]).payload(&payload[..]);
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err((e, _)) => panic!("produce: {e}"),
            }
        }
    }
    producer
        .flush(Duration::from_secs(300))
        .unwrap_or_else(|e| panic!("flush: {e}"));
    let seconds = started.elapsed().as_secs_f64();
    let (ok, failed) = (
        acks.ok.load(Ordering::Relaxed),
        acks.failed.load(Ordering::Relaxed),
    );
    assert_eq!(failed, 0, "{failed} messages were not acknowledged");
    println!("{ok} {seconds:.3}");
}
