//! Least privilege and secrets: the pipeline runs under the roles of
//! `sql/roles.sql` (neither superuser nor owner of anything captured), and
//! no password (in a DSN, a SASL property, the registry's credentials)
//! ever shows in logs at debug level, errors, `validate` or `check`
//! output, or metrics.

use std::process::Stdio;
use std::time::Duration;

use crate::materialize as mat;
use crate::support::{self, ConfigFile, Stack};

const CONNECTOR_SECRET: &str = "conn-Secr3t-7731";
const MATERIALIZER_SECRET: &str = "mat-Secr3t-4409";
const SASL_SECRET: &str = "sasl-Secr3t-9912";
const REGISTRY_SECRET: &str = "reg-Secr3t-5518";
const SECRETS: [&str; 4] = [
    CONNECTOR_SECRET,
    MATERIALIZER_SECRET,
    SASL_SECRET,
    REGISTRY_SECRET,
];

/// A `pgcdc` process with debug logging, its output kept in a file.
struct Logged {
    child: tokio::process::Child,
    log: tempfile::NamedTempFile,
}

impl Logged {
    fn start(args: &[&str]) -> Logged {
        let log = tempfile::NamedTempFile::new().expect("log file");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
            .args(args)
            .env("RUST_LOG", "debug")
            .stdout(Stdio::from(log.reopen().expect("log")))
            .stderr(Stdio::from(log.reopen().expect("log")))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn pgcdc");
        Logged { child, log }
    }

    async fn stop(mut self) -> String {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("stopped within 30 s")
            .expect("wait");
        let log = std::fs::read_to_string(self.log.path()).expect("read log");
        assert_eq!(status.code(), Some(0), "{log}");
        log
    }
}

fn assert_no_secret(what: &str, text: &str) {
    assert!(
        !text.is_empty(),
        "{what}: nothing captured, nothing checked"
    );
    for s in SECRETS {
        assert!(!text.contains(s), "{what} shows a secret:\n{text}");
    }
}

fn pipeline(stack: &Stack, source: &str, target: &str, name: &str) -> String {
    let host = |url: &str| {
        url.split_once('@')
            .map(|(_, h)| h.to_string())
            .expect("host")
    };
    format!(
        r#"name = "{name}"
[source]
url = "postgres://pgcdc_connector:{CONNECTOR_SECRET}@{source}"
slot = "{name}"
publication = "{name}"
tables = ["public.customers", "public.orders"]
[kafka]
brokers = "{brokers}"
topic_prefix = "{name}"
[kafka.properties]
"sasl.username" = "pgcdc"
"sasl.password" = "{SASL_SECRET}"
[registry]
url = "{registry}"
username = "pgcdc"
password = "{REGISTRY_SECRET}"
[target]
url = "postgres://pgcdc_materializer:{MATERIALIZER_SECRET}@{target}"
{}"#,
        mat::READ_MODELS,
        source = host(source),
        target = host(target),
        brokers = stack.brokers,
        registry = stack.registry_url,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipeline_runs_under_least_privilege_roles_and_never_shows_a_secret() {
    let stack = support::stack();
    let admin = support::connect(&stack.admin_url).await;
    // Databases of the superuser: the roles own nothing in them.
    let (source_name, target_name) = (support::unique("roles_src"), support::unique("roles_tgt"));
    for db in [&source_name, &target_name] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .expect("database");
    }
    let source_admin_url = support::with_database(&stack.admin_url, &source_name);
    let target_admin_url = support::with_database(&stack.admin_url, &target_name);
    let source_admin = support::connect(&source_admin_url).await;
    let target_admin = support::connect(&target_admin_url).await;
    mat::seed(&source_admin, 99, 500).await;
    support::apply_sql_file(&source_admin, "sql/roles.sql").await;
    support::apply_sql_file(&target_admin, "sql/roles.sql").await;
    let name = source_name.clone();
    source_admin
        .execute(
            "SELECT pgcdc_admin.grant_capture('pgcdc_connector', $1, ARRAY['public.customers', 'public.orders'])",
            &[&name],
        )
        .await
        .expect("grant capture");
    // The publication also covers a table in a schema the connector's
    // role may not use: its checks must not need that schema.
    source_admin
        .batch_execute(&format!(
            "CREATE SCHEMA private; CREATE TABLE private.t (id int PRIMARY KEY);
             ALTER PUBLICATION {name} ADD TABLE private.t;"
        ))
        .await
        .expect("private schema");
    target_admin
        .execute("SELECT pgcdc_admin.grant_apply('pgcdc_materializer')", &[])
        .await
        .expect("grant apply");
    admin
        .batch_execute(&format!(
            "ALTER ROLE pgcdc_connector PASSWORD '{CONNECTOR_SECRET}';
             ALTER ROLE pgcdc_materializer PASSWORD '{MATERIALIZER_SECRET}';"
        ))
        .await
        .expect("passwords");
    // The roles are what sql/roles.sql says, nothing more.
    let rights = source_admin
        .query_one(
            "SELECT r.rolsuper, r.rolreplication, r.rolcreatedb, r.rolcreaterole,
                    has_table_privilege('pgcdc_connector', 'public.orders', 'SELECT'),
                    has_table_privilege('pgcdc_connector', 'public.orders', 'INSERT'),
                    (SELECT count(*) FROM pg_class c WHERE c.relowner = r.oid)
             FROM pg_roles r WHERE r.rolname = 'pgcdc_connector'",
            &[],
        )
        .await
        .expect("connector rights");
    assert_eq!(
        (
            rights.get::<_, bool>(0),
            rights.get::<_, bool>(1),
            rights.get::<_, bool>(2),
            rights.get::<_, bool>(3),
            rights.get::<_, bool>(4),
            rights.get::<_, bool>(5),
            rights.get::<_, i64>(6)
        ),
        (false, true, false, false, true, false, 0)
    );
    let materializer_super: bool = target_admin
        .query_one(
            "SELECT rolsuper OR rolcreatedb OR rolreplication FROM pg_roles WHERE rolname = 'pgcdc_materializer'",
            &[],
        )
        .await
        .expect("materializer rights")
        .get(0);
    assert!(!materializer_super);

    let config = ConfigFile::write(&pipeline(
        &stack,
        &source_admin_url,
        &target_admin_url,
        &name,
    ));
    let parsed = pgcdc::config::Config::load(&config.path).expect("config");

    let validate = support::pgcdc(&["validate", "--config", config.arg()]).await;
    assert_eq!(validate.code, 0, "{}", validate.all_output());
    assert_no_secret("validate", &validate.all_output());
    let check = support::pgcdc(&["check", "--config", config.arg()]).await;
    assert_no_secret("check", &check.all_output());
    assert!(
        check
            .check_line("postgres.publication")
            .is_some_and(|l| l.starts_with("PASS")),
        "{}",
        check.all_output()
    );

    let (connector_metrics, materializer_metrics) = (
        format!("127.0.0.1:{}", support::free_port()),
        format!("127.0.0.1:{}", support::free_port()),
    );
    let connector = Logged::start(&[
        "run",
        "--config",
        config.arg(),
        "--http-addr",
        &connector_metrics,
    ]);
    let materializer = Logged::start(&[
        "materialize",
        "--config",
        config.arg(),
        "--http-addr",
        &materializer_metrics,
    ]);
    support::wait_snapshot_completed(&parsed).await;
    let source = support::connect(&source_admin_url).await;
    let target = support::connect(&target_admin_url).await;
    mat::workload(&source, 2_000, 0x5ec7e7).await;
    mat::wait_converged(&source, &target).await;
    // The materializer owns what it created, in its own schemas.
    let owner: String = target
        .query_one(
            "SELECT tableowner::text FROM pg_tables WHERE schemaname = 'mirror' AND tablename = 'orders'",
            &[],
        )
        .await
        .expect("mirror owner")
        .get(0);
    assert_eq!(owner, "pgcdc_materializer");
    for addr in [&connector_metrics, &materializer_metrics] {
        let page = reqwest::get(format!("http://{addr}/metrics"))
            .await
            .expect("metrics")
            .text()
            .await
            .expect("metrics text");
        assert!(page.contains("pgcdc_"), "{page}");
        assert_no_secret("metrics", &page);
    }
    assert_no_secret("connector log", &connector.stop().await);
    assert_no_secret("materializer log", &materializer.stop().await);

    // Failures: a wrong password for each role, at debug level.
    let wrong = ConfigFile::write(
        &pipeline(&stack, &source_admin_url, &target_admin_url, &name)
            .replace(
                &format!("pgcdc_connector:{CONNECTOR_SECRET}"),
                &format!("pgcdc_connector:{MATERIALIZER_SECRET}"),
            )
            .replace(
                &format!("pgcdc_materializer:{MATERIALIZER_SECRET}"),
                &format!("pgcdc_materializer:{CONNECTOR_SECRET}"),
            ),
    );
    for command in ["run", "materialize", "check"] {
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
            .args([command, "--config", wrong.arg()])
            .env("RUST_LOG", "debug")
            .output();
        let out = tokio::time::timeout(Duration::from_secs(60), out)
            .await
            .unwrap_or_else(|_| panic!("{command} with a wrong password did not stop"))
            .expect("run pgcdc");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.status.success(), "{command}: {text}");
        assert!(
            text.contains("password authentication failed"),
            "{command}: {text}"
        );
        assert_no_secret(command, &text);
    }

    drop((source_admin, target_admin, source, target));
    for db in [&source_name, &target_name] {
        let _ = admin
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1",
                &[db],
            )
            .await;
        let _ = admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
            .await;
    }
}
