//! The hit-rate harness driving running daemons (`kvpool-bench replay --engine pool
//! --endpoint ...`): with room for every block, a real node must hit exactly what an unbounded
//! cache does, and several nodes pooled must too.
#![cfg(not(loom))]

mod common;

use std::path::Path;

use common::Node;
use kvpool_bench::replay::cache::Unbounded;
use kvpool_bench::replay::cli::BUNDLED_TRACE;
use kvpool_bench::replay::sweep::{Engine, Policy, RunSpec, Scenario, Setup};
use kvpool_bench::replay::trace::{Trace, TraceFormat};
use kvpool_bench::replay::ttft::TtftModel;
use kvpool_bench::replay::{next_uses, replay};

/// The harness driving `endpoints` with 4 KiB blocks.
fn setup(trace: &Trace, endpoints: Vec<String>) -> Setup<'_> {
    Setup {
        trace,
        trace_name: "slice".into(),
        block_bytes: 4096,
        ttft: TtftModel {
            prefill_tokens_per_s: 1e4,
            pool_bytes_per_s: 1e10,
            block_bytes: 4096,
            block_tokens: 512,
        },
        pool_shards: 1,
        endpoints,
        namespace: "default".into(),
        density: Default::default(),
        sim: Default::default(),
    }
}

#[test]
fn replay_against_running_daemons_matches_an_unbounded_cache() {
    let trace = Trace::load(
        Path::new(BUNDLED_TRACE),
        TraceFormat::Auto,
        None,
        None,
        Some(400),
    )
    .unwrap();
    let next = next_uses(&trace);
    let ceiling = replay(&trace, &mut Unbounded::default(), &next, || {}).unwrap();
    assert!(ceiling.hits > 100);
    let nodes = [Node::start("64MiB", &[]), Node::start("64MiB", &[])];
    for n in 1..=2 {
        let setup = setup(
            &trace,
            nodes[..n].iter().map(|node| node.tcp_url()).collect(),
        );
        let spec = RunSpec {
            engine: Engine::Pool,
            policy: Policy::Lru,
            capacity_blocks: 0,
            nodes: n as u32,
            scenario: Scenario::Pooled,
            disk_blocks: 0,
        };
        let row = setup.run(&spec, &next, || {}).unwrap();
        assert_eq!(row.nodes, n as u32);
        assert_eq!(
            row.hits, ceiling.hits,
            "{n} daemon(s): every block fits, so every re-use hits"
        );
        assert_eq!(row.blocks, ceiling.blocks);
    }
    // The blocks really went to both nodes.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for node in &nodes {
        let c = rt
            .block_on(kvpool_client::Client::connect(
                &node.tcp_url(),
                Default::default(),
            ))
            .unwrap();
        assert!(rt.block_on(c.stats()).unwrap().objects > 100);
    }

    // A cluster pools by itself: one endpoint, the client routes each block to its owner.
    let seed = Node::start("64MiB", &["--node-id", "0", "--heartbeat-ms", "100"]);
    let other = Node::start(
        "64MiB",
        &[
            "--node-id",
            "1",
            "--heartbeat-ms",
            "100",
            "--peer",
            &seed.tcp,
            "--cluster-secret-file",
            seed.secret_file().to_str().unwrap(),
        ],
    );
    let c = rt
        .block_on(kvpool_client::Client::connect(
            &seed.tcp_url(),
            Default::default(),
        ))
        .unwrap();
    let t = std::time::Instant::now();
    while rt
        .block_on(c.view())
        .unwrap()
        .nodes
        .iter()
        .filter(|n| n.state == kvpool::placement::NodeState::Serving)
        .count()
        < 2
    {
        assert!(t.elapsed().as_secs() < 20, "the cluster did not form");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let setup = setup(&trace, vec![seed.tcp_url()]);
    let spec = RunSpec {
        engine: Engine::Pool,
        policy: Policy::Lru,
        capacity_blocks: 0,
        nodes: 1,
        scenario: Scenario::Pooled,
        disk_blocks: 0,
    };
    let row = setup.run(&spec, &next, || {}).unwrap();
    assert_eq!(row.nodes, 2, "both nodes of the cluster");
    assert_eq!(row.hits, ceiling.hits);
    for node in [&seed, &other] {
        let c = rt
            .block_on(kvpool_client::Client::connect(
                &node.tcp_url(),
                Default::default(),
            ))
            .unwrap();
        assert!(
            rt.block_on(c.stats()).unwrap().objects > 100,
            "blocks spread over the cluster"
        );
    }
}
