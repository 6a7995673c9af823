//! `fio` as the baseline of `kvpool-bench disk`: the same file system, the same block size,
//! `O_DIRECT`, run from here and read back as JSON.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{ensure, Context};
use kvpool::disk::region_file_name;

/// A `fio` binary that answered `--version`.
pub(super) struct Fio {
    bin: PathBuf,
}

impl Fio {
    /// The `fio` at `bin`, or why there is none.
    pub(super) fn find(bin: &Path) -> Result<Fio, String> {
        match Command::new(bin).arg("--version").output() {
            Ok(out) if out.status.success() => Ok(Fio {
                bin: bin.to_path_buf(),
            }),
            _ => Err(format!(
                "{} does not run (install fio, e.g. apt-get install fio)",
                bin.display()
            )),
        }
    }

    /// Writes `bytes` sequentially into a new file in `dir` in blocks of `bs`, with `O_DIRECT`
    /// and an fsync at the end (as the store's inserts are synced); GB/s. The file is removed.
    pub(super) fn write(&self, dir: &Path, bs: u64, bytes: u64) -> anyhow::Result<f64> {
        std::fs::create_dir_all(dir)?;
        let json = self.run(&[
            "--name=write",
            &format!("--directory={}", dir.display()),
            "--filename=fio-write",
            "--rw=write",
            &format!("--bs={bs}"),
            &format!("--size={bytes}"),
            "--direct=1",
            "--ioengine=psync",
            "--end_fsync=1",
        ]);
        let _ = std::fs::remove_dir_all(dir);
        gbs(&json?, "write")
    }

    /// Random reads of `bs` blocks over the store's region files in `dir`, `O_DIRECT`, one
    /// synchronous `pread` at a time in each of `jobs` jobs, for `time`; GB/s.
    pub(super) fn randread(
        &self,
        dir: &Path,
        regions: u32,
        bs: u64,
        jobs: usize,
        time: Duration,
    ) -> anyhow::Result<f64> {
        let json = self.read(
            dir,
            regions,
            bs,
            time,
            &["--ioengine=psync", &format!("--numjobs={jobs}")],
        )?;
        gbs(&json, "read")
    }

    /// As [`Fio::randread`], one job keeping 16 reads in flight through io_uring: what the
    /// device gives a deep queue.
    pub(super) fn ceiling(
        &self,
        dir: &Path,
        regions: u32,
        bs: u64,
        time: Duration,
    ) -> anyhow::Result<f64> {
        let json = self.read(
            dir,
            regions,
            bs,
            time,
            &["--ioengine=io_uring", "--iodepth=16"],
        )?;
        gbs(&json, "read")
    }

    fn read(
        &self,
        dir: &Path,
        regions: u32,
        bs: u64,
        time: Duration,
        engine: &[&str],
    ) -> anyhow::Result<serde_json::Value> {
        // Only files holding at least one block (the spare region is empty).
        let files: Vec<String> = (0..regions)
            .map(region_file_name)
            .filter(|f| std::fs::metadata(dir.join(f)).is_ok_and(|m| m.len() >= bs))
            .collect();
        ensure!(!files.is_empty(), "no region file of {bs} bytes or more");
        let mut args = vec![
            "--name=randread".to_string(),
            format!("--directory={}", dir.display()),
            format!("--filename={}", files.join(":")),
            "--rw=randread".into(),
            format!("--bs={bs}"),
            "--direct=1".into(),
            "--readonly".into(),
            // A new sequence of offsets each run, as each of the store's passes has.
            "--randrepeat=0".into(),
            "--group_reporting".into(),
            "--time_based".into(),
            format!("--runtime={}ms", time.as_millis().max(1)),
        ];
        args.extend(engine.iter().map(|a| a.to_string()));
        self.run(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    fn run(&self, args: &[&str]) -> anyhow::Result<serde_json::Value> {
        let out = Command::new(&self.bin)
            .args(args)
            .arg("--output-format=json")
            .output()
            .with_context(|| format!("running {}", self.bin.display()))?;
        ensure!(
            out.status.success(),
            "fio {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        serde_json::from_slice(&out.stdout).context("fio's JSON")
    }
}

/// The `dir` ("read", "write") bandwidth of fio's first (grouped) job, GB/s.
fn gbs(json: &serde_json::Value, dir: &str) -> anyhow::Result<f64> {
    let bw = json["jobs"][0][dir]["bw_bytes"]
        .as_f64()
        .with_context(|| format!("no {dir} bandwidth in fio's JSON"))?;
    Ok(bw / 1e9)
}
