//! Where each changelog event goes: hot-key detection, salting, routing
//! to a dedicated topic, and the tenant header.
//!
//! Guarantees:
//! - **Per-key order unless salted.** An event goes to the partition
//!   Kafka's Java client would pick for its key (murmur2 of the key bytes
//!   modulo the partition count), the same one librdkafka picks, unless
//!   its table salts and its key is salted right now.
//! - **A salted key spreads over `min(salt_shards, partitions)`
//!   partitions**: its own and the ones after it, shard `s` going to
//!   `(own + s) mod partitions`. The shard comes from the event's
//!   position, so a replay after a crash sends each event where it went
//!   before. Salted events carry the header `pgcdc.shard`. Order between
//!   shards is lost; the materializer's position guard is what keeps an
//!   older change from overwriting a newer one.
//! - **Deletes reach every shard.** On a salting table a delete's
//!   tombstone goes to each of the key's shard partitions, so compaction
//!   cannot keep an older salted value of a deleted key in some other
//!   partition.
//! - **Routing is a function of the key or the tenant.** A declared key
//!   (`dedicated_keys`) or tenant (`dedicated_tenants`) always goes to the
//!   table's dedicated topic, snapshot rows and deletes included (a delete
//!   carries the tenant: the tenant column is in the key or the table is
//!   `REPLICA IDENTITY FULL`, which the connector checks), so a key's
//!   events stay in one topic and keep their order. Changing the lists
//!   moves keys between topics; the position guard orders what arrives
//!   from both.
//! - **The tenant travels as a header** (`pgcdc.tenant`), so the
//!   materializer schedules by tenant without decoding.
//! - **Detection is bounded and never overstates** (see [`sketch`]):
//!   reported rates are lower bounds. It counts streamed inserts, updates
//!   and deletes, not snapshot rows.
//!
//! ```text
//!  event key, tenant ──► dedicated key or tenant? ──► topic (own or dedicated)
//!  event key ──► sketch (rate) ──► declared, or rate ≥ salt_above_per_sec?
//!                                      │ no                │ yes
//!                             own partition      (own + shard(position)) mod n
//! ```

pub mod sketch;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::config::{Config, HotKeysConfig, PartitioningConfig};
use crate::encode::types::Input;
use crate::encode::{Op, Position, TableCodec};
use crate::observe;
use sketch::Sketch;

/// The header naming a salted event's shard.
pub const SHARD_HEADER: &str = "pgcdc.shard";

/// Where one event goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// The dedicated topic, or `None` for the table's own.
    pub topic: Option<Arc<str>>,
    /// An explicit partition, or `None` for the producer's partitioner.
    pub partition: Option<i32>,
    /// The shard of a salted event.
    pub shard: Option<u32>,
    /// Partitions a delete's tombstone goes to (empty: the key's own,
    /// chosen by the producer).
    pub tombstones: Vec<i32>,
}

struct Table {
    config: Option<PartitioningConfig>,
    sketch: Option<Mutex<Sketch>>,
    /// The topic's partition count (0 until known).
    partitions: AtomicI32,
    /// Hashes of the declared `salt_keys`, encoded with the table's codec.
    declared: Mutex<HashSet<u64>>,
    /// The dedicated topic, its partition count, and the hashes of the
    /// `dedicated_keys`.
    dedicated: Option<Arc<str>>,
    dedicated_partitions: AtomicI32,
    dedicated_keys: Mutex<HashSet<u64>>,
    /// The tenant column's index in the table's columns, once known
    /// ([`NO_TENANT`] until then, or without one).
    tenant: AtomicUsize,
    salted: OnceLock<metrics::Counter>,
    /// Keys published as hot last time, to zero when they cool.
    published: Mutex<HashMap<u64, String>>,
}

impl Table {
    /// Whether a key at `rate` is salted: declared, or at the threshold.
    fn salts_key(&self, hash: u64, rate: f64) -> bool {
        self.config.as_ref().is_some_and(|s| {
            s.salt_shards.is_some()
                && (s.salt_above_per_sec.is_some_and(|above| rate >= above)
                    || lock(&self.declared).contains(&hash))
        })
    }

    /// The dedicated topic, if the event's key or tenant goes there.
    fn route(&self, hash: u64, tenant: Option<&[u8]>) -> Option<&Arc<str>> {
        let topic = self.dedicated.as_ref()?;
        let config = self.config.as_ref()?;
        let by_tenant =
            tenant.is_some_and(|t| config.dedicated_tenants.iter().any(|d| d.as_bytes() == t));
        (by_tenant || lock(&self.dedicated_keys).contains(&hash)).then_some(topic)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

const NO_TENANT: usize = usize::MAX;

/// The header carrying an event's tenant (`partitioning.<table>.tenant_column`).
pub const TENANT_HEADER: &str = "pgcdc.tenant";

/// The connector's partitioning decisions, shared by its tasks.
pub struct Partitioner {
    hot: HotKeysConfig,
    prints: Fingerprints,
    tables: HashMap<String, Table>,
    /// Whether some table has a tenant column.
    tenants: bool,
}

impl std::fmt::Debug for Partitioner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Partitioner")
            .field("tables", &self.tables.len())
            .finish_non_exhaustive()
    }
}

/// FNV-1a: keys are short, and the sketch needs no stronger hash.
pub fn key_hash(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A position's shard among `span`; positions differ in their low bits,
/// so they are mixed first (splitmix64).
pub fn shard_of(position: Position, span: u32) -> u32 {
    let mut z = position
        .commit_lsn
        .wrapping_add(position.seq.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z % u64::from(span.max(1))) as u32
}

/// The shortest `hot_keys.fingerprint_key`.
pub const FINGERPRINT_KEY_MIN: usize = 16;

/// How a key or tenant is shown where its value must not be (logs, and
/// metrics under `hot_keys.redact_keys`): `#` and 16 hex digits of its
/// hash, or of an HMAC-SHA256 of the hash under `hot_keys.fingerprint_key`.
/// Unkeyed, a guessable value is found by hashing candidates; keyed, not
/// without the key.
#[derive(Clone)]
pub struct Fingerprints(Option<ring::hmac::Key>);

impl std::fmt::Debug for Fingerprints {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Fingerprints(keyed)"
        } else {
            "Fingerprints(unkeyed)"
        })
    }
}

impl Fingerprints {
    pub fn new(config: &HotKeysConfig) -> Fingerprints {
        Fingerprints(
            config
                .fingerprint_key
                .as_ref()
                .map(|k| ring::hmac::Key::new(ring::hmac::HMAC_SHA256, k.expose().as_bytes())),
        )
    }

    /// The fingerprint of a key whose [`key_hash`] is `hash`.
    pub fn of(&self, hash: u64) -> String {
        let shown = match &self.0 {
            None => hash,
            Some(key) => {
                let tag = ring::hmac::sign(key, &hash.to_be_bytes());
                let mut first = [0u8; 8];
                first.copy_from_slice(&tag.as_ref()[..8]);
                u64::from_be_bytes(first)
            }
        };
        format!("#{shown:016x}")
    }
}

/// The partitions of a key salted over `shards` in a topic of
/// `partitions`: its own first.
pub fn shard_partitions(key: &[u8], shards: u32, partitions: i32) -> Vec<i32> {
    let own = crate::sink::partition_for(key, partitions);
    let span = (shards as i32).min(partitions).max(1);
    (0..span).map(|s| (own + s) % partitions).collect()
}

/// A key's text form, as `salt_keys` declares it and metrics show it: one
/// column's text, or a JSON array of several columns' texts.
pub fn key_label(codec: &TableCodec, row: &[Input<'_>]) -> String {
    let texts: Vec<Option<String>> = codec
        .desc
        .columns
        .iter()
        .zip(row)
        .filter(|(c, _)| c.key)
        .map(|(c, v)| Some(String::from_utf8_lossy(&v.text(&c.kind())?).into_owned()))
        .collect();
    match texts.as_slice() {
        [Some(one)] => one.clone(),
        _ => serde_json::to_string(&texts).unwrap_or_default(),
    }
}

/// The hashes of declared keys (`<base>.<field>[i]`), each encoded with
/// the table's key codec as its events' keys are.
fn declared_hashes(
    codec: &TableCodec,
    texts: &[String],
    base: &str,
    field: &str,
) -> Result<HashSet<u64>, String> {
    let key_columns = codec.desc.columns.iter().filter(|c| c.key).count();
    let mut hashes = HashSet::new();
    for (i, text) in texts.iter().enumerate() {
        let path = format!("{base}.{field}[{i}]");
        if key_columns == 0 {
            return Err(format!("{path}: {} has no primary key", codec.table));
        }
        let texts = parse_declared(text, key_columns).map_err(|e| format!("{path}: {e}"))?;
        let mut texts = texts.iter();
        let row: Vec<Input<'_>> = codec
            .desc
            .columns
            .iter()
            .map(|c| match c.key {
                true => texts
                    .next()
                    .map_or(Input::Null, |t| Input::Text(t.as_bytes())),
                false => Input::Null,
            })
            .collect();
        let key = codec.encode_key(&row).map_err(|e| format!("{path}: {e}"))?;
        hashes.insert(key_hash(&key));
    }
    Ok(hashes)
}

/// The key columns' texts of a declared key (see [`key_label`]).
fn parse_declared(text: &str, columns: usize) -> Result<Vec<String>, String> {
    if columns == 1 {
        return Ok(vec![text.to_string()]);
    }
    let parts: Vec<serde_json::Value> = serde_json::from_str(text).map_err(|_| {
        format!("the key has {columns} columns: write it as a JSON array of their texts")
    })?;
    if parts.len() != columns {
        return Err(format!(
            "has {} values but the key has {columns} columns",
            parts.len()
        ));
    }
    Ok(parts
        .into_iter()
        .map(|v| match v {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        })
        .collect())
}

impl Partitioner {
    pub fn new(config: &Config) -> Partitioner {
        let now = Instant::now();
        let hot = config.hot_keys.clone();
        let window = Duration::from_secs(hot.window_secs);
        let tables = config
            .changelog_tables()
            .map(|t| {
                let table = Table {
                    config: config.partitioning.get(t).cloned(),
                    sketch: (hot.capacity > 0)
                        .then(|| Mutex::new(Sketch::new(hot.capacity, window, now))),
                    partitions: AtomicI32::new(0),
                    declared: Mutex::default(),
                    dedicated: config.dedicated_topic(t).map(Arc::from),
                    dedicated_partitions: AtomicI32::new(0),
                    dedicated_keys: Mutex::default(),
                    tenant: AtomicUsize::new(NO_TENANT),
                    salted: OnceLock::new(),
                    published: Mutex::default(),
                };
                (t.clone(), table)
            })
            .collect();
        let tenants = config.tenant_columns().next().is_some();
        Partitioner {
            prints: Fingerprints::new(&hot),
            hot,
            tables,
            tenants,
        }
    }

    /// The topics whose partition counts placement needs: those of the
    /// salting tables.
    pub fn counted_topics(&self, config: &Config) -> Vec<String> {
        self.tables
            .iter()
            .filter(|(_, t)| t.config.as_ref().is_some_and(|c| c.salt_shards.is_some()))
            .flat_map(|(table, _)| config.topics_of(table))
            .collect()
    }

    /// Whether `table`'s tenant column is outside its key: a delete then
    /// carries the tenant only under `REPLICA IDENTITY FULL`.
    pub fn tenant_outside_key(&self, codec: &TableCodec) -> Option<String> {
        let t = self.tables.get(&codec.table)?;
        let column = t.config.as_ref()?.tenant_column.as_ref()?;
        codec
            .desc
            .columns
            .iter()
            .any(|c| &c.name == column && !c.key)
            .then(|| column.clone())
    }

    /// Takes a table's codec (after its schemas are registered, as the
    /// key bytes carry the key schema's id) and its topics' partition
    /// counts: the declared keys are encoded as its events' keys are, and
    /// the tenant column is found. An error names the field.
    pub fn prepare(
        &self,
        codec: &TableCodec,
        partitions: &std::collections::BTreeMap<String, i32>,
    ) -> Result<(), String> {
        let Some(t) = self.tables.get(&codec.table) else {
            return Ok(());
        };
        let count = |topic: &str| partitions.get(topic).copied().unwrap_or(0);
        t.partitions.store(count(&codec.topic), Ordering::Relaxed);
        if let Some(d) = &t.dedicated {
            t.dedicated_partitions.store(count(d), Ordering::Relaxed);
        }
        let Some(config) = &t.config else {
            return Ok(());
        };
        let base = format!("partitioning.\"{}\"", codec.table);
        *lock(&t.declared) = declared_hashes(codec, &config.salt_keys, &base, "salt_keys")?;
        *lock(&t.dedicated_keys) =
            declared_hashes(codec, &config.dedicated_keys, &base, "dedicated_keys")?;
        let tenant = match &config.tenant_column {
            None => NO_TENANT,
            Some(column) => codec
                .desc
                .columns
                .iter()
                .position(|c| &c.name == column)
                .ok_or_else(|| {
                    format!(
                        "{base}.tenant_column: {} has no column {column}",
                        codec.table
                    )
                })?,
        };
        t.tenant.store(tenant, Ordering::Relaxed);
        Ok(())
    }

    /// Whether events of `table` are placed by their tenant column's text.
    pub fn has_tenant(&self, table: &str) -> bool {
        self.tenants
            && self
                .tables
                .get(table)
                .is_some_and(|t| t.tenant.load(Ordering::Relaxed) != NO_TENANT)
    }

    /// The tenant of an event of `table` (the text of its tenant column in
    /// `row`), if the table has a tenant column and the row a value.
    pub fn tenant<'a>(&self, table: &str, row: &[Input<'a>]) -> Option<&'a [u8]> {
        // Most pipelines name no tenant: no look-up per event then.
        if !self.tenants {
            return None;
        }
        let i = self.tables.get(table)?.tenant.load(Ordering::Relaxed);
        match row.get(i) {
            Some(Input::Text(t)) => Some(t),
            _ => None,
        }
    }

    /// Where an event of `table` with the framed `key` and `tenant` goes,
    /// counting a streamed one in the table's sketch. `row` is the image
    /// the key was taken from. Snapshot rows are routed but never salted.
    pub fn place(
        &self,
        codec: &TableCodec,
        key: &[u8],
        row: &[Input<'_>],
        tenant: Option<&[u8]>,
        op: Op,
        position: Position,
    ) -> Placement {
        let Some(t) = self.tables.get(&codec.table) else {
            return Placement::default();
        };
        let hash = key_hash(key);
        let topic = t.route(hash, tenant).cloned();
        let mut rate = 0.0;
        if let Some(sketch) = t.sketch.as_ref().filter(|_| op != Op::Read) {
            let now = Instant::now();
            let mut s = lock(sketch);
            let i = s.observe(hash, now);
            rate = s.rate(i, now);
            // Only reported keys need their text, so cold keys cost none.
            if rate >= self.hot.report_per_sec && s.label(i).is_none() {
                s.set_label(i, self.shown(hash, || key_label(codec, row)));
            }
        }
        let routed = Placement {
            topic: topic.clone(),
            ..Placement::default()
        };
        let Some(shards) = t.config.as_ref().and_then(|c| c.salt_shards) else {
            return routed;
        };
        let partitions = match topic {
            Some(_) => t.dedicated_partitions.load(Ordering::Relaxed),
            None => t.partitions.load(Ordering::Relaxed),
        };
        if partitions <= 1 || op == Op::Read {
            return routed;
        }
        let shards = shard_partitions(key, shards, partitions);
        let tombstones = if op == Op::Delete {
            shards.clone()
        } else {
            Vec::new()
        };
        if !t.salts_key(hash, rate) {
            return Placement {
                tombstones,
                ..routed
            };
        }
        let shard = shard_of(position, shards.len() as u32);
        t.salted
            .get_or_init(
                || metrics::counter!(observe::SALTED_EVENTS, "table" => codec.table.clone()),
            )
            .increment(1);
        Placement {
            topic,
            partition: Some(shards[shard as usize]),
            shard: Some(shard),
            tombstones,
        }
    }

    /// A key as metrics and `pgcdc status` show it.
    fn shown(&self, hash: u64, label: impl FnOnce() -> String) -> String {
        if self.hot.redact_keys {
            self.prints.of(hash)
        } else {
            label()
        }
    }

    /// Exports every table's hot keys (`pgcdc_hot_key_rate`, `_share`,
    /// `_salted`), zeroing the ones that cooled since the last call. Run
    /// every second, so quiet tables fade too.
    pub fn publish(&self) {
        let now = Instant::now();
        for (table, t) in &self.tables {
            let Some(sketch) = &t.sketch else { continue };
            let hot = lock(sketch).hot(self.hot.report_per_sec, now);
            let mut published = lock(&t.published);
            let mut now_hot = HashMap::new();
            for h in hot {
                let key = h.label.clone().unwrap_or_else(|| self.prints.of(h.hash));
                let salted = t.salts_key(h.hash, h.rate);
                let labels = [("table", table.clone()), ("key", key.clone())];
                metrics::gauge!(observe::HOT_KEY_RATE, &labels).set(h.rate);
                metrics::gauge!(observe::HOT_KEY_SHARE, &labels).set(h.share);
                metrics::gauge!(observe::HOT_KEY_SALTED, &labels).set(f64::from(u8::from(salted)));
                if !published.contains_key(&h.hash) {
                    tracing::info!(%table, fingerprint = self.prints.of(h.hash),
                        rate = h.rate.round(), share = format!("{:.2}", h.share), salted,
                        "hot key: its rate reached hot_keys.report_per_sec");
                }
                now_hot.insert(h.hash, key);
            }
            for (hash, key) in published.iter() {
                if !now_hot.contains_key(hash) {
                    let labels = [("table", table.clone()), ("key", key.clone())];
                    metrics::gauge!(observe::HOT_KEY_RATE, &labels).set(0.0);
                    metrics::gauge!(observe::HOT_KEY_SHARE, &labels).set(0.0);
                    metrics::gauge!(observe::HOT_KEY_SALTED, &labels).set(0.0);
                }
            }
            *published = now_hot;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::partition_for;

    #[test]
    fn a_fingerprint_is_keyed_only_with_a_fingerprint_key() {
        let with = |key: Option<&str>| {
            Fingerprints::new(&HotKeysConfig {
                fingerprint_key: key.map(crate::secret::Secret::new),
                ..Default::default()
            })
        };
        let hash = key_hash(b"acme-corp");
        // Unkeyed: the hash itself, as before the key existed.
        assert_eq!(with(None).of(hash), format!("#{hash:016x}"));
        let a = with(Some("0123456789abcdef"));
        let print = a.of(hash);
        assert_eq!(print.len(), 17);
        assert!(print.starts_with('#'));
        assert_ne!(print, with(None).of(hash));
        // Stable for one key, so that every process shows the same one.
        assert_eq!(print, with(Some("0123456789abcdef")).of(hash));
        assert_ne!(print, with(Some("0123456789abcdeg")).of(hash));
        assert_ne!(print, a.of(key_hash(b"acme-corq")));
        assert!(!format!("{a:?}").contains("0123"));
    }

    #[test]
    fn a_salted_key_spreads_over_its_shards_and_its_own_partition_comes_first() {
        let key = b"\x00\x00\x00\x00\x01\x02";
        let own = partition_for(key, 12);
        let shards = shard_partitions(key, 8, 12);
        assert_eq!(shards.len(), 8);
        assert_eq!(shards[0], own);
        assert_eq!(shards.iter().collect::<HashSet<_>>().len(), 8, "{shards:?}");
        assert!(shards.iter().all(|p| (0..12).contains(p)));
        // Never more shards than partitions.
        assert_eq!(shard_partitions(key, 8, 3).len(), 3);
    }

    #[test]
    fn shards_of_consecutive_positions_cover_every_shard_evenly() {
        let mut seen = [0u32; 8];
        for lsn in 0..8000u64 {
            let s = shard_of(
                Position {
                    commit_lsn: 0x1_6000_0000 + lsn * 56,
                    seq: lsn % 3,
                },
                8,
            );
            seen[s as usize] += 1;
        }
        assert!(seen.iter().all(|n| (800..1200).contains(n)), "{seen:?}");
        // The same position, the same shard (a replay goes where it went).
        let p = Position {
            commit_lsn: 42,
            seq: 1,
        };
        assert_eq!(shard_of(p, 8), shard_of(p, 8));
    }

    #[test]
    fn declared_keys_of_several_columns_are_json_arrays() {
        assert_eq!(parse_declared("42", 1).expect("parsed"), vec!["42"]);
        assert_eq!(
            parse_declared(r#"["7", 3]"#, 2).expect("parsed"),
            vec!["7".to_string(), "3".to_string()]
        );
        assert!(parse_declared("7,3", 2)
            .expect_err("refused")
            .contains("JSON array"));
        assert!(parse_declared(r#"["7"]"#, 2)
            .expect_err("refused")
            .contains("2 columns"));
    }
}
