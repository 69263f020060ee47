//! kvpages-host: the axum + tokio server that runs `kvpages-core` behind vLLM's and SGLang's
//! HF3FS routes. The `kvpages` binary (`crates/cli`) parses the flags into a
//! [`config::ServeConfig`] and runs it; the load generator (`crates/bench`) starts it in-process.
//!
//! # Layout, by layer (a module uses only the layers below it)
//! - Leaves: [`telemetry`] (the process's figures and their `/metrics` exposition), [`runtime`]
//!   (worker threads, logging, the shutdown signal), [`api`] (error answers from the wire
//!   crate's catalogue, JSON responses), [`client`] (a keep-alive HTTP/1.1 client for loopback
//!   servers), [`progress`] (count and rate lines for long work: recovery, imports).
//! - Engines and storage: [`engine`] (the interface the app drives, and the native engine),
//!   [`plugin`] (the wasm engine: the core as a sandboxed component), [`durable`] (the
//!   write-ahead log, snapshots, recovery), `sglang_file` (SGLang's persistence file).
//! - [`config`]: what `kvpages serve` is told; [`access`] (`--allow`, `--admin-token`) and
//!   [`connections`] (the accept loop and its limits).
//! - [`app`]: the engine behind its lock with the log beside it: apply, recover, snapshot.
//! - `routes`: every route of `kvpages_wire` through one handler (body → `wire::parse` →
//!   command → [`app::App::apply`] → answer), plus `/health`, `/metrics`, SGLang's file import
//!   and export, and `/simulator/`.
//! - [`server`]: the router over the routes, the request log, the run loop. [`forward`]:
//!   `kvpages forward`, the per-node TCP forwarder to the one server.
//!
//! Requests are parsed and validated outside the engine lock; the lock is held only while the
//! core applies the command.

pub mod access;
pub mod api;
pub mod app;
pub mod client;
pub mod config;
pub mod connections;
pub mod durable;
pub mod engine;
pub mod forward;
pub mod plugin;
pub mod progress;
mod routes;
pub mod runtime;
pub mod server;
mod sglang_file;
pub mod telemetry;
