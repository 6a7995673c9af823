//! The commands clients send on connect or to probe a server (`HELLO`, `CLIENT`, `INFO`,
//! `CONFIG GET`, `COMMAND`), answered in the shapes redis clients accept.

use std::sync::atomic::Ordering::Relaxed;

use kvpool::resp::{encode, Proto};
use tokio::io::AsyncWrite;

use super::conn::{proto_of, Conn};

/// The Redis version the door reports: the command set and reply shapes it follows. Clients
/// gate features on it; kvpool's own version is in `INFO` (`kvpool_version`).
pub(crate) const REDIS_VERSION: &str = "7.2.0";

/// One command as `COMMAND` reports it: name, arity (negative: at least), flags, first key, last
/// key, step.
type Spec = (&'static str, i64, &'static [&'static str], i64, i64, i64);

/// The commands the door serves.
const TABLE: &[Spec] = &[
    ("ping", -1, &["fast"], 0, 0, 0),
    ("echo", 2, &["fast"], 0, 0, 0),
    (
        "hello",
        -1,
        &["noscript", "loading", "stale", "fast", "no_auth"],
        0,
        0,
        0,
    ),
    (
        "auth",
        -2,
        &["noscript", "loading", "stale", "fast", "no_auth"],
        0,
        0,
        0,
    ),
    ("select", 2, &["loading", "stale", "fast"], 0, 0, 0),
    (
        "quit",
        -1,
        &["noscript", "loading", "stale", "fast", "no_auth"],
        0,
        0,
        0,
    ),
    ("get", 2, &["readonly", "fast"], 1, 1, 1),
    ("set", -3, &["write", "denyoom"], 1, 1, 1),
    ("mget", -2, &["readonly", "fast"], 1, -1, 1),
    ("mset", -3, &["write", "denyoom"], 1, -1, 2),
    ("exists", -2, &["readonly", "fast"], 1, -1, 1),
    ("del", -2, &["write"], 1, -1, 1),
    ("unlink", -2, &["write", "fast"], 1, -1, 1),
    ("strlen", 2, &["readonly", "fast"], 1, 1, 1),
    ("scan", -2, &["readonly"], 0, 0, 0),
    ("dbsize", 1, &["readonly", "fast"], 0, 0, 0),
    ("flushdb", -1, &["write"], 0, 0, 0),
    ("flushall", -1, &["write"], 0, 0, 0),
    ("info", -1, &["loading", "stale"], 0, 0, 0),
    ("client", -2, &["loading", "stale"], 0, 0, 0),
    ("config", -2, &["loading", "stale"], 0, 0, 0),
    ("command", -1, &["loading", "stale"], 0, 0, 0),
];

/// `HELLO [protover [AUTH user pass] [SETNAME name]]`.
pub(crate) fn hello<W: AsyncWrite + Unpin + Send>(c: &mut Conn<'_, W>, args: &[&[u8]]) {
    let mut proto = c.proto;
    if let Some(v) = args.first() {
        match proto_of(v) {
            Some(p) => proto = p,
            None => {
                return encode::error(&mut c.out, "NOPROTO unsupported protocol version");
            }
        }
    }
    let mut i = 1;
    let mut name = None;
    while i < args.len() {
        let opt = args[i].to_ascii_uppercase();
        match opt.as_slice() {
            b"AUTH" if i + 2 < args.len() => {
                if let Err(msg) = c.auth(Some(args[i + 1]), args[i + 2]) {
                    return encode::error(&mut c.out, &msg);
                }
                i += 3;
            }
            b"SETNAME" if i + 1 < args.len() => {
                name = Some(args[i + 1].to_vec());
                i += 2;
            }
            _ => {
                let shown = String::from_utf8_lossy(args[i]).into_owned();
                return encode::error(
                    &mut c.out,
                    &format!("ERR Syntax error in HELLO option '{shown}'"),
                );
            }
        }
    }
    if !c.authenticated() {
        return encode::error(
            &mut c.out,
            "NOAUTH HELLO must be called with the client already authenticated, otherwise the \
             HELLO <proto> AUTH <user> <pass> option can be used to authenticate the client and \
             select the RESP protocol version at the same time",
        );
    }
    if name.is_some() {
        c.name = name;
    }
    c.proto = proto;
    let p = c.proto;
    let out = &mut c.out;
    encode::map(out, 7, p);
    encode::bulk(out, b"server");
    encode::bulk(out, b"redis");
    encode::bulk(out, b"version");
    encode::bulk(out, REDIS_VERSION.as_bytes());
    encode::bulk(out, b"proto");
    encode::integer(out, if p == Proto::Resp3 { 3 } else { 2 });
    encode::bulk(out, b"id");
    encode::integer(out, c.id as i64);
    encode::bulk(out, b"mode");
    encode::bulk(out, b"standalone");
    encode::bulk(out, b"role");
    encode::bulk(out, b"master");
    encode::bulk(out, b"modules");
    encode::array(out, 0);
}

/// `CLIENT SETNAME | GETNAME | SETINFO | ID | INFO`.
pub(crate) fn client<W: AsyncWrite + Unpin + Send>(c: &mut Conn<'_, W>, args: &[&[u8]]) {
    let sub = args
        .first()
        .map(|s| s.to_ascii_uppercase())
        .unwrap_or_default();
    match (sub.as_slice(), args.len()) {
        (b"SETNAME", 2) => {
            if args[1].iter().any(|&b| b <= b' ' || b > b'~') {
                return encode::error(
                    &mut c.out,
                    "ERR Client names cannot contain spaces, newlines or special characters.",
                );
            }
            c.name = (!args[1].is_empty()).then(|| args[1].to_vec());
            encode::ok(&mut c.out);
        }
        (b"GETNAME", 1) => match c.name.clone() {
            Some(n) => encode::bulk(&mut c.out, &n),
            None => encode::null(&mut c.out, c.proto),
        },
        // LIB-NAME / LIB-VER: what a client library says about itself; accepted and dropped.
        (b"SETINFO", 3) => encode::ok(&mut c.out),
        (b"ID", 1) => encode::integer(&mut c.out, c.id as i64),
        (b"INFO", 1) => {
            let line = format!(
                "id={} name={} db=0 resp={}\n",
                c.id,
                String::from_utf8_lossy(c.name.as_deref().unwrap_or_default()),
                if c.proto == Proto::Resp3 { 3 } else { 2 }
            );
            encode::bulk(&mut c.out, line.as_bytes());
        }
        _ => unknown_subcommand(&mut c.out, "client", args),
    }
}

/// `CONFIG GET pattern...`: the few parameters clients ask about, as Redis names them.
pub(crate) fn config<W: AsyncWrite + Unpin + Send>(c: &mut Conn<'_, W>, args: &[&[u8]]) {
    let sub = args
        .first()
        .map(|s| s.to_ascii_uppercase())
        .unwrap_or_default();
    if sub != b"GET" || args.len() < 2 {
        return encode::error(
            &mut c.out,
            "ERR kvpool's RESP door supports only CONFIG GET; configure kvpoold through its TOML file",
        );
    }
    let cfg = &c.door.config;
    let capacity = c.s.pool.stats().capacity();
    let params: [(&str, String); 8] = [
        ("save", String::new()),
        ("appendonly", "no".into()),
        ("databases", "1".into()),
        ("maxmemory", capacity.to_string()),
        ("maxmemory-policy", "allkeys-lru".into()),
        ("proto-max-bulk-len", cfg.max_bulk.to_string()),
        ("client-query-buffer-limit", cfg.max_command.to_string()),
        ("cluster-enabled", "no".into()),
    ];
    let found: Vec<&(&str, String)> = params
        .iter()
        .filter(|(name, _)| {
            args[1..]
                .iter()
                .any(|p| super::glob::matches(&p.to_ascii_lowercase(), name.as_bytes()))
        })
        .collect();
    encode::map(&mut c.out, found.len(), c.proto);
    for (name, v) in found {
        encode::bulk(&mut c.out, name.as_bytes());
        encode::bulk(&mut c.out, v.as_bytes());
    }
}

/// `COMMAND`, `COMMAND COUNT`, `COMMAND INFO name...`, `COMMAND DOCS [name...]`.
pub(crate) fn command<W: AsyncWrite + Unpin + Send>(c: &mut Conn<'_, W>, args: &[&[u8]]) {
    let sub = args
        .first()
        .map(|s| s.to_ascii_uppercase())
        .unwrap_or_default();
    let named = |names: &[&[u8]]| -> Vec<Option<usize>> {
        names
            .iter()
            .map(|n| {
                let n = n.to_ascii_lowercase();
                TABLE.iter().position(|e| e.0.as_bytes() == n.as_slice())
            })
            .collect()
    };
    match sub.as_slice() {
        b"" => {
            encode::array(&mut c.out, TABLE.len());
            for i in 0..TABLE.len() {
                info_entry(&mut c.out, i);
            }
        }
        b"COUNT" => encode::integer(&mut c.out, TABLE.len() as i64),
        b"INFO" => {
            let which = named(&args[1..]);
            encode::array(&mut c.out, which.len());
            for w in which {
                match w {
                    Some(i) => info_entry(&mut c.out, i),
                    None => encode::null(&mut c.out, c.proto),
                }
            }
        }
        b"DOCS" => {
            let which: Vec<usize> = if args.len() > 1 {
                named(&args[1..]).into_iter().flatten().collect()
            } else {
                (0..TABLE.len()).collect()
            };
            let p = c.proto;
            encode::map(&mut c.out, which.len(), p);
            for i in which {
                encode::bulk(&mut c.out, TABLE[i].0.as_bytes());
                encode::map(&mut c.out, 3, p);
                encode::bulk(&mut c.out, b"summary");
                encode::bulk(&mut c.out, b"served by kvpool's RESP front door");
                encode::bulk(&mut c.out, b"since");
                encode::bulk(&mut c.out, b"1.0.0");
                encode::bulk(&mut c.out, b"group");
                encode::bulk(
                    &mut c.out,
                    if TABLE[i].3 > 0 {
                        b"string" as &[u8]
                    } else {
                        b"connection"
                    },
                );
            }
        }
        _ => unknown_subcommand(&mut c.out, "command", args),
    }
}

/// One `COMMAND INFO` entry, in Redis 7's ten-field shape.
fn info_entry(out: &mut Vec<u8>, i: usize) {
    let (name, arity, flags, first, last, step) = TABLE[i];
    encode::array(out, 10);
    encode::bulk(out, name.as_bytes());
    encode::integer(out, arity);
    encode::array(out, flags.len());
    for f in flags {
        encode::simple(out, f);
    }
    encode::integer(out, first);
    encode::integer(out, last);
    encode::integer(out, step);
    for _ in 0..4 {
        // ACL categories, tips, key specifications, subcommands: none.
        encode::array(out, 0);
    }
}

/// `INFO [section...]`: the fields monitoring tools and clients read, plus kvpool's own.
pub(crate) fn info<W: AsyncWrite + Unpin + Send>(c: &mut Conn<'_, W>, args: &[&[u8]]) {
    let want = |s: &str| {
        args.is_empty()
            || args.iter().any(|a| {
                let a = a.to_ascii_lowercase();
                a == b"all" || a == b"everything" || a == b"default" || a == s.as_bytes()
            })
    };
    let st = c.s.pool.stats();
    let ns = c.session().map_or(0, |s| s.ns);
    let ns_stats = st.namespaces.iter().find(|n| n.id == ns);
    let mut t = String::new();
    use std::fmt::Write;
    if want("server") {
        let _ = write!(
            t,
            "# Server\r\nredis_version:{REDIS_VERSION}\r\nkvpool_version:{}\r\nredis_mode:standalone\r\n\
             os:{} {}\r\narch_bits:64\r\nprocess_id:{}\r\ntcp_port:{}\r\nuptime_in_seconds:{}\r\n\
             kvpool_node:{}\r\nkvpool_namespace:{}\r\n\r\n",
            env!("CARGO_PKG_VERSION"),
            std::env::consts::OS,
            std::env::consts::ARCH,
            std::process::id(),
            c.door.addr.port(),
            c.s.started.elapsed().as_secs(),
            c.s.cluster.me(),
            c.session().map_or("", |s| s.ns_name.as_str()),
        );
    }
    if want("clients") {
        let _ = write!(
            t,
            "# Clients\r\nconnected_clients:{}\r\n\r\n",
            c.door.clients.load(Relaxed)
        );
    }
    if want("memory") {
        let _ = write!(
            t,
            "# Memory\r\nused_memory:{}\r\nmaxmemory:{}\r\nmaxmemory_policy:allkeys-lru\r\n\
             kvpool_namespace_used_bytes:{}\r\nkvpool_resp_input_bytes:{}\r\n\
             kvpool_resp_input_memory:{}\r\n\r\n",
            st.segments.iter().map(|s| s.used_bytes).sum::<u64>(),
            st.capacity(),
            ns_stats.map_or(0, |n| n.used_bytes),
            c.door.input_memory.held(),
            c.door.config.input_memory,
        );
    }
    if want("persistence") {
        t.push_str(
            "# Persistence\r\nloading:0\r\nrdb_bgsave_in_progress:0\r\naof_enabled:0\r\n\r\n",
        );
    }
    if want("stats") {
        let _ = write!(
            t,
            "# Stats\r\nkeyspace_hits:{}\r\nkeyspace_misses:{}\r\nevicted_keys:{}\r\n\
             expired_keys_pending:{}\r\n\r\n",
            ns_stats.map_or(0, |n| n.hits),
            ns_stats.map_or(0, |n| n.misses),
            st.evictions,
            c.door.expiry.len(),
        );
    }
    if want("replication") {
        t.push_str("# Replication\r\nrole:master\r\nconnected_slaves:0\r\n\r\n");
    }
    if want("keyspace") {
        let keys = ns_stats.map_or(0, |n| n.objects);
        t.push_str("# Keyspace\r\n");
        if keys > 0 {
            let _ = write!(t, "db0:keys={keys},expires=0,avg_ttl=0\r\n");
        }
        t.push_str("\r\n");
    }
    encode::bulk(&mut c.out, t.as_bytes());
}

/// Redis's error for a subcommand of `cmd` it does not know (or with the wrong arguments).
fn unknown_subcommand(out: &mut Vec<u8>, cmd: &str, args: &[&[u8]]) {
    let shown = String::from_utf8_lossy(args.first().copied().unwrap_or_default());
    encode::error(
        out,
        &format!("ERR unknown subcommand or wrong number of arguments for '{cmd}|{shown}'"),
    );
}
