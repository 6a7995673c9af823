use super::*;

fn cfg(workers: usize) -> BulkConfig {
    BulkConfig {
        workers,
        spare: 0,
        quiet: QUIET,
        rate: None,
        ns_rates: vec![None, None],
        threshold: 256 << 10,
        hold: Duration::from_millis(5),
        chunk: 1 << 20,
    }
}

const MIB: u64 = 1 << 20;

/// Drives `st` by hand: every flow keeps `depth` chunks queued; each round returns the
/// oldest grant and refills. Returns the grants per flow.
fn run(st: &mut State, flows: &[(FlowKey, usize)], rounds: usize) -> HashMap<FlowKey, u64> {
    let t0 = Instant::now();
    let mut rxs: Vec<(FlowKey, oneshot::Receiver<bool>)> = Vec::new();
    let mut granted: HashMap<FlowKey, u64> = HashMap::new();
    for &(f, depth) in flows {
        for _ in 0..depth {
            let (tx, rx) = oneshot::channel();
            st.enqueue(f, MIB, tx);
            rxs.push((f, rx));
        }
    }
    st.dispatch(t0, false, 0);
    for round in 0..rounds {
        // Whatever was granted: count it, return its grant, queue its flow's next chunk.
        let mut next = Vec::new();
        for (f, mut rx) in rxs.drain(..) {
            if rx.try_recv().is_ok() {
                *granted.entry(f).or_default() += 1;
                st.free += 1;
                let (tx, rx) = oneshot::channel();
                st.enqueue(f, MIB, tx);
                next.push((f, rx));
            } else {
                next.push((f, rx));
            }
        }
        rxs = next;
        st.dispatch(t0 + Duration::from_millis(round as u64), true, 0);
    }
    granted
}

fn flow(ns: u32, priority: Priority) -> FlowKey {
    FlowKey { ns, priority }
}

#[test]
fn two_namespaces_share_equally_whatever_their_connections() {
    let c = cfg(1);
    let mut st = State::new(&c, Instant::now());
    let (a, b) = (flow(0, Priority::Normal), flow(1, Priority::Normal));
    let g = run(&mut st, &[(a, 4), (b, 1)], 1000);
    let (ga, gb) = (g[&a], g[&b]);
    assert!(ga + gb >= 999, "{ga} + {gb}");
    assert!(ga.abs_diff(gb) <= 2, "a {ga}, b {gb}");
}

#[test]
fn shares_follow_priority_weights_and_background_is_not_starved() {
    let c = cfg(1);
    let mut st = State::new(&c, Instant::now());
    let (h, n, bg) = (
        flow(0, Priority::High),
        flow(1, Priority::Normal),
        flow(CLUSTER_NS, Priority::Background),
    );
    let g = run(&mut st, &[(h, 2), (n, 2), (bg, 2)], 1300);
    // Weights 8 : 4 : 1 of 1300 grants: 800, 400, 100.
    assert!(g[&h].abs_diff(800) <= 4, "{g:?}");
    assert!(g[&n].abs_diff(400) <= 4, "{g:?}");
    assert!(g[&bg].abs_diff(100) <= 4, "{g:?}");
}

#[test]
fn grants_never_exceed_the_workers() {
    let c = cfg(3);
    let mut st = State::new(&c, Instant::now());
    let now = Instant::now();
    let mut rxs = Vec::new();
    for i in 0..10 {
        let (tx, rx) = oneshot::channel();
        st.enqueue(flow(i % 2, Priority::Normal), MIB, tx);
        rxs.push(rx);
    }
    st.dispatch(now, false, 0);
    let granted = rxs
        .iter_mut()
        .map(|r| r.try_recv().is_ok() as usize)
        .sum::<usize>();
    assert_eq!((granted, st.free, st.waiting.len()), (3, 0, 7));
}

#[test]
fn a_namespace_over_its_rate_steps_aside_for_the_others() {
    let mut c = cfg(1);
    c.ns_rates = vec![Some(MIB), None];
    let t0 = Instant::now();
    let mut st = State::new(&c, t0);
    let (slow, fast) = (flow(0, Priority::Normal), flow(1, Priority::Normal));
    let mut rxs = Vec::new();
    for f in [slow, slow, fast, fast] {
        let (tx, rx) = oneshot::channel();
        st.enqueue(f, MIB, tx);
        rxs.push(rx);
    }
    // The slow namespace's bucket holds one chunk: its first goes, then it owes a chunk.
    st.dispatch(t0, false, 0);
    assert!(rxs[0].try_recv().is_ok());
    st.free += 1;
    st.dispatch(t0, true, 0);
    // Its second chunk is held back; the other namespace's go meanwhile.
    assert!(rxs[1].try_recv().is_err() && rxs[2].try_recv().is_ok());
    st.free += 1;
    st.dispatch(t0, true, 0);
    assert!(rxs[1].try_recv().is_err() && rxs[3].try_recv().is_ok());
    st.free += 1;
    st.dispatch(t0, true, 0);
    let retry = st
        .retry_at
        .expect("a retry time while a rate holds a chunk back");
    assert!(retry > t0 + Duration::from_millis(900), "{retry:?}");
    st.dispatch(t0 + Duration::from_millis(1001), false, 0);
    assert!(rxs[1].try_recv().is_ok());
}

#[test]
fn the_node_rate_paces_every_grant() {
    let mut c = cfg(4);
    c.rate = Some(10 * MIB);
    let t0 = Instant::now();
    let mut st = State::new(&c, t0);
    let mut rxs = Vec::new();
    for _ in 0..4 {
        let (tx, rx) = oneshot::channel();
        st.enqueue(flow(0, Priority::Normal), MIB, tx);
        rxs.push(rx);
    }
    // A burst of 0.1 s at 10 MiB/s is one chunk; the next must wait 0.1 s per chunk.
    st.dispatch(t0, false, 0);
    let first = rxs
        .iter_mut()
        .map(|r| r.try_recv().is_ok() as usize)
        .sum::<usize>();
    assert_eq!(first, 1);
    st.dispatch(t0 + Duration::from_millis(50), false, 0);
    assert_eq!(
        rxs.iter_mut()
            .map(|r| r.try_recv().is_ok() as usize)
            .sum::<usize>(),
        0
    );
    st.dispatch(t0 + Duration::from_millis(101), false, 0);
    assert_eq!(
        rxs.iter_mut()
            .map(|r| r.try_recv().is_ok() as usize)
            .sum::<usize>(),
        1
    );
}

#[test]
fn admission_refuses_what_cannot_finish_in_time() {
    let mut c = cfg(1);
    c.rate = Some(100 * MIB);
    let bulk = Bulk::new(c);
    // 100 MiB at 100 MiB/s: about a second.
    let ahead = bulk
        .admit(0, Priority::Normal, 100 * MIB, None)
        .expect("no deadline");
    let r = bulk.admit(1, Priority::Normal, MIB, Some(Duration::from_millis(5)));
    // Fair queueing serves the other flow only as much as this one meanwhile: 2 MiB.
    let e = r.err().expect("2 MiB at 100 MiB/s takes 20 ms");
    assert!(
        e.estimate >= Duration::from_millis(19) && e.estimate <= Duration::from_millis(21),
        "{e:?}"
    );
    assert!(bulk
        .admit(1, Priority::Normal, MIB, Some(Duration::from_millis(30)))
        .is_ok());
    // A high-priority request is served 8 : 4 ahead of the normal one.
    let e = bulk
        .admit(2, Priority::High, 8 * MIB, Some(Duration::from_millis(1)))
        .err()
        .expect("refused");
    assert!(
        e.estimate >= Duration::from_millis(115) && e.estimate <= Duration::from_millis(125),
        "{e:?}"
    );
    drop(ahead);
    assert!(bulk
        .admit(1, Priority::Normal, MIB, Some(Duration::from_millis(15)))
        .is_ok());
}

/// Counts the grants out: (workers', spare).
fn out(bulk: &Bulk) -> (usize, usize) {
    let st = bulk.lock();
    (bulk.cfg.workers - st.free, st.spare_out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kept_worker_moves_bulk_only_while_no_small_request_is_served() {
    let mut c = cfg(1);
    (c.spare, c.quiet) = (1, Duration::from_secs(30));
    let bulk = Bulk::new(c);
    let mut t = [0, 1, 2].map(|ns| bulk.admit(ns, Priority::Normal, 8 * MIB, None).unwrap());
    // No small request yet: the worker's grant, then the spare one, then none.
    let g1 = t[0].chunk(MIB).await;
    let g2 = t[1].chunk(MIB).await;
    assert_eq!(
        (g1.spare, g2.spare, out(&bulk)),
        (Some(false), Some(true), (1, 1))
    );
    let third = tokio::time::timeout(Duration::from_millis(20), t[2].chunk(MIB)).await;
    assert!(
        third.is_err(),
        "a third chunk moved with one worker and one spare"
    );
    // A small request is served: the spare grant out finishes its chunk, and no other
    // goes out while the window lasts; the worker's grant still does.
    bulk.served_small();
    drop(g2);
    assert_eq!(out(&bulk), (1, 0));
    let third = tokio::time::timeout(Duration::from_millis(20), t[2].chunk(MIB)).await;
    assert!(
        third.is_err(),
        "a spare grant went out right after a small request"
    );
    drop(g1);
    let g3 = t[2].chunk(MIB).await;
    assert_eq!((g3.spare, out(&bulk)), (Some(false), (1, 0)));
    drop(g3);
    assert_eq!(out(&bulk), (0, 0));
    drop(t);
    assert!(bulk.lock().flows.values().all(|f| f.remaining == 0));

    // Once the window has passed with no small request, spare grants go out again.
    let mut c = cfg(1);
    (c.spare, c.quiet) = (1, Duration::from_millis(30));
    let bulk = Bulk::new(c);
    bulk.served_small();
    let mut t = [0, 1].map(|ns| bulk.admit(ns, Priority::Normal, 8 * MIB, None).unwrap());
    let g1 = t[0].chunk(MIB).await;
    tokio::time::sleep(Duration::from_millis(60)).await;
    let g2 = t[1].chunk(MIB).await;
    assert_eq!(
        (g1.spare, g2.spare, out(&bulk)),
        (Some(false), Some(true), (1, 1))
    );
    // A waiter granted a spare grant while it was being dropped hands it back.
    drop(g2);
    let pending = t[1].chunk(MIB);
    drop(pending);
    drop(g1);
    assert_eq!(out(&bulk), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_dropped_in_the_queue_or_at_its_grant_leaks_nothing() {
    let bulk = Bulk::new(cfg(1));
    let mut t1 = bulk.admit(0, Priority::Normal, 4 * MIB, None).unwrap();
    let mut t2 = bulk.admit(1, Priority::Normal, 4 * MIB, None).unwrap();
    let g1 = t1.chunk(MIB).await;
    // The second waits behind the first grant; dropping it leaves the queue.
    let wait = tokio::time::timeout(Duration::from_millis(20), t2.chunk(MIB)).await;
    assert!(wait.is_err());
    assert!(bulk.lock().waiting.is_empty());
    drop(g1);
    assert_eq!(bulk.lock().free, 1);
    // Granted while dropped: the grant comes back.
    let g = t2.chunk(MIB).await;
    let pending = t1.chunk(MIB);
    drop(g);
    drop(pending);
    let st = bulk.lock();
    assert_eq!((st.free, st.waiting.len()), (1, 0));
    drop(st);
    drop((t1, t2));
    assert!(bulk.lock().flows.values().all(|f| f.remaining == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_held_back_by_the_rate_when_a_grant_returns_still_gets_its_turn() {
    let mut c = cfg(1);
    c.rate = Some(4 * MIB);
    let bulk = Bulk::new(c);
    let mut t1 = bulk.admit(0, Priority::Normal, MIB, None).unwrap();
    let mut t2 = bulk.admit(1, Priority::Normal, MIB, None).unwrap();
    // The first chunk empties the bucket (its burst is one chunk); the second queues for
    // the grant, and when the grant comes back the rate holds it back a quarter second:
    // nobody's timer was set for that until the release told the waiters.
    let g = t1.chunk(MIB).await;
    let second = async {
        let _g = t2.chunk(MIB).await;
    };
    let release = async {
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(g);
    };
    let both = async { tokio::join!(second, release) };
    tokio::time::timeout(Duration::from_secs(10), both)
        .await
        .expect("the second chunk got its turn once the bucket refilled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_lapses_after_its_hold() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let bulk = Bulk::new(cfg(1));
    let done = AtomicBool::new(false);
    let mut t = bulk.admit(0, Priority::Normal, 2 * MIB, None).unwrap();
    let g = t.chunk(MIB).await;
    // A chunk that takes far longer than the hold (5 ms): a peer reading slowly.
    let slow = under(g, Duration::from_millis(5), async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        done.store(true, Ordering::SeqCst);
    });
    let mut t2 = bulk.admit(1, Priority::Normal, MIB, None).unwrap();
    let other = async {
        let _g = t2.chunk(MIB).await;
        done.load(Ordering::SeqCst)
    };
    let ((), slow_was_done) = tokio::join!(slow, other);
    assert!(
        !slow_was_done,
        "the next chunk waited for the slow one to finish"
    );
}
