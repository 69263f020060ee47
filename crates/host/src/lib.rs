//! kvpages-host: the axum + tokio server that runs `kvpages-core` behind vLLM's HF3FS routes.
//!
//! # Layout
//! - [`cli`]: the `kvpages` command line (flags, `KVPAGES_*` environment variables, logging).
//! - [`server`]: builds the router, the per-request guard (time bound, request log) and runs it.
//! - [`connections`]: the accept loop and its limits (head and idle time limits, the connection
//!   cap below the descriptor limit).
//! - [`engine`]: the small interface the server drives, and the native engine behind it.
//! - [`api`]: the host's own error answers (from the core's catalogue, `kvpages_wire::ErrorCode`)
//!   and JSON responses.
//! - `routes`: every route of `kvpages_wire` (vLLM's, SGLang's, `/stats`, key inspection)
//!   through one handler: body → `wire::parse` → [`kvpages_core::Command`] → engine →
//!   `Pending::answer`; plus `/health`, SGLang's persistence file import and export.
//! - `wire`: re-exports of the core's strict JSON decoding for the host's own formats.
//! - [`bench`](mod@bench): `kvpages bench`, the load generator (and its transport-only floor route).
//! - [`client`]: a small keep-alive HTTP/1.1 client for loopback servers.
//! - [`metrics`]: `GET /metrics` (Prometheus text format) and the recording functions.
//! - [`access`]: `--allow` (client address allowlist) and `--admin-token`.
//! - [`forward`]: `kvpages forward`, the per-node TCP forwarder to the one server.
//! - `simulator`: `/simulator/`, the browser simulator's page and wasm module (embedded).
//!
//! Requests are parsed and validated outside the engine lock; the lock is held only while the
//! core applies the command.

pub mod access;
pub mod api;
pub mod bench;
pub mod cli;
pub mod client;
pub mod connections;
pub mod durable;
pub mod engine;
pub mod forward;
pub mod metrics;
pub mod plugin;
mod routes;
pub mod server;
mod simulator;
mod wire;
