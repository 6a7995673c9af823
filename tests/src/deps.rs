//! What a test does when a tool it drives is missing: in CI (`CI` set to anything but `false`
//! or `0`) it fails, since `.ci/run` installs every tool; elsewhere it says so on the terminal,
//! past the test runner's output capture, and returns early.

use std::io::Write;

/// Returns `true` when the test may go on. `tool` is what is missing, `install` how to get it.
pub fn require(present: bool, test: &str, tool: &str, install: &str) -> bool {
    if present {
        return true;
    }
    let why = format!("{tool} is not installed ({install})");
    if in_ci() {
        panic!("{test}: {why}; CI installs it, so its absence is a failure");
    }
    // Written to the raw handle, not through `eprintln!`, so the runner does not swallow it.
    let _ = writeln!(std::io::stderr(), "test {test} ... SKIPPED: {why}");
    false
}

/// [`require`] for libfabric: `built` is `kvpool_fabric::AVAILABLE` (whether the binding was
/// generated, its headers installed at build time).
pub fn require_libfabric(built: bool, test: &str) -> bool {
    require(
        built,
        test,
        "libfabric",
        "apt-get install libfabric-dev libfabric-bin libclang-dev, then rebuild",
    )
}

/// Whether this run is CI's: the `CI` variable that CI services and `.ci/run` set.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}
