//! What machine and when: printed at the top of every run and stored in the JSON.

use std::time::{SystemTime, UNIX_EPOCH};

/// The machine a run happened on.
#[derive(Clone, Debug)]
pub(crate) struct Machine {
    /// CPUs this process may use.
    pub(crate) nproc: usize,
    /// `model name` from /proc/cpuinfo.
    pub(crate) cpu: String,
    /// Kernel release.
    pub(crate) kernel: String,
    /// Total memory in GiB.
    pub(crate) mem_gib: f64,
    /// Start of the run, UTC, ISO 8601.
    pub(crate) date: String,
}

impl Machine {
    /// The machine as every report's JSON gives it.
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "nproc": self.nproc,
            "cpu": self.cpu,
            "kernel": self.kernel,
            "mem_gib": self.mem_gib,
            "date": self.date,
        })
    }

    /// Reads /proc for this machine.
    pub(crate) fn detect() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .and_then(|r| r.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        Machine {
            nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
            cpu,
            kernel: format!("Linux {kernel}"),
            mem_gib: meminfo_kib("MemTotal").unwrap_or(0) as f64 / (1 << 20) as f64,
            date: utc_now(),
        }
    }

    /// One line for people.
    pub(crate) fn describe(&self) -> String {
        format!(
            "nproc {}, {}, {:.0} GiB RAM, {}, {}",
            self.nproc, self.cpu, self.mem_gib, self.kernel, self.date
        )
    }
}

/// A field of /proc/meminfo, in KiB.
pub(crate) fn meminfo_kib(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// utime + stime of process `pid` (/proc/PID/stat), in clock ticks.
pub(crate) fn process_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)
}

/// Clock ticks per second.
pub(crate) fn ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Resident set size of this process in bytes (from /proc/self/statm).
pub(crate) fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page.max(4096) as u64
}

fn utc_now() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}
