"""kvpages beside SGLang's REAL metadata server and client (SGLang 0.5.23, fetched at test time).

`sglang_peer.py` downloads the SGLang wheel into `target/peers/` (once), extracts
`mini_3fs_metadata_server.py`, and runs it with stand-ins for the two SGLang modules it imports.

kvpages runs here with `--eviction off --read-lease 0 --quarantine 0`. Why: parity holds while
nothing is evicted (SGLang's server evicts the least recently used key on the spot when no page
is free; kvpages with eviction off answers -1 — the generator never lets a pool run out), and
kvpages' read leases and quarantine only change page numbers around deletes of recently read
keys (a deleted page that a reader may still be reading is kept out of use for the lease),
which SGLang's server does not protect at all. With both set to 0, kvpages must hand out exactly
the pages SGLang's server hands out.

- `test_hicache_cycle_same_on_both`: SGLang's own client, driven as HiCache's HF3FS backend
  drives it (`sglang_peer.HiCache`: kv and mamba pools, sets with cache hits and write failures,
  gets, exists, deletes, clears, uninitialized pools), against kvpages and against the peer:
  the two transcripts (every return value, every error's status and detail) must be identical.
- `test_differential_random_valid_input`: a seeded generator sends the same raw bytes to both
  servers and requires identical status codes and body bytes (and content types on 200). Its
  input is VALID, meaning:
  * a rank:namespace is initialized before use (requests to other rank:namespaces are sent too:
    both answer the same 404), and re-initialized only with the same size;
  * no key twice in one reserve batch; never a second writer of a key whose reservation is
    pending in that rank:namespace;
  * every page handed out as `[false, p]` is confirmed or released once, by that rank:namespace
    (in one confirm, or split over several), except for a few abandoned saves (a crashed
    writer: the page stays reserved, well within kvpages' 60 s reservation TTL); a clear ends
    the saves in flight in that rank:namespace (SGLang's caller clears at shutdown);
  * no release names a page committed to a key (only pages of failed writes are released);
  * a pool never runs out: a reserve batch never asks for more new pages than are free (the
    batch is cut where it would; a pool may become exactly full);
  * delete_keys (committed, pending and unknown keys) and clear are included.
  The generator keeps a model of SGLang's server (stack free list, key -> page) and also checks
  the peer's answers against it, so a drift of the model is reported as such.
  Seeds: `KVPAGES_SGLANG_PARITY_SEED=N` or `=N,M,...` (default 1, 2, 3, 4); steps per seed:
  `KVPAGES_SGLANG_PARITY_STEPS` (default 2,500). Both servers start empty for each seed.
"""

import hashlib
import http.client
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pytest
import requests

import sglang_peer
from peer import seeds_from_env, show_reply, show_request
from sglang_peer import NOT_INITIALIZED, HiCache, Recorder

DEFAULT_SEEDS = (1, 2, 3, 4)
DEFAULT_STEPS = 2500
KVPAGES_FLAGS = ("--read-lease", "0", "--quarantine", "0")  # and --eviction off (conftest)


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


class _Sglang:
    """What the module fixture got; `require()` fails the calling test if it is unavailable."""

    def __init__(self):
        self.error = None
        self.script = None
        self.module = None
        self.server = None

    def require(self):
        if self.error is not None:
            pytest.fail(f"SGLang's metadata server (the peer) is unavailable: {self.error}",
                        pytrace=False)
        return self

    def fresh(self) -> str:
        """A freshly started peer (SGLang's server cannot forget an initialized rank:namespace)."""
        if self.server is not None:
            self.server.close()
            self.server = None
        server = sglang_peer.sglang_server(self.script)
        try:
            server.start()
        except sglang_peer.PeerError as e:
            server.close()
            pytest.fail(str(e), pytrace=False)
        self.server = server
        return server.url


@pytest.fixture(scope="module")
def sglang(say):
    s = _Sglang()
    try:
        s.script, s.module = sglang_peer.prepare(say)
    except sglang_peer.PeerError as e:
        s.error = str(e)
    try:
        yield s
    finally:
        if s.server is not None:
            s.server.close()


@pytest.fixture(scope="module")
def kv_module(kvpages_server):
    return kvpages_server(*KVPAGES_FLAGS)


@pytest.fixture
def kv_url(kv_module):
    """This module's kvpages, emptied (every SGLang pool dropped, the vLLM routes cleared), and
    checked to run with the settings parity needs."""
    settings = requests.get(f"{kv_module}/stats", timeout=5).json()["settings"]
    want = {"eviction": "off", "read_lease_seconds": 0.0, "quarantine_seconds": 0.0}
    got = {k: settings.get(k) for k in want}
    assert got == want, f"kvpages runs with {got}; parity needs {want}"
    _empty(kv_module)
    return kv_module


def _empty(url: str) -> None:
    r = requests.post(f"{url}/admin/import/sglang?replace=true", data=b"{}", timeout=10)
    assert r.status_code == 200 and r.json()["pools"] == 0, (r.status_code, r.text)
    assert requests.post(f"{url}/clear", timeout=5).status_code == 204


# --------------------------------------------------------------------------------------------
# Test A: SGLang's client, as HiCache drives it, against both
# --------------------------------------------------------------------------------------------


def chain(n: int, seed: str) -> list:
    out, prev = [], ""
    for i in range(n):
        prev = hashlib.sha256(f"{seed}|{prev}|{i}".encode()).hexdigest()
        out.append(prev)
    return out


def hicache_cycle(module, url: str) -> list:
    """HiCache's calls through SGLang's client; returns the transcript (results and errors)."""
    P = module.PoolName
    client = module.Hf3fsGlobalMetadataClient(url)
    rec = Recorder(client)
    errors = []

    def expect_404(call, *args, **kwargs):
        try:
            call(*args, **kwargs)
        except RuntimeError as e:
            resp = e.__cause__.response
            errors.append((resp.status_code, resp.headers.get("content-type"), resp.content,
                           resp.raw.retries.history))
            rec.calls.append(("error", args, kwargs, errors[-1]))
            return
        raise AssertionError(f"{call.__name__}{args} did not fail")

    keys = chain(200, "hicache parity")
    tp0 = HiCache(rec, P, rank=0, num_pages=160, pools={P.MAMBA: 48})
    tp1 = HiCache(rec, P, rank=1, num_pages=160, pools={P.MAMBA: 48})
    out = []
    for hc in (tp0, tp1):
        out.append(hc.batch_exists(keys))
        out.append(hc.batch_set(keys[:128]))
        out.append(hc.batch_set(keys[:40], P.MAMBA))
        out.append(hc.batch_exists(keys))
    # Cache hits mixed with new keys (32 new, 32 free: exactly full); write failures released
    # in the same confirm, then written again (5 new, 5 free).
    tp0.fail_writes = set(keys[130:135])
    out.append(tp0.batch_set(keys[100:160]))
    out.append(tp0.batch_exists(keys))
    tp0.fail_writes = set()
    out.append(tp0.batch_set(keys[128:140]))
    out.append(tp0.batch_get(keys[120:145]))
    out.append(tp0.batch_get(keys[:45], P.MAMBA))
    # Deletes (the freed pages are the next ones handed out) and an exactly full pool.
    for k in keys[50:60]:
        tp1.delete(k)
    tp1.delete(keys[3], P.MAMBA)
    out.append(tp1.batch_exists(keys))
    out.append(tp1.batch_set(keys[50:60] + keys[128:160]))  # 42 new keys, 42 free pages
    out.append(rec.get_page_indices(1, keys[:160]))
    out.append(tp1.batch_set(keys[40:49], P.MAMBA))  # mamba: 9 new, 9 free
    out.append(rec.get_page_indices(1, [f"{k}_mamba" for k in keys[:50]], namespace=P.MAMBA))
    # MHA zero-copy keys in a pool of their own rank.
    tp2 = HiCache(rec, P, rank=2, num_pages=300)
    zkeys = [f"{b}-{x}" for b in keys[:128] for x in ("k", "v")]
    out.append(tp2.batch_set(zkeys))
    out.append(tp2.batch_exists(keys, mha_zero_copy=True))
    # Pools nobody initialized: 404 at once, same bytes.
    expect_404(rec.exists, 3, keys[:2])
    expect_404(rec.get_page_indices, 0, keys[:2], namespace=P.SWA)
    expect_404(rec.reserve_and_allocate_page_indices, 2, [(keys[0], "")], namespace=P.MAMBA)
    expect_404(rec.confirm_write, 4, [(keys[0], 1)], [])
    expect_404(rec.delete_keys, 0, keys[:1], namespace=P.INDEXER)
    expect_404(rec.clear, 5)
    # Re-initialize with the same size (ignored), clear, and start again.
    rec.initialize(0, 160)
    tp0.clear()
    out.append(tp0.batch_exists(keys))
    out.append(tp0.batch_set(keys[:10]))
    out.append(rec.get_page_indices(0, keys[:12]))
    out.append(tp1.batch_exists(keys))
    client._session.close()
    return [(name, args, kwargs, result) for name, args, kwargs, result in rec.calls] + out


def test_hicache_cycle_same_on_both(sglang, kv_url, say):
    s = sglang.require()
    peer_url = s.fresh()
    start = time.monotonic()
    ours = hicache_cycle(s.module, kv_url)
    theirs = hicache_cycle(s.module, peer_url)
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            pytest.fail(f"transcript entry {i}: kvpages {a!r:.600}\n  but the peer {b!r:.600}",
                        pytrace=False)
    say(f"SGLang HiCache cycle: {len(ours)} identical calls/results on kvpages and the peer "
        f"({time.monotonic() - start:.1f} s)")


# --------------------------------------------------------------------------------------------
# Test B: differential on random valid input
# --------------------------------------------------------------------------------------------


class RawClient:
    """One keep-alive HTTP/1.1 connection; sends raw bytes, returns (status, content-type, body)."""

    def __init__(self, url: str):
        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)

    def post(self, path: str, body: bytes, content_type: str | None = "application/json"):
        headers = {"Content-Type": content_type} if content_type else {}
        self.conn.request("POST", path, body=body, headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        return r.status, r.getheader("content-type"), data

    def close(self):
        self.conn.close()


@dataclass
class Pool:
    """The model of one rank:namespace in SGLang's server."""

    num_pages: int
    free: list = field(default_factory=list)  # a stack: pop() from the end, push to the end
    committed: dict = field(default_factory=dict)  # key -> page
    pending: dict = field(default_factory=dict)  # key -> page reserved, not confirmed/released

    def __post_init__(self):
        self.free = list(range(self.num_pages))


@dataclass
class Save:
    """A set in flight: the new pages of one reserve, not yet confirmed or released."""

    space: tuple
    entries: list  # (key, page)


RANKS = (0, 1, 2, 3)
NAMESPACES = ("kv",) * 3 + ("mamba", "swa", "indexer", "draft", "deepseek_v4_c4_indexer",
                            "名前空間✓", 'q"uo\\te/', "")
SIZES = (16, 24, 40, 64, 128, 300, 1000, 2000)  # small pools fill up and reuse pages at once


class Generator:
    """Random valid requests (see the module docstring) and the model that keeps them valid."""

    STYLES = ("sha",) * 20 + ("mha", "upper", "text", "unicode", "escapes", "long")

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.stats = Counter()
        self.serial = 0
        spaces = sorted({(rng.choice(RANKS), rng.choice(NAMESPACES)) for _ in range(9)}
                        | {(0, "kv")})
        rng.shuffle(spaces)
        # Most are used; a few are never initialized (requests to them answer 404).
        cut = max(1, len(spaces) - rng.randint(1, 2))
        self.usable = spaces[:cut]
        self.never = spaces[cut:] + [(9, "kv"), (0, "never")]
        self.sizes = {s: rng.choice(SIZES) for s in self.usable}
        self.pools = {}  # space -> Pool, initialized ones
        self.inflight = []
        self.prompts = [self._prompt() for _ in range(10)]

    # ---- keys ------------------------------------------------------------------------------

    def _key(self, style: str, parent: str, i: int) -> str:
        h = hashlib.sha256(f"{parent}|{i}|{self.serial}".encode()).hexdigest()
        self.serial += 1
        if style == "upper":
            return h.upper()
        if style == "text":
            return f"req-{i}/page-{h[:10]}"
        if style == "unicode":
            return f"страница-{h[:8]}-ключ✓😀"
        if style == "escapes":
            return f'q"{h[:4]}\\/\n\t\r\b\f\x00\x01\x1f\x7f\u2028\ufeff {h[4:8]}'
        if style == "long":  # up to kvpages' documented 1,024-byte key limit
            text = f"{h}/" + "é" * 300 + h * 6
            return text.encode()[: 1024 - 64 - 40].decode(errors="ignore") + h  # + a suffix
        return h

    def _prompt(self) -> list:
        rng = self.rng
        style = rng.choice(self.STYLES)
        n = rng.choice((8, 40, 150, 400))
        out, prev = [], f"p{rng.random()}"
        for i in range(n):
            prev = self._key("sha" if style == "mha" else style, prev, i)
            if style == "mha":
                out += [f"{prev}-k", f"{prev}-v"]
            else:
                out.append(prev)
        return out

    def _keys_for(self, space, base: list) -> list:
        """The keys a pool stores: component keys `K_ns` outside kv, as the caller makes them."""
        _, ns = space
        return base if ns == "kv" else [f"{k}_{ns}" for k in base]

    # ---- encoding --------------------------------------------------------------------------

    def _enc(self, body) -> bytes:
        """Compact JSON as orjson writes it; sometimes non-ASCII as \\u escapes (both get it)."""
        return json.dumps(body, separators=(",", ":"), ensure_ascii=self.rng.random() < 0.15).encode()

    def _ns(self, body: dict, space) -> dict:
        """Adds the namespace; a body without one means "kv" (SGLang's client always sends it)."""
        _, ns = space
        if ns != "kv" or self.rng.random() < 0.7:
            body["namespace"] = ns
        return body

    def _path(self, space, op: str) -> str:
        rank, _ = space
        if self.rng.random() < 0.02:
            return f"/0{rank}/{op}"  # leading zeros: the same rank for both
        return f"/{rank}/{op}"

    # ---- requests --------------------------------------------------------------------------

    def next_request(self):
        """(path, body bytes, expected (status, parsed reply) from the model, on_reply)."""
        rng = self.rng
        choices = []
        not_yet = [s for s in self.usable if s not in self.pools]
        if not_yet:
            choices.append((40 if not self.pools else 3, self._init_new))
        if self.pools:
            choices += [(30, self._reserve), (10, self._get), (10, self._exists),
                        (5, self._delete), (1.5, self._init_again), (0.6, self._clear)]
        if self.inflight:
            choices.append((30, self._confirm))
        choices.append((1.5, self._uninitialized))
        total = sum(w for w, _ in choices)
        x = rng.random() * total
        for w, f in choices:
            x -= w
            if x < 0:
                return f()
        return choices[-1][1]()

    def _pick(self):
        return self.rng.choice(sorted(self.pools))

    def _init_new(self):
        space = self.rng.choice([s for s in self.usable if s not in self.pools])
        n = self.sizes[space]

        def on_reply():
            self.pools[space] = Pool(n)
            self.stats["initialize"] += 1

        body = self._ns({"num_pages": n}, space)
        return self._path(space, "initialize"), self._enc(body), (204, None), on_reply

    def _init_again(self):
        space = self._pick()

        def on_reply():
            self.stats["initialize again (same size)"] += 1

        body = self._ns({"num_pages": self.pools[space].num_pages}, space)
        return self._path(space, "initialize"), self._enc(body), (204, None), on_reply

    def _reserve(self):
        rng = self.rng
        space = self._pick()
        pool = self.pools[space]
        prompt = rng.choice(self.prompts)
        if rng.random() < 0.02:
            self.prompts[rng.randrange(len(self.prompts))] = self._prompt()
        x = rng.random()
        n = 1 if x < 0.2 else rng.randint(1, 256 if prompt[0].endswith("-k") else 128)
        keys = self._keys_for(space, prompt)
        if x < 0.6:  # the next pages this pool has not stored (the usual set)
            firsts = [i for i, k in enumerate(keys) if k not in pool.committed]
            start = firsts[0] if firsts else 0
        elif x < 0.8:
            start = 0  # the whole prompt again: written pages first, then new ones
        else:
            start = rng.randrange(len(keys))
        chunk, seen, new = [], set(), 0
        for k in keys[start:start + n]:
            if k in seen or k in pool.pending:
                continue  # a key twice in a batch / a second writer: not valid input
            if k not in pool.committed:
                if new == len(pool.free):
                    self.stats["reserve batch cut: pool full"] += 1
                    break  # the pool would run out (the peer would evict): stop here
                new += 1
            seen.add(k)
            chunk.append(k)
        if rng.random() < 0.04 and chunk:
            rng.shuffle(chunk)
        # The model's answer, as SGLang's server computes it.
        free = list(pool.free)
        want = []
        for k in chunk:
            if k in pool.committed:
                want.append([True, pool.committed[k]])
            else:
                want.append([False, free.pop()])
        # The prefix key is always "" from SGLang's caller today; the peer ignores it.
        prefix = (lambda i: chunk[i - 1] if i else "") if rng.random() < 0.05 else (lambda i: "")
        body = self._ns({"keys": [[k, prefix(i)] for i, k in enumerate(chunk)]}, space)
        if rng.random() < 0.03:
            body["request_id"] = f"r{self.serial}"  # unknown members are ignored by both

        def on_reply():
            st = self.stats
            st["reserve"] += 1
            entries = []
            for k, (hit, page) in zip(chunk, want):
                if hit:
                    st["reserve: already written"] += 1
                else:
                    assert pool.free.pop() == page
                    pool.pending[k] = page
                    entries.append((k, page))
                    st["reserve: new page"] += 1
            if not pool.free:
                st["pool exactly full"] += 1
            if entries:
                if rng.random() < 0.02:
                    st["save abandoned (pages stay reserved)"] += 1
                else:
                    self.inflight.append(Save(space, entries))

        return self._path(space, "reserve_and_allocate_page_indices"), self._enc(body), \
            (200, {"indices": want}), on_reply

    def _confirm(self):
        rng = self.rng
        save = rng.choice(self.inflight)
        space = save.space
        pool = self.pools[space]
        entries = list(save.entries)
        mode = rng.choices(("all written", "some failed", "all failed", "split"), (60, 18, 5, 17))[0]
        keep = []
        if mode == "all written":
            ok, failed = entries, []
        elif mode == "all failed":
            ok, failed = [], entries
        elif mode == "some failed":
            ok, failed = [], []
            for e in entries:
                (failed if rng.random() < 0.3 else ok).append(e)
        else:
            a = rng.randint(0, len(entries))
            b = rng.randint(a, len(entries))
            ok, failed, keep = entries[:a], entries[a:b], entries[b:]
        release = [p for _, p in failed]
        if rng.random() < 0.1:
            rng.shuffle(release)
        body = {"written_keys_to_confirm": [[k, p] for k, p in ok], "pages_to_release": release}
        if not ok and rng.random() < 0.3:
            del body["written_keys_to_confirm"]  # missing means []
        if not release and rng.random() < 0.3:
            del body["pages_to_release"]
        body = self._ns(body, space)

        def on_reply():
            st = self.stats
            st[f"confirm_write: {mode}"] += 1
            for k, p in ok:
                del pool.pending[k]
                pool.committed[k] = p
                st["confirmed"] += 1
            for p in release:
                if p not in pool.free:
                    pool.free.append(p)
                st["released"] += 1
            for k, _ in failed:
                del pool.pending[k]
            save.entries = keep
            if not keep:
                self.inflight.remove(save)

        return self._path(space, "confirm_write"), self._enc(body), (204, None), on_reply

    def _some_keys(self, space) -> list:
        """A prompt's prefix (the load path), a whole prompt (the lookup), or a mix of this
        pool's committed and pending keys, other pools' keys and unknown ones."""
        rng = self.rng
        x = rng.random()
        keys = self._keys_for(space, rng.choice(self.prompts))
        if x < 0.35:
            return keys
        if x < 0.7:
            return keys[: rng.randint(0, len(keys))]
        pool = self.pools.get(space)
        mine = list(pool.committed) + list(pool.pending) if pool else []
        others = [k for p in self.pools.values() for k in list(p.committed)[:50]]
        mix = []
        for _ in range(rng.randint(0, 60)):
            y = rng.random()
            if mine and y < 0.5:
                mix.append(rng.choice(mine))
            elif others and y < 0.8:
                mix.append(rng.choice(others))
            else:
                mix.append(rng.choice(rng.choice(self.prompts)))
        return mix  # repeats are fine for reads

    def _get(self):
        space = self._pick()
        pool = self.pools[space]
        keys = self._some_keys(space)
        want = [pool.committed.get(k) for k in keys]

        def on_reply():
            self.stats["get_page_indices"] += 1
            self.stats["get: found"] += sum(p is not None for p in want)

        body = self._ns({"keys": keys}, space)
        return self._path(space, "get_page_indices"), self._enc(body), (200, {"indices": want}), on_reply

    def _exists(self):
        space = self._pick()
        pool = self.pools[space]
        keys = self._some_keys(space)
        want = [k in pool.committed for k in keys]

        def on_reply():
            self.stats["exists"] += 1
            self.stats["exists: true"] += sum(want)

        body = self._ns({"keys": keys}, space)
        return self._path(space, "exists"), self._enc(body), (200, {"exists": want}), on_reply

    def _delete(self):
        rng = self.rng
        space = self._pick()
        pool = self.pools[space]
        committed = list(pool.committed)
        keys = rng.sample(committed, min(len(committed), rng.randint(1, rng.choice((8, 24, 96)))))
        if pool.pending and rng.random() < 0.2:
            keys.append(rng.choice(list(pool.pending)))  # not written yet: ignored by both
        if rng.random() < 0.2:
            keys.append(f"unknown-{self.serial}")
        if keys and rng.random() < 0.1:
            keys.append(keys[0])  # twice: the second finds nothing
        rng.shuffle(keys)

        def on_reply():
            st = self.stats
            st["delete_keys"] += 1
            for k in keys:
                if k in pool.committed:
                    page = pool.committed.pop(k)
                    if page not in pool.free:
                        pool.free.append(page)
                    st["deleted"] += 1

        body = self._ns({"keys": keys}, space)
        return self._path(space, "delete_keys"), self._enc(body), (204, None), on_reply

    def _clear(self):
        space = self._pick()
        _, ns = space
        body = self._ns({}, space)

        def on_reply():
            self.stats["clear"] += 1
            self.pools[space] = Pool(self.pools[space].num_pages)
            self.inflight = [s for s in self.inflight if s.space != space]

        data = self._enc(body) if body or self.rng.random() < 0.5 else b'{"namespace":"kv","x":[1]}'
        return self._path(space, "clear"), data, (204, None), on_reply

    def _uninitialized(self):
        rng = self.rng
        space = rng.choice(self.never + [s for s in self.usable if s not in self.pools])
        rank, ns = space
        op = rng.choice(("exists", "get_page_indices", "delete_keys", "clear",
                         "reserve_and_allocate_page_indices", "confirm_write"))
        keys = self._keys_for(space, rng.choice(self.prompts)[:5])
        body = {
            "exists": {"keys": keys},
            "get_page_indices": {"keys": keys},
            "delete_keys": {"keys": keys},
            "clear": {},
            "reserve_and_allocate_page_indices": {"keys": [[k, ""] for k in keys]},
            "confirm_write": {"written_keys_to_confirm": [[keys[0], 1]], "pages_to_release": [2]},
        }[op]
        body = self._ns(body, space)
        want = {"detail": NOT_INITIALIZED.format(rank=rank, ns=ns)}

        def on_reply():
            self.stats["404: not initialized"] += 1

        return self._path(space, op), self._enc(body), (404, want), on_reply

    def sweep(self):
        """Final reads of every pool: every key it holds or has pending."""
        out = []
        for space in sorted(self.pools):
            pool = self.pools[space]
            keys = sorted(set(pool.committed) | set(pool.pending))
            for op, want in (("get_page_indices", {"indices": [pool.committed.get(k) for k in keys]}),
                             ("exists", {"exists": [k in pool.committed for k in keys]})):
                body = {"keys": keys, "namespace": space[1]}
                out.append((f"/{space[0]}/{op}", self._enc(body), (op, want)))
        return out


@pytest.mark.parametrize("seed", seeds_from_env("KVPAGES_SGLANG_PARITY_SEED", DEFAULT_SEEDS), ids=lambda s: f"seed{s}")
def test_differential_random_valid_input(sglang, kv_url, seed, say):
    s = sglang.require()
    peer_url = s.fresh()
    steps = int(os.environ.get("KVPAGES_SGLANG_PARITY_STEPS", DEFAULT_STEPS))
    print(f"SGLang parity seed {seed} (KVPAGES_SGLANG_PARITY_SEED={seed} reproduces it), {steps} steps")
    gen = Generator(random.Random(seed))
    # Both servers read the body as JSON whatever the Content-Type says (or without one).
    ctype_rng = random.Random(f"content-type {seed}")
    ours, theirs = RawClient(kv_url), RawClient(peer_url)
    history = []
    compared = 0
    start = time.monotonic()

    def fail(problem, step, route, body, a, b):
        before = "\n".join(f"  step {st}: {show_request(r, x, 200)} -> {code}" for st, r, x, code in history[:-1])
        pytest.fail(
            f"{problem} at seed {seed} step {step} (reproduce: KVPAGES_SGLANG_PARITY_SEED={seed})\n"
            f"request: {show_request(route, body, 2000)}\n"
            f"kvpages: {show_reply(a, 2000)}\n"
            f"peer:    {show_reply(b, 2000)}\n"
            f"previous requests (peer status):\n{before}",
            pytrace=False,
        )

    def compare(step, route, body):
        nonlocal compared
        ctype = ctype_rng.choices(("application/json", "text/plain", None), (90, 5, 5))[0]
        a = ours.post(route, body, ctype)
        b = theirs.post(route, body, ctype)
        compared += 1
        history.append((step, route, body, b[0]))
        del history[:-12]
        if a[0] != b[0]:
            fail("parity mismatch (status differs)", step, route, body, a, b)
        if a[2] != b[2]:
            fail("parity mismatch (body bytes differ)", step, route, body, a, b)
        if a[0] in (200, 404) and a[1] != b[1]:
            fail("parity mismatch (content-type differs)", step, route, body, a, b)
        return a, b

    try:
        for step in range(steps):
            route, body, (want_status, want), on_reply = gen.next_request()
            a, b = compare(step, route, body)
            got = json.loads(b[2]) if b[2] else None
            if b[0] != want_status or got != want:
                fail(f"the generator's model of SGLang's server drifted (expected {want_status} "
                     f"{json.dumps(want)[:600]})", step, route, body, a, b)
            on_reply()
        for route, body, (op, want) in gen.sweep():
            a, b = compare(steps, route, body)
            if json.loads(b[2]) != want:
                fail("the generator's model drifted (final sweep)", steps, route, body, a, b)
    finally:
        ours.close()
        theirs.close()
    elapsed = time.monotonic() - start
    st = gen.stats
    summary = ", ".join(f"{k} {v}" for k, v in sorted(st.items()))
    print(f"seed {seed}: {compared} requests compared in {elapsed:.1f} s; pools "
          f"{sorted(gen.pools)}; {summary}")
    say(f"SGLang parity seed {seed}: {compared} identical replies in {elapsed:.1f} s "
        f"({len(gen.pools)} pools, {st['clear']} clears, {st['deleted']} deleted, "
        f"{st['reserve batch cut: pool full']} full-pool cuts, {st['released']} released pages)")
    assert compared >= 2000
    for what in ("initialize", "initialize again (same size)", "reserve: already written",
                 "reserve: new page", "confirm_write: all written", "confirm_write: some failed",
                 "confirm_write: all failed", "confirm_write: split", "released", "deleted",
                 "clear", "get: found", "exists: true", "404: not initialized", "pool exactly full"):
        assert st[what] > 0, (what, summary)
    assert elapsed < 50, f"seed {seed} took {elapsed:.1f} s: reservations could expire (TTL 60 s)"
