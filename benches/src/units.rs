//! Parsing and printing sizes, rates and durations.

/// Parses `64KiB`, `2MiB`, `1GiB`, `4096`, `64K`, `2M` (binary multiples), refusing zero.
pub fn parse_size(s: &str) -> Result<u64, String> {
    Some(kvpool::units::parse_size(s)?)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("{s:?}: size must be positive"))
}

/// `65536` → `64KiB`, `2097152` → `2MiB`; other values in bytes.
pub fn fmt_size(n: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if n >= 1 << shift && n % (1 << shift) == 0 {
            return format!("{}{unit}", n >> shift);
        }
    }
    format!("{n}B")
}

/// Operations per second with a k/M suffix.
pub fn fmt_rate(r: f64) -> String {
    if r >= 1e6 {
        format!("{:.2}M", r / 1e6)
    } else if r >= 1e3 {
        format!("{:.1}k", r / 1e3)
    } else {
        format!("{r:.0}")
    }
}

/// Nanoseconds as µs or ms.
pub fn fmt_ns(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2}ms", ns / 1e6)
    } else if ns >= 1e4 {
        format!("{:.0}µs", ns / 1e3)
    } else {
        format!("{:.1}µs", ns / 1e3)
    }
}
