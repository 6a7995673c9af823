//! The command table: each command checks its arguments, calls the node's data operations
//! (`crate::service`) and encodes the reply. Keys are ordinary kvpool objects of the
//! connection's namespace, so a value SET here is read by the native and Python clients, and
//! the other way round.
use std::io;

use kvpool::resp::{encode, Parser};
use kvpool::{Commit, NodeId, PoolError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite};

use super::conn::{Args, Conn, Next, Place, Refused};
use super::{admin, glob};
use crate::metrics::RespCommand;

impl<W: AsyncWrite + Unpin + Send> Conn<'_, W> {
    /// Executes the command the parser just returned.
    pub(crate) async fn execute(&mut self, p: &Parser, buf: &[u8]) -> io::Result<Next> {
        if p.is_empty() {
            return Ok(Next::Continue);
        }
        let a = Args { p, buf };
        let mut name = [0u8; 16];
        let raw = a.get(0);
        let upper = if raw.len() <= name.len() {
            name[..raw.len()].copy_from_slice(raw);
            name[..raw.len()].make_ascii_uppercase();
            &name[..raw.len()]
        } else {
            raw
        };
        let cmd = RespCommand::from_name(upper);
        let before = self.out.len();
        let next = self.dispatch(cmd, upper, &a).await?;
        // An error reply is one that starts with '-' (replies are appended in order; a value
        // written directly leaves `out` shorter than before only after a flush).
        let failed = self.out.len() > before && self.out[before] == b'-';
        self.s.metrics.resp_command(cmd, failed);
        // Served outside the bulk class: the worker it keeps for small requests stays kept.
        self.s.bulk.served_small();
        Ok(next)
    }

    async fn dispatch(&mut self, cmd: RespCommand, upper: &[u8], a: &Args<'_>) -> io::Result<Next> {
        use RespCommand as C;
        if self.session.is_none() && !matches!(cmd, C::Auth | C::Hello | C::Quit) {
            encode::error(&mut self.out, "NOAUTH Authentication required.");
            return Ok(Next::Continue);
        }
        let n = a.len();
        if !arity_ok(cmd, n) {
            let lower = String::from_utf8_lossy(upper).to_lowercase();
            encode::error(
                &mut self.out,
                &format!("ERR wrong number of arguments for '{lower}' command"),
            );
            return Ok(Next::Continue);
        }
        let changes = matches!(cmd, C::Set | C::Mset | C::Del | C::Unlink | C::Flushdb);
        if changes && !self.writes() {
            encode::error(
                &mut self.out,
                "NOPERM kvpool: this token may only read this namespace",
            );
            return Ok(Next::Continue);
        }
        match cmd {
            C::Ping if n == 2 => encode::bulk(&mut self.out, a.get(1)),
            C::Ping => encode::simple(&mut self.out, "PONG"),
            C::Echo => encode::bulk(&mut self.out, a.get(1)),
            C::Quit => {
                encode::ok(&mut self.out);
                return Ok(Next::Close);
            }
            C::Select if a.get(1) == b"0" => encode::ok(&mut self.out),
            C::Select => encode::error(&mut self.out, "ERR DB index is out of range"),
            C::Auth => {
                let (user, token) = match n {
                    3 => (Some(a.get(1)), a.get(2)),
                    _ => (None, a.get(1)),
                };
                match self.auth(user, token) {
                    Ok(()) => encode::ok(&mut self.out),
                    Err(msg) => encode::error(&mut self.out, &msg),
                }
            }
            C::Hello => admin::hello(self, a.iter(1).collect::<Vec<_>>().as_slice()),
            C::Get => self.get(a.get(1)).await?,
            C::Set => self.set(a).await,
            C::Mget => self.mget(a).await?,
            C::Mset => self.mset(a).await,
            C::Exists => self.exists(a).await,
            C::Del | C::Unlink => self.del(a).await,
            C::Strlen => self.strlen(a.get(1)).await,
            C::Scan => self.scan(a).await,
            C::Dbsize => match self.s.count(self.ns()) {
                Ok(c) => encode::integer(&mut self.out, c as i64),
                Err(e) => self.pool_error(e),
            },
            C::Flushdb => self.flushdb(a).await,
            C::Info => admin::info(self, a.iter(1).collect::<Vec<_>>().as_slice()),
            C::Client => admin::client(self, a.iter(1).collect::<Vec<_>>().as_slice()),
            C::Config => admin::config(self, a.iter(1).collect::<Vec<_>>().as_slice()),
            C::Command => admin::command(self, a.iter(1).collect::<Vec<_>>().as_slice()),
            C::Other => encode::error(&mut self.out, &unknown(a.get(0))),
        }
        Ok(Next::Continue)
    }
    async fn get(&mut self, key: &[u8]) -> io::Result<()> {
        if self.weights_get(key).await? {
            return Ok(());
        }
        match self.check_key(key) {
            Err(r) => {
                self.refuse(r);
                return Ok(());
            }
            Ok(Place::Remote) => {
                match self.forward_get(key).await {
                    Ok(Some(v)) => self.write_value(&v).await?,
                    Ok(None) => encode::null(&mut self.out, self.proto),
                    Err(msg) => encode::error(&mut self.out, &msg),
                }
                return Ok(());
            }
            Ok(Place::Local) => {}
        }
        let s = self.s;
        match s.get(self.ns(), key, s.now(), self.routing) {
            Ok(obj) => self.write_value(obj.bytes()).await?,
            Err(PoolError::NotFound) => encode::null(&mut self.out, self.proto),
            Err(e) => self.pool_error(e),
        }
        Ok(())
    }

    async fn mget(&mut self, a: &Args<'_>) -> io::Result<()> {
        let mut places = Vec::with_capacity(a.len() - 1);
        for key in a.iter(1) {
            match self.check_key(key) {
                Ok(place) => places.push(place),
                Err(r) => {
                    self.refuse(r);
                    return Ok(());
                }
            }
        }
        encode::array(&mut self.out, a.len() - 1);
        let s = self.s;
        let ns = self.ns();
        // An element of MGET is a value or a null, never an error.
        for (key, place) in a.iter(1).zip(places) {
            if place == Place::Remote {
                match self.forward_get(key).await {
                    Ok(Some(v)) => self.write_value(&v).await?,
                    _ => encode::null(&mut self.out, self.proto),
                }
                continue;
            }
            match s.get(ns, key, s.now(), self.routing) {
                Ok(obj) => self.write_value(obj.bytes()).await?,
                Err(_) => encode::null(&mut self.out, self.proto),
            }
        }
        Ok(())
    }

    /// `SET key value [NX|XX] [EX s|PX ms]`.
    async fn set(&mut self, a: &Args<'_>) {
        let (key, value) = (a.get(1), a.get(2));
        let mut nx = false;
        let mut xx = false;
        let mut ttl_ms: Option<u64> = None;
        let mut i = 3;
        while i < a.len() {
            let mut opt = a.get(i).to_vec();
            opt.make_ascii_uppercase();
            match opt.as_slice() {
                b"NX" if !xx => nx = true,
                b"XX" if !nx => xx = true,
                b"EX" | b"PX" if ttl_ms.is_none() && i + 1 < a.len() => {
                    let v = kvpool::resp::parse_int(a.get(i + 1));
                    let ms = match (opt.as_slice(), v) {
                        (b"EX", Some(v)) if v > 0 => (v as u64).checked_mul(1000),
                        (b"PX", Some(v)) if v > 0 => Some(v as u64),
                        (_, None) => {
                            encode::error(
                                &mut self.out,
                                "ERR value is not an integer or out of range",
                            );
                            return;
                        }
                        _ => None,
                    };
                    let Some(ms) = ms else {
                        encode::error(&mut self.out, "ERR invalid expire time in 'set' command");
                        return;
                    };
                    ttl_ms = Some(ms);
                    i += 1;
                }
                _ => {
                    encode::error(&mut self.out, "ERR syntax error");
                    return;
                }
            }
            i += 1;
        }
        match self.check_key(key) {
            Err(r) => return self.refuse(r),
            Ok(Place::Remote) if nx || xx || ttl_ms.is_some() => {
                return encode::error(
                    &mut self.out,
                    "ERR kvpool: SET with NX, XX, EX or PX of a key owned by another node: \
                     send it to the owner's RESP door (a plain SET is forwarded)",
                );
            }
            Ok(Place::Remote) => {
                return match self.forward_put(key, value).await {
                    Ok(()) => encode::ok(&mut self.out),
                    Err(msg) => encode::error(&mut self.out, &msg),
                };
            }
            Ok(Place::Local) => {}
        }
        let ns = self.ns();
        // NX/XX: the condition is checked at the commit, under the key's index lock, so two
        // racing `SET NX` never both succeed.
        let present = match (nx, xx) {
            (true, _) => Some(false),
            (_, true) => Some(true),
            _ => None,
        };
        match self.put(ns, key, value, ttl_ms, present) {
            Ok(true) => encode::ok(&mut self.out),
            Ok(false) => encode::null(&mut self.out, self.proto),
            Err(msg) => encode::error(&mut self.out, &msg),
        }
    }

    /// Stores `value` (checksummed here), with a TTL when `ttl_ms` is given, and only when the
    /// key's presence is `present` when that is given. Whether it was stored.
    fn put(
        &self,
        ns: u32,
        key: &[u8],
        value: &[u8],
        ttl_ms: Option<u64>,
        present: Option<bool>,
    ) -> Result<bool, String> {
        self.s.metrics.bytes(value.len() as u64, 0);
        if ttl_ms.is_none() && present.is_none() {
            return self
                .s
                .put_value(ns, key, value, None, false)
                .map(|()| true)
                .map_err(|e| self.pool_error_text(e));
        }
        // The service's two steps, with the address in hand: the commit checks the condition,
        // and a TTL's deadline names the generation written, so a later write of the key is
        // never removed by it.
        let (s, pool) = (self.s, &*self.s.pool);
        let (addr, stored) = s
            .put_value_if(ns, key, value, (None, present), false)
            .map_err(|e| self.pool_error_text(e))?;
        if let (true, Some(ttl)) = (stored, ttl_ms) {
            let at = s.now().saturating_add(ttl);
            if let Err(full) = self.door.expiry.add(ns, key, addr.generation, at) {
                let _ = pool.remove_generation(ns, key, addr.generation);
                return Err(format!("ERR kvpool: {full}"));
            }
        }
        Ok(stored)
    }

    /// `SET key value` whose value is still arriving: the value goes from the socket straight
    /// into its pool allocation, without the connection buffer. `have` holds the bytes of the
    /// value (and perhaps the first of its CRLF) already read. Consumes the value and its CRLF
    /// whatever happens, so the stream stays in step; Close when the CRLF is missing.
    pub(crate) async fn set_streamed<R: AsyncRead + Unpin>(
        &mut self,
        key: &[u8],
        len: usize,
        have: &[u8],
        r: &mut R,
    ) -> io::Result<Next> {
        let (head, crlf_have) = have.split_at(have.len().min(len));
        let ns = self.ns();
        let s = self.s;
        let addr = match self.check_key(key) {
            Err(Refused::Reply(msg)) => Err(msg),
            Ok(Place::Remote) => return self.set_forwarded(key, len, head, crlf_have, r).await,
            Ok(Place::Local) => s
                .begin_put(ns, key, len as u64, false, 0)
                .map_err(|e| self.pool_error_text(e)),
        };
        let addr = match addr {
            Ok(a) => a,
            Err(msg) => {
                kvpool::protocol::io::discard(r, (len - head.len()) as u64).await?;
                let next = self.end_of_value(crlf_have, r).await?;
                if matches!(next, Next::Continue) {
                    encode::error(&mut self.out, &msg);
                    self.s.metrics.resp_command(RespCommand::Set, true);
                }
                return Ok(next);
            }
        };
        let pool = &*s.pool;
        let checksum = {
            let mut w = match pool.begin_write(&addr) {
                Ok(w) => w,
                Err(e) => {
                    let _ = pool.abort(&addr);
                    return Err(io::Error::other(e.to_string()));
                }
            };
            w.bytes_mut()[..head.len()].copy_from_slice(head);
            let deadline = s.instant_at(w.deadline());
            let read =
                tokio::time::timeout_at(deadline, r.read_exact(&mut w.bytes_mut()[head.len()..]))
                    .await;
            let failed = match read {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(e),
                Err(_) => Some(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "value not received before its allocation's deadline",
                )),
            };
            if let Some(e) = failed {
                drop(w);
                let _ = pool.abort(&addr);
                return Err(e);
            }
            kvpool::checksum(w.bytes_mut())
        };
        let next = self.end_of_value(crlf_have, r).await;
        if !matches!(next, Ok(Next::Continue)) {
            let _ = pool.abort(&addr);
            return next;
        }
        s.metrics.bytes(len as u64, 0);
        let failed = match pool.commit(Commit::new(&addr, checksum)) {
            Ok(_) => {
                encode::ok(&mut self.out);
                false
            }
            Err(e) => {
                self.pool_error(e);
                true
            }
        };
        s.metrics.resp_command(RespCommand::Set, failed);
        Ok(Next::Continue)
    }

    /// [`Conn::set_streamed`] of a key owned elsewhere: the value (within the door's bulk
    /// limit, which the parser checked) is read whole, then forwarded to the owners.
    async fn set_forwarded<R: AsyncRead + Unpin>(
        &mut self,
        key: &[u8],
        len: usize,
        head: &[u8],
        crlf_have: &[u8],
        r: &mut R,
    ) -> io::Result<Next> {
        let mut value = vec![0u8; len];
        value[..head.len()].copy_from_slice(head);
        let within = self.door.forward.timeout();
        tokio::time::timeout(within, r.read_exact(&mut value[head.len()..]))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "value not received in time"))??;
        let next = self.end_of_value(crlf_have, r).await?;
        if matches!(next, Next::Continue) {
            let failed = match self.forward_put(key, &value).await {
                Ok(()) => {
                    encode::ok(&mut self.out);
                    false
                }
                Err(msg) => {
                    encode::error(&mut self.out, &msg);
                    true
                }
            };
            self.s.metrics.resp_command(RespCommand::Set, failed);
        }
        Ok(next)
    }

    /// Reads the CRLF after a streamed value (`have`: its bytes already read). Close, with a
    /// protocol error answered, when it is not there.
    async fn end_of_value<R: AsyncRead + Unpin>(
        &mut self,
        have: &[u8],
        r: &mut R,
    ) -> io::Result<Next> {
        let mut end = [0u8; 2];
        let n = have.len().min(2);
        end[..n].copy_from_slice(&have[..n]);
        r.read_exact(&mut end[n..]).await?;
        if &end != b"\r\n" {
            self.s.metrics.resp_protocol_error();
            self.protocol_error(&kvpool::resp::RespError::UnterminatedBulk.to_string());
            return Ok(Next::Close);
        }
        Ok(Next::Continue)
    }

    async fn mset(&mut self, a: &Args<'_>) {
        let mut it = a.iter(1);
        let mut remote = false;
        while let Some(key) = it.next() {
            let _ = it.next();
            match self.check_key(key) {
                Ok(place) => remote |= place == Place::Remote,
                Err(r) => return self.refuse(r),
            }
        }
        if remote {
            return self.mset_forwarded(a).await;
        }
        // All or nothing: every value is written into its own allocation first, then all are
        // committed under their keys' index locks at once (`Commit::all`).
        let (ns, s) = (self.ns(), self.s);
        let mut staged = Vec::with_capacity(a.len() / 2);
        let mut it = a.iter(1);
        let mut failed = None;
        while let (Some(key), Some(value)) = (it.next(), it.next()) {
            s.metrics.bytes(value.len() as u64, 0);
            match s.stage_value(ns, key, value, false) {
                Ok(addr) => staged.push((addr, kvpool::checksum(value))),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let done = match failed {
            Some(e) => {
                for (addr, _) in &staged {
                    let _ = s.pool.abort(addr);
                }
                Err(e)
            }
            None => s.pool.commit(Commit::all(&staged)).map(drop),
        };
        match done {
            Ok(()) => encode::ok(&mut self.out),
            Err(e) => self.pool_error(e),
        }
    }

    /// `MSET` with a key owned elsewhere: every pair goes to its owners (one round trip per
    /// owner). All or nothing on each node, not across nodes: when one owner refuses, the
    /// pairs other owners stored stay.
    async fn mset_forwarded(&mut self, a: &Args<'_>) {
        let t = match self.forward() {
            Ok(t) => t,
            Err(msg) => return encode::error(&mut self.out, &msg),
        };
        let mut items = Vec::with_capacity(a.len() / 2);
        let mut it = a.iter(1);
        while let (Some(key), Some(value)) = (it.next(), it.next()) {
            self.s.metrics.bytes(value.len() as u64, 0);
            items.push((key, value));
        }
        match t.put_many(&items).await {
            Ok(codes) => match codes
                .iter()
                .find(|c| **c != kvpool::protocol::ErrorCode::Ok)
            {
                None => encode::ok(&mut self.out),
                Some(code) => encode::error(
                    &mut self.out,
                    &format!("ERR kvpool: an owner refused part of the MSET: {code:?}"),
                ),
            },
            Err(msg) => encode::error(&mut self.out, &msg),
        }
    }

    async fn exists(&mut self, a: &Args<'_>) {
        let ns = self.ns();
        let mut n = 0;
        for key in a.iter(1) {
            let hit = match self.check_key(key) {
                Err(r) => return self.refuse(r),
                Ok(Place::Remote) => match self.forward() {
                    Ok(t) => t.exists(key).await,
                    Err(msg) => Err(msg),
                },
                Ok(Place::Local) => self
                    .s
                    .exists_run(ns, std::iter::once(key), self.routing)
                    .map(|hit| hit == 1)
                    .map_err(|e| self.pool_error_text(e)),
            };
            match hit {
                Ok(hit) => n += hit as i64,
                Err(msg) => return encode::error(&mut self.out, &msg),
            }
        }
        encode::integer(&mut self.out, n);
    }

    async fn del(&mut self, a: &Args<'_>) {
        let mut places = Vec::with_capacity(a.len() - 1);
        for key in a.iter(1) {
            match self.check_key(key) {
                Ok(place) => places.push(place),
                Err(r) => return self.refuse(r),
            }
        }
        let ns = self.ns();
        let mut n = 0;
        for (key, place) in a.iter(1).zip(places) {
            let removed = match place {
                Place::Remote => match self.forward() {
                    Ok(t) => t.remove(key).await,
                    Err(msg) => Err(msg),
                },
                Place::Local => match self.s.remove(ns, key) {
                    // Removed here by a view this node has since left: the key's new owner may
                    // have been handed the older value first, so it is removed there too
                    // (`Shared::remove_keys`).
                    Ok(hit) if self.s.view_moved(self.routing) => match self.forward() {
                        Ok(t) => t.remove(key).await.map(|there| hit || there),
                        Err(msg) => Err(msg),
                    },
                    r => r.map_err(|e| self.pool_error_text(e)),
                },
            };
            match removed {
                Ok(hit) => n += hit as i64,
                Err(msg) => return encode::error(&mut self.out, &msg),
            }
        }
        encode::integer(&mut self.out, n);
    }

    /// `FLUSHDB [ASYNC|SYNC]` and `FLUSHALL [ASYNC|SYNC]`: every object of the connection's
    /// namespace on this node, pinned ones too, removed before the reply (both modes). A
    /// connection sees only its namespace, so FLUSHALL is FLUSHDB.
    async fn flushdb(&mut self, a: &Args<'_>) {
        if a.len() == 2 {
            let mut mode = a.get(1).to_vec();
            mode.make_ascii_uppercase();
            if mode != b"ASYNC" && mode != b"SYNC" {
                return encode::error(&mut self.out, "ERR syntax error");
            }
        }
        if self.s.cluster.view().nodes.len() > 1 {
            // In a cluster, on every node.
            let cleared = match self.forward() {
                Ok(t) => t.remove_all().await,
                Err(msg) => Err(msg),
            };
            return match cleared {
                Ok(_) => encode::ok(&mut self.out),
                Err(msg) => encode::error(&mut self.out, &msg),
            };
        }
        match self.s.clear(self.ns()) {
            Ok(_) => encode::ok(&mut self.out),
            Err(e) => self.pool_error(e),
        }
    }

    async fn strlen(&mut self, key: &[u8]) {
        match self.check_key(key) {
            Err(r) => return self.refuse(r),
            Ok(Place::Remote) => {
                return match self.forward_get(key).await {
                    Ok(v) => encode::integer(&mut self.out, v.map_or(0, |v| v.len() as i64)),
                    Err(msg) => encode::error(&mut self.out, &msg),
                };
            }
            Ok(Place::Local) => {}
        }
        let s = self.s;
        match s.get(self.ns(), key, s.now(), self.routing) {
            Ok(obj) => encode::integer(&mut self.out, obj.bytes().len() as i64),
            Err(PoolError::NotFound) => encode::integer(&mut self.out, 0),
            Err(e) => self.pool_error(e),
        }
    }

    /// `SCAN cursor [MATCH pattern] [COUNT n] [TYPE string]`. A walk (cursor 0) whose pattern
    /// names a directory of the weights view of a published model answers the view's names in
    /// one step, with the next cursor 0 (`weights`).
    async fn scan(&mut self, a: &Args<'_>) {
        let Some(cursor) = std::str::from_utf8(a.get(1))
            .ok()
            .and_then(|c| c.parse::<u64>().ok())
        else {
            return encode::error(&mut self.out, "ERR invalid cursor");
        };
        let mut pattern: Option<&[u8]> = None;
        let mut count: u64 = 10;
        let mut only_strings = true;
        let mut i = 2;
        while i < a.len() {
            let mut opt = a.get(i).to_vec();
            opt.make_ascii_uppercase();
            let Some(v) = (i + 1 < a.len()).then(|| a.get(i + 1)) else {
                return encode::error(&mut self.out, "ERR syntax error");
            };
            match opt.as_slice() {
                b"MATCH" => pattern = Some(v),
                b"COUNT" => match kvpool::resp::parse_int(v) {
                    Some(c) if c >= 1 => count = c as u64,
                    Some(_) => return encode::error(&mut self.out, "ERR syntax error"),
                    None => {
                        return encode::error(
                            &mut self.out,
                            "ERR value is not an integer or out of range",
                        )
                    }
                },
                // Every kvpool object is a string.
                b"TYPE" => only_strings = v.eq_ignore_ascii_case(b"string"),
                _ => return encode::error(&mut self.out, "ERR syntax error"),
            }
            i += 2;
        }
        if let (0, Some(p), true) = (cursor, pattern, only_strings) {
            if let Some(keys) = self.weights_scan(p).await {
                encode::array(&mut self.out, 2);
                encode::bulk(&mut self.out, b"0");
                encode::array(&mut self.out, keys.len());
                for k in &keys {
                    encode::bulk(&mut self.out, k);
                }
                return;
            }
        }
        let budget = count.min(self.door.config.max_scan_count.max(1)) as usize;
        let ns = self.ns();
        let me = self.s.cluster.me();
        let view = self.view.1.clone();
        let multi = view.nodes.len() > 1;
        let page = self.s.pool.scan(ns, cursor, budget, &mut |k| {
            only_strings
                && pattern.is_none_or(|p| glob::matches(p, k))
                // In a cluster, only the keys this node serves (not copies it keeps for others).
                && (!multi || view.owner(k) == Some(NodeId(me)))
        });
        match page {
            Ok(page) => {
                encode::array(&mut self.out, 2);
                encode::bulk(&mut self.out, page.cursor.to_string().as_bytes());
                encode::array(&mut self.out, page.keys.len());
                for k in &page.keys {
                    encode::bulk(&mut self.out, k);
                }
            }
            Err(e) => self.pool_error(e),
        }
    }
}

/// Whether `n` arguments (the command's name counted) suit `cmd`.
fn arity_ok(cmd: RespCommand, n: usize) -> bool {
    use RespCommand as C;
    match cmd {
        C::Ping => n <= 2,
        C::Echo => n == 2,
        C::Dbsize => n == 1,
        C::Flushdb => n <= 2,
        C::Get | C::Strlen => n == 2,
        C::Set => n >= 3,
        C::Mget | C::Exists | C::Del | C::Unlink => n >= 2,
        C::Mset => n >= 3 && n % 2 == 1,
        C::Select => n == 2,
        C::Scan => n >= 2,
        C::Auth => n == 2 || n == 3,
        C::Quit | C::Client | C::Config | C::Command | C::Info | C::Hello | C::Other => true,
    }
}

/// Redis's answer to a command it does not know, naming at most 64 printable bytes of it.
fn unknown(name: &[u8]) -> String {
    let shown: String = String::from_utf8_lossy(&name[..name.len().min(64)])
        .chars()
        .filter(|c| !c.is_control())
        .collect();
    format!("ERR unknown command '{shown}', with args beginning with: ")
}
