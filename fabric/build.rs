//! Generates the libfabric binding against the headers installed, when they are: bindgen reads
//! `wrapper.h` (API version 1.17 and later), and the static inline calls libfabric's headers
//! define (`fi_read`, `fi_domain`, ...) are wrapped in C functions compiled here. Without the
//! headers the crate builds without the binding (`kvpool_fabric::AVAILABLE` is false), so the
//! rest of kvpool builds on a machine without libfabric.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo::rustc-check-cfg=cfg(libfabric)");
    println!("cargo::rerun-if-changed=wrapper.h");
    println!("cargo::rerun-if-env-changed=KVPOOL_LIBFABRIC_DIR");
    // A libfabric installed under a prefix of its own, else the system's.
    let prefix = std::env::var_os("KVPOOL_LIBFABRIC_DIR").map(PathBuf::from);
    let include = prefix
        .as_ref()
        .map_or_else(|| PathBuf::from("/usr/include"), |p| p.join("include"));
    if !include.join("rdma/fabric.h").is_file() {
        println!(
            "cargo::warning=libfabric's headers are not installed ({}): kvpool-fabric builds \
             without its binding (apt-get install libfabric-dev libclang-dev)",
            include.join("rdma/fabric.h").display()
        );
        return;
    }
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let wrappers = out.join("fi_inline.c");
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let header = manifest.join("wrapper.h");
    let bindings = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .clang_arg(format!("-I{}", include.display()))
        .allowlist_function("fi_.*")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*")
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrappers)
        .derive_default(true)
        .layout_tests(true)
        .generate()
        .expect("generating the libfabric binding");
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("writing the binding");
    // Not linked: loaded by `loader.c` when first used (why: there).
    let library = prefix.as_ref().map_or_else(
        || "libfabric.so.1".to_string(),
        |p| p.join("lib/libfabric.so.1").display().to_string(),
    );
    compile_wrappers(&wrappers, &header, &include, &manifest, &library);
    println!("cargo::rustc-cfg=libfabric");
    println!("cargo::metadata=binding=1");
}

/// Compiles bindgen's C wrappers of libfabric's inline calls (`<file>.c` includes nothing
/// itself: the header goes in front of it), and the loader that opens `library` when first
/// used.
fn compile_wrappers(
    wrappers: &Path,
    header: &Path,
    include: &Path,
    manifest: &Path,
    library: &str,
) {
    let mut c = wrappers.to_path_buf();
    c.set_extension("c");
    cc::Build::new()
        .file(&c)
        .include(include)
        .flag("-include")
        .flag(header.to_string_lossy().as_ref())
        .warnings(false)
        .compile("kvpool_fabric_inline");
    println!("cargo::rerun-if-changed=loader.c");
    cc::Build::new()
        .file(manifest.join("loader.c"))
        .include(include)
        .define("KVPOOL_LIBFABRIC_SO", format!("\"{library}\"").as_str())
        .compile("kvpool_fabric_loader");
}
