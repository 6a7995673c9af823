//! `kvpool-bench disk` end to end on a few small objects, so that it cannot rot: every write
//! lands, every record is found and every read is checked. With fio installed its rows run
//! too; without, they are left out. Nothing here asserts on speed.

use super::*;

#[test]
fn a_small_run_reads_back_every_object_checked_and_leaves_nothing_behind() {
    let base = std::env::temp_dir().join(format!("kvpool-bench-disk-test-{}", std::process::id()));
    let args = DiskArgs {
        dir: Some(base.clone()),
        objects: 40,
        value_size: 256 << 10,
        readers: vec![1, 2],
        seconds: 0.5,
        rounds: 2,
        fio: PathBuf::from("fio"),
    };
    run(args).unwrap();
    let left = std::fs::read_dir(&base).map_or(0, |d| d.count());
    let _ = std::fs::remove_dir(&base);
    assert_eq!(left, 0, "the run's directory was not removed");
}
