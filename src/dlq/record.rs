//! The dead-letter record: the original key and value, with headers that
//! say why it failed and where it came from.
//!
//! Guarantee: a record too large for the broker is split into parts that
//! each fit and share a part id; the store records the message once every
//! part arrived, so an oversized change is kept whole.

use rdkafka::message::{Header, OwnedHeaders};

/// Room left in each part for the key, the headers and Kafka's framing.
const PART_OVERHEAD: usize = 8 * 1024;

/// Why and from where, as headers.
#[derive(Debug, Clone, Copy)]
pub struct Quarantine<'a> {
    pub class: &'a str,
    pub error: &'a str,
    pub origin_topic: &'a str,
    /// Partition and offset of the origin record; `None` for what never
    /// reached a changelog topic (the connector's).
    pub origin: Option<(i32, i64)>,
    /// `(commit_lsn, seq)`.
    pub position: Option<(i64, i64)>,
    /// The change record's own LSN (the connector's).
    pub lsn: Option<u64>,
    /// The event's op (`c`, `u`, `d`, `r`): with the position it names a
    /// connector's event, as a key change emits a delete and a create at
    /// one position.
    pub op: Option<&'a str>,
    pub attempts: u32,
    pub first_failure_ms: i64,
    pub last_failure_ms: i64,
    /// The dead letter whose replay failed again.
    pub replay_of: Option<i64>,
}

/// One part of a split record: 1-based index, count, and the id they share.
#[derive(Debug, Clone, Copy)]
pub struct Part<'a> {
    pub index: usize,
    pub count: usize,
    pub id: &'a str,
}

impl Quarantine<'_> {
    pub fn headers(&self, part: Option<Part<'_>>) -> OwnedHeaders {
        let mut pairs: Vec<(&str, String)> = vec![
            ("pgcdc.failure.class", self.class.to_string()),
            ("pgcdc.failure.error", self.error.to_string()),
            ("pgcdc.origin.topic", self.origin_topic.to_string()),
        ];
        if let Some((p, o)) = self.origin {
            pairs.push(("pgcdc.origin.partition", p.to_string()));
            pairs.push(("pgcdc.origin.offset", o.to_string()));
        }
        pairs.push((
            "pgcdc.position",
            self.position
                .map(|(c, s)| format!("{c}:{s}"))
                .unwrap_or_default(),
        ));
        if let Some(lsn) = self.lsn {
            pairs.push((
                "pgcdc.origin.lsn",
                crate::source::pgoutput::Lsn(lsn).to_string(),
            ));
        }
        if let Some(op) = self.op {
            pairs.push(("pgcdc.origin.op", op.to_string()));
        }
        pairs.push(("pgcdc.attempts", self.attempts.to_string()));
        pairs.push(("pgcdc.first_failure_ms", self.first_failure_ms.to_string()));
        pairs.push(("pgcdc.last_failure_ms", self.last_failure_ms.to_string()));
        if let Some(id) = self.replay_of {
            pairs.push(("pgcdc.replay_of", id.to_string()));
        }
        if let Some(p) = part {
            pairs.push(("pgcdc.part", format!("{}/{}", p.index, p.count)));
            pairs.push(("pgcdc.part.id", p.id.to_string()));
        }
        pairs
            .into_iter()
            .fold(OwnedHeaders::new(), |h, (key, value)| {
                h.insert(Header {
                    key,
                    value: Some(value.as_bytes()),
                })
            })
    }
}

impl Quarantine<'_> {
    /// The dead-letter records of `value`: one, or parts that fit
    /// `max_message_bytes` beside a key of `key_len` bytes, each with its
    /// headers. The part id is `origin` with the count and length, so a
    /// resend split another way never mixes with these parts.
    pub fn records<'v>(
        &self,
        value: &'v [u8],
        key_len: usize,
        max_message_bytes: usize,
        origin: &str,
    ) -> Vec<(OwnedHeaders, &'v [u8])> {
        let parts = split(value, key_len, max_message_bytes);
        let count = parts.len();
        let id = format!("{origin}/{count}x{}", value.len());
        parts
            .into_iter()
            .enumerate()
            .map(|(i, part)| {
                let headers = self.headers((count > 1).then_some(Part {
                    index: i + 1,
                    count,
                    id: &id,
                }));
                (headers, part)
            })
            .collect()
    }
}

/// `value` in parts that fit `max_message_bytes` beside a key of
/// `key_len` bytes; one part when it fits whole.
fn split(value: &[u8], key_len: usize, max_message_bytes: usize) -> Vec<&[u8]> {
    let room = max_message_bytes
        .saturating_sub(key_len + PART_OVERHEAD)
        .max(1024);
    if value.len() <= room {
        return vec![value];
    }
    value.chunks(room).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::message::Headers;

    #[test]
    fn a_large_value_is_split_into_parts_that_fit_and_join_back() {
        let value: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let parts = split(&value, 100, 20_000);
        assert!(parts.len() > 1);
        assert!(parts
            .iter()
            .all(|p| p.len() + 100 + PART_OVERHEAD <= 20_000));
        assert_eq!(parts.concat(), value);
        assert_eq!(split(&value[..500], 100, 20_000).len(), 1);
    }

    #[test]
    fn headers_name_the_failure_the_origin_and_the_part() {
        let q = Quarantine {
            class: "oversized",
            error: "too large",
            origin_topic: "demo.public.t",
            origin: None,
            position: Some((100, 2)),
            lsn: Some(0x16_B374_D848),
            op: Some("c"),
            attempts: 1,
            first_failure_ms: 5,
            last_failure_ms: 6,
            replay_of: None,
        };
        let h = q.headers(Some(Part {
            index: 2,
            count: 3,
            id: "demo.public.t@100:2",
        }));
        let got: Vec<(String, String)> = h
            .iter()
            .map(|h| {
                (
                    h.key.to_string(),
                    String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                )
            })
            .collect();
        let get = |k: &str| got.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("pgcdc.failure.class"), Some("oversized"));
        assert_eq!(get("pgcdc.position"), Some("100:2"));
        assert_eq!(get("pgcdc.origin.lsn"), Some("16/B374D848"));
        assert_eq!(get("pgcdc.origin.op"), Some("c"));
        assert_eq!(
            get("pgcdc.origin.offset"),
            None,
            "never on a changelog topic"
        );
        assert_eq!(get("pgcdc.part"), Some("2/3"));
        assert_eq!(get("pgcdc.part.id"), Some("demo.public.t@100:2"));
    }
}
