//! The operator's view: `/healthz`, `/readyz` through start-up and
//! shutdown, and the status page in a real headless Chromium.

use std::time::Duration;

use serde_json::{json, Value as Json};

use crate::support::{self, insert_lsn, ConfigFile, ConnectorProcess, TestDb};

/// GET `path` on an admin server: status code and body (0 while it does
/// not answer).
pub(crate) async fn http_get(addr: &str, path: &str) -> (u16, String) {
    match reqwest::get(format!("http://{addr}{path}")).await {
        Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
        Err(_) => (0, String::new()),
    }
}

/// `pgcdc_alert{alert=NAME}` on a metrics page, `None` before it exists.
pub(crate) async fn alert(addr: &str, name: &str) -> Option<f64> {
    crate::materialize::samples(addr, "pgcdc_alert")
        .await
        .into_iter()
        .find(|(labels, _)| labels.contains(&format!("alert=\"{name}\"")))
        .map(|(_, v)| v)
}

/// [`support::wait_for`] for up to two minutes.
pub(crate) async fn wait_until(what: &str, check: impl AsyncFnMut() -> bool) {
    support::wait_for(what, Duration::from_secs(120), check).await;
}

/// Waits until `/readyz` answers 200.
pub(crate) async fn wait_ready(addr: &str) {
    wait_until("/readyz 200", async || {
        http_get(addr, "/readyz").await.0 == 200
    })
    .await;
}

#[tokio::test]
async fn readyz_is_ready_only_while_streaming_and_flips_back_when_a_stop_is_requested() {
    let stack = support::stack();
    let broker = support::PrivateBroker::start(&stack);
    let db = TestDb::create(&stack, "op_ready").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE public.t (id bigint PRIMARY KEY, v text)")
        .await
        .expect("table");
    let toml = support::pipeline_toml(&stack, &db.url, &db.name, &["public.t"])
        .replace(&stack.brokers, &broker.address)
        .replace(
            "[registry]\n",
            &format!("[registry]\nusername = \"ops\"\npassword = \"{REGISTRY_PASSWORD}\"\n"),
        );
    let config = ConfigFile::write(&toml);
    let addr = format!("127.0.0.1:{}", support::free_port());

    // Start-up cannot finish while the broker answers nothing: alive, not
    // ready, and the reason is the phase.
    broker.freeze();
    let connector =
        ConnectorProcess::start_with(&config, &["--http-addr", &addr, "--log-format", "json"]);
    wait_until("/healthz 200", async || {
        http_get(&addr, "/healthz").await.0 == 200
    })
    .await;
    for _ in 0..10 {
        let (code, body) = http_get(&addr, "/readyz").await;
        assert_eq!(code, 503, "{body}");
        assert!(
            body.starts_with("not ready: starting") || body.starts_with("not ready: restarting"),
            "{body}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    broker.thaw();
    wait_ready(&addr).await;
    assert_eq!(http_get(&addr, "/readyz").await.1, "ready: streaming\n");
    let status: Json = serde_json::from_str(&http_get(&addr, "/status").await.1).expect("json");
    assert_eq!(status["phase"], "streaming");
    assert_eq!(status["ready"], true);

    // A stop with changes in flight: not ready from the signal on, while
    // the drain waits for Kafka; alive all along; and nothing lost.
    support::wait_streaming(&client, &db.name).await;
    broker.freeze();
    // The position inside the transaction, before its commit: the drain
    // confirms the commit's end, past it. One read after the commit could
    // land past WAL that other tests' databases wrote since, which a
    // connector stopped right after the commit has not seen.
    client
        .batch_execute(
            "BEGIN; INSERT INTO public.t SELECT g, 'row-value-' || g FROM generate_series(1, 50) g",
        )
        .await
        .expect("insert");
    let written = insert_lsn(&client).await;
    client.batch_execute("COMMIT").await.expect("commit");
    // The rows reached the connector (handed to the producer, which
    // cannot deliver them) before the stop.
    wait_until("50 events produced", async || {
        crate::materialize::counter(&addr, "pgcdc_events_total").await >= 50.0
    })
    .await;
    let pid = connector.child.id().expect("pid").to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    wait_until("/readyz 503 stopping", async || {
        http_get(&addr, "/readyz").await == (503, "not ready: stopping\n".into())
    })
    .await;
    for _ in 0..5 {
        assert_eq!(
            http_get(&addr, "/healthz").await.0,
            200,
            "alive while draining"
        );
        assert_eq!(
            http_get(&addr, "/readyz").await.0,
            503,
            "nothing leaves stopping"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    broker.thaw();
    // Logs as JSON lines: each one an object with a level and a message,
    // none with a row value or the source's password.
    let log = connector.log();
    // Complete lines only: the process is still writing.
    let complete = log.rsplit_once('\n').map_or("", |(done, _)| done);
    let lines: Vec<Json> = complete
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(lines
        .iter()
        .all(|l| l["level"].is_string() && l["message"].is_string()));
    assert!(
        lines.iter().any(|l| l["message"] == "shutdown requested"),
        "{log}"
    );
    assert!(
        !log.contains("row-value-"),
        "a row value in the log:\n{log}"
    );
    assert!(!log.contains(REGISTRY_PASSWORD), "the password in the log");
    assert_eq!(connector.terminate().await, 0);
    assert!(
        support::confirmed_reached(&client, &db.name, &written).await,
        "the drain confirmed everything written before the stop"
    );
    let records = broker
        .read_topic(&stack, &format!("{}.public.t", db.name), 50)
        .await;
    assert_eq!(records.len(), 50);
    db.drop_db().await;
}

/// A secret the readiness test's config holds (the local registry does
/// not ask for one, so any will do), to look for in the log.
const REGISTRY_PASSWORD: &str = "pw-Secret-4f1c9e0a";

/// A ChromeDriver with one headless Chromium session, both ended on drop.
/// Debian's `chromium` and `chromium-driver` (`scripts/test` installs
/// them); PGCDC_CHROMIUM and PGCDC_CHROMEDRIVER point elsewhere.
struct Browser {
    driver: std::process::Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    async fn start() -> Browser {
        let chromium = std::env::var("PGCDC_CHROMIUM").unwrap_or("/usr/bin/chromium".into());
        let chromedriver =
            std::env::var("PGCDC_CHROMEDRIVER").unwrap_or("/usr/bin/chromedriver".into());
        assert!(
            std::path::Path::new(&chromium).exists() && std::path::Path::new(&chromedriver).exists(),
            "{chromium} or {chromedriver} is missing: install Debian's chromium and chromium-driver (scripts/test does)"
        );
        let port = support::free_port();
        let driver = std::process::Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while http.get(format!("{base}/status")).send().await.is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "chromedriver did not start"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().expect("profile dir");
        // A closed network: no sandbox (no user namespaces here), and
        // nothing that calls home at start.
        let args = [
            "--headless=new".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-dev-shm-usage".into(),
            "--no-first-run".into(),
            "--no-default-browser-check".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-extensions".into(),
            "--window-size=1280,1400".into(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": chromium, "args": args}
        }}});
        let r: Json = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .expect("new session")
            .json()
            .await
            .expect("session json");
        let session = r["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no browser session: {r}"))
            .to_string();
        Browser {
            driver,
            base,
            session,
            http,
            _profile: profile,
        }
    }

    async fn command(&self, method: reqwest::Method, path: &str, body: Json) -> Json {
        let url = format!("{}/session/{}/{path}", self.base, self.session);
        let mut request = self.http.request(method.clone(), url);
        if method != reqwest::Method::GET {
            request = request.json(&body);
        }
        let r: Json = request
            .send()
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .json()
            .await
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        if r["value"]["error"].is_string() {
            panic!("{path}: {r}");
        }
        r["value"].clone()
    }

    async fn open(&self, url: &str) {
        self.command(reqwest::Method::POST, "url", json!({ "url": url }))
            .await;
    }

    async fn eval(&self, script: &str) -> Json {
        self.command(
            reqwest::Method::POST,
            "execute/sync",
            json!({ "script": script, "args": [] }),
        )
        .await
    }

    async fn screenshot(&self, path: &std::path::Path) {
        use base64::Engine;
        let png = self
            .command(reqwest::Method::GET, "screenshot", Json::Null)
            .await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().expect("screenshot base64"))
            .expect("screenshot png");
        assert!(bytes.starts_with(b"\x89PNG"), "not a PNG");
        std::fs::create_dir_all(path.parent().expect("parent")).expect("output dir");
        std::fs::write(path, bytes).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = std::process::Command::new("curl")
            .args(["-s", "-X", "DELETE"])
            .arg(format!("{}/session/{}", self.base, self.session))
            .output();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// What the page shows, read in the browser from its DOM: its plots (by
/// series, with their sample count and maximum), its figures (by row and
/// name), and what it loaded from elsewhere.
const READ_PAGE: &str = r#"
const all = (s) => Array.from(document.querySelectorAll(s));
const row = (e) => { const r = e.closest('[data-table],[data-read-model]');
  return r ? (r.dataset.table || r.dataset.readModel) + ':' : ''; };
return {
  phase: (document.getElementById('phase') || {}).textContent,
  plots: all('svg.plot[data-series]').map(e => ({
    name: row(e) + e.dataset.series, points: Number(e.dataset.points),
    max: Number(e.dataset.max), lines: e.querySelectorAll('polyline').length })),
  figures: Object.fromEntries(all('[data-figure]').map(e => [row(e) + e.dataset.figure, e.textContent])),
  external: all('script[src],link[href],img[src],iframe,object,embed').length,
  elsewhere: performance.getEntriesByType('resource').map(r => r.name)
    .filter(n => !n.startsWith(location.origin)),
};
"#;

fn plot<'a>(page: &'a Json, name: &str) -> &'a Json {
    page["plots"]
        .as_array()
        .expect("plots")
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no plot {name}: {page}"))
}

/// Where the screenshots go: PGCDC_TEST_OUTPUT, or `test-output/` in the
/// clone (ignored by git).
fn test_output() -> std::path::PathBuf {
    std::env::var_os("PGCDC_TEST_OUTPUT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| support::repo_file("test-output"))
}

#[tokio::test]
async fn the_status_pages_show_plots_and_figures_that_move_after_a_burst_in_a_real_browser() {
    let stack = support::stack();
    let source_db = TestDb::create(&stack, "op_page_src").await;
    let target_db = TestDb::create(&stack, "op_page_tgt").await;
    let source = source_db.client().await;
    source
        .batch_execute(
            "CREATE TABLE public.seeded (id bigint PRIMARY KEY, note text);
             INSERT INTO public.seeded SELECT g, 'seed' FROM generate_series(1, 2000) g;
             ANALYZE public.seeded;
             CREATE TABLE public.orders (id bigint PRIMARY KEY, amount numeric(10,2), note text);",
        )
        .await
        .expect("source");
    let toml = format!(
        "{}[target]\nurl = \"{}\"\n[dlq]\ncheck_interval_secs = 2\n",
        support::pipeline_toml(
            &stack,
            &source_db.url,
            &source_db.name,
            &["public.seeded", "public.orders"]
        ),
        target_db.url
    );
    let config = ConfigFile::write(&toml);
    let connector_addr = format!("127.0.0.1:{}", support::free_port());
    let materializer_addr = format!("127.0.0.1:{}", support::free_port());
    let connector = ConnectorProcess::start_with(&config, &["--http-addr", &connector_addr]);
    let materializer =
        crate::materialize::materializer(&config, &["--http-addr", &materializer_addr], &[]);
    wait_ready(&connector_addr).await;
    wait_ready(&materializer_addr).await;

    let browser = Browser::start().await;
    browser.open(&format!("http://{connector_addr}/")).await;
    // A few samples of the quiet pipeline, read through the page's own
    // refresh (it is never reloaded from here).
    let mut quiet = browser.eval(READ_PAGE).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while plot(&quiet, "public.orders:events")["points"].as_f64() < Some(3.0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the page never refreshed: {quiet}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        quiet = browser.eval(READ_PAGE).await;
    }
    assert_eq!(
        quiet["external"], 0,
        "the page loads nothing by URL: {quiet}"
    );
    assert_eq!(quiet["elsewhere"], json!([]), "{quiet}");
    assert_eq!(quiet["phase"], "streaming", "{quiet}");
    for name in [
        "public.orders:events",
        "public.seeded:events",
        "retained_wal",
    ] {
        assert_eq!(plot(&quiet, name)["lines"], 1, "{name}: {quiet}");
    }
    let figures = &quiet["figures"];
    for figure in [
        "confirmed_lsn",
        "lag_bytes",
        "retained_wal_bytes",
        "public.orders:events_total",
    ] {
        assert!(figures[figure].is_string(), "no figure {figure}: {quiet}");
    }
    // The snapshot's progress: every estimated row copied.
    assert!(
        figures["public.seeded:snapshot"]
            .as_str()
            .is_some_and(|s| s.contains("2000 of ~2000 rows")),
        "{quiet}"
    );
    assert_eq!(
        plot(&quiet, "public.orders:events")["max"],
        0.0,
        "quiet: {quiet}"
    );

    // A burst of writes: the plot rises and the figures move, on the page
    // the browser already holds.
    for i in 0..10 {
        source
            .batch_execute(&format!(
                "INSERT INTO public.orders SELECT g, g, 'burst' FROM generate_series({}, {}) g",
                10_000 + i * 500,
                10_000 + i * 500 + 499
            ))
            .await
            .expect("burst");
    }
    let mut busy = browser.eval(READ_PAGE).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while plot(&busy, "public.orders:events")["max"].as_f64() <= Some(0.0)
        || busy["figures"]["public.orders:events_total"]
            == quiet["figures"]["public.orders:events_total"]
        || busy["figures"]["confirmed_lsn"] == quiet["figures"]["confirmed_lsn"]
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the page did not move: {busy}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        busy = browser.eval(READ_PAGE).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while busy["figures"]["public.orders:events_total"] != "5000" {
        assert!(
            std::time::Instant::now() < deadline,
            "not 5000 events: {busy}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        busy = browser.eval(READ_PAGE).await;
    }
    let out = test_output();
    browser
        .screenshot(&out.join("status-page-connector.png"))
        .await;

    // The materializer's page: the mirror's applied rate and lag, and the
    // dead-letter health.
    browser.open(&format!("http://{materializer_addr}/")).await;
    let mut mat = browser.eval(READ_PAGE).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while plot(&mat, "public.orders:applied")["max"].as_f64() <= Some(0.0) {
        assert!(
            std::time::Instant::now() < deadline,
            "applied never plotted: {mat}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        mat = browser.eval(READ_PAGE).await;
    }
    assert_eq!(mat["phase"], "consuming", "{mat}");
    for name in [
        "public.orders:lag",
        "public.orders:applied",
        "public.orders:duplicates",
        "dlq_arrivals",
    ] {
        assert_eq!(plot(&mat, name)["lines"], 1, "{name}: {mat}");
    }
    for figure in [
        "public.orders:consumer_lag",
        "public.orders:applied_per_sec",
        "public.orders:duplicates_per_sec",
        "dlq_open",
        "dlq_oldest",
        "dlq_replay_success",
        "dlq_arrivals",
        "dlq_baseline",
    ] {
        assert!(
            mat["figures"][figure].is_string(),
            "no figure {figure}: {mat}"
        );
    }
    assert_eq!(mat["figures"]["dlq_open"], "0", "{mat}");
    browser
        .screenshot(&out.join("status-page-materializer.png"))
        .await;
    eprintln!("screenshots in {}", out.display());

    drop(browser);
    assert_eq!(crate::materialize::terminate(materializer).await, Some(0));
    assert_eq!(connector.terminate().await, 0);
    source_db.drop_db().await;
    target_db.drop_db().await;
}
