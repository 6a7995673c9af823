use super::cache::{Belady, BlockCache, Lru, Unbounded};
use super::cli::BUNDLED_TRACE;
use super::sweep::{
    grid, write_csv, write_json, Engine, Policy, Row, RunSpec, Scenario, Setup, CSV_HEADER,
};
use super::trace::{Trace, TraceFormat};
use super::ttft::TtftModel;
use super::*;

fn bundled(limit: Option<usize>) -> Trace {
    Trace::load(
        std::path::Path::new(BUNDLED_TRACE),
        TraceFormat::Auto,
        None,
        None,
        limit,
    )
    .unwrap()
}

fn run(trace: &Trace, cache: &mut dyn BlockCache) -> Outcome {
    replay(trace, cache, &next_uses(trace), || {}).unwrap()
}

fn setup(trace: &Trace, block_bytes: u64) -> Setup<'_> {
    Setup {
        trace,
        trace_name: "t".into(),
        block_bytes,
        ttft: TtftModel {
            prefill_tokens_per_s: 1e4,
            pool_bytes_per_s: 1e10,
            block_bytes,
            block_tokens: trace.block_tokens,
        },
        pool_shards: 1,
        endpoints: vec![],
        namespace: "default".into(),
        density: Default::default(),
        sim: Default::default(),
    }
}

/// Four requests of 4-token blocks, checked by hand.
#[test]
fn tiny_trace_by_hand() {
    let lines = [
        r#"{"timestamp": 0, "input_length": 10, "hash_ids": [1, 2, 3]}"#, // all miss; 3 is partial
        r#"{"timestamp": 1, "input_length": 8, "hash_ids": [1, 2]}"#,     // hits 1, 2: saves 8
        r#"{"timestamp": 2, "input_length": 12, "hash_ids": [1, 4, 3]}"#, // hits 1 only (4 missing): saves 4
        r#"{"timestamp": 3, "input_length": 11, "hash_ids": [1, 4, 3]}"#, // hits 3 blocks, 3 is partial: saves 8
    ];
    let t = Trace::read(
        lines.join("\n").as_bytes(),
        TraceFormat::Mooncake,
        Some(4),
        None,
        None,
    )
    .unwrap();
    let o = run(&t, &mut Unbounded::default());
    assert_eq!((o.blocks, o.hits), (11, 6));
    assert_eq!((o.input_tokens, o.saved_tokens), (41, 20));
    assert_eq!(
        o.per_request.iter().map(|p| p.1).collect::<Vec<_>>(),
        vec![0, 8, 4, 8]
    );
    // With room for 2 blocks: request 1 leaves {2,3}; request 2 misses on 1 (hits 0), touches
    // 2 and inserts 1, leaving {2,1}; request 3 hits 1, then 4 and 3 push out 2 and 1, leaving
    // {4,3}; request 4 misses on 1 again.
    let o = run(&t, &mut Lru::new(2));
    assert_eq!(
        o.per_request.iter().map(|p| p.2).collect::<Vec<_>>(),
        vec![0, 0, 1, 0]
    );
}

#[test]
fn the_bundled_trace_has_the_published_shape() {
    let t = bundled(None);
    assert_eq!(t.requests.len(), 12_031);
    assert_eq!(t.total_blocks(), 288_500);
    assert!(
        t.requests.iter().all(|r| r.blocks[0] == 0),
        "every request starts with the system prompt"
    );
    let o = run(&t, &mut Unbounded::default());
    assert_eq!(o.hits, 105_710);
    assert!(
        (o.block_hit_rate() - 0.366).abs() < 0.0005,
        "{}",
        o.block_hit_rate()
    );
}

#[test]
fn lru_and_belady_match_an_independent_simulation() {
    // Reference numbers from a separate Python implementation of the same semantics.
    let t = bundled(None);
    assert_eq!(run(&t, &mut Lru::new(5000)).hits, 31_840);
    assert_eq!(run(&t, &mut Lru::new(1000)).hits, 12_831);
    let b = run(&t, &mut Belady::new(5000)).block_hit_rate();
    assert!((b - 0.3412).abs() < 0.002, "belady at 5000: {b}");
    // Belady bounds LRU from above at every capacity, unbounded bounds both.
    for cap in [500, 2000, 20_000] {
        let (l, b) = (
            run(&t, &mut Lru::new(cap)).hits,
            run(&t, &mut Belady::new(cap)).hits,
        );
        assert!(l <= b && b <= 105_710, "cap {cap}: lru {l} belady {b}");
    }
}

#[test]
fn the_real_pool_agrees_with_the_simulation() {
    let t = bundled(Some(4000));
    let s = setup(&t, 4096);
    let next = s.next_uses();
    let cases = [
        (Policy::Lru, 1, Scenario::Pooled),
        (Policy::Lru, 3, Scenario::Pooled),
        (Policy::Lru, 2, Scenario::Private),
        (Policy::S3fifo, 1, Scenario::Pooled),
        (Policy::PrefixAware, 1, Scenario::Pooled),
    ];
    for (policy, nodes, scenario) in cases {
        let spec = |engine| RunSpec {
            engine,
            policy,
            capacity_blocks: 300,
            nodes,
            scenario,
            disk_blocks: 0,
        };
        let sim = s.run(&spec(Engine::Sim), &next, || {}).unwrap();
        let pool = s.run(&spec(Engine::Pool), &next, || {}).unwrap();
        let diff = (sim.block_hit_rate - pool.block_hit_rate).abs();
        assert!(
            diff < 0.01,
            "{policy:?} {nodes} nodes {scenario:?}: sim {} pool {}",
            sim.block_hit_rate,
            pool.block_hit_rate
        );
        assert!(pool.hits > 0);
    }
}

#[test]
fn pooling_beats_private_caches_of_the_same_size() {
    let t = bundled(Some(4000));
    let s = setup(&t, 4096);
    let next = s.next_uses();
    let spec = |scenario| RunSpec {
        engine: Engine::Sim,
        policy: Policy::Lru,
        capacity_blocks: 1000,
        nodes: 4,
        scenario,
        disk_blocks: 0,
    };
    let pooled = s.run(&spec(Scenario::Pooled), &next, || {}).unwrap();
    let private = s.run(&spec(Scenario::Private), &next, || {}).unwrap();
    assert!(
        pooled.block_hit_rate > private.block_hit_rate,
        "{} vs {}",
        pooled.block_hit_rate,
        private.block_hit_rate
    );
}

#[test]
fn outputs_have_the_documented_schema_and_charts_are_drawn() {
    let t = bundled(Some(500));
    let s = setup(&t, 64 << 20);
    let next = s.next_uses();
    let specs = grid(
        &[Engine::Sim],
        &[Policy::Lru, Policy::Belady, Policy::Unbounded],
        &[100, 400, 1600],
        &[1],
        &[Scenario::Pooled],
    );
    assert_eq!(specs.len(), 7, "unbounded runs once");
    let rows: Vec<Row> = specs
        .iter()
        .map(|sp| s.run(sp, &next, || {}).unwrap())
        .collect();
    let dir = std::env::temp_dir().join(format!("kvpool-replay-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_csv(&dir.join("r.csv"), &rows).unwrap();
    write_json(&dir.join("r.json"), &rows).unwrap();
    let csv = std::fs::read_to_string(dir.join("r.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(CSV_HEADER));
    let columns = CSV_HEADER.split(',').count();
    for l in lines {
        assert_eq!(l.split(',').count(), columns, "{l}");
        assert!(l.starts_with("\"t\",sim,"), "{l}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("r.json")).unwrap()).unwrap();
    let first = &json.as_array().unwrap()[0];
    for key in CSV_HEADER.split(',') {
        assert!(first.get(key).is_some(), "json lacks {key}");
    }
    assert_eq!(first["policy"], "lru");
    let charts = plot::hit_rate_charts(&rows, &dir, "test").unwrap();
    assert_eq!(charts.len(), 1);
    let png = std::fs::read(&charts[0]).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 10_000, "a real chart, not an empty image");
    let _ = std::fs::remove_dir_all(dir);
}

/// The eviction goal of the context-caching work, on the bundled trace: the default policy hits
/// at least 20 % more than LRU wherever LRU hits less than half of what an unbounded cache would,
/// and is never more than one percentage point worse than LRU.
#[test]
fn the_default_policy_beats_lru_where_it_matters() {
    use kvpool::eviction::PolicyKind;
    let t = bundled(None);
    let unbounded = run(&t, &mut Unbounded::default()).block_hit_rate();
    for cap in [1000, 2000, 5000, 10_000, 20_000, 50_000] {
        let lru = run(&t, &mut Lru::new(cap)).block_hit_rate();
        let pa = run(
            &t,
            &mut cache::PoolPolicy::new(PolicyKind::PrefixAware, cap),
        )
        .block_hit_rate();
        let best =
            run(&t, &mut cache::PoolPolicy::new(PolicyKind::default(), cap)).block_hit_rate();
        println!(
            "capacity {cap}: lru {:.4} prefix-aware {:.4} default {:.4} ({:+.1}%)",
            lru,
            pa,
            best,
            (best / lru - 1.0) * 100.0
        );
        if lru < unbounded / 2.0 {
            assert!(
                best >= lru * 1.2,
                "capacity {cap}: default {best:.4} is not 20% above lru {lru:.4}"
            );
        }
        assert!(
            best >= lru - 0.01,
            "capacity {cap}: default {best:.4} is over 1 point below lru {lru:.4}"
        );
    }
}

#[test]
fn the_default_policy_keeps_up_with_lru_on_recency_workloads() {
    // chat and agent reread each conversation on every turn, then never again: the workloads
    // where the paper's S3-FIFO fell 2 to 3 points behind LRU (docs/BENCHMARKS.md). Since
    // batches are stored tail first, the paper's version no longer falls behind on agent at 200
    // blocks (63.4 % against LRU's 60.7 %), so only chat still has to tell the two apart.
    use kvpool::eviction::PolicyKind;
    use synth::{generate, Workload};
    for (w, cap, separates) in [(Workload::Chat, 1000, true), (Workload::Agent, 200, false)] {
        let t = generate(w, 1, 10_000);
        let lru = run(&t, &mut Lru::new(cap)).block_hit_rate();
        let rate = |k| run(&t, &mut cache::PoolPolicy::new(k, cap)).block_hit_rate();
        let (default, paper) = (rate(PolicyKind::default()), rate(PolicyKind::S3Fifo));
        println!("{w:?} at {cap}: lru {lru:.4} default {default:.4} s3fifo {paper:.4}");
        assert!(
            default >= lru - 0.01,
            "{w:?} at {cap}: default {default:.4} is over 1 point below lru {lru:.4}"
        );
        assert!(
            !separates || paper < lru - 0.01,
            "{w:?} at {cap}: s3fifo {paper:.4} no longer falls behind lru {lru:.4}, so this \
             workload no longer tells the policies apart"
        );
    }
}

#[test]
fn synthetic_workloads_are_deterministic_and_shaped_like_traces() {
    use synth::{generate, write_jsonl, Workload};
    for w in Workload::ALL {
        let a = generate(w, 7, 300);
        let b = generate(w, 7, 300);
        assert_eq!(a.requests, b.requests, "{w:?}: same seed, same trace");
        assert_ne!(
            a.requests,
            generate(w, 8, 300).requests,
            "{w:?}: another seed, another trace"
        );
        // The JSONL reads back as the same trace, like the bundled one.
        let mut jsonl = Vec::new();
        write_jsonl(&a, &mut jsonl).unwrap();
        let back = Trace::read(&jsonl[..], TraceFormat::Auto, None, None, None).unwrap();
        assert_eq!(back.requests, a.requests);
        assert_eq!(back.block_tokens, 512);
        // Ids are dense in order of first appearance; each prompt's last block is partial.
        let mut seen = 0;
        for r in &a.requests {
            for &id in &r.blocks {
                assert!(id <= seen, "{w:?}: id {id} before {seen}");
                seen = seen.max(id + 1);
            }
            assert_eq!(r.blocks.len() as u64, r.input_tokens.div_ceil(512));
            assert!(r.arrival_ms >= a.requests[0].arrival_ms);
        }
        // Every workload reuses prefixes, and none is all reuse.
        let o = run(&a, &mut Unbounded::default());
        assert!(o.hits > 0 && o.hits < o.blocks, "{w:?}: {o:?}");
    }
}

#[test]
fn replay_defaults_show_the_default_policy() {
    use clap::ValueEnum;
    let policies: Vec<Policy> = cli::DEFAULT_POLICIES
        .split(',')
        .map(|p| Policy::from_str(p, false).unwrap())
        .collect();
    for want in [
        Policy::Lru,
        Policy::pool_default(),
        Policy::Belady,
        Policy::Unbounded,
    ] {
        assert!(
            policies.contains(&want),
            "{want:?} missing from {policies:?}"
        );
    }
}

#[test]
fn density_flags_parse_and_reject_nonsense() {
    let c = cli::parse_density("sample=8, no-gap,no-ghost").unwrap();
    assert_eq!((c.sample, c.gap, c.ghost, c.refs), (8, false, false, true));
    assert_eq!(cli::parse_density("").unwrap(), Default::default());
    for bad in ["sample=0", "ghost=17", "no-such", "sample=x"] {
        assert!(cli::parse_density(bad).is_err(), "{bad}");
    }
}

#[test]
fn a_disk_tier_adds_hits_between_dram_alone_and_the_ceiling() {
    use sweep::with_disk;
    let t = bundled(Some(3000));
    let s = setup(&t, 4096);
    let next = s.next_uses();
    let ceiling = run(&t, &mut Unbounded::default()).hits;
    let specs = with_disk(
        grid(
            &[Engine::Sim],
            &[Policy::Lru, Policy::S3fifoLru, Policy::Belady],
            &[300],
            &[1, 2],
            &[Scenario::Pooled, Scenario::Private],
        ),
        &[10.0],
    );
    let tiered: Vec<&RunSpec> = specs.iter().filter(|s| s.disk_blocks > 0).collect();
    assert_eq!(
        tiered.len(),
        4,
        "lru and s3fifo-lru, one node and private: {specs:?}"
    );
    for spec in tiered {
        assert_eq!(spec.disk_blocks, 3000);
        let alone = s
            .run(
                &RunSpec {
                    disk_blocks: 0,
                    ..spec.clone()
                },
                &next,
                || {},
            )
            .unwrap();
        let row = s.run(spec, &next, || {}).unwrap();
        let d = row.disk.as_ref().expect("disk columns");
        assert_eq!(d.dram_hits + d.disk_hits, row.hits, "{spec:?}");
        assert!(d.disk_hits > 0 && d.disk_writes > 0, "{spec:?}");
        assert!(alone.disk.is_none());
        assert!(
            alone.hits < row.hits && row.hits <= ceiling,
            "{spec:?}: {} alone, {} with disk, {ceiling} unbounded",
            alone.hits,
            row.hits
        );
        // DRAM holds the same blocks either way, and serves at least what it served alone.
        assert!(d.dram_hits >= alone.hits, "{spec:?}");
    }
    // The pool engine has no disk tier, nor has a pooled fleet's simulation.
    for (engine, nodes, scenario) in [
        (Engine::Pool, 1, Scenario::Pooled),
        (Engine::Sim, 2, Scenario::Pooled),
    ] {
        let spec = RunSpec {
            engine,
            policy: Policy::Lru,
            capacity_blocks: 300,
            nodes,
            scenario,
            disk_blocks: 3000,
        };
        assert!(s.run(&spec, &next, || {}).is_err(), "{spec:?}");
    }
}

#[test]
fn read_once_admission_writes_less_than_admitting_all() {
    let t = bundled(Some(3000));
    let mut s = setup(&t, 4096);
    let next = s.next_uses();
    let spec = RunSpec {
        engine: Engine::Sim,
        policy: Policy::Lru,
        capacity_blocks: 300,
        nodes: 1,
        scenario: Scenario::Pooled,
        disk_blocks: 3000,
    };
    let all = s.run(&spec, &next, || {}).unwrap().disk.unwrap();
    s.sim.disk_admit = tiers::Admit::ReadOnce;
    let once = s.run(&spec, &next, || {}).unwrap().disk.unwrap();
    assert!(once.disk_writes < all.disk_writes, "{once:?} {all:?}");
    assert_eq!(once.disk_admit, tiers::Admit::ReadOnce);
}

#[test]
fn disk_columns_appear_only_for_runs_with_a_disk_tier() {
    let t = bundled(Some(300));
    let s = setup(&t, 4096);
    let next = s.next_uses();
    let specs = sweep::with_disk(
        grid(
            &[Engine::Sim],
            &[Policy::Lru, Policy::Unbounded],
            &[100],
            &[1],
            &[Scenario::Pooled],
        ),
        &[10.0],
    );
    let rows: Vec<Row> = specs
        .iter()
        .map(|sp| s.run(sp, &next, || {}).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    let dir = std::env::temp_dir().join(format!("kvpool-replay-disk-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_csv(&dir.join("r.csv"), &rows).unwrap();
    write_json(&dir.join("r.json"), &rows).unwrap();
    let csv = std::fs::read_to_string(dir.join("r.csv")).unwrap();
    let header = format!("{CSV_HEADER},{}", sweep::CSV_DISK_HEADER);
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some(header.as_str()));
    for l in lines {
        assert_eq!(l.split(',').count(), header.split(',').count(), "{l}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("r.json")).unwrap()).unwrap();
    let json = json.as_array().unwrap();
    for key in sweep::CSV_DISK_HEADER.split(',') {
        assert!(json[0].get(key).is_none(), "DRAM alone has no {key}");
        assert!(json[1].get(key).is_some(), "json lacks {key}");
    }
    assert_eq!(json[1]["disk_admit"], "all");
    // Without a disk tier the CSV is what it always was.
    write_csv(&dir.join("r.csv"), &rows[..1]).unwrap();
    let csv = std::fs::read_to_string(dir.join("r.csv")).unwrap();
    assert_eq!(csv.lines().next(), Some(CSV_HEADER));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_order_of_a_requests_blocks_is_selectable() {
    // Room for 3: 1, 2 and 9 stored, 1 the least recent. A request for 3, 4, 1 keeps 1, 3 and 4
    // in either order, but touching first leaves 1 the least recent, while going in request order
    // evicts 1 for 3, re-inserts it last and leaves 3 the least recent. Then 5 comes.
    let requests: [&[u64]; 3] = [&[1, 2, 9], &[3, 4, 1], &[5]];
    let left = |order| {
        let mut c = cache::Lru::new(3).with_order(order);
        for r in requests {
            c.store(r, &[0; 3][..r.len()]).unwrap();
        }
        (c.lookup(&[1]).unwrap(), c.lookup(&[3]).unwrap())
    };
    assert_eq!(left(cache::Order::PresentFirst), (0, 1));
    assert_eq!(left(cache::Order::RequestOrder), (1, 0));
    assert_eq!(cache::Order::default(), cache::Order::PresentFirst);
    // The harness passes the order to every simulated policy; the default is present-first.
    let t = synth::generate(synth::Workload::Agent, 1, 1500);
    let mut s = setup(&t, 4096);
    let next = s.next_uses();
    let hits = |s: &Setup<'_>, policy| {
        let spec = RunSpec {
            engine: Engine::Sim,
            policy,
            capacity_blocks: 200,
            nodes: 1,
            scenario: Scenario::Pooled,
            disk_blocks: 0,
        };
        s.run(&spec, &next, || {}).unwrap().hits
    };
    let present_first = [Policy::Lru, Policy::S3fifoLru].map(|p| hits(&s, p));
    assert_eq!(present_first[0], run(&t, &mut Lru::new(200)).hits);
    s.sim.order = cache::Order::RequestOrder;
    let request_order = [Policy::Lru, Policy::S3fifoLru].map(|p| hits(&s, p));
    assert_ne!(present_first, request_order);
}

#[test]
fn replay_flags_default_to_no_disk_and_present_first() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        replay: cli::ReplayArgs,
    }
    let a = Cli::parse_from(["replay"]).replay;
    assert!(a.disk_ratio.is_empty());
    assert_eq!(a.order, cache::Order::PresentFirst);
    assert_eq!(a.disk_admit, tiers::Admit::All);
    let a = Cli::parse_from([
        "replay",
        "--disk-ratio",
        "5,10",
        "--disk-admit",
        "read-once",
        "--order",
        "request-order",
    ])
    .replay;
    assert_eq!(a.disk_ratio, [5.0, 10.0]);
    assert_eq!(a.disk_admit, tiers::Admit::ReadOnce);
    assert_eq!(a.order, cache::Order::RequestOrder);
}
