//! The report as JSON, written by hand: the shape is flat and fixed.

use std::fmt::Write as _;

use super::report::{Report, Row};

impl Report {
    /// The report as JSON (no external serializer: the shape is flat and fixed).
    pub(crate) fn to_json(&self, args: &str) -> String {
        let m = &self.machine;
        let mut s = String::from("{\n");
        let _ = writeln!(
            s,
            "  \"machine\": {{\"nproc\": {}, \"cpu\": {}, \"kernel\": {}, \"mem_gib\": {:.1}, \"date\": {}}},",
            m.nproc,
            json_str(&m.cpu),
            json_str(&m.kernel),
            m.mem_gib,
            json_str(&m.date)
        );
        let _ = writeln!(s, "  \"args\": {},", json_str(args));
        s.push_str("  \"rows\": [\n");
        let rows: Vec<String> = self.rows.iter().map(row_json).collect();
        s.push_str(&rows.join(",\n"));
        s.push_str("\n  ],\n  \"notes\": [\n");
        let notes: Vec<String> = self
            .notes
            .iter()
            .map(|(sec, n)| {
                format!(
                    "    {{\"section\": {}, \"note\": {}}}",
                    json_str(sec.name()),
                    json_str(n)
                )
            })
            .collect();
        s.push_str(&notes.join(",\n"));
        s.push_str("\n  ]\n}\n");
        s
    }
}

fn row_json(r: &Row) -> String {
    let num = |v: Option<f64>| {
        v.map_or("null".into(), |v| {
            if v.is_finite() {
                format!("{v:.4}")
            } else {
                "null".into()
            }
        })
    };
    let int = |v: Option<u64>| v.map_or("null".into(), |v| v.to_string());
    let refs: Vec<String> = r
        .refs
        .iter()
        .map(|f| {
            let met = f
                .target
                .map_or("null".into(), |t| (f.ratio >= t).to_string());
            format!(
                "{{\"reference\": {}, \"ratio\": {}, \"target\": {}, \"met\": {}}}",
                json_str(&f.name),
                num(Some(f.ratio)),
                num(f.target),
                met
            )
        })
        .collect();
    format!(
        "    {{\"section\": {}, \"system\": {}, \"op\": {}, \"size\": {}, \"conns\": {}, \"depth\": {}, \"gbps\": {}, \"ops_per_s\": {}, \"p50_ns\": {}, \"p99_ns\": {}, \"objects\": {}, \"bytes_per_object\": {}, \"refs\": [{}]}}",
        json_str(r.section.name()),
        json_str(&r.system),
        json_str(&r.op),
        int(r.size),
        int(r.conns.map(|c| c as u64)),
        int(r.depth.map(|d| d as u64)),
        num(r.gbps),
        num(r.ops_per_s),
        num(r.p50_ns),
        num(r.p99_ns),
        int(r.objects),
        num(r.bytes_per_object),
        refs.join(", ")
    )
}

/// A JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
