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
//! crypto provider (ring) serves both connections. A client certificate
//! (`sslcert`, `sslkey`, or libpq's `~/.postgresql/postgresql.crt` and
//! `.key` when they exist) goes to the server on both as well.

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
    /// The certificate the client presents, if any.
    pub client: Option<ClientCert>,
}

/// A client certificate chain and its private key, PEM files (as libpq
/// reads them; a key encrypted with `sslpassword` is not supported).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCert {
    pub cert: PathBuf,
    pub key: PathBuf,
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
        let params = if is_url(text) {
            url_params(text)
        } else {
            key_value_params(text)
        };
        let mut mode = None;
        let mut root = None;
        let (mut cert, mut key) = (None, None);
        let mut cut = Vec::new();
        for p in &params {
            match p.key.as_str() {
                "sslmode" => {
                    if let Some(m) = SslMode::parse(&p.value) {
                        mode = Some(m);
                        cut.push(p.span.clone());
                    }
                }
                "sslrootcert" => {
                    root = Some(p.value.clone());
                    cut.push(p.span.clone());
                }
                "sslcert" => {
                    cert = Some(PathBuf::from(&p.value));
                    cut.push(p.span.clone());
                }
                "sslkey" => {
                    key = Some(PathBuf::from(&p.value));
                    cut.push(p.span.clone());
                }
                _ => {}
            }
        }
        let rest = remove_spans(text, &cut);
        let mut pg = tokio_postgres::Config::from_str(&rest)?;
        let roots = match root.as_deref() {
            Some("system") => Roots::System,
            Some(path) => Roots::File(PathBuf::from(path)),
            None => Roots::File(default_root_file()),
        };
        // libpq 16: the public roots make verify-full the default.
        let mode = mode.unwrap_or(if roots == Roots::System {
            SslMode::VerifyFull
        } else {
            SslMode::Prefer
        });
        pg.ssl_mode(match mode {
            SslMode::Disable => WireMode::Disable,
            SslMode::Prefer => WireMode::Prefer,
            _ => WireMode::Require,
        });
        // As libpq: the default certificate only when it exists, its key
        // beside it unless named.
        let client = match cert {
            Some(cert) => Some(cert),
            None => Some(libpq_file("postgresql.crt")).filter(|c| c.exists()),
        }
        .map(|cert| ClientCert {
            cert,
            key: key.unwrap_or_else(|| libpq_file("postgresql.key")),
        });
        Ok(Endpoint {
            pg,
            tls: Tls {
                mode,
                roots,
                client,
            },
        })
    }
}

/// libpq's default CA file.
fn default_root_file() -> PathBuf {
    libpq_file("root.crt")
}

/// A file of libpq's `~/.postgresql` directory.
fn libpq_file(name: &str) -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_default();
    PathBuf::from(home).join(".postgresql").join(name)
}

/// What of the server's certificate is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    Nothing,
    Chain,
    ChainAndName,
}

impl Tls {
    /// What this mode checks. As in libpq, `require` checks the chain when
    /// the CA file exists (an older libpq's way to ask for verification).
    fn check(&self) -> Check {
        match self.mode {
            SslMode::VerifyFull => Check::ChainAndName,
            SslMode::VerifyCa => Check::Chain,
            SslMode::Require if matches!(&self.roots, Roots::File(p) if p.exists()) => Check::Chain,
            _ => Check::Nothing,
        }
    }

    /// A combination libpq refuses: the public roots with a weak mode
    /// (anyone can get a publicly trusted certificate for some name).
    pub fn conflict(&self) -> Option<TlsError> {
        (self.roots == Roots::System && self.mode != SslMode::VerifyFull).then(|| {
            TlsError(format!(
                "sslmode={} may not be used with sslrootcert=system; use verify-full",
                self.mode.as_str()
            ))
        })
    }

    /// The rustls client configuration for this mode. Reads the CA file
    /// only when the certificate is checked.
    pub fn client_config(&self) -> Result<ClientConfig, TlsError> {
        if let Some(e) = self.conflict() {
            return Err(e);
        }
        let provider = Arc::new(crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError(format!("TLS setup: {e}")))?;
        let check = self.check();
        let verifier: Arc<dyn ServerCertVerifier> = if check == Check::Nothing {
            Arc::new(Unverified(provider))
        } else {
            let roots = Arc::new(self.root_store()?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| TlsError(format!("sslrootcert: {e}")))?;
            if check == Check::ChainAndName {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        };
        let builder = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        match &self.client {
            Some(client) if self.mode != SslMode::Disable => {
                let (chain, key) = client.read()?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| TlsError(format!("sslcert/sslkey: {e}")))
            }
            _ => Ok(builder.with_no_client_auth()),
        }
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

    /// The same settings for the replication connection to `host`.
    pub fn replication(&self, host: &str) -> Result<pgwire_replication::TlsConfig, TlsError> {
        use pgwire_replication::TlsConfig;
        if let Some(e) = self.conflict() {
            return Err(e);
        }
        let ca = || -> Result<Option<PathBuf>, TlsError> {
            // Read the file here too, so both connections refuse it alike.
            self.root_store()?;
            Ok(match &self.roots {
                Roots::File(path) => Some(path.clone()),
                Roots::System => None,
            })
        };
        let config = match (self.mode, self.check()) {
            (SslMode::Disable, _) => TlsConfig::disabled(),
            (SslMode::Prefer, _) => TlsConfig {
                mode: pgwire_replication::SslMode::Prefer,
                ..TlsConfig::require()
            },
            (_, Check::Nothing) => TlsConfig::require(),
            (_, Check::Chain) => TlsConfig::verify_ca(ca()?),
            // pgwire wants an explicit name to check an IP address against;
            // rustls then checks the certificate's IP names.
            (_, Check::ChainAndName) if host.parse::<std::net::IpAddr>().is_ok() => {
                TlsConfig::verify_full(ca()?).with_sni_hostname(host)
            }
            (_, Check::ChainAndName) => TlsConfig::verify_full(ca()?),
        };
        // Both files read here too, so both connections refuse them alike.
        Ok(match &self.client {
            Some(client) if self.mode != SslMode::Disable => {
                client.read()?;
                config.with_client_cert(&client.cert, &client.key)
            }
            _ => config,
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

impl ClientCert {
    /// The certificate chain and the key; an error names the parameter
    /// and the file.
    fn read(
        &self,
    ) -> Result<
        (
            Vec<CertificateDer<'static>>,
            rustls::pki_types::PrivateKeyDer<'static>,
        ),
        TlsError,
    > {
        use rustls::pki_types::PrivateKeyDer;
        let unreadable = |what: &str, path: &std::path::Path, e: &dyn std::fmt::Display| {
            TlsError(format!("{what}: cannot read \"{}\": {e}", path.display()))
        };
        if !self.cert.exists() {
            return Err(TlsError(format!(
                "sslcert: client certificate file \"{}\" does not exist",
                self.cert.display()
            )));
        }
        if !self.key.exists() {
            return Err(TlsError(format!(
                "sslkey: private key file \"{}\" for client certificate \"{}\" does not exist",
                self.key.display(),
                self.cert.display()
            )));
        }
        let chain = CertificateDer::pem_file_iter(&self.cert)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| unreadable("sslcert", &self.cert, &e))?;
        if chain.is_empty() {
            return Err(TlsError(format!(
                "sslcert: no certificate in \"{}\"",
                self.cert.display()
            )));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| unreadable("sslkey", &self.key, &e))?;
        Ok((chain, key))
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
            .any(|e| e.is::<TlsError>() || e.is::<rustls::Error>() || refused_text(&e.to_string()))
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Whether an error text (pgwire-replication's, or a cause's) says TLS
/// refused the server or could not be set up, rather than an I/O failure
/// during the handshake: a retry would meet the same answer.
pub fn refused_text(text: &str) -> bool {
    [
        "invalid peer certificate",
        "TLS config error",
        "does not support TLS",
        "sslrootcert",
        "sslcert",
        "sslkey",
    ]
    .iter()
    .any(|t| text.contains(t))
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

/// tokio-postgres' own test for the URL form.
fn is_url(text: &str) -> bool {
    text.starts_with("postgres://") || text.starts_with("postgresql://")
}

/// The `key=value` query parameters of a URL-form connection string.
fn url_params(url: &str) -> Vec<Param> {
    let pairs = crate::secret::url_query_pairs(url).map_or_else(Vec::new, |(_, p)| p);
    pairs
        .into_iter()
        .filter(|p| p.assigned)
        .map(|p| Param {
            key: percent_decode(&url[p.key.clone()]),
            value: percent_decode(&url[p.value.clone()]),
            span: p.span(),
        })
        .collect()
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

/// The parameters of a key/value connection string (libpq's grammar, in
/// [`crate::secret::key_value_pairs`]), values unquoted and unescaped.
fn key_value_params(text: &str) -> Vec<Param> {
    crate::secret::key_value_pairs(text)
        .into_iter()
        .filter(|p| p.assigned)
        .map(|p| {
            let raw = &text[p.value.clone()];
            let quoted = raw
                .strip_prefix('\'')
                .map(|r| r.strip_suffix('\'').unwrap_or(r));
            Param {
                key: text[p.key.clone()].to_string(),
                value: unescape(quoted.unwrap_or(raw)),
                span: p.span(),
            }
        })
        .collect()
}

/// libpq's backslash escapes: `\x` is `x`.
fn unescape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        out.push(if c == '\\' {
            chars.next().unwrap_or(c)
        } else {
            c
        });
    }
    out
}

/// `text` without the given parameter spans; nothing else is touched.
fn remove_spans(text: &str, spans: &[std::ops::Range<usize>]) -> String {
    if spans.is_empty() {
        return text.to_string();
    }
    if is_url(text) {
        // The query rebuilt from the parameters kept.
        let Some((q, _)) = crate::secret::url_query_pairs(text) else {
            return text.to_string();
        };
        let kept: Vec<&str> = url_params(text)
            .into_iter()
            .filter(|p| !spans.contains(&p.span))
            .map(|p| &text[p.span])
            .collect();
        return if kept.is_empty() {
            text[..q].to_string()
        } else {
            format!("{}?{}", &text[..q], kept.join("&"))
        };
    }
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    let mut sorted = spans.to_vec();
    sorted.sort_by_key(|s| s.start);
    for s in sorted {
        out.push_str(&text[at..s.start]);
        at = s.end;
    }
    out.push_str(&text[at..]);
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
        assert_eq!(
            (e.tls.mode, &e.tls.roots),
            (SslMode::Require, &Roots::System)
        );
        assert!(e.tls.conflict().is_some() && e.tls.client_config().is_err());
        // libpq 16: the public roots default to verify-full.
        let e = parse("host=db sslrootcert=system");
        assert_eq!(e.tls.mode, SslMode::VerifyFull);
        assert!(e.tls.conflict().is_none());
    }

    #[test]
    fn the_rest_of_the_string_is_left_as_tokio_postgres_reads_it() {
        // A key/value string whose value holds "://" is no URL.
        let e = parse("host=db password=ab://cd sslmode=require");
        assert_eq!(e.tls.mode, SslMode::Require);
        assert_eq!(e.pg.get_password(), Some(&b"ab://cd"[..]));
        // A '?' or "&&" in the password belongs to the credentials.
        let e = parse("postgres://u:p?x@db/shop?sslmode=require&application_name=a");
        assert_eq!(e.tls.mode, SslMode::Require);
        assert_eq!(e.pg.get_password(), Some(&b"p?x"[..]));
        assert_eq!(e.pg.get_application_name(), Some("a"));
        let e = parse("postgres://u:a&&b@db/x?sslmode=disable");
        assert_eq!(e.pg.get_password(), Some(&b"a&&b"[..]));
        assert_eq!(e.tls.mode, SslMode::Disable);
        let e = parse("postgres://u:a&&b@db/x?application_name=q");
        assert_eq!(e.pg.get_password(), Some(&b"a&&b"[..]));
        assert_eq!(e.pg.get_ssl_mode(), WireMode::Prefer);
        // Spaces around '=' in the key/value form.
        let e = parse("host=db sslmode = verify-ca  sslrootcert=/x.pem");
        assert_eq!(e.tls.mode, SslMode::VerifyCa);
        assert_eq!(e.pg.get_hosts().len(), 1);
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
    fn client_certificates_are_taken_out_of_both_forms_with_libpq_defaults() {
        let e = parse("postgres://u@db/shop?sslmode=require&sslcert=%2Fc%2Fme.crt&sslkey=%2Fc%2Fme.key&application_name=x");
        assert_eq!(
            e.tls.client,
            Some(ClientCert {
                cert: "/c/me.crt".into(),
                key: "/c/me.key".into()
            })
        );
        assert_eq!(e.pg.get_application_name(), Some("x"));
        // The key defaults to libpq's file, whatever the certificate's.
        let e = parse("host=db sslcert='/c/my cert.crt' sslmode=verify-ca");
        let client = e.tls.client.expect("client certificate");
        assert_eq!(client.cert, PathBuf::from("/c/my cert.crt"));
        assert!(client.key.ends_with(".postgresql/postgresql.key"));
    }

    #[test]
    fn a_client_certificate_is_read_for_both_connections_and_errors_name_the_file() {
        let dir = tempfile::tempdir().expect("dir");
        let missing = Tls {
            mode: SslMode::Require,
            roots: Roots::File(dir.path().join("no-ca.pem")),
            client: Some(ClientCert {
                cert: dir.path().join("none.crt"),
                key: dir.path().join("none.key"),
            }),
        };
        let e = missing.client_config().expect_err("no certificate");
        assert!(
            e.0.starts_with("sslcert:") && e.0.contains("none.crt"),
            "{e}"
        );
        assert!(refused_text(&e.0));
        assert!(missing.replication("db").is_err());
        // Not sent, so not read, when TLS is off.
        let off = Tls {
            mode: SslMode::Disable,
            ..missing.clone()
        };
        assert!(off.client_config().is_ok() && off.replication("db").is_ok());
        let cert = dir.path().join("me.crt");
        std::fs::write(&cert, "not a certificate").expect("write");
        let junk = Tls {
            client: Some(ClientCert {
                cert: cert.clone(),
                key: dir.path().join("none.key"),
            }),
            ..missing
        };
        let e = junk.client_config().expect_err("no key");
        assert!(
            e.0.starts_with("sslkey:") && e.0.contains("none.key"),
            "{e}"
        );
        std::fs::write(dir.path().join("none.key"), "not a key").expect("write");
        let e = junk.client_config().expect_err("junk");
        assert!(e.0.starts_with("sslcert:"), "{e}");
    }

    #[test]
    fn verifying_modes_need_a_readable_ca_file() {
        let tls = Tls {
            mode: SslMode::VerifyFull,
            roots: Roots::File("/nonexistent/ca.pem".into()),
            client: None,
        };
        let e = tls.client_config().expect_err("no file");
        assert!(
            e.0.contains("sslrootcert") && e.0.contains("/nonexistent/ca.pem"),
            "{e}"
        );
        assert!(refused_text(&e.0));
        assert!(tls.replication("db").is_err());
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
            client: None,
        };
        let e = tls.client_config().expect_err("junk");
        assert!(e.0.contains("no CA certificate"), "{e}");
        let system = Tls {
            mode: SslMode::VerifyFull,
            roots: Roots::System,
            client: None,
        };
        assert!(system.client_config().is_ok() && system.replication("db").is_ok());
        // An IP address is checked against the certificate's IP names.
        let ip = system.replication("10.0.0.5").expect("ip");
        assert_eq!(ip.sni_hostname.as_deref(), Some("10.0.0.5"));
        assert_eq!(ip.mode, pgwire_replication::SslMode::VerifyFull);
        // require with an existing CA file checks the chain, as libpq does.
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "x").expect("write");
        let require = Tls {
            mode: SslMode::Require,
            roots: Roots::File(ca),
            client: None,
        };
        assert_eq!(require.check(), Check::Chain);
        assert!(!refused_text(
            "TLS handshake failed: connection reset by peer"
        ));
    }
}
