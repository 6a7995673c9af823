//! The daemon's TOML configuration (kvpool-server's `Config`) and every value derived from it
//! at start: the wire limits, the RESP limits, the pool's configuration (no pool is built),
//! per-namespace tokens, replication and bulk rates; and the size, rate and address parsers.
//!
//! Asserts: no panic, whatever the text; limits derived are the ones configured.
#![no_main]

use kvpool_server::config::{parse_listen, parse_rate, parse_size};
use kvpool_server::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = parse_size(text);
    let _ = parse_rate(text);
    let _ = parse_listen(text);
    let Ok(config) = Config::from_toml(text) else {
        return;
    };
    if let Ok(l) = config.wire_limits() {
        assert_eq!(u64::from(l.max_header), config.limits.max_header);
        assert_eq!(l.max_payload, config.limits.max_payload);
        if let Ok(h) = config.hello_limits() {
            assert!(h.max_header <= l.max_header && h.max_payload == 0);
        }
        let r = config.resp.limits(l.max_payload);
        assert!(r.max_bulk <= l.max_payload);
    }
    let _ = config.data_dir();
    let _ = config.unix_path();
    if let Ok(pool) = config.pool_config() {
        let names: Vec<(String, u32)> = pool
            .namespaces
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), i as u32))
            .collect();
        assert_eq!(config.namespace_tokens(&names).len(), names.len());
        assert_eq!(config.replication(&names).len(), names.len());
        assert_eq!(config.bulk_rates(&names).len(), names.len());
    }
});
