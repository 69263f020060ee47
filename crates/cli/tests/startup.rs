//! The binary's start-up, run as users run it: a data directory of the first format served as
//! it is, and a `--plugin` that is no component refused with a clear message.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The golden data directories, kept beside the data-format tests of `kvpages-host`.
fn golden() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../host/tests/data")
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvpages-startup-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Copies the files of `from` (not its directories) into a new `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

#[test]
fn kvpages_serve_starts_on_the_format_1_golden_directory() {
    use std::io::{Read, Write};
    let dir = tmp("serve");
    copy_dir(&golden().join("format-1"), &dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    /// Kills the server however the test ends.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_kvpages"))
        .args(["serve", "--port", &port.to_string(), "--engine", "native", "--log", "warn", "--data-dir"])
        .arg(&dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let child = Killed(child);
    let post = |path: &str, body: &str| -> Option<(u16, String)> {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .ok()?;
        let mut raw = String::new();
        s.read_to_string(&mut raw).ok()?;
        let (head, body) = raw.split_once("\r\n\r\n")?;
        Some((head.get(9..12)?.parse().ok()?, body.to_owned()))
    };
    let body = r#"{"rank":0,"keys":["00000000000000000000000000000001","00000000000000000000000000000002","layer-0/block 7"]}"#;
    let deadline = Instant::now() + Duration::from_secs(20);
    let got = loop {
        match post("/keys/get_locations", body) {
            Some((200, b)) => break b,
            _ if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            other => panic!("kvpages did not serve the golden directory: {other:?}"),
        }
    };
    // As format-1.expected.json says: key 1 on page 0, key 2 deleted, the verbatim key on page 2.
    assert_eq!(got, r#"{"locations":[0,null,2]}"#);
    drop(child);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_binary_refuses_a_bad_plugin_with_a_clear_message() {
    let bin = env!("CARGO_BIN_EXE_kvpages");
    let dir = std::env::temp_dir().join(format!("kvpages-plugin-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("not-a-plugin.wasm");
    // A core module (binary), not a component.
    std::fs::write(&path, b"\0asm\x01\0\0\0").unwrap();
    let out = std::process::Command::new(bin).args(["serve", "--port", "0", "--plugin"]).arg(&path).output().unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("is not a valid component"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
