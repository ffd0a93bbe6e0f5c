//! TLS to Postgres, for SQL sessions and the replication stream alike.
//!
//! Guarantee: a connection string's `sslmode` means what it means to libpq,
//! on both kinds of connection. `verify-full` checks the server's chain
//! against `sslrootcert` and its name against the host; `verify-ca` checks
//! the chain only; `require` encrypts without checking; none of the three
//! ever falls back to plain text. `prefer` (libpq's default) tries TLS and
//! falls back; `disable` never tries.
//!
//! ```text
//! "host=db sslmode=verify-full sslrootcert=ca.pem"
//!        │ Endpoint::parse (takes out sslmode, sslrootcert)
//!        ├─► tokio_postgres::Config (sslmode disable|prefer|require) + Connector
//!        └─► pgwire_replication::TlsConfig (same mode, same CA file)
//! ```
//!
//! tokio-postgres knows no `verify-*` modes, so they never reach it: it is
//! told `require` and the rustls verifier does the checking. One rustls
//! crypto provider (ring) serves both connections.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{self, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_postgres::config::SslMode as WireMode;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::secret::Dsn;

/// libpq's `sslmode` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Option<SslMode> {
        Some(match value {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    fn verifies(self) -> bool {
        matches!(self, SslMode::VerifyCa | SslMode::VerifyFull)
    }
}

/// Where the trusted CA certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Roots {
    /// A PEM file (`sslrootcert=path`, or libpq's `~/.postgresql/root.crt`).
    File(PathBuf),
    /// `sslrootcert=system`: the Mozilla roots of `webpki-roots`.
    System,
}

/// The TLS half of a connection string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    pub mode: SslMode,
    pub roots: Roots,
}

/// A parsed connection string: tokio-postgres' settings plus our TLS.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub pg: tokio_postgres::Config,
    pub tls: Tls,
}

impl Endpoint {
    /// Parses both forms of connection string. An `sslmode` we do not know
    /// is left in place for tokio-postgres to refuse by name.
    pub fn parse(dsn: &Dsn) -> Result<Endpoint, tokio_postgres::Error> {
        let text = dsn.expose();
        let params = if text.contains("://") {
            url_params(text)
        } else {
            key_value_params(text)
        };
        let mut mode = SslMode::Prefer;
        let mut root = None;
        let mut cut = Vec::new();
        for p in &params {
            match p.key.as_str() {
                "sslmode" => {
                    if let Some(m) = SslMode::parse(&p.value) {
                        mode = m;
                        cut.push(p.span.clone());
                    }
                }
                "sslrootcert" => {
                    root = Some(p.value.clone());
                    cut.push(p.span.clone());
                }
                _ => {}
            }
        }
        let rest = remove_spans(text, &cut);
        let mut pg = tokio_postgres::Config::from_str(&rest)?;
        pg.ssl_mode(match mode {
            SslMode::Disable => WireMode::Disable,
            SslMode::Prefer => WireMode::Prefer,
            _ => WireMode::Require,
        });
        let roots = match root.as_deref() {
            Some("system") => Roots::System,
            Some(path) => Roots::File(PathBuf::from(path)),
            None => Roots::File(default_root_file()),
        };
        Ok(Endpoint {
            pg,
            tls: Tls { mode, roots },
        })
    }
}

/// libpq's default CA file.
fn default_root_file() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_default();
    PathBuf::from(home).join(".postgresql").join("root.crt")
}

impl Tls {
    /// The rustls client configuration for this mode. Reads the CA file
    /// only for the verifying modes.
    pub fn client_config(&self) -> Result<ClientConfig, TlsError> {
        let provider = Arc::new(crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError(format!("TLS setup: {e}")))?;
        let verifier: Arc<dyn ServerCertVerifier> = if self.mode.verifies() {
            let roots = Arc::new(self.root_store()?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| TlsError(format!("sslrootcert: {e}")))?;
            if self.mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        } else {
            Arc::new(Unverified(provider))
        };
        Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth())
    }

    fn root_store(&self) -> Result<RootCertStore, TlsError> {
        let mut roots = RootCertStore::empty();
        match &self.roots {
            Roots::System => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
            Roots::File(path) => {
                let missing = || {
                    TlsError(format!(
                        "sslrootcert: root certificate file \"{}\" does not exist; provide it, \
                         use sslrootcert=system for the public roots, or use sslmode=require \
                         to skip verification",
                        path.display()
                    ))
                };
                if !path.exists() {
                    return Err(missing());
                }
                let certs = CertificateDer::pem_file_iter(path)
                    .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| {
                        TlsError(format!(
                            "sslrootcert: cannot read \"{}\": {e}",
                            path.display()
                        ))
                    })?;
                let (added, _) = roots.add_parsable_certificates(certs);
                if added == 0 {
                    return Err(TlsError(format!(
                        "sslrootcert: no CA certificate in \"{}\"",
                        path.display()
                    )));
                }
            }
        }
        Ok(roots)
    }

    /// The same settings for the replication connection.
    pub fn replication(&self) -> Result<pgwire_replication::TlsConfig, TlsError> {
        use pgwire_replication::TlsConfig;
        let ca = || -> Result<Option<PathBuf>, TlsError> {
            // Read the file here too, so both connections refuse it alike.
            self.root_store()?;
            Ok(match &self.roots {
                Roots::File(path) => Some(path.clone()),
                Roots::System => None,
            })
        };
        Ok(match self.mode {
            SslMode::Disable => TlsConfig::disabled(),
            SslMode::Prefer => TlsConfig {
                mode: pgwire_replication::SslMode::Prefer,
                ..TlsConfig::require()
            },
            SslMode::Require => TlsConfig::require(),
            SslMode::VerifyCa => TlsConfig::verify_ca(ca()?),
            SslMode::VerifyFull => TlsConfig::verify_full(ca()?),
        })
    }

    /// The connector tokio-postgres is given; a CA file that cannot be read
    /// fails the connection attempt with that reason.
    pub fn connector(&self) -> Connector {
        Connector(
            self.client_config()
                .map(MakeRustlsConnect::new)
                .map_err(Arc::new),
        )
    }
}

/// Whether a connection failed because TLS refused the server (its
/// certificate) or could not be set up; an I/O error in the handshake is not.
pub fn refused(e: &tokio_postgres::Error) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        // tokio-rustls wraps rustls' verdict in an io::Error, whose
        // `source()` skips it.
        let inner = c
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|i| i as &(dyn std::error::Error + 'static));
        if [Some(c), inner]
            .into_iter()
            .flatten()
            .any(|e| e.is::<TlsError>() || e.is::<rustls::Error>())
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// A TLS setup problem: the message names the connection-string parameter.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct TlsError(pub String);

/// rustls for tokio-postgres, or the reason it could not be set up.
#[derive(Clone)]
pub struct Connector(Result<MakeRustlsConnect, Arc<TlsError>>);

impl std::fmt::Debug for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connector").finish_non_exhaustive()
    }
}

impl<S> MakeTlsConnect<S> for Connector
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = <MakeRustlsConnect as MakeTlsConnect<S>>::Stream;
    type TlsConnect = <MakeRustlsConnect as MakeTlsConnect<S>>::TlsConnect;
    type Error = TlsError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, TlsError> {
        match &mut self.0 {
            Ok(make) => match MakeTlsConnect::<S>::make_tls_connect(make, domain) {
                Ok(c) => Ok(c),
                Err(never) => match never {},
            },
            Err(e) => Err((**e).clone()),
        }
    }
}

/// `verify-ca`: the chain must lead to a trusted root; the name may differ.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `require` and `prefer`: any certificate, but the handshake's signatures
/// are still checked so the session key belongs to that certificate.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// One `key=value` of a connection string and the bytes it spans.
#[derive(Debug, PartialEq)]
struct Param {
    key: String,
    value: String,
    span: std::ops::Range<usize>,
}

/// The query parameters of a URL-form connection string.
fn url_params(url: &str) -> Vec<Param> {
    let Some(q) = url.find('?') else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut start = q + 1;
    for part in url[q + 1..].split('&') {
        let end = start + part.len();
        if let Some((k, v)) = part.split_once('=') {
            out.push(Param {
                key: percent_decode(k),
                value: percent_decode(v),
                span: start..end,
            });
        }
        start = end + 1;
    }
    out
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The parameters of a key/value connection string, by libpq's rules:
/// `key = value`, values single-quoted or bare, `\` escaping.
fn key_value_params(text: &str) -> Vec<Param> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let skip_ws = |mut i: usize| {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_ws(i);
        if i >= b.len() {
            return out;
        }
        let start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = text[start..i].to_string();
        i = skip_ws(i);
        if i >= b.len() || b[i] != b'=' {
            // Malformed: tokio-postgres will say so.
            return out;
        }
        i = skip_ws(i + 1);
        let mut value = Vec::new();
        if i < b.len() && b[i] == b'\'' {
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                value.push(b[i]);
                i += 1;
            }
            i += 1;
        } else {
            while i < b.len() && !b[i].is_ascii_whitespace() {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                value.push(b[i]);
                i += 1;
            }
        }
        let end = i.min(b.len());
        out.push(Param {
            key,
            value: String::from_utf8_lossy(&value).into_owned(),
            span: start..end,
        });
    }
}

/// `text` without the given parameter spans (and a URL's dangling `&`/`?`).
fn remove_spans(text: &str, spans: &[std::ops::Range<usize>]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    let mut sorted = spans.to_vec();
    sorted.sort_by_key(|s| s.start);
    for s in sorted {
        out.push_str(&text[at..s.start]);
        at = s.end;
    }
    out.push_str(&text[at..]);
    if out.contains("://") {
        while out.contains("&&") {
            out = out.replace("&&", "&");
        }
        out = out.replace("?&", "?");
        while out.ends_with('&') || out.ends_with('?') {
            out.pop();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Endpoint {
        Endpoint::parse(&Dsn::new(s)).expect(s)
    }

    #[test]
    fn both_forms_give_mode_and_root_and_keep_the_rest() {
        let e = parse("postgres://u:p@db:5433/shop?sslmode=verify-full&sslrootcert=%2Ftmp%2Fca.pem&application_name=x");
        assert_eq!(e.tls.mode, SslMode::VerifyFull);
        assert_eq!(e.tls.roots, Roots::File("/tmp/ca.pem".into()));
        assert_eq!(e.pg.get_application_name(), Some("x"));
        assert_eq!(e.pg.get_ssl_mode(), WireMode::Require);
        assert_eq!(e.pg.get_ports(), &[5433]);

        let e =
            parse("host=db user=u sslrootcert = '/tmp/my ca.pem' sslmode=verify-ca dbname=shop");
        assert_eq!(e.tls.mode, SslMode::VerifyCa);
        assert_eq!(e.tls.roots, Roots::File("/tmp/my ca.pem".into()));
        assert_eq!(e.pg.get_dbname(), Some("shop"));
        assert_eq!(e.pg.get_ssl_mode(), WireMode::Require);

        let e = parse(r"host=db password='it\'s' sslmode=disable");
        assert_eq!(e.tls.mode, SslMode::Disable);
        assert_eq!(e.pg.get_ssl_mode(), WireMode::Disable);

        let e = parse("postgres://db/shop?sslrootcert=system&sslmode=require");
        assert_eq!((e.tls.mode, e.tls.roots), (SslMode::Require, Roots::System));
    }

    #[test]
    fn libpq_defaults_and_unknown_modes() {
        let e = parse("postgres://db/shop");
        assert_eq!(e.tls.mode, SslMode::Prefer);
        assert_eq!(e.pg.get_ssl_mode(), WireMode::Prefer);
        assert!(matches!(e.tls.roots, Roots::File(ref p) if p.ends_with(".postgresql/root.crt")));
        let err = Endpoint::parse(&Dsn::new("host=db sslmode=verify-everything"))
            .expect_err("unknown mode");
        assert!(err.to_string().contains("connection string"), "{err}");
        assert!(Endpoint::parse(&Dsn::new("postgres://db/x?sslmode=sometimes")).is_err());
    }

    #[test]
    fn verifying_modes_need_a_readable_ca_file() {
        let tls = Tls {
            mode: SslMode::VerifyFull,
            roots: Roots::File("/nonexistent/ca.pem".into()),
        };
        let e = tls.client_config().expect_err("no file");
        assert!(
            e.0.contains("sslrootcert") && e.0.contains("/nonexistent/ca.pem"),
            "{e}"
        );
        assert!(tls.replication().is_err());
        // Not verifying: the file is never read.
        let tls = Tls {
            mode: SslMode::Require,
            ..tls
        };
        assert!(tls.client_config().is_ok());
        let dir = tempfile::tempdir().expect("dir");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").expect("write");
        let tls = Tls {
            mode: SslMode::VerifyCa,
            roots: Roots::File(junk),
        };
        let e = tls.client_config().expect_err("junk");
        assert!(e.0.contains("no CA certificate"), "{e}");
        let system = Tls {
            mode: SslMode::VerifyFull,
            roots: Roots::System,
        };
        assert!(system.client_config().is_ok() && system.replication().is_ok());
    }
}
