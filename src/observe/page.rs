//! The status page: one self-contained HTML document rendered on the
//! server from a [`Status`], its plots inline SVG.
//!
//! Guarantee: the page loads nothing from anywhere (no CDN, no font, no
//! image, no stylesheet by URL); its only script fetches `/` again every
//! few seconds and swaps the body in. Every text that comes from the
//! pipeline (table, read-model and slot names) is HTML-escaped. Row values
//! never reach it: it is built from metrics alone.

use std::fmt::Write;

use super::board::{DeadLetterStatus, ReadModelStatus, Role, SlotStatus, Status, TableStatus};

/// Seconds between the page's refreshes.
pub const REFRESH_SECS: u64 = 2;

const STYLE: &str = "body{font:14px system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}\
h1{font-size:1.4em;margin:0 0 .2em}h2{font-size:1.1em;margin:1.4em 0 .4em}\
table{border-collapse:collapse;background:#fff}td,th{padding:.35em .7em;border-bottom:1px solid #e4e4e4;text-align:left;vertical-align:middle}\
th{font-weight:600;color:#555}.num{text-align:right;font-variant-numeric:tabular-nums}\
.ok{color:#17803d}.warn{color:#b42318;font-weight:600}.muted{color:#888}\
.banner{background:#fdecea;border:1px solid #f5c2c0;padding:.6em .9em;margin:.8em 0;border-radius:4px}\
.phase{display:inline-block;padding:.1em .6em;border-radius:1em;background:#e8eef9}.phase.ready{background:#dcf5e3}\
svg.plot{background:#fff;border:1px solid #e4e4e4}svg.plot polyline{fill:none;stroke:#2563eb;stroke-width:1.5}\
svg.plot.alarm polyline{stroke:#b42318}.bar{width:8em;height:.7em;background:#e4e4e4;display:inline-block}\
.bar span{display:block;height:100%;background:#2563eb}";

/// Renders the whole page.
pub fn render(s: &Status) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let role = match s.role {
        Role::Connector => "connector",
        Role::Materializer => "materializer",
    };
    let _ = write!(
        out,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>pgcdc {role}: {pipeline}</title><style>{STYLE}</style></head><body>",
        pipeline = esc(&s.pipeline)
    );
    body(&mut out, s, role);
    let _ = write!(
        out,
        "<script>\
         setInterval(async()=>{{try{{const r=await fetch(location.pathname,{{cache:'no-store'}});\
         if(r.ok){{const d=new DOMParser().parseFromString(await r.text(),'text/html');\
         document.body.innerHTML=d.body.innerHTML;}}}}catch(e){{\
         document.getElementById('phase').textContent='unreachable';}}}},{});\
         </script></body></html>",
        REFRESH_SECS * 1000
    );
    out
}

fn body(out: &mut String, s: &Status, role: &str) {
    let _ = write!(
        out,
        "<h1>pgcdc {role} <span class=\"muted\">{}</span></h1>\
         <div>phase <span id=\"phase\" class=\"phase{}\" data-ready=\"{}\">{}</span> \
         <span class=\"muted\">up {} · a sample every {} s, {} kept · refreshes every {REFRESH_SECS} s</span></div>",
        esc(&s.pipeline),
        if s.ready { " ready" } else { "" },
        s.ready,
        s.phase.as_str(),
        span(s.uptime_secs as f64),
        s.sample_every_secs,
        s.samples,
    );
    let firing: Vec<_> = s.alerts.iter().filter(|a| a.firing).collect();
    for a in &firing {
        let _ = write!(
            out,
            "<div class=\"banner\" data-alert=\"{}\"><b>alert: {}</b> · {} · see the README's “{}”</div>",
            a.alert,
            a.alert,
            esc(a.condition),
            esc(a.runbook)
        );
    }
    if let Some(slot) = &s.slot {
        slot_section(out, slot);
    }
    if !s.tables.is_empty() {
        tables_section(out, &s.tables);
    }
    if !s.read_models.is_empty() {
        models_section(out, &s.read_models);
    }
    if let Some(d) = &s.dead_letters {
        dead_letter_section(out, d);
    }
    out.push_str("<h2>Alerts</h2><table><tr><th>alert</th><th>state</th><th>condition</th></tr>");
    for a in &s.alerts {
        let _ = write!(
            out,
            "<tr data-alert-row=\"{}\"><td>{}</td><td class=\"{}\">{}</td><td>{}</td></tr>",
            a.alert,
            a.alert,
            if a.firing { "warn" } else { "ok" },
            if a.firing { "firing" } else { "ok" },
            esc(a.condition)
        );
    }
    out.push_str("</table>");
}

fn slot_section(out: &mut String, slot: &SlotStatus) {
    let _ = write!(out, "<h2>Slot <code>{}</code></h2>", esc(&slot.slot));
    if slot.stalled {
        out.push_str("<div class=\"banner\" id=\"stall-warning\">The slot is stalling: its confirmed LSN has not moved while WAL grows, and Postgres keeps that WAL.</div>");
    }
    let _ = write!(
        out,
        "<table><tr><th>confirmed LSN</th><td class=\"num\" data-figure=\"confirmed_lsn\">{}</td></tr>\
         <tr><th>lag</th><td class=\"num\" data-figure=\"lag_bytes\">{}</td></tr>\
         <tr><th>retained WAL</th><td class=\"num\" data-figure=\"retained_wal_bytes\">{}</td><td>{}</td></tr></table>",
        slot.confirmed_lsn.as_deref().map_or("—".to_string(), esc),
        slot.lag_bytes.map_or("—".into(), bytes),
        slot.retained_wal_bytes.map_or("—".into(), bytes),
        plot("retained_wal", &slot.retained_wal_history, slot.wal_at_risk || slot.stalled),
    );
}

fn tables_section(out: &mut String, tables: &[TableStatus]) {
    out.push_str(
        "<h2>Tables</h2><table><tr><th>table</th><th>events/s</th><th>last minutes</th>\
         <th>events</th><th>snapshot</th></tr>",
    );
    for t in tables {
        let snapshot = match t.snapshot_rows_estimated {
            Some(est) if est > 0.0 || t.snapshot_rows > 0.0 => {
                let frac = if est > 0.0 {
                    (t.snapshot_rows / est).min(1.0)
                } else {
                    1.0
                };
                format!(
                    "<span class=\"bar\"><span style=\"width:{:.0}%\"></span></span> {} of ~{} rows",
                    frac * 100.0,
                    count(t.snapshot_rows),
                    count(est)
                )
            }
            _ if t.snapshot_rows > 0.0 => format!("{} rows", count(t.snapshot_rows)),
            _ => "<span class=\"muted\">none this run</span>".into(),
        };
        let _ = write!(
            out,
            "<tr data-table=\"{name}\"><td>{name}</td><td class=\"num\" data-figure=\"events_per_sec\">{}</td>\
             <td>{}</td><td class=\"num\" data-figure=\"events_total\">{}</td><td data-figure=\"snapshot\">{snapshot}</td></tr>",
            rate(t.events_per_sec),
            plot("events", &t.events_per_sec_history, false),
            count(t.events_total),
            name = esc(&t.table),
        );
    }
    out.push_str("</table>");
    hot_keys_section(out, tables);
}

/// Keys at or above `hot_keys.report_per_sec`; nothing when none is.
fn hot_keys_section(out: &mut String, tables: &[TableStatus]) {
    if tables.iter().all(|t| t.hot_keys.is_empty()) {
        return;
    }
    out.push_str(
        "<h2>Hot keys</h2><table><tr><th>table</th><th>key</th><th>changes/s</th>\
         <th>share</th><th>salted</th></tr>",
    );
    for t in tables {
        for k in &t.hot_keys {
            let _ = write!(
                out,
                "<tr data-hot-key=\"{key}\"><td>{table}</td><td><code>{key}</code></td>\
                 <td class=\"num\">{}</td><td class=\"num\">{:.0}%</td><td>{}</td></tr>",
                rate(k.rate_per_sec),
                k.share * 100.0,
                if k.salted { "yes" } else { "no" },
                key = esc(&k.key),
                table = esc(&t.table),
            );
        }
    }
    out.push_str("</table>");
}

fn models_section(out: &mut String, models: &[ReadModelStatus]) {
    out.push_str(
        "<h2>Read models</h2><table><tr><th>read model</th><th>consumer lag</th><th></th>\
         <th>applied/s</th><th></th><th>duplicates skipped/s</th><th></th><th>rebuild reach</th></tr>",
    );
    for m in models {
        let reach = match m.reach_requirement_met {
            Some(true) => "<span class=\"ok\">met</span>",
            Some(false) => "<span class=\"warn\">short</span>",
            None => "<span class=\"muted\">—</span>",
        };
        let _ = write!(
            out,
            "<tr data-read-model=\"{name}\"><td>{name} <span class=\"muted\">{} · {}</span></td>\
             <td class=\"num\" data-figure=\"consumer_lag\">{}</td><td>{}</td>\
             <td class=\"num\" data-figure=\"applied_per_sec\">{}</td><td>{}</td>\
             <td class=\"num\" data-figure=\"duplicates_per_sec\">{}</td><td>{}</td><td>{reach}</td></tr>",
            m.kind,
            esc(&m.tables.join(", ")),
            count(m.consumer_lag),
            plot("lag", &m.consumer_lag_history, false),
            rate(m.applied_per_sec),
            plot("applied", &m.applied_per_sec_history, false),
            rate(m.duplicates_per_sec),
            plot("duplicates", &m.duplicates_per_sec_history, false),
            name = esc(&m.name),
        );
    }
    out.push_str("</table>");
}

fn dead_letter_section(out: &mut String, d: &DeadLetterStatus) {
    let opt = |v: Option<f64>, f: fn(f64) -> String| v.map_or("—".to_string(), f);
    let _ = write!(
        out,
        "<h2>Dead letters</h2><table>\
         <tr><th>open</th><td class=\"num\" data-figure=\"dlq_open\">{}</td></tr>\
         <tr><th>oldest open</th><td class=\"num\" data-figure=\"dlq_oldest\">{}</td></tr>\
         <tr><th>replay success</th><td class=\"num\" data-figure=\"dlq_replay_success\">{}</td></tr>\
         <tr><th>arrivals, last hour</th><td class=\"num\" data-figure=\"dlq_arrivals\">{}</td><td>{}</td></tr>\
         <tr><th>baseline per hour</th><td class=\"num\" data-figure=\"dlq_baseline\">{}</td></tr></table>",
        count(d.open),
        if d.open > 0.0 {
            opt(d.oldest_open_age_secs, span)
        } else {
            "none".into()
        },
        opt(d.replay_success_ratio, |r| format!("{:.0}%", r * 100.0)),
        opt(d.arrivals_last_hour, count),
        plot("dlq_arrivals", &d.arrivals_history, false),
        opt(d.arrival_baseline_per_hour, |b| format!("{b:.1}")),
    );
}

/// A sparkline of `values` (oldest first), scaled to its own maximum.
pub fn plot(series: &str, values: &[f64], alarm: bool) -> String {
    const W: f64 = 180.0;
    const H: f64 = 36.0;
    let max = values.iter().copied().fold(0.0_f64, f64::max);
    let n = values.len();
    let mut points = String::new();
    for (i, v) in values.iter().enumerate() {
        let x = if n > 1 {
            i as f64 * W / (n - 1) as f64
        } else {
            W
        };
        let y = if max > 0.0 {
            H - 2.0 - (v / max) * (H - 4.0)
        } else {
            H - 2.0
        };
        let _ = write!(points, "{x:.1},{y:.1} ");
    }
    format!(
        "<svg class=\"plot{}\" data-series=\"{series}\" data-points=\"{n}\" data-max=\"{max}\" \
         width=\"{W}\" height=\"{H}\" viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"{series}, max {}\">\
         <polyline points=\"{}\"/></svg>",
        if alarm { " alarm" } else { "" },
        compact(max),
        points.trim_end()
    )
}

fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn compact(v: f64) -> String {
    match v.abs() {
        a if a >= 1e9 => format!("{:.1}G", v / 1e9),
        a if a >= 1e6 => format!("{:.1}M", v / 1e6),
        a if a >= 1e4 => format!("{:.1}k", v / 1e3),
        _ => format!("{v:.0}"),
    }
}

fn count(v: f64) -> String {
    compact(v)
}

fn rate(v: f64) -> String {
    if v > 0.0 && v < 10.0 {
        format!("{v:.1}")
    } else {
        compact(v)
    }
}

fn bytes(v: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut unit = 0;
    while v.abs() >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

fn span(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{:02}h", s / 86400, s % 86400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::super::board::{AlertStatus, Phase};
    use super::*;

    fn status() -> Status {
        Status {
            role: Role::Connector,
            pipeline: "demo<script>".into(),
            phase: Phase::Streaming,
            ready: true,
            uptime_secs: 75,
            sample_every_secs: 2,
            samples: 3,
            tables: vec![TableStatus {
                table: "public.\"odd&name\"".into(),
                events_total: 1234.0,
                events_per_sec: 50.0,
                events_per_sec_history: vec![0.0, 50.0, 100.0],
                snapshot_rows: 50.0,
                snapshot_rows_estimated: Some(100.0),
                hot_keys: vec![super::super::board::HotKeyStatus {
                    key: "42<".into(),
                    rate_per_sec: 900.0,
                    share: 0.5,
                    salted: true,
                }],
                salted_events_total: 10.0,
            }],
            slot: Some(SlotStatus {
                slot: "pgcdc_demo".into(),
                confirmed_lsn: Some("0/16B3748".into()),
                lag_bytes: Some(2048.0),
                retained_wal_bytes: Some(3.0 * 1024.0 * 1024.0),
                retained_wal_history: vec![1.0, 2.0],
                stalled: true,
                wal_at_risk: false,
            }),
            read_models: vec![],
            dead_letters: None,
            alerts: vec![AlertStatus {
                alert: "slot_stalled",
                firing: true,
                condition: "the confirmed LSN stands still",
                runbook: "Runbook: a slot stall",
            }],
        }
    }

    #[test]
    fn the_page_is_self_contained_and_escapes_names() {
        let page = render(&status());
        for external in ["src=", "href=", "@import", "url("] {
            assert!(!page.contains(external), "the page references {external}");
        }
        assert!(page.contains("demo&lt;script&gt;"));
        assert!(!page.contains("demo<script>"));
        assert!(page.contains("public.&quot;odd&amp;name&quot;"));
    }

    #[test]
    fn the_page_shows_plots_figures_progress_and_a_stall_warning() {
        let page = render(&status());
        assert!(page.contains("data-series=\"events\" data-points=\"3\" data-max=\"100\""));
        assert!(page.contains("data-series=\"retained_wal\""));
        assert!(page.contains("<td class=\"num\" data-figure=\"lag_bytes\">2.0 KiB</td>"));
        assert!(page.contains("0/16B3748"));
        assert!(page.contains("width:50%"), "snapshot progress at half");
        assert!(page.contains("id=\"stall-warning\""));
        assert!(page.contains("data-alert=\"slot_stalled\""));
        assert!(
            page.contains("<tr data-hot-key=\"42&lt;\">"),
            "hot keys, escaped"
        );
        assert!(page.contains("<td class=\"num\">50%</td><td>yes</td>"));
        assert!(
            page.contains("class=\"plot alarm\""),
            "the WAL plot turns red on a stall"
        );
    }

    #[test]
    fn a_plot_scales_to_its_maximum() {
        let svg = plot("x", &[0.0, 5.0, 10.0], false);
        assert!(
            svg.contains("points=\"0.0,34.0 90.0,18.0 180.0,2.0\""),
            "{svg}"
        );
        let flat = plot("x", &[], false);
        assert!(flat.contains("data-points=\"0\""), "{flat}");
    }
}
