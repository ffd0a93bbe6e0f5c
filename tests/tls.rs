//! TLS to Postgres: a scratch cluster that refuses plain TCP, with a
//! certificate for `localhost` signed by a CA this test generates. Every
//! connection of the pipeline (SQL sessions, the replication stream, the
//! materializer's target) is encrypted, `verify-full` and `verify-ca`
//! check what they should, and a refused certificate stops the connector
//! instead of being retried.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::faults::LOGICAL;
use crate::materialize as mat;
use crate::support::{self, ConfigFile, ScratchCluster};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA that signed a server certificate for `localhost` (and nothing
/// else), and a second CA that signed nothing of ours.
struct Certs {
    ca: PathBuf,
    other_ca: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

/// An EC P-256 key and certificate request, `-nodes`: no passphrase.
const EC_KEY: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:prime256v1",
    "-nodes",
];

fn make_certs(dir: &Path) -> Certs {
    for (name, subject) in [("ca", "/CN=pgcdc test CA"), ("other", "/CN=pgcdc other CA")] {
        let (key, crt) = (format!("{name}.key"), format!("{name}.crt"));
        let mut args = vec!["req", "-x509"];
        args.extend(EC_KEY);
        args.extend([
            "-keyout", &key, "-out", &crt, "-days", "2", "-subj", subject,
        ]);
        openssl(dir, &args);
    }
    issue(
        dir,
        "server",
        "/CN=localhost",
        "subjectAltName = DNS:localhost\nbasicConstraints = CA:FALSE\n\
         keyUsage = digitalSignature\nextendedKeyUsage = serverAuth\n",
    );
    Certs {
        ca: dir.join("ca.crt"),
        other_ca: dir.join("other.crt"),
        server_cert: dir.join("server.crt"),
        server_key: dir.join("server.key"),
    }
}

/// `name.key` and `name.crt` for `subject`, signed by the test CA with
/// `extensions`.
fn issue(dir: &Path, name: &str, subject: &str, extensions: &str) -> (PathBuf, PathBuf) {
    let (key, csr, ext, crt) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.ext"),
        format!("{name}.crt"),
    );
    let mut args = vec!["req"];
    args.extend(EC_KEY);
    args.extend(["-keyout", &key, "-out", &csr, "-subj", subject]);
    openssl(dir, &args);
    std::fs::write(dir.join(&ext), extensions).expect("extensions");
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &crt,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
    (dir.join(crt), dir.join(key))
}

/// pgwire-replication 0.5.0's verify-ca verifier forgives rustls'
/// `NotValidForName` but not the `NotValidForNameContext` rustls 0.23.46
/// reports, so on the replication connection verify-ca checks the host
/// name as verify-full does. The day this is fixed upstream, this test
/// fails: set it to false and drop the README's note.
const REPLICATION_CHECKS_NAMES: bool = true;

fn config(stack: &support::Stack, source: &str, target: &str, name: &str) -> String {
    format!(
        "{}[target]\nurl = \"{target}\"\n{}",
        support::pipeline_toml(stack, source, name, &["public.customers", "public.orders"]),
        mat::READ_MODELS
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connections_are_encrypted_and_verify_the_server() {
    let stack = support::stack();
    let cluster = ScratchCluster::start(&LOGICAL);
    let certs = make_certs(cluster.dir());
    cluster.give_to_server(&certs.server_key);
    cluster.reconfigure(
        &[
            "ssl = on",
            &format!("ssl_cert_file = '{}'", certs.server_cert.display()),
            &format!("ssl_key_file = '{}'", certs.server_key.display()),
        ],
        // The source takes TCP only with TLS (its walsender too); the target
        // takes both, so that a plain session there would show. The test's
        // own sessions use the Unix socket.
        &["hostnossl tls_src all 0.0.0.0/0 reject"],
    );
    let port = cluster.port;
    let url = |host: &str, db: &str, params: String| {
        format!("postgres://postgres@{host}:{port}/{db}?{params}")
    };
    // A reload is a signal: wait until the server speaks TLS.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let probe = pgcdc::secret::Dsn::new(url("localhost", "postgres", "sslmode=require".into()));
    while let Err(e) = pgcdc::source::connect(&probe).await {
        assert!(
            std::time::Instant::now() < deadline,
            "no TLS after reload: {}",
            pgcdc::source::error_text(&e)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let admin = support::connect(&cluster.socket_url("postgres")).await;
    for db in ["tls_src", "tls_tgt"] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .expect("database");
    }
    let source = support::connect(&cluster.socket_url("tls_src")).await;
    let target = support::connect(&cluster.socket_url("tls_tgt")).await;
    mat::seed(&source, 40, 200).await;
    let ca = format!("sslrootcert={}", certs.ca.display());
    let name = support::unique("tls");

    // What `check` says of each mode, for a SQL session and for the
    // connector's replication connection, against this one server.
    let cases: [(&str, String, bool, &str); 8] = [
        (
            "localhost",
            format!("sslmode=verify-full&{ca}"),
            true,
            "sslmode=verify-full",
        ),
        (
            "localhost",
            format!("sslmode=verify-ca&{ca}"),
            true,
            "sslmode=verify-ca",
        ),
        // verify-ca checks the chain only, so another name passes (on
        // the SQL session; see `REPLICATION_CHECKS_NAMES`)...
        (
            "127.0.0.1",
            format!("sslmode=verify-ca&{ca}"),
            true,
            "sslmode=verify-ca",
        ),
        (
            "127.0.0.1",
            "sslmode=require".into(),
            true,
            "sslmode=require",
        ),
        // ...where verify-full refuses it.
        (
            "127.0.0.1",
            format!("sslmode=verify-full&{ca}"),
            false,
            "not valid for name",
        ),
        (
            "localhost",
            format!(
                "sslmode=verify-full&sslrootcert={}",
                certs.other_ca.display()
            ),
            false,
            "UnknownIssuer",
        ),
        (
            "localhost",
            "sslmode=disable".into(),
            false,
            "no encryption",
        ),
        (
            "localhost",
            "sslmode=verify-full&sslrootcert=/nonexistent/ca.pem".into(),
            false,
            "\"/nonexistent/ca.pem\" does not exist",
        ),
    ];
    for (host, params, passes, says) in &cases {
        let dsn = url(host, "tls_src", params.clone());
        let file = ConfigFile::write(&config(&stack, &dsn, &dsn, &name));
        let run = support::pgcdc(&["check", "--config", file.arg()]).await;
        for check in ["postgres.connect", "postgres.replication"] {
            let line = run.check_line(check).unwrap_or_default();
            let name_checked = check == "postgres.replication"
                && REPLICATION_CHECKS_NAMES
                && params.starts_with("sslmode=verify-ca")
                && *host == "127.0.0.1";
            let passes = *passes && !name_checked;
            let status = if passes { "PASS" } else { "FAIL" };
            let says = if name_checked {
                "not valid for name"
            } else if passes && check == "postgres.replication" {
                "a replication connection opens"
            } else {
                says
            };
            assert!(
                line.starts_with(status) && line.contains(says),
                "{host} {params}: expected {check} {status} with {says:?}:\n{}",
                run.all_output()
            );
        }
        let line = run.check_line("postgres.connect").unwrap_or_default();
        let status = if *passes { "PASS" } else { "FAIL" };
        assert!(line.starts_with(status), "{line}");
        if *passes {
            assert!(line.contains("TLSv1."), "{line}");
        } else if says.contains("valid") || says.contains("Issuer") {
            assert!(run.stdout.contains("sslrootcert (the CA"), "{}", run.stdout);
        }
    }

    // The pipeline over verify-full, source and target.
    let verified = |db| url("localhost", db, format!("sslmode=verify-full&{ca}"));
    let file = ConfigFile::write(&config(
        &stack,
        &verified("tls_src"),
        &verified("tls_tgt"),
        &name,
    ));
    let parsed = pgcdc::config::Config::load(&file.path).expect("config");
    let connector = support::ConnectorProcess::start(&file);
    let mut materializer = mat::materializer(&file, &[], &[]);
    support::wait_snapshot_completed(&parsed).await;
    mat::workload(&source, 500, 0x7157).await;
    support::wait_caught_up(&source, &name).await;
    mat::wait_converged(&source, &target).await;
    let row = admin
        .query_one(
            "SELECT count(*) FILTER (WHERE a.backend_type = 'walsender' AND s.ssl),
                    count(*) FILTER (WHERE a.backend_type = 'client backend' AND a.datname = 'tls_tgt' AND s.ssl),
                    count(*) FILTER (WHERE a.client_addr IS NOT NULL AND NOT s.ssl)
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)",
            &[],
        )
        .await
        .expect("pg_stat_ssl");
    let (walsenders, target_sessions, plain): (i64, i64, i64) =
        (row.get(0), row.get(1), row.get(2));
    assert!(walsenders >= 1, "the replication stream is not encrypted");
    assert!(
        target_sessions >= 1,
        "the materializer's session is not encrypted"
    );
    // The target would take a plain session: none of pgcdc's is one.
    assert_eq!(plain, 0, "a TCP session without TLS");
    assert_eq!(connector.terminate().await, 0);
    let _ = materializer.kill().await;

    // A certificate the connector cannot trust is not an outage: it stops,
    // naming the reason, instead of retrying for ever.
    let untrusted = url(
        "localhost",
        "tls_src",
        format!(
            "sslmode=verify-full&sslrootcert={}",
            certs.other_ca.display()
        ),
    );
    let file = ConfigFile::write(&config(&stack, &untrusted, &verified("tls_tgt"), &name));
    let run = tokio::time::timeout(
        Duration::from_secs(60),
        support::pgcdc(&["run", "--config", file.arg()]),
    )
    .await
    .expect("pgcdc run with an untrusted certificate kept retrying");
    assert_ne!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stderr.contains("certificate") && run.stderr.contains("UnknownIssuer"),
        "{}",
        run.all_output()
    );
}

/// A server that authenticates by client certificate (`cert` in
/// pg_hba.conf): `sslcert` and `sslkey` go to the server on the SQL
/// sessions and on the replication connection; without them the server
/// refuses, and a certificate file that does not exist is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_authenticate_sql_sessions_and_the_replication_stream() {
    let stack = support::stack();
    let cluster = ScratchCluster::start(&LOGICAL);
    let certs = make_certs(cluster.dir());
    let (client_cert, client_key) = issue(
        cluster.dir(),
        "client",
        "/CN=postgres",
        "basicConstraints = CA:FALSE\nkeyUsage = digitalSignature\nextendedKeyUsage = clientAuth\n",
    );
    cluster.give_to_server(&certs.server_key);
    cluster.reconfigure(
        &[
            "ssl = on",
            &format!("ssl_cert_file = '{}'", certs.server_cert.display()),
            &format!("ssl_key_file = '{}'", certs.server_key.display()),
            &format!("ssl_ca_file = '{}'", certs.ca.display()),
        ],
        &[
            "hostssl tls_cert all 0.0.0.0/0 cert",
            "host tls_cert all 0.0.0.0/0 reject",
        ],
    );
    let admin = support::connect(&cluster.socket_url("postgres")).await;
    admin
        .batch_execute("CREATE DATABASE tls_cert")
        .await
        .expect("database");
    let source = support::connect(&cluster.socket_url("tls_cert")).await;
    mat::seed(&source, 10, 20).await;
    let port = cluster.port;
    let url = |params: String| format!("postgres://postgres@localhost:{port}/tls_cert?{params}");
    let ca = format!("sslmode=verify-full&sslrootcert={}", certs.ca.display());
    let with_cert = url(format!(
        "{ca}&sslcert={}&sslkey={}",
        client_cert.display(),
        client_key.display()
    ));
    // A reload is a signal: wait until the server takes the certificate.
    // Only it gets in: pg_hba.conf admits TCP by certificate alone, so a
    // check that passes presented it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while let Err(e) = pgcdc::source::connect(&pgcdc::secret::Dsn::new(with_cert.clone())).await {
        assert!(
            std::time::Instant::now() < deadline,
            "no certificate login after reload: {}",
            pgcdc::source::error_text(&e)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let name = support::unique("tlscert");
    let cases: [(String, &str, &str); 3] = [
        (with_cert.clone(), "PASS", ""),
        (url(ca.clone()), "FAIL", "certificate"),
        (
            url(format!("{ca}&sslcert=/nonexistent/me.crt")),
            "FAIL",
            "sslcert: client certificate file \"/nonexistent/me.crt\" does not exist",
        ),
    ];
    for (dsn, status, says) in &cases {
        let file = ConfigFile::write(&config(&stack, dsn, dsn, &name));
        let run = support::pgcdc(&["check", "--config", file.arg()]).await;
        for check in ["postgres.connect", "postgres.replication", "target.connect"] {
            let line = run.check_line(check).unwrap_or_default();
            assert!(
                line.starts_with(status) && run.stdout.contains(says),
                "{dsn}: expected {check} {status} with {says:?}:\n{}",
                run.all_output()
            );
        }
    }
}
