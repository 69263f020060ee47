//! The workloads of the real clients, the state each needs on the server, and the loop one
//! connection runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvpages_host::client::{Client, Response};
use kvpages_rng::{Rng, mix};

/// Pages of the rank the allocating workloads use (a 1 GiB file of 1 KiB pages, the size the
/// issue asks for; real pools are 10^4..10^6 pages).
pub(super) const POOL_PAGES: u32 = 1_000_000;
/// Keys stored before the lookup workloads run; their lookups hit these half of the time.
pub(super) const STORED_KEYS: usize = 16_384;
/// Pages of the full pool the `pool-full` workload allocates from.
pub(super) const FULL_POOL_PAGES: u32 = 1_024;
/// Batch size of the set-up's allocate+confirm pairs (vLLM's largest save batch).
const SETUP_BATCH: usize = 128;

/// One workload: what a vLLM connector or scheduler sends, in a loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// A worker saving 32 new blocks: batch_allocate of 32 fresh keys, then confirm_write.
    AllocateConfirm32,
    /// A worker saving 128 new blocks (vLLM's largest save batch).
    AllocateConfirm128,
    /// The scheduler's lookup of a short prompt: batch_exists of 32 keys, half of them stored.
    Exists32,
    /// batch_exists of 256 keys (50 % hits).
    Exists256,
    /// batch_exists of 1,250 keys (a 20K-token prompt at block size 16; 50 % hits).
    Exists1250,
    /// A worker loading 32 blocks: get_locations of 32 stored keys.
    Locations32,
    /// The connector's save/load cycle for a 32-block prompt whose first 16 blocks are cached:
    /// batch_exists(32) → batch_allocate(16 new) → confirm_write(16) → get_locations(32).
    SaveLoadCycle,
    /// batch_allocate of 32 keys on a full 1,024-page pool: every page -1 (a server with
    /// eviction off, as vLLM's; the bench's own runs one for this workload).
    PoolFull,
}

impl std::str::FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Workload, String> {
        Workload::ALL.into_iter().find(|w| w.name() == s).ok_or_else(|| format!("no workload '{s}'"))
    }
}

const ALLOCATE: &str = "/keys/batch_allocate";
const CONFIRM: &str = "/keys/confirm_write";
const EXISTS: &str = "/keys/batch_exists";
const LOCATIONS: &str = "/keys/get_locations";

impl Workload {
    /// Every workload, in report order.
    pub const ALL: [Workload; 8] = [
        Workload::AllocateConfirm32,
        Workload::AllocateConfirm128,
        Workload::Exists32,
        Workload::Exists256,
        Workload::Exists1250,
        Workload::Locations32,
        Workload::SaveLoadCycle,
        Workload::PoolFull,
    ];

    /// The workload's name in `--workload` and in the results.
    pub fn name(self) -> &'static str {
        match self {
            Workload::AllocateConfirm32 => "allocate-confirm-32",
            Workload::AllocateConfirm128 => "allocate-confirm-128",
            Workload::Exists32 => "exists-32",
            Workload::Exists256 => "exists-256",
            Workload::Exists1250 => "exists-1250",
            Workload::Locations32 => "locations-32",
            Workload::SaveLoadCycle => "save-load-cycle",
            Workload::PoolFull => "pool-full",
        }
    }

    /// Keys one iteration handles (what keys/s counts).
    pub(super) fn batch(self) -> usize {
        match self {
            Workload::AllocateConfirm32 | Workload::Exists32 | Workload::Locations32 => 32,
            Workload::SaveLoadCycle | Workload::PoolFull => 32,
            Workload::AllocateConfirm128 => 128,
            Workload::Exists256 => 256,
            Workload::Exists1250 => 1_250,
        }
    }

    /// The requests of one iteration: route and the status a correct answer has.
    pub(super) fn steps(self) -> &'static [(&'static str, u16)] {
        match self {
            Workload::AllocateConfirm32 | Workload::AllocateConfirm128 => &[(ALLOCATE, 200), (CONFIRM, 204)],
            Workload::Exists32 | Workload::Exists256 | Workload::Exists1250 => &[(EXISTS, 200)],
            Workload::Locations32 => &[(LOCATIONS, 200)],
            Workload::SaveLoadCycle => &[(EXISTS, 200), (ALLOCATE, 200), (CONFIRM, 204), (LOCATIONS, 200)],
            Workload::PoolFull => &[(ALLOCATE, 200)],
        }
    }

    /// Fresh pages one iteration takes from the 1,000,000-page pool, for workloads that fill it.
    fn pages_per_iteration(self) -> Option<u64> {
        match self {
            Workload::AllocateConfirm32 => Some(32),
            Workload::AllocateConfirm128 => Some(128),
            Workload::SaveLoadCycle => Some(16),
            _ => None,
        }
    }
}

/// Where the requests of a measurement go.
#[derive(Clone, Debug)]
pub(super) enum Mode {
    /// The real routes.
    Real,
    /// The floor route, with the reply size each step should get (its real route's mean), and
    /// for workloads that confirm, a batch_allocate reply of their batch: the generator parses
    /// it in place of the floor's (meaningless) bytes, so that it spends on a floor iteration
    /// what it spends on a real one (on a shared machine, a cheaper client would lend the floor
    /// CPU).
    Floor { replies: Vec<String>, allocate_reply: Option<Vec<u8>> },
}

impl Mode {
    /// The floor of `workload`, its steps answered with these paths.
    pub(super) fn floor(workload: Workload, replies: Vec<String>) -> Mode {
        Mode::Floor { replies, allocate_reply: workload.pages_per_iteration().map(|n| allocate_reply(n as usize)) }
    }
}

/// A batch_allocate reply as kvpages writes it, for `n` fresh keys (pages of 6 digits, as on a
/// 1,000,000-page rank).
fn allocate_reply(n: usize) -> Vec<u8> {
    use std::fmt::Write;
    let mut keys = Vec::with_capacity(n);
    KeyGen::new(0x66_6c6f_6f72).fresh(n, &mut keys);
    let mut s = String::from("{\"rank\":0,\"results\":[");
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "[\"{k}\",{}]", 500_000 + i);
    }
    s.push_str("]}");
    s.into_bytes()
}

/// Unique 32-hex keys: [`mix`] is a bijection, so distinct counters give distinct keys.
#[derive(Debug)]
pub(super) struct KeyGen {
    seed: u64,
    next: AtomicU64,
}

impl KeyGen {
    pub(super) fn new(seed: u64) -> KeyGen {
        KeyGen { seed, next: AtomicU64::new(0) }
    }

    /// Appends `n` keys never handed out before.
    pub(super) fn fresh(&self, n: usize, out: &mut Vec<String>) {
        let start = self.next.fetch_add(n as u64, Ordering::Relaxed);
        for i in start..start + n as u64 {
            let a = mix(self.seed.wrapping_add((i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
            let b = mix(a ^ self.seed);
            out.push(format!("{a:016x}{b:016x}"));
        }
    }
}

// Request bodies, written by hand: the generator must spend its (shared) CPU on the socket.

fn push_keys(s: &mut String, keys: &[String], pairs: bool) {
    s.push('[');
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(if pairs { "[\"" } else { "\"" });
        s.push_str(k);
        s.push_str(if pairs { "\",\"\"]" } else { "\"" });
    }
    s.push(']');
}

pub(super) fn allocate_body(keys: &[String]) -> String {
    let mut s = String::with_capacity(24 + keys.len() * 40);
    s.push_str("{\"rank\":0,\"keys\":");
    push_keys(&mut s, keys, true);
    s.push('}');
    s
}

pub(super) fn confirm_body<'a>(pairs: impl Iterator<Item = (&'a str, i64)>) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(64 + 128 * 44);
    s.push_str("{\"rank\":0,\"confirmations\":[");
    for (i, (k, page)) in pairs.enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "[\"{k}\",{page}]");
    }
    s.push_str("],\"pages_to_release\":[]}");
    s
}

fn exists_body(keys: &[String]) -> String {
    let mut s = String::with_capacity(16 + keys.len() * 35);
    s.push_str("{\"keys\":");
    push_keys(&mut s, keys, false);
    s.push('}');
    s
}

fn locations_body(keys: &[String]) -> String {
    let mut s = String::with_capacity(24 + keys.len() * 35);
    s.push_str("{\"rank\":0,\"keys\":");
    push_keys(&mut s, keys, false);
    s.push('}');
    s
}

#[derive(serde::Deserialize)]
struct AllocateReply<'a> {
    #[serde(borrow)]
    results: Vec<(&'a str, i64)>,
}

fn parse_allocate(body: &[u8]) -> Result<Vec<(&str, i64)>, String> {
    serde_json::from_slice::<AllocateReply<'_>>(body)
        .map(|r| r.results)
        .map_err(|e| format!("batch_allocate reply is not {{\"results\": [[key, page], ...]}}: {e}"))
}

fn expect(resp: Response, what: &str, status: u16) -> Result<Response, String> {
    if resp.status == status {
        Ok(resp)
    } else {
        Err(format!("{what}: expected {status}, got {} {}", resp.status, String::from_utf8_lossy(&resp.body)))
    }
}

async fn post(c: &mut Client, path: &str, body: String, status: u16) -> Result<Response, String> {
    let resp = c.post(path, body).await.map_err(|e| format!("POST {path}: {e}"))?;
    expect(resp, path, status)
}

/// Drops every rank and key, then creates rank 0 with `pages` pages.
async fn reset(c: &mut Client, pages: u32) -> Result<(), String> {
    post(c, "/clear", String::new(), 204).await?;
    post(c, "/rank/0/initialize", format!("{{\"num_pages\":{pages},\"role\":\"worker\"}}"), 200).await?;
    Ok(())
}

/// Allocates and confirms `keys` on rank 0 (set-up only).
async fn store(c: &mut Client, keys: &[String]) -> Result<(), String> {
    for batch in keys.chunks(SETUP_BATCH) {
        let resp = post(c, ALLOCATE, allocate_body(batch), 200).await?;
        let pages = parse_allocate(&resp.body)?;
        if pages.iter().any(|&(_, p)| p < 0) {
            return Err("set-up: the pool ran out of pages while storing keys".into());
        }
        post(c, CONFIRM, confirm_body(pages.into_iter()), 204).await?;
    }
    Ok(())
}

/// Rounds of the allocating workloads: the pool is never exhausted because a round ends before
/// it would be (rather than a `/keys/delete` per iteration, which would add a request to what
/// is measured). The connection that finds the round's pages
/// used up waits for the others' iterations to finish, clears the server and re-initializes
/// rank 0; that pause is left out of the measured time.
#[derive(Debug)]
pub(super) struct Rounds {
    /// Round number; iterations hold it shared, a reset exclusively.
    lock: tokio::sync::RwLock<u64>,
    /// Pages taken in this round.
    used: AtomicU64,
    /// Nanoseconds spent in resets after the measurement began (of the current measurement).
    paused_ns: AtomicU64,
    /// Server CPU nanoseconds those resets took (nothing else runs during one).
    paused_cpu_ns: AtomicU64,
    /// Resets so far (over the fixture's life).
    pub(super) resets: AtomicU64,
}

/// The server state a workload needs, set up once per workload and target.
#[derive(Debug)]
pub(super) struct Fixture {
    pub(super) workload: Workload,
    /// Stored keys the lookups hit.
    stored: Vec<String>,
    pub(super) rounds: Option<Rounds>,
    pub(super) keys: Arc<KeyGen>,
}

impl Fixture {
    /// Clears the server and builds the workload's state on it, then checks one iteration's
    /// answer is what the workload claims (hits, -1s).
    pub(super) async fn set_up(c: &mut Client, workload: Workload, keys: Arc<KeyGen>) -> Result<Fixture, String> {
        let mut stored = Vec::new();
        match workload {
            Workload::PoolFull => {
                reset(c, FULL_POOL_PAGES).await?;
                keys.fresh(FULL_POOL_PAGES as usize, &mut stored);
                store(c, &stored).await?;
                let mut probe = Vec::new();
                keys.fresh(workload.batch(), &mut probe);
                let resp = post(c, ALLOCATE, allocate_body(&probe), 200).await?;
                let pages = parse_allocate(&resp.body)?;
                if pages.len() != probe.len() || pages.iter().any(|&(_, p)| p != -1) {
                    return Err(format!(
                        "pool-full: expected every page -1, got {}",
                        String::from_utf8_lossy(&resp.body)
                    ));
                }
            }
            Workload::Exists32 | Workload::Exists256 | Workload::Exists1250 | Workload::Locations32 => {
                reset(c, POOL_PAGES).await?;
                keys.fresh(STORED_KEYS, &mut stored);
                store(c, &stored).await?;
            }
            _ => reset(c, POOL_PAGES).await?,
        }
        let rounds = workload.pages_per_iteration().map(|_| Rounds {
            lock: tokio::sync::RwLock::new(0),
            used: AtomicU64::new(0),
            paused_ns: AtomicU64::new(0),
            paused_cpu_ns: AtomicU64::new(0),
            resets: AtomicU64::new(0),
        });
        let fixture = Fixture { workload, stored, rounds, keys };
        if matches!(workload, Workload::Exists32 | Workload::Exists256 | Workload::Exists1250) {
            let mut rng = Rng::new(1);
            let body = exists_body(&fixture.lookup_keys(&mut rng));
            let resp = post(c, EXISTS, body, 200).await?;
            let hits = resp.body.windows(4).filter(|w| w == b"true").count();
            if hits != workload.batch() / 2 {
                return Err(format!("{}: expected {} hits, got {hits}", workload.name(), workload.batch() / 2));
            }
        }
        if workload == Workload::Locations32 {
            let keys: Vec<String> = fixture.stored[..32].to_vec();
            let resp = post(c, LOCATIONS, locations_body(&keys), 200).await?;
            if resp.body.windows(4).any(|w| w == b"null") {
                return Err("locations-32: a stored key has no location".into());
            }
        }
        Ok(fixture)
    }

    /// Keys of one lookup: alternately a stored key (a hit) and one never stored (a miss).
    fn lookup_keys(&self, rng: &mut Rng) -> Vec<String> {
        let n = self.workload.batch();
        let mut misses = Vec::with_capacity(n / 2 + 1);
        self.keys.fresh(n - n / 2, &mut misses);
        let mut misses = misses.into_iter();
        (0..n)
            .map(
                |i| {
                    if i % 2 == 1 { self.stored[rng.index(self.stored.len())].clone() } else { misses.next().unwrap() }
                },
            )
            .collect()
    }

    /// Sets the paused time of a new measurement to zero.
    pub(super) fn start_measurement(&self) {
        if let Some(r) = &self.rounds {
            r.paused_ns.store(0, Ordering::Relaxed);
            r.paused_cpu_ns.store(0, Ordering::Relaxed);
        }
    }

    /// The in-process servers' CPU time spent in this measurement's resets.
    pub(super) fn paused_cpu(&self) -> Duration {
        self.rounds.as_ref().map_or(Duration::ZERO, |r| Duration::from_nanos(r.paused_cpu_ns.load(Ordering::Relaxed)))
    }

    pub(super) fn paused(&self) -> Duration {
        self.rounds.as_ref().map_or(Duration::ZERO, |r| Duration::from_nanos(r.paused_ns.load(Ordering::Relaxed)))
    }
}

/// The bounds and shared counters of one measurement.
#[derive(Debug)]
pub(super) struct Run {
    /// Requests that start before this are warm-up and not recorded.
    pub(super) measure_from: Instant,
    /// No iteration starts after this.
    pub(super) deadline: Instant,
    /// No iteration starts once this many requests were started (after warm-up).
    pub(super) max_requests: u64,
    pub(super) started: AtomicU64,
    /// Recorded requests, for the progress line.
    pub(super) done: AtomicU64,
    pub(super) errors: AtomicU64,
}

/// What one connection measured.
#[derive(Debug, Default)]
pub(super) struct Tally {
    /// Latency samples in nanoseconds, per step.
    pub(super) samples: Vec<Vec<u64>>,
    /// Body and reply bytes, per step.
    pub(super) body_bytes: Vec<u64>,
    pub(super) reply_bytes: Vec<u64>,
    pub(super) iterations: u64,
    pub(super) errors: u64,
    pub(super) first_error: Option<String>,
    /// When the last recorded request finished.
    pub(super) last_done: Option<Instant>,
}

/// One connection's loop.
pub(super) struct Worker {
    client: Client,
    mode: Mode,
    fixture: Arc<Fixture>,
    run: Arc<Run>,
    rng: Rng,
    /// The cycle's previous fresh keys: cached blocks of the next prompt.
    prev: Vec<String>,
    tally: Tally,
}

impl Worker {
    pub(super) fn new(client: Client, mode: Mode, fixture: Arc<Fixture>, run: Arc<Run>, id: u64) -> Worker {
        let steps = fixture.workload.steps().len();
        let tally = Tally {
            samples: vec![Vec::new(); steps],
            body_bytes: vec![0; steps],
            reply_bytes: vec![0; steps],
            ..Tally::default()
        };
        Worker { client, mode, fixture, run, rng: Rng::new(id), prev: Vec::new(), tally }
    }

    /// Runs iterations until the deadline or the request bound.
    pub(super) async fn run(mut self) -> Tally {
        let steps = self.fixture.workload.steps().len() as u64;
        while Instant::now() < self.run.deadline {
            if Instant::now() >= self.run.measure_from
                && self.run.started.fetch_add(steps, Ordering::Relaxed) >= self.run.max_requests
            {
                break;
            }
            if let Err(e) = self.iteration().await {
                self.error(e).await;
            }
        }
        self.tally
    }

    async fn error(&mut self, e: String) {
        self.tally.errors += 1;
        self.run.errors.fetch_add(1, Ordering::Relaxed);
        self.tally.first_error.get_or_insert(e);
        // A failed connection cannot be used again; a failed answer leaves it usable, but a
        // fresh one is harmless either way. Back off a little so a dead server is not spun on.
        tokio::time::sleep(Duration::from_millis(10)).await;
        if let Ok(c) = Client::connect(self.client.addr()).await {
            self.client = c;
        }
    }

    /// One request: to its real route or to the floor, timed and checked.
    async fn call(&mut self, step: usize, body: String) -> Result<Response, String> {
        let (route, status) = self.fixture.workload.steps()[step];
        let (path, status) = match &self.mode {
            Mode::Real => (route, status),
            Mode::Floor { replies, .. } => {
                (replies[step].as_str(), if replies[step].ends_with("=0") { 204 } else { 200 })
            }
        };
        let len = body.len() as u64;
        let start = Instant::now();
        let resp = self.client.post(path, body).await.map_err(|e| format!("POST {path}: {e}"))?;
        let end = Instant::now();
        if start >= self.run.measure_from {
            let t = &mut self.tally;
            t.samples[step].push((end - start).as_nanos() as u64);
            t.body_bytes[step] += len;
            t.reply_bytes[step] += resp.body.len() as u64;
            t.last_done = Some(end);
            self.run.done.fetch_add(1, Ordering::Relaxed);
        }
        expect(resp, path, status)
    }

    fn floor(&self) -> bool {
        matches!(self.mode, Mode::Floor { .. })
    }

    /// `(key, page)` pairs to confirm: the allocation's (on the floor: those of a real reply of
    /// the same size, parsed the same way).
    fn confirmations(&self, keys: &[String], reply: &Response) -> Result<String, String> {
        let reply = match &self.mode {
            Mode::Floor { allocate_reply: Some(r), .. } => r,
            _ => &reply.body[..],
        };
        let pages = parse_allocate(reply)?;
        if pages.len() != keys.len() || pages.iter().any(|&(_, p)| p < 0) {
            return Err(format!("batch_allocate: expected {} fresh pages, got {}", keys.len(), pages.len()));
        }
        Ok(confirm_body(pages.into_iter()))
    }

    async fn iteration(&mut self) -> Result<(), String> {
        let fixture = self.fixture.clone();
        let workload = fixture.workload;
        // Allocating workloads hold the round for the whole iteration (its confirm included).
        let _round = match (&fixture.rounds, workload.pages_per_iteration(), self.floor()) {
            (Some(rounds), Some(pages), false) => Some(self.enter_round(rounds, pages).await?),
            _ => None,
        };
        match workload {
            Workload::AllocateConfirm32 | Workload::AllocateConfirm128 => {
                let mut keys = Vec::with_capacity(workload.batch());
                fixture.keys.fresh(workload.batch(), &mut keys);
                let reply = self.call(0, allocate_body(&keys)).await?;
                let body = self.confirmations(&keys, &reply)?;
                self.call(1, body).await?;
            }
            Workload::Exists32 | Workload::Exists256 | Workload::Exists1250 => {
                let keys = fixture.lookup_keys(&mut self.rng);
                self.call(0, exists_body(&keys)).await?;
            }
            Workload::Locations32 => {
                let keys: Vec<String> =
                    (0..32).map(|_| fixture.stored[self.rng.index(fixture.stored.len())].clone()).collect();
                self.call(0, locations_body(&keys)).await?;
            }
            Workload::SaveLoadCycle => {
                // The prompt: the previous prompt's 16 new blocks (cached now), then 16 new ones.
                let mut prompt = std::mem::take(&mut self.prev);
                if prompt.len() != 16 {
                    prompt.clear();
                    fixture.keys.fresh(16, &mut prompt);
                }
                fixture.keys.fresh(16, &mut prompt);
                self.call(0, exists_body(&prompt)).await?;
                let new = &prompt[16..];
                let reply = self.call(1, allocate_body(new)).await?;
                let body = self.confirmations(new, &reply)?;
                self.call(2, body).await?;
                self.call(3, locations_body(&prompt)).await?;
                self.prev = prompt.split_off(16);
            }
            Workload::PoolFull => {
                let mut keys = Vec::with_capacity(32);
                fixture.keys.fresh(32, &mut keys);
                self.call(0, allocate_body(&keys)).await?;
            }
        }
        self.tally.iterations += 1;
        Ok(())
    }

    /// Takes `pages` of the round's budget, first ending the round (clear + initialize) if it
    /// is used up.
    async fn enter_round<'r>(
        &mut self,
        rounds: &'r Rounds,
        pages: u64,
    ) -> Result<tokio::sync::RwLockReadGuard<'r, u64>, String> {
        loop {
            let guard = rounds.lock.read().await;
            if rounds.used.fetch_add(pages, Ordering::SeqCst) + pages <= u64::from(POOL_PAGES) {
                return Ok(guard);
            }
            let round = *guard;
            drop(guard);
            let mut w = rounds.lock.write().await;
            if *w == round {
                let start = Instant::now();
                let cpu_before = super::server_cpu();
                reset(&mut self.client, POOL_PAGES).await?;
                if let (Some(a), Some(b)) = (cpu_before, super::server_cpu())
                    && start >= self.run.measure_from
                {
                    rounds.paused_cpu_ns.fetch_add(b.saturating_sub(a).as_nanos() as u64, Ordering::Relaxed);
                }
                rounds.used.store(0, Ordering::SeqCst);
                *w += 1;
                rounds.resets.fetch_add(1, Ordering::Relaxed);
                if start >= self.run.measure_from {
                    rounds.paused_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
                }
                // The cycle's cached keys are gone with the round.
                self.prev.clear();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_unique_lowercase_32_hex() {
        let g = KeyGen::new(42);
        let mut keys = Vec::new();
        g.fresh(10_000, &mut keys);
        g.fresh(10_000, &mut keys);
        assert!(
            keys.iter().all(|k| k.len() == 32 && k.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        );
        let set: std::collections::HashSet<&String> = keys.iter().collect();
        assert_eq!(set.len(), keys.len());
    }

    #[test]
    fn bodies_are_the_wire_format() {
        let keys = vec!["a".to_string(), "b".to_string()];
        assert_eq!(allocate_body(&keys), r#"{"rank":0,"keys":[["a",""],["b",""]]}"#);
        assert_eq!(exists_body(&keys), r#"{"keys":["a","b"]}"#);
        assert_eq!(locations_body(&keys), r#"{"rank":0,"keys":["a","b"]}"#);
        assert_eq!(
            confirm_body([("a", 1), ("b", 20)].into_iter()),
            r#"{"rank":0,"confirmations":[["a",1],["b",20]],"pages_to_release":[]}"#
        );
        let parsed = parse_allocate(br#"{"rank":0,"results":[["a",1],["b",-1]]}"#).unwrap();
        assert_eq!(parsed, vec![("a", 1), ("b", -1)]);
        // The floor's stand-in reply parses like a real one: n pairs of a 32-hex key and a page.
        let floor = allocate_reply(3);
        let pairs = parse_allocate(&floor).unwrap();
        assert_eq!(
            pairs.iter().map(|&(k, p)| (k.len(), p)).collect::<Vec<_>>(),
            [(32, 500_000), (32, 500_001), (32, 500_002)]
        );
    }
}
