//! An etcd of the tests' own on loopback: one member or several, on free ports with a data
//! directory of its own, driven through etcd's JSON gateway. Members can be killed, hung and
//! restarted on their data, or the whole cluster wiped and started anew on the same ports.
//! Every process is killed (resumed first if hung) and the directory removed on drop.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::temp_dir;

/// The `etcd` binary: on PATH, or where Debian's `etcd-server` puts it.
pub fn find_etcd() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

/// A free TCP port on loopback (free when asked; the caller binds it soon after).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One member of an [`Etcd`].
pub struct Member {
    /// Its name in the cluster (`m0`, `m1`, …).
    pub name: String,
    /// Its client port (the JSON gateway and gRPC).
    pub client: u16,
    /// Its peer port.
    pub peer: u16,
    /// A second client listener, for TLS clients (its certificate flags are in `extra`).
    pub https: Option<u16>,
    child: Option<Child>,
    hung: bool,
}

/// An etcd cluster of one or more members on loopback.
pub struct Etcd {
    bin: PathBuf,
    /// Its directory: a data dir and a log per member, and whatever a test keeps beside them.
    pub dir: PathBuf,
    /// The members, in the order they were made.
    pub members: Vec<Member>,
    /// More flags for every launch of every member.
    extra: Vec<String>,
    /// The cluster token's number: a wiped cluster is a new one.
    generation: u32,
}

impl Etcd {
    /// A healthy cluster of `members` members, each launched with `extra` flags too.
    pub fn start(bin: PathBuf, members: usize, extra: &[&str]) -> Etcd {
        Etcd::launched(bin, members, extra, false)
    }

    /// A single member that also serves TLS clients on a second port, with `extra` holding
    /// its certificate flags.
    pub fn start_tls(bin: PathBuf, extra: &[&str]) -> Etcd {
        Etcd::launched(bin, 1, extra, true)
    }

    fn launched(bin: PathBuf, members: usize, extra: &[&str], tls: bool) -> Etcd {
        let members = (0..members)
            .map(|i| Member {
                name: format!("m{i}"),
                client: free_port(),
                peer: free_port(),
                https: tls.then(free_port),
                child: None,
                hung: false,
            })
            .collect();
        let mut e = Etcd {
            bin,
            dir: temp_dir("etcd"),
            members,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            generation: 0,
        };
        for i in 0..e.members.len() {
            e.launch(i);
        }
        e.wait_healthy();
        e
    }

    /// Member `i`'s plain client URL.
    pub fn url(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client)
    }

    /// Member `i`'s TLS client URL.
    pub fn https_url(&self, i: usize) -> String {
        let port = self.members[i].https.expect("started with TLS");
        format!("https://127.0.0.1:{port}")
    }

    /// Every member's plain client URL, comma-separated (as `--etcd` takes them).
    pub fn urls(&self) -> String {
        let urls: Vec<String> = (0..self.members.len()).map(|i| self.url(i)).collect();
        urls.join(",")
    }

    /// Member `i`'s data directory.
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.join(&self.members[i].name)
    }

    fn log(&self, i: usize) -> PathBuf {
        self.dir.join(format!("{}.log", self.members[i].name))
    }

    /// Starts member `i` on its ports and data dir (the initial-cluster flags matter only
    /// while that is empty); [`Etcd::wait_healthy`] waits for it.
    pub fn launch(&mut self, i: usize) {
        let peer = |m: &Member| format!("http://127.0.0.1:{}", m.peer);
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, peer(m)))
            .collect();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log(i))
            .unwrap();
        let m = &self.members[i];
        let mut clients = self.url(i);
        if m.https.is_some() {
            clients = format!("{clients},{}", self.https_url(i));
        }
        let child = Command::new(&self.bin)
            .args(["--name", &m.name])
            .args(["--data-dir", self.data_dir(i).to_str().unwrap()])
            .args(["--listen-client-urls", &clients])
            .args(["--advertise-client-urls", &clients])
            .args(["--listen-peer-urls", &peer(m)])
            .args(["--initial-advertise-peer-urls", &peer(m)])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", "new"])
            .args([
                "--initial-cluster-token",
                &format!("kvpool-{}", self.generation),
            ])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning etcd");
        self.members[i].child = Some(child);
        self.members[i].hung = false;
    }

    /// Whether member `i` answers `/health` as healthy (it has a leader and a quorum).
    pub fn healthy(&self, i: usize) -> bool {
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", self.members[i].client)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        let req = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
        let mut out = String::new();
        s.write_all(req.as_bytes()).is_ok()
            && s.read_to_string(&mut out).is_ok()
            && out.contains("\"health\":\"true\"")
    }

    /// Members running and not hung.
    fn answering(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.members.len())
            .filter(|&i| self.members[i].child.is_some() && !self.members[i].hung)
    }

    /// Waits (at most 30 s) until every running member answers healthy.
    pub fn wait_healthy(&self) {
        let t = Instant::now();
        for i in self.answering().collect::<Vec<_>>() {
            while !self.healthy(i) {
                if t.elapsed() > Duration::from_secs(30) {
                    let log = std::fs::read_to_string(self.log(i)).unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(30).collect();
                    panic!("etcd member {i} not healthy in 30 s:\n{tail:#?}");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Waits (at most 30 s) until some member answers healthy: etcd serves again, whether or
    /// not every member has caught up.
    pub fn wait_quorum(&self) {
        let t = Instant::now();
        while !self.answering().any(|i| self.healthy(i)) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "etcd not healthy again in 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// One HTTP/1.1 POST to member `i`'s JSON gateway (`token`: etcd's auth token); the status
    /// and body, or None when it does not answer within `timeout`.
    pub fn post(
        &self,
        i: usize,
        path: &str,
        body: &str,
        token: Option<&str>,
        timeout: Duration,
    ) -> Option<(u16, String)> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.members[i].client));
        let mut s = std::net::TcpStream::connect_timeout(&addr, timeout).ok()?;
        s.set_read_timeout(Some(timeout)).ok()?;
        s.set_write_timeout(Some(timeout)).ok()?;
        let auth = token.map_or(String::new(), |t| format!("Authorization: {t}\r\n"));
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n{auth}\
             Connection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        let status = out.split_whitespace().nth(1)?.parse().ok()?;
        let body = out.split_once("\r\n\r\n")?.1.to_string();
        Some((status, body))
    }

    /// The member that leads, as the members say (at most 20 s).
    pub fn leader(&self) -> usize {
        let t = Instant::now();
        loop {
            for i in self.answering().collect::<Vec<_>>() {
                let status = self.post(
                    i,
                    "/v3/maintenance/status",
                    "{}",
                    None,
                    Duration::from_secs(1),
                );
                if let Some((200, body)) = status {
                    let me = field(&body, &["header", "member_id"]);
                    if !me.is_empty() && me == field(&body, &["leader"]) {
                        return i;
                    }
                }
            }
            assert!(t.elapsed() < Duration::from_secs(20), "etcd has no leader");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// How many keys lie in `[key, range_end)`, as an answering member says (None when none
    /// answers within a second).
    pub fn count(&self, key: &str, range_end: &str) -> Option<u64> {
        use base64::Engine as _;
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let body = format!(
            r#"{{"key":"{}","range_end":"{}","count_only":true,"serializable":false}}"#,
            b64(key),
            b64(range_end)
        );
        self.answering().find_map(|i| {
            match self.post(i, "/v3/kv/range", &body, None, Duration::from_secs(1)) {
                Some((200, r)) => Some(field(&r, &["count"]).parse().unwrap_or(0)),
                _ => None,
            }
        })
    }

    /// Revokes the lease `key` is attached to (what etcd does to a lease it believes expired):
    /// the key goes with it. False when no member answered or the key has no lease.
    pub fn revoke_lease_of(&self, key: &str) -> bool {
        use base64::Engine as _;
        let body = format!(
            r#"{{"key":"{}"}}"#,
            base64::engine::general_purpose::STANDARD.encode(key)
        );
        let lease = self.answering().find_map(|i| {
            match self.post(i, "/v3/kv/range", &body, None, Duration::from_secs(1)) {
                Some((200, r)) => {
                    let v: serde_json::Value = serde_json::from_str(&r).unwrap_or_default();
                    v["kvs"][0]["lease"].as_str().map(str::to_string)
                }
                _ => None,
            }
        });
        let Some(lease) = lease else {
            return false;
        };
        let body = format!(r#"{{"ID":"{lease}"}}"#);
        self.answering().any(|i| {
            matches!(
                self.post(i, "/v3/lease/revoke", &body, None, Duration::from_secs(1)),
                Some((200, _))
            )
        })
    }

    /// Member `i`'s process id.
    pub fn pid(&self, i: usize) -> u32 {
        self.members[i].child.as_ref().expect("running").id()
    }

    /// Hangs member `i` (SIGSTOP): it keeps its sockets and answers nothing.
    pub fn hang(&mut self, i: usize) {
        signal(self.pid(i), "STOP");
        self.members[i].hung = true;
    }

    /// Resumes a hung member `i` (SIGCONT).
    pub fn resume(&mut self, i: usize) {
        signal(self.pid(i), "CONT");
        self.members[i].hung = false;
    }

    /// SIGKILL member `i`, and wait for it.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            if self.members[i].hung {
                signal(c.id(), "CONT");
            }
            let _ = c.kill();
            let _ = c.wait();
        }
        self.members[i].hung = false;
    }

    /// Every member stopped, its data wiped, and a fresh cluster started on the same ports
    /// ([`Etcd::wait_healthy`] waits for it).
    pub fn restart_empty(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
            let _ = std::fs::remove_dir_all(self.data_dir(i));
        }
        self.generation += 1;
        for i in 0..self.members.len() {
            self.launch(i);
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A field of etcd's proto3 JSON as a string (uint64s are strings there; absent is "").
pub fn field(body: &str, path: &[&str]) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    let mut at = &v;
    for p in path {
        at = &at[*p];
    }
    match at {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Sends `sig` (`STOP`, `CONT`) to process `pid`.
pub fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([format!("-{sig}"), pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid}");
}
