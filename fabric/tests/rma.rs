//! One-sided reads and writes over the `tcp` provider (offset addressing) and the `shm`
//! provider (virtual addressing), between two endpoints of two domains in this process: the
//! serving one polled by a thread of its own, as a node's progress would. Every byte is
//! checked; ranges out of bounds are refused; a forged key is refused by the provider that
//! checks keys, and the serving side goes on serving another peer either way.

use kvpool_system_tests::deps::require_libfabric;

/// Whether the test may go on: the binding is built and the provider is there.
fn available(test: &str) -> bool {
    require_libfabric(kvpool_fabric::AVAILABLE, test)
}

/// The checks, compiled where the binding is.
#[cfg(libfabric)]
mod checks {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    const LEN: usize = 2 << 20;

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(131) ^ (i >> 11)) as u8
    }

    /// Another reading endpoint, in a domain of its own, and the serving endpoint's address in it.
    type Second = (
        kvpool_fabric::Endpoint,
        kvpool_fabric::Peer,
        kvpool_fabric::Fabric,
    );

    /// Runs `check` with a reading endpoint, the peer address of a serving endpoint in another
    /// domain of `provider`, and the remote description of the serving endpoint's region (filled
    /// with [`pattern`]), while a thread polls the serving endpoint.
    fn with_server(
        provider: &str,
        check: impl FnOnce(
            &mut kvpool_fabric::Endpoint,
            kvpool_fabric::Peer,
            kvpool_fabric::Remote,
            &dyn Fn() -> Result<Second, kvpool_fabric::Error>,
        ),
    ) -> Vec<u8> {
        use kvpool_fabric::Fabric;
        let server_fabric = Fabric::open(provider).unwrap_or_else(|e| panic!("{provider}: {e}"));
        let client_fabric = Fabric::open(provider).unwrap();
        println!(
            "{provider}: provider {}, mr_mode {:#x}, virtual addressing {}, keys {}, checked {}",
            server_fabric.provider(),
            server_fabric.mr_mode(),
            server_fabric.virtual_addressing(),
            if server_fabric.provider_keys() {
                "the provider's"
            } else {
                "random"
            },
            server_fabric.checks_keys(),
        );
        let mut server = server_fabric.serving_endpoint().unwrap();
        let mut region = server.register(LEN, true, true).unwrap();
        for (i, b) in region.bytes_mut().iter_mut().enumerate() {
            *b = pattern(i);
        }
        let remote = region.remote();
        assert_eq!(remote.len, LEN as u64);
        assert_eq!(
            remote.addr != 0,
            server_fabric.virtual_addressing(),
            "an address under the provider's addressing"
        );
        let mut client = client_fabric.endpoint().unwrap();
        let server_name = server.name().unwrap();
        let peer = client.insert(&server_name).unwrap();
        server.insert(&client.name().unwrap()).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = stop.clone();
        let progress = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                // A peer's failed access shows as an error here; the serving side goes on,
                // sleeping until the provider has work (or the next look at `stopping`).
                let _ = server.wait(20, std::time::Duration::from_micros(50));
            }
            let bytes = region.bytes().to_vec();
            drop(region);
            bytes
        });
        let name = server_name;
        let second = || -> Result<Second, kvpool_fabric::Error> {
            let f = Fabric::open(provider)?;
            let ep = f.endpoint()?;
            let peer = ep.insert(&name)?;
            Ok((ep, peer, f))
        };
        check(&mut client, peer, remote, &second);
        stop.store(true, Ordering::Relaxed);
        progress.join().unwrap()
    }

    pub(super) fn reads_and_writes(provider: &str) {
        let served = with_server(provider, |client, peer, remote, second| {
            // A whole 2 MiB read, every byte checked.
            let mut dst = client.register(LEN, false, false).unwrap();
            client.read((&mut dst, 0..LEN), peer, &remote, 0).unwrap();
            assert!(dst
                .bytes()
                .iter()
                .enumerate()
                .all(|(i, &b)| b == pattern(i)));
            // A read of a range in the middle, into the middle of the buffer.
            let mut part = client.register(64 << 10, false, false).unwrap();
            part.bytes_mut().fill(0);
            client
                .read((&mut part, 4096..8192), peer, &remote, 1 << 20)
                .unwrap();
            let got = &part.bytes()[4096..8192];
            assert!(got
                .iter()
                .enumerate()
                .all(|(i, &b)| b == pattern((1 << 20) + i)));
            assert!(part.bytes()[..4096].iter().all(|&b| b == 0));
            // The region in 64 KiB reads, 8 in flight, in reverse order.
            let reads: Vec<_> = (0..LEN / (64 << 10))
                .rev()
                .map(|i| {
                    let at = i * (64 << 10);
                    (at..at + (64 << 10), peer, remote, at as u64)
                })
                .collect();
            dst.bytes_mut().fill(0);
            client.read_many(&mut dst, &reads, 8).unwrap();
            assert!(dst
                .bytes()
                .iter()
                .enumerate()
                .all(|(i, &b)| b == pattern(i)));
            // Straight into unregistered buffers, where the provider allows it (tcp, shm).
            if client.reads_into_any_memory() {
                let mut a = vec![0u8; 64 << 10];
                let mut b = vec![0u8; 4096];
                client
                    .read_many_into(
                        &mut [
                            (&mut a[..], peer, remote, 0),
                            (&mut b[..], peer, remote, (LEN - 4096) as u64),
                        ],
                        2,
                    )
                    .unwrap();
                assert!(a.iter().enumerate().all(|(i, &x)| x == pattern(i)));
                assert!(b
                    .iter()
                    .enumerate()
                    .all(|(i, &x)| x == pattern(LEN - 4096 + i)));
                let mut past = vec![0u8; 8192];
                let e = client
                    .read_many_into(&mut [(&mut past[..], peer, remote, (LEN - 4096) as u64)], 1)
                    .unwrap_err();
                assert_eq!(e.op, "range out of bounds");
            }
            // Overlapping ranges are refused.
            let twice = [reads[0].clone(), reads[0].clone()];
            let e = client.read_many(&mut dst, &twice, 8).unwrap_err();
            assert_eq!(e.op, "overlapping ranges");
            // A write of 1 MiB at 512 KiB, then read back.
            let mut src = client.register(1 << 20, false, false).unwrap();
            src.bytes_mut().fill(0x5a);
            client
                .write((&src, 0..1 << 20), peer, &remote, 512 << 10)
                .unwrap();
            client.read((&mut dst, 0..LEN), peer, &remote, 0).unwrap();
            for (i, &b) in dst.bytes().iter().enumerate() {
                let want = if (512 << 10..(512 << 10) + (1 << 20)).contains(&i) {
                    0x5a
                } else {
                    pattern(i)
                };
                assert_eq!(b, want, "byte {i}");
            }
            // Out of bounds, on either side: refused before anything is posted.
            let e = client
                .read((&mut part, 0..4096), peer, &remote, LEN as u64 - 100)
                .unwrap_err();
            assert_eq!(e.op, "range out of bounds");
            let e = client
                .read(
                    (&mut part, (64 << 10) - 10..(64 << 10) + 10),
                    peer,
                    &remote,
                    0,
                )
                .unwrap_err();
            assert_eq!(e.op, "range out of bounds");
            // A key the serving side never gave out: the provider refuses the access.
            let forged = kvpool_fabric::Remote {
                key: remote.key ^ 0xdead_0000,
                ..remote
            };
            let e = client.read((&mut part, 0..4096), peer, &forged, 0);
            if provider == "tcp" {
                // The provider checks keys: the access is refused, and the connection of the
                // peer that tried it is closed.
                assert!(e.is_err(), "a forged key read {provider}'s memory");
                let after = client.read((&mut part, 0..4096), peer, &remote, 0);
                println!("{provider}: the same peer's next read: {after:?}");
            } else {
                // shm moves the bytes with the kernel's cross-memory attach by virtual address
                // and does not check the key: it is no boundary between tenants (docs).
                println!("{provider}: keys are not checked: {e:?}");
            }
            // Another peer is served as before.
            let mut other = second().unwrap();
            let mut buf = other.0.register(4096, false, false).unwrap();
            other
                .0
                .read((&mut buf, 0..4096), other.1, &remote, 8192)
                .unwrap();
            assert!(buf
                .bytes()
                .iter()
                .enumerate()
                .all(|(i, &b)| b == pattern(8192 + i)));
        });
        // The serving side's memory holds the write.
        assert!(served[512 << 10..(512 << 10) + (1 << 20)]
            .iter()
            .all(|&b| b == 0x5a));
        assert_eq!(served[0], pattern(0));
    }
}

#[test]
fn one_sided_reads_and_writes_over_tcp() {
    if available("one_sided_reads_and_writes_over_tcp") {
        #[cfg(libfabric)]
        checks::reads_and_writes("tcp");
    }
}

#[test]
fn one_sided_reads_and_writes_over_shm() {
    if available("one_sided_reads_and_writes_over_shm") {
        #[cfg(libfabric)]
        checks::reads_and_writes("shm");
    }
}
