//! Points in time and spans as the retention report shows and reads them:
//! RFC 3339 UTC timestamps (`2026-12-01T05:40:12.123Z`), spans such as
//! `90d` or `1d12h`, and byte counts.
//!
//! Guarantee: [`rfc3339`] and [`parse_timestamp`] round-trip every
//! millisecond, and parsing never guesses: text that is not exactly one of
//! the documented forms is refused.

use crate::encode::types::{civil_from_days, days_from_civil};

const MS_PER_DAY: i64 = 86_400_000;

/// Milliseconds since the epoch as `YYYY-MM-DDTHH:MM:SS.mmmZ`.
pub fn rfc3339(ms: i64) -> String {
    let (days, rest) = (ms.div_euclid(MS_PER_DAY), ms.rem_euclid(MS_PER_DAY));
    let (y, m, d) = civil_from_days(days);
    let (h, min, s, milli) = (
        rest / 3_600_000,
        rest / 60_000 % 60,
        rest / 1000 % 60,
        rest % 1000,
    );
    format!("{y:04}-{m:02}-{d:02}T{h:02}:{min:02}:{s:02}.{milli:03}Z")
}

/// `YYYY-MM-DD` (midnight UTC) or `YYYY-MM-DDTHH:MM:SS[.fff](Z|±HH:MM)`,
/// as milliseconds since the epoch.
pub fn parse_timestamp(text: &str) -> Option<i64> {
    let num = |s: &str, len: usize| -> Option<i64> {
        (s.len() == len && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let (date, time) = match text.split_once(['T', 't']) {
        Some((d, t)) => (d, Some(t)),
        None => (text, None),
    };
    let mut parts = date.split('-');
    let (y, m, d) = (
        num(parts.next()?, 4)?,
        num(parts.next()?, 2)?,
        num(parts.next()?, 2)?,
    );
    if parts.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    let day_ms = days_from_civil(y, m, d) * MS_PER_DAY;
    let Some(time) = time else {
        return Some(day_ms);
    };
    let (clock, offset_ms) = if let Some(c) = time.strip_suffix(['Z', 'z']) {
        (c, 0)
    } else {
        let at = time.rfind(['+', '-'])?;
        let (c, off) = time.split_at(at);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let (oh, om) = off[1..].split_once(':')?;
        (c, sign * (num(oh, 2)? * 3_600_000 + num(om, 2)? * 60_000))
    };
    let (hms, frac) = match clock.split_once('.') {
        Some((hms, f))
            if !f.is_empty() && f.len() <= 9 && f.bytes().all(|b| b.is_ascii_digit()) =>
        {
            (hms, format!("{f:0<3}")[..3].parse::<i64>().ok()?)
        }
        Some(_) => return None,
        None => (clock, 0),
    };
    let mut hms = hms.split(':');
    let (h, min, s) = (
        num(hms.next()?, 2)?,
        num(hms.next()?, 2)?,
        num(hms.next()?, 2)?,
    );
    if hms.next().is_some() || h > 23 || min > 59 || s > 59 {
        return None;
    }
    Some(day_ms + h * 3_600_000 + min * 60_000 + s * 1000 + frac - offset_ms)
}

/// A span such as `90d`, `12h`, `1d12h`, `30m`, `45s`, `2w` or `500ms`, in
/// milliseconds. Every part needs its unit.
pub fn parse_span(text: &str) -> Option<i64> {
    let mut total: i64 = 0;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let n: i64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.bytes().take_while(u8::is_ascii_alphabetic).count();
        let unit = match &rest[..unit_len] {
            "ms" => 1,
            "s" => 1000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => MS_PER_DAY,
            "w" => 7 * MS_PER_DAY,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total = total.checked_add(n.checked_mul(unit)?)?;
    }
    Some(total)
}

/// A span for people: `89d 23h 50m`, `2h 5m`, `42s`, `350ms`.
pub fn human_span(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (d, h, m, s) = (
        ms / MS_PER_DAY,
        ms / 3_600_000 % 24,
        ms / 60_000 % 60,
        ms / 1000 % 60,
    );
    let parts: Vec<String> = [(d, "d"), (h, "h"), (m, "m"), (s, "s")]
        .iter()
        .skip_while(|(n, _)| *n == 0)
        .take(3)
        .filter(|(n, _)| *n > 0)
        .map(|(n, u)| format!("{n}{u}"))
        .collect();
    parts.join(" ")
}

/// A byte count for people, with the exact figure: `52.3 MiB (54838272 bytes)`.
pub fn human_bytes(n: i64) -> String {
    let units = ["KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = None;
    for u in units {
        if value.abs() < 1024.0 {
            break;
        }
        value /= 1024.0;
        unit = Some(u);
    }
    match unit {
        Some(u) => format!("{value:.1} {u} ({n} bytes)"),
        None => format!("{n} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip_to_the_millisecond() {
        for ms in [
            0,
            1,
            951_782_400_000,
            1_764_567_612_123,
            -86_400_001,
            253_402_300_799_999,
        ] {
            let text = rfc3339(ms);
            assert_eq!(parse_timestamp(&text), Some(ms), "{text}");
        }
        assert_eq!(rfc3339(1_764_567_612_123), "2025-12-01T05:40:12.123Z");
    }

    #[test]
    fn timestamps_accept_dates_and_offsets_and_refuse_the_rest() {
        assert_eq!(parse_timestamp("1970-01-02"), Some(MS_PER_DAY));
        assert_eq!(
            parse_timestamp("1970-01-01T01:00:00+01:00"),
            Some(0),
            "an offset east of UTC"
        );
        assert_eq!(parse_timestamp("1970-01-01T00:00:00.5Z"), Some(500));
        for bad in [
            "",
            "2026-13-01",
            "2026-1-01",
            "2026-01-01T25:00:00Z",
            "2026-01-01T10:00:00",
            "2026-01-01T10:00Z",
            "yesterday",
            "2026-01-01T10:00:00.Z",
        ] {
            assert_eq!(parse_timestamp(bad), None, "{bad}");
        }
    }

    #[test]
    fn spans_need_a_unit_for_every_part() {
        assert_eq!(parse_span("90d"), Some(90 * MS_PER_DAY));
        assert_eq!(parse_span("1d12h"), Some(36 * 3_600_000));
        assert_eq!(parse_span("2w"), Some(14 * MS_PER_DAY));
        assert_eq!(parse_span("500ms"), Some(500));
        for bad in ["", "90", "d", "1y", "-1d", "1.5d", "1d 2h"] {
            assert_eq!(parse_span(bad), None, "{bad}");
        }
    }

    #[test]
    fn spans_and_bytes_read_well() {
        assert_eq!(
            human_span(89 * MS_PER_DAY + 23 * 3_600_000 + 50 * 60_000 + 7000),
            "89d 23h 50m"
        );
        assert_eq!(human_span(42_000), "42s");
        assert_eq!(human_span(2 * 3_600_000 + 5 * 60_000), "2h 5m");
        assert_eq!(human_span(350), "350ms");
        assert_eq!(human_bytes(512), "512 bytes");
        assert_eq!(human_bytes(54_838_272), "52.3 MiB (54838272 bytes)");
    }
}
