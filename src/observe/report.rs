//! `pgcdc status`: a running process's `/status`, as text for a terminal.
//!
//! Guarantee: it shows what `/status` says, fetched once; it changes
//! nothing.
//!
//! ```text
//!  pgcdc status ──GET /status──► running connector or materializer ──► text
//! ```

use std::fmt::Write;

use serde_json::Value as Json;

/// Fetches `/status` from the admin server at `addr`.
pub async fn fetch(addr: &str) -> Result<Json, String> {
    let url = format!("http://{addr}/status");
    let response = reqwest::Client::new()
        .get(&url)
        .timeout(std::time::Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| {
            format!("cannot reach {url}: {e} (is `pgcdc run --http-addr {addr}` running?)")
        })?;
    if !response.status().is_success() {
        return Err(format!("{url} answered {}", response.status()));
    }
    response
        .json()
        .await
        .map_err(|e| format!("{url}: not a status document: {e}"))
}

fn num(v: &Json) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

/// The status as lines of text.
pub fn text(status: &Json) -> String {
    let mut out = String::new();
    let s = |k: &str| status[k].as_str().unwrap_or("?").to_string();
    let _ = writeln!(
        out,
        "{} {}: {} ({}), up {} s",
        s("role"),
        s("pipeline"),
        s("phase"),
        if status["ready"].as_bool() == Some(true) {
            "ready"
        } else {
            "not ready"
        },
        num(&status["uptime_secs"])
    );
    if let Some(slot) = status["slot"].as_object() {
        let _ = writeln!(
            out,
            "slot {}: confirmed {}, lag {} bytes, retained WAL {} bytes",
            slot["slot"].as_str().unwrap_or("?"),
            slot["confirmed_lsn"].as_str().unwrap_or("—"),
            num(&slot["lag_bytes"]),
            num(&slot["retained_wal_bytes"]),
        );
    }
    let tables = status["tables"].as_array().cloned().unwrap_or_default();
    if !tables.is_empty() {
        let _ = writeln!(out, "\n{:<40} {:>12} {:>14}", "table", "events/s", "events");
        for t in &tables {
            let _ = writeln!(
                out,
                "{:<40} {:>12.1} {:>14}",
                t["table"].as_str().unwrap_or("?"),
                num(&t["events_per_sec"]),
                num(&t["events_total"]),
            );
        }
        let hot: Vec<(&str, &Json)> = tables
            .iter()
            .flat_map(|t| {
                let name = t["table"].as_str().unwrap_or("?");
                t["hot_keys"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(move |k| (name, k))
            })
            .collect();
        if hot.is_empty() {
            out.push_str("\nhot keys: none at or above hot_keys.report_per_sec\n");
        } else {
            let _ = writeln!(
                out,
                "\nhot keys\n{:<30} {:<24} {:>10} {:>6} salted",
                "table", "key", "changes/s", "share"
            );
            for (table, k) in hot {
                let _ = writeln!(
                    out,
                    "{:<30} {:<24} {:>10.0} {:>5.0}% {}",
                    table,
                    k["key"].as_str().unwrap_or("?"),
                    num(&k["rate_per_sec"]),
                    num(&k["share"]) * 100.0,
                    if k["salted"].as_bool() == Some(true) {
                        "yes"
                    } else {
                        "no"
                    },
                );
            }
        }
    }
    for m in status["read_models"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "{} {}: lag {}, applied {:.1}/s",
            m["kind"].as_str().unwrap_or("?"),
            m["name"].as_str().unwrap_or("?"),
            num(&m["consumer_lag"]),
            num(&m["applied_per_sec"]),
        );
    }
    let firing: Vec<&str> = status["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|a| a["firing"].as_bool() == Some(true))
        .filter_map(|a| a["alert"].as_str())
        .collect();
    let _ = writeln!(
        out,
        "\nalerts firing: {}",
        if firing.is_empty() {
            "none".to_string()
        } else {
            firing.join(", ")
        }
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_keys_and_firing_alerts_are_listed() {
        let status = serde_json::json!({
            "role": "connector", "pipeline": "demo", "phase": "streaming", "ready": true,
            "uptime_secs": 12,
            "tables": [{"table": "public.orders", "events_per_sec": 900.0, "events_total": 5000.0,
                        "hot_keys": [{"key": "42", "rate_per_sec": 450.0, "share": 0.5, "salted": true}]}],
            "read_models": [],
            "alerts": [{"alert": "slot_stalled", "firing": true}, {"alert": "slot_wal_at_risk", "firing": false}]
        });
        let text = text(&status);
        assert!(text.contains("connector demo: streaming (ready)"), "{text}");
        let line = text.lines().find(|l| l.contains(" 42 ")).expect(&text);
        assert!(line.starts_with("public.orders"), "{line}");
        assert!(
            line.contains("450") && line.contains("50%") && line.ends_with("yes"),
            "{line}"
        );
        assert!(text.contains("alerts firing: slot_stalled\n"), "{text}");
    }
}
