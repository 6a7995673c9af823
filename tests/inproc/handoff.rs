//! Leases, access by address (two-phase puts, one-sided reads), and handoff: waiting for keys,
//! tombstones, subscriptions and lapsing leases, over the nodes' plain streams.

use std::time::Duration;

use kvpool_client::{ErrorCode, KeyEvent};

use crate::harness::{eventually, holds, Net};

#[tokio::test]
async fn a_lease_locates_present_keys_and_misses_absent_ones() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"here", b"bytes").await.unwrap();
    let found = kv.lease(&[b"here", b"absent"], 1000).await.unwrap();
    let here = found[0].as_ref().expect("located");
    assert_eq!(here.checksum, kvpool::checksum(b"bytes"));
    assert_eq!(here.addr.len, 5);
    assert!(found[1].is_none());
    assert_eq!(kv.release(&[b"here", b"absent"]).await.unwrap(), 1);
}

#[tokio::test]
async fn a_located_object_is_read_by_its_address_until_replaced() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"k", b"0123456789").await.unwrap();
    let addr = kv.lease(&[b"k"], 0).await.unwrap()[0]
        .as_ref()
        .unwrap()
        .addr;
    let mut part = [0u8; 4];
    assert!(kv.read(&addr, 3, &mut part).await.unwrap());
    assert_eq!(&part, b"3456");
    kv.put(b"k", b"replaced!!").await.unwrap();
    assert!(!kv.read(&addr, 0, &mut part).await.unwrap());
}

#[tokio::test]
async fn a_two_phase_put_is_visible_only_once_committed() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let addr = kv.alloc(b"k", 6).await.unwrap();
    kv.write(&addr, 0, b"abc").await.unwrap();
    kv.write(&addr, 3, b"def").await.unwrap();
    assert!(!kv.exists(b"k").await.unwrap());
    kv.commit(&addr, kvpool::checksum(b"abcdef")).await.unwrap();
    assert_eq!(kv.get(b"k").await.unwrap().unwrap(), b"abcdef");
}

#[tokio::test]
async fn a_commit_with_the_wrong_checksum_is_refused() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let addr = kv.alloc(b"k", 3).await.unwrap();
    kv.write(&addr, 0, b"abc").await.unwrap();
    let err = kv
        .commit(&addr, kvpool::checksum(b"abd"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::ChecksumMismatch));
    assert!(!kv.exists(b"k").await.unwrap());
}

#[tokio::test]
async fn an_aborted_allocation_leaves_nothing_behind() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let addr = kv.alloc(b"k", 3).await.unwrap();
    kv.write(&addr, 0, b"abc").await.unwrap();
    kv.abort(&addr).await.unwrap();
    assert!(!kv.exists(b"k").await.unwrap());
    assert!(kv.commit(&addr, kvpool::checksum(b"abc")).await.is_err());
}

#[tokio::test]
async fn a_waiting_consumer_sees_a_key_written_after_it_started() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let consumer = net.client(&node).await;
    let producer = net.client(&node).await;
    let wait = consumer.wait(&[b"a", b"b"], Duration::from_secs(10));
    let write = async {
        producer.put(b"a", b"1").await.unwrap();
        producer.put(b"b", b"2").await.unwrap();
    };
    let (outcome, ()) = tokio::join!(wait, write);
    assert!(outcome.unwrap().complete());
}

#[tokio::test]
async fn a_wait_reports_keys_not_written_in_time_as_missing() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"there", b"1").await.unwrap();
    let outcome = kv
        .wait(&[b"there", b"never"], Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(outcome.missing, vec![b"never".to_vec()]);
    assert!(outcome.failed.is_empty());
}

#[tokio::test]
async fn a_producers_tombstone_ends_the_wait_with_its_reason() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let consumer = net.client(&node).await;
    let producer = net.client(&node).await;
    let wait = consumer.wait(&[b"k"], Duration::from_secs(10));
    let fail = async {
        // Posted once the consumer's watch is in place or before: either way it is seen.
        assert_eq!(producer.fail(&[b"k"], "prefill crashed").await.unwrap(), 1);
    };
    let (outcome, ()) = tokio::join!(wait, fail);
    let outcome = outcome.unwrap();
    assert_eq!(
        outcome.failed,
        vec![(b"k".to_vec(), "prefill crashed".to_string())]
    );
    assert!(!outcome.complete());
}

#[tokio::test]
async fn a_subscription_hears_of_every_key_written_under_its_prefix() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let mut sub = kv.subscribe(b"req-7/").await.unwrap();
    kv.put(b"other/x", b"1").await.unwrap();
    kv.put(b"req-7/block-0", b"2").await.unwrap();
    match sub.recv_within(Duration::from_secs(10)).await {
        Some(KeyEvent::Written(k)) => assert_eq!(k, b"req-7/block-0"),
        other => panic!("expected the write of req-7/block-0, got {other:?}"),
    }
}

#[tokio::test]
async fn a_key_whose_lease_lapses_is_removed() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"short-lived", b"v").await.unwrap();
    kv.put(b"kept", b"v").await.unwrap();
    assert_eq!(
        kv.expire(&[b"short-lived"], Duration::from_millis(1))
            .await
            .unwrap(),
        1
    );
    eventually("the lapsed key is removed", || {
        !holds(&node, 0, b"short-lived")
    })
    .await;
    assert_eq!(kv.get(b"short-lived").await.unwrap(), None);
    assert!(kv.exists(b"kept").await.unwrap());
}
