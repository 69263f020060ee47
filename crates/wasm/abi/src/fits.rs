//! Whether a reply fits the command it answers: the one check of what an engine that is
//! trusted for nothing (a plugin) answered, before anything indexes a batch by it.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;
use core::hash::BuildHasher;

use kvpages_core::{Allocation, Command, Error, Key, Reply};

/// [`fits`]' tables, kept between calls (no allocation a call once they have grown to the
/// largest batch), and its hasher, seeded by the caller: at random, since a client that knew
/// the seed could send keys that all collide, or shape the free list so that a batch's pages
/// did.
pub struct Seen {
    hasher: foldhash::fast::FixedState,
    tables: Vec<u32>,
}

impl Seen {
    /// Empty tables, hashing with `seed`.
    pub fn new(seed: u64) -> Seen {
        Seen { hasher: foldhash::fast::FixedState::with_seed(seed), tables: Vec::new() }
    }
}

impl core::fmt::Debug for Seen {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Seen").field("tables", &self.tables.len()).finish_non_exhaustive()
    }
}

/// Whether an engine's answer fits `cmd` where the routes rely on it: they index the batch's
/// keys by the answer, so a plugin (trusted for nothing) must answer a batch lookup key for key
/// and allocations at key positions, in range and in increasing order, each distinct key's
/// first position exactly once and no page twice, as the core does ([`answered_once`]). A
/// confirm's refusals are at most one a pair (and, when nothing was confirmed, exactly one, for
/// a batch of at least one pair), its ignored releases at most one a release: so what a plugin
/// answers is bounded by what it was asked. `seen`: [`answered_once`]'s tables.
pub fn fits(cmd: &Command, answer: Result<&Reply, &Error>, seen: &mut Seen) -> Result<(), String> {
    let most = |what: &str, n: usize, of: usize, unit: &str| match n > of {
        true => Err(format!("{n} {what} for {of} {unit}")),
        false => Ok(()),
    };
    match (cmd, answer) {
        (Command::Exists { keys, .. }, Ok(Reply::Exists(answers))) if answers.len() != keys.len() => {
            Err(format!("{} answers for {} keys", answers.len(), keys.len()))
        }
        (Command::Locations { keys, .. }, Ok(Reply::Locations(answers))) if answers.len() != keys.len() => {
            Err(format!("{} answers for {} keys", answers.len(), keys.len()))
        }
        (Command::Allocate { keys, .. }, Ok(Reply::Allocated(a))) => {
            let mut next = 0;
            for a in a {
                if (a.index as usize) < next || a.index as usize >= keys.len() {
                    return Err(format!("an allocation for key {} of {} out of order or range", a.index, keys.len()));
                }
                next = a.index as usize + 1;
            }
            answered_once(keys, a, seen)
        }
        (Command::Confirm { confirmations, releases, .. }, Ok(Reply::Confirmed(r))) => {
            most("refusals", r.refused.len(), confirmations.len(), "pairs")?;
            most("ignored releases", r.ignored_releases.len(), releases.len(), "releases")
        }
        (Command::Confirm { confirmations, .. }, Err(Error::NothingConfirmed { refused }))
            if refused.len() != confirmations.len() || confirmations.is_empty() =>
        {
            Err(format!("nothing confirmed with {} refusals for {} pairs", refused.len(), confirmations.len()))
        }
        _ => Ok(()),
    }
}

/// Whether `allocations` (in range and increasing: checked before) answer exactly the first
/// position of each distinct key of `keys`, and name no page twice — as the core's do: a key's
/// repeats share its answer, and two keys of one batch never hold one page. A plugin that left
/// a key out would have vLLM's client miss it, one that answered a repeat would list a key
/// twice, one that gave two keys a page would have them overwrite each other's block.
fn answered_once(keys: &[Key], allocations: &[Allocation], seen: &mut Seen) -> Result<(), String> {
    // Two linear-probing tables at most half full, found by a hash's top bits, in `seen`: of
    // key positions (+1; 0 is empty) and of pages (+1; u32::MAX, no rank's page, is refused).
    // Through two std `HashSet`s a call this check cost the plugin's 32-key save ~12 % more
    // instructions, through two tables allocated a call ~7 %, this way ~5 % (valgrind counts
    // each byte of the tables' clearing, a `rep stos`, as an instruction).
    let bits = (keys.len() * 2).next_power_of_two().max(2).trailing_zeros();
    let (len, shift) = (1usize << bits, 64 - bits);
    let Seen { hasher, tables } = seen;
    tables.clear();
    tables.resize(2 * len, 0);
    let (firsts, pages) = tables.split_at_mut(len);
    let mut answers = allocations.iter().peekable();
    for (i, key) in keys.iter().enumerate() {
        let mut b = (hasher.hash_one(key) >> shift) as usize;
        let first = loop {
            match firsts[b] {
                0 => {
                    firsts[b] = i as u32 + 1;
                    break true;
                }
                at if keys[at as usize - 1] == *key => break false,
                _ => b = (b + 1) & (len - 1),
            }
        };
        match (first, answers.next_if(|a| a.index as usize == i)) {
            (true, None) => return Err(format!("no allocation for key {i}, the first of its kind")),
            (false, Some(_)) => return Err(format!("an allocation for key {i}, a repeat of an earlier key")),
            (_, Some(&Allocation { page: Some(page), .. })) => {
                let Some(mark) = page.checked_add(1) else {
                    return Err(format!("page {page} for key {i}, past any rank's pages"));
                };
                let mut b = (hasher.hash_one(page) >> shift) as usize;
                loop {
                    match pages[b] {
                        0 => break pages[b] = mark,
                        p if p == mark => {
                            return Err(format!("page {page} allocated to two keys (the second: key {i})"));
                        }
                        _ => b = (b + 1) & (len - 1),
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use alloc::vec;

    use kvpages_core as kv;

    use super::*;

    /// [`fits`] with tables of its own.
    fn fit(cmd: &Command, answer: &Result<Reply, Error>) -> Result<(), String> {
        fits(cmd, answer.as_ref(), &mut Seen::new(0))
    }

    #[test]
    fn a_reply_must_fit_its_batch() {
        let k = |s: &str| Key::parse(s).unwrap();
        let keys = vec![k("a"), k("b"), k("a")];
        // The native core's own answers fit: duplicates, an empty batch, either space.
        let mut core = kv::Core::new(1, kv::Settings::default());
        let sg = kv::Space::Sglang { rank: 0, namespace: "kv".into() };
        for space in [kv::Space::Vllm, sg] {
            core.apply(0, &Command::Initialize { space: space.clone(), rank: 0, num_pages: 8 }).unwrap();
            for batch in [keys.clone(), vec![]] {
                for cmd in [
                    Command::Allocate { space: space.clone(), rank: 0, keys: batch.clone() },
                    Command::Exists { space: space.clone(), keys: batch.clone() },
                    Command::Locations { space: space.clone(), rank: 0, keys: batch.clone() },
                ] {
                    let reply = core.apply(1, &cmd);
                    assert_eq!(fit(&cmd, &reply), Ok(()), "{cmd:?}: {reply:?}");
                }
            }
        }
        // A broken engine's do not.
        let alloc = Command::Allocate { space: kv::Space::Vllm, rank: 0, keys: keys.clone() };
        let at = |index| kv::Allocation { index, page: Some(0), cached: false };
        for (reply, why) in [
            (Reply::Allocated(vec![at(3)]), "key 3 of 3"),
            (Reply::Allocated(vec![at(1), at(0)]), "key 0 of 3 out of order"),
            (Reply::Allocated(vec![at(1), at(1)]), "key 1 of 3 out of order"),
        ] {
            assert!(fit(&alloc, &Ok(reply.clone())).unwrap_err().contains(why), "{reply:?}");
        }
        let exists = Command::Exists { space: kv::Space::Vllm, keys: keys.clone() };
        assert_eq!(fit(&exists, &Ok(Reply::Exists(vec![true; 2]))).unwrap_err(), "2 answers for 3 keys");
        let locations = Command::Locations { space: kv::Space::Vllm, rank: 0, keys: keys.clone() };
        assert_eq!(fit(&locations, &Ok(Reply::Locations(vec![None; 4]))).unwrap_err(), "4 answers for 3 keys");

        // Confirms: the core's answers fit (one refused pair and an ignored release; nothing
        // confirmed, one refusal a pair), a broken engine's longer lists do not.
        let mut core = kv::Core::new(1, kv::Settings::default());
        core.apply(0, &Command::Initialize { space: kv::Space::Vllm, rank: 0, num_pages: 8 }).unwrap();
        let Reply::Allocated(a) =
            core.apply(1, &Command::Allocate { space: kv::Space::Vllm, rank: 0, keys: vec![k("a")] }).unwrap()
        else {
            panic!()
        };
        let page = a[0].page.unwrap();
        let confirm = |pairs: Vec<(Key, u32)>, releases: Vec<u32>| Command::Confirm {
            space: kv::Space::Vllm,
            rank: 0,
            confirmations: pairs,
            releases,
        };
        let some = confirm(vec![(k("a"), page), (k("b"), page)], vec![(page + 1) % 8]);
        let none = confirm(vec![(k("c"), (page + 2) % 8), (k("d"), (page + 3) % 8)], vec![]);
        let refused = kv::Refused { index: 0, page: 0, reason: kv::Refusal::NotReserved };
        let answer = core.clone().apply(2, &none);
        assert!(matches!(&answer, Err(Error::NothingConfirmed { refused }) if refused.len() == 2), "{answer:?}");
        assert_eq!(fit(&none, &answer), Ok(()));
        // Repeated pairs and releases: still at most one refusal a pair, one ignored release a
        // release.
        let twice = confirm(vec![(k("a"), page), (k("a"), page), (k("b"), page)], vec![(page + 1) % 8; 2]);
        let answer = core.clone().apply(2, &twice);
        assert!(matches!(&answer, Ok(Reply::Confirmed(r)) if r.ignored_releases.len() == 2), "{answer:?}");
        assert_eq!(fit(&twice, &answer), Ok(()));
        let answer = core.clone().apply(2, &some);
        assert_eq!(fit(&some, &answer), Ok(()));
        let Ok(Reply::Confirmed(report)) = answer else { panic!("{answer:?}") };
        assert_eq!((report.refused.len(), report.ignored_releases.len()), (1, 1), "{report:?}");
        let mut long = report.clone();
        long.refused = vec![refused; 3];
        assert_eq!(fit(&some, &Ok(Reply::Confirmed(long))).unwrap_err(), "3 refusals for 2 pairs");
        let mut long = report;
        long.ignored_releases = vec![(0, kv::IgnoredRelease::AlreadyFree); 2];
        assert_eq!(fit(&some, &Ok(Reply::Confirmed(long))).unwrap_err(), "2 ignored releases for 1 releases");
        for n in [1, 3] {
            let answer = Err(Error::NothingConfirmed { refused: vec![refused; n] });
            assert_eq!(fit(&none, &answer).unwrap_err(), format!("nothing confirmed with {n} refusals for 2 pairs"));
        }
        // "Nothing confirmed" of an empty batch: the core confirms an empty batch.
        let empty = confirm(vec![], vec![]);
        assert!(matches!(core.clone().apply(2, &empty), Ok(Reply::Confirmed(_))));
        let answer = Err(Error::NothingConfirmed { refused: vec![] });
        assert_eq!(fit(&empty, &answer).unwrap_err(), "nothing confirmed with 0 refusals for 0 pairs");
    }
}
