//! `kvpool top` as text: a header, a line per node and a totals line, each cut to the
//! terminal's width.

use super::frame::{Frame, Moved, Rates, Use};

/// The column headings.
const HEADINGS: [&str; 14] = [
    "NODE",
    "STATE",
    "ADDRESS",
    "USED",
    "CAP",
    "OBJECTS",
    "HIT%",
    "IN/s",
    "OUT/s",
    "B-IN/s",
    "B-OUT/s",
    "REFUSED/s",
    "EVICT/s",
    "DISK",
];
/// Column widths; a negative one is left-aligned.
const WIDTHS: [i32; 14] = [5, -9, -21, 7, 7, 9, 5, 8, 8, 7, 7, 9, 8, -13];

/// The frame's lines: header, headings, one per node, totals. `clock` is the time of day shown
/// in the header; each line is cut to `width` characters when one is given.
pub(crate) fn lines(f: &Frame, interval_s: f64, clock: &str, width: Option<usize>) -> Vec<String> {
    let t = &f.totals;
    let mut out = vec![format!(
        "kvpool top  {clock}  view {}  nodes {} up {}  every {interval_s} s",
        f.version, t.nodes, t.up
    )];
    let heads: Vec<String> = HEADINGS.iter().map(|h| h.to_string()).collect();
    out.push(row_line(&heads));
    for r in &f.rows {
        let mut cells = vec![r.id.to_string(), r.state.to_string(), r.tcp.clone()];
        cells.extend(use_cells(r.now.as_ref()));
        cells.extend(moved_cells(r.moved.as_ref(), r.moved.map(|m| m.rates())));
        cells.push(disk_cell(r.now.as_ref()));
        if let Some(e) = &r.error {
            cells.push(e.clone());
        }
        out.push(row_line(&cells));
    }
    let any = f.rows.iter().any(|r| r.moved.is_some());
    let mut cells = vec![
        "TOTAL".into(),
        format!("{}/{}", t.up, t.nodes),
        String::new(),
    ];
    cells.extend(use_cells((t.up > 0).then_some(&t.now)));
    cells.extend(moved_cells(any.then_some(&t.moved), any.then_some(t.rates)));
    cells.push(disk_cell(Some(&t.now)));
    out.push(row_line(&cells));
    if let Some(w) = width {
        for l in &mut out {
            cut(l, w);
        }
    }
    out
}

/// Bytes in binary units, to three significant figures: `512B`, `1.50K`, `12.0M`, `3.00G`.
pub(crate) fn human(n: f64) -> String {
    const UNITS: [&str; 6] = ["B", "K", "M", "G", "T", "P"];
    let mut v = n;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0}B")
    } else if v < 10.0 {
        format!("{v:.2}{}", UNITS[u])
    } else if v < 100.0 {
        format!("{v:.1}{}", UNITS[u])
    } else {
        format!("{v:.0}{}", UNITS[u])
    }
}

/// A count per second: whole numbers from 10 on, one decimal below.
fn rate(n: f64) -> String {
    if n >= 10.0 {
        format!("{n:.0}")
    } else {
        format!("{n:.1}")
    }
}

fn use_cells(u: Option<&Use>) -> [String; 3] {
    match u {
        Some(u) => [
            human(u.used as f64),
            human(u.capacity as f64),
            u.objects.to_string(),
        ],
        None => ["-".into(), "-".into(), "-".into()],
    }
}

/// HIT% through EVICT/s.
fn moved_cells(m: Option<&Moved>, r: Option<Rates>) -> Vec<String> {
    let dash = || "-".to_string();
    let (Some(m), Some(r)) = (m, r) else {
        return vec![dash(); 7];
    };
    let hit = m
        .hit_rate()
        .map_or_else(dash, |h| format!("{:.1}", h * 100.0));
    let known = m.traffic.is_some();
    let t = |s: String| if known { s } else { dash() };
    vec![
        hit,
        t(rate(r.ops_in)),
        t(rate(r.ops_out)),
        t(human(r.bytes_in)),
        t(human(r.bytes_out)),
        t(rate(r.refusals)),
        rate(r.evictions),
    ]
}

fn disk_cell(u: Option<&Use>) -> String {
    match u.and_then(|u| u.disk) {
        Some([bytes, capacity, _]) => format!("{}/{}", human(bytes as f64), human(capacity as f64)),
        None => "-".into(),
    }
}

/// The cells laid out in their columns (those past the headings' columns follow, separated by a
/// space).
fn row_line(cells: &[String]) -> String {
    let mut line = String::new();
    for (i, c) in cells.iter().enumerate() {
        if i > 0 {
            line.push(' ');
        }
        match WIDTHS.get(i) {
            Some(&w) if w < 0 => line.push_str(&format!("{c:<0$}", (-w) as usize)),
            Some(&w) => line.push_str(&format!("{c:>0$}", w as usize)),
            None => line.push_str(c),
        }
    }
    line.trim_end().to_string()
}

/// Cuts `line` to `width` characters.
fn cut(line: &mut String, width: usize) {
    if let Some((i, _)) = line.char_indices().nth(width) {
        line.truncate(i);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(human(0.0), "0B");
        assert_eq!(human(1023.0), "1023B");
        assert_eq!(human(1536.0), "1.50K");
        assert_eq!(human(12.5 * 1024.0 * 1024.0), "12.5M");
        assert_eq!(human(300.0 * (1u64 << 30) as f64), "300G");
    }

    #[test]
    fn cut_counts_characters() {
        let mut s = "ab€cd".to_string();
        cut(&mut s, 3);
        assert_eq!(s, "ab€");
        let mut s = "ab".to_string();
        cut(&mut s, 10);
        assert_eq!(s, "ab");
    }
}
