//! Columns left out of events (`source.columns.<table>.exclude`).
//!
//! Guarantee: an excluded column's value is dropped where it enters the
//! connector, before anything else sees it: a streamed change is cut by
//! its table's last Relation message ([`Kept::cut`]), and a snapshot reads
//! only the kept columns (its description is cut by [`without_excluded`]
//! before the select list is built). So no event, schema, dead-letter
//! record or tenant header can carry it. A key column is never left out:
//! every event needs the key. A left-out column renamed while the
//! connector streams stays left out under its new name (the config names
//! the old one until it is edited, and a restart refuses a name the table
//! no longer has).
//!
//! ```text
//!  Relation ──► Kept::describe ──► codec (kept columns) ─┐
//!          └──► positions and names per relation         │
//!  Insert/Update/Delete ──► Kept::cut ───────────────────┴─► emit
//!  snapshot describe ──► without_excluded ──► SELECT kept columns
//! ```

use std::collections::HashMap;

use crate::config::Config;
use crate::encode::TableDesc;
use crate::source::pgoutput::{Datum, Lsn, Message, OldTuple};

/// A snapshot's `desc` without the columns its table's `exclude` names.
/// Leaving out a key column is an error naming the field, and so is a
/// name the table no longer has: renamed since the connector started, a
/// snapshot would not know the column to leave out.
pub fn without_excluded(config: &Config, desc: TableDesc) -> Result<TableDesc, String> {
    let table = desc.qualified();
    let excluded = config.excluded_columns(&table);
    for (i, name) in excluded.iter().enumerate() {
        if !desc.columns.iter().any(|c| &c.name == name) {
            return Err(format!(
                "source.columns.\"{table}\".exclude[{i}]: {table} has no column {name} now (renamed or dropped since the connector started); a snapshot stops rather than guess which column to leave out: name the column as it is called now and restart"
            ));
        }
    }
    Ok(cut_desc(&table, excluded, &[], desc)?.0)
}

/// `desc` without the columns `excluded` (the field's list) and `renamed`
/// (what some of them are called now) name.
fn cut_desc(
    table: &str,
    excluded: &[String],
    renamed: &[String],
    mut desc: TableDesc,
) -> Result<(TableDesc, Vec<bool>), String> {
    for (i, name) in excluded.iter().enumerate() {
        if desc.columns.iter().any(|c| c.key && &c.name == name) {
            let field = format!("source.columns.\"{table}\".exclude[{i}]");
            return Err(crate::source::catalog::excluded_key(&field, name, table));
        }
    }
    let out = |name: &String| excluded.contains(name) || renamed.contains(name);
    if let Some(c) = desc
        .columns
        .iter()
        .find(|c| c.key && renamed.contains(&c.name))
    {
        return Err(crate::source::catalog::excluded_key(
            &format!("source.columns.\"{table}\".exclude"),
            &c.name,
            table,
        ));
    }
    let kept: Vec<bool> = desc.columns.iter().map(|c| !out(&c.name)).collect();
    desc.columns.retain(|c| !out(&c.name));
    Ok((desc, kept))
}

/// What the stream knows of one relation that has an exclude list.
#[derive(Debug, Default)]
struct Seen {
    /// Its columns' names, as its last Relation message listed them.
    names: Vec<String>,
    /// Left-out columns renamed since the stream began: their new names.
    renamed: Vec<String>,
}

/// The columns kept of each relation that leaves some out, as its last
/// Relation message described them (positions move with DDL, so they are
/// taken again from every Relation message).
#[derive(Debug, Default)]
pub struct Kept {
    cut: HashMap<u32, Vec<bool>>,
    seen: HashMap<u32, Seen>,
}

impl Kept {
    /// A Relation message's description, `desc`, without the left-out
    /// columns; their positions are kept for [`Kept::cut`]. A left-out
    /// column missing from `desc` with a column the last description did
    /// not have in its place was renamed (or dropped as that one was
    /// added): the new name stays left out, with an error logged asking
    /// for the config to name it.
    pub fn describe(
        &mut self,
        config: &Config,
        relation: u32,
        desc: TableDesc,
        lsn: Lsn,
    ) -> Result<TableDesc, String> {
        let table = desc.qualified();
        let excluded = config.excluded_columns(&table);
        if excluded.is_empty() {
            self.cut.remove(&relation);
            self.seen.remove(&relation);
            return Ok(desc);
        }
        let names: Vec<String> = desc.columns.iter().map(|c| c.name.clone()).collect();
        let seen = self.seen.entry(relation).or_default();
        let out: Vec<String> = excluded.iter().chain(&seen.renamed).cloned().collect();
        for name in &out {
            let Some(p) = seen.names.iter().position(|n| n == name) else {
                continue;
            };
            if names.contains(name) {
                continue;
            }
            let Some(new) = names
                .get(p)
                .filter(|n| !seen.names.contains(n) && !out.contains(n))
            else {
                continue;
            };
            tracing::error!(
                field = %format!("source.columns.\"{table}\".exclude"),
                column = %name,
                now = %new,
                %lsn,
                "a left-out column was renamed (or dropped as another was added in its place); the new name stays left out until the connector stops, and a restart refuses the old one: put the new name in the list"
            );
            seen.renamed.push(new.clone());
        }
        let (desc, kept) = cut_desc(&table, excluded, &seen.renamed, desc)?;
        seen.names = names;
        if kept.iter().all(|k| *k) {
            self.cut.remove(&relation);
        } else {
            self.cut.insert(relation, kept);
        }
        Ok(desc)
    }

    /// `msg` with the left-out columns' values dropped; other messages as
    /// they are.
    pub fn cut(&self, msg: Message, lsn: Lsn) -> Result<Message, String> {
        if self.cut.is_empty() {
            return Ok(msg);
        }
        let keep = |relation: u32, row: Vec<Datum>| -> Result<Vec<Datum>, String> {
            let Some(kept) = self.cut.get(&relation) else {
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

    fn named(desc: &TableDesc) -> Vec<&str> {
        desc.columns.iter().map(|c| c.name.as_str()).collect()
    }

    /// `desc(false)` with its columns renamed or reordered as `names`.
    fn with_names(names: &[&str]) -> TableDesc {
        let mut d = desc(false);
        let template = d.columns[1].clone();
        d.columns = names
            .iter()
            .map(|n| ColumnDesc {
                name: n.to_string(),
                key: *n == "id",
                ..template.clone()
            })
            .collect();
        d
    }

    #[test]
    fn excluded_columns_leave_the_description_and_every_row_image() {
        let config = config(r#""token", "secret""#);
        let cut = without_excluded(&config, desc(false)).expect("cut");
        assert_eq!(named(&cut), ["id", "name"]);

        let mut relations = Kept::default();
        let lsn = Lsn(42);
        let streamed = relations
            .describe(&config, 7, desc(false), lsn)
            .expect("describe");
        assert_eq!(streamed, cut);
        let row = || {
            vec![
                text("1"),
                text("s3cret"),
                text("ann"),
                Datum::UnchangedToast,
            ]
        };
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
        // Positions follow each Relation message: a column added before a
        // left-out one moves it.
        relations
            .describe(
                &config,
                7,
                with_names(&["id", "added", "secret", "name", "token"]),
                lsn,
            )
            .expect("moved");
        let moved = vec![text("1"), text("a"), text("s3cret"), text("ann"), text("t")];
        assert_eq!(
            relations
                .cut(
                    Message::Insert {
                        relation: 7,
                        new: moved
                    },
                    lsn
                )
                .expect("moved"),
            Message::Insert {
                relation: 7,
                new: vec![text("1"), text("a"), text("ann")]
            }
        );
    }

    #[test]
    fn a_left_out_column_renamed_while_streaming_stays_left_out() {
        let config = config(r#""secret""#);
        let mut relations = Kept::default();
        let lsn = Lsn(42);
        let described = |relations: &mut Kept, names: &[&str]| {
            named(
                &relations
                    .describe(&config, 7, with_names(names), lsn)
                    .expect("describe"),
            )
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>()
        };
        assert_eq!(
            described(&mut relations, &["id", "secret", "name"]),
            ["id", "name"]
        );
        // Renamed: the column in its place is new.
        assert_eq!(
            described(&mut relations, &["id", "hidden", "name"]),
            ["id", "name"]
        );
        // And again, and with a column added after it.
        assert_eq!(
            described(&mut relations, &["id", "hush", "name", "x"]),
            ["id", "name", "x"]
        );
        let row = vec![text("1"), text("s3cret"), text("ann"), text("x")];
        assert_eq!(
            relations
                .cut(
                    Message::Insert {
                        relation: 7,
                        new: row
                    },
                    lsn
                )
                .expect("cut"),
            Message::Insert {
                relation: 7,
                new: vec![text("1"), text("ann"), text("x")]
            }
        );
        // Dropped: what takes its place was there before, and is kept.
        assert_eq!(
            described(&mut relations, &["id", "name", "x"]),
            ["id", "name", "x"]
        );
        // Another relation of the same table (a new stream) knows nothing
        // of the renames, so a name the config lacks is kept there; the
        // start-up check refuses such a config.
        assert_eq!(
            named(
                &relations
                    .describe(&config, 9, with_names(&["id", "hidden"]), lsn)
                    .expect("other")
            ),
            ["id", "hidden"]
        );
        // A snapshot cannot tell a rename: it refuses a name the table lacks.
        let e = without_excluded(&config, with_names(&["id", "hidden", "name"])).expect_err("gone");
        assert!(
            e.starts_with(
                "source.columns.\"public.users\".exclude[0]: public.users has no column secret now"
            ),
            "{e}"
        );
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
        let e = Kept::default()
            .describe(&config(r#""secret""#), 7, desc(true), Lsn(1))
            .expect_err("streamed");
        assert!(e.contains("exclude[0]: secret"), "{e}");
        // A table without exclusions keeps everything.
        let other = TableDesc {
            table: "other".into(),
            ..desc(false)
        };
        let same = without_excluded(&config(r#""secret""#), other.clone()).expect("other");
        assert_eq!(same, other);
    }
}
