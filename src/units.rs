//! Sizes as people write them, shared by the daemon's config and the benchmarks.

/// Parses `"1GiB"`, `"512 MiB"`, `"64k"`, `"1g"` or a plain number of bytes (binary multiples).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("bad size {s:?}"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        u => return Err(format!("bad size unit {u:?} in {s:?}")),
    };
    n.checked_mul(1 << shift)
        .ok_or_else(|| format!("size {s:?} overflows"))
}
