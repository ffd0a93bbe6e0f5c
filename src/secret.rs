//! Values that must never reach output or logs.
//!
//! Guarantee: `Debug`, `Display` and `Serialize` of [`Secret`] and of a
//! [`Dsn`]'s password print a fixed placeholder. The only way to the real
//! value is an explicit `expose()` at the point of use.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// What every redacted value prints as.
pub const REDACTED: &str = "***";

/// A password, token or key.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({REDACTED})")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Secret)
    }
}

/// A Postgres connection string, URL (`postgres://u:p@h/db`) or key/value
/// (`host=h password=p`) form, whose password never prints.
#[derive(Clone, PartialEq, Eq)]
pub struct Dsn(String);

impl Dsn {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The connection string with its password replaced by [`REDACTED`].
    pub fn redacted(&self) -> String {
        redact_dsn(&self.0)
    }
}

impl fmt::Debug for Dsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Dsn({})", self.redacted())
    }
}

impl fmt::Display for Dsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl Serialize for Dsn {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.redacted())
    }
}

impl<'de> Deserialize<'de> for Dsn {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(Dsn)
    }
}

/// Redacts the password of a URL-form or key/value-form connection string,
/// and any `password=` query parameter.
pub fn redact_dsn(dsn: &str) -> String {
    // A URL starts with its scheme; "://" inside a key/value value is not one.
    let scheme_end = dsn.find("://").filter(|&i| {
        i > 0
            && dsn[..i]
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
    });
    match scheme_end {
        Some(end) => redact_url(dsn, end),
        None => redact_key_value(dsn),
    }
}

/// Redacts the password in a URL's userinfo and in its query string.
fn redact_url(url: &str, scheme_end: usize) -> String {
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let mut out = String::with_capacity(url.len());
    out.push_str(&url[..rest_start]);
    // Credentials end at the first '@', as tokio-postgres reads them: a
    // '/', '?' or '#' in a password does not end them.
    let after_credentials = match rest.find('@') {
        Some(at) => {
            let userinfo = &rest[..at];
            match userinfo.find(':') {
                Some(colon) => {
                    out.push_str(&userinfo[..colon]);
                    out.push(':');
                    out.push_str(REDACTED);
                }
                None => out.push_str(userinfo),
            }
            out.push('@');
            at + 1
        }
        None => 0,
    };
    let tail = &rest[after_credentials..];
    match tail.find('?') {
        Some(q) => {
            out.push_str(&tail[..=q]);
            let params: Vec<String> = tail[q + 1..]
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((k, _)) if is_sensitive_key(k) => format!("{k}={REDACTED}"),
                    _ => pair.to_string(),
                })
                .collect();
            out.push_str(&params.join("&"));
        }
        None => out.push_str(tail),
    }
    out
}

fn redact_key_value(dsn: &str) -> String {
    // libpq grammar: `key = value` pairs separated by whitespace, where a
    // value is either bare or single-quoted with backslash escapes.
    let bytes = dsn.as_bytes();
    let mut out = String::with_capacity(dsn.len());
    let mut i = 0;
    while i < bytes.len() {
        let ws_start = i;
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        out.push_str(&dsn[ws_start..i]);
        let key_start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &dsn[key_start..i];
        let sep_start = i;
        while i < bytes.len() && (bytes[i] == b'=' || bytes[i].is_ascii_whitespace()) {
            i += 1;
        }
        let sep = &dsn[sep_start..i];
        let value_start = i;
        if i < bytes.len() && bytes[i] == b'\'' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'\'' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i = (i + 1).min(bytes.len());
        } else {
            while i < bytes.len() && !bytes[i].is_ascii_whitespace() {
                i += 1;
            }
        }
        out.push_str(key);
        out.push_str(sep);
        if is_sensitive_key(key) {
            out.push_str(REDACTED);
        } else {
            out.push_str(&dsn[value_start..i.min(dsn.len())]);
        }
    }
    out
}

/// Whether a configuration key names a secret (Postgres, librdkafka or HTTP).
pub fn is_sensitive_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    [
        "password",
        "secret",
        "passwd",
        "token",
        "credential",
        ".pem",
        "key.pem",
        "sslkey",
    ]
    .iter()
    .any(|needle| key.contains(needle))
        || key == "ssl.key.location"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_password_is_redacted() {
        let d = Dsn::new("postgres://app:hunter2@db:5432/shop?sslmode=require");
        assert_eq!(
            d.to_string(),
            "postgres://app:***@db:5432/shop?sslmode=require"
        );
        assert!(!format!("{d:?}").contains("hunter2"));
    }

    #[test]
    fn passwords_holding_url_characters_and_urls_in_values_are_redacted() {
        for (dsn, secret) in [
            ("postgres://u:hun?ter2@db/shop", "hun?ter2"),
            (
                "postgres://u:hun/ter#2@db/shop?sslmode=require",
                "hun/ter#2",
            ),
            (
                "host=db password=hunter2 application_name=svc://x",
                "hunter2",
            ),
        ] {
            let shown = Dsn::new(dsn).to_string();
            assert!(
                !shown.contains(secret) && shown.contains(REDACTED),
                "{shown}"
            );
        }
    }

    #[test]
    fn url_without_password_is_unchanged() {
        let d = Dsn::new("postgresql://app@db/shop");
        assert_eq!(d.redacted(), "postgresql://app@db/shop");
    }

    #[test]
    fn url_query_password_is_redacted() {
        let d = Dsn::new("postgres://db/shop?user=app&password=hunter2");
        assert_eq!(d.redacted(), "postgres://db/shop?user=app&password=***");
    }

    #[test]
    fn key_value_password_is_redacted_even_quoted() {
        let d = Dsn::new("host=db user=app password='hun ter2' dbname=shop");
        let shown = d.redacted();
        assert!(!shown.contains("hun"), "{shown}");
        assert!(shown.contains("password=***"), "{shown}");
        assert!(shown.contains("dbname=shop"), "{shown}");
        let plain = Dsn::new("host=db password=hunter2");
        assert_eq!(plain.redacted(), "host=db password=***");
    }

    #[test]
    fn secret_never_prints() {
        let s = Secret::new("hunter2");
        assert_eq!(s.to_string(), REDACTED);
        assert!(!format!("{s:?}").contains("hunter2"));
        assert_eq!(serde_json::to_string(&s).unwrap_or_default(), "\"***\"");
        assert_eq!(s.expose(), "hunter2");
    }

    #[test]
    fn sensitive_keys_cover_librdkafka_secrets() {
        for k in [
            "sasl.password",
            "ssl.key.password",
            "ssl.keystore.password",
            "sasl.oauthbearer.client.secret",
            "ssl.key.pem",
        ] {
            assert!(is_sensitive_key(k), "{k}");
        }
        assert!(!is_sensitive_key("compression.type"));
    }
}
