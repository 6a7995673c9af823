//! The bulk class (docs/ARCHITECTURE.md "Scheduling large and small requests"),
//! against a real `kvpoold` over real sockets: two namespaces moving bulk at once get the
//! node's bulk rate in equal shares whatever their number of connections, priorities get
//! shares by weight, a bulk get whose deadline can't be met is refused up front (and counted),
//! and small requests are served meanwhile. The loads run for a fixed time and stop by
//! themselves; what is asserted is who got which share of the bytes, never how fast.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cluster::cfg;
use common::Node;
use kvpool_client::{Client, Priority, SameHost};

const MIB: usize = 1 << 20;

/// The values the loads put: bulk (the threshold is 256 KiB), several per rate bucket.
const VALUE: usize = 512 << 10;

fn config(toml: &str) -> String {
    let dir = common::temp_dir("bulk");
    let path = dir.join("kvpoold.toml");
    std::fs::write(&path, toml).unwrap();
    path.to_str().unwrap().to_string()
}

async fn connect(n: &Node, ns: &str, priority: Priority) -> Client {
    let mut c = cfg(SameHost::Off);
    c.namespace = ns.into();
    c.priority = priority;
    c.timeout = Duration::from_secs(30);
    Client::connect(&n.tcp_url(), c).await.unwrap()
}

/// `conns` tasks putting 512 KiB values through `c` until `until`; returns the bytes stored.
async fn put_load(c: &Client, conns: usize, until: Instant) -> u64 {
    let done = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..conns)
        .map(|t| {
            let (c, done) = (c.clone(), done.clone());
            tokio::spawn(async move {
                let v = common::value(t as u64, VALUE);
                let mut i = 0u64;
                while Instant::now() < until {
                    let key = format!("load-{t}-{}", i % 4);
                    if let Err(e) = c.put(key.as_bytes(), &v).await {
                        panic!("load put {key} failed after {i} puts: {e:?}");
                    }
                    done.fetch_add(VALUE as u64, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed)
}

/// Runs the two loads at once for `secs`; returns (a's bytes, b's bytes).
async fn race(a: (&Client, usize), b: (&Client, usize), secs: u64) -> (u64, u64) {
    let until = Instant::now() + Duration::from_secs(secs);
    tokio::join!(put_load(a.0, a.1, until), put_load(b.0, b.1, until))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_namespaces_doing_bulk_share_the_node_equally_and_priorities_by_weight() {
    // The rate cap makes the node the bottleneck, so the shares are the scheduler's.
    let conf = config(
        "[limits]\nbulk_rate = \"8MiB\"\n\n\
         [[namespace]]\nname = \"tenant-a\"\n\n[[namespace]]\nname = \"tenant-b\"\n",
    );
    let n = Node::start("256MiB", &["--config", &conf]);
    let a = connect(&n, "tenant-a", Priority::Normal).await;
    let b = connect(&n, "tenant-b", Priority::Normal).await;

    // Four connections against one: fair queueing is per namespace, not per connection.
    let (ga, gb) = race((&a, 4), (&b, 1), 3).await;
    let share = gb as f64 / (ga + gb) as f64;
    assert!(ga > 0 && gb > 0);
    assert!(
        (0.35..=0.65).contains(&share),
        "tenant-b (1 connection) got {share:.2} of the bytes against 4 connections of tenant-a \
         ({gb} / {ga})"
    );

    // One connection each, tenant-a at high priority: weights 8 to 4, a share of 2/3.
    let a_high = a.with_priority(Priority::High);
    let (ga, gb) = race((&a_high, 2), (&b, 2), 3).await;
    let share = ga as f64 / (ga + gb) as f64;
    assert!(
        (0.55..=0.8).contains(&share),
        "tenant-a at high priority got {share:.2} of the bytes against tenant-b at normal \
         ({ga} / {gb})"
    );

    let m = n.scrape();
    let moved = |p: &str| {
        m.lines()
            .find(|l| l.starts_with(&format!("kvpool_bulk_bytes_total{{priority=\"{p}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .unwrap_or(0)
    };
    assert!(
        moved("normal") > 0 && moved("high") > 0,
        "bulk bytes by priority not in the metrics:\n{}",
        m.lines()
            .filter(|l| l.contains("bulk"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_transfer_that_cannot_meet_its_deadline_is_refused_up_front() {
    let conf = config("[limits]\nbulk_rate = \"16MiB\"\n");
    let n = Node::start("256MiB", &["--config", &conf]);
    let c = connect(&n, "default", Priority::Normal).await;
    let big = common::value(7, 8 * MIB);
    c.put(b"big", &big).await.unwrap();
    let small = common::value(8, 4096);
    c.put(b"small", &small).await.unwrap();

    // 8 MiB at 16 MiB/s takes about half a second: a 50 ms deadline is refused at once.
    let hurried = c.with_deadline(Some(Duration::from_millis(50)));
    let e = hurried.get(b"big").await.expect_err("refused");
    assert!(e.is_deadline_refused(), "{e}");
    // A small get is latency class: served whatever the deadline (it has 50 ms).
    assert_eq!(hurried.get(b"small").await.unwrap().unwrap(), small);
    // A bulk put too (its payload is read and thrown away; nothing is stored).
    let e = hurried.put(b"big-2", &big).await.expect_err("refused");
    assert!(e.is_deadline_refused(), "{e}");
    assert!(c.get(b"big-2").await.unwrap().is_none());
    // With time enough, the same get is served.
    let patient = c.with_deadline(Some(Duration::from_secs(20)));
    assert_eq!(patient.get(b"big").await.unwrap().unwrap(), big);

    // Queued behind a namespace-mate's bulk, a deadline that was enough alone is not.
    let loader = {
        let c = c.clone();
        tokio::spawn(async move {
            let until = Instant::now() + Duration::from_secs(2);
            put_load(&c, 2, until).await
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let e = c
        .with_deadline(Some(Duration::from_millis(400)))
        .get(b"big")
        .await
        .expect_err("refused behind the load");
    assert!(e.is_deadline_refused(), "{e}");
    assert!(loader.await.unwrap() > 0);

    let refusals = n
        .scrape()
        .lines()
        .find(|l| l.starts_with("kvpool_bulk_deadline_refusals_total "))
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok());
    assert_eq!(refusals, Some(3));

    // The CLI says so too, and exits 2.
    let out = std::process::Command::new(common::bin("kvpool"))
        .args([
            "-e",
            &n.tcp_url(),
            "--no-local",
            "--deadline-ms",
            "50",
            "get",
            "big",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("DeadlineUnmeetable"), "{err}");
}
