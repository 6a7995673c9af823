//! Whole values on one node: put, get, a miss as a plain answer, batches, removes, pins,
//! listing.

use futures_util::future::join_all;
use kvpool_client::{ClientError, ErrorCode};

use crate::harness::{keys, pairs, refs, value_of, Net};

#[tokio::test]
async fn a_put_value_is_read_back() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"block-0", b"some bytes").await.unwrap();
    assert_eq!(
        kv.get(b"block-0").await.unwrap().as_deref(),
        Some(&b"some bytes"[..])
    );
    assert!(
        !kv.is_local(),
        "an in-memory stream never takes the same-host path"
    );
}

#[tokio::test]
async fn a_missing_key_is_a_miss_not_an_error() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    assert_eq!(kv.get(b"never-written").await.unwrap(), None);
    let mut buf = [0u8; 8];
    assert_eq!(kv.get_into(b"never-written", &mut buf).await.unwrap(), None);
    assert!(!kv.exists(b"never-written").await.unwrap());
}

#[tokio::test]
async fn exists_follows_puts_and_removes() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"k", b"v").await.unwrap();
    assert!(kv.exists(b"k").await.unwrap());
    assert!(kv.remove(b"k").await.unwrap());
    assert!(!kv.exists(b"k").await.unwrap());
}

#[tokio::test]
async fn a_second_put_replaces_the_value() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"k", b"first").await.unwrap();
    kv.put(b"k", b"second, longer").await.unwrap();
    assert_eq!(kv.get(b"k").await.unwrap().unwrap(), b"second, longer");
}

#[tokio::test]
async fn removing_twice_reports_the_key_gone() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"k", b"v").await.unwrap();
    assert!(kv.remove(b"k").await.unwrap());
    assert!(!kv.remove(b"k").await.unwrap());
    assert_eq!(kv.get(b"k").await.unwrap(), None);
}

#[tokio::test]
async fn get_into_copies_into_the_buffer_and_refuses_a_small_one() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let v = value_of(b"abc", 1000);
    kv.put(b"k", &v).await.unwrap();
    let mut buf = vec![0u8; 2000];
    assert_eq!(kv.get_into(b"k", &mut buf).await.unwrap(), Some(1000));
    assert_eq!(&buf[..1000], &v[..]);
    let mut small = vec![0u8; 10];
    match kv.get_into(b"k", &mut small).await {
        Err(ClientError::BufferTooSmall { need, have }) => assert_eq!((need, have), (1000, 10)),
        other => panic!("expected BufferTooSmall, got {other:?}"),
    }
    // The connection stays in sync after the refusal.
    assert_eq!(kv.get(b"k").await.unwrap().unwrap(), v);
}

#[tokio::test]
async fn a_batch_put_is_read_back_by_a_batch_get_in_order() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let ks = keys("batch", 100);
    let vals: Vec<Vec<u8>> = ks.iter().map(|k| value_of(k, 300)).collect();
    let items = pairs(&ks, &vals);
    let codes = kv.batch_put_from(&items).await.unwrap();
    assert!(codes.iter().all(|c| *c == ErrorCode::Ok), "{codes:?}");
    let mut bufs = vec![vec![0u8; 300]; 100];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let lens = kv.batch_get_into(&refs(&ks), &mut dsts).await.unwrap();
    assert!(lens.iter().all(|l| *l == Some(300)));
    assert_eq!(bufs, vals);
}

#[tokio::test]
async fn a_batch_get_answers_hits_and_misses_per_key() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"a", b"1").await.unwrap();
    kv.put(b"c", b"333").await.unwrap();
    let mut bufs = vec![vec![0u8; 8]; 3];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let lens = kv
        .batch_get_into(&[b"a", b"b", b"c"], &mut dsts)
        .await
        .unwrap();
    assert_eq!(lens, vec![Some(1), None, Some(3)]);
    assert_eq!(&bufs[2][..3], b"333");
}

#[tokio::test]
async fn batch_exists_counts_the_leading_run_and_present_answers_per_key() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    for k in [&b"p0"[..], b"p1", b"p3"] {
        kv.put(k, b"x").await.unwrap();
    }
    let ks: [&[u8]; 4] = [b"p0", b"p1", b"p2", b"p3"];
    assert_eq!(kv.batch_exists(&ks).await.unwrap(), 2);
    assert_eq!(
        kv.present(&ks).await.unwrap(),
        vec![true, true, false, true]
    );
}

#[tokio::test]
async fn batch_remove_counts_what_was_there() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let ks = keys("rm", 10);
    for k in &ks[..6] {
        kv.put(k, b"x").await.unwrap();
    }
    assert_eq!(kv.batch_remove(&refs(&ks)).await.unwrap(), 6);
    assert_eq!(kv.batch_exists(&refs(&ks)).await.unwrap(), 0);
}

#[tokio::test]
async fn a_scattered_get_fills_the_pieces_in_order() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let v = value_of(b"0123456789", 100);
    kv.put(b"k", &v).await.unwrap();
    let (mut a, mut b) = (vec![0u8; 40], vec![0u8; 60]);
    let mut dsts = vec![vec![&mut a[..], &mut b[..]]];
    let lens = kv.batch_get_scatter(&[b"k"], &mut dsts).await.unwrap();
    assert_eq!(lens, vec![Some(100)]);
    assert_eq!([a, b].concat(), v);
}

#[tokio::test]
async fn keys_are_listed_by_prefix() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    for k in keys("list", 5).iter().chain(&keys("other", 3)) {
        kv.put(k, b"x").await.unwrap();
    }
    let mut listed = kv.keys_with_prefix(b"list-").await.unwrap();
    listed.sort();
    assert_eq!(listed, keys("list", 5));
}

#[tokio::test]
async fn remove_all_empties_the_namespace() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let ks = keys("all", 7);
    for k in &ks {
        kv.put(k, b"x").await.unwrap();
    }
    kv.put_pinned(b"pinned", b"y").await.unwrap();
    assert_eq!(kv.remove_all().await.unwrap(), 8);
    assert_eq!(kv.batch_exists(&refs(&ks)).await.unwrap(), 0);
    assert!(!kv.exists(b"pinned").await.unwrap());
}

#[tokio::test]
async fn pin_and_unpin_count_the_objects_there() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    kv.put(b"a", b"x").await.unwrap();
    kv.put(b"b", b"x").await.unwrap();
    assert_eq!(kv.pin(&[b"a", b"b", b"absent"]).await.unwrap(), 2);
    assert_eq!(kv.unpin(&[b"a"]).await.unwrap(), 1);
    kv.put_pinned(b"w", b"weights").await.unwrap();
    assert_eq!(kv.get(b"w").await.unwrap().unwrap(), b"weights");
}

#[tokio::test]
async fn a_wrong_checksum_refuses_that_item_only() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let items: [(&[u8], &[u8]); 2] = [(b"good", b"one"), (b"bad", b"two")];
    let sums = [kvpool::checksum(b"one"), kvpool::checksum(b"two") ^ 1];
    let codes = kv
        .batch_put_pinned_with_checksums(&items, &sums)
        .await
        .unwrap();
    assert_eq!(codes, vec![ErrorCode::Ok, ErrorCode::ChecksumMismatch]);
    assert!(kv.exists(b"good").await.unwrap());
    assert!(!kv.exists(b"bad").await.unwrap());
}

#[tokio::test]
async fn many_concurrent_calls_share_a_few_connections() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let cfg = kvpool_client::ClientConfig {
        max_connections: 2,
        ..net.client_config()
    };
    let kv = net.client_with(&node, cfg).await.unwrap();
    let ks = keys("conc", 64);
    let puts = ks.iter().map(|k| kv.put(k, k));
    for r in join_all(puts).await {
        r.unwrap();
    }
    let gets = ks.iter().map(|k| kv.get(k));
    for (k, r) in ks.iter().zip(join_all(gets).await) {
        assert_eq!(r.unwrap().as_deref(), Some(&k[..]));
    }
    assert!(net.dials() <= 2, "opened {} streams", net.dials());
}
