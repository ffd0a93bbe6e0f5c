//! Hostile identifiers: schema, table and column names with quotes,
//! spaces, upper case, unicode, dots and reserved words are captured,
//! snapshotted (initial and incremental), streamed and materialized under
//! their own names; topics follow Debezium's naming rule; and names built
//! to break out of a quoted identifier or a literal run no SQL.

use std::time::{Duration, Instant};

use crate::materialize as mat;
use crate::support::{self, ConfigFile, ConnectorProcess, TestDb};

/// Tables in `source.tables` spelling, the SQL that creates them, their
/// mirror (in schema `mirror`), their topic suffix and their key column.
const TABLES: [(&str, &str, &str, &str, &str); 5] = [
    (
        r#""Sales ""Dept""".Order Items"#,
        r#"CREATE SCHEMA "Sales ""Dept""";
           CREATE TABLE "Sales ""Dept"""."Order Items" (
               "Id" bigint PRIMARY KEY, "select" text, "Prix €" numeric(10,2),
               "naïve""col" text, "a b" int, "a-b" int, "日本" text)"#,
        "Order Items",
        "Sales__Dept_.Order_Items",
        "Id",
    ),
    (
        // Spelt as SQL would: the same table as public.user.
        r#""public"."user""#,
        r#"CREATE TABLE public."user" ("order" int PRIMARY KEY, "group" text, "v1.2" text)"#,
        "user",
        "public.user",
        "order",
    ),
    (
        r#""public"."x""; DROP TABLE public.victim; --""#,
        r#"CREATE TABLE public."x""; DROP TABLE public.victim; --" (
               "y'); DROP TABLE public.victim; --" int PRIMARY KEY,
               "z"" text); DROP TABLE public.victim; --" text)"#,
        r#"x"; DROP TABLE public.victim; --"#,
        "public.x___DROP_TABLE_public.victim__--",
        "y'); DROP TABLE public.victim; --",
    ),
    (
        r#"public."odd.name""#,
        r#"CREATE TABLE public."odd.name" (id int PRIMARY KEY, "Mixed Case" text)"#,
        "odd.name",
        "public.odd.name",
        "id",
    ),
    (
        "日本.表 1",
        r#"CREATE SCHEMA "日本"; CREATE TABLE "日本"."表 1" ("キー" int PRIMARY KEY, "値" text)"#,
        "表 1",
        "__.__1",
        "キー",
    ),
];

fn quote(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The source table as SQL spells it.
fn sql_name(table: &str) -> String {
    let (schema, name) = pgcdc::config::split_table(table).expect("schema.table");
    format!("{}.{}", quote(&schema), quote(&name))
}

/// Every row of a table as JSON text, in key order, every value as text.
async fn rows(
    client: &tokio_postgres::Client,
    table: &str,
    columns: &[String],
    key: &str,
) -> String {
    let list = columns
        .iter()
        .map(|c| format!("{}::text AS {}", quote(c), quote(c)))
        .collect::<Vec<_>>()
        .join(", ");
    let sql = format!(
        "SELECT coalesce(json_agg(r ORDER BY r.{k})::text, '[]') FROM (SELECT {list} FROM {table}) r",
        k = quote(key)
    );
    client
        .query_one(&sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0)
}

async fn columns_of(client: &tokio_postgres::Client, schema: &str, table: &str) -> Vec<String> {
    client
        .query(
            "SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass(format('%I.%I', $1::text, $2::text)) AND attnum > 0
               AND NOT attisdropped ORDER BY attnum",
            &[&schema, &table],
        )
        .await
        .expect("columns")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn victims(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM public.victim", &[])
        .await
        .expect("the victim table is gone")
        .get(0)
}

/// Inserts, updates and deletes in every table; `round` keeps keys apart.
async fn write(client: &tokio_postgres::Client, round: i64) {
    let nasty = "it's \"quoted\"; DROP TABLE public.victim; --";
    for i in 0..5i64 {
        let k = round * 100 + i;
        let text = format!("{nasty} {k}");
        client
            .execute(
                r#"INSERT INTO "Sales ""Dept"""."Order Items" VALUES ($1, $2, $3::text::numeric, $2, $4, $5, '日本語')"#,
                &[&k, &text, &format!("{k}.5"), &(k as i32), &(-k as i32)],
            )
            .await
            .expect("insert order items");
        let k32 = k as i32;
        for sql in [
            r#"INSERT INTO public."user" VALUES ($1, $2, $2)"#,
            r#"INSERT INTO public."x""; DROP TABLE public.victim; --" VALUES ($1, $2)"#,
            r#"INSERT INTO public."odd.name" VALUES ($1, $2)"#,
            r#"INSERT INTO "日本"."表 1" VALUES ($1, $2)"#,
        ] {
            client
                .execute(sql, &[&k32, &text])
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
    }
    let (first, second) = (round * 100, round * 100 + 1);
    client
        .batch_execute(&format!(
            r#"UPDATE "Sales ""Dept"""."Order Items" SET "select" = 'upd''ated', "a-b" = 7 WHERE "Id" = {first};
               DELETE FROM "Sales ""Dept"""."Order Items" WHERE "Id" = {second};
               UPDATE public."user" SET "group" = NULL WHERE "order" = {first};
               DELETE FROM public."x""; DROP TABLE public.victim; --" WHERE "y'); DROP TABLE public.victim; --" = {second};
               UPDATE public."x""; DROP TABLE public.victim; --" SET "z"" text); DROP TABLE public.victim; --" = 'z' WHERE "y'); DROP TABLE public.victim; --" = {first};
               UPDATE public."odd.name" SET "Mixed Case" = 'MiXeD' WHERE id = {first};
               DELETE FROM "日本"."表 1" WHERE "キー" = {second};"#
        ))
        .await
        .expect("updates and deletes");
}

/// Waits until every mirror holds exactly its source table's rows.
async fn wait_mirrored(source: &tokio_postgres::Client, target: &tokio_postgres::Client) {
    let deadline = Instant::now() + Duration::from_secs(120);
    for (table, _, mirror, _, key) in TABLES {
        let (schema, name) = pgcdc::config::split_table(table).expect("table");
        let columns = columns_of(source, &schema, &name).await;
        let mirror_sql = format!("mirror.{}", quote(mirror));
        loop {
            let want = rows(source, &sql_name(table), &columns, key).await;
            let got = match columns_of(target, "mirror", mirror).await {
                c if c.is_empty() => String::new(),
                _ => rows(target, &mirror_sql, &columns, key).await,
            };
            if want == got {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{table} not mirrored:\nsource {want}\nmirror {got}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_names_are_captured_materialized_and_inject_nothing() {
    let stack = support::stack();
    let source_db = TestDb::create(&stack, "ident_src").await;
    let target_db = TestDb::create(&stack, "ident_tgt").await;
    let (source, target) = (source_db.client().await, target_db.client().await);
    for db in [&source, &target] {
        db.batch_execute(
            "CREATE TABLE public.victim (id int PRIMARY KEY); INSERT INTO public.victim VALUES (1)",
        )
        .await
        .expect("victim");
    }
    for (_, create, ..) in TABLES {
        source.batch_execute(create).await.expect(create);
    }
    // A mirror as an older pgcdc made it: columns (the key among them)
    // named by their Avro spelling. It is renamed in place.
    target
        .batch_execute(
            r#"CREATE SCHEMA mirror;
               CREATE TABLE mirror."表 1" ("__" int PRIMARY KEY, "_" text,
                   _pgcdc_commit_lsn bigint NOT NULL, _pgcdc_seq bigint NOT NULL)"#,
        )
        .await
        .expect("old mirror");
    write(&source, 1).await;

    let name = source_db.name.clone();
    let tables: Vec<&str> = TABLES.iter().map(|t| t.0).collect();
    let config = ConfigFile::write(&format!(
        "{}[target]\nurl = \"{}\"\n",
        support::pipeline_toml(&stack, &source_db.url, &name, &tables),
        target_db.url
    ));
    let parsed = pgcdc::config::Config::load(&config.path).expect("config");

    let check = support::pgcdc(&["check", "--config", config.arg()]).await;
    assert_eq!(check.code, 0, "{}", check.all_output());

    let connector = ConnectorProcess::start(&config);
    let mut materializer = mat::materializer(&config, &[], &[]);
    support::wait_snapshot_completed(&parsed).await;
    write(&source, 2).await;
    support::wait_caught_up(&source, &name).await;
    wait_mirrored(&source, &target).await;

    // An incremental snapshot of the two tables with the worst names (its
    // chunk queries quote names and key literals), while changes flow.
    let args = [
        "snapshot",
        "--config",
        config.arg(),
        "--table",
        TABLES[0].0,
        "--table",
        TABLES[2].0,
        "--timeout-secs",
        "120",
    ];
    let snapshot = support::pgcdc(&args);
    let (snapshot, ()) = tokio::join!(snapshot, write(&source, 3));
    assert_eq!(snapshot.code, 0, "{}", snapshot.all_output());
    // "... completed at LSN X: <table> <n> rows in <m> chunks, ..."
    let read = snapshot
        .stdout
        .split_once(": ")
        .map(|(_, r)| r.trim().to_string())
        .unwrap_or_default();
    for t in [TABLES[0].0, TABLES[2].0] {
        let spelt = pgcdc::config::canonical_table(t);
        let rows = read
            .split(", ")
            .filter_map(|item| item.strip_prefix(&format!("{spelt} ")))
            .filter_map(|rest| rest.split(' ').next()?.parse::<u64>().ok())
            .next();
        assert!(rows.unwrap_or(0) > 0, "{t}: no rows read in {read:?}");
    }
    support::wait_caught_up(&source, &name).await;
    wait_mirrored(&source, &target).await;

    // Mirrors carry the source's column names, not their Avro spellings.
    for (table, _, mirror, ..) in TABLES {
        let (schema, name) = pgcdc::config::split_table(table).expect("table");
        let mirrored = columns_of(&target, "mirror", mirror).await;
        for column in columns_of(&source, &schema, &name).await {
            assert!(
                mirrored.contains(&column),
                "{mirror} lacks {column:?}: {mirrored:?}"
            );
        }
    }
    // Debezium's topic names, and Avro names that keep the column's own.
    for (table, _, _, topic, _) in TABLES {
        let topic = format!("{name}.{topic}");
        assert!(
            mat::end_offsets(&stack, &topic).await > 0,
            "{table}: no topic {topic}"
        );
    }
    let subject = format!("{name}.{}-value", TABLES[0].3);
    let latest: serde_json::Value = reqwest::get(format!(
        "{}/subjects/{subject}/versions/latest",
        stack.registry_url
    ))
    .await
    .expect("registry")
    .json()
    .await
    .expect("registry json");
    let schema: serde_json::Value =
        serde_json::from_str(latest["schema"].as_str().expect("schema")).expect("schema json");
    let fields = schema["fields"][0]["type"][1]["fields"]
        .as_array()
        .expect("value fields")
        .iter()
        .map(|f| {
            (
                f["name"].as_str().unwrap_or_default().to_string(),
                f["pgcdc.column"].as_str().map(String::from),
            )
        })
        .collect::<Vec<_>>();
    let field = |n: &str, c: Option<&str>| (n.to_string(), c.map(String::from));
    assert_eq!(
        fields,
        [
            field("Id", None),
            field("select", None),
            field("Prix__", Some("Prix €")),
            field("na_ve_col", Some("naïve\"col")),
            field("a_b", Some("a b")),
            field("a_b_2", Some("a-b")),
            field("__", Some("日本")),
        ]
    );

    // The publication pgcdc made covers every table, as check sees it.
    let check = support::pgcdc(&["check", "--config", config.arg()]).await;
    assert_eq!(check.code, 0, "{}", check.all_output());
    let publication = check.check_line("postgres.publication").unwrap_or_default();
    assert!(publication.starts_with("PASS"), "{}", check.stdout);

    // Nothing ran that a name smuggled in.
    assert_eq!(victims(&source).await, 1);
    assert_eq!(victims(&target).await, 1);

    assert_eq!(connector.terminate().await, 0);
    let _ = materializer.kill().await;
    source_db.drop_db().await;
    target_db.drop_db().await;
}
