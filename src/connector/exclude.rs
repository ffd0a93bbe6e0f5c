//! Columns left out of events (`source.columns.<table>.exclude`).
//!
//! Guarantee: an excluded column's value is dropped where it enters the
//! connector, before anything else sees it: a streamed change is cut by
//! its table's last Relation message ([`Kept::cut`]), and a snapshot reads
//! only the kept columns (its description is cut by [`without_excluded`]
//! before the select list is built). So no event, schema, dead-letter
//! record or tenant header can carry it. A key column is never left out:
//! every event needs the key.
//!
//! ```text
//!  Relation ──► without_excluded ──► codec (kept columns) ─┐
//!          └──► Kept (positions per relation)              │
//!  Insert/Update/Delete ──► Kept::cut ─────────────────────┴─► emit
//!  snapshot describe ──► without_excluded ──► SELECT kept columns
//! ```

use std::collections::HashMap;

use crate::config::Config;
use crate::encode::TableDesc;
use crate::source::pgoutput::{Datum, Lsn, Message, OldTuple};

/// `desc` without the columns its table's `exclude` names, and which of
/// `desc`'s columns were kept, in order. Leaving out a key column is an
/// error naming the field.
pub fn without_excluded(
    config: &Config,
    mut desc: TableDesc,
) -> Result<(TableDesc, Vec<bool>), String> {
    let table = desc.qualified();
    let excluded = config.excluded_columns(&table);
    for (i, name) in excluded.iter().enumerate() {
        if desc.columns.iter().any(|c| c.key && &c.name == name) {
            let field = format!("source.columns.\"{table}\".exclude[{i}]");
            return Err(crate::source::catalog::excluded_key(&field, name, &table));
        }
    }
    let kept: Vec<bool> = desc
        .columns
        .iter()
        .map(|c| !excluded.contains(&c.name))
        .collect();
    desc.columns.retain(|c| !excluded.contains(&c.name));
    Ok((desc, kept))
}

/// The columns kept of each relation that leaves some out, as its last
/// Relation message described them (positions move with DDL, so they are
/// taken again from every Relation message).
#[derive(Debug, Default)]
pub struct Kept(HashMap<u32, Vec<bool>>);

impl Kept {
    /// Records a relation's kept columns from [`without_excluded`].
    pub fn described(&mut self, relation: u32, kept: Vec<bool>) {
        if kept.iter().all(|k| *k) {
            self.0.remove(&relation);
        } else {
            self.0.insert(relation, kept);
        }
    }

    /// `msg` with the left-out columns' values dropped; other messages as
    /// they are.
    pub fn cut(&self, msg: Message, lsn: Lsn) -> Result<Message, String> {
        if self.0.is_empty() {
            return Ok(msg);
        }
        let keep = |relation: u32, row: Vec<Datum>| -> Result<Vec<Datum>, String> {
            let Some(kept) = self.0.get(&relation) else {
                return Ok(row);
            };
            if kept.len() != row.len() {
                return Err(format!(
                    "a change at LSN {lsn} carries {} columns of relation {relation}, whose Relation message described {}",
                    row.len(),
                    kept.len()
                ));
            }
            Ok(row
                .into_iter()
                .zip(kept)
                .filter_map(|(d, k)| k.then_some(d))
                .collect())
        };
        let old = |relation: u32, o: OldTuple| -> Result<OldTuple, String> {
            Ok(match o {
                OldTuple::Key(v) => OldTuple::Key(keep(relation, v)?),
                OldTuple::Full(v) => OldTuple::Full(keep(relation, v)?),
            })
        };
        Ok(match msg {
            Message::Insert { relation, new } => Message::Insert {
                relation,
                new: keep(relation, new)?,
            },
            Message::Update {
                relation,
                old: o,
                new,
            } => Message::Update {
                relation,
                old: o.map(|o| old(relation, o)).transpose()?,
                new: keep(relation, new)?,
            },
            Message::Delete { relation, old: o } => Message::Delete {
                relation,
                old: old(relation, o)?,
            },
            other => other,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::encode::ColumnDesc;

    fn config(exclude: &str) -> Config {
        let toml = format!(
            r#"
name = "n"
[source]
url = "postgres://localhost/db"
slot = "s"
publication = "p"
tables = ["public.users"]
[source.columns."public.users"]
exclude = [{exclude}]
[kafka]
brokers = "localhost:9092"
topic_prefix = "p"
[registry]
url = "http://localhost:8081"
"#
        );
        Config::from_toml(&toml, "test.toml", &[]).expect("config")
    }

    fn desc(full_identity: bool) -> TableDesc {
        let column = |name: &str, key: bool| ColumnDesc {
            name: name.into(),
            type_oid: 25,
            type_modifier: -1,
            type_name: "text".into(),
            enum_labels: None,
            array: false,
            key: key || full_identity,
        };
        TableDesc {
            schema: "public".into(),
            table: "users".into(),
            columns: vec![
                column("id", true),
                column("secret", false),
                column("name", false),
                column("token", false),
            ],
        }
    }

    fn text(s: &str) -> Datum {
        Datum::Text(s.as_bytes().to_vec())
    }

    #[test]
    fn excluded_columns_leave_the_description_and_every_row_image() {
        let config = config(r#""token", "secret""#);
        let (cut, kept) = without_excluded(&config, desc(false)).expect("cut");
        let names: Vec<&str> = cut.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["id", "name"]);
        assert_eq!(kept, [true, false, true, false]);

        let mut relations = Kept::default();
        relations.described(7, kept);
        let row = || {
            vec![
                text("1"),
                text("s3cret"),
                text("ann"),
                Datum::UnchangedToast,
            ]
        };
        let lsn = Lsn(42);
        let insert = relations
            .cut(
                Message::Insert {
                    relation: 7,
                    new: row(),
                },
                lsn,
            )
            .expect("insert");
        assert_eq!(
            insert,
            Message::Insert {
                relation: 7,
                new: vec![text("1"), text("ann")]
            }
        );
        let update = relations
            .cut(
                Message::Update {
                    relation: 7,
                    old: Some(OldTuple::Full(row())),
                    new: row(),
                },
                lsn,
            )
            .expect("update");
        assert_eq!(
            update,
            Message::Update {
                relation: 7,
                old: Some(OldTuple::Full(vec![text("1"), text("ann")])),
                new: vec![text("1"), text("ann")],
            }
        );
        let delete = relations
            .cut(
                Message::Delete {
                    relation: 7,
                    old: OldTuple::Key(row()),
                },
                lsn,
            )
            .expect("delete");
        assert_eq!(
            delete,
            Message::Delete {
                relation: 7,
                old: OldTuple::Key(vec![text("1"), text("ann")])
            }
        );
        // Another relation, and a message without rows, pass as they are.
        let other = Message::Insert {
            relation: 8,
            new: row(),
        };
        assert_eq!(relations.cut(other.clone(), lsn).expect("other"), other);
        // A row of another width than described is refused, not misaligned.
        let short = Message::Insert {
            relation: 7,
            new: vec![text("1")],
        };
        let e = relations.cut(short, lsn).expect_err("width");
        assert!(
            e.contains("LSN 0/2A carries 1 columns of relation 7"),
            "{e}"
        );
        // A new Relation message that keeps everything forgets the cut.
        relations.described(7, vec![true; 4]);
        let whole = Message::Insert {
            relation: 7,
            new: row(),
        };
        assert_eq!(relations.cut(whole.clone(), lsn).expect("whole"), whole);
    }

    #[test]
    fn a_key_column_cannot_be_left_out() {
        let e = without_excluded(&config(r#""name", "id""#), desc(false)).expect_err("key");
        assert!(
            e.starts_with(
                "source.columns.\"public.users\".exclude[1]: id is a column of public.users's key"
            ),
            "{e}"
        );
        // Under REPLICA IDENTITY FULL without a key, every column is one.
        let e = without_excluded(&config(r#""secret""#), desc(true)).expect_err("full");
        assert!(e.contains("exclude[0]: secret"), "{e}");
        // A table without exclusions keeps everything.
        let other = TableDesc {
            table: "other".into(),
            ..desc(false)
        };
        let (same, kept) = without_excluded(&config(r#""secret""#), other.clone()).expect("other");
        assert_eq!(same, other);
        assert!(kept.iter().all(|k| *k));
    }
}
