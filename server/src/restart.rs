//! Restarts in place: the note a node leaves in its data directory when it stops for a restart
//! (`[cluster] restart_on_shutdown`), and what the next process on that directory makes of it.
//!
//! The note, `restart-<node>.json`, holds the node's last view (its own record `restarting`),
//! when it left (wall-clock milliseconds) and the restart window it left under. It is written
//! once the node has told the others it is restarting and its last request has finished, and
//! is read and removed by the next start on the directory (so a later crash starts afresh).
//! It is only this node's own account: whether the cluster still holds its keys for it is
//! decided against the others' records (`kvpool::membership::Membership::resume`).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvpool::placement::{ClusterView, NodeState};
use serde::{Deserialize, Serialize};

use crate::etcd_gateway::{decode_record, encode_record};

/// Largest note read back (a view of thousands of nodes fits many times over).
const MAX_NOTE: u64 = 16 << 20;

#[derive(Serialize, Deserialize)]
struct Note {
    node: u32,
    left_at_ms: u64,
    window_ms: u64,
    view: Vec<serde_json::Value>,
}

/// What the previous process left for a restart in place.
#[derive(Debug)]
pub(crate) struct Departed {
    /// Its last view, its own record restarting.
    pub(crate) view: ClusterView,
    /// What is left of the restart window it left under (or of this node's own, if shorter).
    pub(crate) remaining: Duration,
}

fn path(dir: &Path, node: u32) -> PathBuf {
    dir.join(format!("restart-{node}.json"))
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Leaves the note of node `node`, stopping for a restart with `view` as its last view.
pub(crate) fn leave_note(
    dir: &Path,
    node: u32,
    view: &ClusterView,
    window: Duration,
) -> std::io::Result<()> {
    let note = Note {
        node,
        left_at_ms: unix_ms(),
        window_ms: window.as_millis() as u64,
        view: view
            .nodes
            .iter()
            .map(|n| serde_json::from_slice(&encode_record(n)).expect("a record is JSON"))
            .collect(),
    };
    let body = serde_json::to_vec(&note).map_err(std::io::Error::other)?;
    let tmp = dir.join(format!("restart-{node}.json.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&body)?;
    drop(f);
    std::fs::rename(&tmp, path(dir, node))
}

/// Takes node `node`'s note from `dir` (removing it), when there is one it can resume by:
/// readable, of this node, holding this node's record restarting, and left less than the
/// window ago (the shorter of the one it left under and `window`, this process's). Says in
/// the log why a note found is not used.
pub(crate) fn take_note(dir: &Path, node: u32, window: Duration) -> Option<Departed> {
    let p = path(dir, node);
    let body = match std::fs::metadata(&p) {
        Ok(m) if m.len() > MAX_NOTE => Err("too large".to_string()),
        Ok(_) => std::fs::read(&p).map_err(|e| e.to_string()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => Err(e.to_string()),
    };
    // Once only, whatever it says.
    let _ = std::fs::remove_file(&p);
    let found = body.and_then(|b| parse(&b, node, window, unix_ms()));
    match found {
        Ok(d) => Some(d),
        Err(why) => {
            tracing::info!(path = %p.display(), %why, "not resuming a restart in place");
            None
        }
    }
}

fn parse(body: &[u8], node: u32, window: Duration, now_ms: u64) -> Result<Departed, String> {
    let note: Note = serde_json::from_slice(body).map_err(|e| format!("unreadable: {e}"))?;
    if note.node != node {
        return Err(format!("it is node {}'s", note.node));
    }
    let mut nodes = Vec::with_capacity(note.view.len());
    for v in &note.view {
        let b = serde_json::to_vec(v).map_err(|e| e.to_string())?;
        nodes.push(decode_record(&b).ok_or("a record is unreadable")?);
    }
    let view = ClusterView::from_nodes(nodes);
    let mine = view.node(kvpool::NodeId(node)).map(|n| n.state);
    if mine != Some(NodeState::Restarting) {
        return Err("its own record is not restarting".into());
    }
    let window = note.window_ms.min(window.as_millis() as u64);
    let away = now_ms.saturating_sub(note.left_at_ms);
    if away >= window {
        return Err(format!(
            "it left {away} ms ago, past its restart window of {window} ms"
        ));
    }
    Ok(Departed {
        view,
        remaining: Duration::from_millis(window - away),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpool::placement::NodeInfo;

    fn view(me_state: NodeState) -> ClusterView {
        ClusterView::from_nodes(vec![
            NodeInfo {
                tcp: "127.0.0.1:1".into(),
                ..NodeInfo::serving(0, 10)
            },
            NodeInfo {
                tcp: "127.0.0.1:2".into(),
                state: me_state,
                epoch: 3,
                ..NodeInfo::serving(1, 10)
            },
        ])
    }

    #[test]
    fn a_note_is_read_once_with_the_window_left() {
        let dir = kvpool_system_tests::temp_dir("restart-note");
        let v = view(NodeState::Restarting);
        leave_note(&dir, 1, &v, Duration::from_secs(60)).unwrap();
        let d = take_note(&dir, 1, Duration::from_secs(30)).expect("resumable");
        assert_eq!(d.view.nodes, v.nodes);
        assert!(d.remaining <= Duration::from_secs(30), "the shorter window");
        assert!(d.remaining > Duration::from_secs(20));
        assert!(
            take_note(&dir, 1, Duration::from_secs(30)).is_none(),
            "once only"
        );
    }

    #[test]
    fn a_note_past_its_window_or_of_another_node_is_not_used() {
        let v = view(NodeState::Restarting);
        let note = |node, left_at_ms| {
            serde_json::to_vec(&Note {
                node,
                left_at_ms,
                window_ms: 1000,
                view: v
                    .nodes
                    .iter()
                    .map(|n| serde_json::from_slice(&encode_record(n)).unwrap())
                    .collect(),
            })
            .unwrap()
        };
        let w = Duration::from_secs(60);
        assert!(parse(&note(1, 10_000), 1, w, 10_500).is_ok());
        assert!(
            parse(&note(1, 10_000), 1, w, 11_000).is_err(),
            "window passed"
        );
        assert!(
            parse(&note(0, 10_000), 1, w, 10_500).is_err(),
            "another node's"
        );
        assert!(parse(b"{", 1, w, 10_500).is_err());
        assert!(
            parse(&note(1, 10_000), 0, w, 10_500).is_err(),
            "node 0 is serving"
        );
    }

    #[test]
    fn a_damaged_note_is_removed_and_ignored() {
        let dir = kvpool_system_tests::temp_dir("restart-note-damaged");
        std::fs::write(path(&dir, 1), b"\xff\x00 not json").unwrap();
        assert!(take_note(&dir, 1, Duration::from_secs(60)).is_none());
        assert!(!path(&dir, 1).exists());
    }
}
