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
    // tokio-postgres ends credentials at the first '@' (a '/', '?' or '#'
    // in a password does not end them); the url crate (the registry's and
    // Redis's URLs) at the last '@' before the host's end. Whatever either
    // reads as the password is hidden.
    let after_credentials = match rest.find('@').map(|first| {
        let host = &rest[first + 1..];
        let host_end = host.find(['/', '?', '#']).unwrap_or(host.len());
        host[..host_end]
            .rfind('@')
            .map_or(first, |at| first + 1 + at)
    }) {
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
    // A query parameter without '=' has no value to hide.
    let sensitive: Vec<Pair> = url_query_pairs(url)
        .map(|(_, pairs)| pairs)
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.assigned)
        .collect();
    out.push_str(&redact_values(
        url,
        rest_start + after_credentials,
        &sensitive,
    ));
    out
}

fn redact_key_value(dsn: &str) -> String {
    redact_values(dsn, 0, &key_value_pairs(dsn))
}

/// `text` from `from` on, with the values of `pairs` whose key is
/// sensitive replaced by [`REDACTED`].
fn redact_values(text: &str, from: usize, pairs: &[Pair]) -> String {
    let mut out = String::with_capacity(text.len() - from);
    let mut at = from;
    for p in pairs
        .iter()
        .filter(|p| is_sensitive_key(&text[p.key.clone()]))
    {
        out.push_str(&text[at..p.value.start]);
        out.push_str(REDACTED);
        at = p.value.end;
    }
    out.push_str(&text[at..]);
    out
}

/// One `key=value` of a connection string, as byte ranges of its text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pair {
    pub key: std::ops::Range<usize>,
    /// The value as written (a quoted one with its quotes).
    pub value: std::ops::Range<usize>,
    /// Whether a `=` separates them, as libpq requires.
    pub assigned: bool,
}

impl Pair {
    /// The whole `key = value`.
    pub fn span(&self) -> std::ops::Range<usize> {
        self.key.start..self.value.end
    }
}

/// The pairs of a key/value connection string by libpq's grammar: `key =
/// value` separated by whitespace, a value bare or single-quoted with
/// backslash escapes. Total: malformed text still falls into pairs, so
/// redaction never leaves a value out.
pub(crate) fn key_value_pairs(dsn: &str) -> Vec<Pair> {
    let bytes = dsn.as_bytes();
    let mut pairs = Vec::new();
    let mut i = 0;
    loop {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= bytes.len() {
            return pairs;
        }
        let key_start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = key_start..i;
        let mut assigned = false;
        while i < bytes.len() && (bytes[i] == b'=' || bytes[i].is_ascii_whitespace()) {
            assigned |= bytes[i] == b'=';
            i += 1;
        }
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
        pairs.push(Pair {
            key,
            value: value_start..i.min(bytes.len()),
            assigned,
        });
    }
}

/// Where a URL's query starts (its `?`) and its `&`-separated pairs, read
/// as tokio-postgres reads a URL: the credentials end at the first `@`, so
/// a `?` in a password starts no query.
pub(crate) fn url_query_pairs(url: &str) -> Option<(usize, Vec<Pair>)> {
    let after = url.find('@').map_or(0, |at| at + 1);
    let q = after + url[after..].find('?')?;
    let mut pairs = Vec::new();
    let mut start = q + 1;
    for part in url[q + 1..].split('&') {
        let end = start + part.len();
        pairs.push(match part.find('=') {
            Some(eq) => Pair {
                key: start..start + eq,
                value: start + eq + 1..end,
                assigned: true,
            },
            None => Pair {
                key: start..end,
                value: end..end,
                assigned: false,
            },
        });
        start = end + 1;
    }
    Some((q, pairs))
}

/// Whether a configuration key names a secret (Postgres, librdkafka or HTTP).
pub fn is_sensitive_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    // Public material and paths that the rules below would catch.
    const NOT_SECRET: [&str; 4] = [
        "passfile",
        "ssl.ca.pem",
        "ssl.certificate.pem",
        "sasl.oauthbearer.token.endpoint.url",
    ];
    if NOT_SECRET.contains(&key.as_str()) {
        return false;
    }
    [
        "password",
        // Redis's `pass` query parameter; librdkafka's `*.passphrase`.
        "pass",
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
        || key == "fingerprint_key"
        // `principal=... clientSecret=...` for unsecured JWTs.
        || key == "sasl.oauthbearer.config"
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
            // The url crate reads up to the last '@' of the authority.
            ("https://svc:p@ssw0rd@registry:8081", "ssw0rd"),
            ("redis://:hun@ter2@cache:6379/0", "ter2"),
            ("redis+unix:///run/redis.sock?pass=hunter2", "hunter2"),
        ] {
            let shown = Dsn::new(dsn).to_string();
            assert!(
                !shown.contains(secret) && shown.contains(REDACTED),
                "{shown}"
            );
        }
    }

    #[test]
    fn malformed_key_value_strings_still_hide_their_passwords() {
        for dsn in [
            "host=db password hunter2",
            "password='hunter2",
            "=x password = hunter2 ==",
        ] {
            let shown = Dsn::new(dsn).to_string();
            assert!(!shown.contains("hunter2"), "{dsn} -> {shown}");
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
            "sasl.oauthbearer.assertion.private.key.passphrase",
            "sasl.oauthbearer.config",
            "pass",
        ] {
            assert!(is_sensitive_key(k), "{k}");
        }
        assert!(!is_sensitive_key("compression.type"));
    }

    #[test]
    fn public_material_and_paths_are_shown() {
        for k in [
            "passfile",
            "ssl.ca.pem",
            "SSL.Certificate.PEM",
            "sasl.oauthbearer.token.endpoint.url",
        ] {
            assert!(!is_sensitive_key(k), "{k}");
        }
        // Their secret neighbours stay hidden.
        for k in ["ssl.key.pem", "sasl.oauthbearer.client.secret", "password"] {
            assert!(is_sensitive_key(k), "{k}");
        }
    }
}
