//! Reads the Prometheus text exposition that `/metrics` serves back into
//! samples, so the status page shows exactly the figures `/metrics` does.
//!
//! Guarantee: [`parse`] never fails; a line it cannot read (a comment, a
//! malformed sample) is skipped, and a label value's escapes (`\\`, `\"`,
//! `\n`) are undone.

use std::collections::BTreeMap;

/// One sample: a metric name, its labels and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Every sample of one rendering.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Scrape {
    samples: Vec<Sample>,
}

impl Scrape {
    /// The sum over every sample of `name` whose labels include `filter`;
    /// `None` when no sample matches.
    pub fn sum(&self, name: &str, filter: &[(&str, &str)]) -> Option<f64> {
        let mut found = None;
        for s in self.matching(name, filter) {
            *found.get_or_insert(0.0) += s.value;
        }
        found
    }

    /// Samples of `name` whose labels include `filter`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        filter: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && filter
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
        })
    }

    /// The distinct values of `label` over the samples of `name`.
    pub fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .matching(name, &[])
            .filter_map(|s| s.labels.get(label).cloned())
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// Parses a text exposition.
pub fn parse(text: &str) -> Scrape {
    Scrape {
        samples: text.lines().filter_map(sample).collect(),
    }
}

fn sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = label_set(after)?;
        labels = parsed;
        rest = tail;
    }
    // A timestamp may follow the value.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// `k="v",k2="v2"}` up to and including the closing brace.
fn label_set(mut s: &str) -> Option<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(tail) = s.strip_prefix('}') {
            return Some((labels, tail));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_string();
        s = s[eq + 1..].strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.insert(key, value);
        s = &s[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP pgcdc_events_total Change events produced, by table and op
# TYPE pgcdc_events_total counter
pgcdc_events_total{table="public.orders",op="c"} 12
pgcdc_events_total{table="public.orders",op="u"} 3
pgcdc_events_total{table="odd \"name\"\\x",op="c"} 1
pgcdc_confirmed_lsn 23456789
pgcdc_commit_to_ack_seconds{quantile="0.99"} 0.017 1700000000
pgcdc_commit_to_ack_seconds_sum +Inf
broken{table="unterminated} 1
"#;

    #[test]
    fn sums_and_filters_by_label() {
        let s = parse(TEXT);
        assert_eq!(
            s.sum("pgcdc_events_total", &[("table", "public.orders")]),
            Some(15.0)
        );
        assert_eq!(
            s.sum("pgcdc_events_total", &[("op", "c")]),
            Some(13.0),
            "both tables' creates"
        );
        assert_eq!(s.sum("pgcdc_events_total", &[("table", "nope")]), None);
        assert_eq!(s.sum("pgcdc_confirmed_lsn", &[]), Some(23456789.0));
    }

    #[test]
    fn reads_escapes_timestamps_and_infinities_and_skips_what_it_cannot_read() {
        let s = parse(TEXT);
        assert_eq!(
            s.label_values("pgcdc_events_total", "table"),
            vec!["odd \"name\"\\x".to_string(), "public.orders".to_string()]
        );
        assert_eq!(
            s.sum("pgcdc_commit_to_ack_seconds", &[("quantile", "0.99")]),
            Some(0.017)
        );
        assert_eq!(
            s.sum("pgcdc_commit_to_ack_seconds_sum", &[]),
            Some(f64::INFINITY)
        );
        assert_eq!(s.sum("broken", &[]), None);
    }
}
