//! The simulation: a core, a simulated clock, a workload, the event log and the scenario log.
//!
//! Every request, typed by hand or made by a workload, goes through the server's wire rules
//! (`wire::parse` → `Core::apply` → `Pending::answer`), so its reply is byte for byte what
//! `kvpages serve` answers. The scenario log records the user's actions (workload changes,
//! steps, clock moves, hand requests), not the requests they cause: replaying it regenerates
//! the same requests, and a 100k-command run exports as a few lines.

use std::collections::VecDeque;

use kvpages_core::{Core, Eviction, PageCounts, PageView, Reply, Settings, Space};
use kvpages_wire as wire;
use serde::{Deserialize, Serialize};

use crate::workload::{Workload, WorkloadSpec};

/// The format tag of an exported scenario.
pub const SCENARIO_FORMAT: &str = "kvpages-scenario 1";
/// Events the event log keeps.
pub const EVENTS_KEPT: usize = 1_000;
/// Bodies longer than this are cut in the event log (the scenario log keeps them whole).
pub const EVENT_BODY_BYTES: usize = 2_048;
/// Largest number of TP ranks a simulation may have.
pub const MAX_RANKS: u32 = 64;

/// Eviction policy, as the page names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionName {
    /// Least recently used keys go first.
    #[default]
    Lru,
    /// A full pool answers -1.
    Off,
}

/// The pool policy: the core's [`Settings`] in the page's units and names.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct SimSettings {
    /// Reservation TTL (ms).
    pub reservation_ttl_ms: u64,
    /// Read lease of get_locations and allocate hits (ms).
    pub read_lease_ms: u64,
    /// Quarantine of pages taken back (ms).
    pub quarantine_ms: u64,
    /// Eviction policy.
    pub eviction: EvictionName,
    /// Evict above this share of a rank (per mille).
    pub evict_high_permille: u16,
    /// ... down to this share (per mille).
    pub evict_low_permille: u16,
    /// TP world size (`null`: the initialized ranks).
    pub world_size: Option<u32>,
}

impl Default for SimSettings {
    fn default() -> SimSettings {
        SimSettings::from(Settings::default())
    }
}

impl From<Settings> for SimSettings {
    fn from(s: Settings) -> SimSettings {
        SimSettings {
            reservation_ttl_ms: s.reservation_ttl,
            read_lease_ms: s.read_lease,
            quarantine_ms: s.quarantine,
            eviction: match s.eviction {
                Eviction::Lru => EvictionName::Lru,
                Eviction::Off => EvictionName::Off,
            },
            evict_high_permille: s.evict_high_permille,
            evict_low_permille: s.evict_low_permille,
            world_size: s.world_size,
        }
    }
}

impl SimSettings {
    fn to_core(&self) -> Settings {
        Settings {
            reservation_ttl: self.reservation_ttl_ms,
            world_size: self.world_size,
            read_lease: self.read_lease_ms,
            quarantine: self.quarantine_ms,
            eviction: match self.eviction {
                EvictionName::Lru => Eviction::Lru,
                EvictionName::Off => Eviction::Off,
            },
            evict_high_permille: self.evict_high_permille,
            evict_low_permille: self.evict_low_permille,
        }
    }
}

/// A simulated cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default, deny_unknown_fields)]
pub struct Config {
    /// Seeds the core's hash tables.
    pub seed: u64,
    /// TP ranks, initialized in vLLM's space.
    pub ranks: u32,
    /// Pages of each rank's file.
    pub pages_per_rank: u32,
    /// Pool policy.
    pub settings: SimSettings,
}

impl Default for Config {
    fn default() -> Config {
        Config { seed: 1, ranks: 2, pages_per_rank: 4096, settings: SimSettings::default() }
    }
}

/// Largest seed: JavaScript numbers are exact up to 2^53.
pub const MAX_SEED: u64 = (1 << 53) - 1;

impl Config {
    /// Checks the config, naming the first bad field.
    pub fn validate(&self) -> Result<(), SimError> {
        let bad = |m: String| Err(SimError(m));
        if self.seed > MAX_SEED {
            return bad(format!("seed must be at most {MAX_SEED}, not {}", self.seed));
        }
        if !(1..=MAX_RANKS).contains(&self.ranks) {
            return bad(format!("ranks must be in 1..={MAX_RANKS}, not {}", self.ranks));
        }
        if self.pages_per_rank == 0 {
            return bad("pagesPerRank must be at least 1".into());
        }
        let s = &self.settings;
        if s.evict_high_permille > 1000 || s.evict_low_permille > s.evict_high_permille {
            return bad(format!(
                "settings.evictLowPermille <= settings.evictHighPermille <= 1000 must hold, not {} and {}",
                s.evict_low_permille, s.evict_high_permille
            ));
        }
        if s.world_size == Some(0) {
            return bad("settings.worldSize must be at least 1 (or null)".into());
        }
        Ok(())
    }
}

/// A refused config, spec, scenario or argument, with the reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimError(pub String);

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimError {}

/// One user action of the scenario log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "camelCase", deny_unknown_fields)]
pub enum Action {
    /// Switch to another workload (its generator starts afresh).
    Workload {
        /// The workload.
        spec: WorkloadSpec,
    },
    /// Run `n` steps of the current workload.
    Step {
        /// Steps.
        n: u64,
    },
    /// Move the clock.
    Advance {
        /// Milliseconds.
        ms: u64,
    },
    /// A request typed by hand.
    Request {
        /// HTTP method.
        method: String,
        /// Path.
        path: String,
        /// Body text.
        body: String,
    },
}

/// An exported scenario: enough to rebuild the simulation exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// [`SCENARIO_FORMAT`].
    pub format: String,
    /// The cluster.
    pub config: Config,
    /// The user's actions, in order.
    pub log: Vec<Action>,
}

/// One request and its reply, for the event log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Event {
    /// Sequence number (1 = the first request).
    pub seq: u64,
    /// Simulated time (ms).
    pub t: u64,
    /// HTTP method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Request body (cut to [`EVENT_BODY_BYTES`]).
    pub body: String,
    /// Reply status.
    pub status: u16,
    /// Reply body (cut to [`EVENT_BODY_BYTES`]).
    pub reply: String,
}

/// What the workloads' requests saw, counted from the replies (so a replay counts the same).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadStats {
    /// Keys looked up with batch_exists.
    pub lookups: u64,
    /// ... of which existed.
    pub lookup_hits: u64,
    /// Keys batch_allocate answered with page -1.
    pub alloc_failures: u64,
}

/// One rank's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RankFigures {
    /// The rank.
    pub rank: u32,
    /// Its pool size.
    pub num_pages: u32,
    /// Its pages by state: `free`, `reserved`, `committed` (leased ones included), `leased`,
    /// `quarantined`.
    #[serde(flatten)]
    pub pages: PageCounts,
}

/// The figures the page shows.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SimStats {
    /// Simulated time (ms).
    pub now: u64,
    /// Requests sent so far.
    pub requests: u64,
    /// Keys with a committed page.
    pub keys: u64,
    /// Keys with only pending reservations.
    pub pending_keys: u64,
    /// Per rank.
    pub ranks: Vec<RankFigures>,
    /// The core's event counters of vLLM's space (camelCase names of `GET /stats`' counters).
    pub counters: serde_json::Value,
    /// What the workloads' lookups and allocations saw.
    pub workload: WorkloadStats,
}

/// One page, as the page map's hover shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PageInfo {
    /// The page.
    pub page: u32,
    /// free | reserved | committed | leased | quarantined.
    pub state: &'static str,
    /// The key it holds or is reserved for.
    pub key: Option<String>,
    /// Since its key's first commit (committed and leased pages).
    pub age_ms: Option<u64>,
    /// Until its reservation or quarantine ends.
    pub expires_in_ms: Option<u64>,
}

/// The simulation.
#[derive(Clone, Debug)]
pub struct Sim {
    config: Config,
    core: Core,
    now: u64,
    requests: u64,
    workload: Option<Workload>,
    wstats: WorkloadStats,
    events: VecDeque<Event>,
    log: Vec<Action>,
}

fn cut(s: &str) -> String {
    if s.len() <= EVENT_BODY_BYTES {
        return s.to_owned();
    }
    let mut end = EVENT_BODY_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn camel(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => serde_json::Value::Object(
            m.into_iter()
                .map(|(k, v)| {
                    let mut out = String::with_capacity(k.len());
                    let mut up = false;
                    for c in k.chars() {
                        match c {
                            '_' => up = true,
                            c if up => {
                                out.extend(c.to_uppercase());
                                up = false;
                            }
                            c => out.push(c),
                        }
                    }
                    (out, camel(v))
                })
                .collect(),
        ),
        other => other,
    }
}

impl Sim {
    /// A fresh cluster: every rank initialized through `/rank/{r}/initialize`, clock at 0.
    pub fn new(config: Config) -> Result<Sim, SimError> {
        config.validate()?;
        let core = Core::new(config.seed, config.settings.to_core());
        let mut sim = Sim {
            core,
            now: 0,
            requests: 0,
            workload: None,
            wstats: WorkloadStats::default(),
            events: VecDeque::new(),
            log: Vec::new(),
            config,
        };
        for rank in 0..sim.config.ranks {
            let body = format!("{{\"num_pages\": {}}}", sim.config.pages_per_rank);
            let (status, reply, _) = sim.exchange("POST", &format!("/rank/{rank}/initialize"), body);
            if status != 200 {
                return Err(SimError(format!("initializing rank {rank} failed: {status} {reply}")));
            }
        }
        Ok(sim)
    }

    /// Rebuilds a simulation by replaying an exported scenario.
    pub fn from_scenario(s: &Scenario) -> Result<Sim, SimError> {
        if s.format != SCENARIO_FORMAT {
            return Err(SimError(format!("scenario format is '{}', expected '{SCENARIO_FORMAT}'", s.format)));
        }
        let mut sim = Sim::new(s.config.clone())?;
        for (i, action) in s.log.iter().enumerate() {
            sim.act(action.clone()).map_err(|e| SimError(format!("scenario log[{i}]: {e}")))?;
        }
        Ok(sim)
    }

    /// Performs one action and records it in the scenario log.
    pub fn act(&mut self, action: Action) -> Result<(), SimError> {
        self.perform(&action)?;
        self.record(action);
        Ok(())
    }

    fn perform(&mut self, action: &Action) -> Result<Option<(u16, String)>, SimError> {
        match action {
            Action::Workload { spec } => {
                spec.validate().map_err(SimError)?;
                self.workload = Some(Workload::new(spec.clone()));
            }
            Action::Step { n } => {
                if self.workload.is_none() {
                    return Err(SimError("no workload is set".into()));
                }
                for _ in 0..*n {
                    self.step_once();
                }
            }
            Action::Advance { ms } => self.now = self.now.saturating_add(*ms),
            Action::Request { method, path, body } => {
                let (status, reply, _) = self.exchange(method, path, body.clone());
                return Ok(Some((status, reply)));
            }
        }
        Ok(None)
    }

    fn record(&mut self, action: Action) {
        // Consecutive steps and clock moves merge, so a long run stays one line.
        match (self.log.last_mut(), &action) {
            (Some(Action::Step { n: a }), Action::Step { n: b }) => *a += b,
            (Some(Action::Advance { ms: a }), Action::Advance { ms: b }) => *a = a.saturating_add(*b),
            _ => self.log.push(action),
        }
    }

    /// Sends a request as typed by hand; returns the status and the whole reply body.
    pub fn request(&mut self, method: &str, path: &str, body: &str) -> (u16, String) {
        let action = Action::Request { method: method.into(), path: path.into(), body: body.into() };
        let answer = self.perform(&action).expect("a request always applies").expect("a request answers");
        self.record(action);
        answer
    }

    /// Switches to a workload (its generator starts afresh).
    pub fn set_workload(&mut self, spec: WorkloadSpec) -> Result<(), SimError> {
        self.act(Action::Workload { spec })
    }

    /// Runs `n` steps of the workload; returns the number of requests they sent.
    pub fn step(&mut self, n: u64) -> Result<u64, SimError> {
        let before = self.requests;
        self.act(Action::Step { n })?;
        Ok(self.requests - before)
    }

    /// Moves the clock by `ms`.
    pub fn advance(&mut self, ms: u64) {
        self.act(Action::Advance { ms }).expect("moving the clock always applies");
    }

    /// One serving step, as vLLM's connector does it: the scheduler asks which blocks exist,
    /// every rank loads the hit prefix (`get_locations`), and every writer allocates the misses on
    /// every rank and confirms what it got (unless it crashes first).
    fn step_once(&mut self) {
        let plan = self.workload.as_mut().expect("checked by the caller").next_plan();
        let step_ms = self.workload.as_ref().expect("checked by the caller").spec().step_ms;
        let quoted: Vec<String> = plan.keys.iter().map(|k| format!("\"{k}\"")).collect();
        let all = quoted.join(",");
        let (_, _, reply) = self.exchange("POST", "/keys/batch_exists", format!("{{\"keys\":[{all}]}}"));
        let hits = match reply {
            Some(Reply::Exists(flags)) => flags.iter().take_while(|&&f| f).count(),
            _ => 0,
        };
        if hits > 0 {
            let keys = quoted[..hits].join(",");
            for rank in 0..self.config.ranks {
                self.exchange("POST", "/keys/get_locations", format!("{{\"rank\":{rank},\"keys\":[{keys}]}}"));
            }
        }
        if hits < quoted.len() {
            let pairs: Vec<String> = quoted[hits..].iter().map(|k| format!("[{k},\"\"]")).collect();
            let pairs = pairs.join(",");
            let mut writes = Vec::new();
            for _ in 0..plan.writers {
                for rank in 0..self.config.ranks {
                    let body = format!("{{\"rank\":{rank},\"keys\":[{pairs}]}}");
                    if let (_, _, Some(Reply::Allocated(allocs))) = self.exchange("POST", "/keys/batch_allocate", body)
                    {
                        let confirmations: Vec<String> = allocs
                            .iter()
                            .filter_map(|a| a.page.map(|p| format!("[{},{p}]", quoted[hits + a.index as usize])))
                            .collect();
                        writes.push((rank, confirmations.join(",")));
                    }
                }
            }
            if !plan.crash {
                for (rank, confirmations) in writes {
                    let body =
                        format!("{{\"rank\":{rank},\"confirmations\":[{confirmations}],\"pages_to_release\":[]}}");
                    self.exchange("POST", "/keys/confirm_write", body);
                }
            }
        }
        self.now = self.now.saturating_add(step_ms);
    }

    /// Sends one request through the wire rules and the core; logs it as an event. Returns the
    /// status, the reply body, and the typed reply of lookups and allocations.
    fn exchange(&mut self, method: &str, path: &str, body: String) -> (u16, String, Option<Reply>) {
        let (status, bytes, reply) = match wire::parse(method, path, body.as_bytes()) {
            wire::Parsed::Answer(a) => (a.status, a.body, None),
            wire::Parsed::Apply(p) => {
                let result = self.core.apply(self.now, p.command());
                let reply = match &result {
                    Ok(r @ (Reply::Allocated(_) | Reply::Exists(_))) => Some(r.clone()),
                    _ => None,
                };
                let a = p.answer(result);
                (a.status, a.body, reply)
            }
        };
        let text = String::from_utf8(bytes).expect("replies are JSON text");
        match &reply {
            Some(Reply::Exists(flags)) => {
                self.wstats.lookups += flags.len() as u64;
                self.wstats.lookup_hits += flags.iter().filter(|&&f| f).count() as u64;
            }
            Some(Reply::Allocated(allocs)) => {
                self.wstats.alloc_failures += allocs.iter().filter(|a| a.page.is_none()).count() as u64;
            }
            _ => {}
        }
        self.requests += 1;
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(Event {
            seq: self.requests,
            t: self.now,
            method: method.to_owned(),
            path: path.to_owned(),
            body: cut(&body),
            status,
            reply: cut(&text),
        });
        (status, text, reply)
    }

    /// The config (defaults filled in).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Simulated time (ms).
    pub fn now(&self) -> u64 {
        self.now
    }

    /// The figures the page shows.
    pub fn stats(&self) -> SimStats {
        let stats = self.core.stats();
        let vllm = stats.spaces.iter().find(|s| s.space == Space::Vllm);
        let ranks = vllm
            .map(|s| {
                s.ranks.iter().map(|r| RankFigures { rank: r.rank, num_pages: r.num_pages, pages: r.pages }).collect()
            })
            .unwrap_or_default();
        let counters = vllm.map(|s| s.counters).unwrap_or_default();
        SimStats {
            now: self.now,
            requests: self.requests,
            keys: vllm.map_or(0, |s| s.keys),
            pending_keys: vllm.map_or(0, |s| s.pending_keys),
            ranks,
            counters: camel(serde_json::to_value(counters).expect("counters serialize")),
            workload: self.wstats,
        }
    }

    /// Page counts of `rank` in `cells` runs of pages ([`kvpages_core::PAGE_CLASSES`] per cell).
    pub fn page_map(&self, rank: u32, cells: u32) -> Result<Vec<u32>, SimError> {
        self.core.page_map(&Space::Vllm, rank, cells).ok_or_else(|| SimError(format!("rank {rank} does not exist")))
    }

    /// One page of `rank`.
    pub fn page_info(&self, rank: u32, page: u32) -> Result<PageInfo, SimError> {
        let view = self
            .core
            .page_view(&Space::Vllm, rank, page)
            .ok_or_else(|| SimError(format!("rank {rank} has no page {page}")))?;
        let left = |until: Option<u64>| until.map(|u| u.saturating_sub(self.now));
        Ok(match view {
            PageView::Free => PageInfo { page, state: "free", key: None, age_ms: None, expires_in_ms: None },
            PageView::Reserved { key, until } => PageInfo {
                page,
                state: "reserved",
                key: Some(key.to_string()),
                age_ms: None,
                expires_in_ms: left(until),
            },
            PageView::Committed { key, leased, since_s } => PageInfo {
                page,
                state: if leased { "leased" } else { "committed" },
                key: Some(key.to_string()),
                age_ms: Some(self.now.saturating_sub(u64::from(since_s) * 1000)),
                expires_in_ms: None,
            },
            PageView::Quarantined { until } => {
                PageInfo { page, state: "quarantined", key: None, age_ms: None, expires_in_ms: left(until) }
            }
        })
    }

    /// The last `n` events, oldest first.
    pub fn events(&self, n: usize) -> impl Iterator<Item = &Event> {
        self.events.iter().skip(self.events.len().saturating_sub(n))
    }

    /// The scenario: config and the user's actions.
    pub fn scenario(&self) -> Scenario {
        Scenario { format: SCENARIO_FORMAT.into(), config: self.config.clone(), log: self.log.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Kind;

    fn small() -> Config {
        Config { ranks: 2, pages_per_rank: 64, ..Config::default() }
    }

    #[test]
    fn a_fresh_cluster_has_its_ranks_and_answers_like_the_server() {
        let mut sim = Sim::new(small()).unwrap();
        let st = sim.stats();
        assert_eq!(st.requests, 2);
        assert_eq!(st.ranks.len(), 2);
        assert_eq!((st.ranks[1].rank, st.ranks[1].num_pages, st.ranks[1].pages.free), (1, 64, 64));
        let k = "0123456789abcdef0123456789abcdef";
        let (status, body) =
            sim.request("POST", "/keys/batch_allocate", &format!("{{\"rank\":1,\"keys\":[[\"{k}\",\"\"]]}}"));
        assert_eq!((status, body.as_str()), (200, format!("{{\"rank\":1,\"results\":[[\"{k}\",0]]}}").as_str()));
        let (status, body) = sim.request("POST", "/keys/batch_exists", "{\"keys\": 5}");
        assert_eq!(status, 400, "{body}");
        let e: Vec<&Event> = sim.events(2).collect();
        assert_eq!((e[0].seq, e[0].path.as_str(), e[0].status), (3, "/keys/batch_allocate", 200));
        assert_eq!((e[1].seq, e[1].status), (4, 400));
        assert_eq!(sim.stats().ranks[1].pages.reserved, 1);
        assert_eq!(sim.page_info(1, 0).unwrap().key.as_deref(), Some(k));
        assert_eq!(sim.page_info(1, 0).unwrap().expires_in_ms, Some(60_000));
    }

    #[test]
    fn bad_configs_are_named() {
        let bad = |c: Config| Sim::new(c).unwrap_err().0;
        assert_eq!(bad(Config { ranks: 0, ..small() }), "ranks must be in 1..=64, not 0");
        assert_eq!(bad(Config { pages_per_rank: 0, ..small() }), "pagesPerRank must be at least 1");
        let s = SimSettings { evict_low_permille: 990, ..SimSettings::default() };
        assert!(bad(Config { settings: s, ..small() }).starts_with("settings.evictLowPermille"));
    }

    fn run_every_kind(sim: &mut Sim) {
        for kind in
            [Kind::SharedPrefix, Kind::MultiTurn, Kind::UniqueBurst, Kind::CrashingWriters, Kind::DuplicateWriters]
        {
            sim.set_workload(WorkloadSpec { kind, blocks: 4, prompts: 50, ..WorkloadSpec::default() }).unwrap();
            sim.step(150).unwrap();
            sim.advance(30_000);
        }
        sim.request("POST", "/keys/delete", "{\"keys\": [\"00000000000000000000000000000000\"]}");
    }

    #[test]
    fn workloads_keep_the_invariants_and_a_scenario_replays_exactly() {
        let mut sim = Sim::new(small()).unwrap();
        run_every_kind(&mut sim);
        sim.core.check_invariants().unwrap();
        let st = sim.stats();
        // The pool filled up and LRU made room; crashed writers' reservations expired.
        assert!(st.counters["evictions"].as_u64().unwrap() > 0, "{st:?}");
        assert!(st.counters["expiredReservations"].as_u64().unwrap() > 0, "{st:?}");
        assert!(st.workload.lookup_hits > 0 && st.workload.lookups > st.workload.lookup_hits, "{st:?}");
        // The log is the user's actions, merged: 5 x (workload, step, advance) + the request.
        let scenario = sim.scenario();
        assert_eq!(scenario.log.len(), 16);
        let json = serde_json::to_string(&scenario).unwrap();
        let again = Sim::from_scenario(&serde_json::from_str(&json).unwrap()).unwrap();
        assert_eq!(again.stats(), st);
        assert_eq!(again.events(5).collect::<Vec<_>>(), sim.events(5).collect::<Vec<_>>());
        assert_eq!(again.page_map(0, 7).unwrap(), sim.page_map(0, 7).unwrap());
    }

    #[test]
    fn eviction_off_answers_minus_one_when_full() {
        let settings = SimSettings { eviction: EvictionName::Off, ..SimSettings::default() };
        let mut sim = Sim::new(Config { ranks: 1, pages_per_rank: 32, settings, ..small() }).unwrap();
        sim.set_workload(WorkloadSpec { kind: Kind::UniqueBurst, blocks: 8, ..WorkloadSpec::default() }).unwrap();
        assert_eq!(sim.step(5).unwrap(), 5 * 3);
        let st = sim.stats();
        assert_eq!((st.ranks[0].pages.committed, st.ranks[0].pages.free), (32, 0));
        assert_eq!(st.workload.alloc_failures, 8);
        assert_eq!(st.counters["evictions"], 0);
        // Page map of the full pool: 4 cells of 8 committed pages.
        assert_eq!(sim.page_map(0, 4).unwrap(), [0, 0, 8, 0, 0].repeat(4));
    }

    #[test]
    fn bad_scenarios_are_refused_with_the_place() {
        let mut s = Sim::new(small()).unwrap().scenario();
        s.log.push(Action::Step { n: 1 });
        assert_eq!(Sim::from_scenario(&s).unwrap_err().0, "scenario log[0]: no workload is set");
        s.format = "other".into();
        assert!(Sim::from_scenario(&s).unwrap_err().0.starts_with("scenario format is 'other'"));
    }
}
