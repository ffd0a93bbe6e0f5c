//! The fast dedup tier: the positions this process committed most
//! recently, by key, in a bounded LRU.
//!
//! Guarantee: it only ever answers "already applied" (a position at or
//! below one committed for the key; positions only grow, so the durable
//! tier holds at least that). Anything else, a miss or an evicted key
//! included, falls through to the durable tier. Positions enter only after
//! their database transaction committed.

use std::collections::{BTreeMap, HashMap};

use super::mirror::Position;

#[derive(Debug)]
pub struct Recent {
    capacity: usize,
    tick: u64,
    entries: HashMap<String, (Position, u64)>,
    order: BTreeMap<u64, String>,
}

impl Recent {
    pub fn new(capacity: usize) -> Recent {
        Recent {
            capacity,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
        }
    }

    /// Whether `position` is known to be applied for `key`.
    pub fn applied(&mut self, key: &str, position: Position) -> bool {
        let Some((stored, used)) = self.entries.get_mut(key) else {
            return false;
        };
        self.tick += 1;
        self.order.remove(used);
        *used = self.tick;
        self.order.insert(self.tick, key.to_string());
        position <= *stored
    }

    /// Records a committed position (never moving one backwards).
    pub fn committed(&mut self, key: String, position: Position) {
        if self.capacity == 0 {
            return;
        }
        self.tick += 1;
        if let Some((stored, used)) = self.entries.get_mut(&key) {
            self.order.remove(used);
            *stored = (*stored).max(position);
            *used = self.tick;
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
        self.entries.insert(key, (position, self.tick));
    }

    /// Forgets everything (the durable tier still knows).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_known_positions_are_reported_applied() {
        let mut r = Recent::new(2);
        assert!(!r.applied("a", (1, 1)), "a miss falls through");
        r.committed("a".into(), (5, 2));
        assert!(r.applied("a", (5, 2)));
        assert!(r.applied("a", (4, 9)));
        assert!(!r.applied("a", (5, 3)), "newer is not known");
        r.committed("a".into(), (1, 1));
        assert!(r.applied("a", (5, 2)), "never moves backwards");
    }

    #[test]
    fn the_least_recently_used_key_is_evicted() {
        let mut r = Recent::new(2);
        r.committed("a".into(), (1, 0));
        r.committed("b".into(), (1, 0));
        assert!(r.applied("a", (1, 0)));
        r.committed("c".into(), (1, 0));
        assert_eq!(r.len(), 2);
        assert!(!r.applied("b", (1, 0)), "b was least recently used");
        assert!(r.applied("a", (1, 0)));
        assert!(r.applied("c", (1, 0)));
        r.clear();
        assert!(r.is_empty());
    }
}
