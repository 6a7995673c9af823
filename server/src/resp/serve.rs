//! The read loop of one RESP connection: bytes read into a bounded buffer, every complete
//! command in it parsed and executed in order, replies flushed when no further command is
//! buffered; a large SET's value streamed from the socket into its allocation.

use std::sync::Arc;

use kvpool::resp::{Parsed, Parser, RespLimits};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};
use tokio::sync::watch;

use super::conn::{Conn, Next};
use super::shared::RespShared;
use crate::deadline::{within, ReadStall, StallLimit};
use crate::metrics::Transport;
use crate::service::Shared;

/// Before a connection has authenticated (when the node needs a token) it may send only small
/// commands, as in Redis: 10 arguments of at most 16 KiB.
const UNAUTHENTICATED: RespLimits = RespLimits {
    max_bulk: 16 << 10,
    max_args: 10,
    max_inline: 16 << 10,
    max_command: 256 << 10,
};

/// A SET value at least this long, still arriving when its command is parsed, is read from the
/// socket straight into its pool allocation.
const STREAM_AT: usize = 64 << 10;

/// The most a read makes room for ahead of the bytes that arrived.
const READ_AHEAD: usize = 16 << 20;

/// Replies are flushed once this much is buffered, even with more commands pending.
const FLUSH_AT: usize = 256 << 10;

/// Each connection's input buffer starts with this much capacity, which is not charged to the
/// door's `InputMemory` (`max_connections` bounds it); a buffer left empty with more than
/// `INPUT_KEEP` goes back to this size.
const INPUT_BASE: usize = 64 << 10;
const INPUT_KEEP: usize = 1 << 20;

/// Serves one RESP connection until the peer leaves, sends bytes that are not RESP, or shutdown
/// is signalled while it is idle. `peer`: its address, and what tells the reaper when it has
/// authenticated.
pub(crate) async fn serve<R, W>(
    shared: Arc<Shared>,
    door: Arc<RespShared>,
    peer: (Option<std::net::IpAddr>, Option<crate::reaper::Admit>),
    r: R,
    w: W,
    mut shutdown: watch::Receiver<bool>,
) where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    use std::sync::atomic::Ordering::Relaxed;
    shared.metrics.connection_opened(Transport::Resp);
    door.clients.fetch_add(1, Relaxed);
    let id = door.next_id.fetch_add(1, Relaxed) + 1;
    let w = StallLimit::new(w, shared.conn.write);
    // A command that stops arriving half-way (its line, its bulk strings, a streamed SET's
    // value) fails the connection after `read_timeout_ms` without progress.
    let mut r = ReadStall::new(r, shared.conn.read);
    let mut conn = Conn::new(&shared, &door, id, peer, w);
    let authed = door.config.limits(shared.conn.limits.max_payload);
    let mut input = Input::new(door.clone(), authed, &conn);
    let connected = tokio::time::Instant::now();
    loop {
        let need = match input.run(&mut conn, &shared).await {
            Flow::Need(n) => n,
            Flow::Stop => break,
        };
        r.in_request(true);
        match input.stream_set(&mut conn, &mut r).await {
            Some(Flow::Stop) => break,
            Some(Flow::Need(_)) => continue,
            None => {}
        }
        if conn.flush().await.is_err() {
            break;
        }
        if !input.make_room(need) {
            shared.metrics.resp_input_refused();
            tracing::debug!(
                need,
                "closing a RESP connection: the door's input memory is full"
            );
            conn.protocol_error(&format!(
                "kvpool: the node's RESP input buffers are full ([resp] input_memory = {}); \
                 command refused, closing",
                door.config.input_memory
            ));
            let _ = conn.flush().await;
            break;
        }
        let deadline = if conn.authenticated() {
            shared.conn.idle.map(|d| tokio::time::Instant::now() + d)
        } else {
            Some(connected + shared.conn.handshake)
        };
        let idle = input.buf.is_empty();
        r.in_request(!idle);
        let read = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop), if idle => break,
            n = within(deadline, r.read_buf(&mut input.buf)) => n,
        };
        match read {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    shared
        .trim
        .released((input.buf.capacity() + conn.out.capacity()) as u64);
    // The buffer's charge goes back before the peer can see the close, so that a client that
    // saw this connection end finds its room free (a refused one's charge, above all).
    drop(input);
    let _ = conn.shutdown().await;
    door.clients.fetch_sub(1, Relaxed);
    shared.metrics.connection_closed(Transport::Resp);
}

/// What the connection loop does next.
enum Flow {
    /// Read more: the command being parsed needs at least this many more bytes.
    Need(usize),
    /// Close the connection (QUIT, a broken stream, or bytes that are not RESP).
    Stop,
}

/// The bytes read and not yet executed, and the parser over them.
struct Input {
    buf: Vec<u8>,
    /// Where the first command not yet executed starts in `buf`.
    start: usize,
    parser: Parser,
    /// The limits once the connection is authenticated (smaller ones before).
    authed: RespLimits,
    /// Capacity of `buf` beyond `INPUT_BASE`, charged to the door's `InputMemory`.
    charged: u64,
    door: Arc<RespShared>,
}

impl Drop for Input {
    fn drop(&mut self) {
        self.door.input_memory.give(self.charged);
    }
}

impl Input {
    fn new<W: AsyncWrite + Unpin + Send>(
        door: Arc<RespShared>,
        authed: RespLimits,
        conn: &Conn<'_, W>,
    ) -> Self {
        Input {
            buf: Vec::with_capacity(INPUT_BASE),
            charged: 0,
            door,
            start: 0,
            parser: Parser::new(if conn.authenticated() {
                authed
            } else {
                UNAUTHENTICATED
            }),
            authed,
        }
    }

    /// Executes every complete command buffered, in order, flushing replies as they pile up.
    async fn run<W: AsyncWrite + Unpin + Send>(
        &mut self,
        conn: &mut Conn<'_, W>,
        shared: &Shared,
    ) -> Flow {
        loop {
            match self.parser.parse(&self.buf[self.start..]) {
                Ok(Parsed::Command { consumed }) => {
                    let was_authed = conn.authenticated();
                    let next = conn.execute(&self.parser, &self.buf[self.start..]).await;
                    self.start += consumed;
                    match next {
                        Ok(Next::Continue) => {}
                        Ok(Next::Close) => {
                            let _ = conn.flush().await;
                            return Flow::Stop;
                        }
                        Err(_) => return Flow::Stop,
                    }
                    if !was_authed && conn.authenticated() {
                        self.parser = Parser::new(self.authed);
                    }
                    if conn.pending() >= FLUSH_AT && conn.flush().await.is_err() {
                        return Flow::Stop;
                    }
                }
                Ok(Parsed::Incomplete { need }) => return Flow::Need(need),
                Err(e) => {
                    shared.metrics.resp_protocol_error();
                    tracing::debug!(error = %e, "closing a RESP connection after bytes that are not RESP");
                    conn.protocol_error(&e.to_string());
                    let _ = conn.flush().await;
                    return Flow::Stop;
                }
            }
        }
    }

    /// A large value of a plain `SET` still arriving goes from the socket straight into its
    /// allocation. None when the command being parsed is not one.
    async fn stream_set<R, W>(&mut self, conn: &mut Conn<'_, W>, r: &mut R) -> Option<Flow>
    where
        R: AsyncRead + Unpin + Send,
        W: AsyncWrite + Unpin + Send,
    {
        let pb = self.parser.pending_bulk()?;
        let cmd = &self.buf[self.start..];
        let is_set = self
            .parser
            .arg(cmd, 0)
            .is_some_and(|n| n.eq_ignore_ascii_case(b"SET"));
        let streams = is_set && pb.index == 2 && pb.args == 3 && pb.len >= STREAM_AT;
        if !streams || !conn.authenticated() || !conn.writes() {
            // (A read-only session's SET is refused once parsed.)
            return None;
        }
        let key = self.parser.arg(cmd, 1).unwrap_or_default().to_vec();
        let flow = match conn.set_streamed(&key, pb.len, &cmd[pb.start..], r).await {
            Ok(Next::Continue) => Flow::Need(0),
            Ok(Next::Close) => {
                let _ = conn.flush().await;
                Flow::Stop
            }
            Err(_) => Flow::Stop,
        };
        self.buf.clear();
        self.start = 0;
        self.parser.reset();
        Some(flow)
    }

    /// Room for what the command still needs (a value's remaining bytes at once, up to
    /// READ_AHEAD: the peer's declared length is not believed further), and 64 KiB to read ahead
    /// while that is cheap. Consumed bytes are dropped when nothing is left after them, and
    /// otherwise moved out only when the room is short, so a pipeline of large values is not
    /// shifted down after every command.
    ///
    /// Growth is charged to the door's `InputMemory` before it is allocated: false when the
    /// node has no room for it and the command needs it (the buffer is left as it was). A
    /// buffer emptied with more than `INPUT_KEEP` of capacity is given back.
    fn make_room(&mut self, need: usize) -> bool {
        let want = need.clamp(64 << 10, READ_AHEAD);
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
            if self.buf.capacity() > INPUT_KEEP {
                self.buf = Vec::with_capacity(INPUT_BASE);
                self.settle();
            }
        } else if self.start > 0 && self.buf.capacity() - self.buf.len() < want {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        let (len, cap) = (self.buf.len(), self.buf.capacity());
        if cap - len >= want {
            return true;
        }
        // Reading ahead is worth growing for only while the buffer is small (a pipeline of small
        // commands). A large one with room for the rest of its command (a value's last bytes,
        // after a short read) reads them as it is rather than doubling for them.
        let fits = cap - len >= need.max(1);
        if fits && cap >= INPUT_KEEP {
            return true;
        }
        // Doubling, as `Vec::reserve` does, so that a command arriving in many reads is not
        // copied once per read.
        let grown = (len + want).max(cap.saturating_mul(2));
        let extra = (grown.saturating_sub(INPUT_BASE) as u64).saturating_sub(self.charged);
        if !self.door.input_memory.take(extra) {
            // Refused only when the command cannot be read without the growth.
            return fits;
        }
        self.charged += extra;
        self.buf.reserve_exact(grown - len);
        self.settle();
        true
    }

    /// Makes the charge match the buffer's capacity (the allocator may round it up).
    fn settle(&mut self) {
        let now = self.buf.capacity().saturating_sub(INPUT_BASE) as u64;
        let memory = &self.door.input_memory;
        if now > self.charged {
            memory.add(now - self.charged);
        } else {
            memory.give(self.charged - now);
        }
        self.charged = now;
    }
}
