//! The broker's ingest ceiling, for `scripts/bench stream`: COUNT
//! pre-built keyed messages of SIZE bytes produced with rdkafka to a new
//! topic of PARTITIONS partitions, under the connector's producer settings
//! (idempotent, `acks=all`, `linger.ms=5`, plus every `-X key=value` given,
//! such as the pipeline's `compression.type`), timed from the first send
//! to the last acknowledgement. Prints `<acknowledged> <seconds>`.
//!
//! With `--replay TOPIC[,TOPIC...]` in place of SIZE, the messages are the
//! keys and values those topics hold (read into memory first, outside the
//! figures), produced in their order and repeated up to COUNT: the
//! connector's own bytes, which compress as they do (a constant payload
//! compresses to almost nothing).
//!
//! With `--cpu-of PID` it also prints the CPU seconds (user + sys) that
//! it and that process (the broker) spent in the timed span alone:
//! `<acknowledged> <seconds> <own cpu> <PID's cpu>`. A replay's reading
//! would otherwise count as producing.
//!
//! A few warm-up messages go first, outside the figures. With `--rate R`
//! it sends at R messages a second instead (one burst
//! every 10 ms) and prints `<acknowledged> <seconds> <p50> <p99> <max>`,
//! each message's send-to-acknowledgement time in milliseconds: the part
//! of the commit-to-ack latency that librdkafka and the broker take.
//!
//! ```text
//! cargo run --release --example bench_ingest -- BROKERS TOPIC COUNT SIZE [PARTITIONS] [--rate R] [-X key=value ...]
//! cargo run --release --example bench_ingest -- BROKERS TOPIC COUNT --replay TOPICS [PARTITIONS] [--cpu-of PID] [-X key=value ...]
//! ```
//!
//! An example rather than a bench target: `cargo test` builds examples,
//! so this cannot rot between benchmark runs.

use pgcdc::sink::CreateClient as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{BaseRecord, DeliveryResult, Producer, ProducerContext, ThreadedProducer};
use rdkafka::{ClientContext, Message, Offset, TopicPartitionList};

#[derive(Default)]
struct Acks {
    ok: AtomicU64,
    failed: AtomicU64,
    /// Send-to-ack times (µs), in latency mode.
    latencies: Mutex<Vec<u64>>,
    started: Option<Instant>,
}

struct Counter(Arc<Acks>);

/// The opaque of a warm-up message.
const WARMUP: usize = usize::MAX;

impl ClientContext for Counter {}

impl ProducerContext for Counter {
    /// Microseconds since the run started, at the send.
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, sent_us: usize) {
        let n = if result.is_ok() {
            &self.0.ok
        } else {
            &self.0.failed
        };
        n.fetch_add(1, Ordering::Relaxed);
        if sent_us == WARMUP {
            return;
        }
        if let Some(started) = self.0.started {
            let now = started.elapsed().as_micros() as u64;
            if let Ok(mut l) = self.0.latencies.lock() {
                l.push(now.saturating_sub(sent_us as u64));
            }
        }
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: bench_ingest BROKERS TOPIC COUNT (SIZE | --replay TOPICS) [PARTITIONS] [--rate R] [--cpu-of PID] [-X key=value ...]"
    );
    std::process::exit(2)
}

struct Args {
    brokers: String,
    topic: String,
    count: u64,
    payload: Payload,
    partitions: i32,
    cpu_of: Option<String>,
    rate: Option<u64>,
    properties: Vec<(String, String)>,
}

fn parse_args() -> Args {
    let mut positional = Vec::new();
    let (mut rate, mut properties, mut replay, mut cpu_of) = (None, Vec::new(), None, None);
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--rate" => {
                rate = Some(
                    it.next()
                        .and_then(|r| r.parse().ok())
                        .unwrap_or_else(|| usage()),
                )
            }
            "--replay" => replay = Some(it.next().unwrap_or_else(|| usage())),
            "--cpu-of" => cpu_of = Some(it.next().unwrap_or_else(|| usage())),
            "-X" => {
                let kv = it.next().unwrap_or_else(|| usage());
                let (k, v) = kv.split_once('=').unwrap_or_else(|| usage());
                properties.push((k.to_string(), v.to_string()));
            }
            _ => positional.push(a),
        }
    }
    // SIZE is there unless --replay takes its place.
    let sized = usize::from(replay.is_none());
    if !(3 + sized..=4 + sized).contains(&positional.len()) {
        usage();
    }
    let payload = match replay {
        Some(topics) => Payload::Replay(topics.split(',').map(str::to_string).collect()),
        None => Payload::Constant(positional[3].parse().unwrap_or_else(|_| usage())),
    };
    Args {
        brokers: positional[0].clone(),
        topic: positional[1].clone(),
        count: positional[2].parse().unwrap_or_else(|_| usage()),
        payload,
        cpu_of,
        partitions: positional
            .get(3 + sized)
            .map(|p| p.parse().unwrap_or_else(|_| usage()))
            .unwrap_or(3),
        rate,
        properties,
    }
}

/// A process's user + sys CPU seconds so far (`self` for this one), from
/// /proc: its clock ticks are USER_HZ, 100 on Linux.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    // The fields after the command name, which may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let tick = |i: usize| -> f64 { fields.get(i).and_then(|f| f.parse().ok()).unwrap_or(0.0) };
    (tick(11) + tick(12)) / 100.0
}

/// What the messages carry.
enum Payload {
    /// SIZE bytes of one value.
    Constant(usize),
    /// The messages these topics hold.
    Replay(Vec<String>),
}

/// A message's key and value (`None`: null, as a tombstone's value).
type Sample = (Option<Box<[u8]>>, Option<Box<[u8]>>);

/// Every message of `topics`, partition after partition, up to each
/// partition's high watermark as it is now.
fn read_topics(brokers: &str, topics: &[String]) -> Vec<Sample> {
    let consumer: BaseConsumer<pgcdc::sink::Quiet> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "bench_ingest_replay")
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .client()
        .unwrap_or_else(|e| panic!("replay consumer: {e}"));
    let timeout = Duration::from_secs(30);
    let mut samples = Vec::new();
    for topic in topics {
        let metadata = consumer
            .fetch_metadata(Some(topic), timeout)
            .unwrap_or_else(|e| panic!("metadata of {topic}: {e}"));
        let partitions = metadata
            .topics()
            .first()
            .map(|t| t.partitions().len() as i32)
            .filter(|n| *n > 0)
            .unwrap_or_else(|| panic!("topic {topic} has no partitions"));
        for p in 0..partitions {
            let (low, high) = consumer
                .fetch_watermarks(topic, p, timeout)
                .unwrap_or_else(|e| panic!("watermarks of {topic}/{p}: {e}"));
            if high <= low {
                continue;
            }
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(topic, p, Offset::Offset(low))
                .unwrap_or_else(|e| panic!("assign {topic}/{p}: {e}"));
            consumer
                .assign(&tpl)
                .unwrap_or_else(|e| panic!("assign {topic}/{p}: {e}"));
            loop {
                let m = match consumer.poll(timeout) {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => panic!("read {topic}/{p}: {e}"),
                    None => panic!("read {topic}/{p}: nothing within {timeout:?}"),
                };
                samples.push((m.key().map(Box::from), m.payload().map(Box::from)));
                if m.offset() + 1 >= high {
                    break;
                }
            }
        }
    }
    assert!(!samples.is_empty(), "{topics:?} hold no messages");
    samples
}

fn quantile(sorted: &[u64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i] as f64 / 1000.0
}

#[tokio::main]
async fn main() {
    let args = parse_args();
    let (brokers, topic) = (&args.brokers, &args.topic);
    let admin: AdminClient<pgcdc::sink::Quiet> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .client()
        .unwrap_or_else(|e| panic!("admin client: {e}"));
    let created = admin
        .create_topics(
            &[NewTopic::new(
                topic,
                args.partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await
        .unwrap_or_else(|e| panic!("create topic {topic}: {e}"));
    for r in created {
        if let Err((t, e)) = r {
            panic!("create topic {t}: {e}");
        }
    }

    let acks = Arc::new(Acks {
        started: args.rate.map(|_| Instant::now()),
        ..Acks::default()
    });
    let mut cc = ClientConfig::new();
    cc.set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "5");
    for (k, v) in &args.properties {
        cc.set(k, v);
    }
    let producer: ThreadedProducer<Counter> = cc
        .client_with(Counter(acks.clone()))
        .unwrap_or_else(|e| panic!("producer: {e}"));
    let samples = match &args.payload {
        Payload::Constant(size) => vec![(None, Some(vec![0x5a_u8; *size].into_boxed_slice()))],
        Payload::Replay(topics) => read_topics(brokers, topics),
    };
    let payload = samples[0].1.as_deref().unwrap_or_default();
    // Warm-up, outside the figures: the new topic's metadata and leaders,
    // and the idempotent producer's id.
    for i in 0..(args.partitions as u64 * 4) {
        let key = (u64::MAX - i).to_be_bytes();
        let record = BaseRecord::with_opaque_to(topic, WARMUP)
            .key(&key[..])
            .payload(payload);
        producer
            .send(record)
            .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
    }
    producer
        .flush(Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("flush: {e}"));
    acks.ok.store(0, Ordering::Relaxed);
    let cpu_before = args
        .cpu_of
        .as_deref()
        .map(|pid| (cpu_seconds("self"), cpu_seconds(pid)));
    let started = Instant::now();
    // Latency mode: a burst every 10 ms, as the latency load commits.
    let per_tick = args.rate.map(|r| (r / 100).max(1));
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    for i in 0..args.count {
        if let Some(n) = per_tick {
            if i % n == 0 {
                tick.tick().await;
            }
        }
        let (key, value) = &samples[(i % samples.len() as u64) as usize];
        let counted = i.to_be_bytes();
        let sent_us = acks.started.map_or(0, |s| s.elapsed().as_micros() as usize);
        let mut record =
            BaseRecord::with_opaque_to(topic, sent_us).key(key.as_deref().unwrap_or(&counted[..]));
        record.payload = value.as_deref();
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
    if args.rate.is_some() {
        let mut l = acks.latencies.lock().map(|l| l.clone()).unwrap_or_default();
        l.sort_unstable();
        println!(
            "{ok} {seconds:.3} {:.1} {:.1} {:.1}",
            quantile(&l, 0.5),
            quantile(&l, 0.99),
            quantile(&l, 1.0)
        );
    } else if let (Some(pid), Some((own, theirs))) = (args.cpu_of.as_deref(), cpu_before) {
        println!(
            "{ok} {seconds:.3} {:.2} {:.2}",
            cpu_seconds("self") - own,
            cpu_seconds(pid) - theirs
        );
    } else {
        println!("{ok} {seconds:.3}");
    }
}
