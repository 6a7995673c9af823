use super::*;

/// A config for one node listening on free loopback ports over a small anonymous pool, with
/// its data dir (and Unix socket) in a fresh directory named after `test`.
fn config(test: &str) -> Config {
    let dir = std::env::temp_dir().join(format!("kvpoold-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = Config {
        data_dir: Some(dir),
        ..Config::default()
    };
    c.memory.size = 4 << 20;
    c.memory.backing = "anonymous".into();
    c.memory.huge_pages = "off".into();
    c.listen.tcp = "127.0.0.1:0".into();
    c.listen.quic = String::new();
    c.listen.metrics = "127.0.0.1:0".into();
    c
}

#[test]
fn the_advertised_address_is_reachable_from_other_processes() {
    let mut c = Config::default();
    let mut bound = Bound::default();
    assert_eq!(advertise(&c, &bound), "", "no TCP, nothing to advertise");
    bound.tcp = Some("0.0.0.0:7370".parse().unwrap());
    assert_eq!(advertise(&c, &bound), "127.0.0.1:7370");
    bound.tcp = Some("10.1.2.3:7370".parse().unwrap());
    assert_eq!(advertise(&c, &bound), "10.1.2.3:7370");
    c.cluster.advertise = Some("node-a:7370".into());
    assert_eq!(advertise(&c, &bound), "node-a:7370");
}

#[test]
fn connection_policy_reads_the_configured_timeouts() {
    let mut c = Config::default();
    assert_eq!(conn_policy(&c).unwrap().idle, None, "0: no idle timeout");
    c.limits.idle_timeout_ms = 1500;
    c.limits.write_timeout_ms = 0;
    let p = conn_policy(&c).unwrap();
    assert_eq!(p.idle, Some(Duration::from_millis(1500)));
    assert_eq!(p.write, Duration::from_millis(1), "at least 1 ms");
}

#[tokio::test]
async fn sockets_bind_free_ports_and_refuse_a_live_unix_socket() {
    let c = config("sockets");
    let dir = c.data_dir();
    let sockets = Sockets::bind(&c, &dir).await.unwrap();
    let b = &sockets.bound;
    assert_ne!(b.tcp.unwrap().port(), 0);
    assert_ne!(b.metrics.unwrap().port(), 0);
    assert_eq!((b.quic, b.tls_cert.as_ref()), (None, None), "QUIC is off");
    assert_eq!(b.unix.as_deref(), Some(c.unix_path().as_path()));
    let again = Sockets::bind(&c, &dir).await;
    let err = format!("{:#}", again.err().expect("the first daemon still serves"));
    assert!(err.contains("another kvpoold"), "{err}");
    drop(sockets);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_lone_node_serves_and_one_with_peers_joins() {
    let mut c = config("membership");
    c.namespaces = vec![crate::config::NamespaceEntry {
        name: "team".into(),
        quota: None,
        tokens: vec!["team-token".into()],
        read_tokens: Vec::new(),
        own_segment: None,
        eviction: "lru".into(),
        replicas: 1,
        pinned_replicas: 3,
        bulk_rate: None,
    }];
    let pool = open_pool(&c).unwrap();
    let bound = Bound {
        tcp: Some("127.0.0.1:9".parse().unwrap()),
        ..Bound::default()
    };
    let timing = Timing {
        heartbeat: Duration::from_millis(100),
        down_after: Duration::from_millis(500),
        restart_window: Duration::from_secs(5),
    };
    let alone = membership(&c, (&c.membership().unwrap(), None, &timing), &bound, &pool);
    assert_eq!(alone.my_state(), NodeState::Serving);
    assert_eq!(alone.view().nodes[0].tcp, "127.0.0.1:9");
    // Alone, a node makes the cluster's secret; a joining one must be given it.
    let creds = credentials(
        &c,
        &c.membership().unwrap(),
        &c.data_dir(),
        &Metrics::default(),
    )
    .unwrap();
    c.cluster.peers = vec!["127.0.0.1:1".into()];
    let joining = membership(&c, (&c.membership().unwrap(), None, &timing), &bound, &pool);
    assert_eq!(joining.my_state(), NodeState::Joining);
    std::fs::remove_file(c.data_dir().join(crate::secret::SECRET_FILE_NAME)).unwrap();
    let Err(refused) = credentials(
        &c,
        &c.membership().unwrap(),
        &c.data_dir(),
        &Metrics::default(),
    ) else {
        panic!("joined with no secret");
    };
    let refused = format!("{refused:#}");
    assert!(refused.contains("no cluster secret"), "{refused}");

    let metrics = Arc::new(Metrics::default());
    let policy = (conn_policy(&c).unwrap(), c.ledger_bounds().unwrap());
    let parts = (&pool, &metrics, &joining, &creds);
    let s = shared(&c, parts, &bound, policy, None);
    assert_eq!(s.hello.namespaces, pool.namespaces());
    let team = pool.namespace_id("team").unwrap();
    let repl = s.replication(team).unwrap();
    assert_eq!((repl.replicas, repl.pinned_replicas), (1, 3));
    assert_eq!(s.auth.ns_tokens[team as usize], ["team-token"]);
    assert_eq!(s.hello.max_batch, s.conn.limits.max_batch);
    let _ = std::fs::remove_dir_all(c.data_dir());
}

#[tokio::test]
async fn the_reaper_stops_at_shutdown() {
    let pool = open_pool(&config("reaper")).unwrap();
    let (stop, shutdown) = watch::channel(false);
    let reaper = start_reaper(pool, Instant::now(), &shutdown);
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(5), reaper)
        .await
        .expect("the reaper ends once shutdown is signalled")
        .unwrap();
}
