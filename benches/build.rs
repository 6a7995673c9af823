//! `cfg(libfabric)` where kvpool-fabric was built with its binding (`kvpool-bench fabric`).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(libfabric)");
    println!("cargo::rerun-if-env-changed=DEP_FABRIC_BINDING");
    if std::env::var_os("DEP_FABRIC_BINDING").is_some_and(|v| v == "1") {
        println!("cargo::rustc-cfg=libfabric");
    }
}
