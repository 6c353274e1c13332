//! The real binary, spawned the way a user or parent process runs it.

use std::process::Command;

fn mlx_runner() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mlx-runner"));
    // The binary must find libmlx through its rpath alone (BUILD_NOTES.md).
    c.env_remove("LD_LIBRARY_PATH");
    c
}

#[test]
fn info_reports_mlx_device_and_blas() {
    let out = mlx_runner().arg("info").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("mlx        0.32.4"), "{text}");
    assert!(text.contains("device     cpu"), "{text}");
    assert!(text.lines().any(|l| l.starts_with("sgemm ")), "{text}");
    assert!(text.contains("self-check ok"), "{text}");
}

#[test]
fn unknown_subcommand_is_a_clear_error() {
    let out = mlx_runner().arg("frobnicate").output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unrecognized subcommand 'frobnicate'"),
        "{err}"
    );
}
