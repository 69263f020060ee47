//! The direct entry point's guest side: the two plain core-wasm exports beside the WIT
//! interface (named by [`BUFFER`](kvpages_abi::direct::BUFFER) and
//! [`CALL`](kvpages_abi::direct::CALL)), the buffer the guest keeps for them, and [`handle`],
//! which applies one request. The exchange itself, which the host shares, is
//! [`kvpages_abi::direct`]'s. Compiled for wasm32 and the unit tests only.

use alloc::vec::Vec;

#[cfg(feature = "chaos")]
use kvpages_core::Command;

use kvpages_abi::direct::{
    Applied, BIG, FAULT, OK, REFUSED, Request, answers, encode_refusal, encode_reply, keeps_buffer,
};

/// Handles one request (in [`kvpages_abi::direct`]'s frames); the reply's bytes are left in
/// `reply` (cleared first; a snapshot is moved in whole). Returns the status. [`FAULT`] always
/// means nothing was applied: a reply that does not fit its command, or does not encode, after
/// the command was applied is a panic (a trap: the host rebuilds the instance without it), as
/// the WIT interface's `expect!` is.
pub(crate) fn handle(request: &[u8], reply: &mut Vec<u8>) -> u32 {
    // A snapshot's buffer (or any big reply) is not kept for the small replies after it.
    if reply.capacity() > BIG {
        *reply = Vec::new();
    }
    reply.clear();
    let fault = |reply: &mut Vec<u8>, why: &str| {
        reply.extend_from_slice(why.as_bytes());
        FAULT
    };
    let cmd = match kvpages_abi::direct::decode_request(request) {
        Ok(Request::Apply(applied)) => applied,
        Ok(Request::Create { seed, settings }) => {
            crate::create(seed, settings);
            return OK;
        }
        Ok(Request::Snapshot) => {
            return match crate::snapshot() {
                Ok(bytes) => {
                    *reply = bytes;
                    OK
                }
                Err(crate::NotCreated) => fault(reply, "the engine was not created"),
            };
        }
        Ok(Request::Restore(snapshot)) => {
            return match crate::restore(snapshot) {
                Ok(()) => OK,
                Err(why) => fault(reply, &why),
            };
        }
        Err(why) => return fault(reply, &why),
    };
    let Applied { now, op, cmd, raw } = cmd;
    #[cfg(feature = "chaos")]
    let after = match &cmd {
        Command::Allocate { keys, .. } => crate::chaos::before(keys),
        _ => false,
    };
    let result = crate::run(now, cmd, raw);
    #[cfg(feature = "chaos")]
    crate::chaos::after(after);
    let encoded = match result {
        Ok(Ok(r)) => {
            assert!(answers(op, &r), "the core answered op {op} with {r:?}");
            encode_reply(reply, &r).map(|()| OK)
        }
        Ok(Err(e)) => encode_refusal(reply, &e).map(|()| REFUSED),
        Err(crate::NotCreated) => return fault(reply, "the engine was not created"),
    };
    // Writing to a `Vec` does not fail.
    encoded.expect("a reply encodes")
}

/// The exchange's buffers and the last reply's descriptor (wasm32; natively only the unit
/// tests).
#[derive(Debug)]
struct Exchange {
    request: Vec<u8>,
    reply: Vec<u8>,
    descriptor: [u32; 3],
}

/// The guest's one exchange (single-threaded: see `State` in lib.rs).
struct Shared(core::cell::RefCell<Exchange>);

// SAFETY: as for lib.rs's `State`: wasm32 guests are single-threaded, and natively it exists
// only in the unit tests, which touch it one at a time under `TEST_LOCK` (the module is
// compiled out of any other native build).
unsafe impl Sync for Shared {}

static EXCHANGE: Shared =
    Shared(core::cell::RefCell::new(Exchange { request: Vec::new(), reply: Vec::new(), descriptor: [0; 3] }));

/// [`BUFFER`](kvpages_abi::direct::BUFFER): at least `len` writable bytes for the next
/// request (zeroed when it grows, so the buffer is always initialized memory); its address as a
/// wasm32 pointer.
fn buffer(len: u32) -> *mut u8 {
    let mut x = EXCHANGE.0.borrow_mut();
    // The last reply is not needed any more: a big one (a snapshot) is freed before the
    // request buffer grows.
    if x.reply.capacity() > BIG {
        x.reply = Vec::new();
    }
    let len = len as usize;
    if x.request.len() < len {
        x.request.resize(len, 0);
    }
    x.request.as_mut_ptr()
}

/// [`CALL`](kvpages_abi::direct::CALL): handles the request in the buffer's first `len` bytes;
/// the address of the reply's descriptor.
fn call(len: u32) -> *const u32 {
    let mut x = EXCHANGE.0.borrow_mut();
    let x = &mut *x;
    let mut keep = true;
    let status = match x.request.get(..len as usize) {
        Some(request) => {
            keep = keeps_buffer(request);
            handle(request, &mut x.reply)
        }
        None => {
            x.reply.clear();
            x.reply.extend_from_slice(b"the request is longer than the buffer");
            FAULT
        }
    };
    if !keep {
        x.request = Vec::new();
    }
    // Pointers are 32 bits on wasm32, the only target the host calls this on.
    x.descriptor = [status, x.reply.as_ptr() as usize as u32, x.reply.len() as u32];
    x.descriptor.as_ptr()
}

#[cfg(target_arch = "wasm32")]
mod exports {
    // The names are `kvpages_abi::direct::{BUFFER, CALL}`; the host looks them up in the
    // component's core module (a host test checks that the embedded plugin has them).
    #[unsafe(no_mangle)]
    extern "C" fn kvpages_direct_v1_buffer(len: u32) -> *mut u8 {
        super::buffer(len)
    }

    #[unsafe(no_mangle)]
    extern "C" fn kvpages_direct_v1_call(len: u32) -> *const u32 {
        super::call(len)
    }
}

#[cfg(test)]
mod tests {
    use alloc::vec;

    use alloc::string::String;

    use kvpages_abi::direct::{APPLY, OP_ALLOCATE, RESTORE, SNAPSHOT, decode_reply, encode_apply, encode_create};
    use kvpages_core::{Command, Core, Eviction, Key, Millis, Reply, Settings, SglangPool, Space};

    use super::*;

    fn key(s: &str) -> Key {
        Key::parse(s).unwrap()
    }

    /// Sends `cmd` through the exchange's guest side (`handle`) and decodes the reply as the
    /// host does.
    fn through(now: Millis, cmd: &Command) -> Result<Result<Reply, kvpages_core::Error>, String> {
        let mut request = Vec::new();
        encode_apply(&mut request, now, cmd);
        let mut reply = Vec::new();
        let status = handle(&request, &mut reply);
        decode_reply(cmd, status, &reply)
    }

    fn create(seed: u64, settings: Settings) {
        let mut request = Vec::new();
        encode_create(&mut request, seed, &settings);
        assert_eq!(handle(&request, &mut Vec::new()), OK);
    }

    /// Every kind of command, and of reply (refusals included), through the direct entry
    /// point answers exactly what the core answers directly.
    #[test]
    fn every_command_and_reply_crosses_the_exchange_unchanged() {
        let _serial = crate::TEST_LOCK.lock().unwrap();
        let settings = Settings { eviction: Eviction::Off, ..Settings::default() };
        create(9, settings);
        let mut core = Core::new(9, settings);
        let hex = key("386b2d9cf5aa91ba3a4b42c35396c822");
        let sg = Space::Sglang { rank: 1, namespace: "kv".into() };
        let commands = vec![
            Command::Stats,
            Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![hex.clone()] },
            Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 4 },
            Command::Initialize { space: sg.clone(), rank: 1, num_pages: 8 },
            Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![hex.clone(), key("t"), hex.clone()] },
            Command::Confirm {
                space: Space::Vllm,
                rank: 0,
                confirmations: vec![(hex.clone(), 0), (key("t"), 3)],
                releases: vec![2, 1],
            },
            Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![(key("u"), 9)], releases: vec![] },
            Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![(key("u"), 2)], releases: vec![] },
            Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![key("a"), key("b"), key("c"), key("d")] },
            Command::Exists { space: Space::Vllm, keys: vec![hex.clone(), key("t"), key("x")] },
            Command::Locations { space: Space::Vllm, rank: 0, keys: vec![key("x"), hex.clone()] },
            Command::Inspect { space: Space::Vllm, key: hex.clone() },
            Command::Inspect { space: Space::Vllm, key: key("nope") },
            Command::Allocate { space: sg.clone(), rank: 1, keys: vec![key("s1"), key("s2")] },
            Command::Confirm { space: sg.clone(), rank: 1, confirmations: vec![(key("s1"), 7)], releases: vec![] },
            Command::ExportSglang,
            Command::ImportSglang {
                pools: vec![SglangPool {
                    rank: 2,
                    namespace: "kv".into(),
                    num_pages: 4,
                    free_pages: vec![3, 2],
                    keys: vec![(key("i"), 0), (hex.clone(), 1)],
                }],
                replace: true,
            },
            Command::ImportSglang { pools: vec![], replace: false },
            Command::LeaseAll,
            Command::Delete { space: Space::Vllm, keys: vec![hex.clone(), key("x")] },
            Command::Configure(Settings { reservation_ttl: 5, ..settings }),
            Command::Stats,
            Command::Clear { space: sg },
            Command::Reset { space: Space::Vllm },
            Command::Allocate { space: Space::Vllm, rank: 0, keys: vec![] },
        ];
        let mut kinds = alloc::collections::BTreeSet::new();
        for (i, cmd) in commands.iter().enumerate() {
            let now = 10 + i as u64;
            let want = core.apply(now, cmd);
            let got = through(now, cmd).unwrap();
            assert_eq!(got, want, "{i}: {cmd:?}");
            kinds.insert(alloc::format!("{:?}", got.map(|r| core::mem::discriminant(&r))));
        }
        // All 13 kinds of reply, and refusals of four kinds.
        assert_eq!(kinds.iter().filter(|k| k.starts_with("Ok")).count(), 13, "{kinds:?}");
        assert_eq!(kinds.iter().filter(|k| k.starts_with("Err")).count(), 4, "{kinds:?}");
        assert_eq!(crate::snapshot().unwrap(), core.snapshot());
    }

    #[test]
    fn malformed_requests_are_faults_that_change_nothing() {
        let _serial = crate::TEST_LOCK.lock().unwrap();
        create(3, Settings::default());
        let init = Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 8 };
        assert!(through(1, &init).unwrap().is_ok());
        let before = crate::snapshot().unwrap();
        let mut good = Vec::new();
        encode_apply(
            &mut good,
            2,
            &Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![(key("a"), 0)], releases: vec![] },
        );
        let mut extra_key = good.clone();
        extra_key.extend_from_slice(&[1, 0, b'b']);
        let mut bad_key = good.clone();
        bad_key.truncate(bad_key.len() - 1);
        bad_key.extend_from_slice(&[0xff]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "an empty direct request"),
            (vec![99], "an unknown request kind 99"),
            (vec![APPLY, 1, 2], "no time"),
            (vec![APPLY, 0, 0, 0, 0, 0, 0, 0, 0], "no op"),
            (vec![APPLY, 0, 0, 0, 0, 0, 0, 0, 0, 200], "op 200"),
            (vec![APPLY, 0, 0, 0, 0, 0, 0, 0, 0, OP_ALLOCATE], "header"),
            (good[..good.len() - 2].to_vec(), "keys[0]: the length prefix is cut off"),
            (extra_key, "2 keys but 1 pages: confirmations need one page per key"),
            (bad_key, "keys[0]: the key is not UTF-8"),
        ];
        for (request, why) in cases {
            let mut reply = Vec::new();
            assert_eq!(handle(&request, &mut reply), FAULT, "{request:?}");
            let text = core::str::from_utf8(&reply).unwrap();
            assert!(text.contains(why), "{request:?}: {text}");
        }
        assert_eq!(crate::snapshot().unwrap(), before);
        // A confirm whose page list is cut short: refused, not read past.
        let mut request = Vec::new();
        encode_apply(
            &mut request,
            2,
            &Command::Confirm { space: Space::Vllm, rank: 0, confirmations: vec![], releases: vec![] },
        );
        let at = request.len() - 4;
        request[at..].copy_from_slice(&1000u32.to_le_bytes());
        let mut reply = Vec::new();
        assert_eq!(handle(&request, &mut reply), FAULT);
        assert!(core::str::from_utf8(&reply).unwrap().contains("pages cut off"));
        // No engine: a fault, not a trap.
        *crate::STATE.0.borrow_mut() = None;
        assert!(through(3, &init).unwrap_err().contains("not created"));
        let mut reply = Vec::new();
        assert_eq!(handle(&[SNAPSHOT], &mut reply), FAULT);
        assert_eq!(handle(&[RESTORE, 1, 2, 3], &mut reply), FAULT);
        let mut request = vec![RESTORE];
        request.extend_from_slice(&before);
        assert_eq!(handle(&request, &mut reply), OK);
        assert_eq!(crate::snapshot().unwrap(), before);
    }

    /// The exports' side: the buffer handed out, the request read from it, the descriptor.
    #[test]
    fn the_exchange_reads_the_buffer_and_describes_the_reply() {
        let _serial = crate::TEST_LOCK.lock().unwrap();
        create(5, Settings::default());
        let descriptor = || EXCHANGE.0.borrow().descriptor;
        let reply = |d: [u32; 3]| {
            let x = EXCHANGE.0.borrow();
            // The whole reply (the pointer is 64 bits here, truncated: only wasm32 reads it).
            assert_eq!(d[2] as usize, x.reply.len());
            x.reply.clone()
        };
        let mut request = Vec::new();
        let cmd = Command::Initialize { space: Space::Vllm, rank: 0, num_pages: 4 };
        encode_apply(&mut request, 1, &cmd);
        let at = buffer(request.len() as u32);
        EXCHANGE.0.borrow_mut().request[..request.len()].copy_from_slice(&request);
        call(request.len() as u32);
        let d = descriptor();
        assert_eq!(d[0], OK);
        assert_eq!(
            decode_reply(&cmd, OK, &reply(d)).unwrap().unwrap(),
            Core::new(5, Settings::default()).apply(1, &cmd).unwrap()
        );
        // A small request keeps the buffer where it is; a longer one than it holds is a fault.
        assert_eq!(buffer(4), at);
        call(request.len() as u32 + 1_000_000);
        let d = descriptor();
        assert_eq!((d[0], reply(d)), (FAULT, b"the request is longer than the buffer".to_vec()));
        // A restore's buffer is freed after it (`keeps_buffer`), and so is a big request's.
        let snapshot = crate::snapshot().unwrap();
        let mut restore = vec![RESTORE];
        restore.extend_from_slice(&snapshot);
        assert!(!keeps_buffer(&restore) && keeps_buffer(&request) && !keeps_buffer(&vec![APPLY; BIG + 1]));
        buffer(restore.len() as u32);
        EXCHANGE.0.borrow_mut().request[..restore.len()].copy_from_slice(&restore);
        call(restore.len() as u32);
        assert_eq!(descriptor()[0], OK);
        assert_eq!(EXCHANGE.0.borrow().request.capacity(), 0);
    }
}
