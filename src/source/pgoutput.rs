//! A decoder for pgoutput logical replication messages, protocol version 1
//! (Postgres 10 and later), as documented in "Logical Replication Message
//! Formats" of the Postgres manual.
//!
//! Guarantee: [`decode`] never panics on any input. A truncated or
//! malformed message is an error naming the message kind and byte offset;
//! bytes after a complete message are an error too, so a framing mistake is
//! never mistaken for data. Column values stay in Postgres's text format,
//! and NULL, unchanged-TOAST and text values stay distinct.

use std::fmt;

/// A log sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl std::str::FromStr for Lsn {
    type Err = String;
    fn from_str(s: &str) -> Result<Lsn, String> {
        let (hi, lo) = s
            .split_once('/')
            .ok_or_else(|| format!("'{s}' is not an LSN (expected X/Y)"))?;
        let hi = u64::from_str_radix(hi, 16).map_err(|_| format!("'{s}' is not an LSN"))?;
        let lo = u64::from_str_radix(lo, 16).map_err(|_| format!("'{s}' is not an LSN"))?;
        if hi > u64::from(u32::MAX) || lo > u64::from(u32::MAX) {
            return Err(format!("'{s}' is not an LSN"));
        }
        Ok(Lsn(hi << 32 | lo))
    }
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Datum {
    Null,
    /// A TOASTed value the change did not touch: its value is not in the WAL.
    UnchangedToast,
    /// The value in Postgres's text output format.
    Text(Vec<u8>),
    /// The value in binary format (protocol 2 and later with `binary`).
    Binary(Vec<u8>),
}

/// A relation column as the Relation message describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Part of the replica identity (the key).
    pub key: bool,
    pub name: String,
    pub type_oid: u32,
    pub type_modifier: i32,
}

/// REPLICA IDENTITY setting of a relation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaIdentity {
    Default,
    Nothing,
    Full,
    Index,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    pub oid: u32,
    pub namespace: String,
    pub name: String,
    pub replica_identity: ReplicaIdentity,
    pub columns: Vec<Column>,
}

/// The old row image an Update or Delete carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// Only the replica-identity columns (others are Null).
    Key(Vec<Datum>),
    /// The whole old row (REPLICA IDENTITY FULL).
    Full(Vec<Datum>),
}

impl OldTuple {
    pub fn values(&self) -> &[Datum] {
        match self {
            OldTuple::Key(v) | OldTuple::Full(v) => v,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Begin {
        final_lsn: Lsn,
        /// Microseconds since 2000-01-01 UTC.
        commit_time: i64,
        xid: u32,
    },
    Commit {
        flags: u8,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        commit_time: i64,
    },
    Origin {
        commit_lsn: Lsn,
        name: String,
    },
    Relation(Relation),
    Type {
        oid: u32,
        namespace: String,
        name: String,
    },
    Insert {
        relation: u32,
        new: Vec<Datum>,
    },
    Update {
        relation: u32,
        old: Option<OldTuple>,
        new: Vec<Datum>,
    },
    Delete {
        relation: u32,
        old: OldTuple,
    },
    Truncate {
        cascade: bool,
        restart_identity: bool,
        relations: Vec<u32>,
    },
    /// A logical decoding message (`pg_logical_emit_message`).
    Message {
        transactional: bool,
        lsn: Lsn,
        prefix: String,
        content: Vec<u8>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed pgoutput {kind} message at byte {offset}: {problem}")]
pub struct DecodeError {
    pub kind: &'static str,
    pub offset: usize,
    pub problem: String,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    kind: &'static str,
}

impl<'a> Reader<'a> {
    fn err(&self, problem: impl Into<String>) -> DecodeError {
        DecodeError {
            kind: self.kind,
            offset: self.pos,
            problem: problem.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                self.err(format!(
                    "needs {n} more bytes, has {}",
                    self.buf.len() - self.pos
                ))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn i16(&mut self) -> Result<i16, DecodeError> {
        let b = self.take(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self) -> Result<i32, DecodeError> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        self.i32().map(|v| v as u32)
    }

    fn i64(&mut self) -> Result<i64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(i64::from_be_bytes(a))
    }

    fn lsn(&mut self) -> Result<Lsn, DecodeError> {
        self.i64().map(|v| Lsn(v as u64))
    }

    fn string(&mut self) -> Result<String, DecodeError> {
        let rest = &self.buf[self.pos..];
        let nul = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.err("string without a terminating NUL"))?;
        let s = std::str::from_utf8(&rest[..nul])
            .map_err(|_| self.err("string is not UTF-8"))?
            .to_string();
        self.pos += nul + 1;
        Ok(s)
    }

    fn count(&mut self, what: &str) -> Result<usize, DecodeError> {
        let n = self.i16()?;
        usize::try_from(n).map_err(|_| self.err(format!("negative {what} count {n}")))
    }

    fn tuple(&mut self) -> Result<Vec<Datum>, DecodeError> {
        let n = self.count("column")?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let tag = self.u8()?;
            out.push(match tag {
                b'n' => Datum::Null,
                b'u' => Datum::UnchangedToast,
                b't' | b'b' => {
                    let len = self.i32()?;
                    let len = usize::try_from(len)
                        .map_err(|_| self.err(format!("negative value length {len}")))?;
                    let bytes = self.take(len)?.to_vec();
                    if tag == b't' {
                        Datum::Text(bytes)
                    } else {
                        Datum::Binary(bytes)
                    }
                }
                other => return Err(self.err(format!("unknown column tag 0x{other:02x}"))),
            });
        }
        Ok(out)
    }

    fn finish(self) -> Result<(), DecodeError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(self.err(format!("{} trailing bytes", self.buf.len() - self.pos)))
        }
    }
}

fn kind_name(tag: u8) -> &'static str {
    match tag {
        b'B' => "Begin",
        b'C' => "Commit",
        b'O' => "Origin",
        b'R' => "Relation",
        b'Y' => "Type",
        b'I' => "Insert",
        b'U' => "Update",
        b'D' => "Delete",
        b'T' => "Truncate",
        b'M' => "Message",
        _ => "unknown",
    }
}

/// Decodes one pgoutput message (the payload of an XLogData message).
pub fn decode(buf: &[u8]) -> Result<Message, DecodeError> {
    let Some((&tag, _)) = buf.split_first() else {
        return Err(DecodeError {
            kind: "empty",
            offset: 0,
            problem: "no bytes".to_string(),
        });
    };
    let mut r = Reader {
        buf,
        pos: 1,
        kind: kind_name(tag),
    };
    let msg = match tag {
        b'B' => Message::Begin {
            final_lsn: r.lsn()?,
            commit_time: r.i64()?,
            xid: r.u32()?,
        },
        b'C' => Message::Commit {
            flags: r.u8()?,
            commit_lsn: r.lsn()?,
            end_lsn: r.lsn()?,
            commit_time: r.i64()?,
        },
        b'O' => Message::Origin {
            commit_lsn: r.lsn()?,
            name: r.string()?,
        },
        b'R' => {
            let oid = r.u32()?;
            let namespace = r.string()?;
            let name = r.string()?;
            let replica_identity = match r.u8()? {
                b'd' => ReplicaIdentity::Default,
                b'n' => ReplicaIdentity::Nothing,
                b'f' => ReplicaIdentity::Full,
                b'i' => ReplicaIdentity::Index,
                other => return Err(r.err(format!("unknown replica identity 0x{other:02x}"))),
            };
            let n = r.count("column")?;
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                columns.push(Column {
                    key: r.u8()? & 1 == 1,
                    name: r.string()?,
                    type_oid: r.u32()?,
                    type_modifier: r.i32()?,
                });
            }
            Message::Relation(Relation {
                oid,
                namespace,
                name,
                replica_identity,
                columns,
            })
        }
        b'Y' => Message::Type {
            oid: r.u32()?,
            namespace: r.string()?,
            name: r.string()?,
        },
        b'I' => {
            let relation = r.u32()?;
            match r.u8()? {
                b'N' => Message::Insert {
                    relation,
                    new: r.tuple()?,
                },
                other => return Err(r.err(format!("expected 'N', found 0x{other:02x}"))),
            }
        }
        b'U' => {
            let relation = r.u32()?;
            let (old, marker) = match r.u8()? {
                b'K' => (Some(OldTuple::Key(r.tuple()?)), r.u8()?),
                b'O' => (Some(OldTuple::Full(r.tuple()?)), r.u8()?),
                m => (None, m),
            };
            if marker != b'N' {
                return Err(r.err(format!("expected 'N', found 0x{marker:02x}")));
            }
            Message::Update {
                relation,
                old,
                new: r.tuple()?,
            }
        }
        b'D' => {
            let relation = r.u32()?;
            let old = match r.u8()? {
                b'K' => OldTuple::Key(r.tuple()?),
                b'O' => OldTuple::Full(r.tuple()?),
                other => return Err(r.err(format!("expected 'K' or 'O', found 0x{other:02x}"))),
            };
            Message::Delete { relation, old }
        }
        b'T' => {
            let n = r.i32()?;
            let n =
                usize::try_from(n).map_err(|_| r.err(format!("negative relation count {n}")))?;
            let options = r.u8()?;
            // Each oid is 4 bytes: refuse counts the buffer cannot hold
            // before allocating for them.
            if n > (buf.len() - r.pos) / 4 {
                return Err(r.err(format!("{n} relations do not fit in the message")));
            }
            let mut relations = Vec::with_capacity(n);
            for _ in 0..n {
                relations.push(r.u32()?);
            }
            Message::Truncate {
                cascade: options & 1 == 1,
                restart_identity: options & 2 == 2,
                relations,
            }
        }
        b'M' => {
            let flags = r.u8()?;
            let lsn = r.lsn()?;
            let prefix = r.string()?;
            let len = r.i32()?;
            let len = usize::try_from(len)
                .map_err(|_| r.err(format!("negative content length {len}")))?;
            Message::Message {
                transactional: flags & 1 == 1,
                lsn,
                prefix,
                content: r.take(len)?.to_vec(),
            }
        }
        other => {
            return Err(DecodeError {
                kind: "unknown",
                offset: 0,
                problem: format!("unknown message type 0x{other:02x}"),
            })
        }
    };
    r.finish()?;
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds pgoutput bytes the way the server writes them.
    #[derive(Default)]
    struct W(Vec<u8>);
    impl W {
        fn u8(mut self, v: u8) -> Self {
            self.0.push(v);
            self
        }
        fn i16(mut self, v: i16) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn i32(mut self, v: i32) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn i64(mut self, v: i64) -> Self {
            self.0.extend_from_slice(&v.to_be_bytes());
            self
        }
        fn s(mut self, v: &str) -> Self {
            self.0.extend_from_slice(v.as_bytes());
            self.0.push(0);
            self
        }
        fn text(self, v: &str) -> Self {
            let mut w = self.u8(b't').i32(v.len() as i32);
            w.0.extend_from_slice(v.as_bytes());
            w
        }
    }

    #[test]
    fn lsn_parses_and_prints_like_postgres() {
        let lsn: Lsn = "16/B374D848".parse().unwrap_or_default();
        assert_eq!(lsn, Lsn(0x16_B374_D848));
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert!("nope".parse::<Lsn>().is_err());
        assert!("1/100000000".parse::<Lsn>().is_err());
    }

    #[test]
    fn decodes_begin_and_commit() {
        let begin = W::default().u8(b'B').i64(0x100).i64(42).i32(777).0;
        assert_eq!(
            decode(&begin),
            Ok(Message::Begin {
                final_lsn: Lsn(0x100),
                commit_time: 42,
                xid: 777
            })
        );
        let commit = W::default().u8(b'C').u8(0).i64(0x100).i64(0x130).i64(42).0;
        assert_eq!(
            decode(&commit),
            Ok(Message::Commit {
                flags: 0,
                commit_lsn: Lsn(0x100),
                end_lsn: Lsn(0x130),
                commit_time: 42
            })
        );
    }

    #[test]
    fn decodes_relation_with_key_flags() {
        let bytes = W::default()
            .u8(b'R')
            .i32(16384)
            .s("public")
            .s("orders")
            .u8(b'd')
            .i16(2)
            .u8(1)
            .s("id")
            .i32(20)
            .i32(-1)
            .u8(0)
            .s("amount")
            .i32(1700)
            .i32((12 << 16 | 2) + 4)
            .0;
        let Ok(Message::Relation(rel)) = decode(&bytes) else {
            panic!("not a relation: {:?}", decode(&bytes));
        };
        assert_eq!(
            (rel.namespace.as_str(), rel.name.as_str()),
            ("public", "orders")
        );
        assert_eq!(rel.replica_identity, ReplicaIdentity::Default);
        assert!(rel.columns[0].key && !rel.columns[1].key);
        assert_eq!(rel.columns[1].type_oid, 1700);
    }

    #[test]
    fn keeps_null_unchanged_toast_and_text_distinct() {
        let bytes = W::default()
            .u8(b'U')
            .i32(16384)
            .u8(b'K')
            .i16(1)
            .text("7")
            .u8(b'N')
            .i16(3)
            .u8(b'n')
            .u8(b'u')
            .text("")
            .0;
        assert_eq!(
            decode(&bytes),
            Ok(Message::Update {
                relation: 16384,
                old: Some(OldTuple::Key(vec![Datum::Text(b"7".to_vec())])),
                new: vec![Datum::Null, Datum::UnchangedToast, Datum::Text(vec![])],
            })
        );
    }

    #[test]
    fn decodes_update_without_old_tuple_delete_truncate_and_message() {
        let upd = W::default().u8(b'U').i32(1).u8(b'N').i16(1).text("x").0;
        assert!(matches!(
            decode(&upd),
            Ok(Message::Update { old: None, .. })
        ));
        let del = W::default().u8(b'D').i32(1).u8(b'O').i16(1).text("x").0;
        assert!(matches!(
            decode(&del),
            Ok(Message::Delete {
                old: OldTuple::Full(_),
                ..
            })
        ));
        let tr = W::default().u8(b'T').i32(2).u8(3).i32(10).i32(11).0;
        assert_eq!(
            decode(&tr),
            Ok(Message::Truncate {
                cascade: true,
                restart_identity: true,
                relations: vec![10, 11]
            })
        );
        let mut m = W::default().u8(b'M').u8(1).i64(5).s("pgcdc").i32(2);
        m.0.extend_from_slice(b"hi");
        assert_eq!(
            decode(&m.0),
            Ok(Message::Message {
                transactional: true,
                lsn: Lsn(5),
                prefix: "pgcdc".into(),
                content: b"hi".to_vec()
            })
        );
    }

    #[test]
    fn malformed_input_is_an_error_with_kind_and_offset() {
        let cut = W::default()
            .u8(b'I')
            .i32(1)
            .u8(b'N')
            .i16(1)
            .u8(b't')
            .i32(10)
            .0;
        let err = decode(&cut).err();
        assert_eq!(err.as_ref().map(|e| e.kind), Some("Insert"));
        assert_eq!(
            err.map(|e| e.offset),
            Some(13),
            "the value starts at byte 13"
        );
        let trailing = W::default().u8(b'B').i64(1).i64(2).i32(3).u8(9).0;
        assert!(decode(&trailing).is_err());
        assert!(decode(&[]).is_err());
        assert!(decode(b"Z").is_err());
        let negative = W::default().u8(b'I').i32(1).u8(b'N').i16(-1).0;
        assert!(decode(&negative).is_err());
        let huge_truncate = W::default().u8(b'T').i32(i32::MAX).u8(0).0;
        assert!(decode(&huge_truncate).is_err());
    }

    #[test]
    fn never_panics_on_arbitrary_bytes() {
        // A deterministic sweep over every prefix of valid messages and
        // pseudo-random mutations of them.
        let seeds: Vec<Vec<u8>> = vec![
            W::default()
                .u8(b'R')
                .i32(1)
                .s("a")
                .s("b")
                .u8(b'f')
                .i16(1)
                .u8(1)
                .s("c")
                .i32(23)
                .i32(-1)
                .0,
            W::default()
                .u8(b'U')
                .i32(1)
                .u8(b'O')
                .i16(1)
                .text("abc")
                .u8(b'N')
                .i16(1)
                .u8(b'u')
                .0,
            W::default().u8(b'T').i32(1).u8(0).i32(5).0,
            W::default().u8(b'M').u8(0).i64(1).s("p").i32(1).u8(b'x').0,
        ];
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        for seed in &seeds {
            for cut in 0..=seed.len() {
                let _ = decode(&seed[..cut]);
            }
            for _ in 0..2000 {
                let mut m = seed.clone();
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let i = (state as usize) % m.len();
                m[i] = (state >> 32) as u8;
                let _ = decode(&m);
            }
        }
    }
}

/// Fuzzing: the decoder never panics, whatever the bytes.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(20_000))]

        #[test]
        fn arbitrary_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn every_message_tag_with_arbitrary_bytes_is_safe(
            tag in proptest::sample::select(b"BCRYIUDTMOKNu".to_vec()),
            rest in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let mut bytes = vec![tag];
            bytes.extend(rest);
            let _ = decode(&bytes);
        }
    }
}
