//! kvpages-plugin: `kvpages-core` as a WebAssembly component exporting `kvpages:engine/engine`
//! (`wit/kvpages.wit`), for kvpages' own wasmtime engine and any other component-model host.
//!
//! # Layout
//! - this file: the component's global state (one [`Core`]) and the `Guest` implementation, one
//!   function per command, each a conversion WIT → [`Command`] → [`Core::apply`] → WIT.
//! - [`convert`]: the type conversions, both ways (the packed key batches and allocations, and
//!   the direct entry point's frames, are `kvpages_abi`'s: one copy, which the host shares).
//! - `direct` (wasm32 and the unit tests): the direct entry point's exports.
//! - `chaos` (feature `chaos`, tests only): misbehaviour on magic keys.
//!
//! The guest is thin on purpose: no rule of the cache lives here, so the plugin cannot drift from
//! the native engine (a differential test in the host checks that command by command).
//!
//! `no_std` + alloc: on wasm32 the crate brings its own allocator (dlmalloc) and panic handler
//! (a panic aborts, which the host sees as a trap). On other targets std is linked only to
//! provide those two, so the workspace still builds and unit-tests natively; the code itself
//! never uses std.
#![no_std]
#![warn(missing_docs, unreachable_pub, missing_debug_implementations)]

extern crate alloc;
#[cfg(not(target_arch = "wasm32"))]
extern crate std;

pub mod cache;
#[cfg(feature = "chaos")]
mod chaos;
pub mod convert;
#[cfg(any(target_arch = "wasm32", test))]
mod direct;

use alloc::string::String;
use alloc::vec::Vec;
use core::cell::RefCell;

use kvpages_core::{Command, Core, Reply};

use crate::bindings::exports::kvpages::engine::engine as wit;

#[allow(missing_docs, unreachable_pub, missing_debug_implementations, clippy::all)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../../wit",
        world: "plugin",
        // PartialEq for the unit tests' assertions.
        additional_derives: [PartialEq],
    });
}

#[cfg(target_arch = "wasm32")]
#[global_allocator]
static ALLOC: cache::Cached<dlmalloc::GlobalDlmalloc> = cache::Cached::new(dlmalloc::GlobalDlmalloc);

#[cfg(target_arch = "wasm32")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    // The host sees `unreachable` as a trap and rebuilds the engine; the state before the
    // failing call is restored there, so nothing is lost by not unwinding.
    core::arch::wasm32::unreachable()
}

/// The component's one engine. A component instance runs on one thread and wasm has no
/// re-entrancy without imports, so a `RefCell` in a `static` is sound here.
struct State(RefCell<Option<Core>>);

// SAFETY: wasm32 components are single-threaded (no threads proposal is enabled and the crate
// imports nothing that could spawn one); on native targets the static is only touched by the
// unit tests, which run the guest functions on one thread at a time through `TEST_LOCK`.
unsafe impl Sync for State {}

static STATE: State = State(RefCell::new(None));

/// Serialises native unit tests that drive the global state.
#[cfg(not(target_arch = "wasm32"))]
pub static TEST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// No engine yet: neither `create` nor `restore` was called.
#[derive(Debug)]
pub(crate) struct NotCreated;

/// Applies `cmd` to the engine: the core's answer.
fn apply_core(now: u64, cmd: &Command) -> Result<Result<Reply, kvpages_core::Error>, NotCreated> {
    let mut state = STATE.0.borrow_mut();
    let core = state.as_mut().ok_or(NotCreated)?;
    Ok(core.apply(now, cmd))
}

fn apply(now: u64, cmd: &Command) -> Result<Reply, wit::Error> {
    match apply_core(now, cmd) {
        Ok(reply) => reply.map_err(|e| convert::error(&e)),
        Err(NotCreated) => Err(wit::Error::NotCreated),
    }
}

/// [`apply_core`] for a command built from a decoded batch, which is then freed by
/// [`kvpages_abi::keys::discard`] (`raw` from [`kvpages_abi::keys::unpack_batch`]): both ways in
/// (the WIT interface and `direct`) apply their batches here.
pub(crate) fn run(now: u64, cmd: Command, raw: bool) -> Result<Result<Reply, kvpages_core::Error>, NotCreated> {
    let reply = apply_core(now, &cmd);
    match cmd {
        Command::Allocate { keys, .. }
        | Command::Exists { keys, .. }
        | Command::Locations { keys, .. }
        | Command::Delete { keys, .. } => kvpages_abi::keys::discard(keys, raw),
        Command::Confirm { confirmations, .. } => kvpages_abi::keys::discard(confirmations, raw),
        _ => {}
    }
    reply
}

/// [`run`] with the WIT interface's errors.
fn apply_batch(now: u64, cmd: Command, raw: bool) -> Result<Reply, wit::Error> {
    match run(now, cmd, raw) {
        Ok(reply) => reply.map_err(|e| convert::error(&e)),
        Err(NotCreated) => Err(wit::Error::NotCreated),
    }
}

/// Creates the engine (both ways in).
pub(crate) fn create(seed: u64, settings: kvpages_core::Settings) {
    *STATE.0.borrow_mut() = Some(Core::new(seed, settings));
}

/// The engine's snapshot (both ways in).
pub(crate) fn snapshot() -> Result<Vec<u8>, NotCreated> {
    Ok(STATE.0.borrow().as_ref().ok_or(NotCreated)?.snapshot())
}

/// Replaces the engine with a snapshot's state (both ways in); why not, if it does not restore.
pub(crate) fn restore(snapshot: &[u8]) -> Result<(), String> {
    let core = Core::restore(snapshot).map_err(|e| alloc::format!("{e}"))?;
    *STATE.0.borrow_mut() = Some(core);
    Ok(())
}

/// The reply a command must give, or a fault: a reply of another kind would be a bug in the
/// core, and aborting turns it into a trap the host recovers from.
macro_rules! expect {
    ($reply:expr, $pat:pat => $out:expr) => {
        match $reply {
            $pat => $out,
            other => panic!("unexpected reply {other:?}"),
        }
    };
}

/// The exported functions.
#[derive(Debug)]
pub struct Plugin;

impl wit::Guest for Plugin {
    fn create(seed: u64, settings: wit::Settings) {
        create(seed, convert::settings(settings));
    }

    fn configure(now: u64, settings: wit::Settings) -> Result<(), wit::Error> {
        let reply = apply(now, &Command::Configure(convert::settings(settings)))?;
        expect!(reply, Reply::Configured => Ok(()))
    }

    fn initialize(now: u64, space: wit::Space, rank: u32, num_pages: u32) -> Result<wit::InitOutcome, wit::Error> {
        let reply = apply(now, &Command::Initialize { space: convert::space(space), rank, num_pages })?;
        expect!(reply, Reply::Initialized { outcome, .. } => Ok(convert::init_outcome(outcome)))
    }

    fn allocate(now: u64, space: wit::Space, rank: u32, keys: Vec<u8>) -> Result<Vec<u32>, wit::Error> {
        let (keys, raw) = convert::batch(&keys)?;
        #[cfg(feature = "chaos")]
        let after = chaos::before(&keys);
        let reply = apply_batch(now, Command::Allocate { space: convert::space(space), rank, keys }, raw);
        #[cfg(feature = "chaos")]
        chaos::after(after);
        expect!(reply?, Reply::Allocated(a) => Ok(kvpages_abi::allocations::pack_allocations(&a)))
    }

    fn confirm(
        now: u64,
        space: wit::Space,
        rank: u32,
        keys: Vec<u8>,
        pages: Vec<u32>,
        releases: Vec<u32>,
    ) -> Result<wit::ConfirmReport, wit::Error> {
        let (confirmations, raw) = convert::confirmations(&keys, &pages)?;
        let cmd = Command::Confirm { space: convert::space(space), rank, confirmations, releases };
        expect!(apply_batch(now, cmd, raw)?, Reply::Confirmed(r) => Ok(convert::confirm_report(r)))
    }

    fn exists(now: u64, space: wit::Space, keys: Vec<u8>) -> Result<Vec<bool>, wit::Error> {
        let (keys, raw) = convert::batch(&keys)?;
        expect!(apply_batch(now, Command::Exists { space: convert::space(space), keys }, raw)?, Reply::Exists(e) => Ok(e))
    }

    fn locations(now: u64, space: wit::Space, rank: u32, keys: Vec<u8>) -> Result<Vec<Option<u32>>, wit::Error> {
        let (keys, raw) = convert::batch(&keys)?;
        let cmd = Command::Locations { space: convert::space(space), rank, keys };
        expect!(apply_batch(now, cmd, raw)?, Reply::Locations(l) => Ok(l))
    }

    fn delete(now: u64, space: wit::Space, keys: Vec<u8>) -> Result<u32, wit::Error> {
        let (keys, raw) = convert::batch(&keys)?;
        let reply = apply_batch(now, Command::Delete { space: convert::space(space), keys }, raw)?;
        expect!(reply, Reply::Deleted(n) => Ok(n))
    }

    fn inspect(now: u64, space: wit::Space, key: String) -> Result<Option<wit::KeyInfo>, wit::Error> {
        let key = convert::key(&key)?;
        let reply = apply(now, &Command::Inspect { space: convert::space(space), key })?;
        expect!(reply, Reply::Key(k) => Ok(k.map(|k| convert::key_info(&k))))
    }

    fn clear(now: u64, space: wit::Space) -> Result<wit::Cleared, wit::Error> {
        let reply = apply(now, &Command::Clear { space: convert::space(space) })?;
        expect!(reply, Reply::Cleared { ranks, keys } => Ok(wit::Cleared { ranks, keys }))
    }

    fn reset(now: u64, space: wit::Space) -> Result<wit::Cleared, wit::Error> {
        let reply = apply(now, &Command::Reset { space: convert::space(space) })?;
        expect!(reply, Reply::Cleared { ranks, keys } => Ok(wit::Cleared { ranks, keys }))
    }

    fn stats(now: u64) -> Result<wit::EngineStats, wit::Error> {
        let reply = apply(now, &Command::Stats)?;
        expect!(reply, Reply::Stats(s) => Ok(convert::stats(&s)))
    }

    fn import_sglang(now: u64, pools: Vec<wit::SglangPool>, replace: bool) -> Result<wit::Imported, wit::Error> {
        let pools =
            pools.into_iter().enumerate().map(|(i, p)| convert::sglang_pool(p, i)).collect::<Result<Vec<_>, _>>()?;
        let reply = apply(now, &Command::ImportSglang { pools, replace })?;
        expect!(reply, Reply::Imported { pools, keys, leaked_pages } => Ok(wit::Imported { pools, keys, leaked_pages }))
    }

    fn export_sglang(now: u64) -> Result<Vec<wit::SglangPool>, wit::Error> {
        let reply = apply(now, &Command::ExportSglang)?;
        expect!(reply, Reply::SglangPools(p) => Ok(p.iter().map(convert::sglang_pool_out).collect()))
    }

    fn lease_all(now: u64) -> Result<u64, wit::Error> {
        let reply = apply(now, &Command::LeaseAll)?;
        expect!(reply, Reply::Leased(n) => Ok(n))
    }

    fn snapshot() -> Result<Vec<u8>, wit::Error> {
        snapshot().map_err(|NotCreated| wit::Error::NotCreated)
    }

    fn restore(snapshot: Vec<u8>) -> Result<(), wit::Error> {
        restore(&snapshot).map_err(wit::Error::SnapshotInvalid)
    }
}

// Only wasm32 exports the functions: native linkers refuse the component-model export names
// (`kvpages:engine/engine@0.2.0#allocate`), and native code (the unit tests) calls `Plugin`.
#[cfg(target_arch = "wasm32")]
bindings::export!(Plugin with_types_in bindings);

#[cfg(test)]
mod tests {
    use super::*;
    use wit::Guest;

    fn packed(keys: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for k in keys {
            kvpages_abi::keys::pack_key(&mut out, k);
        }
        out
    }

    /// The guest created afresh with `settings` and rank 0 of vLLM's space initialized with
    /// `pages` pages; the guard serializes the tests (the guest's state is global).
    fn created(settings: kvpages_core::Settings, pages: u32) -> std::sync::MutexGuard<'static, ()> {
        let serial = TEST_LOCK.lock().unwrap();
        Plugin::create(7, convert::settings_out(settings));
        Plugin::initialize(1, wit::Space::Vllm, 0, pages).unwrap();
        serial
    }

    fn sp() -> wit::Space {
        wit::Space::Vllm
    }

    #[test]
    fn a_cycle_through_the_guest_functions() {
        let _serial = TEST_LOCK.lock().unwrap();
        *STATE.0.borrow_mut() = None;
        assert_eq!(Plugin::stats(0).unwrap_err(), wit::Error::NotCreated);
        Plugin::create(7, convert::settings_out(kvpages_core::Settings::default()));
        let sp = || wit::Space::Vllm;
        assert!(matches!(Plugin::initialize(1, sp(), 0, 8), Ok(wit::InitOutcome::Created(false))));
        let keys = packed(&["386b2d9cf5aa91ba3a4b42c35396c822", "k2", "k2"]);
        // Two distinct keys: (index, page) each, packed.
        assert_eq!(Plugin::allocate(2, sp(), 0, keys.clone()).unwrap(), alloc::vec![0, 0, 1, 1]);
        let two = packed(&["386b2d9cf5aa91ba3a4b42c35396c822", "k2"]);
        let r = Plugin::confirm(3, sp(), 0, two.clone(), alloc::vec![0, 1], alloc::vec![]).unwrap();
        assert_eq!(r.committed, 2);
        assert_eq!(Plugin::exists(4, sp(), keys).unwrap(), alloc::vec![true, true, true]);
        assert_eq!(Plugin::locations(5, sp(), 0, two.clone()).unwrap(), alloc::vec![Some(0), Some(1)]);
        let info = Plugin::inspect(6, sp(), "k2".into()).unwrap().unwrap();
        assert_eq!((info.key.as_str(), info.pages.len()), ("k2", 1));
        let snap = Plugin::snapshot().unwrap();
        assert_eq!(Plugin::delete(7, sp(), two.clone()).unwrap(), 2);
        Plugin::restore(snap).unwrap();
        assert_eq!(Plugin::locations(8, sp(), 0, two).unwrap(), alloc::vec![Some(0), Some(1)]);
        assert!(matches!(Plugin::restore(alloc::vec![1, 2, 3]), Err(wit::Error::SnapshotInvalid(_))));
        assert_eq!(Plugin::clear(9, sp()).unwrap(), wit::Cleared { ranks: 1, keys: 2 });
        assert_eq!(Plugin::allocate(10, sp(), 0, packed(&["x"])).unwrap_err(), wit::Error::RankNotInitialized(0));
    }

    #[test]
    fn allocations_are_packed_with_the_hit_flag_and_the_no_page_word() {
        let off = kvpages_core::Settings { eviction: kvpages_core::Eviction::Off, ..Default::default() };
        let _serial = created(off, 4);
        assert_eq!(Plugin::allocate(2, sp(), 0, packed(&["a"])).unwrap(), alloc::vec![0, 0]);
        Plugin::confirm(3, sp(), 0, packed(&["a"]), alloc::vec![0], alloc::vec![]).unwrap();
        // "a" is a hit at index 1 (bit 31), "b" at index 2 takes page 1 (0 went back: vLLM's rotation).
        assert_eq!(Plugin::allocate(4, sp(), 0, packed(&["b", "a", "b"])).unwrap(), alloc::vec![0, 1, 1 | 1 << 31, 0]);
        // Three fresh keys, two free pages, eviction off: no page for any (the wire's -1).
        let full = Plugin::allocate(5, sp(), 0, packed(&["c", "d", "e"])).unwrap();
        assert_eq!(full, alloc::vec![0, u32::MAX, 1, u32::MAX, 2, u32::MAX]);
    }

    #[test]
    fn raw_hex_keys_are_the_same_keys_as_their_text() {
        let _serial = created(kvpages_core::Settings::default(), 8);
        let text = "386b2d9cf5aa91ba3a4b42c35396c822";
        let key = kvpages_core::Key::parse(text).unwrap();
        let mut raw = Vec::new();
        kvpages_abi::keys::pack_core_key(&mut raw, &key);
        assert_eq!(raw.len(), 18);
        assert_eq!(&raw[..2], &[0x10, 0x80]);
        kvpages_abi::keys::pack_core_key(&mut raw, &kvpages_core::Key::parse("k2").unwrap());
        assert_eq!(&raw[18..], &[2, 0, b'k', b'2']);
        assert_eq!(Plugin::allocate(2, sp(), 0, raw.clone()).unwrap(), alloc::vec![0, 0, 1, 1]);
        Plugin::confirm(3, sp(), 0, packed(&[text, "k2"]), alloc::vec![0, 1], alloc::vec![]).unwrap();
        assert_eq!(Plugin::exists(4, sp(), packed(&[text])).unwrap(), alloc::vec![true]);
        assert_eq!(Plugin::locations(5, sp(), 0, raw).unwrap(), alloc::vec![Some(0), Some(1)]);
    }

    #[test]
    fn malformed_arguments_are_refused_not_trapped() {
        let _serial = created(kvpages_core::Settings::default(), 8);
        for (bytes, why) in [
            (alloc::vec![5u8], "keys[0]: the length prefix is cut off"),
            (alloc::vec![3, 0, b'a'], "keys[0]: 3 bytes announced, 1 left"),
            (alloc::vec![0, 0], "keys[0]: key is empty"),
            (alloc::vec![1, 0, 0xff], "keys[0]: the key is not UTF-8"),
            (alloc::vec![0x10, 0x80, 1, 2], "keys[0]: 16 raw bytes announced, 2 left"),
            (alloc::vec![0x11, 0x80, 1], "keys[0]: prefix 0x8011: the only raw form is 0x8010"),
        ] {
            assert_eq!(Plugin::exists(2, sp(), bytes).unwrap_err(), wit::Error::InvalidInput(why.into()));
        }
        let r = Plugin::confirm(2, sp(), 0, packed(&["a"]), alloc::vec![], alloc::vec![]);
        assert!(matches!(r, Err(wit::Error::InvalidInput(_))));
    }
}
