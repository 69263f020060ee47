//! The `kvpages` binary: parses the command line (`args`), starts logging, and hands over to the
//! libraries: `kvpages_host` serves, forwards and queries, `kvpages_bench` measures.

mod args;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use kvpages_host::app::try_build_engine;
use kvpages_host::runtime::{default_threads, init_logging, server_runtime, shutdown_signal};
use kvpages_host::server;

use crate::args::{Cli, Cmd, ExportArgs, ForwardArgs, ImportArgs, QueryArgs, ServeArgs};

/// Entry point of the binary.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Cmd::Serve(args) => serve(args),
        Cmd::Bench(args) => kvpages_bench::main(args.into()),
        Cmd::Stats(args) => query(&args, "/stats".to_owned()),
        Cmd::Inspect(args) => query(&args.server, format!("/admin/keys/{}", percent_encode(&args.key))),
        Cmd::ImportSglang(args) => import_sglang(&args),
        Cmd::ExportSglang(args) => export_sglang(&args),
        Cmd::Forward(args) => forward(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvpages: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(args: ServeArgs) -> Result<(), String> {
    init_logging(&args.log)?;
    let config = args.config()?;
    let threads = args.threads.unwrap_or_else(default_threads);
    let rt = server_runtime(threads)?;
    rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", bracket_v6(&args.host), args.port)
            .parse()
            .map_err(|e| format!("--host {} --port {}: {e}", args.host, args.port))?;
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let seed = random_seed();
        let engine = try_build_engine(&config, seed)?;
        tracing::info!(
            engine = %config.engine,
            threads,
            world_size = ?config.settings.world_size,
            max_body = config.max_body,
            request_timeout = ?config.request_timeout,
            reservation_ttl_ms = config.settings.reservation_ttl,
            "starting"
        );
        let limits = config.connections;
        let (router, handle) = server::build(config, engine)?;
        // Serve at once (503 `recovering` until the state is back), recover meanwhile.
        let serving = tokio::spawn(server::run_with(listener, router, limits, shutdown_signal()));
        let started = match &args.import_sglang {
            Some(path) => match handle.start(seed).await {
                Ok(()) => handle.import_sglang(path).await,
                Err(e) => Err(e),
            },
            None => handle.start(seed).await,
        };
        if let Err(e) = started {
            serving.abort();
            return Err(e);
        }
        let result = serving.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string());
        handle.stop().await;
        result
    })
}

/// `kvpages forward`.
fn forward(args: ForwardArgs) -> Result<(), String> {
    init_logging(&args.log)?;
    let target: kvpages_host::forward::Target = args.to.parse()?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
        kvpages_host::forward::run(listener, target, args.connect_timeout, shutdown_signal())
            .await
            .map_err(|e| e.to_string())
    })
}

fn bracket_v6(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host.to_owned() }
}

/// A seed for the core's hash tables (the core has no randomness of its own).
fn random_seed() -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one(0x006b_7670_6167_6573_u64)
}

/// `GET path` on a running server; prints the JSON body, fails on an error status.
fn query(args: &QueryArgs, path: String) -> Result<(), String> {
    let url = &args.url;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut client = args.connect().await?;
        let resp = client.get(&path).await.map_err(|e| format!("{url}{path}: {e}"))?;
        let text = String::from_utf8_lossy(&resp.body);
        let pretty = serde_json::from_slice::<serde_json::Value>(&resp.body)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok())
            .unwrap_or_else(|| text.into_owned());
        if (200..300).contains(&resp.status) {
            println!("{pretty}");
            Ok(())
        } else {
            Err(format!("{url}{path} answered {}: {pretty}", resp.status))
        }
    })
}

/// Escapes everything but unreserved characters, for a key in a URL path.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn import_sglang(args: &ImportArgs) -> Result<(), String> {
    let body = std::fs::read(&args.file).map_err(|e| format!("{}: {e}", args.file.display()))?;
    eprintln!("kvpages: sending {} ({} bytes) to {}", args.file.display(), body.len(), args.server.url);
    let path = if args.replace { "/admin/import/sglang?replace=true" } else { "/admin/import/sglang" };
    let url = &args.server.url;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async {
        let mut client = args.server.connect().await?;
        let started = std::time::Instant::now();
        // The server does the work (its log shows the parsing progress); say every second that
        // it is still going, so a large import does not look hung.
        let post = client.post(path, body);
        tokio::pin!(post);
        let every = Duration::from_secs(1);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let resp = loop {
            tokio::select! {
                resp = &mut post => break resp,
                _ = tick.tick() => eprintln!(
                    "kvpages: import: the server is still importing, {:.0} s (its log shows the progress)",
                    started.elapsed().as_secs_f64()
                ),
            }
        };
        let resp = resp.map_err(|e| format!("{url}{path}: {e}"))?;
        let text = String::from_utf8_lossy(&resp.body);
        if (200..300).contains(&resp.status) {
            if let Some(line) = import_summary(&resp.body) {
                eprintln!("kvpages: {line}");
            }
            println!("{text}");
            Ok(())
        } else {
            Err(format!("{url}{path} answered {}: {text}", resp.status))
        }
    })
}

/// The final line of an import, from the server's reply
/// (`{"pools":P,"keys":K,"leaked_pages":L,"seconds":S}`).
fn import_summary(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let (pools, keys, leaked, secs) =
        (v["pools"].as_u64()?, v["keys"].as_u64()?, v["leaked_pages"].as_u64()?, v["seconds"].as_f64()?);
    Some(format!(
        "import: done, {keys} keys of {pools} pools in {secs:.2} s ({:.0} keys/s), {leaked} leaked pages made free",
        keys as f64 / secs.max(1e-9)
    ))
}

fn export_sglang(args: &ExportArgs) -> Result<(), String> {
    let url = &args.server.url;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    let body = rt.block_on(async {
        let mut client = args.server.connect().await?;
        let resp = client.get("/admin/export/sglang").await.map_err(|e| format!("{url}: {e}"))?;
        if (200..300).contains(&resp.status) {
            Ok(resp.body)
        } else {
            Err(format!("{url}/admin/export/sglang answered {}: {}", resp.status, String::from_utf8_lossy(&resp.body)))
        }
    })?;
    // Written beside the target and renamed, so a crash never leaves half a file.
    let tmp = args.file.with_extension("tmp");
    std::fs::write(&tmp, &body)
        .and_then(|()| std::fs::rename(&tmp, &args.file))
        .map_err(|e| format!("{}: {e}", args.file.display()))?;
    eprintln!("kvpages: wrote {} ({} bytes)", args.file.display(), body.len());
    Ok(())
}
