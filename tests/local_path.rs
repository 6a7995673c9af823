//! Proves the same-host one-sided path makes no syscall per read: this binary re-runs itself
//! under `strace -f -c` doing 0 and then 10 000 reads of committed objects by global address
//! through the mapping, and compares the total syscall counts; as a control, 1 000 reads
//! through the socket must cost at least 1 000 syscalls more than 0. Likewise 10 000 batched
//! gets of 8 keys the client has seen cost less than one syscall per call (no lookup round
//! trip; only the batched reports of reads to the node, one per 256 keys).
//!
//! Without strace it fails in CI (`.ci/run` installs strace) and elsewhere says it skipped.

#[cfg(not(loom))]
mod common;

#[cfg(loom)]
fn main() {}

#[cfg(not(loom))]
fn main() {
    use std::process::Command;

    if let Ok(mode) = std::env::var("KVPOOL_CHILD_MODE") {
        child(&mode);
        return;
    }
    let name = "ten_thousand_local_reads_make_no_syscalls";
    let has_strace = Command::new("strace").arg("-V").output().is_ok();
    if !common::deps::require(has_strace, name, "strace", "apt-get install strace") {
        return;
    }
    let node = common::Node::start("64MiB", &[]);
    let count = |mode: &str, reads: u64| -> u64 {
        let out = common::temp_dir("strace").join("count.txt");
        let status = Command::new("strace")
            .args(["-f", "-c", "-o", out.to_str().unwrap()])
            .arg(std::env::current_exe().unwrap())
            .env("KVPOOL_CHILD_MODE", mode)
            .env("KVPOOL_CHILD_READS", reads.to_string())
            .env("KVPOOL_CHILD_ENDPOINT", node.tcp_url())
            .status()
            .unwrap();
        assert!(status.success(), "child {mode} {reads} failed");
        let text = std::fs::read_to_string(&out).unwrap();
        let total = text
            .lines()
            .find(|l| l.trim_end().ends_with("total"))
            .expect("strace total line");
        // "100.00  0.001  1  1234  5  total": the calls column is the 4th.
        total.split_whitespace().nth(3).unwrap().parse().unwrap()
    };
    // Setup puts the objects; a run of 0 reads measures everything but the reads.
    count("setup", 0);
    let base = count("local", 0);
    let local = count("local", 10_000);
    let socket = count("socket", 1_000);
    let seen_base = count("seen", 0);
    let seen = count("seen", 10_000);
    println!(
        "syscalls: base {base}, 10 000 local reads {local}, 1 000 socket reads {socket}, \
         10 000 batched gets of seen keys {seen} (base {seen_base})"
    );
    assert!(
        seen.saturating_sub(seen_base) < 10_000,
        "10 000 batched gets of seen keys cost {} syscalls",
        seen - seen_base
    );
    assert!(
        local.saturating_sub(base) < 100,
        "10 000 local reads cost {} syscalls",
        local - base
    );
    assert!(
        socket.saturating_sub(base) >= 1_000,
        "1 000 socket reads cost only {} syscalls",
        socket - base
    );
    println!("test {name} ... ok");
    println!("1 passed, 0 failed");
}

#[cfg(not(loom))]
fn child(mode: &str) {
    use kvpool_client::{Client, ClientConfig, SameHost};

    let endpoint = std::env::var("KVPOOL_CHILD_ENDPOINT").unwrap();
    let reads: usize = std::env::var("KVPOOL_CHILD_READS")
        .unwrap()
        .parse()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let c = rt
        .block_on(Client::connect(&endpoint, ClientConfig::default()))
        .unwrap();
    assert!(c.is_local(), "the node runs on this host");
    let keys: Vec<Vec<u8>> = (0..100u64)
        .map(|i| format!("obj{i}").into_bytes())
        .collect();
    if mode == "setup" {
        for (i, k) in keys.iter().enumerate() {
            rt.block_on(c.put(k, &common::value(i as u64, 64 << 10)))
                .unwrap();
        }
        return;
    }
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let located = rt.block_on(c.lease(&refs, 30_000)).unwrap();
    let mut buf = vec![0u8; 64 << 10];
    match mode {
        "local" => {
            for i in 0..reads {
                let l = located[i % 100].expect("present");
                c.read_local(&l.addr, 0, &mut buf)
                    .expect("mapped")
                    .expect("valid");
                assert_eq!(kvpool::checksum(&buf), l.checksum);
            }
        }
        "socket" => {
            let remote = rt
                .block_on(Client::connect(
                    &endpoint,
                    ClientConfig {
                        same_host: SameHost::Off,
                        ..Default::default()
                    },
                ))
                .unwrap();
            for i in 0..reads {
                let l = located[i % 100].expect("present");
                assert!(rt.block_on(remote.read(&l.addr, 0, &mut buf)).unwrap());
            }
        }
        "seen" => {
            let mut bufs = vec![vec![0u8; 64 << 10]; 8];
            for i in 0..reads {
                let batch: Vec<&[u8]> = (0..8).map(|j| refs[(i * 8 + j) % 100]).collect();
                let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                let got = rt.block_on(c.batch_get_into(&batch, &mut dsts)).unwrap();
                assert!(got.iter().all(|g| *g == Some(64 << 10)));
            }
        }
        other => panic!("unknown mode {other}"),
    }
}
