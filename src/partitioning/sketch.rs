//! A heavy-hitters sketch: Space-Saving (Metwally, Agrawal, El Abbadi,
//! 2005) over a sliding rate window.
//!
//! Guarantees:
//! - **Fixed memory.** `capacity` counters, whatever the number of
//!   distinct keys.
//! - **Never overstates.** [`Sketch::rate`] is a lower bound: each
//!   counter keeps the error it inherited when it replaced another, and
//!   rates subtract it. A cold key is never reported hot because the
//!   counters are few.
//! - **Finds what matters.** A key with more than `1/capacity` of a
//!   window's changes holds a counter through that window.
//!
//! ```text
//!  change ──► hash ──► counter? ──yes──► +1
//!                         └─no──► replace the smallest (count = its + 1, error = its)
//!  every window: previous = count - error, count = 0
//!  rate = (previous × (1 - elapsed fraction) + count - error) / window
//! ```

use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
struct Counter {
    hash: u64,
    label: Option<String>,
    /// This window's count, including `error`.
    count: u64,
    /// Over-count inherited from the counter this one replaced.
    error: u64,
    /// The previous window's lower bound.
    previous: u64,
}

impl Counter {
    fn weight(&self) -> u64 {
        self.count + self.previous
    }
}

/// One reported key.
#[derive(Debug, Clone, PartialEq)]
pub struct Hot {
    pub hash: u64,
    pub label: Option<String>,
    /// Changes per second, a lower bound.
    pub rate: f64,
    /// Its part of the table's changes over the same window.
    pub share: f64,
}

#[derive(Debug)]
pub struct Sketch {
    capacity: usize,
    window: Duration,
    started: Instant,
    counters: Vec<Counter>,
    index: HashMap<u64, usize>,
    total: u64,
    total_previous: u64,
}

impl Sketch {
    pub fn new(capacity: usize, window: Duration, now: Instant) -> Sketch {
        Sketch {
            capacity: capacity.max(1),
            window: window.max(Duration::from_millis(1)),
            started: now,
            counters: Vec::with_capacity(capacity),
            index: HashMap::with_capacity(capacity),
            total: 0,
            total_previous: 0,
        }
    }

    /// Counts one change of the key `hash` and returns its counter.
    pub fn observe(&mut self, hash: u64, now: Instant) -> usize {
        self.roll(now);
        self.total += 1;
        if let Some(&i) = self.index.get(&hash) {
            self.counters[i].count += 1;
            return i;
        }
        if self.counters.len() < self.capacity {
            self.counters.push(Counter {
                hash,
                label: None,
                count: 1,
                error: 0,
                previous: 0,
            });
            self.index.insert(hash, self.counters.len() - 1);
            return self.counters.len() - 1;
        }
        let (i, _) = self
            .counters
            .iter()
            .enumerate()
            .min_by_key(|(_, c)| c.weight())
            .expect("capacity is at least 1");
        let victim = &mut self.counters[i];
        self.index.remove(&victim.hash);
        *victim = Counter {
            hash,
            label: None,
            count: victim.count + 1,
            error: victim.count,
            previous: 0,
        };
        self.index.insert(hash, i);
        i
    }

    /// Starts a new window when the current one is over; after more than
    /// one window without changes nothing of the past counts.
    fn roll(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.started);
        if elapsed < self.window {
            return;
        }
        let stale = elapsed >= self.window * 2;
        for c in &mut self.counters {
            c.previous = if stale { 0 } else { c.count - c.error };
            c.count = 0;
            c.error = 0;
        }
        self.total_previous = if stale { 0 } else { self.total };
        self.total = 0;
        let windows = (elapsed.as_nanos() / self.window.as_nanos()) as u32;
        self.started += self.window * windows;
    }

    fn estimate(&self, previous: u64, current: u64, now: Instant) -> f64 {
        let frac = (now.saturating_duration_since(self.started).as_secs_f64()
            / self.window.as_secs_f64())
        .min(1.0);
        previous as f64 * (1.0 - frac) + current as f64
    }

    /// The lower bound of counter `i`'s rate, in changes per second.
    pub fn rate(&self, i: usize, now: Instant) -> f64 {
        let c = &self.counters[i];
        self.estimate(c.previous, c.count - c.error, now) / self.window.as_secs_f64()
    }

    pub fn label(&self, i: usize) -> Option<&str> {
        self.counters[i].label.as_deref()
    }

    pub fn set_label(&mut self, i: usize, label: String) {
        self.counters[i].label = Some(label);
    }

    /// Keys at or above `min_rate`, hottest first.
    pub fn hot(&mut self, min_rate: f64, now: Instant) -> Vec<Hot> {
        self.roll(now);
        let total = self.estimate(self.total_previous, self.total, now);
        let mut out: Vec<Hot> = (0..self.counters.len())
            .map(|i| (i, self.rate(i, now)))
            .filter(|(_, rate)| *rate >= min_rate)
            .map(|(i, rate)| Hot {
                hash: self.counters[i].hash,
                label: self.counters[i].label.clone(),
                rate,
                share: if total > 0.0 {
                    rate * self.window.as_secs_f64() / total
                } else {
                    0.0
                },
            })
            .collect();
        out.sort_by(|a, b| b.rate.total_cmp(&a.rate));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xorshift(state: &mut u64) -> u64 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state
    }

    #[test]
    fn a_key_with_half_the_changes_is_found_among_many_cold_ones() {
        let start = Instant::now();
        let mut s = Sketch::new(16, Duration::from_secs(10), start);
        let mut rng = 0x2545_f491_4f6c_dd1d;
        let mut true_counts: HashMap<u64, u64> = HashMap::new();
        for i in 0..100_000u64 {
            let key = if i % 2 == 0 {
                7
            } else {
                1000 + xorshift(&mut rng) % 50_000
            };
            *true_counts.entry(key).or_default() += 1;
            s.observe(key, start + Duration::from_micros(i * 10));
        }
        let now = start + Duration::from_secs(1);
        let hot = s.hot(1.0, now);
        assert_eq!(hot[0].hash, 7, "{hot:?}");
        assert!((hot[0].share - 0.5).abs() < 0.01, "{hot:?}");
        // Lower bounds: no key is ever counted above its true count.
        for h in &hot {
            let counted = h.rate * 10.0;
            assert!(
                counted <= true_counts[&h.hash] as f64 + 1e-6,
                "{h:?} over {}",
                true_counts[&h.hash]
            );
        }
        // The cold keys (a change or two each) do not reach 5 in the window.
        assert_eq!(s.hot(0.5, now).len(), 1, "{:?}", s.hot(0.5, now));
    }

    #[test]
    fn rates_slide_across_windows_and_fade_when_the_key_goes_quiet() {
        let start = Instant::now();
        let mut s = Sketch::new(4, Duration::from_secs(1), start);
        // 1,000 changes in the first second.
        for i in 0..1000u64 {
            s.observe(1, start + Duration::from_millis(i));
        }
        let i = s.observe(1, start + Duration::from_millis(1000));
        // Just into the second window: the previous one counts in full.
        let rate = s.rate(i, start + Duration::from_millis(1000));
        assert!((999.0..=1001.0).contains(&rate), "{rate}");
        // Halfway through it, with no more changes: half.
        let rate = s.rate(i, start + Duration::from_millis(1500));
        assert!((499.0..=502.0).contains(&rate), "{rate}");
        // Two windows later nothing remains.
        assert!(s.hot(1.0, start + Duration::from_millis(3100)).is_empty());
    }

    #[test]
    fn a_replacing_counter_carries_its_error_and_reports_only_what_it_saw() {
        let start = Instant::now();
        let mut s = Sketch::new(2, Duration::from_secs(10), start);
        for _ in 0..5 {
            s.observe(1, start);
        }
        s.observe(2, start);
        // 3 replaces 2 (the smallest): count 2, error 1, so rate 1 / 10 s.
        let i = s.observe(3, start);
        assert!((s.rate(i, start) - 0.1).abs() < 1e-9);
        assert_eq!(s.hot(0.0, start).len(), 2);
    }
}
