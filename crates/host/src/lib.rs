//! kvpages-host: the axum + tokio server that runs `kvpages-core` behind vLLM's HF3FS routes.
//!
//! # Layout
//! - [`cli`]: the `kvpages` command line (flags, `KVPAGES_*` environment variables, logging).
//! - [`server`]: builds the router, the per-request guard (time bound, request log) and runs it.
//! - [`engine`]: the small interface the server drives, and the native engine behind it.
//! - [`api`]: the error catalogue (status + `detail` of every error the server can answer) and
//!   JSON responses.
//! - `wire`: strict JSON decoding (integers in u32 range, no duplicate members, exact pairs).
//! - `routes::vllm`: vLLM's six routes: request bodies → [`kvpages_core::Command`] → replies.
//! - [`bench`]: `kvpages bench`, the load generator (and its transport-only floor route).
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
pub mod durable;
pub mod engine;
pub mod forward;
pub mod metrics;
pub mod plugin;
mod routes;
pub mod server;
mod simulator;
mod wire;
