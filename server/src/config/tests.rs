//! The configuration's parsing, defaults and checks.

use std::path::PathBuf;

use super::*;

#[test]
fn sizes_parse() {
    assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
    assert_eq!(parse_size("512 MiB").unwrap(), 512 << 20);
    assert_eq!(parse_size("64k").unwrap(), 64 << 10);
    assert_eq!(parse_size("123").unwrap(), 123);
    assert!(parse_size("12 parsecs").is_err());
    assert!(parse_size("99999999999T").is_err());
    assert_eq!(parse_rate("2GiB/s").unwrap(), 2 << 30);
    assert_eq!(parse_rate("500MiB").unwrap(), 500 << 20);
    assert!(parse_rate("fast").is_err());
}

#[test]
fn a_full_file_parses_and_unknown_keys_are_refused() {
    let c = Config::from_toml(
        r#"
        node_id = 2
        data_dir = "/tmp/x"
        [memory]
        size = "256MiB"
        segments = 2
        [listen]
        tcp = "127.0.0.1:9000"
        quic = ""
        [[namespace]]
        name = "tenant-a"
        quota = "64MiB"
        eviction = "lru"
        pinned_replicas = 3
        [cluster]
        peers = ["127.0.0.1:9100", "127.0.0.1:9200"]
        heartbeat_ms = 100
        handover_max_bytes = "1GiB"
        "#,
    )
    .unwrap();
    assert_eq!(c.memory.size, 256 << 20);
    assert_eq!(c.cluster.peers.len(), 2);
    assert_eq!(c.cluster.heartbeat_ms, 100);
    assert_eq!(c.cluster.down_after_ms, 2_000, "the default");
    assert!(c.cluster.handover, "the default");
    assert_eq!(c.cluster.handover_max_bytes, 1 << 30);
    assert!(
        !Config::from_toml("[cluster]\nhandover = false")
            .unwrap()
            .cluster
            .handover
    );
    let ns = [("default".to_string(), 0), ("tenant-a".to_string(), 1)];
    assert_eq!(c.replication(&ns), vec![(1, 2), (1, 3)]);
    assert_eq!(c.namespaces[0].quota, Some(64 << 20));
    assert_eq!(c.unix_path(), PathBuf::from("/tmp/x/kvpool.sock"));
    let p = c.pool_config().unwrap();
    let names: Vec<&str> = p.namespaces.iter().map(|n| &n.name[..]).collect();
    assert_eq!(
        names,
        ["default", "tenant-a", "weights"],
        "default and weights always exist"
    );
    assert_eq!(p.namespaces[1].eviction, kvpool::eviction::PolicyKind::Lru);
    assert_eq!(
        p.namespaces[0].eviction,
        kvpool::eviction::PolicyKind::S3FifoLru,
        "the default"
    );
    let bad = Config::from_toml("[[namespace]]\nname = \"x\"\neviction = \"mru\"").unwrap();
    assert!(bad.pool_config().is_err());
    assert!(Config::from_toml("nonsense = 1").is_err());
    assert!(Config::from_toml("[memory]\nbacking = \"floppy\"")
        .unwrap()
        .pool_config()
        .is_err());
}

/// A tenant (a namespace with a quota and tokens, read-only ones too) gets a segment of its
/// own unless told otherwise; a namespace without tokens or a quota shares the common ones.
#[test]
fn tenants_get_segments_of_their_own() {
    let c = Config::from_toml(
        r#"
        [listen]
        unix_mode = "0660"
        [[namespace]]
        name = "tenant"
        quota = "8MiB"
        tokens = ["t"]
        [[namespace]]
        name = "readers"
        quota = "8MiB"
        read_tokens = ["r"]
        [[namespace]]
        name = "shared"
        quota = "8MiB"
        [[namespace]]
        name = "no-quota"
        tokens = ["n"]
        [[namespace]]
        name = "opted-out"
        quota = "8MiB"
        tokens = ["o"]
        own_segment = false
        "#,
    )
    .unwrap();
    assert_eq!(c.listen.unix_mode, 0o660);
    let own: Vec<(String, bool)> = c
        .pool_config()
        .unwrap()
        .namespaces
        .into_iter()
        .map(|n| (n.name, n.own_segment))
        .collect();
    let want = [
        ("default", false),
        ("tenant", true),
        ("readers", true),
        ("shared", false),
        ("no-quota", false),
        ("opted-out", false),
        ("weights", false),
    ];
    assert_eq!(
        own,
        want.map(|(n, o)| (n.to_string(), o)).to_vec(),
        "own segments"
    );
    let ns: Vec<(String, u32)> = ["default", "tenant", "readers"]
        .iter()
        .enumerate()
        .map(|(i, n)| (n.to_string(), i as u32))
        .collect();
    assert_eq!(c.namespace_read_tokens(&ns)[2], ["r"]);
    assert_eq!(Config::default().listen.unix_mode, 0o600);
    assert_eq!(
        Config::from_toml("[listen]\nunix_mode = 0o666")
            .unwrap()
            .listen
            .unix_mode,
        0o666
    );
    assert!(Config::from_toml("[listen]\nunix_mode = \"0999\"").is_err());
    assert!(Config::from_toml("[listen]\nunix_mode = \"01777\"").is_err());
}

#[test]
fn etcd_membership_excludes_peers_and_needs_http_or_https_urls() {
    let c = Config::from_toml(
        "[cluster]\netcd = [\"http://127.0.0.1:2379\", \"http://10.0.0.2:2379/\"]",
    )
    .unwrap();
    assert_eq!(c.cluster.etcd_prefix, "/kvpool/", "the default");
    match c.membership().unwrap() {
        MembershipConfig::Etcd(e) => assert_eq!(e.endpoints.len(), 2),
        other => panic!("{other:?}"),
    }
    let both = "[cluster]\netcd = [\"http://h:1\"]\npeers = [\"h:2\"]";
    assert!(Config::from_toml(both).unwrap().membership().is_err());
    let tls = "[cluster]\netcd = [\"https://h:1\"]";
    let e = Config::from_toml(tls).unwrap().membership().unwrap_err();
    assert!(e.to_string().contains("etcd_ca_file"), "{e}");
    assert!(Config::from_toml("[cluster]\netcd = [\"ftp://h:1\"]")
        .unwrap()
        .membership()
        .is_err());
    assert!(matches!(
        Config::default().membership().unwrap(),
        MembershipConfig::Static { .. }
    ));
}

#[test]
fn etcd_authentication_needs_a_user_and_a_password_file() {
    let dir = kvpool_system_tests::temp_dir("etcd-auth-config");
    let file = dir.join("etcd.password");
    std::fs::write(&file, "  s3cret\n").unwrap();
    let with = |extra: &str| {
        Config::from_toml(&format!("[cluster]\netcd = [\"http://h:1\"]\n{extra}"))
            .unwrap()
            .membership()
    };
    let both = format!(
        "etcd_user = \"kvpool\"\netcd_password_file = \"{}\"",
        file.display()
    );
    match with(&both).unwrap() {
        MembershipConfig::Etcd(e) => {
            let a = e.auth.unwrap();
            assert_eq!((a.user.as_str(), a.password.as_str()), ("kvpool", "s3cret"));
            assert!(
                !format!("{a:?}").contains("s3cret"),
                "the password is not logged"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(with("etcd_user = \"kvpool\"").is_err(), "no password file");
    let alone = format!("etcd_password_file = \"{}\"", file.display());
    assert!(with(&alone).is_err(), "no user");
    let missing = "etcd_user = \"kvpool\"\netcd_password_file = \"/nonexistent/pw\"";
    let err = with(missing).unwrap_err().to_string();
    assert!(err.contains("/nonexistent/pw"), "{err}");
    std::fs::write(&file, "\n").unwrap();
    assert!(with(&both).is_err(), "an empty password");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn etcd_over_tls_needs_a_ca_and_https_urls() {
    let dir = kvpool_system_tests::temp_dir("etcd-tls-config");
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
    let (ca, key) = (dir.join("ca.pem"), dir.join("key.pem"));
    std::fs::write(&ca, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let with = |urls: &str, extra: &str| {
        Config::from_toml(&format!("[cluster]\netcd = [{urls}]\n{extra}"))
            .unwrap()
            .membership()
    };
    let (https, http) = ("\"https://127.0.0.1:1\"", "\"http://127.0.0.1:1\"");
    let ca_line = format!("etcd_ca_file = \"{}\"", ca.display());
    let client = format!(
        "{ca_line}\netcd_cert_file = \"{}\"\netcd_key_file = \"{}\"",
        ca.display(),
        key.display()
    );
    for (urls, extra) in [(https, ca_line.as_str()), (https, client.as_str())] {
        match with(urls, extra).unwrap() {
            MembershipConfig::Etcd(e) => assert!(e.tls.is_some() && e.endpoints[0].tls),
            other => panic!("{other:?}"),
        }
    }
    match with(http, "").unwrap() {
        MembershipConfig::Etcd(e) => assert!(e.tls.is_none()),
        other => panic!("{other:?}"),
    }
    let half = format!("{ca_line}\netcd_cert_file = \"{}\"", ca.display());
    assert!(with(https, &half).is_err(), "a certificate without its key");
    assert!(with(http, &ca_line).is_err(), "a CA with no https URL");
    let missing = "etcd_ca_file = \"/nonexistent/ca.pem\"";
    let e = with(https, missing).unwrap_err().to_string();
    assert!(e.contains("/nonexistent/ca.pem"), "{e}");
    let not_pem = format!("etcd_ca_file = \"{}\"", dir.join("none.pem").display());
    std::fs::write(dir.join("none.pem"), "not a certificate\n").unwrap();
    assert!(with(https, &not_pem).is_err(), "a file with no certificate");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn defaults_are_the_documented_ones() {
    let c = Config::default();
    assert_eq!(c.listen.tcp, "127.0.0.1:7370");
    assert_eq!(c.listen.quic, "127.0.0.1:7371");
    assert_eq!(c.memory.size, 1 << 30);
    assert_eq!(c.data_dir(), PathBuf::from("/dev/shm/kvpool-0"));
    assert_eq!(c.limits.max_header, 8 << 20);
    assert_eq!(c.limits.max_header_unauthenticated, 64 << 10);
    assert_eq!(c.limits.handshake_timeout_ms, 10_000);
    assert_eq!(c.limits.idle_timeout_ms, 0);
    assert_eq!(c.limits.write_timeout_ms, 30_000);
    assert_eq!(c.limits.read_timeout_ms, 30_000);
    assert_eq!(c.listen.max_connections_per_peer, 256);
    assert_eq!(c.listen.reserve_fds, 64);
    assert_eq!(c.listen.metrics_namespaces, NamespaceMetrics::Off);
    assert_eq!(
        (c.limits.auth_failures, c.limits.auth_failure_refill_ms),
        (10, 1_000)
    );
    assert_eq!(c.limits.auth_failures_per_second, 100);
    assert_eq!(c.limits.cluster_auth_failures_per_second, 20);
    let budgets = Config::from_toml(
        "[limits]\nauth_failures_per_second = 5\ncluster_auth_failures_per_second = 0",
    )
    .unwrap();
    assert_eq!(budgets.limits.auth_failures_per_second, 5);
    assert_eq!(budgets.limits.cluster_auth_failures_per_second, 0);
    let h = c.hello_limits().unwrap();
    assert_eq!((h.max_header, h.max_payload), (64 << 10, 0));
    let open = Config::from_toml("[listen]\nmetrics_namespaces = \"token\"").unwrap();
    assert_eq!(open.listen.metrics_namespaces, NamespaceMetrics::Token);
    assert!(Config::from_toml("[listen]\nmetrics_namespaces = \"maybe\"").is_err());
}

#[test]
fn the_disk_tier_is_off_by_default_and_checked_when_on() {
    let c = Config::default();
    assert_eq!(c.disk.path, None);
    assert_eq!(c.disk.region_size, 64 << 20);
    assert_eq!(c.disk.queue, 256 << 20);
    assert_eq!(c.disk.admit, DiskAdmit::ReadOnce);
    assert_eq!(c.disk.io, kvpool::disk::IoEngine::Direct);
    assert_eq!(c.disk_tier().unwrap(), None);

    let on = Config::from_toml(
        "[disk]\npath = \"/var/lib/kvpool\"\ncapacity = \"64GiB\"\nregion_size = \"16MiB\"\n\
         queue = \"32MiB\"\nadmit = \"all\"\nio = \"buffered\"",
    )
    .unwrap();
    let tier = on.disk_tier().unwrap().unwrap();
    assert_eq!(tier.store.dir, PathBuf::from("/var/lib/kvpool"));
    assert_eq!(tier.store.capacity, 64 << 30);
    assert_eq!(tier.store.region_size, 16 << 20);
    assert_eq!(tier.store.regions(), 4096);
    assert_eq!((tier.queue, tier.admit), (32 << 20, DiskAdmit::All));
    assert_eq!(tier.io, kvpool::disk::IoEngine::Buffered);

    let err = |toml: &str| {
        let c = Config::from_toml(toml).unwrap();
        format!("{:#}", c.disk_tier().unwrap_err())
    };
    assert!(err("[disk]\npath = \"/d\"").contains("disk.capacity is not"));
    assert!(err("[disk]\ncapacity = \"1GiB\"").contains("disk.path is not"));
    assert!(err("[disk]\npath = \"\"\ncapacity = \"1GiB\"").contains("must not be empty"));
    assert!(
        err("[disk]\npath = \"/d\"\ncapacity = \"1GiB\"\nregion_size = 1000")
            .contains("multiple of 4 KiB")
    );
    assert!(err("[disk]\npath = \"/d\"\ncapacity = \"100MiB\"").contains("two regions"));
    assert!(err("[disk]\npath = \"/d\"\ncapacity = \"1GiB\"\nqueue = 0").contains("disk.queue"));
    assert!(Config::from_toml("[disk]\nadmit = \"sometimes\"").is_err());
    assert!(Config::from_toml("[disk]\nio = \"mmap\"").is_err());
    assert!(
        Config::from_toml("[disk]\nsize = \"1GiB\"").is_err(),
        "unknown key"
    );
    assert_eq!(DiskAdmit::parse("read-once").unwrap(), DiskAdmit::ReadOnce);
    assert!(DiskAdmit::parse("most").is_err());
}
