//! Fairness between tenants in the materializer's batch formation
//! (`target.tenant_quota`).
//!
//! Guarantees:
//! - **A flood waits behind the others, not the reverse.** Each tenant
//!   (the `pgcdc.tenant` header) has a token bucket; a record beyond its
//!   tenant's bucket waits in memory, so the consumer reads on and the
//!   records behind it (other tenants') go into the batch first.
//! - **A tenant's records keep their order.** A tenant with waiting
//!   records queues every later one behind them; waiting records leave in
//!   the order they were read.
//! - **Offsets never pass a waiting record.** A partition's commit point is
//!   its first waiting record's offset, or one past the last record read;
//!   after a crash the group re-reads from there, and the position guard
//!   skips what was applied already.
//! - **Never idle.** Room left in a batch goes to waiting records,
//!   round-robin by tenant, tokens or not: a quota orders work, it does
//!   not throttle an otherwise idle materializer.
//! - **A rebalance loses nothing.** Waiting records of a partition given
//!   away stay and are applied here (the position guard makes that
//!   harmless next to the new owner's copy); its offsets are the new
//!   owner's to commit. Paused partitions stay on the list to resume, as
//!   librdkafka keeps a partition paused across a re-assignment.
//! - **Bounded memory.** At `max_deferred` waiting records, the partitions
//!   that hold waiting records are paused until half of them have been
//!   applied. On one shared topic that is every partition (fairness falls
//!   back to order of arrival meanwhile); with the noisy tenant routed to
//!   a dedicated topic, only that topic's partitions pause.
//! - **Bounded metrics.** The first `target.tenant_labels` tenants seen
//!   get series of their own on the per-tenant metrics; the rest share
//!   [`OTHER_TENANTS`].
//!
//! ```text
//!  consumer ──► tenant header ──► tokens left? ──yes──► batch ──► apply ──► commit points
//!                                     │ no                ▲
//!                                     └──► waiting (FIFO per tenant) ─┘ tokens, or room left
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::time::Instant;

use rdkafka::message::{Headers, OwnedMessage};
use rdkafka::Message;

use crate::config::TenantQuotaConfig;
use crate::observe;
use crate::partitioning::{Fingerprints, TENANT_HEADER};

/// A partition: topic and number.
pub type Partition = (String, i32);

/// Buckets kept at most; beyond, full idle ones are dropped (a full bucket
/// is what a new one starts as, so nothing changes for them).
const MAX_BUCKETS: usize = 10_000;

struct Bucket {
    tokens: f64,
    at: Instant,
    rate: f64,
    burst: f64,
}

impl Bucket {
    fn take(&mut self, now: Instant) -> bool {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.at = now;
    }

    fn full(&self) -> bool {
        self.tokens >= self.burst
    }
}

/// Batch formation's tenant state. Without a quota every record goes
/// straight to the batch, and only the commit points are kept.
pub struct Fairness {
    quota: Option<TenantQuotaConfig>,
    labels: TenantLabels,
    buckets: HashMap<Vec<u8>, Bucket>,
    waiting: HashMap<Vec<u8>, VecDeque<OwnedMessage>>,
    /// Tenants with waiting records, in round-robin order.
    turn: VecDeque<Vec<u8>>,
    count: usize,
    /// Offsets of waiting records, per partition.
    held: BTreeMap<Partition, BTreeSet<i64>>,
    /// One past the last offset read, per partition with waiting records
    /// (the batch itself tells the others').
    high: BTreeMap<Partition, i64>,
    paused: Vec<Partition>,
    /// Records deferred since the last [`Fairness::report`], by tenant.
    deferred: HashMap<Vec<u8>, u64>,
    /// Series whose waiting count the last report showed.
    shown: Vec<String>,
}

impl std::fmt::Debug for Fairness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fairness")
            .field("quota", &self.quota)
            .field("waiting", &self.count)
            .field("paused", &self.paused.len())
            .finish_non_exhaustive()
    }
}

/// The tenant of a record, from its `pgcdc.tenant` header.
pub fn tenant_of(m: &OwnedMessage) -> Option<&[u8]> {
    m.headers()?
        .iter()
        .find(|h| h.key == TENANT_HEADER)
        .and_then(|h| h.value)
}

/// A tenant as the metrics show it: its text, or under
/// `hot_keys.redact_keys` a fingerprint (as hot keys are shown).
fn label(tenant: &[u8], redact: Option<&Fingerprints>) -> String {
    match redact {
        Some(prints) => prints.of(crate::partitioning::key_hash(tenant)),
        None => String::from_utf8_lossy(tenant).into_owned(),
    }
}

/// The `tenant` label of the tenants beyond `target.tenant_labels`.
pub const OTHER_TENANTS: &str = "_other";

/// How the per-tenant metrics name tenants: the first `max` seen by
/// [`label`], each on series of its own, and every later one as
/// [`OTHER_TENANTS`], so that the number of series stays bounded however
/// many tenants come.
#[derive(Debug)]
pub struct TenantLabels {
    redact: Option<Fingerprints>,
    max: usize,
    named: HashSet<Vec<u8>>,
}

impl TenantLabels {
    /// `redact`: show tenants as these fingerprints (`hot_keys.redact_keys`).
    pub fn new(redact: Option<Fingerprints>, max: usize) -> TenantLabels {
        TenantLabels {
            redact,
            max,
            named: HashSet::new(),
        }
    }

    /// Names `tenant` if it has no name yet and there is room; whether
    /// it has one.
    fn see(&mut self, tenant: &[u8]) -> bool {
        if self.named.contains(tenant) {
            return true;
        }
        if self.named.len() >= self.max {
            return false;
        }
        self.named.insert(tenant.to_vec());
        true
    }

    fn of(&mut self, tenant: &[u8]) -> String {
        if self.see(tenant) {
            label(tenant, self.redact.as_ref())
        } else {
            OTHER_TENANTS.to_string()
        }
    }
}

impl Fairness {
    pub fn new(quota: Option<TenantQuotaConfig>, labels: TenantLabels) -> Fairness {
        Fairness {
            quota,
            labels,
            buckets: HashMap::new(),
            waiting: HashMap::new(),
            turn: VecDeque::new(),
            count: 0,
            held: BTreeMap::new(),
            high: BTreeMap::new(),
            paused: Vec::new(),
            deferred: HashMap::new(),
            shown: Vec::new(),
        }
    }

    /// Records waiting, in all.
    pub fn waiting(&self) -> usize {
        self.count
    }

    /// Whether the consumer should stop reading into this batch.
    pub fn full(&self) -> bool {
        self.quota
            .as_ref()
            .is_some_and(|q| self.count >= q.max_deferred)
    }

    fn bucket(&mut self, tenant: &[u8], now: Instant) -> &mut Bucket {
        if self.buckets.len() >= MAX_BUCKETS && !self.buckets.contains_key(tenant) {
            for b in self.buckets.values_mut() {
                b.refill(now);
            }
            self.buckets.retain(|_, b| !b.full());
        }
        let q = self.quota.as_ref();
        self.buckets.entry(tenant.to_vec()).or_insert_with(|| {
            let rate = q
                .and_then(|q| {
                    q.tenants
                        .get(String::from_utf8_lossy(tenant).as_ref())
                        .copied()
                        .or(Some(q.rate_per_sec))
                })
                .unwrap_or(f64::INFINITY);
            let burst = q.and_then(|q| q.burst).unwrap_or(rate).max(1.0);
            Bucket {
                tokens: burst,
                at: now,
                rate,
                burst,
            }
        })
    }

    /// A record read from the consumer: returned to go into the batch now,
    /// or kept to wait behind its tenant's quota.
    pub fn admit(&mut self, m: OwnedMessage, now: Instant) -> Option<OwnedMessage> {
        if self.quota.is_none() {
            return Some(m);
        }
        let Some(tenant) = tenant_of(&m).map(<[u8]>::to_vec) else {
            return Some(m);
        };
        if !self.waiting.contains_key(&tenant) && self.bucket(&tenant, now).take(now) {
            return Some(m);
        }
        let partition = (m.topic().to_string(), m.partition());
        self.held
            .entry(partition.clone())
            .or_default()
            .insert(m.offset());
        let high = self.high.entry(partition).or_default();
        *high = (*high).max(m.offset() + 1);
        *self.deferred.entry(tenant.clone()).or_default() += 1;
        let queue = self.waiting.entry(tenant.clone()).or_default();
        if queue.is_empty() {
            self.turn.push_back(tenant);
        }
        queue.push_back(m);
        self.count += 1;
        None
    }

    /// Up to `room` waiting records for a batch, round-robin by tenant:
    /// those their tenants' tokens cover, and with `spare` the rest too.
    pub fn release(&mut self, room: usize, spare: bool, now: Instant) -> Vec<OwnedMessage> {
        let mut out = Vec::new();
        let mut dry = 0;
        while out.len() < room && dry < self.turn.len() {
            let Some(tenant) = self.turn.pop_front() else {
                break;
            };
            if !spare && !self.bucket(&tenant, now).take(now) {
                self.turn.push_back(tenant);
                dry += 1;
                continue;
            }
            dry = 0;
            let queue = self.waiting.get_mut(&tenant);
            let Some(m) = queue.and_then(VecDeque::pop_front) else {
                self.waiting.remove(&tenant);
                continue;
            };
            self.count -= 1;
            let partition = (m.topic().to_string(), m.partition());
            if let Some(offsets) = self.held.get_mut(&partition) {
                offsets.remove(&m.offset());
                if offsets.is_empty() {
                    self.held.remove(&partition);
                }
            }
            out.push(m);
            if self.waiting.get(&tenant).is_some_and(|q| !q.is_empty()) {
                self.turn.push_back(tenant);
            } else {
                self.waiting.remove(&tenant);
            }
        }
        out
    }

    /// The offsets to commit once `batch` is durable, for the partitions
    /// it touched: a partition's first waiting record, or one past the
    /// last record read from it.
    pub fn commit_points(&mut self, batch: &[OwnedMessage]) -> BTreeMap<Partition, i64> {
        let mut next: BTreeMap<Partition, i64> = BTreeMap::new();
        for m in batch {
            let e = next
                .entry((m.topic().to_string(), m.partition()))
                .or_default();
            *e = (*e).max(m.offset() + 1);
        }
        for (partition, offset) in next.iter_mut() {
            let high = self
                .high
                .get(partition)
                .map_or(*offset, |h| (*h).max(*offset));
            match self.held.get(partition).and_then(|o| o.first()) {
                Some(first) => {
                    self.high.insert(partition.clone(), high);
                    *offset = *first;
                }
                None => {
                    self.high.remove(partition);
                    *offset = high;
                }
            }
        }
        next
    }

    /// Partitions to pause now (the buffer is full) and to resume (it
    /// drained to half).
    pub fn flow(&mut self) -> (Vec<Partition>, Vec<Partition>) {
        let Some(q) = &self.quota else {
            return (Vec::new(), Vec::new());
        };
        if self.count >= q.max_deferred {
            let pause: Vec<Partition> = self
                .held
                .keys()
                .filter(|p| !self.paused.contains(p))
                .cloned()
                .collect();
            self.paused.extend(pause.iter().cloned());
            metrics::gauge!(observe::MATERIALIZE_PAUSED).set(self.paused.len() as f64);
            return (pause, Vec::new());
        }
        if self.count <= q.max_deferred / 2 && !self.paused.is_empty() {
            metrics::gauge!(observe::MATERIALIZE_PAUSED).set(0.0);
            return (Vec::new(), std::mem::take(&mut self.paused));
        }
        (Vec::new(), Vec::new())
    }

    /// Partitions a resume failed for: still paused, to resume next time.
    pub fn still_paused(&mut self, partitions: Vec<Partition>) {
        self.paused.extend(partitions);
        metrics::gauge!(observe::MATERIALIZE_PAUSED).set(self.paused.len() as f64);
    }

    /// Per-tenant lag after a batch: for each tenant in it, the age of its
    /// newest applied record; for each with waiting records, the age of
    /// the oldest of them if greater. Also the waiting counts.
    /// Tenants beyond `target.tenant_labels` are summed under
    /// [`OTHER_TENANTS`] (their largest lag).
    pub fn report(&mut self, batch: &[OwnedMessage], now_ms: i64) {
        let labels = &mut self.labels;
        // Names go to tenants in the order their records were read: the
        // batch's, then those waiting.
        let mut lag: HashMap<&[u8], i64> = HashMap::new();
        for m in batch {
            let Some(tenant) = tenant_of(m) else { continue };
            labels.see(tenant);
            let Some(at) = m.timestamp().to_millis() else {
                continue;
            };
            let e = lag.entry(tenant).or_insert(i64::MAX);
            *e = (*e).min((now_ms - at).max(0));
        }
        for tenant in &self.turn {
            labels.see(tenant);
        }
        let mut deferred: HashMap<String, u64> = HashMap::new();
        for (tenant, n) in self.deferred.drain() {
            *deferred.entry(labels.of(&tenant)).or_default() += n;
        }
        for (series, n) in deferred {
            metrics::counter!(observe::TENANT_DEFERRED, "tenant" => series).increment(n);
        }
        let mut waiting: HashMap<String, usize> = HashMap::new();
        for (tenant, queue) in &self.waiting {
            let oldest = queue.front().and_then(|m| m.timestamp().to_millis());
            if let Some(at) = oldest {
                let e = lag.entry(tenant).or_insert(0);
                *e = (*e).max((now_ms - at).max(0));
            }
            *waiting.entry(labels.of(tenant)).or_default() += queue.len();
        }
        for (series, n) in &waiting {
            metrics::gauge!(observe::TENANT_WAITING, "tenant" => series.clone()).set(*n as f64);
        }
        // Series whose last waiting record left since the last report.
        for series in self.shown.iter().filter(|s| !waiting.contains_key(*s)) {
            metrics::gauge!(observe::TENANT_WAITING, "tenant" => series.clone()).set(0.0);
        }
        self.shown = waiting.into_keys().collect();
        let mut lags: HashMap<String, i64> = HashMap::new();
        for (tenant, ms) in lag {
            let e = lags.entry(labels.of(tenant)).or_insert(0);
            *e = (*e).max(ms);
        }
        for (series, ms) in lags {
            metrics::gauge!(observe::TENANT_LAG, "tenant" => series).set(ms as f64 / 1e3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::Timestamp;
    use std::time::Duration;

    fn record(tenant: &str, partition: i32, offset: i64) -> OwnedMessage {
        let headers = OwnedHeaders::new().insert(Header {
            key: TENANT_HEADER,
            value: Some(tenant.as_bytes()),
        });
        OwnedMessage::new(
            Some(vec![1]),
            Some(vec![2]),
            "t".into(),
            Timestamp::CreateTime(1_000),
            partition,
            offset,
            Some(headers),
        )
    }

    fn quota(rate: f64, max: usize) -> Fairness {
        Fairness::new(
            Some(TenantQuotaConfig {
                rate_per_sec: rate,
                burst: Some(2.0),
                max_deferred: max,
                tenants: BTreeMap::new(),
            }),
            TenantLabels::new(None, 1000),
        )
    }

    fn tenants(batch: &[OwnedMessage]) -> Vec<String> {
        batch
            .iter()
            .map(|m| label(tenant_of(m).expect("tenant"), None))
            .collect()
    }

    #[test]
    fn a_flood_beyond_its_bucket_waits_and_the_others_go_first() {
        let now = Instant::now();
        let mut f = quota(1.0, 100);
        let mut batch = Vec::new();
        for o in 0..6 {
            batch.extend(f.admit(record("big", 0, o), now));
        }
        batch.extend(f.admit(record("small", 0, 6), now));
        // Burst 2: two of big's, then small's; four wait.
        assert_eq!(tenants(&batch), ["big", "big", "small"]);
        assert_eq!(f.waiting(), 4);
        // The partition's commit point stops at the first waiting record.
        assert_eq!(f.commit_points(&batch).get(&("t".into(), 0)), Some(&2));
        // No tokens yet: nothing leaves unless there is spare room.
        assert!(f.release(10, false, now).is_empty());
        let later = now + Duration::from_secs(1);
        let one = f.release(10, false, later);
        assert_eq!(one.iter().map(Message::offset).collect::<Vec<_>>(), [2]);
        assert_eq!(f.commit_points(&one).get(&("t".into(), 0)), Some(&3));
        // Spare room takes the rest, in order.
        let rest = f.release(10, true, later);
        assert_eq!(
            rest.iter().map(Message::offset).collect::<Vec<_>>(),
            [3, 4, 5]
        );
        // Nothing waits: one past the last record read (small's, offset 6).
        assert_eq!(f.commit_points(&rest).get(&("t".into(), 0)), Some(&7));
        assert_eq!(f.waiting(), 0);
    }

    #[test]
    fn a_tenant_with_waiting_records_queues_behind_them_even_with_tokens() {
        let now = Instant::now();
        let mut f = quota(1.0, 100);
        for o in 0..3 {
            f.admit(record("a", 0, o), now);
        }
        // Refilled, but offset 2 waits: offset 3 must not overtake it.
        let later = now + Duration::from_secs(5);
        assert!(f.admit(record("a", 0, 3), later).is_none());
        let out = f.release(10, false, later);
        assert_eq!(out.iter().map(Message::offset).collect::<Vec<_>>(), [2, 3]);
    }

    #[test]
    fn spare_room_is_shared_round_robin_and_records_without_a_tenant_never_wait() {
        let now = Instant::now();
        let mut f = quota(0.001, 100);
        for o in 0..6 {
            f.admit(record("a", 0, o), now);
            f.admit(record("b", 1, o), now);
        }
        let plain = OwnedMessage::new(None, None, "t".into(), Timestamp::NotAvailable, 2, 0, None);
        assert!(f.admit(plain, now).is_some());
        let out = f.release(4, true, now);
        assert_eq!(tenants(&out), ["a", "b", "a", "b"]);
    }

    #[test]
    fn a_full_buffer_pauses_the_partitions_holding_waiting_records_until_half_drains() {
        let now = Instant::now();
        let mut f = quota(0.001, 4);
        f.admit(record("a", 0, 0), now);
        f.admit(record("a", 0, 1), now);
        assert!(f.admit(record("x", 3, 0), now).is_some());
        for o in 2..6 {
            f.admit(record("a", 0, o), now);
        }
        assert!(f.full());
        let (pause, resume) = f.flow();
        assert_eq!(pause, vec![("t".to_string(), 0)]);
        assert!(resume.is_empty());
        f.release(1, true, now);
        assert_eq!(f.flow(), (vec![], vec![]), "3 of 4 still wait");
        f.release(1, true, now);
        assert_eq!(f.flow(), (vec![], vec![("t".to_string(), 0)]));
    }

    #[test]
    fn under_redact_keys_the_metrics_show_tenants_as_fingerprints() {
        let unkeyed = Fingerprints::new(&crate::config::HotKeysConfig::default());
        let keyed = Fingerprints::new(&crate::config::HotKeysConfig {
            fingerprint_key: Some(crate::secret::Secret::new("0123456789abcdef")),
            ..Default::default()
        });
        let exported = |redact: Option<&Fingerprints>| {
            let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            let mut f = Fairness::new(
                quota(0.001, 10).quota,
                TenantLabels::new(redact.cloned(), 1000),
            );
            let now = Instant::now();
            // Two records of one tenant: the second waits for the bucket.
            let batch: Vec<_> = (0..3)
                .filter_map(|o| f.admit(record("acme-corp", 0, o), now))
                .collect();
            metrics::with_local_recorder(&recorder, || f.report(&batch, 2_000));
            handle.render()
        };
        let hash = crate::partitioning::key_hash(b"acme-corp");
        let (print, keyed_print) = (unkeyed.of(hash), keyed.of(hash));
        assert_ne!(print, keyed_print);
        let plain = exported(None);
        let redacted = exported(Some(&unkeyed));
        let keyed_redacted = exported(Some(&keyed));
        for name in [
            observe::TENANT_LAG,
            observe::TENANT_WAITING,
            observe::TENANT_DEFERRED,
        ] {
            assert!(
                plain.contains(&format!("{name}{{tenant=\"acme-corp\"}}")),
                "{plain}"
            );
            assert!(
                redacted.contains(&format!("{name}{{tenant=\"{print}\"}}")),
                "{redacted}"
            );
            assert!(
                keyed_redacted.contains(&format!("{name}{{tenant=\"{keyed_print}\"}}")),
                "{keyed_redacted}"
            );
        }
        assert!(!redacted.contains("acme"), "{redacted}");
    }

    #[test]
    fn tenants_beyond_tenant_labels_share_one_series() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let mut f = Fairness::new(quota(0.001, 100).quota, TenantLabels::new(None, 2));
        let now = Instant::now();
        // Each tenant's bucket takes two (its burst); the rest wait: a 1,
        // b 2, c 3 and d 4 waiting.
        let mut batch = Vec::new();
        let mut offset = 0;
        for (tenant, n) in [("a", 3), ("b", 4), ("c", 5), ("d", 6)] {
            for _ in 0..n {
                batch.extend(f.admit(record(tenant, 0, offset), now));
                offset += 1;
            }
        }
        assert_eq!(f.waiting(), 10);
        metrics::with_local_recorder(&recorder, || f.report(&batch, 2_000));
        let shown = handle.render();
        let waiting = |series: &str| {
            let line = format!("{}{{tenant=\"{series}\"}} ", observe::TENANT_WAITING);
            shown
                .lines()
                .find_map(|l| l.strip_prefix(line.as_str()))
                .map(|v| v.trim().to_string())
        };
        assert_eq!(waiting("a").as_deref(), Some("1"), "{shown}");
        assert_eq!(waiting("b").as_deref(), Some("2"), "{shown}");
        assert_eq!(waiting(OTHER_TENANTS).as_deref(), Some("7"), "{shown}");
        assert_eq!(waiting("c"), None, "{shown}");
        assert_eq!(waiting("d"), None, "{shown}");
        for name in [observe::TENANT_LAG, observe::TENANT_DEFERRED] {
            assert!(
                shown.contains(&format!("{name}{{tenant=\"{OTHER_TENANTS}\"}}")),
                "{shown}"
            );
            assert!(!shown.contains("tenant=\"c\""), "{shown}");
        }
    }

    #[test]
    fn without_a_quota_everything_goes_straight_to_the_batch() {
        let now = Instant::now();
        let mut f = Fairness::new(None, TenantLabels::new(None, 1000));
        let batch: Vec<_> = (0..5)
            .filter_map(|o| f.admit(record("a", 0, o), now))
            .collect();
        assert_eq!(batch.len(), 5);
        assert!(!f.full());
        assert_eq!(f.commit_points(&batch).get(&("t".into(), 0)), Some(&5));
    }
}
