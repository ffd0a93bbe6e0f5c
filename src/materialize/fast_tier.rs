//! The fast dedup tier: an in-process LRU ([`Recent`]) or Redis shared by
//! every instance, with an optional Bloom filter of keys.
//!
//! Guarantee: the tier only ever answers "this key's position P is
//! applied", and only for positions whose database transaction committed
//! (entries are written after the commit). A miss, an expired or evicted
//! entry, or Redis being down (under `fail_open`) falls through to the
//! durable positions, which stay the source of truth. Under `fail_closed`
//! an unreachable Redis is an error: the caller stops applying and retries.
//!
//! ```text
//!  batch keys ──► lookup (LRU, or one MGET) ──► known positions
//!  commit ──► committed(keys, positions) ──► LRU, or a compare-and-set script
//!                                             (a stored position never moves back)
//! ```
//!
//! Redis keys are `pgcdc:<target id>:<mirror>|<key>`, the target id being
//! `pgcdc_state.identity`: a recreated target never trusts entries about
//! the old one. Values are the position as 32 hex digits, so that Lua
//! compares them as strings without losing 64-bit precision.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::bloom::Bloom;
use super::mirror::Position;
use super::recent::Recent;
use crate::config::{DedupConfig, RedisFailure};
use crate::observe;

/// Sets each key to its new position unless a newer one is stored.
const COMPARE_AND_SET: &str = r"
local ttl = ARGV[1]
for i, key in ipairs(KEYS) do
  local new = ARGV[i + 1]
  local cur = redis.call('GET', key)
  if (not cur) or cur < new then
    redis.call('SET', key, new, 'PX', ttl)
  end
end
return #KEYS
";

/// Keys per Redis round trip.
const CHUNK: usize = 1000;

/// Redis is unreachable and the policy is `fail_closed`.
#[derive(Debug, thiserror::Error)]
#[error("redis is unreachable and target.dedup.on_redis_failure = fail_closed: {0}")]
pub struct Unavailable(pub String);

#[derive(Debug)]
pub struct FastTier {
    store: Store,
    bloom: Option<Bloom>,
}

#[derive(Debug)]
enum Store {
    Memory(Recent),
    Redis(Box<Shared>),
}

struct Shared {
    conn: ConnectionManager,
    namespace: String,
    ttl_ms: u64,
    policy: RedisFailure,
    script: redis::Script,
    /// While down under fail_open: when to try Redis again.
    down: Option<(Instant, Duration)>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The connection holds the URL (and its password): not shown.
        f.debug_struct("Shared")
            .field("namespace", &self.namespace)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

fn encode(p: Position) -> String {
    format!("{:016x}{:016x}", p.0 as u64, p.1 as u64)
}

fn decode(s: &str) -> Option<Position> {
    if s.len() != 32 {
        return None;
    }
    let lsn = u64::from_str_radix(&s[..16], 16).ok()?;
    let seq = u64::from_str_radix(&s[16..], 16).ok()?;
    Some((lsn as i64, seq as i64))
}

impl FastTier {
    /// `target_id` namespaces Redis entries (see the module doc).
    pub fn new(config: &DedupConfig, target_id: &str) -> Result<FastTier, String> {
        let ttl = Duration::from_secs(config.ttl_seconds);
        let store = match &config.redis_url {
            None => Store::Memory(Recent::new(config.cache_keys, ttl)),
            Some(url) => {
                let client = redis::Client::open(url.expose()).map_err(|e| {
                    format!(
                        "target.dedup.redis_url: not a valid Redis URL ({:?})",
                        e.kind()
                    )
                })?;
                // Short timeouts: a dead Redis must not hold a batch for long.
                let cm = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(Duration::from_secs(2)))
                    .set_response_timeout(Some(Duration::from_secs(2)))
                    .set_number_of_retries(1)
                    .set_max_delay(Duration::from_millis(500));
                let conn = ConnectionManager::new_lazy_with_config(client, cm)
                    .map_err(|e| format!("target.dedup.redis_url: {:?}", e.kind()))?;
                Store::Redis(Box::new(Shared {
                    conn,
                    namespace: format!("pgcdc:{target_id}:"),
                    ttl_ms: config.ttl_seconds * 1000,
                    policy: config.on_redis_failure.unwrap_or(RedisFailure::FailClosed),
                    script: redis::Script::new(COMPARE_AND_SET),
                    down: None,
                }))
            }
        };
        Ok(FastTier {
            store,
            bloom: (config.bloom_keys > 0).then(|| Bloom::new(config.bloom_keys)),
        })
    }

    /// The newest committed positions known for `keys`.
    pub async fn lookup(
        &mut self,
        keys: &[&str],
    ) -> Result<HashMap<String, Position>, Unavailable> {
        let mut known = HashMap::new();
        match &mut self.store {
            Store::Memory(recent) => {
                for k in keys {
                    if let Some(p) = recent.get(k) {
                        known.insert(k.to_string(), p);
                    }
                }
            }
            Store::Redis(shared) => {
                if !shared.usable() {
                    return Ok(known);
                }
                for chunk in keys.chunks(CHUNK) {
                    let names: Vec<String> = chunk
                        .iter()
                        .map(|k| format!("{}{k}", shared.namespace))
                        .collect();
                    let got: Result<Vec<Option<String>>, _> = redis::cmd("MGET")
                        .arg(&names)
                        .query_async(&mut shared.conn)
                        .await;
                    match got {
                        Ok(values) => {
                            shared.up();
                            for (k, v) in chunk.iter().zip(values) {
                                if let Some(p) = v.as_deref().and_then(decode) {
                                    known.insert(k.to_string(), p);
                                }
                            }
                        }
                        Err(e) => {
                            shared.failed(&e)?;
                            return Ok(HashMap::new());
                        }
                    }
                }
            }
        }
        Ok(known)
    }

    /// Records positions whose transaction committed.
    pub async fn committed(&mut self, entries: &[(String, Position)]) -> Result<(), Unavailable> {
        if let Some(bloom) = &mut self.bloom {
            for (k, _) in entries {
                bloom.insert(k);
            }
        }
        match &mut self.store {
            Store::Memory(recent) => {
                for (k, p) in entries {
                    recent.committed(k.clone(), *p);
                }
            }
            Store::Redis(shared) => {
                if !shared.usable() {
                    return Ok(());
                }
                for chunk in entries.chunks(CHUNK) {
                    let mut call = shared.script.prepare_invoke();
                    call.arg(shared.ttl_ms);
                    for (k, p) in chunk {
                        call.key(format!("{}{k}", shared.namespace)).arg(encode(*p));
                    }
                    let done: Result<i64, _> = call.invoke_async(&mut shared.conn).await;
                    match done {
                        Ok(_) => shared.up(),
                        Err(e) => return shared.failed(&e),
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether the key may be in the durable tier; true without a filter.
    pub fn may_have_seen(&self, key: &str) -> bool {
        self.bloom.as_ref().is_none_or(|b| b.may_contain(key))
    }

    /// Adds a key the durable tier holds (seeding the filter at start-up).
    pub fn seen(&mut self, key: &str) {
        if let Some(b) = &mut self.bloom {
            b.insert(key);
        }
    }

    pub fn has_bloom(&self) -> bool {
        self.bloom.is_some()
    }
}

impl Shared {
    /// False while down under fail_open and not yet time to try again.
    fn usable(&mut self) -> bool {
        match self.down {
            Some((next_try, _)) if self.policy == RedisFailure::FailOpen => {
                Instant::now() >= next_try
            }
            _ => true,
        }
    }

    fn up(&mut self) {
        if self.down.take().is_some() {
            tracing::info!("redis is reachable again; the shared dedup tier is back in use");
        }
        metrics::gauge!(observe::MATERIALIZE_FAST_TIER_UP).set(1.0);
    }

    /// Logs an outage once, then applies the policy.
    fn failed(&mut self, e: &redis::RedisError) -> Result<(), Unavailable> {
        metrics::gauge!(observe::MATERIALIZE_FAST_TIER_UP).set(0.0);
        let error = e.to_string();
        let backoff = match self.down {
            None => {
                match self.policy {
                    RedisFailure::FailOpen => tracing::warn!(%error,
                        "redis is unreachable; going on with the durable dedup tier only (fail_open)"),
                    RedisFailure::FailClosed => tracing::warn!(%error,
                        "redis is unreachable; applying stops until it is back (fail_closed)"),
                }
                Duration::from_secs(1)
            }
            Some((_, last)) => (last * 2).min(Duration::from_secs(30)),
        };
        self.down = Some((Instant::now() + backoff, backoff));
        match self.policy {
            RedisFailure::FailOpen => Ok(()),
            RedisFailure::FailClosed => Err(Unavailable(error)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoded_positions_order_like_positions() {
        let ps = [
            (0, 0),
            (0, 1),
            (1, 0),
            (0x7fff_ffff, 3),
            (1 << 40, 0),
            (i64::MAX, i64::MAX),
        ];
        for a in ps {
            assert_eq!(decode(&encode(a)), Some(a));
            for b in ps {
                assert_eq!(a.cmp(&b), encode(a).cmp(&encode(b)), "{a:?} vs {b:?}");
            }
        }
        assert_eq!(decode("xyz"), None);
    }

    #[tokio::test]
    async fn the_memory_tier_knows_only_committed_positions() -> Result<(), Unavailable> {
        let mut t = FastTier::new(
            &DedupConfig {
                bloom_keys: 100,
                ..DedupConfig::default()
            },
            "t",
        )
        .map_err(Unavailable)?;
        assert!(t.lookup(&["a"]).await?.is_empty());
        assert!(!t.may_have_seen("a"));
        t.committed(&[("a".into(), (5, 1))]).await?;
        assert_eq!(t.lookup(&["a", "b"]).await?.get("a"), Some(&(5, 1)));
        assert!(t.may_have_seen("a"));
        Ok(())
    }
}
