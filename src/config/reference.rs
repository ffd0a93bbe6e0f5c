//! The configuration reference (`pgcdc reference`, and the README's
//! "Configuration reference"), generated from the config types' own
//! source: their doc comments, serde attributes and defaults.
//!
//! Guarantee: every key the parser accepts is listed, with its type, its
//! default (taken from what serde fills in, not copied by hand) and its
//! doc comment; a key without a doc comment fails [`markdown`]'s tests,
//! and a README that differs from [`markdown`] fails the integration test.
//!
//! ```text
//!  include_str!(config/mod.rs) ──► structs, fields, enums (docs, serde attrs)
//!  sample TOML ──► Config (serde defaults) ──► JSON ──► default per key
//!                                   └──► markdown: one table per section
//! ```

use std::collections::BTreeMap;
use std::fmt::Write;

const SOURCE: &str = include_str!("mod.rs");

/// Only required keys: serde fills in every default, which is what the
/// reference shows. One entry per map so that their sections have values.
const SAMPLE: &str = r#"
name = "n"
[source]
url = "postgres://localhost/db"
slot = "s"
publication = "p"
tables = ["public.t"]
[kafka]
brokers = "localhost:9092"
topic_prefix = "p"
[registry]
url = "http://localhost:8081"
[target]
url = "postgres://localhost/target"
[target.tenant_quota]
rate_per_sec = 100.0
[read_models.NAME]
table = "read_models.t"
key = ["id"]
query = "SELECT 1"
sources = [{ table = "public.t" }]
[dlq.policies.NAME]
action = "archive"
[dlq.mappings.TABLE]
[outbox.TABLE]
[partitioning.TABLE]
salt_shards = 8
[source.columns.TABLE]
exclude = ["c"]
"#;

#[derive(Debug, Default)]
struct Field {
    key: String,
    ty: String,
    docs: String,
    has_default: bool,
}

#[derive(Debug, Default)]
struct Struct {
    docs: String,
    fields: Vec<Field>,
}

#[derive(Debug, Default)]
struct Enum {
    /// Serialized names.
    variants: Vec<String>,
}

#[derive(Debug, Default)]
struct Types {
    structs: BTreeMap<String, Struct>,
    enums: BTreeMap<String, Enum>,
}

/// The `#[serde(rename = "...")]` or `rename_all` value in `attrs`.
fn serde_arg(attrs: &[String], arg: &str) -> Option<String> {
    attrs.iter().find_map(|a| {
        let inner = a.strip_prefix("#[serde(")?;
        let at = inner.find(&format!("{arg} = \""))? + arg.len() + 4;
        let rest = &inner[at..];
        Some(rest[..rest.find('"')?].to_string())
    })
}

fn join_docs(lines: &[String]) -> String {
    lines
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

fn snake_case(ident: &str) -> String {
    let mut out = String::new();
    for (i, c) in ident.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.extend(c.to_lowercase());
    }
    out
}

/// Reads the config module's struct and enum declarations: line-based,
/// for this module's own (rustfmt) layout.
fn parse(source: &str) -> Types {
    enum In {
        Nothing,
        Struct(String),
        Enum(String, Option<String>),
    }
    let mut types = Types::default();
    let (mut docs, mut attrs): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    let mut inside = In::Nothing;
    for raw in source.lines() {
        if raw.starts_with("#[cfg(test)]") {
            break;
        }
        let line = raw.trim();
        if let Some(d) = line.strip_prefix("///") {
            docs.push(d.to_string());
            continue;
        }
        if line.starts_with("#[") {
            attrs.push(line.to_string());
            continue;
        }
        if raw == "}" {
            inside = In::Nothing;
        } else if let Some(rest) = raw.strip_prefix("pub struct ") {
            if let Some(name) = rest.strip_suffix(" {") {
                types.structs.insert(
                    name.to_string(),
                    Struct {
                        docs: join_docs(&docs),
                        fields: Vec::new(),
                    },
                );
                inside = In::Struct(name.to_string());
            }
        } else if let Some(rest) = raw.strip_prefix("pub enum ") {
            if let Some(name) = rest.strip_suffix(" {") {
                types.enums.insert(name.to_string(), Enum::default());
                inside = In::Enum(name.to_string(), serde_arg(&attrs, "rename_all"));
            }
        } else {
            match &inside {
                In::Struct(name) => {
                    if let Some((key, ty)) = line
                        .strip_prefix("pub ")
                        .and_then(|f| f.strip_suffix(','))
                        .and_then(|f| f.split_once(": "))
                    {
                        let field = Field {
                            key: serde_arg(&attrs, "rename").unwrap_or_else(|| key.to_string()),
                            ty: ty.to_string(),
                            docs: join_docs(&docs),
                            has_default: attrs.iter().any(|a| a.starts_with("#[serde(default")),
                        };
                        if let Some(s) = types.structs.get_mut(name) {
                            s.fields.push(field);
                        }
                    }
                }
                In::Enum(name, rename_all) => {
                    if let Some(ident) = line
                        .strip_suffix(',')
                        .filter(|v| v.chars().all(|c| c.is_alphanumeric()) && !v.is_empty())
                    {
                        let shown = serde_arg(&attrs, "rename").unwrap_or_else(|| match rename_all
                            .as_deref()
                        {
                            Some("lowercase") => ident.to_lowercase(),
                            Some("snake_case") => snake_case(ident),
                            _ => ident.to_string(),
                        });
                        if let Some(e) = types.enums.get_mut(name) {
                            e.variants.push(shown);
                        }
                    }
                }
                In::Nothing => {}
            }
        }
        docs.clear();
        attrs.clear();
    }
    types
}

/// `Outer<Inner>` → `Inner`.
fn inner<'a>(ty: &'a str, outer: &str) -> Option<&'a str> {
    ty.strip_prefix(outer)?.strip_prefix('<')?.strip_suffix('>')
}

impl Types {
    fn type_name(&self, ty: &str) -> String {
        if let Some(t) = inner(ty, "Option") {
            return self.type_name(t);
        }
        if let Some(t) = inner(ty, "Vec") {
            return format!("array of {}", self.plural(t));
        }
        if let Some(t) = inner(ty, "BTreeMap").and_then(|kv| kv.strip_prefix("String, ")) {
            return format!("table of {}", self.plural(t));
        }
        if let Some(e) = self.enums.get(ty) {
            return e
                .variants
                .iter()
                .map(|v| format!("`\"{v}\"`"))
                .collect::<Vec<_>>()
                .join(" \\| ");
        }
        match ty {
            "String" => "string",
            "bool" => "boolean",
            "f64" => "number",
            "u32" | "u64" | "usize" | "i32" | "i64" => "integer",
            "Dsn" => "connection string (its password never prints)",
            "Secret" => "string (never printed)",
            "Properties" => "table of strings (librdkafka properties; secrets never print)",
            other => other,
        }
        .to_string()
    }

    fn plural(&self, ty: &str) -> String {
        match ty {
            "String" => "strings".into(),
            other => self.type_name(other),
        }
    }

    /// The struct a field opens as a section: `(struct, kind)` where kind
    /// is `table`, `map` (a table per name) or `array` (array of tables).
    fn section<'a>(&self, ty: &'a str) -> Option<(&'a str, &'static str)> {
        let ty = inner(ty, "Option").unwrap_or(ty);
        if self.structs.contains_key(ty) {
            return Some((ty, "table"));
        }
        if let Some(t) = inner(ty, "BTreeMap").and_then(|kv| kv.strip_prefix("String, ")) {
            return self.structs.contains_key(t).then_some((t, "map"));
        }
        inner(ty, "Vec")
            .filter(|t| self.structs.contains_key(*t))
            .map(|t| (t, "array"))
    }
}

/// A serde default as TOML.
fn toml_value(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => format!("\"{s}\""),
        serde_json::Value::Array(a) => {
            format!(
                "[{}]",
                a.iter().map(toml_value).collect::<Vec<_>>().join(", ")
            )
        }
        serde_json::Value::Object(o) if o.is_empty() => "{}".into(),
        other => other.to_string(),
    }
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

struct Writer<'a> {
    types: &'a Types,
    out: String,
    /// Keys without a doc comment (the tests refuse them).
    undocumented: Vec<String>,
}

impl Writer<'_> {
    /// One section: its table of keys, then its sub-sections. `heading`
    /// is how TOML names it, `intro` the doc of the field that opens it,
    /// `sample` its value in the sample.
    fn section(
        &mut self,
        name: &str,
        heading: &str,
        intro: &str,
        path: &str,
        sample: &serde_json::Value,
    ) {
        let types = self.types;
        let s = &types.structs[name];
        let _ = writeln!(self.out, "### `{heading}`\n");
        for text in [intro, &s.docs] {
            if !text.is_empty() {
                let _ = writeln!(self.out, "{text}\n");
            }
        }
        if intro.is_empty() && s.docs.is_empty() {
            self.undocumented.push(heading.to_string());
        }
        let leaves: Vec<&Field> = s
            .fields
            .iter()
            .filter(|f| types.section(&f.ty).is_none())
            .collect();
        if !leaves.is_empty() {
            self.out
                .push_str("| key | type | default | |\n|---|---|---|---|\n");
            for f in leaves {
                let default = if f.ty.starts_with("Option<") {
                    "unset".to_string()
                } else if !f.has_default {
                    "**required**".to_string()
                } else {
                    sample
                        .get(&f.key)
                        .map(|v| format!("`{}`", cell(&toml_value(v))))
                        .unwrap_or_else(|| "unset".into())
                };
                if f.docs.is_empty() {
                    self.undocumented.push(format!("{path}{}", f.key));
                }
                let _ = writeln!(
                    self.out,
                    "| `{}` | {} | {default} | {} |",
                    f.key,
                    types.type_name(&f.ty),
                    cell(&f.docs)
                );
            }
            self.out.push('\n');
        }
        for f in &s.fields {
            let Some((child, kind)) = types.section(&f.ty) else {
                continue;
            };
            let value = sample.get(&f.key).cloned().unwrap_or_default();
            let (heading, path, value) = match kind {
                "map" => {
                    let placeholder = if f.docs.contains("schema.table") {
                        "\"<schema.table>\""
                    } else {
                        "<name>"
                    };
                    let first = value
                        .as_object()
                        .and_then(|o| o.values().next().cloned())
                        .unwrap_or_default();
                    (
                        format!("[{path}{}.{placeholder}]", f.key),
                        format!("{path}{}.{placeholder}.", f.key),
                        first,
                    )
                }
                "array" => (
                    format!("[[{path}{}]]", f.key),
                    format!("{path}{}[].", f.key),
                    value.get(0).cloned().unwrap_or_default(),
                ),
                _ => (
                    format!("[{path}{}]", f.key),
                    format!("{path}{}.", f.key),
                    value,
                ),
            };
            self.section(child, &heading, &f.docs, &path, &value);
        }
    }
}

/// The reference as markdown, and the keys it found without a doc comment.
fn generate() -> (String, Vec<String>) {
    let types = parse(SOURCE);
    let sample: super::Config = toml::from_str(SAMPLE).expect("the reference's sample parses");
    let sample = serde_json::to_value(&sample).expect("the sample serializes");
    let mut w = Writer {
        types: &types,
        out: String::new(),
        undocumented: Vec::new(),
    };
    w.out.push_str(
        "Generated from the config types' doc comments by `pgcdc reference`; a test fails \
         when this section and the code differ. Unknown keys are errors. Any value may be \
         `${VAR}` (from the environment), and `PGCDC__SECTION__KEY=value` overrides a key \
         by path (`PGCDC__SOURCE__SLOT=other`).\n\n",
    );
    w.section("Config", "(top level)", "", "", &sample);
    (w.out.trim_end().to_string() + "\n", w.undocumented)
}

/// The configuration reference, as markdown.
pub fn markdown() -> String {
    generate().0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's copy, between its markers, is this reference.
    #[test]
    fn the_readme_carries_this_reference() {
        let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"));
        let (start, end) = (
            "<!-- config-reference:start (pgcdc reference) -->\n",
            "<!-- config-reference:end -->",
        );
        let copy = readme
            .split_once(start)
            .and_then(|(_, rest)| rest.split_once(end))
            .map(|(copy, _)| copy)
            .expect("the README has the reference's markers");
        assert!(
            copy == markdown(),
            "the README's configuration reference is stale: run `pgcdc reference` and paste it between the markers"
        );
    }

    #[test]
    fn every_key_has_a_doc_comment() {
        let (_, undocumented) = generate();
        assert!(
            undocumented.is_empty(),
            "keys without a doc comment: {undocumented:?}"
        );
    }

    #[test]
    fn sections_keys_types_and_defaults_come_from_the_code() {
        let md = markdown();
        for needle in [
            "### `[source]`",
            "### `[source.snapshot]`",
            "### `[read_models.<name>]`",
            "### `[[read_models.<name>.sources]]`",
            "### `[outbox.\"<schema.table>\"]`",
            "### `[dlq.health]`",
            "| `slot` | string | **required** |",
            "| `tables` | array of strings | **required** |",
            "| `stall_warning_secs` | integer | `300` |",
            "| `retained_wal_warning_bytes` | integer | `1073741824` |",
            "| `mode` | `\"initial\"` \\| `\"never\"` \\| `\"always\"` | `\"initial\"` |",
            "| `cleanup_policy` | `\"delete\"` \\| `\"compact\"` \\| `\"compact,delete\"` | `\"delete\"` |",
            "| `on_redis_failure` | `\"fail_closed\"` \\| `\"fail_open\"` | unset |",
            "| `max_oldest_age` | string | `\"24h\"` |",
        ] {
            assert!(md.contains(needle), "{needle} not in:\n{md}");
        }
    }

    #[test]
    fn every_field_the_parser_accepts_is_listed() {
        // Each struct's field count, read independently of the parser:
        // serde's own error lists the expected fields of an unknown key.
        for (section, toml) in [
            ("source", "[source]\nbogus = 1"),
            ("kafka", "[kafka]\nbogus = 1"),
            ("target", "[target]\nbogus = 1"),
        ] {
            let text = SAMPLE.replace(&format!("[{section}]\n"), &format!("{toml}\n"));
            let err = toml::from_str::<super::super::Config>(&text)
                .expect_err("an unknown key")
                .to_string();
            let expected: Vec<&str> = err
                .split("expected one of ")
                .nth(1)
                .unwrap_or_default()
                .split(", ")
                .map(|k| k.trim().trim_matches('`'))
                .collect();
            assert!(!expected.is_empty(), "{err}");
            let md = markdown();
            for key in expected {
                let key = key.split('`').next().unwrap_or(key);
                assert!(
                    md.contains(&format!("| `{key}` |"))
                        || md.contains(&format!(".{key}]"))
                        || md.contains(&format!(".{key}.\"<schema.table>\"]")),
                    "{section}.{key} missing"
                );
            }
        }
    }
}
