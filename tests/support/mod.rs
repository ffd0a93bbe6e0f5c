//! Test support: the real local stack (`scripts/stack up`), fresh databases
//! per test, scratch Postgres clusters, and running the `pgcdc` binary.
//!
//! Nothing here is a mock. Tests that need the stack fail loudly when its
//! settings are missing rather than skipping.

#![allow(dead_code)]

use pgcdc::sink::CreateClient as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use tokio_postgres::{Client, NoTls};

/// Connection settings of the local stack, from `scripts/stack env`.
#[derive(Debug, Clone)]
pub struct Stack {
    pub source_url: String,
    pub target_url: String,
    pub admin_url: String,
    pub brokers: String,
    pub registry_url: String,
    pub pg_bindir: PathBuf,
    /// The Kafka-protocol broker binary, for tests that need a broker of
    /// their own (to stop or freeze it).
    pub broker_bin: PathBuf,
}

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!("{name} is not set: run the tests through scripts/test, or `scripts/stack up && eval \"$(scripts/stack env)\"` first")
    })
}

pub fn stack() -> Stack {
    Stack {
        source_url: var("PGCDC_SOURCE_URL"),
        target_url: var("PGCDC_TARGET_URL"),
        admin_url: var("PGCDC_ADMIN_URL"),
        brokers: var("PGCDC_KAFKA_BROKERS"),
        registry_url: var("PGCDC_REGISTRY_URL"),
        pg_bindir: PathBuf::from(var("PGCDC_PG_BINDIR")),
        broker_bin: PathBuf::from(var("PGCDC_BROKER_BIN")),
    }
}

/// A name unique within this test run and across concurrent runs.
pub fn unique(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

pub async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect to test Postgres: {e}"));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// Replaces the database name at the end of a URL.
pub fn with_database(url: &str, db: &str) -> String {
    let base = url.rsplit_once('/').map(|(b, _)| b).unwrap_or(url);
    format!("{base}/{db}")
}

/// Replaces user and password in a `postgres://user:pw@host/db` URL.
pub fn with_user(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("URL form DSN");
    let host = rest.split_once('@').map(|(_, h)| h).unwrap_or(rest);
    format!("{scheme}://{user}:{password}@{host}")
}

/// A fresh database in the stack's cluster, owned by the stack's `pgcdc`
/// role, so tests never see each other's tables, slots or publications.
pub struct TestDb {
    pub name: String,
    /// URL as the `pgcdc` role.
    pub url: String,
    /// URL as the superuser, for setup the capture role may not do.
    pub admin_url: String,
    stack_admin_url: String,
}

impl TestDb {
    pub async fn create(stack: &Stack, prefix: &str) -> TestDb {
        let name = unique(prefix);
        let admin = connect(&stack.admin_url).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name} OWNER pgcdc"))
            .await
            .unwrap_or_else(|e| panic!("create database {name}: {e}"));
        TestDb {
            url: with_database(&stack.source_url, &name),
            admin_url: with_database(&stack.admin_url, &name),
            stack_admin_url: stack.admin_url.clone(),
            name,
        }
    }

    pub async fn client(&self) -> Client {
        connect(&self.url).await
    }

    pub async fn admin(&self) -> Client {
        connect(&self.admin_url).await
    }

    /// Drops the database and any replication slot left in it.
    pub async fn drop_db(self) {
        let admin = connect(&self.stack_admin_url).await;
        let _ = admin
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1",
                &[&self.name],
            )
            .await;
        let _ = admin
            .batch_execute(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await;
    }
}

/// A file of the repository. The directory comes from `cargo test`'s
/// environment when it runs the tests: the one compiled in names the clone
/// that built this binary, which in a build cache shared between clones
/// may be another (cargo keeps a binary whose sources are older than it).
pub fn repo_file(relative: &str) -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join(relative)
}

/// Applies a SQL file from the repository.
pub async fn apply_sql_file(client: &Client, relative: &str) {
    let path = repo_file(relative);
    let sql = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {relative}: {e}"));
    client
        .batch_execute(&sql)
        .await
        .unwrap_or_else(|e| panic!("apply {relative}: {e}"));
}

/// What a `pgcdc` invocation printed and how it exited.
#[derive(Debug)]
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn all_output(&self) -> String {
        format!("{}{}", self.stdout, self.stderr)
    }

    /// The output line for one check, e.g. `line_for("postgres.wal_level")`.
    pub fn check_line(&self, check: &str) -> Option<&str> {
        self.stdout
            .lines()
            .find(|l| l.split_whitespace().nth(1) == Some(check))
    }
}

impl From<Output> for Run {
    fn from(o: Output) -> Run {
        Run {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }
}

/// Runs the `pgcdc` binary built for this test run, with an environment
/// free of the caller's `PGCDC__*` overrides.
pub async fn pgcdc(args: &[&str]) -> Run {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"));
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("PGCDC__") {
            cmd.env_remove(k);
        }
    }
    cmd.output()
        .await
        .unwrap_or_else(|e| panic!("run pgcdc {args:?}: {e}"))
        .into()
}

/// A connector definition written to a temporary file.
pub struct ConfigFile {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
}

impl ConfigFile {
    pub fn write(toml: &str) -> ConfigFile {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("pipeline.toml");
        std::fs::write(&path, toml).expect("write config");
        ConfigFile { _dir: dir, path }
    }

    /// Writes `toml` and parses it as pgcdc would (no environment).
    pub fn parsed(toml: &str) -> (ConfigFile, pgcdc::config::Config) {
        let parsed = pgcdc::config::Config::from_toml(toml, "test", &[]).expect("config");
        (ConfigFile::write(toml), parsed)
    }

    pub fn arg(&self) -> &str {
        self.path.to_str().expect("utf-8 temp path")
    }
}

/// The minimal connector definition for a source database and tables.
pub fn pipeline_toml(stack: &Stack, source_url: &str, name: &str, tables: &[&str]) -> String {
    // A literal string ('...', no escapes) for names holding quotes.
    let tables = tables
        .iter()
        .map(|t| {
            assert!(!t.contains('\''), "{t}");
            if t.contains('"') {
                format!("'{t}'")
            } else {
                format!("\"{t}\"")
            }
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        r#"name = "{name}"
[source]
url = "{source_url}"
slot = "{name}"
publication = "{name}"
tables = [{tables}]
[kafka]
brokers = "{brokers}"
topic_prefix = "{name}"
[registry]
url = "{registry}"
"#,
        brokers = stack.brokers,
        registry = stack.registry_url,
    )
}

/// A throwaway Postgres cluster with settings of its own, for conditions
/// the shared stack must not have (such as `wal_level=replica`).
pub struct ScratchCluster {
    dir: PathBuf,
    bindir: PathBuf,
    pub port: u16,
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn run_ok(mut cmd: Command, what: &str) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl ScratchCluster {
    /// Initialises and starts a cluster; `conf` lines are appended to its
    /// postgresql.conf. Trust authentication, superuser `postgres`.
    pub fn start(conf: &[&str]) -> ScratchCluster {
        let stack = stack();
        let dir = std::env::temp_dir().join(unique("pgcdc_scratch"));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        if is_root() {
            run_ok(
                {
                    let mut c = Command::new("chown");
                    c.arg("postgres:").arg(&dir);
                    c
                },
                "chown scratch dir",
            );
        }
        let port = free_port();
        let data = dir.join("data");
        let mut initdb = as_postgres(&stack.pg_bindir.join("initdb"));
        initdb.arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
        ]);
        run_ok(initdb, "initdb scratch cluster");
        let mut settings = format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\nfsync = off\nshared_buffers = 16MB\nmax_connections = 20\n",
            dir.display()
        );
        for line in conf {
            settings.push_str(line);
            settings.push('\n');
        }
        let conf_path = data.join("postgresql.conf");
        let mut existing = std::fs::read_to_string(&conf_path).expect("read postgresql.conf");
        existing.push_str(&settings);
        std::fs::write(&conf_path, existing).expect("write postgresql.conf");
        let cluster = ScratchCluster {
            dir,
            bindir: stack.pg_bindir,
            port,
        };
        cluster.start_again();
        cluster
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The cluster's directory (data, log, socket), owned by the server.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A connection over the cluster's Unix socket (`local` in pg_hba.conf).
    pub fn socket_url(&self, db: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={db}",
            self.dir.display(),
            self.port
        )
    }

    /// Makes a file the server's own, mode 0600 (as a key file must be).
    pub fn give_to_server(&self, file: &Path) {
        use std::os::unix::fs::PermissionsExt;
        if is_root() {
            run_ok(
                {
                    let mut c = Command::new("chown");
                    c.arg("postgres:").arg(file);
                    c
                },
                "chown for the server",
            );
        }
        std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    }

    /// Appends `conf` to postgresql.conf, puts `hba` first in pg_hba.conf,
    /// and reloads.
    pub fn reconfigure(&self, conf: &[&str], hba: &[&str]) {
        let data = self.dir.join("data");
        let conf_path = data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path).expect("read postgresql.conf");
        for line in conf {
            text.push_str(line);
            text.push('\n');
        }
        std::fs::write(&conf_path, text).expect("write postgresql.conf");
        let hba_path = data.join("pg_hba.conf");
        let old = std::fs::read_to_string(&hba_path).expect("read pg_hba.conf");
        let mut text = hba.join("\n");
        text.push('\n');
        text.push_str(&old);
        std::fs::write(&hba_path, text).expect("write pg_hba.conf");
        // A signal: the caller waits for what it changed to show.
        run_ok(self.pg_ctl(&["reload"]), "reload scratch cluster");
    }

    /// `pg_ctl -D <data> ARGS`, with the server log for what starts it.
    fn pg_ctl(&self, args: &[&str]) -> Command {
        let mut c = as_postgres(&self.bindir.join("pg_ctl"));
        c.arg("-D").arg(self.dir.join("data"));
        if args.iter().any(|a| matches!(*a, "start" | "restart")) {
            c.arg("-l").arg(self.dir.join("log"));
        }
        c.args(args);
        c
    }

    /// `pg_ctl stop -m fast`: the cluster is down until [`Self::start_again`].
    pub fn stop(&self) {
        run_ok(
            self.pg_ctl(&["-m", "fast", "-w", "-t", "60", "stop"]),
            "stop scratch cluster",
        );
    }

    /// Starts the cluster (again, after [`Self::stop`]), on its port.
    pub fn start_again(&self) {
        run_ok(
            self.pg_ctl(&["-w", "-t", "60", "start"]),
            "start scratch cluster",
        );
    }

    /// `pg_ctl restart -m fast`: every connection is closed, the cluster
    /// comes back on the same port with its data and slots.
    pub fn restart(&self) {
        run_ok(
            self.pg_ctl(&["-m", "fast", "-w", "-t", "60", "restart"]),
            "restart scratch cluster",
        );
    }
}

impl Drop for ScratchCluster {
    fn drop(&mut self) {
        let _ = self.pg_ctl(&["-m", "immediate", "-w", "stop"]).output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A `pgcdc registry` process of a test's own, on a free port.
pub struct RegistryProcess {
    child: std::process::Child,
    pub url: String,
    port: u16,
    store: String,
}

impl RegistryProcess {
    pub async fn start(store: &str) -> RegistryProcess {
        let port = free_port();
        let child = Command::new(env!("CARGO_BIN_EXE_pgcdc"))
            .args([
                "registry",
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--store",
                store,
            ])
            .env_remove("PGCDC_REGISTRY_BASIC_AUTH")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("spawn pgcdc registry");
        let mut p = RegistryProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
            port,
            store: store.to_string(),
        };
        p.wait_ready().await;
        p
    }

    /// Polls until the registry answers `GET /config`, or panics after 30 s.
    pub async fn wait_ready(&mut self) {
        let client = reqwest::Client::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("registry exited early with {status}");
            }
            if client
                .get(format!("{}/config", self.url))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
            {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "registry on port {} not ready",
                self.port
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Kills the process (SIGKILL) and starts it again on the same port and store.
    pub async fn restart(&mut self) {
        self.stop();
        self.start_again().await;
    }

    /// Kills the process (SIGKILL): the port refuses connections.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the process again on the same port and store.
    pub async fn start_again(&mut self) {
        self.child = Command::new(env!("CARGO_BIN_EXE_pgcdc"))
            .args([
                "registry",
                "--listen",
                &format!("127.0.0.1:{}", self.port),
                "--store",
                &self.store,
            ])
            .env_remove("PGCDC_REGISTRY_BASIC_AUTH")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("respawn pgcdc registry");
        self.wait_ready().await;
    }
}

impl Drop for RegistryProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Creates a topic on the stack's broker with the given configs.
pub async fn create_topic(stack: &Stack, name: &str, configs: &[(&str, &str)]) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &stack.brokers)
        .client()
        .expect("admin client");
    let mut topic = NewTopic::new(name, 1, TopicReplication::Fixed(1));
    for (k, v) in configs {
        topic = topic.set(k, v);
    }
    let results = admin
        .create_topics([&topic], &AdminOptions::new())
        .await
        .expect("create topics");
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
    }
}

/// One record read back from a topic.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, String)>,
}

impl Record {
    /// A header's value as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The schema text of a subject's latest version in the stack's registry.
pub async fn latest_schema(stack: &Stack, subject: &str) -> String {
    let latest: serde_json::Value = reqwest::Client::new()
        .get(format!(
            "{}/subjects/{subject}/versions/latest",
            stack.registry_url
        ))
        .send()
        .await
        .expect("registry")
        .json()
        .await
        .expect("json");
    latest["schema"].as_str().expect("schema").to_string()
}

/// Registers `schema` (its text) under `subject`, which must succeed.
pub async fn register_schema(stack: &Stack, subject: &str, schema: &str) {
    let r = reqwest::Client::new()
        .post(format!(
            "{}/subjects/{subject}/versions",
            stack.registry_url
        ))
        .header("Content-Type", "application/vnd.schemaregistry.v1+json")
        .body(serde_json::json!({ "schema": schema }).to_string())
        .send()
        .await
        .expect("register");
    assert!(
        r.status().is_success(),
        "register {subject}: {}",
        r.status()
    );
}

/// Reads a topic from the beginning of every partition until `count`
/// records arrived, or panics after `limit`.
pub async fn read_topic(
    stack: &Stack,
    topic: &str,
    count: usize,
    limit: std::time::Duration,
) -> Vec<Record> {
    read_topic_until(stack, topic, limit, move |records| records.len() >= count).await
}

/// Reads a topic from the beginning of every partition until `done` holds
/// for the records read so far (checked when the topic is idle and every
/// 5,000 records), or panics after `limit`.
pub async fn read_topic_until(
    stack: &Stack,
    topic: &str,
    limit: std::time::Duration,
    done: impl Fn(&[Record]) -> bool + Send + 'static,
) -> Vec<Record> {
    read_topic_at(&stack.brokers, topic, limit, done).await
}

/// [`read_topic_until`] on the brokers given, as a `read_committed`
/// consumer.
pub async fn read_topic_at(
    brokers: &str,
    topic: &str,
    limit: std::time::Duration,
    done: impl Fn(&[Record]) -> bool + Send + 'static,
) -> Vec<Record> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Headers;
    use rdkafka::{Message, Offset, TopicPartitionList};
    let brokers = brokers.to_string();
    let topic = topic.to_string();
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer<pgcdc::sink::Quiet> = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("group.id", unique("reader"))
            .set("enable.auto.commit", "false")
            .set("isolation.level", "read_committed")
            .client()
            .expect("consumer");
        let deadline = std::time::Instant::now() + limit;
        // The topic may not exist yet: wait until it has partitions.
        let mut tpl = TopicPartitionList::new();
        while tpl.count() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{topic} never appeared"
            );
            if let Ok(metadata) =
                consumer.fetch_metadata(Some(&topic), std::time::Duration::from_secs(5))
            {
                for t in metadata.topics().iter().filter(|t| t.error().is_none()) {
                    for p in t.partitions() {
                        tpl.add_partition_offset(&topic, p.id(), Offset::Beginning)
                            .expect("tpl");
                    }
                }
            }
            if tpl.count() == 0 {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        consumer.assign(&tpl).expect("assign");
        let mut out = Vec::new();
        let mut checked = 0;
        loop {
            match consumer.poll(std::time::Duration::from_millis(200)) {
                Some(Ok(m)) => {
                    out.push(Record {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: m.key().map(<[u8]>::to_vec),
                        value: m.payload().map(<[u8]>::to_vec),
                        headers: m
                            .headers()
                            .map(|h| {
                                h.iter()
                                    .map(|h| {
                                        let v = h.value.unwrap_or_default();
                                        (h.key.to_string(), String::from_utf8_lossy(v).into_owned())
                                    })
                                    .collect()
                            })
                            .unwrap_or_default(),
                    });
                    if out.len() - checked < 5_000 {
                        continue;
                    }
                }
                Some(Err(e)) => panic!("{topic}: {e}"),
                None => {}
            }
            checked = out.len();
            if done(&out) {
                return out;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{topic}: condition not met after {limit:?} ({} records read)",
                out.len()
            );
        }
    })
    .await
    .expect("reader task")
}

/// Decodes Confluent-framed Avro by fetching writer schemas from the registry.
pub struct Decoder {
    registry: String,
    schemas: std::collections::HashMap<u32, apache_avro::Schema>,
}

impl Decoder {
    pub fn new(stack: &Stack) -> Decoder {
        Decoder::at(&stack.registry_url)
    }

    /// A decoder reading schemas from the registry at `url`.
    pub fn at(url: &str) -> Decoder {
        Decoder {
            registry: url.to_string(),
            schemas: Default::default(),
        }
    }

    pub async fn decode(&mut self, framed: &[u8]) -> apache_avro::types::Value {
        let (id, datum) = pgcdc::encode::unframe(framed).expect("Confluent framing");
        if !self.schemas.contains_key(&id) {
            let body: serde_json::Value =
                reqwest::get(format!("{}/schemas/ids/{id}", self.registry))
                    .await
                    .expect("fetch schema")
                    .json()
                    .await
                    .expect("schema json");
            let schema =
                apache_avro::Schema::parse_str(body["schema"].as_str().expect("schema text"))
                    .expect("parse schema");
            self.schemas.insert(id, schema);
        }
        pgcdc::encode::decode_datum(&self.schemas[&id], datum).expect("decode datum")
    }
}

/// A `pgcdc run` process, killed when dropped. Its log goes to a file, and
/// a test failing while it lives prints the log's end (parallel tests'
/// logs interleaved on one stderr are unreadable, and cut short in CI).
pub struct ConnectorProcess {
    pub child: tokio::process::Child,
    log: tempfile::NamedTempFile,
}

impl ConnectorProcess {
    pub fn start(config: &ConfigFile) -> ConnectorProcess {
        ConnectorProcess::start_with(config, &[])
    }

    pub fn start_with(config: &ConfigFile, extra: &[&str]) -> ConnectorProcess {
        let log = tempfile::NamedTempFile::new().expect("connector log");
        let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
            .args(["run", "--config", config.arg()])
            .args(extra)
            .stderr(log.reopen().expect("connector log"))
            .kill_on_drop(true)
            .spawn()
            .expect("spawn pgcdc run");
        ConnectorProcess { child, log }
    }

    /// What the connector logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// SIGTERM, then the exit code.
    pub async fn terminate(mut self) -> i32 {
        if let Some(pid) = self.child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let status = tokio::time::timeout(std::time::Duration::from_secs(30), self.child.wait())
            .await
            .expect("connector did not stop within 30 s")
            .expect("wait");
        status.code().unwrap_or(-1)
    }
}

impl Drop for ConnectorProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = self.log();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(80)..];
            eprintln!(
                "--- the connector's log, last {} lines ---\n{}",
                tail.len(),
                tail.join("\n")
            );
        }
    }
}

/// Waits until a connection holds the slot and the slot is consistent:
/// every transaction committed from then on is streamed, not read by the
/// snapshot. (The slot is active while it is still being created, and a
/// commit in that window lands in the snapshot instead.)
pub async fn wait_streaming(client: &Client, slot: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let active = client
            .query_opt(
                "SELECT 1 FROM pg_replication_slots
                 WHERE slot_name = $1 AND active AND confirmed_flush_lsn IS NOT NULL",
                &[&slot],
            )
            .await
            .expect("slot state")
            .is_some();
        if active {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "slot {slot} never became active"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The WAL insert position: unlike `pg_current_wal_lsn()` (the write
/// position), it includes a commit that `synchronous_commit=off` has not
/// written yet.
pub async fn insert_lsn(client: &Client) -> String {
    client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .expect("lsn")
        .get(0)
}

/// Whether the slot's confirmed LSN reached `target`.
pub async fn confirmed_reached(client: &Client, slot: &str, target: &str) -> bool {
    client
        .query_opt(
            // NULL while the slot is still being created; no row while a
            // restarted connector drops and creates it again.
            "SELECT coalesce(confirmed_flush_lsn >= $2::text::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot, &target],
        )
        .await
        .expect("slot")
        .is_some_and(|r| r.get(0))
}

/// Polls `check` every 200 ms until it holds, or panics after `limit`
/// naming `what`.
pub async fn wait_for(
    what: &str,
    limit: std::time::Duration,
    mut check: impl AsyncFnMut() -> bool,
) {
    let deadline = std::time::Instant::now() + limit;
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// Waits until the connector confirmed everything written so far: Kafka
/// then holds every change committed before this call.
pub async fn wait_caught_up(client: &Client, slot: &str) {
    let target = insert_lsn(client).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(180);
    while !confirmed_reached(client, slot, &target).await {
        assert!(
            std::time::Instant::now() < deadline,
            "slot {slot} did not confirm {target}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// A broker of a test's own, killed when dropped: memory storage, or
/// SQLite storage that survives [`PrivateBroker::stop`] and
/// [`PrivateBroker::start_again`].
pub struct PrivateBroker {
    child: std::process::Child,
    pub address: String,
    bin: PathBuf,
    port: u16,
    /// The SQLite store's directory, for a persistent broker.
    dir: Option<tempfile::TempDir>,
}

impl PrivateBroker {
    pub fn start(stack: &Stack) -> PrivateBroker {
        PrivateBroker::launch(stack.broker_bin.clone(), free_port(), None)
    }

    /// A broker whose data survives a stop (SQLite storage).
    pub fn start_persistent(stack: &Stack) -> PrivateBroker {
        let dir = tempfile::tempdir().expect("broker dir");
        PrivateBroker::launch(stack.broker_bin.clone(), free_port(), Some(dir))
    }

    fn launch(bin: PathBuf, port: u16, dir: Option<tempfile::TempDir>) -> PrivateBroker {
        let child = PrivateBroker::spawn(&bin, port, dir.as_ref().map(|d| d.path()));
        PrivateBroker {
            child,
            address: format!("127.0.0.1:{port}"),
            bin,
            port,
            dir,
        }
    }

    fn spawn(bin: &Path, port: u16, dir: Option<&Path>) -> std::process::Child {
        let url = format!("tcp://127.0.0.1:{port}");
        let mut cmd = Command::new(bin);
        cmd.args([
            "broker",
            "--listener-url",
            &url,
            "--advertised-listener-url",
            &url,
            "--group-initial-rebalance-delay",
            "0s",
        ]);
        match dir {
            // The SQLite URL takes a path relative to the working directory.
            Some(d) => cmd
                .current_dir(d)
                .args(["--storage-engine", "sqlite://broker.db"]),
            None => cmd.args(["--storage-engine", "memory://nisshi/"]),
        };
        let child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start broker");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "private broker did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        child
    }

    /// Kills the broker: its port refuses connections until
    /// [`PrivateBroker::start_again`].
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the broker again on the same port and store.
    pub fn start_again(&mut self) {
        assert!(
            self.dir.is_some(),
            "a memory broker loses its data on a stop"
        );
        self.child =
            PrivateBroker::spawn(&self.bin, self.port, self.dir.as_ref().map(|d| d.path()));
    }

    /// Reads `count` records of `topic` from this broker (the stack's other
    /// services as they are).
    pub async fn read_topic(&self, stack: &Stack, topic: &str, count: usize) -> Vec<Record> {
        let private = Stack {
            brokers: self.address.clone(),
            ..stack.clone()
        };
        read_topic(&private, topic, count, std::time::Duration::from_secs(60)).await
    }

    /// SIGSTOP: the broker holds its connections but answers nothing.
    pub fn freeze(&self) {
        let _ = Command::new("kill")
            .args(["-STOP", &self.child.id().to_string()])
            .status();
    }

    /// SIGCONT after `freeze`.
    pub fn thaw(&self) {
        let _ = Command::new("kill")
            .args(["-CONT", &self.child.id().to_string()])
            .status();
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        self.thaw();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The latest marker of the pipeline's initial snapshot.
pub async fn initial_marker(config: &pgcdc::config::Config) -> pgcdc::snapshot_marker::Marker {
    use pgcdc::snapshot_marker::{latest, topic};
    latest(&config.kafka, &topic(config), &config.source.slot)
        .await
        .expect("snapshot markers")
        .expect("a snapshot marker")
}

/// Waits until the pipeline's latest snapshot marker says `completed`.
pub async fn wait_snapshot_completed(config: &pgcdc::config::Config) {
    use pgcdc::snapshot_marker::{latest, topic, Phase};
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let marker = latest(&config.kafka, &topic(config), &config.source.slot)
            .await
            .ok()
            .flatten();
        if marker.is_some_and(|m| m.phase == Phase::Completed) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the snapshot never completed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A field of a decoded Avro record, unions unwrapped on both sides.
pub fn field<'a>(v: &'a apache_avro::types::Value, name: &str) -> &'a apache_avro::types::Value {
    use apache_avro::types::Value;
    let v = match v {
        Value::Union(_, inner) => inner.as_ref(),
        other => other,
    };
    let Value::Record(fields) = v else {
        panic!("not a record: {v:?}")
    };
    let found = fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no field {name}"));
    match found {
        Value::Union(_, inner) => inner.as_ref(),
        other => other,
    }
}

/// The time `ahead` from now, as RFC 3339 UTC.
pub fn rfc3339_in(ahead: std::time::Duration) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        + ahead;
    pgcdc::retention::time::rfc3339(now.as_millis() as i64)
}
