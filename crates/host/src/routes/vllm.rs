//! vLLM's HF3FS metadata routes: their JSON and rules are `kvpages_wire`'s (see
//! `protocol-vllm.md` in the project's notes, and `docs/errors.md`); the host adds the log lines
//! an operator reads.

use kvpages_core::{Command, InitOutcome, Reply, Space};

/// Logs what an applied vLLM command did, where an operator should know: ranks joining or
/// re-created, confirms applied in part, clears and deletes.
pub(crate) fn log_applied(cmd: &Command, reply: &Reply) {
    match (cmd, reply) {
        (&Command::Initialize { space: Space::Vllm, rank, num_pages }, Reply::Initialized { outcome, .. }) => {
            match *outcome {
                InitOutcome::Created { joined_after_keys: true } => tracing::warn!(
                    rank,
                    "rank {rank} joined after keys were confirmed: those keys are incomplete until rank {rank} stores them"
                ),
                InitOutcome::Created { .. } => tracing::info!(rank, num_pages, "rank initialized"),
                InitOutcome::Unchanged => tracing::debug!(rank, num_pages, "rank already initialized with this size"),
                InitOutcome::Recreated { old_num_pages, dropped_keys } => tracing::warn!(
                    rank,
                    old_num_pages,
                    num_pages,
                    dropped_keys,
                    "rank re-initialized with another size: pool re-created, keys with pages on it dropped"
                ),
            }
        }
        (&Command::Confirm { space: Space::Vllm, rank, .. }, Reply::Confirmed(report))
            if !report.refused.is_empty() || !report.ignored_releases.is_empty() || report.superseded > 0 =>
        {
            tracing::info!(
                rank,
                committed = report.committed,
                refused = report.refused.len(),
                superseded = report.superseded,
                ignored_releases = report.ignored_releases.len(),
                "confirm applied in part"
            );
        }
        (Command::Clear { space: Space::Vllm }, &Reply::Cleared { ranks, keys }) => {
            tracing::info!(ranks, keys, "cleared the vLLM space")
        }
        (Command::Delete { space: Space::Vllm, .. }, &Reply::Deleted(deleted)) => {
            tracing::info!(deleted, "keys deleted")
        }
        _ => {}
    }
}
