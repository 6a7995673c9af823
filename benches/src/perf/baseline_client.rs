//! Minimal async clients of the baselines, just enough for the benchmark: redis (RESP `GET`/`SET`
//! with bulk strings) and memcached (text protocol `get`/`set`). Requests are buffered and
//! sent on `flush`, so a pipelined batch is several `send_get`s, one `flush`, then as many
//! `read_get`s.

use std::sync::Arc;

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use super::driver::Worker;
use super::workloads::{put_keys, Buffers};

/// Same buffer size as kvpool's client.
const IO_BUFFER: usize = 64 << 10;

/// Which baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Proto {
    /// redis, RESP2.
    Redis,
    /// memcached, text protocol.
    Memcached,
}

impl Proto {
    /// Its name in the report.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Proto::Redis => "redis",
            Proto::Memcached => "memcached",
        }
    }
}

/// One connection to a baseline.
pub(crate) struct BaselineConn {
    proto: Proto,
    r: BufReader<OwnedReadHalf>,
    w: BufWriter<OwnedWriteHalf>,
    line: Vec<u8>,
}

impl BaselineConn {
    /// Connects to the baseline on loopback `port`.
    pub(crate) async fn connect(proto: Proto, port: u16) -> std::io::Result<BaselineConn> {
        let s = TcpStream::connect(("127.0.0.1", port)).await?;
        s.set_nodelay(true)?;
        let (r, w) = s.into_split();
        Ok(BaselineConn {
            proto,
            r: BufReader::with_capacity(IO_BUFFER, r),
            w: BufWriter::with_capacity(IO_BUFFER, w),
            line: Vec::new(),
        })
    }

    /// Queues a get of `key`.
    pub(crate) async fn send_get(&mut self, key: &[u8]) -> std::io::Result<()> {
        match self.proto {
            Proto::Redis => {
                let head = format!("*2\r\n$3\r\nGET\r\n${}\r\n", key.len());
                self.w.write_all(head.as_bytes()).await?;
                self.w.write_all(key).await?;
                self.w.write_all(b"\r\n").await
            }
            Proto::Memcached => {
                self.w.write_all(b"get ").await?;
                self.w.write_all(key).await?;
                self.w.write_all(b"\r\n").await
            }
        }
    }

    /// Queues a set of `key` to `value`.
    pub(crate) async fn send_set(&mut self, key: &[u8], value: &[u8]) -> std::io::Result<()> {
        match self.proto {
            Proto::Redis => {
                let head = format!("*3\r\n$3\r\nSET\r\n${}\r\n", key.len());
                self.w.write_all(head.as_bytes()).await?;
                self.w.write_all(key).await?;
                self.w
                    .write_all(format!("\r\n${}\r\n", value.len()).as_bytes())
                    .await?;
            }
            Proto::Memcached => {
                self.w.write_all(b"set ").await?;
                self.w.write_all(key).await?;
                self.w
                    .write_all(format!(" 0 0 {}\r\n", value.len()).as_bytes())
                    .await?;
            }
        }
        self.w.write_all(value).await?;
        self.w.write_all(b"\r\n").await
    }

    /// Sends everything queued.
    pub(crate) async fn flush(&mut self) -> std::io::Result<()> {
        self.w.flush().await
    }

    /// Reads the reply to a get into `dst`; returns the value's length. A miss is an error.
    pub(crate) async fn read_get(&mut self, dst: &mut [u8]) -> anyhow::Result<usize> {
        let line = self.read_line().await?;
        let len: usize = match self.proto {
            Proto::Redis => match line.strip_prefix('$') {
                Some("-1") => bail!("redis: miss"),
                Some(n) => n
                    .parse()
                    .with_context(|| format!("redis: bad bulk length {line:?}"))?,
                None => bail!("redis: unexpected reply {line:?}"),
            },
            Proto::Memcached => match line.strip_prefix("VALUE ") {
                Some(rest) => rest
                    .rsplit(' ')
                    .next()
                    .unwrap_or("")
                    .parse()
                    .with_context(|| format!("memcached: bad header {line:?}"))?,
                None => bail!("memcached: miss or error {line:?}"),
            },
        };
        let Some(dst) = dst.get_mut(..len) else {
            bail!(
                "{}: value of {len} bytes is larger than the buffer",
                self.proto.name()
            )
        };
        self.r.read_exact(dst).await?;
        let mut crlf = [0u8; 2];
        self.r.read_exact(&mut crlf).await?;
        if self.proto == Proto::Memcached {
            let end = self.read_line().await?;
            if end != "END" {
                bail!("memcached: expected END, got {end:?}");
            }
        }
        Ok(len)
    }

    /// Reads the reply to a set.
    pub(crate) async fn read_set(&mut self) -> anyhow::Result<()> {
        let line = self.read_line().await?;
        match (self.proto, line.as_str()) {
            (Proto::Redis, "+OK") | (Proto::Memcached, "STORED") => Ok(()),
            (p, other) => bail!("{}: set failed: {other:?}", p.name()),
        }
    }

    /// Round trip that proves the server answers (PING / version).
    pub(crate) async fn ping(&mut self) -> anyhow::Result<()> {
        let cmd: &[u8] = if self.proto == Proto::Redis {
            b"PING\r\n"
        } else {
            b"version\r\n"
        };
        self.w.write_all(cmd).await?;
        self.flush().await?;
        let line = self.read_line().await?;
        anyhow::ensure!(
            line == "+PONG" || line.starts_with("VERSION"),
            "{}: unexpected ping reply {line:?}",
            self.proto.name()
        );
        Ok(())
    }

    async fn read_line(&mut self) -> anyhow::Result<String> {
        self.line.clear();
        if self.r.read_until(b'\n', &mut self.line).await? == 0 {
            bail!("{}: connection closed", self.proto.name());
        }
        let text = String::from_utf8_lossy(&self.line);
        Ok(text.trim_end_matches(['\r', '\n']).to_string())
    }
}

/// Gets `depth` keys per round trip: `depth` requests written back to back, then the replies.
pub(crate) struct BaselineGet {
    conn: BaselineConn,
    keys: Arc<Vec<Vec<u8>>>,
    next: usize,
    size: usize,
    depth: usize,
    bufs: Buffers,
}

impl BaselineGet {
    /// A loop over `keys` (values of `size`) starting at key `start`, receiving into `bufs`.
    pub(crate) fn new(
        conn: BaselineConn,
        keys: Arc<Vec<Vec<u8>>>,
        size: u64,
        depth: usize,
        start: usize,
        bufs: Buffers,
    ) -> BaselineGet {
        BaselineGet {
            conn,
            next: start % keys.len(),
            keys,
            size: size as usize,
            depth,
            bufs,
        }
    }
}

impl Worker for BaselineGet {
    async fn op(&mut self) -> anyhow::Result<u64> {
        let n = self.keys.len();
        for j in 0..self.depth {
            self.conn.send_get(&self.keys[(self.next + j) % n]).await?;
        }
        self.next = (self.next + self.depth) % n;
        self.conn.flush().await?;
        let mut bufs = self.bufs.take(self.depth, self.size);
        let mut bytes = 0;
        for buf in &mut bufs {
            bytes += self.conn.read_get(buf).await? as u64;
        }
        self.bufs.put(bufs);
        Ok(bytes)
    }
}

/// Sets one value per round trip, cycling over a few keys of its own (the keys kvpool's put
/// loop uses).
pub(crate) struct BaselineSet {
    conn: BaselineConn,
    keys: Vec<Vec<u8>>,
    next: usize,
    value: Arc<Vec<u8>>,
}

impl BaselineSet {
    /// A set loop for worker number `worker` of `conns`.
    pub(crate) fn new(
        conn: BaselineConn,
        value: Arc<Vec<u8>>,
        worker: usize,
        conns: usize,
    ) -> BaselineSet {
        BaselineSet {
            conn,
            keys: put_keys(value.len() as u64, worker, conns),
            next: 0,
            value,
        }
    }
}

impl Worker for BaselineSet {
    async fn op(&mut self) -> anyhow::Result<u64> {
        self.conn
            .send_set(&self.keys[self.next], &self.value)
            .await?;
        self.next = (self.next + 1) % self.keys.len();
        self.conn.flush().await?;
        self.conn.read_set().await?;
        Ok(self.value.len() as u64)
    }
}
