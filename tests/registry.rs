//! `pgcdc registry` over HTTP, with our client calls and with real
//! third-party clients (Rust `schema_registry_converter`, Python
//! `confluent-kafka[avro]`).

use std::collections::BTreeSet;

use serde_json::{json, Value};

use crate::support::{self, RegistryProcess, TestDb};

const CT: &str = "application/vnd.schemaregistry.v1+json";

fn order_schema(extra_fields: &str) -> String {
    format!(
        r#"{{"type":"record","name":"Order","namespace":"shop","fields":[{{"name":"id","type":"long"}},{{"name":"amount","type":"int"}}{extra_fields}]}}"#
    )
}

struct Api {
    base: String,
    http: reqwest::Client,
}

impl Api {
    fn new(base: &str) -> Api {
        Api {
            base: base.trim_end_matches('/').to_string(),
            http: reqwest::Client::new(),
        }
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<String>,
    ) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .header("Content-Type", CT);
        if let Some(b) = body {
            req = req.body(b);
        }
        let resp = req.send().await.unwrap_or_else(|e| panic!("{path}: {e}"));
        let status = resp.status().as_u16();
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        assert_eq!(ct, CT, "content type of {path}");
        let text = resp.text().await.unwrap_or_default();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        self.call(reqwest::Method::GET, path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        self.call(reqwest::Method::POST, path, Some(body.to_string()))
            .await
    }

    async fn register(&self, subject: &str, schema: &str) -> (u16, Value) {
        self.post(
            &format!("/subjects/{subject}/versions"),
            json!({ "schema": schema }),
        )
        .await
    }

    async fn register_ok(&self, subject: &str, schema: &str) -> i64 {
        let (status, body) = self.register(subject, schema).await;
        assert_eq!(status, 200, "register under {subject}: {body}");
        body["id"]
            .as_i64()
            .unwrap_or_else(|| panic!("no id in {body}"))
    }

    async fn put_level(&self, subject: &str, level: &str) {
        let (status, body) = self
            .call(
                reqwest::Method::PUT,
                &format!("/config/{subject}"),
                Some(json!({ "compatibility": level }).to_string()),
            )
            .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["compatibility"], level);
    }
}

fn stack_api() -> Api {
    Api::new(&support::stack().registry_url)
}

#[tokio::test]
async fn registration_is_idempotent_and_ids_are_global_across_subjects() {
    let api = stack_api();
    let s1 = support::unique("idem-value");
    let s2 = support::unique("idem-other-value");
    // A schema no other test registers, so its usages are ours alone.
    let namespace = support::unique("idem");
    let v1 = order_schema("").replace("\"shop\"", &format!("\"{namespace}\""));

    let id = api.register_ok(&s1, &v1).await;
    assert_eq!(
        api.register_ok(&s1, &v1).await,
        id,
        "same schema, same subject"
    );
    let reformatted = format!(
        r#"{{ "namespace": "{namespace}", "fields": [ {{"type": "long", "name": "id"}},
        {{"type": "int", "name": "amount"}} ], "name": "Order", "type": "record" }}"#
    );
    let reformatted = reformatted.as_str();
    assert_eq!(
        api.register_ok(&s1, reformatted).await,
        id,
        "whitespace and attribute order"
    );
    assert_eq!(
        api.register_ok(&s2, &v1).await,
        id,
        "ids are global across subjects"
    );

    let v2 = order_schema(r#",{"name":"note","type":["null","string"],"default":null}"#)
        .replace("\"shop\"", &format!("\"{namespace}\""));
    let id2 = api.register_ok(&s1, &v2).await;
    assert_ne!(id2, id);

    assert_eq!(
        api.get(&format!("/subjects/{s1}/versions")).await,
        (200, json!([1, 2]))
    );
    let (status, latest) = api.get(&format!("/subjects/{s1}/versions/latest")).await;
    assert_eq!(status, 200);
    assert_eq!(
        (latest["version"].as_i64(), latest["id"].as_i64()),
        (Some(2), Some(id2))
    );
    let (status, by_id) = api.get(&format!("/schemas/ids/{id}")).await;
    assert_eq!(status, 200);
    let stored: Value =
        serde_json::from_str(by_id["schema"].as_str().unwrap_or_default()).unwrap_or_default();
    assert_eq!(
        stored,
        serde_json::from_str::<Value>(&v1).unwrap_or_default()
    );
    let (status, found) = api
        .post(&format!("/subjects/{s1}"), json!({ "schema": reformatted }))
        .await;
    assert_eq!(
        (status, found["version"].as_i64(), found["id"].as_i64()),
        (200, Some(1), Some(id))
    );
    let (_, subjects) = api.get("/subjects").await;
    let subjects: BTreeSet<String> = serde_json::from_value(subjects).unwrap_or_default();
    assert!(
        subjects.contains(&s1) && subjects.contains(&s2),
        "{subjects:?}"
    );
    let (_, usages) = api.get(&format!("/schemas/ids/{id}/versions")).await;
    assert_eq!(usages.as_array().map(Vec::len), Some(2), "{usages}");
}

#[tokio::test]
async fn bad_input_gets_the_confluent_error_and_never_a_500() {
    let api = stack_api();
    let subject = support::unique("bad-value");
    api.register_ok(&subject, &order_schema("")).await;

    let cases: Vec<(reqwest::Method, String, Option<String>, u16, i64)> = vec![
        (
            reqwest::Method::POST,
            format!("/subjects/{subject}/versions"),
            Some("{not json".into()),
            400,
            400,
        ),
        (
            reqwest::Method::POST,
            format!("/subjects/{subject}/versions"),
            Some(r#"{"schema":"{\"type\":\"record\",\"name\":\"X\"}"}"#.into()),
            422,
            42201,
        ),
        (
            reqwest::Method::POST,
            format!("/subjects/{subject}/versions"),
            Some(r#"{"schema":"not json at all"}"#.into()),
            422,
            42201,
        ),
        (
            reqwest::Method::POST,
            format!("/subjects/{subject}/versions"),
            Some(r#"{"schema":"\"int\"","schemaType":"PROTOBUF"}"#.into()),
            422,
            42201,
        ),
        (
            reqwest::Method::GET,
            "/subjects/no-such-subject-xyz/versions".into(),
            None,
            404,
            40401,
        ),
        (
            reqwest::Method::GET,
            "/subjects/no-such-subject-xyz/versions/1".into(),
            None,
            404,
            40401,
        ),
        (
            reqwest::Method::GET,
            format!("/subjects/{subject}/versions/99"),
            None,
            404,
            40402,
        ),
        (
            reqwest::Method::GET,
            format!("/subjects/{subject}/versions/abc"),
            None,
            422,
            42202,
        ),
        (
            reqwest::Method::GET,
            format!("/subjects/{subject}/versions/0"),
            None,
            422,
            42202,
        ),
        (
            reqwest::Method::GET,
            "/schemas/ids/987654321".into(),
            None,
            404,
            40403,
        ),
        (
            reqwest::Method::GET,
            "/schemas/ids/not-a-number".into(),
            None,
            404,
            40403,
        ),
        (
            reqwest::Method::POST,
            format!("/subjects/{subject}"),
            Some(json!({"schema": order_schema(r#",{"name":"x","type":"int"}"#)}).to_string()),
            404,
            40403,
        ),
        (
            reqwest::Method::PUT,
            "/config/some-subject".into(),
            Some(r#"{"compatibility":"SIDEWAYS"}"#.into()),
            422,
            42203,
        ),
        (
            reqwest::Method::GET,
            format!("/config/{subject}"),
            None,
            404,
            40408,
        ),
        (
            reqwest::Method::DELETE,
            "/subjects/no-such-subject-xyz".into(),
            None,
            404,
            40401,
        ),
        (
            reqwest::Method::POST,
            format!("/compatibility/subjects/{subject}/versions/7"),
            Some(json!({"schema": order_schema("")}).to_string()),
            404,
            40402,
        ),
    ];
    for (method, path, body, status, code) in cases {
        let (got_status, got) = api.call(method.clone(), &path, body.clone()).await;
        assert_eq!(
            (got_status, got["error_code"].as_i64()),
            (status, Some(code)),
            "{method} {path} {body:?}: {got}"
        );
        assert!(
            got["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{got}"
        );
    }
}

/// One change that each level must accept, and one it must refuse, checked
/// both through the test endpoint and through registration.
#[tokio::test]
async fn every_compatibility_level_accepts_and_refuses_the_right_changes() {
    let api = stack_api();
    let v1 = order_schema("");
    let add_default = order_schema(r#",{"name":"note","type":"string","default":""}"#);
    let add_required = order_schema(r#",{"name":"note","type":"string"}"#);
    let change_type = r#"{"type":"record","name":"Order","namespace":"shop","fields":[{"name":"id","type":"long"},{"name":"amount","type":"string"}]}"#.to_string();
    let remove = r#"{"type":"record","name":"Order","namespace":"shop","fields":[{"name":"id","type":"long"}]}"#.to_string();
    let promote = r#"{"type":"record","name":"Order","namespace":"shop","fields":[{"name":"id","type":"long"},{"name":"amount","type":"long"}]}"#.to_string();
    let rename_alias = r#"{"type":"record","name":"Order","namespace":"shop","fields":[{"name":"id","type":"long"},{"name":"total","type":"int","aliases":["amount"]}]}"#.to_string();
    let renamed_without_alias = r#"{"type":"record","name":"Order","namespace":"shop","fields":[{"name":"id","type":"long"},{"name":"total","type":"int"}]}"#.to_string();
    let cases = [
        ("NONE", &change_type, None),
        ("BACKWARD", &add_default, Some(&add_required)),
        ("BACKWARD", &promote, Some(&change_type)),
        ("BACKWARD", &rename_alias, Some(&renamed_without_alias)),
        ("BACKWARD_TRANSITIVE", &remove, Some(&add_required)),
        ("FORWARD", &add_required, Some(&remove)),
        ("FORWARD_TRANSITIVE", &add_default, Some(&promote)),
        ("FULL", &add_default, Some(&add_required)),
        ("FULL_TRANSITIVE", &add_default, Some(&remove)),
    ];
    for (level, accepted, refused) in cases {
        let subject = support::unique(&format!("level-{}", level.to_lowercase()));
        api.put_level(&subject, level).await;
        api.register_ok(&subject, &v1).await;
        let steps = refused
            .map(|r| (r, false))
            .into_iter()
            .chain([(accepted, true)]);
        for (schema, expected) in steps {
            let (status, body) = api
                .post(
                    &format!("/compatibility/subjects/{subject}/versions/latest?verbose=true"),
                    json!({ "schema": schema }),
                )
                .await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["is_compatible"], expected, "{level}: {schema}: {body}");
            let (status, body) = api.register(&subject, schema).await;
            if expected {
                assert_eq!(status, 200, "{level} must accept {schema}: {body}");
            } else {
                assert_eq!(
                    (status, body["error_code"].as_i64()),
                    (409, Some(409)),
                    "{level} must refuse {schema}: {body}"
                );
            }
        }
    }
}

#[tokio::test]
async fn transitive_levels_check_the_whole_history() {
    let api = stack_api();
    let subject = support::unique("transitive");
    api.put_level(&subject, "BACKWARD_TRANSITIVE").await;
    let v1 = r#"{"type":"record","name":"R","fields":[{"name":"id","type":"long"}]}"#;
    let v2 = r#"{"type":"record","name":"R","fields":[{"name":"id","type":"long"},{"name":"n","type":"string","default":""}]}"#;
    let v3 = r#"{"type":"record","name":"R","fields":[{"name":"id","type":"long"},{"name":"n","type":"string"}]}"#;
    api.register_ok(&subject, v1).await;
    api.register_ok(&subject, v2).await;
    let (status, body) = api.register(&subject, v3).await;
    assert_eq!(status, 409, "v3 cannot read v1 data: {body}");
    api.put_level(&subject, "BACKWARD").await;
    api.register_ok(&subject, v3).await;
}

#[tokio::test]
async fn subjects_delete_softly_then_permanently_and_ids_survive() {
    let api = stack_api();
    let subject = support::unique("delete");
    let id = api.register_ok(&subject, &order_schema("")).await;

    let (status, body) = api
        .call(
            reqwest::Method::DELETE,
            &format!("/subjects/{subject}?permanent=true"),
            None,
        )
        .await;
    assert_eq!(
        (status, body["error_code"].as_i64()),
        (404, Some(40405)),
        "{body}"
    );
    let (status, body) = api
        .call(
            reqwest::Method::DELETE,
            &format!("/subjects/{subject}"),
            None,
        )
        .await;
    assert_eq!((status, body), (200, json!([1])));
    let (status, body) = api.get(&format!("/subjects/{subject}/versions")).await;
    assert_eq!((status, body["error_code"].as_i64()), (404, Some(40401)));
    assert_eq!(
        api.get(&format!("/subjects/{subject}/versions?deleted=true"))
            .await,
        (200, json!([1]))
    );
    let (status, body) = api
        .call(
            reqwest::Method::DELETE,
            &format!("/subjects/{subject}"),
            None,
        )
        .await;
    assert_eq!(
        (status, body["error_code"].as_i64()),
        (404, Some(40404)),
        "{body}"
    );
    let (status, body) = api
        .call(
            reqwest::Method::DELETE,
            &format!("/subjects/{subject}?permanent=true"),
            None,
        )
        .await;
    assert_eq!((status, body), (200, json!([1])));
    assert_eq!(
        api.get(&format!("/schemas/ids/{id}")).await.0,
        200,
        "the id stays valid"
    );
    // Re-registering after a permanent delete starts again at version 1, same id.
    assert_eq!(api.register_ok(&subject, &order_schema("")).await, id);
    assert_eq!(
        api.get(&format!("/subjects/{subject}/versions")).await,
        (200, json!([1]))
    );
}

#[tokio::test]
async fn a_restart_keeps_ids_and_versions() {
    let stack = support::stack();
    let db = TestDb::create(&stack, "registry_restart").await;
    let mut registry = RegistryProcess::start(&db.url).await;
    let api = Api::new(&registry.url);
    let schemas: Vec<String> = (0..3)
        .map(|i| order_schema(&format!(r#",{{"name":"f{i}","type":"int","default":{i}}}"#)))
        .collect();
    let mut ids = Vec::new();
    for s in &schemas {
        ids.push(api.register_ok("orders-value", s).await);
    }

    registry.restart().await;

    assert_eq!(
        api.get("/subjects/orders-value/versions").await,
        (200, json!([1, 2, 3]))
    );
    for (i, s) in schemas.iter().enumerate() {
        assert_eq!(
            api.register_ok("orders-value", s).await,
            ids[i],
            "id of schema {i} after restart"
        );
        let (_, v) = api
            .get(&format!("/subjects/orders-value/versions/{}", i + 1))
            .await;
        assert_eq!(v["id"].as_i64(), Some(ids[i]));
    }
    let fresh = api
        .register_ok(
            "orders-value",
            &order_schema(r#",{"name":"late","type":"int","default":0}"#),
        )
        .await;
    assert!(
        ids.iter().all(|&old| fresh > old),
        "a new id is never a reused one: {fresh} vs {ids:?}"
    );
    drop(registry);
    db.drop_db().await;
}

#[tokio::test]
async fn fifty_concurrent_registrations_of_one_schema_give_one_id() {
    let api = std::sync::Arc::new(stack_api());
    let subject = support::unique("race-value");
    let schema = order_schema("");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let (api, subject, schema) = (api.clone(), subject.clone(), schema.clone());
        tasks.push(tokio::spawn(async move {
            api.register_ok(&subject, &schema).await
        }));
    }
    let mut ids = BTreeSet::new();
    for t in tasks {
        ids.insert(t.await.expect("task"));
    }
    assert_eq!(ids.len(), 1, "{ids:?}");
    assert_eq!(
        api.get(&format!("/subjects/{subject}/versions")).await,
        (200, json!([1]))
    );
}

#[tokio::test]
async fn different_schemas_racing_for_one_subject_get_distinct_versions() {
    let api = std::sync::Arc::new(stack_api());
    let subject = support::unique("race-distinct");
    api.put_level(&subject, "NONE").await;
    let mut tasks = Vec::new();
    for i in 0..20 {
        let (api, subject) = (api.clone(), subject.clone());
        let schema = order_schema(&format!(r#",{{"name":"f{i}","type":"int"}}"#));
        tasks.push(tokio::spawn(async move {
            api.register_ok(&subject, &schema).await
        }));
    }
    let mut ids = BTreeSet::new();
    for t in tasks {
        ids.insert(t.await.expect("task"));
    }
    assert_eq!(ids.len(), 20, "every schema got its own id");
    let expected: Vec<i64> = (1..=20).collect();
    assert_eq!(
        api.get(&format!("/subjects/{subject}/versions")).await,
        (200, json!(expected))
    );
    let mut seen = BTreeSet::new();
    for v in 1..=20 {
        let (_, body) = api.get(&format!("/subjects/{subject}/versions/{v}")).await;
        seen.insert(body["id"].as_i64().unwrap_or_default());
    }
    assert_eq!(seen, ids, "no registration was lost");
}

#[tokio::test]
async fn basic_auth_guards_every_endpoint_and_credentials_never_reach_the_log() {
    let stack = support::stack();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("port");
    let log = tempfile::NamedTempFile::new().expect("log file");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_pgcdc"))
        .args([
            "registry",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--store",
            &stack.target_url,
        ])
        .env("PGCDC_REGISTRY_BASIC_AUTH", "alice:wonder-pw-42")
        .env("RUST_LOG", "debug")
        .stdout(log.reopen().expect("log"))
        .stderr(log.reopen().expect("log"))
        .spawn()
        .expect("spawn registry");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = Kill(child);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while http.get(format!("{base}/config")).send().await.is_err() {
        assert!(std::time::Instant::now() < deadline, "registry not up");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    let anonymous = http
        .get(format!("{base}/subjects"))
        .send()
        .await
        .expect("request");
    assert_eq!(anonymous.status().as_u16(), 401);
    let body: Value = anonymous.json().await.unwrap_or_default();
    assert_eq!(body["error_code"], 40101);
    let wrong = http
        .get(format!("{base}/subjects"))
        .basic_auth("alice", Some("guess"))
        .send()
        .await
        .expect("request");
    assert_eq!(wrong.status().as_u16(), 401);
    let subject = support::unique("auth-value");
    let right = http
        .post(format!("{base}/subjects/{subject}/versions"))
        .basic_auth("alice", Some("wonder-pw-42"))
        .body(json!({ "schema": order_schema("") }).to_string())
        .send()
        .await
        .expect("request");
    assert_eq!(right.status().as_u16(), 200);

    let logged = std::fs::read_to_string(log.path()).unwrap_or_default();
    assert!(
        logged.contains("schema registered"),
        "the log is being written:\n{logged}"
    );
    assert!(
        !logged.contains("wonder-pw-42"),
        "password leaked into the log:\n{logged}"
    );
    assert!(
        !logged.contains(":pgcdc@"),
        "store password leaked into the log:\n{logged}"
    );
}

/// The Rust client most Rust producers use: it registers through our API,
/// encodes in Confluent wire format, and decodes by fetching the id.
#[tokio::test]
async fn schema_registry_converter_round_trips_through_our_registry() {
    use apache_avro::types::Value as Avro;
    use schema_registry_converter::async_impl::avro::{AvroDecoder, AvroEncoder};
    use schema_registry_converter::async_impl::schema_registry::SrSettings;
    use schema_registry_converter::schema_registry_common::{
        SchemaType, SubjectNameStrategy, SuppliedSchema,
    };

    let stack = support::stack();
    let topic = support::unique("converter");
    let schema = order_schema("");
    let settings = SrSettings::new(stack.registry_url.clone());
    let encoder = AvroEncoder::new(settings.clone());
    let strategy = SubjectNameStrategy::TopicNameStrategyWithSchema(
        topic.clone(),
        false,
        SuppliedSchema::new(Some("shop.Order".into()), SchemaType::Avro, schema.clone()),
    );
    let bytes = encoder
        .encode(
            vec![("id", Avro::Long(42)), ("amount", Avro::Int(-7))],
            strategy,
        )
        .await
        .expect("encode through the registry");
    assert_eq!(bytes[0], 0, "Confluent magic byte");
    let id = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]);
    let api = Api::new(&stack.registry_url);
    let (_, latest) = api
        .get(&format!("/subjects/{topic}-value/versions/latest"))
        .await;
    assert_eq!(
        latest["id"].as_u64(),
        Some(u64::from(id)),
        "the converter registered under <topic>-value"
    );

    let decoder = AvroDecoder::new(settings);
    let decoded = decoder
        .decode(Some(&bytes))
        .await
        .expect("decode through the registry");
    assert_eq!(
        decoded.value,
        Avro::Record(vec![
            ("id".into(), Avro::Long(42)),
            ("amount".into(), Avro::Int(-7))
        ])
    );
}

/// Python `confluent-kafka[avro]`: SchemaRegistryClient and the Avro
/// serializer and deserializer, run from the virtualenv `scripts/test` made.
#[tokio::test]
async fn python_confluent_kafka_clients_work_against_our_registry() {
    let stack = support::stack();
    let python = std::env::var("PGCDC_PYTHON").expect(
        "PGCDC_PYTHON is not set: run the tests through scripts/test, which creates the virtualenv",
    );
    let script = support::repo_file("tests/interop/registry_interop.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .env("PGCDC_REGISTRY_URL", &stack.registry_url)
        .env("SUBJECT_PREFIX", support::unique("py"))
        .output()
        .await
        .expect("run python interop");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python interop failed:\n{stdout}\n{stderr}"
    );
    for step in [
        "register",
        "lookup",
        "compatibility",
        "get_schema",
        "serde_round_trip",
        "incompatible_refused",
    ] {
        assert!(
            stdout.contains(&format!("ok {step}")),
            "missing step {step}:\n{stdout}"
        );
    }
}
