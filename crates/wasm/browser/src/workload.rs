//! Seeded workload generators: what an LLM serving cluster asks the metadata server.
//!
//! A generator only decides *which blocks* one serving step touches and how its writers behave;
//! the simulation turns that into the requests vLLM's connector sends (see [`crate::sim`]). Keys
//! are 32-hex chain hashes, like vLLM's block hashes: a block's key depends on every block
//! before it, so prompts sharing a prefix share the keys of that prefix.

use serde::{Deserialize, Serialize};

use kvpages_rng::{Rng, mix};

/// Which pattern a workload follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// Many requests sharing long prompt prefixes; prompt popularity is Zipf(`zipf`).
    #[default]
    SharedPrefix,
    /// Chats that grow their prefix by `blocks` blocks a turn.
    MultiTurn,
    /// Every step saves `blocks` blocks never seen before: fills the pool.
    UniqueBurst,
    /// Shared-prefix traffic where a `crashRate` share of writers never confirms.
    CrashingWriters,
    /// Shared-prefix traffic saved by two instances at once (both allocate, both confirm).
    DuplicateWriters,
}

/// A workload: its kind, seed and parameters (the ones a kind does not use are ignored).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct WorkloadSpec {
    /// The pattern.
    pub kind: Kind,
    /// Seeds the generator (independent of the core's seed).
    pub seed: u64,
    /// Simulated milliseconds per step.
    pub step_ms: u64,
    /// Blocks of its own per prompt, per chat turn, or per burst step.
    pub blocks: u32,
    /// Distinct prompts (shared-prefix kinds).
    pub prompts: u32,
    /// Zipf exponent of prompt popularity (shared-prefix kinds).
    pub zipf: f64,
    /// Blocks of the system prompt every prompt of a group starts with.
    pub prefix_blocks: u32,
    /// Distinct system prompts; prompt `p` uses system prompt `p % systemPrompts`.
    pub system_prompts: u32,
    /// Concurrent chats (multi-turn).
    pub chats: u32,
    /// Turns after which a chat ends and a new one takes its place (multi-turn).
    pub max_turns: u32,
    /// Share of writers that crash before confirming (crashing-writers).
    pub crash_rate: f64,
}

impl Default for WorkloadSpec {
    fn default() -> WorkloadSpec {
        WorkloadSpec {
            kind: Kind::SharedPrefix,
            seed: 1,
            step_ms: 100,
            blocks: 16,
            prompts: 500,
            zipf: 1.1,
            prefix_blocks: 12,
            system_prompts: 4,
            chats: 64,
            max_turns: 16,
            crash_rate: 0.3,
        }
    }
}

/// Largest number of prompts or chats a workload may have (the Zipf table is one f64 each).
pub const MAX_POPULATION: u32 = 1_000_000;
/// Largest number of blocks one step may touch.
pub const MAX_BLOCKS: u32 = 4_096;

impl WorkloadSpec {
    /// Checks the parameters, naming the first bad one.
    pub fn validate(&self) -> Result<(), String> {
        let range = |name: &str, v: u32, lo: u32, hi: u32| {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(format!("workload {name} must be in {lo}..={hi}, not {v}"))
            }
        };
        range("blocks", self.blocks, 1, MAX_BLOCKS)?;
        range("prompts", self.prompts, 1, MAX_POPULATION)?;
        range("prefixBlocks", self.prefix_blocks, 0, MAX_BLOCKS)?;
        range("systemPrompts", self.system_prompts, 1, MAX_POPULATION)?;
        range("chats", self.chats, 1, MAX_POPULATION)?;
        range("maxTurns", self.max_turns, 1, 1_000)?;
        if self.kind == Kind::MultiTurn && u64::from(self.blocks) * u64::from(self.max_turns) > u64::from(MAX_BLOCKS) {
            return Err(format!("workload blocks x maxTurns must be at most {MAX_BLOCKS}"));
        }
        if self.prefix_blocks + self.blocks > MAX_BLOCKS {
            return Err(format!("workload prefixBlocks + blocks must be at most {MAX_BLOCKS}"));
        }
        if !(self.zipf.is_finite() && (0.0..=5.0).contains(&self.zipf)) {
            return Err(format!("workload zipf must be in 0..=5, not {}", self.zipf));
        }
        if !(self.crash_rate.is_finite() && (0.0..=1.0).contains(&self.crash_rate)) {
            return Err(format!("workload crashRate must be in 0..=1, not {}", self.crash_rate));
        }
        if self.step_ms > 3_600_000 {
            return Err(format!("workload stepMs must be at most 3600000, not {}", self.step_ms));
        }
        Ok(())
    }
}

/// What one serving step does: look the blocks up, load the hits, save the misses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The request's block keys, in prompt order.
    pub keys: Vec<String>,
    /// How many instances save the misses at once (1, or 2 for duplicate writers).
    pub writers: u32,
    /// Whether the writers crash after allocating (never confirm).
    pub crash: bool,
}

/// A running generator.
#[derive(Clone, Debug)]
pub struct Workload {
    spec: WorkloadSpec,
    rng: Rng,
    /// Cumulative Zipf weights of the prompts.
    cdf: Vec<f64>,
    /// Per chat: its id and turns so far.
    chats: Vec<(u64, u32)>,
    next_id: u64,
}

/// The key of the block after `prev` whose own content is `content`: a 128-bit chain hash.
fn chain(prev: u128, content: u64) -> u128 {
    let hi = mix((prev >> 64) as u64 ^ mix(content));
    let lo = mix(prev as u64 ^ hi.rotate_left(17) ^ content);
    (u128::from(hi) << 64) | u128::from(lo)
}

fn hex(k: u128) -> String {
    format!("{k:032x}")
}

impl Workload {
    /// A generator for `spec`, which must be valid.
    pub fn new(spec: WorkloadSpec) -> Workload {
        let mut cdf = Vec::new();
        if matches!(spec.kind, Kind::SharedPrefix | Kind::CrashingWriters | Kind::DuplicateWriters) {
            let mut total = 0.0;
            cdf.reserve(spec.prompts as usize);
            for k in 1..=spec.prompts {
                total += libm::pow(f64::from(k), -spec.zipf);
                cdf.push(total);
            }
        }
        let chats = (0..u64::from(spec.chats)).map(|id| (id, 0)).collect();
        Workload { rng: Rng::new(spec.seed), cdf, chats, next_id: u64::from(spec.chats), spec }
    }

    /// The spec this generator runs.
    pub fn spec(&self) -> &WorkloadSpec {
        &self.spec
    }

    /// The next step's plan.
    pub fn next_plan(&mut self) -> Plan {
        let s = &self.spec;
        // Distinct namespaces for the contents of system prompts, prompts, chats and bursts.
        let seed = u128::from(mix(s.seed ^ 0x5eed));
        match s.kind {
            Kind::SharedPrefix | Kind::CrashingWriters | Kind::DuplicateWriters => {
                let total = *self.cdf.last().expect("prompts >= 1");
                let x = self.rng.unit() * total;
                let prompt = self.cdf.partition_point(|&c| c <= x).min(self.cdf.len() - 1) as u64;
                let system = prompt % u64::from(s.system_prompts);
                let mut keys = Vec::with_capacity((s.prefix_blocks + s.blocks) as usize);
                let mut k = seed;
                for i in 0..u64::from(s.prefix_blocks) {
                    k = chain(k, mix(1 << 60 | system << 20 | i));
                    keys.push(hex(k));
                }
                for i in 0..u64::from(s.blocks) {
                    k = chain(k, mix(2 << 60 | prompt << 20 | i));
                    keys.push(hex(k));
                }
                let crash = s.kind == Kind::CrashingWriters && self.rng.unit() < s.crash_rate;
                let writers = if s.kind == Kind::DuplicateWriters { 2 } else { 1 };
                Plan { keys, writers, crash }
            }
            Kind::MultiTurn => {
                let c = self.rng.below(self.chats.len() as u64) as usize;
                if self.chats[c].1 >= s.max_turns {
                    self.chats[c] = (self.next_id, 0);
                    self.next_id += 1;
                }
                self.chats[c].1 += 1;
                let (id, turns) = self.chats[c];
                let mut k = seed;
                let keys = (0..u64::from(turns * s.blocks))
                    .map(|i| {
                        k = chain(k, mix(3 << 60 | id << 20 | i));
                        hex(k)
                    })
                    .collect();
                Plan { keys, writers: 1, crash: false }
            }
            Kind::UniqueBurst => {
                let id = self.next_id;
                self.next_id += 1;
                let mut k = seed;
                let keys = (0..u64::from(s.blocks))
                    .map(|i| {
                        k = chain(k, mix(4 << 60 | id << 20 | i));
                        hex(k)
                    })
                    .collect();
                Plan { keys, writers: 1, crash: false }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(kind: Kind) -> WorkloadSpec {
        WorkloadSpec {
            kind,
            prompts: 20,
            blocks: 2,
            prefix_blocks: 3,
            system_prompts: 2,
            chats: 3,
            ..Default::default()
        }
    }

    #[test]
    fn same_seed_same_plans_other_seed_other_plans() {
        for kind in
            [Kind::SharedPrefix, Kind::MultiTurn, Kind::UniqueBurst, Kind::CrashingWriters, Kind::DuplicateWriters]
        {
            let (mut a, mut b) = (Workload::new(spec(kind)), Workload::new(spec(kind)));
            let pa: Vec<Plan> = (0..50).map(|_| a.next_plan()).collect();
            let pb: Vec<Plan> = (0..50).map(|_| b.next_plan()).collect();
            assert_eq!(pa, pb, "{kind:?}");
            let mut c = Workload::new(WorkloadSpec { seed: 2, ..spec(kind) });
            let pc: Vec<Plan> = (0..50).map(|_| c.next_plan()).collect();
            assert_ne!(pa, pc, "{kind:?}");
            assert!(pa.iter().flat_map(|p| &p.keys).all(|k| k.len() == 32 && k.bytes().all(|b| b.is_ascii_hexdigit())));
        }
    }

    #[test]
    fn prompts_of_one_system_prompt_share_its_prefix() {
        let mut w = Workload::new(spec(Kind::SharedPrefix));
        let plans: Vec<Plan> = (0..200).map(|_| w.next_plan()).collect();
        assert!(plans.iter().all(|p| p.keys.len() == 5 && p.writers == 1 && !p.crash));
        // Two system prompts: exactly two distinct 3-block prefixes.
        let mut prefixes: Vec<&[String]> = plans.iter().map(|p| &p.keys[..3]).collect();
        prefixes.sort();
        prefixes.dedup();
        assert_eq!(prefixes.len(), 2);
        // Zipf(1.1) over 20 prompts: the most popular prompt is drawn far more often than the least.
        let mut counts = std::collections::BTreeMap::new();
        for p in &plans {
            *counts.entry(p.keys[4].clone()).or_insert(0) += 1;
        }
        let most = counts.values().max().unwrap();
        assert!(*most >= 40, "{counts:?}");
    }

    #[test]
    fn chats_grow_their_prefix_and_bursts_never_repeat() {
        let mut w = Workload::new(WorkloadSpec { chats: 1, max_turns: 3, ..spec(Kind::MultiTurn) });
        let turns: Vec<Plan> = (0..4).map(|_| w.next_plan()).collect();
        assert_eq!(turns.iter().map(|p| p.keys.len()).collect::<Vec<_>>(), [2, 4, 6, 2]);
        assert_eq!(turns[1].keys[..2], turns[0].keys[..]);
        assert_eq!(turns[2].keys[..4], turns[1].keys[..]);
        assert_ne!(turns[3].keys[0], turns[0].keys[0], "a new chat starts after max_turns");

        let mut w = Workload::new(spec(Kind::UniqueBurst));
        let mut all: Vec<String> = (0..100).flat_map(|_| w.next_plan().keys).collect();
        let n = all.len();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n);
    }

    #[test]
    fn crash_rate_and_duplicate_writers() {
        let mut w = Workload::new(WorkloadSpec { crash_rate: 0.5, ..spec(Kind::CrashingWriters) });
        let crashes = (0..1000).filter(|_| w.next_plan().crash).count();
        assert!((400..600).contains(&crashes), "{crashes}");
        let mut w = Workload::new(spec(Kind::DuplicateWriters));
        assert_eq!(w.next_plan().writers, 2);
    }

    #[test]
    fn bad_specs_are_named() {
        let bad = |s: WorkloadSpec| s.validate().unwrap_err();
        assert_eq!(bad(WorkloadSpec { blocks: 0, ..Default::default() }), "workload blocks must be in 1..=4096, not 0");
        assert_eq!(
            bad(WorkloadSpec { zipf: f64::NAN, ..Default::default() }),
            "workload zipf must be in 0..=5, not NaN"
        );
        assert_eq!(
            bad(WorkloadSpec { crash_rate: 2.0, ..Default::default() }),
            "workload crashRate must be in 0..=1, not 2"
        );
        assert!(WorkloadSpec::default().validate().is_ok());
    }
}
