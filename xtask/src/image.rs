//! The container image: `cargo xtask image` builds it from the `Dockerfile`, and `cargo xtask
//! test` builds and runs it (`tests/deploy/test_image.py`).
//!
//! Both use the Dockerfile's "prebuilt" way: the binary (with the plugin and the simulator
//! embedded) is built here first and copied in. `cargo xtask image` hands the build to Docker when
//! its daemon answers, else to podman or buildah. The test uses buildah, which needs no daemon:
//! Debian's package, with the `vfs` storage driver and chroot isolation, as root. When no
//! registry gives `debian:bookworm-slim` (CI reaches only Debian's mirrors), it makes a base of the
//! same release with debootstrap (`--variant=minbase`) under a local name of its own, and builds
//! on it (`--build-arg KVPAGES_BASE=...`).

use std::path::Path;
use std::process::{Command, Stdio};

use crate::{Result, count_pytest, ran_some, root, run, run_capture, step};

const BASE: &str = "docker.io/library/debian:bookworm-slim";
/// The debootstrapped stand-in for [`BASE`], never under the official name.
const LOCAL_BASE: &str = "localhost/kvpages-test-base:bookworm";
const TEST_IMAGE: &str = "localhost/kvpages:test";

/// buildah for the test, on a store of its own driver (`vfs`: no overlay mounts needed).
fn buildah() -> Command {
    let mut c = Command::new("buildah");
    c.args(["--storage-driver", "vfs"]);
    c
}

fn quiet(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// `cargo xtask image [--tag NAME]`: the release binary, then the image (default tag `kvpages`).
pub fn image(args: &[String]) -> Result<()> {
    let tag = match args {
        [] => "kvpages".to_string(),
        [flag, name] if flag == "--tag" => name.clone(),
        _ => return Err("usage: cargo xtask image [--tag NAME]".into()),
    };
    let route = crate::plugin::build()?;
    crate::simulator::build(route)?;
    step("build the release binary");
    crate::run(crate::cargo().args(["build", "--release", "-p", "kvpages"]))?;
    step(&format!("container image {tag} (Dockerfile, KVPAGES_BINARY=prebuilt)"));
    let args = ["--build-arg", "KVPAGES_BINARY=prebuilt", "-t", &tag, "."];
    if quiet(Command::new("docker").arg("info")) {
        run(Command::new("docker").current_dir(root()).arg("build").args(args))
    } else if quiet(Command::new("podman").arg("--version")) {
        run(Command::new("podman").current_dir(root()).arg("build").args(args))
    } else if quiet(Command::new("buildah").arg("--version")) {
        run(Command::new("buildah").current_dir(root()).args(["bud", "--format", "docker"]).args(args))
    } else {
        Err("no container builder: start a Docker daemon, or install podman or buildah".into())
    }
}

/// Builds the test image from `bin` (a binary inside the repository) and runs the image's tests.
pub fn test(bin: &Path) -> Result<(u64, u64)> {
    step("container image: buildah bud of the Dockerfile (prebuilt binary), then run it");
    ensure_tools()?;
    let base = ensure_base()?;
    let rel = bin.strip_prefix(root()).map_err(|_| format!("{} is outside the repository", bin.display()))?;
    run(buildah()
        .current_dir(root())
        .args(["bud", "--isolation", "chroot", "--pull=never", "--format", "docker"])
        .args([
            "--build-arg",
            "KVPAGES_BINARY=prebuilt",
            "--build-arg",
            &format!("KVPAGES_BINARY_PATH={}", rel.display()),
            "--build-arg",
            &format!("KVPAGES_BASE={base}"),
            "-t",
            TEST_IMAGE,
            ".",
        ]))?;
    let lines = run_capture(Command::new("python3").current_dir(root()).env("KVPAGES_IMAGE", TEST_IMAGE).args([
        "-m",
        "pytest",
        "tests/deploy/test_image.py",
        "-q",
    ]))?;
    // The tests remove their own containers; the image goes too (a vfs image is a full copy).
    let _ = quiet(buildah().args(["rmi", TEST_IMAGE]));
    let _ = quiet(buildah().args(["rmi", "--prune"]));
    ran_some("the container image", count_pytest(&lines)?)
}

fn ensure_tools() -> Result<()> {
    if quiet(Command::new("buildah").arg("--version")) && quiet(Command::new("debootstrap").arg("--version")) {
        return Ok(());
    }
    run(Command::new("apt-get").arg("update"))?;
    run(Command::new("apt-get").args(["install", "-y", "--no-install-recommends", "buildah", "debootstrap"]))
}

/// The base to build on: `debian:bookworm-slim` if buildah's store has it or a registry gives
/// it, else [`LOCAL_BASE`] (kept in the store; made with debootstrap when missing).
fn ensure_base() -> Result<&'static str> {
    for name in [BASE, LOCAL_BASE] {
        if quiet(buildah().args(["inspect", "--type", "image", name])) {
            println!("  {name}: in buildah's store");
            return Ok(name);
        }
    }
    if crate::run_with_timeout(
        buildah().args(["pull", "--quiet", BASE]).stdout(Stdio::null()),
        std::time::Duration::from_secs(60),
    ) {
        return Ok(BASE);
    }
    println!("  {BASE} cannot be pulled here: making {LOCAL_BASE} with debootstrap (Debian 12, minbase)");
    let rootfs = root().join("target/image-rootfs");
    let _ = std::fs::remove_dir_all(&rootfs);
    run(Command::new("debootstrap")
        .args(["--variant=minbase", "bookworm"])
        .arg(&rootfs)
        .arg("http://deb.debian.org/debian")
        .stdout(Stdio::null()))?;
    let out = buildah().args(["from", "scratch"]).output().map_err(|e| format!("buildah from scratch: {e}"))?;
    let container = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || container.is_empty() {
        return Err(format!("buildah from scratch failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let made = run(buildah().args(["copy", "--quiet", &container]).arg(format!("{}/", rootfs.display())).arg("/"))
        .and_then(|_| {
            run(buildah().args([
                "config",
                "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--cmd",
                "bash",
                &container,
            ]))
        })
        .and_then(|_| run(buildah().args(["commit", "--quiet", &container, LOCAL_BASE]).stdout(Stdio::null())));
    let _ = quiet(buildah().args(["rm", &container]));
    let _ = std::fs::remove_dir_all(&rootfs);
    made.map(|()| LOCAL_BASE)
}
