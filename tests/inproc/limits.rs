//! Sizes: values larger than a stream's buffer, batches cut to the node's limits, and what
//! the node refuses with which code.

use kvpool_client::{ClientError, ErrorCode};

use crate::harness::{keys, pairs, refs, value_of, Net};

#[tokio::test]
async fn a_value_larger_than_the_stream_buffer_round_trips() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let v = value_of(b"large value ", 3 << 20);
    kv.put(b"big", &v).await.unwrap();
    assert_eq!(kv.get(b"big").await.unwrap().unwrap(), v);
    let mut buf = vec![0u8; 3 << 20];
    assert_eq!(kv.get_into(b"big", &mut buf).await.unwrap(), Some(3 << 20));
    assert_eq!(buf, v);
}

const SMALL_PAYLOAD: &str = "[limits]\nmax_payload = \"64KiB\"\n";

#[tokio::test]
async fn a_batch_over_the_payload_limit_is_cut_into_requests_that_fit() {
    let net = Net::default();
    let node = net.start(1, SMALL_PAYLOAD).await;
    let kv = net.client(&node).await;
    let ks = keys("cut", 10);
    let vals: Vec<Vec<u8>> = ks.iter().map(|k| value_of(k, 20 << 10)).collect();
    let items = pairs(&ks, &vals);
    let codes = kv.batch_put_from(&items).await.unwrap();
    assert_eq!(codes, vec![ErrorCode::Ok; 10]);
    for (k, v) in ks.iter().zip(&vals) {
        assert_eq!(&kv.get(k).await.unwrap().unwrap(), v);
    }
}

#[tokio::test]
async fn a_value_over_the_payload_limit_is_refused_as_too_large_a_frame() {
    let net = Net::default();
    let node = net.start(1, SMALL_PAYLOAD).await;
    let kv = net.client(&node).await;
    let err = kv.put(b"k", &vec![1u8; 100 << 10]).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::FrameTooLarge), "{err}");
    // The node closed that stream; the next call opens another.
    kv.put(b"k", &vec![1u8; 10 << 10]).await.unwrap();
    assert_eq!(kv.get(b"k").await.unwrap().map(|v| v.len()), Some(10 << 10));
}

#[tokio::test]
async fn a_batch_with_more_keys_than_the_node_takes_is_cut() {
    let net = Net::default();
    let node = net.start(1, "[limits]\nmax_batch = 8\n").await;
    let kv = net.client(&node).await;
    let ks = keys("many", 50);
    let items: Vec<(&[u8], &[u8])> = ks.iter().map(|k| (&k[..], &b"v"[..])).collect();
    assert_eq!(
        kv.batch_put_from(&items).await.unwrap(),
        vec![ErrorCode::Ok; 50]
    );
    assert_eq!(kv.batch_exists(&refs(&ks)).await.unwrap(), 50);
    let mut bufs = vec![vec![0u8; 1]; 50];
    let mut dsts: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let lens = kv.batch_get_into(&refs(&ks), &mut dsts).await.unwrap();
    assert_eq!(lens, vec![Some(1); 50]);
}

#[tokio::test]
async fn an_empty_key_is_refused_as_a_bad_key() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let err = kv.put(b"", b"v").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadKey));
}

#[tokio::test]
async fn a_key_over_the_nodes_length_limit_is_refused_as_a_bad_key() {
    let net = Net::default();
    let node = net.start(1, "[limits]\nmax_key_len = 16\n").await;
    let kv = net.client(&node).await;
    kv.put(&[b'k'; 16], b"v").await.unwrap();
    let err = kv.put(&[b'k'; 17], b"v").await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::BadKey));
    assert!(matches!(err, ClientError::Server { .. }));
}

#[tokio::test]
async fn a_value_larger_than_the_pool_is_refused() {
    let net = Net::default();
    let node = net.start(1, "").await;
    let kv = net.client(&node).await;
    let err = kv.put(b"huge", &vec![0u8; 9 << 20]).await.unwrap_err();
    assert_eq!(err.code(), Some(ErrorCode::TooLarge), "{err}");
    assert!(!kv.exists(b"huge").await.unwrap());
}
