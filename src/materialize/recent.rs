//! The fast dedup tier: the positions this process committed most
//! recently, by key, in a bounded LRU.
//!
//! Guarantee: it only ever answers "already applied" (a position at or
//! below one committed for the key; positions only grow, so the durable
//! tier holds at least that). Anything else, a miss or an evicted key
//! included, falls through to the durable tier. Positions enter only after
//! their database transaction committed. An entry older than the TTL is
//! a miss, like an evicted one.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use super::mirror::Position;

#[derive(Debug)]
pub struct Recent {
    capacity: usize,
    ttl: Duration,
    tick: u64,
    /// Key → (position, last use, when the position was stored).
    entries: HashMap<String, (Position, u64, Instant)>,
    order: BTreeMap<u64, String>,
}

impl Recent {
    pub fn new(capacity: usize, ttl: Duration) -> Recent {
        Recent {
            capacity,
            ttl,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// The newest committed position known for `key`.
    pub fn get(&mut self, key: &str) -> Option<Position> {
        let (stored, used, at) = self.entries.get_mut(key)?;
        if at.elapsed() > self.ttl {
            self.order.remove(used);
            self.entries.remove(key);
            return None;
        }
        self.tick += 1;
        self.order.remove(used);
        *used = self.tick;
        self.order.insert(self.tick, key.to_string());
        Some(*stored)
    }

    /// Records a committed position (never moving one backwards).
    pub fn committed(&mut self, key: String, position: Position) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        if let Some((stored, used, at)) = self.entries.get_mut(&key) {
            self.order.remove(used);
            *stored = (*stored).max(position);
            *used = self.tick;
            *at = Instant::now();
            self.order.insert(self.tick, key);
            return;
        }
        while self.entries.len() >= self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.entries.remove(&oldest);
        }
        self.order.insert(self.tick, key.clone());
        self.entries
            .insert(key, (position, self.tick, Instant::now()));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_committed_positions_are_known() {
        let mut r = Recent::new(2, Duration::from_secs(60));
        assert_eq!(r.get("a"), None, "a miss falls through");
        r.committed("a".into(), (5, 2));
        assert_eq!(r.get("a"), Some((5, 2)));
        r.committed("a".into(), (1, 1));
        assert_eq!(r.get("a"), Some((5, 2)), "never moves backwards");
    }

    #[test]
    fn the_least_recently_used_key_is_evicted() {
        let mut r = Recent::new(2, Duration::from_secs(60));
        r.committed("a".into(), (1, 0));
        r.committed("b".into(), (1, 0));
        assert_eq!(r.get("a"), Some((1, 0)));
        r.committed("c".into(), (1, 0));
        assert_eq!(r.len(), 2);
        assert_eq!(r.get("b"), None, "b was least recently used");
        assert_eq!(r.get("a"), Some((1, 0)));
        assert_eq!(r.get("c"), Some((1, 0)));
    }

    #[test]
    fn an_expired_entry_is_a_miss() {
        let mut r = Recent::new(2, Duration::from_millis(30));
        r.committed("a".into(), (5, 2));
        assert_eq!(r.get("a"), Some((5, 2)));
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(r.get("a"), None, "past the TTL the durable tier decides");
        assert_eq!(r.len(), 0);
    }
}
