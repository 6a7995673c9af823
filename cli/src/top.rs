//! `kvpool top`: a live view of the cluster. Every `--interval` it polls the view and each
//! node's `Stats`, `Traffic` and `DiskStats` (`sample`), turns two polls into each node's use
//! and what it served in between (`frame`), and redraws the terminal with plain ANSI escapes
//! (`screen`) or prints the frame as a JSON line. A node that does not answer is shown down.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use kvpool_client::blocking::Client;

mod frame;
mod sample;
mod screen;

/// `kvpool top`'s options.
#[derive(Args, Debug)]
pub(crate) struct TopArgs {
    /// Seconds between polls (fractions allowed, 0.05 to 3600).
    #[arg(long, default_value = "1", value_parser = parse_interval)]
    interval: Duration,
    /// Print one frame (two polls one interval apart) and exit.
    #[arg(long)]
    once: bool,
    /// Print each frame as one line of JSON instead of drawing the screen.
    #[arg(long)]
    json: bool,
    /// Stop after this many frames.
    #[arg(long, conflicts_with = "once")]
    count: Option<u64>,
}

/// Runs `kvpool top` until interrupted, `--count` frames, or one frame with `--once`.
pub(crate) fn run(client: &Client, args: &TopArgs) -> anyhow::Result<i32> {
    let frames = if args.once { Some(1) } else { args.count };
    // A node gets the whole interval (at least a second) to answer a poll.
    let wait = args.interval.max(Duration::from_secs(1));
    let stdout = std::io::stdout();
    let live = !args.once && !args.json && stdout.is_terminal();
    let mut started = Instant::now();
    let mut prev = sample::poll(client, wait);
    let mut shown = 0;
    while frames != Some(shown) {
        std::thread::sleep(args.interval.saturating_sub(started.elapsed()));
        started = Instant::now();
        let cur = sample::poll(client, wait);
        let f = frame::Frame::new(&prev, &cur);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let text = if args.json {
            format!("{}\n", f.to_json(now.as_millis() as u64))
        } else {
            let width = stdout.is_terminal().then(terminal_width).flatten();
            let lines = screen::lines(&f, args.interval.as_secs_f64(), &clock(now), width);
            let clear = if live { "\x1b[H\x1b[2J" } else { "" };
            format!("{clear}{}\n", lines.join("\n"))
        };
        let mut out = stdout.lock();
        match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
            Ok(()) => {}
            // The reader went away (`kvpool top --json | head -1`): done.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(0),
            Err(e) => return Err(e.into()),
        }
        shown += 1;
        prev = cur;
    }
    Ok(0)
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.05..=3600.0).contains(&v) => Ok(Duration::from_secs_f64(v)),
        _ => Err(format!("{s:?}: seconds between 0.05 and 3600")),
    }
}

/// The time of day in UTC, `HH:MM:SS`.
fn clock(since_epoch: Duration) -> String {
    let s = since_epoch.as_secs() % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// The terminal's width in columns: the window size of stdout, else `COLUMNS`.
fn terminal_width() -> Option<usize> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes one `winsize` through the pointer, which points at a live,
    // writable `winsize` for the length of the call.
    let rc = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    if rc == 0 && ws.ws_col > 0 {
        return Some(ws.ws_col as usize);
    }
    std::env::var("COLUMNS").ok()?.parse().ok()
}
