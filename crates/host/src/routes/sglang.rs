//! SGLang HiCache's HF3FS metadata routes, `POST /{rank}/{op}`: their JSON and rules are
//! `kvpages_wire`'s (see `protocol-sglang.md` in the project's notes); the router sends
//! them there through `routes::serve`. What the host's SGLang file format shares with them:

/// The longest namespace accepted, in bytes (SGLang's are words like `kv`, `mamba`, `swa`).
pub use kvpages_wire::MAX_NAMESPACE_LEN;
