//! The ledger scenario, implemented twice: CRUD tables captured by CDC
//! (`sql/ledger/crud.sql`) and events in the event store
//! (`sql/event_store.sql`). One deterministic workload drives both, in the
//! same source transactions, so both paths see the same business history.
//!
//! Read models, built both ways into the target:
//! - `statement`: every payment with its account's customer, amount and status;
//! - `fraud_queue`: payments flagged for review and not cleared or reversed;
//! - `regulatory_export`: settled payments of 1,000.00 or more;
//! - `tax_lines` (the one "added later"): a line per settlement and per
//!   reversal, with its day. It needs history: CRUD keeps only the day of
//!   the last status change.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};

use pgcdc::event_store::{EventStore, Expected, Metadata, NewEvent, RecordedEvent};
use pgcdc::projection::{Projection, Upcasters, Write};
use serde_json::{json, Value};
use tokio_postgres::Client;

/// Why a payment was reversed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Intent {
    Fraud,
    CustomerRequest,
    Duplicate,
}

impl Intent {
    pub fn as_str(self) -> &'static str {
        match self {
            Intent::Fraud => "fraud",
            Intent::CustomerRequest => "customer_request",
            Intent::Duplicate => "duplicate",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    OpenAccount {
        account: i64,
        customer: String,
    },
    RenameCustomer {
        account: i64,
        customer: String,
    },
    Initiate {
        payment: i64,
        account: i64,
        cents: i64,
        day: i32,
    },
    Settle {
        payment: i64,
        day: i32,
    },
    Flag {
        payment: i64,
        rule: &'static str,
    },
    Clear {
        payment: i64,
    },
    Reverse {
        payment: i64,
        day: i32,
        intent: Intent,
    },
}

/// A seeded generator: the same seed gives the same commands.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Stage {
    Initiated,
    Settled,
    Reversed,
}

/// `payments` payments over `accounts` accounts, with settlements, fraud
/// flags, clearances, reversals and renames mixed in; about 2.5 commands
/// per payment. Business days advance with the payments.
pub fn workload(seed: u64, accounts: i64, payments: i64) -> Vec<Command> {
    let mut rng = Rng(seed | 1);
    let mut out = Vec::new();
    for account in 1..=accounts {
        out.push(Command::OpenAccount {
            account,
            customer: format!("customer {account}"),
        });
    }
    let mut stage: Vec<(i64, Stage, bool)> = Vec::new();
    for payment in 1..=payments {
        let day = 1 + (payment / 10) as i32;
        let cents = if rng.below(5) == 0 {
            100_000 + rng.below(400_000) as i64
        } else {
            100 + rng.below(99_900) as i64
        };
        out.push(Command::Initiate {
            payment,
            account: 1 + rng.below(accounts as u64) as i64,
            cents,
            day,
        });
        stage.push((payment, Stage::Initiated, false));
        // Move an earlier payment on.
        for _ in 0..2 {
            let i = rng.below(stage.len() as u64) as usize;
            let (p, s, flagged) = stage[i];
            let roll = rng.below(10);
            match s {
                Stage::Initiated if roll < 6 => {
                    out.push(Command::Settle { payment: p, day });
                    stage[i].1 = Stage::Settled;
                }
                Stage::Initiated | Stage::Settled if !flagged && roll < 8 => {
                    let rule = if roll.is_multiple_of(2) {
                        "velocity"
                    } else {
                        "new_payee"
                    };
                    out.push(Command::Flag { payment: p, rule });
                    stage[i].2 = true;
                }
                Stage::Settled if flagged && roll < 5 => {
                    out.push(Command::Reverse {
                        payment: p,
                        day,
                        intent: Intent::Fraud,
                    });
                    stage[i].1 = Stage::Reversed;
                }
                Stage::Settled if roll == 9 => {
                    let intent = if rng.below(2) == 0 {
                        Intent::CustomerRequest
                    } else {
                        Intent::Duplicate
                    };
                    out.push(Command::Reverse {
                        payment: p,
                        day,
                        intent,
                    });
                    stage[i].1 = Stage::Reversed;
                }
                Stage::Initiated | Stage::Settled if flagged => {
                    out.push(Command::Clear { payment: p });
                    stage[i].2 = false;
                }
                _ => {}
            }
        }
        if rng.below(25) == 0 {
            let account = 1 + rng.below(accounts as u64) as i64;
            out.push(Command::RenameCustomer {
                account,
                customer: format!("customer {account} renamed at {payment}"),
            });
        }
    }
    out
}

fn amount_text(cents: i64) -> String {
    format!("{}.{:02}", cents / 100, cents % 100)
}

/// How the application writes: which versions of it ran when.
#[derive(Debug, Clone, Copy)]
pub struct AppVersions {
    /// Commands from this index on record `payments.reason` (the CRUD
    /// app learned to keep the why); before, it stays NULL.
    pub reason_from: usize,
    /// Commands before this index write `PaymentInitiated` v1 (amount in
    /// cents); from it on, v2 (a decimal amount and a currency).
    pub v2_from: usize,
}

/// Writes commands to both paths, one source transaction per command.
pub struct Writer {
    store: EventStore,
    versions: HashMap<String, i64>,
    pub app: AppVersions,
    /// Amounts by payment (the CRUD side needs them for nothing, the
    /// events carry them only in PaymentInitiated).
    cents: HashMap<i64, i64>,
}

impl Writer {
    pub fn new(app: AppVersions) -> Writer {
        Writer {
            store: EventStore::default(),
            versions: HashMap::new(),
            app,
            cents: HashMap::new(),
        }
    }

    /// Creates both schemas in the source.
    pub async fn setup(client: &Client) {
        crate::support::apply_sql_file(client, "sql/ledger/crud.sql").await;
        crate::support::apply_sql_file(client, "sql/event_store.sql").await;
    }

    /// Applies commands `range` of `commands`, each in a transaction of
    /// its own that writes the CRUD rows and appends the events.
    pub async fn write(&mut self, client: &mut Client, commands: &[Command], from: usize) {
        for (i, c) in commands.iter().enumerate() {
            let index = from + i;
            let mut tx = client.transaction().await.expect("begin");
            let (stream_type, stream, event) = self.apply(&tx, c, index).await;
            let expected = match self.versions.get(&stream) {
                None => Expected::NoStream,
                Some(v) => Expected::Exact(*v),
            };
            let version = self
                .store
                .append(&mut tx, stream_type, &stream, expected, &[event])
                .await
                .unwrap_or_else(|e| panic!("command {index}: {e}"));
            tx.commit().await.expect("commit");
            self.versions.insert(stream, version);
        }
    }

    /// The CRUD statement of a command, and its event.
    async fn apply(
        &mut self,
        tx: &tokio_postgres::Transaction<'_>,
        c: &Command,
        index: usize,
    ) -> (&'static str, String, NewEvent) {
        let meta = |intent: &str| Metadata {
            correlation_id: Some(format!("command-{index}")),
            causation_id: None,
            actor: Some("ledger-app".into()),
            intent: Some(intent.into()),
        };
        match c {
            Command::OpenAccount { account, customer } => {
                tx.execute(
                    "INSERT INTO public.accounts (id, customer) VALUES ($1, $2)",
                    &[account, customer],
                )
                .await
                .expect("open account");
                (
                    "account",
                    format!("account-{account}"),
                    NewEvent::new(
                        "AccountOpened",
                        1,
                        json!({"account": account, "customer": customer}),
                    )
                    .with_metadata(meta("open_account")),
                )
            }
            Command::RenameCustomer { account, customer } => {
                tx.execute(
                    "UPDATE public.accounts SET customer = $2 WHERE id = $1",
                    &[account, customer],
                )
                .await
                .expect("rename");
                (
                    "account",
                    format!("account-{account}"),
                    NewEvent::new(
                        "CustomerRenamed",
                        1,
                        json!({"account": account, "customer": customer}),
                    )
                    .with_metadata(meta("correct_name")),
                )
            }
            Command::Initiate {
                payment,
                account,
                cents,
                day,
            } => {
                self.cents.insert(*payment, *cents);
                let amount = amount_text(*cents);
                tx.execute(
                    "INSERT INTO public.payments (id, account_id, amount, currency, status, status_day)
                     VALUES ($1, $2, $3::text::numeric, 'EUR', 'initiated', $4)",
                    &[payment, account, &amount, day],
                )
                .await
                .expect("initiate");
                let event = if index < self.app.v2_from {
                    NewEvent::new(
                        "PaymentInitiated",
                        1,
                        json!({"payment": payment, "account": account, "amount_cents": cents, "day": day}),
                    )
                } else {
                    initiated_v2(*payment, *account, &amount, *day)
                };
                (
                    "payment",
                    format!("payment-{payment}"),
                    event.with_metadata(meta("pay")),
                )
            }
            Command::Settle { payment, day } => {
                tx.execute(
                    "UPDATE public.payments SET status = 'settled', status_day = $2 WHERE id = $1",
                    &[payment, day],
                )
                .await
                .expect("settle");
                (
                    "payment",
                    format!("payment-{payment}"),
                    NewEvent::new("PaymentSettled", 1, json!({"payment": payment, "day": day}))
                        .with_metadata(meta("settle")),
                )
            }
            Command::Flag { payment, rule } => {
                tx.execute(
                    "UPDATE public.payments SET flag_rule = $2 WHERE id = $1",
                    &[payment, rule],
                )
                .await
                .expect("flag");
                (
                    "payment",
                    format!("payment-{payment}"),
                    NewEvent::new(
                        "PaymentFlagged",
                        1,
                        json!({"payment": payment, "rule": rule}),
                    )
                    .with_metadata(meta("screen")),
                )
            }
            Command::Clear { payment } => {
                tx.execute(
                    "UPDATE public.payments SET flag_rule = NULL WHERE id = $1",
                    &[payment],
                )
                .await
                .expect("clear");
                (
                    "payment",
                    format!("payment-{payment}"),
                    NewEvent::new("PaymentCleared", 1, json!({"payment": payment}))
                        .with_metadata(meta("review_cleared")),
                )
            }
            Command::Reverse {
                payment,
                day,
                intent,
            } => {
                let reason: Option<&str> = (index >= self.app.reason_from).then(|| intent.as_str());
                tx.execute(
                    "UPDATE public.payments SET status = 'reversed', status_day = $2, reason = $3 WHERE id = $1",
                    &[payment, day, &reason],
                )
                .await
                .expect("reverse");
                (
                    "payment",
                    format!("payment-{payment}"),
                    NewEvent::new(
                        "PaymentReversed",
                        1,
                        json!({"payment": payment, "day": day}),
                    )
                    .with_metadata(meta(intent.as_str())),
                )
            }
        }
    }
}

fn initiated_v2(payment: i64, account: i64, amount: &str, day: i32) -> NewEvent {
    NewEvent::new(
        "PaymentInitiated",
        2,
        json!({"payment": payment, "account": account, "amount": amount, "currency": "EUR", "day": day}),
    )
}

/// PaymentInitiated v1 → v2: cents become a decimal amount, in EUR (the
/// only currency v1 knew).
pub fn upcasters() -> Upcasters {
    Upcasters::new().step("PaymentInitiated", 1, |mut p| {
        let cents = p["amount_cents"]
            .as_i64()
            .ok_or("amount_cents is not an integer")?;
        let o = p.as_object_mut().ok_or("the payload is not an object")?;
        o.remove("amount_cents");
        o.insert("amount".into(), Value::String(amount_text(cents)));
        o.insert("currency".into(), Value::String("EUR".into()));
        Ok(p)
    })
}

/// The CDC read models over the mirrors, written into schema `cdc`.
pub const CDC_READ_MODELS: &str = r#"
[read_models.statement]
table = "cdc.statement"
key = ["payment_id"]
query = """
SELECT p.id AS payment_id, p.account_id, a.customer, p.amount, p.status, p.status_day
FROM mirror.payments p LEFT JOIN mirror.accounts a ON a.id = p.account_id
WHERE p.id = ANY($1)
"""
sources = [
  { table = "public.payments", key_columns = ["id"] },
  { table = "public.accounts", affected_keys = "SELECT id FROM mirror.payments WHERE account_id = $1" },
]

[read_models.fraud_queue]
table = "cdc.fraud_queue"
key = ["payment_id"]
query = """
SELECT p.id AS payment_id, p.account_id, p.amount, p.flag_rule AS rule
FROM mirror.payments p
WHERE p.id = ANY($1) AND p.flag_rule IS NOT NULL AND p.status <> 'reversed'
"""
sources = [{ table = "public.payments", key_columns = ["id"] }]

[read_models.regulatory_export]
table = "cdc.regulatory_export"
key = ["payment_id"]
query = """
SELECT p.id AS payment_id, p.account_id, a.customer, p.amount, p.status_day AS settled_day
FROM mirror.payments p LEFT JOIN mirror.accounts a ON a.id = p.account_id
WHERE p.id = ANY($1) AND p.status = 'settled' AND p.amount >= 1000
"""
sources = [
  { table = "public.payments", key_columns = ["id"] },
  { table = "public.accounts", affected_keys = "SELECT id FROM mirror.payments WHERE account_id = $1" },
]
"#;

/// The outbox routing of the event store: one topic per stream type.
pub const OUTBOX: &str = r#"
[outbox."event_store.events"]
route_by = "stream_type"
"#;

/// The same three read models as projections, into schema `schema`.
pub fn projections(schema: &str) -> Vec<Box<dyn Projection>> {
    vec![
        Box::new(Statement::new(schema)),
        Box::new(FraudQueue::new(schema)),
        Box::new(Regulatory::new(schema)),
    ]
}

fn payment(e: &RecordedEvent) -> i64 {
    e.payload["payment"].as_i64().unwrap_or(0)
}
fn account(e: &RecordedEvent) -> i64 {
    e.payload["account"].as_i64().unwrap_or(0)
}
fn text(e: &RecordedEvent, field: &str) -> String {
    e.payload[field].as_str().unwrap_or_default().to_string()
}
fn day(e: &RecordedEvent) -> i32 {
    e.payload["day"].as_i64().unwrap_or(0) as i32
}

/// Account names, per projection: a payment's customer comes from another
/// stream, whose events may arrive before or after it, so both orders
/// give the same rows (the name is set on either side).
fn account_writes(s: &str, e: &RecordedEvent, table: &str) -> Vec<Write> {
    match e.event_type.as_str() {
        "AccountOpened" | "CustomerRenamed" => vec![
            Write::new(
                &format!(
                    "INSERT INTO {s}.{table}_accounts (id, customer) VALUES ($1, $2)
                     ON CONFLICT (id) DO UPDATE SET customer = excluded.customer"
                ),
                vec![Box::new(account(e)), Box::new(text(e, "customer"))],
            ),
            Write::new(
                &format!("UPDATE {s}.{table} SET customer = $2 WHERE account_id = $1"),
                vec![Box::new(account(e)), Box::new(text(e, "customer"))],
            ),
        ],
        _ => Vec::new(),
    }
}

/// Checkpoints are named `<schema>.statement`, so that models in two
/// schemas of one database never share them.
pub struct Statement(pub String, String);

impl Statement {
    pub fn new(schema: &str) -> Statement {
        Statement(schema.to_string(), format!("{schema}.statement"))
    }
}

impl Projection for Statement {
    fn name(&self) -> &str {
        &self.1
    }
    fn create_sql(&self) -> String {
        let s = &self.0;
        format!(
            "CREATE SCHEMA IF NOT EXISTS {s};
             CREATE TABLE IF NOT EXISTS {s}.statement_accounts (id bigint PRIMARY KEY, customer text);
             CREATE TABLE IF NOT EXISTS {s}.statement (payment_id bigint PRIMARY KEY, account_id bigint,
                 customer text, amount numeric(12,2), status text, status_day int);"
        )
    }
    fn tables(&self) -> Vec<String> {
        vec![
            format!("{}.statement_accounts", self.0),
            format!("{}.statement", self.0),
        ]
    }
    fn apply(&self, e: &RecordedEvent) -> Vec<Write> {
        let s = &self.0;
        let mut w = account_writes(s, e, "statement");
        match e.event_type.as_str() {
            "PaymentInitiated" => w.push(Write::new(
                &format!(
                    "INSERT INTO {s}.statement (payment_id, account_id, customer, amount, status, status_day)
                     SELECT $1, $2, (SELECT customer FROM {s}.statement_accounts WHERE id = $2), $3::text::numeric, 'initiated', $4"
                ),
                vec![
                    Box::new(payment(e)),
                    Box::new(account(e)),
                    Box::new(text(e, "amount")),
                    Box::new(day(e)),
                ],
            )),
            "PaymentSettled" | "PaymentReversed" => {
                let status = if e.event_type == "PaymentSettled" { "settled" } else { "reversed" };
                w.push(Write::new(
                    &format!("UPDATE {s}.statement SET status = $2, status_day = $3 WHERE payment_id = $1"),
                    vec![Box::new(payment(e)), Box::new(status), Box::new(day(e))],
                ));
            }
            _ => {}
        }
        w
    }
}

/// Checkpoints are named `<schema>.fraud_queue`, so that models in two
/// schemas of one database never share them.
pub struct FraudQueue(pub String, String);

impl FraudQueue {
    pub fn new(schema: &str) -> FraudQueue {
        FraudQueue(schema.to_string(), format!("{schema}.fraud_queue"))
    }
}

impl Projection for FraudQueue {
    fn name(&self) -> &str {
        &self.1
    }
    fn create_sql(&self) -> String {
        let s = &self.0;
        format!(
            "CREATE SCHEMA IF NOT EXISTS {s};
             CREATE TABLE IF NOT EXISTS {s}.fraud_payments (payment_id bigint PRIMARY KEY, account_id bigint, amount numeric(12,2));
             CREATE TABLE IF NOT EXISTS {s}.fraud_queue (payment_id bigint PRIMARY KEY, account_id bigint,
                 amount numeric(12,2), rule text);"
        )
    }
    fn tables(&self) -> Vec<String> {
        vec![
            format!("{}.fraud_payments", self.0),
            format!("{}.fraud_queue", self.0),
        ]
    }
    fn apply(&self, e: &RecordedEvent) -> Vec<Write> {
        let s = &self.0;
        let p: Box<i64> = Box::new(payment(e));
        match e.event_type.as_str() {
            "PaymentInitiated" => vec![Write::new(
                &format!("INSERT INTO {s}.fraud_payments VALUES ($1, $2, $3::text::numeric)"),
                vec![p, Box::new(account(e)), Box::new(text(e, "amount"))],
            )],
            "PaymentFlagged" => vec![Write::new(
                &format!(
                    "INSERT INTO {s}.fraud_queue SELECT payment_id, account_id, amount, $2 FROM {s}.fraud_payments WHERE payment_id = $1"
                ),
                vec![p, Box::new(text(e, "rule"))],
            )],
            "PaymentCleared" | "PaymentReversed" => vec![Write::new(
                &format!("DELETE FROM {s}.fraud_queue WHERE payment_id = $1"),
                vec![p],
            )],
            _ => Vec::new(),
        }
    }
}

/// Checkpoints are named `<schema>.regulatory_export`, so that models in two
/// schemas of one database never share them.
pub struct Regulatory(pub String, String);

impl Regulatory {
    pub fn new(schema: &str) -> Regulatory {
        Regulatory(schema.to_string(), format!("{schema}.regulatory_export"))
    }
}

impl Projection for Regulatory {
    fn name(&self) -> &str {
        &self.1
    }
    fn create_sql(&self) -> String {
        let s = &self.0;
        format!(
            "CREATE SCHEMA IF NOT EXISTS {s};
             CREATE TABLE IF NOT EXISTS {s}.regulatory_export_accounts (id bigint PRIMARY KEY, customer text);
             CREATE TABLE IF NOT EXISTS {s}.regulatory_payments (payment_id bigint PRIMARY KEY, account_id bigint, amount numeric(12,2));
             CREATE TABLE IF NOT EXISTS {s}.regulatory_export (payment_id bigint PRIMARY KEY, account_id bigint,
                 customer text, amount numeric(12,2), settled_day int);"
        )
    }
    fn tables(&self) -> Vec<String> {
        vec![
            format!("{}.regulatory_export_accounts", self.0),
            format!("{}.regulatory_payments", self.0),
            format!("{}.regulatory_export", self.0),
        ]
    }
    fn apply(&self, e: &RecordedEvent) -> Vec<Write> {
        let s = &self.0;
        let mut w = account_writes(s, e, "regulatory_export");
        let p: Box<i64> = Box::new(payment(e));
        match e.event_type.as_str() {
            "PaymentInitiated" => w.push(Write::new(
                &format!("INSERT INTO {s}.regulatory_payments VALUES ($1, $2, $3::text::numeric)"),
                vec![p, Box::new(account(e)), Box::new(text(e, "amount"))],
            )),
            "PaymentSettled" => w.push(Write::new(
                &format!(
                    "INSERT INTO {s}.regulatory_export
                     SELECT p.payment_id, p.account_id, (SELECT customer FROM {s}.regulatory_export_accounts WHERE id = p.account_id), p.amount, $2
                     FROM {s}.regulatory_payments p WHERE p.payment_id = $1 AND p.amount >= 1000"
                ),
                vec![p, Box::new(day(e))],
            )),
            "PaymentReversed" => w.push(Write::new(
                &format!("DELETE FROM {s}.regulatory_export WHERE payment_id = $1"),
                vec![p],
            )),
            _ => {}
        }
        w
    }
}

/// The read model added later: a line per settlement and per reversal.
/// Checkpoints are named `<schema>.tax_lines`, so that models in two
/// schemas of one database never share them.
pub struct Tax(pub String, String);

impl Tax {
    pub fn new(schema: &str) -> Tax {
        Tax(schema.to_string(), format!("{schema}.tax_lines"))
    }
}

impl Projection for Tax {
    fn name(&self) -> &str {
        &self.1
    }
    fn create_sql(&self) -> String {
        let s = &self.0;
        format!(
            "CREATE SCHEMA IF NOT EXISTS {s};
             CREATE TABLE IF NOT EXISTS {s}.tax_payments (payment_id bigint PRIMARY KEY, amount numeric(12,2));
             CREATE TABLE IF NOT EXISTS {s}.tax_lines (payment_id bigint, kind text, day int, amount numeric(12,2),
                 PRIMARY KEY (payment_id, kind));"
        )
    }
    fn tables(&self) -> Vec<String> {
        vec![
            format!("{}.tax_payments", self.0),
            format!("{}.tax_lines", self.0),
        ]
    }
    fn apply(&self, e: &RecordedEvent) -> Vec<Write> {
        let s = &self.0;
        let p: Box<i64> = Box::new(payment(e));
        match e.event_type.as_str() {
            "PaymentInitiated" => vec![Write::new(
                &format!("INSERT INTO {s}.tax_payments VALUES ($1, $2::text::numeric)"),
                vec![p, Box::new(text(e, "amount"))],
            )],
            "PaymentSettled" => vec![Write::new(
                &format!("INSERT INTO {s}.tax_lines SELECT payment_id, 'settlement', $2, amount FROM {s}.tax_payments WHERE payment_id = $1"),
                vec![p, Box::new(day(e))],
            )],
            "PaymentReversed" => vec![Write::new(
                &format!("INSERT INTO {s}.tax_lines SELECT payment_id, 'reversal', $2, -amount FROM {s}.tax_payments WHERE payment_id = $1"),
                vec![p, Box::new(day(e))],
            )],
            _ => Vec::new(),
        }
    }
}

/// What the tax lines must be, from the commands alone (the oracle):
/// `(payment, kind) → (day, amount in cents)` for commands at `from..`.
pub fn expected_tax_lines(
    commands: &[Command],
    from: usize,
) -> BTreeMap<(i64, String), (i32, i64)> {
    let mut cents = HashMap::new();
    let mut out = BTreeMap::new();
    for (i, c) in commands.iter().enumerate() {
        match c {
            Command::Initiate {
                payment, cents: n, ..
            } => {
                cents.insert(*payment, *n);
            }
            Command::Settle { payment, day } if i >= from => {
                out.insert((*payment, "settlement".to_string()), (*day, cents[payment]));
            }
            Command::Reverse { payment, day, .. } if i >= from => {
                out.insert((*payment, "reversal".to_string()), (*day, -cents[payment]));
            }
            _ => {}
        }
    }
    out
}

/// The payments each command index reversed with intent `intent`.
pub fn reversals(commands: &[Command], intent: Intent, from: usize) -> BTreeSet<i64> {
    commands
        .iter()
        .enumerate()
        .filter_map(|(i, c)| match c {
            Command::Reverse {
                payment, intent: x, ..
            } if *x == intent && i >= from => Some(*payment),
            _ => None,
        })
        .collect()
}
