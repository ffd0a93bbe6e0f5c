//! `pgcdc validate`: unknown fields are named by path, secrets never print.

use crate::support::{self, ConfigFile};

const BASE: &str = r#"name = "shop"
[source]
url = "postgres://app:pg-secret-1@127.0.0.1:5432/shop"
slot = "pgcdc_shop"
publication = "pgcdc_shop"
tables = ["public.orders"]
[kafka]
brokers = "127.0.0.1:9092"
topic_prefix = "shop"
[kafka.properties]
"security.protocol" = "sasl_ssl"
"sasl.mechanism" = "PLAIN"
"sasl.username" = "svc"
"sasl.password" = "kafka-secret-2"
[registry]
url = "https://reg-user:reg-secret-3@registry.example:8081"
username = "reg-user"
password = "reg-secret-4"
"#;

const SECRETS: [&str; 4] = [
    "pg-secret-1",
    "kafka-secret-2",
    "reg-secret-3",
    "reg-secret-4",
];

#[tokio::test]
async fn validate_prints_the_effective_config_without_any_secret() {
    let config = ConfigFile::write(BASE);

    let run = support::pgcdc(&["validate", "--config", config.arg()]).await;

    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stdout
            .contains("postgres://app:***@127.0.0.1:5432/shop"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("\"sasl.password\" = \"***\""),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("workers = 2"),
        "defaults are shown:\n{}",
        run.stdout
    );
    for secret in SECRETS {
        assert!(
            !run.all_output().contains(secret),
            "{secret} leaked:\n{}",
            run.all_output()
        );
    }
}

#[tokio::test]
async fn validate_rejects_an_unknown_field_naming_its_path() {
    let config = ConfigFile::write(&BASE.replace(
        "slot = \"pgcdc_shop\"",
        "slot = \"pgcdc_shop\"\nslott = \"typo\"",
    ));

    let run = support::pgcdc(&["validate", "--config", config.arg()]).await;

    assert_eq!(run.code, 2, "{}", run.all_output());
    assert!(
        run.stderr.contains("source.slott: unknown field `slott`"),
        "{}",
        run.stderr
    );
    for secret in SECRETS {
        assert!(
            !run.all_output().contains(secret),
            "{secret} leaked:\n{}",
            run.all_output()
        );
    }
}

#[tokio::test]
async fn validate_reports_every_invalid_field_by_path() {
    let config = ConfigFile::write(
        &BASE
            .replace("tables = [\"public.orders\"]", "tables = [\"orders\"]")
            .replace("topic_prefix = \"shop\"", "topic_prefix = \"shop!\""),
    );

    let run = support::pgcdc(&["validate", "--config", config.arg()]).await;

    assert_eq!(run.code, 2, "{}", run.all_output());
    assert!(
        run.stderr
            .contains("source.tables[0]: 'orders' must be written as schema.table"),
        "{}",
        run.stderr
    );
    assert!(
        run.stderr.contains("kafka.topic_prefix: must be"),
        "{}",
        run.stderr
    );
}

#[tokio::test]
async fn demo_config_validates_against_the_stack_environment() {
    let stack = support::stack();
    let demo = support::repo_file("connectors/demo.toml");
    let demo = demo.to_str().expect("a UTF-8 path");

    let run = support::pgcdc(&["validate", "--config", demo]).await;

    assert_eq!(run.code, 0, "{}", run.all_output());
    assert!(
        run.stdout
            .contains(&format!("brokers = \"{}\"", stack.brokers)),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("[read_models.order_summary]"),
        "{}",
        run.stdout
    );
    assert!(
        !run.stdout.contains(":pgcdc@"),
        "stack password leaked:\n{}",
        run.stdout
    );
}
