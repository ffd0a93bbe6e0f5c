//! Column values in Postgres's binary format (a snapshot's `COPY ...
//! (FORMAT binary)`), written to Avro without the text in between: no
//! output function on the server, no parsing here.
//!
//! Guarantee: a binary value encodes to the bytes its text (what Postgres
//! writes under [`super::types::SESSION_SETTINGS`]) encodes to. [`write`]
//! takes the common values and declines the rest (infinities, numeric
//! specials, years outside 1 to 9999, `24:00:00`, decimals wider than
//! the column's scale); for those, [`text`] renders Postgres's exact
//! text, which then takes the text path. Tests hold both to what Postgres
//! itself sends and writes.
//!
//! ```text
//! COPY (FORMAT binary) field ──► Form::Text (text, varchar, enum, json, ...) ──► text path
//!                           ├──► Form::Jsonb: version byte 1, then text ──► text path
//!                           └──► Form::Binary ──► write ──(declined)──► text ──► text path
//! ```

use super::datum;
use super::types::{civil_from_days, Input, Kind};

/// How a column's binary value reaches the encoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// The binary value is the text itself (`text`, `varchar`, `char(n)`,
    /// `name`, enums, `json`).
    Text,
    /// A version byte (1), then the text (`jsonb`).
    Jsonb,
    /// A fixed binary layout, read by [`write`] and [`text`].
    Binary,
}

/// The input a binary COPY field of `form` is.
pub fn input(form: Form, b: &[u8]) -> Input<'_> {
    match form {
        Form::Text => Input::Text(b),
        // A jsonb of another version is not text this reads: as a binary
        // value of no known layout, it fails with its kind named.
        Form::Jsonb => match b.split_first() {
            Some((1, text)) => Input::Text(text),
            _ => Input::Binary(b),
        },
        Form::Binary => Input::Binary(b),
    }
}

/// The form of a column of type `oid` carried as `kind`; `None` for types
/// read as text only (a table with one copies in text).
pub fn form(oid: u32, kind: &Kind) -> Option<Form> {
    match (oid, kind) {
        (25 | 1043 | 1042 | 19, Kind::Text) | (114, Kind::Json) | (_, Kind::Enum(_)) => {
            Some(Form::Text)
        }
        (3802, Kind::Json) => Some(Form::Jsonb),
        (16, Kind::Bool)
        | (21, Kind::Int16)
        | (23, Kind::Int32)
        | (20 | 26, Kind::Int64)
        | (700, Kind::Float32)
        | (701, Kind::Float64)
        | (1700, Kind::Decimal { .. } | Kind::VariableDecimal)
        | (17, Kind::Bytes)
        | (2950, Kind::Uuid)
        | (1082, Kind::Date)
        | (1083, Kind::Time)
        | (1114, Kind::Timestamp)
        | (1184, Kind::TimestampTz) => Some(Form::Binary),
        _ => None,
    }
}

/// Days from 1970-01-01 to 2000-01-01, Postgres's epoch.
const EPOCH_DAYS: i64 = 10_957;
const EPOCH_MICROS: i64 = EPOCH_DAYS * 86_400_000_000;
const DAY_MICROS: i64 = 86_400_000_000;

/// Writes a [`Form::Binary`] value of `kind` (its union branch already
/// written); `None`, having written nothing, for a value the text path
/// must take (see the module doc) or bytes that are not one.
pub fn write(out: &mut Vec<u8>, kind: &Kind, b: &[u8]) -> Option<()> {
    match kind {
        Kind::Bool => out.push(u8::from(*fixed::<1>(b)? != [0])),
        Kind::Int16 => datum::long(out, i16::from_be_bytes(*fixed(b)?).into()),
        Kind::Int32 => datum::long(out, i32::from_be_bytes(*fixed(b)?).into()),
        Kind::Int64 => datum::long(out, int64(b)?),
        // Postgres's text of a NaN reads back as the canonical NaN.
        Kind::Float32 => {
            let f = f32::from_be_bytes(*fixed(b)?);
            let f = if f.is_nan() { f32::NAN } else { f };
            out.extend_from_slice(&f.to_le_bytes());
        }
        Kind::Float64 => {
            let f = f64::from_be_bytes(*fixed(b)?);
            let f = if f.is_nan() { f64::NAN } else { f };
            out.extend_from_slice(&f.to_le_bytes());
        }
        Kind::Decimal { scale, .. } => {
            let n = Numeric::read(b)?.unscaled(*scale)?;
            datum::bytes(out, super::types::minimal_be(&n.to_be_bytes()));
        }
        // Its scale is the value's own: the digits its text shows.
        Kind::VariableDecimal => {
            let num = Numeric::read(b)?;
            let n = num.unscaled(u32::from(num.dscale))?;
            datum::long(out, i64::from(num.dscale));
            datum::bytes(out, super::types::minimal_be(&n.to_be_bytes()));
        }
        Kind::Bytes => datum::bytes(out, b),
        Kind::Uuid => datum::string(out, hyphenated(fixed(b)?, &mut [0; 36])),
        Kind::Date => {
            let days = i32::from_be_bytes(*fixed(b)?);
            let days = i64::from(days) + EPOCH_DAYS;
            if !common_year(civil_from_days(days).0) {
                return None;
            }
            datum::long(out, days);
        }
        Kind::Time => {
            let micros = i64::from_be_bytes(*fixed(b)?);
            if !(0..DAY_MICROS).contains(&micros) {
                return None;
            }
            datum::long(out, micros);
        }
        Kind::Timestamp | Kind::TimestampTz => {
            let micros = i64::from_be_bytes(*fixed(b)?);
            let unix = micros.checked_add(EPOCH_MICROS)?;
            if !common_year(civil_from_days(unix.div_euclid(DAY_MICROS)).0) {
                return None;
            }
            datum::long(out, unix);
        }
        _ => return None,
    }
    Some(())
}

/// Years the logical date and timestamp types carry; the text path sends
/// the others (and infinities) as their text.
fn common_year(year: i64) -> bool {
    (1..=9999).contains(&year)
}

fn fixed<const N: usize>(b: &[u8]) -> Option<&[u8; N]> {
    b.try_into().ok()
}

/// An `int8`, or an `oid` (unsigned 32 bits), both carried as a long.
fn int64(b: &[u8]) -> Option<i64> {
    match b.len() {
        4 => Some(u32::from_be_bytes(*fixed(b)?).into()),
        _ => Some(i64::from_be_bytes(*fixed(b)?)),
    }
}

/// Postgres's text of a [`Form::Binary`] value of `kind`, under the
/// session settings the text path assumes; `None` for bytes that are not
/// one. Floats' text is only shown (a dead-lettered row's payload, a hot
/// key's label), never parsed: [`write`] takes every float.
pub fn text(kind: &Kind, b: &[u8]) -> Option<String> {
    Some(match kind {
        Kind::Bool => if *fixed::<1>(b)? != [0] { "t" } else { "f" }.to_string(),
        Kind::Int16 => i16::from_be_bytes(*fixed(b)?).to_string(),
        Kind::Int32 => i32::from_be_bytes(*fixed(b)?).to_string(),
        Kind::Int64 => int64(b)?.to_string(),
        // Postgres (and printf) switch to an exponent below 1e-4 and from
        // 1e6 (real) or 1e15 (double).
        Kind::Float32 => {
            let f = f32::from_be_bytes(*fixed(b)?);
            float(f.into(), || shortest(&format!("{f:e}"), 6))
        }
        Kind::Float64 => {
            let f = f64::from_be_bytes(*fixed(b)?);
            float(f, || shortest(&format!("{f:e}"), 15))
        }
        Kind::Decimal { .. } | Kind::VariableDecimal => Numeric::read(b)?.text(),
        Kind::Bytes => super::bytea_hex(b),
        Kind::Uuid => hyphenated(fixed(b)?, &mut [0; 36]).to_string(),
        Kind::Date => match i32::from_be_bytes(*fixed(b)?) {
            i32::MAX => "infinity".into(),
            i32::MIN => "-infinity".into(),
            days => {
                let (y, m, d) = civil_from_days(i64::from(days) + EPOCH_DAYS);
                with_era(format!("{:04}-{m:02}-{d:02}", era_year(y)), y)
            }
        },
        Kind::Time => clock(i64::from_be_bytes(*fixed(b)?)),
        Kind::Timestamp | Kind::TimestampTz => match i64::from_be_bytes(*fixed(b)?) {
            i64::MAX => "infinity".into(),
            i64::MIN => "-infinity".into(),
            micros => {
                let days = micros.div_euclid(DAY_MICROS);
                let (y, m, d) = civil_from_days(days + EPOCH_DAYS);
                let zone = if *kind == Kind::TimestampTz {
                    "+00"
                } else {
                    ""
                };
                let body = format!(
                    "{:04}-{m:02}-{d:02} {}{zone}",
                    era_year(y),
                    clock(micros.rem_euclid(DAY_MICROS))
                );
                with_era(body, y)
            }
        },
        _ => return None,
    })
}

/// A year as Postgres writes it: BC years counted from 1 (astronomical
/// year 0 is 1 BC).
fn era_year(y: i64) -> i64 {
    if y > 0 {
        y
    } else {
        1 - y
    }
}

fn with_era(mut s: String, y: i64) -> String {
    if y <= 0 {
        s.push_str(" BC");
    }
    s
}

/// `HH:MM:SS[.ffffff]`, trailing zeros of the fraction dropped.
fn clock(micros: i64) -> String {
    let (secs, frac) = (micros / 1_000_000, micros % 1_000_000);
    let mut s = format!("{:02}:{:02}:{:02}", secs / 3600, secs / 60 % 60, secs % 60);
    if frac != 0 {
        let digits = format!("{frac:06}");
        s.push('.');
        s.push_str(digits.trim_end_matches('0'));
    }
    s
}

/// Postgres's words for the specials, else `shown`.
fn float(f: f64, shown: impl FnOnce() -> String) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else {
        shown()
    }
}

/// A float's shortest round-trip digits (Rust's `{:e}`, as Postgres's
/// Ryu gives them under `extra_float_digits` > 0) laid out as Postgres
/// lays them out: plain from 1e-4 up to `10^plain_below`, else `d.ddde+XX`
/// with at least two exponent digits.
fn shortest(sci: &str, plain_below: i32) -> String {
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    if !(-4..plain_below).contains(&exponent) {
        let e_sign = if exponent < 0 { '-' } else { '+' };
        return format!("{sign}{mantissa}e{e_sign}{:02}", exponent.unsigned_abs());
    }
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let point = exponent + 1;
    let body = if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else if digits.len() <= point as usize {
        format!("{digits}{}", "0".repeat(point as usize - digits.len()))
    } else {
        let (int, frac) = digits.split_at(point as usize);
        format!("{int}.{frac}")
    };
    format!("{sign}{body}")
}

/// A uuid's 16 bytes as Postgres writes them: lowercase, hyphenated.
fn hyphenated<'b>(u: &[u8; 16], buf: &'b mut [u8; 36]) -> &'b str {
    use super::HEX_DIGITS as HEX;
    let mut at = 0;
    for (i, byte) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            buf[at] = b'-';
            at += 1;
        }
        buf[at] = HEX[usize::from(byte >> 4)];
        buf[at + 1] = HEX[usize::from(byte & 0xF)];
        at += 2;
    }
    // Only ASCII was written.
    std::str::from_utf8(buf).unwrap_or_default()
}

/// A `numeric` in Postgres's binary layout: base-10000 digits, the weight
/// of the first, a sign (or a special) and the display scale.
struct Numeric<'a> {
    weight: i16,
    sign: u16,
    dscale: u16,
    digits: &'a [u8],
}

const NUMERIC_NEG: u16 = 0x4000;
const NUMERIC_NAN: u16 = 0xC000;
const NUMERIC_PINF: u16 = 0xD000;
const NUMERIC_NINF: u16 = 0xF000;

impl<'a> Numeric<'a> {
    fn read(b: &'a [u8]) -> Option<Numeric<'a>> {
        let word = |i: usize| Some(u16::from_be_bytes(*fixed(b.get(i..i + 2)?)?));
        let ndigits = usize::from(word(0)?);
        let digits = b.get(8..)?;
        (digits.len() == 2 * ndigits).then_some(Numeric {
            weight: word(2)? as i16,
            sign: word(4)?,
            dscale: word(6)?,
            digits,
        })
    }

    fn digit_values(&self) -> impl Iterator<Item = i128> + '_ {
        self.digits
            .chunks_exact(2)
            .map(|d| i128::from(u16::from_be_bytes([d[0], d[1]])))
    }

    /// The unscaled value at `scale` (`12.5` at scale 2 is 1250) when it
    /// fits an i128 and the value has no more fraction digits than
    /// `scale`, as the text path requires; `None` for the specials.
    fn unscaled(&self, scale: u32) -> Option<i128> {
        let negative = match self.sign {
            0 => false,
            NUMERIC_NEG => true,
            _ => return None,
        };
        if u32::from(self.dscale) > scale {
            return None;
        }
        let ndigits = self.digits.len() / 2;
        // The power of ten of the last digit's units, then of the scale.
        let mut exponent = 4 * (i64::from(self.weight) - ndigits as i64 + 1) + i64::from(scale);
        let mut n: i128 = 0;
        for (i, mut d) in self.digit_values().enumerate() {
            // The last digit's zeros below the scale are padding: dropped
            // before they are multiplied in (38 digits fit where 38 digits
            // and three zeros would not).
            let mut width = 4;
            while i + 1 == ndigits && exponent < 0 && width > 0 && d % 10 == 0 {
                (d, width, exponent) = (d / 10, width - 1, exponent + 1);
            }
            n = n.checked_mul(10i128.pow(width))?.checked_add(d)?;
        }
        let ten = |e: i64| 10i128.checked_pow(u32::try_from(e).ok()?);
        n = if exponent >= 0 {
            n.checked_mul(ten(exponent)?)?
        } else {
            let div = ten(-exponent)?;
            // Trailing zero digits beyond the display scale only.
            (n % div == 0).then_some(n / div)?
        };
        Some(if negative { -n } else { n })
    }

    /// `numeric_out`'s text: the integer digits (at least `0`), then
    /// `dscale` fraction digits.
    fn text(&self) -> String {
        match self.sign {
            NUMERIC_NAN => return "NaN".into(),
            NUMERIC_PINF => return "Infinity".into(),
            NUMERIC_NINF => return "-Infinity".into(),
            _ => {}
        }
        let digits: Vec<i128> = self.digit_values().collect();
        let at = |i: i64| {
            usize::try_from(i)
                .ok()
                .and_then(|i| digits.get(i).copied())
                .unwrap_or(0)
        };
        let mut s = String::new();
        if self.sign == NUMERIC_NEG {
            s.push('-');
        }
        let weight = i64::from(self.weight);
        if weight < 0 {
            s.push('0');
        } else {
            s.push_str(&at(0).to_string());
            for i in 1..=weight {
                s.push_str(&format!("{:04}", at(i)));
            }
        }
        if self.dscale > 0 {
            s.push('.');
            let mut frac = String::new();
            let mut i = weight + 1;
            while frac.len() < usize::from(self.dscale) {
                frac.push_str(&format!("{:04}", at(i)));
                i += 1;
            }
            frac.truncate(usize::from(self.dscale));
            s.push_str(&frac);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numeric(weight: i16, sign: u16, dscale: u16, digits: &[u16]) -> Vec<u8> {
        let mut b = Vec::new();
        for w in [digits.len() as u16, weight as u16, sign, dscale] {
            b.extend_from_slice(&w.to_be_bytes());
        }
        for d in digits {
            b.extend_from_slice(&d.to_be_bytes());
        }
        b
    }

    #[test]
    fn numerics_read_as_postgres_writes_them() {
        // 12345.678 (dscale 3): digits 1|2345|6780, weight 1.
        let b = numeric(1, 0, 3, &[1, 2345, 6780]);
        let n = Numeric::read(&b).expect("numeric");
        assert_eq!(n.text(), "12345.678");
        assert_eq!(n.unscaled(3), Some(12_345_678));
        assert_eq!(n.unscaled(5), Some(1_234_567_800));
        assert_eq!(n.unscaled(2), None, "more fraction digits than the scale");
        // -0.0025 (dscale 4): weight -1, digit 25.
        let b = numeric(-1, NUMERIC_NEG, 4, &[25]);
        let n = Numeric::read(&b).expect("numeric");
        assert_eq!(n.text(), "-0.0025");
        assert_eq!(n.unscaled(4), Some(-25));
        // 38 digits at scale 10: the last group's three padding zeros must
        // not overflow the i128 on the way.
        let b = numeric(
            6,
            0,
            10,
            &[1234, 5678, 9012, 3456, 7890, 1234, 5678, 123, 4567, 8900],
        );
        let n = Numeric::read(&b).expect("numeric");
        assert_eq!(n.text(), "1234567890123456789012345678.0123456789");
        assert_eq!(
            n.unscaled(10),
            Some(12_345_678_901_234_567_890_123_456_780_123_456_789)
        );
        // 1000000 (dscale 2): weight 1, digit 100 (trailing zero groups dropped).
        let b = numeric(1, 0, 2, &[100]);
        let n = Numeric::read(&b).expect("numeric");
        assert_eq!(n.text(), "1000000.00");
        assert_eq!(n.unscaled(2), Some(100_000_000));
        // Zero has no digits.
        let b = numeric(0, 0, 2, &[]);
        assert_eq!(Numeric::read(&b).map(|n| n.text()), Some("0.00".into()));
        let b = numeric(0, NUMERIC_NAN, 0, &[]);
        let n = Numeric::read(&b).expect("numeric");
        assert_eq!((n.text(), n.unscaled(2)), ("NaN".into(), None));
        assert!(Numeric::read(&b[..7]).is_none(), "short bytes are refused");
    }

    #[test]
    fn floats_render_as_postgres_writes_them() {
        let f8 = |f: f64| text(&Kind::Float64, &f.to_be_bytes()).expect("double");
        let f4 = |f: f32| text(&Kind::Float32, &f.to_be_bytes()).expect("real");
        // Each as `SELECT x::float8` (or `::float4`) prints it.
        assert_eq!(f8(1e300), "1e+300");
        assert_eq!(f8(1e-7), "1e-07");
        assert_eq!(f8(0.0001), "0.0001");
        assert_eq!(f8(123_456_789_012_345.0), "123456789012345");
        assert_eq!(f8(1e15), "1e+15");
        assert_eq!(f8(1.5e15), "1.5e+15");
        assert_eq!(f8(std::f64::consts::E), "2.718281828459045");
        assert_eq!(f8(-0.0), "-0");
        assert_eq!(f8(100.0), "100");
        assert_eq!(f8(-1.25e-5), "-1.25e-05");
        assert_eq!(f8(f64::NEG_INFINITY), "-Infinity");
        assert_eq!(f4(1.1), "1.1");
        assert_eq!(f4(1e-45), "1e-45");
        assert_eq!(f4(123_456.0), "123456");
        assert_eq!(f4(1_234_567.0), "1.234567e+06");
        assert_eq!(f4(f32::NAN), "NaN");
    }

    #[test]
    fn dates_and_times_render_as_postgres_writes_them() {
        let date = |days: i32| text(&Kind::Date, &days.to_be_bytes());
        assert_eq!(date(0).as_deref(), Some("2000-01-01"));
        assert_eq!(date(i32::MAX).as_deref(), Some("infinity"));
        // 0044-03-15 BC is astronomical year -43.
        let days = crate::encode::types::days_from_civil(-43, 3, 15) - EPOCH_DAYS;
        assert_eq!(date(days as i32).as_deref(), Some("0044-03-15 BC"));
        let ts = |kind: &Kind, micros: i64| text(kind, &micros.to_be_bytes());
        assert_eq!(
            ts(&Kind::TimestampTz, -1).as_deref(),
            Some("1999-12-31 23:59:59.999999+00")
        );
        assert_eq!(
            ts(&Kind::Timestamp, 1_500_000).as_deref(),
            Some("2000-01-01 00:00:01.5")
        );
        assert_eq!(ts(&Kind::Time, DAY_MICROS).as_deref(), Some("24:00:00"));
        let mut out = Vec::new();
        assert!(write(&mut out, &Kind::Time, &DAY_MICROS.to_be_bytes()).is_none());
        assert!(write(&mut out, &Kind::Timestamp, &i64::MAX.to_be_bytes()).is_none());
        assert!(out.is_empty(), "a declined value writes nothing");
    }
}
