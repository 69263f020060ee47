"""kvpages beside vLLM's REAL metadata server and client (vLLM 0.33.0, fetched at test time).

`peer.py` downloads the vLLM wheel into `target/peers/` (once), extracts
`hf3fs_metadata_server.py` and runs it on a free port next to the session's kvpages.

- `test_vllm_client_connector_cycle`: vLLM's own `Hf3fsGlobalMetadataClient`, unchanged, runs the
  connector's cycle (start-up, a 1,250-key lookup, saves of <= 128 keys, loads, a write failure,
  cache hits, a full pool) against kvpages and against the peer: every return value is checked
  exactly, and the two transcripts must be identical.
- `test_differential_random_valid_input`: a seeded generator sends the same raw requests (compact
  JSON) to both servers and requires identical status codes and identical body bytes. It obeys
  the notes' definition of valid input (docs/protocol.md, "Parity") plus two cases
  where kvpages deliberately differs: two writers of one key on one rank with pending
  reservations, and re-allocating a key on a rank that committed it while the key is incomplete.
  Seeds: `KVPAGES_PARITY_SEED=N` or `=N,M,...` (default 1, 2, 3, 4); steps per seed:
  `KVPAGES_PARITY_STEPS` (default 3,000; keep a seed's run well under kvpages' 60 s reservation
  TTL, after which abandoned reservations come back in kvpages but stay leaked in the peer).
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

import peer as peer_mod
from conftest import metric, record_retries
from peer import seeds_from_env, show_reply, show_request

TP = 2
MAX_SAVE_BATCH = 128
DEFAULT_SEEDS = (1, 2, 3, 4)
DEFAULT_STEPS = 3000


# --------------------------------------------------------------------------------------------
# Fixtures: the peer (download, extract, run) and vLLM's client class
# --------------------------------------------------------------------------------------------


class _Peer:
    """What the module-scoped fixture got. Tests call `require()` first: an unavailable peer
    (download failed, say) is then a test FAILURE with the reason, not a skip or a setup error."""

    def __init__(self):
        self.error = None
        self.server = None
        self.module = None

    def require(self):
        """The running peer, cleared (POST /clear); fails the calling test if it is unavailable."""
        if self.error is not None:
            pytest.fail(f"vLLM's metadata server (the peer) is unavailable: {self.error}", pytrace=False)
        r = requests.post(f"{self.url}/clear", timeout=5)
        assert r.status_code == 204 and r.content == b"", (r.status_code, r.text)
        return self

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture(scope="module")
def peer_env(say):
    p = _Peer()
    try:
        script = peer_mod.peer_source(say)
        peer_mod.ensure_peer_deps(say)
        p.module = peer_mod.load_peer_module(script)
        p.server = peer_mod.PeerServer(script)
        p.server.start()
    except peer_mod.PeerError as e:
        p.error = str(e)
    except Exception as e:  # an import error in the extracted file, say
        p.error = f"{type(e).__name__}: {e}"
    try:
        yield p
    finally:
        if p.server is not None:
            p.server.close()


@pytest.fixture
def peer(peer_env):
    """The peer; call `.require()` in the test body."""
    return peer_env


@pytest.fixture
def kv_url(base_url):
    """The session's kvpages, cleared; parity holds only while nothing is evicted, so a server
    whose /stats reports an eviction policy other than "off" fails the test (conftest starts it
    with `--eviction off`; binaries older than that flag have no /stats and never evict)."""
    r = requests.get(f"{base_url}/stats", timeout=5)
    if r.status_code == 200:
        eviction = r.json().get("settings", {}).get("eviction", "off")
        if eviction != "off":
            pytest.fail(
                f"kvpages at {base_url} runs with eviction {eviction!r}: a full pool then evicts "
                "instead of answering -1 like vLLM's server; start it with --eviction off",
                pytrace=False,
            )
    return base_url


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def md5_chain(n: int, seed: str) -> list:
    """`n` chained MD5 hashes of 16-token blocks (32 lowercase hex chars), like the connector's."""
    out, prev = [], ""
    for i in range(n):
        tokens = ",".join(str((i * 16 + t) * 7919 % 50257) for t in range(16))
        prev = hashlib.md5(f"{seed}|{prev}|{tokens}".encode()).hexdigest()
        out.append(prev)
    assert len(set(out)) == n
    return out


def strict_equal(a, b) -> bool:
    """JSON values equal with their types (`True` is not `1`, `1` is not `1.0`)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(strict_equal(a[k], b[k]) for k in a)
    return a == b


# --------------------------------------------------------------------------------------------
# Test A: vLLM's own client, unchanged, against kvpages and against the peer
# --------------------------------------------------------------------------------------------


def connector_cycle(client_cls, url: str) -> list:
    """The connector's cycle through vLLM's client; asserts every result, returns the transcript."""
    c = client_cls(base_url=url)
    transcript = []

    def call(name, *args, **kwargs):
        result = getattr(c, name)(*args, **kwargs)
        transcript.append((name, args, kwargs, result))
        return result

    def save(rank, hashes, want_pages):
        assert len(hashes) <= MAX_SAVE_BATCH
        results = call("allocate_pages_for_keys", rank, [(h, "") for h in hashes])
        assert results == [[h, p] for h, p in zip(hashes, want_pages)], (rank, results[:4])
        pages = [p for _, p in results]
        assert call("confirm_write_for_keys", rank, list(zip(hashes, pages)), []) is None
        return pages

    num_pages = 1024
    prompt = md5_chain(1250, "parity prompt")  # a 20K-token prompt at block size 16

    # Start-up: the scheduler, then every worker of a TP=2 deployment.
    assert call("initialize", 0, role="scheduler") is None
    for rank in range(TP):
        assert call("initialize", rank, num_pages) is None

    # Lookup: nothing cached yet.
    assert call("batch_key_exists", prompt) == [False] * 1250

    # Five saves of 128 keys on each rank, interleaved; a chunk is visible once both confirmed.
    for i in range(5):
        chunk = prompt[128 * i : 128 * (i + 1)]
        want = list(range(128 * i, 128 * (i + 1)))
        save(0, chunk, want)
        assert call("batch_key_exists", chunk) == [False] * 128
        assert call("get_key_locations", 0, chunk) == [None] * 128
        save(1, chunk, want)
        assert call("batch_key_exists", chunk) == [True] * 128
    assert call("batch_key_exists", prompt) == [True] * 640 + [False] * 610
    for rank in range(TP):
        assert call("get_key_locations", rank, prompt[:700]) == list(range(640)) + [None] * 60

    # Write failure on rank 0 (rank 1 saved the chunk): release the pages, confirm nothing.
    chunk5 = prompt[640:768]
    save(1, chunk5, range(640, 768))
    failed = call("allocate_pages_for_keys", 0, [(h, "") for h in chunk5])
    assert failed == [[h, p] for h, p in zip(chunk5, range(640, 768))]
    assert call("confirm_write_for_keys", 0, [], [p for _, p in failed]) is None
    assert call("batch_key_exists", chunk5) == [False] * 128
    assert call("get_key_locations", 1, chunk5) == [None] * 128
    # Released pages went to the tail: rank 0's retry gets 768..895.
    save(0, chunk5, range(768, 896))
    assert call("batch_key_exists", prompt[:768]) == [True] * 768
    assert call("get_key_locations", 0, chunk5) == list(range(768, 896))
    assert call("get_key_locations", 1, chunk5) == list(range(640, 768))

    # Re-saving cached blocks: cache hits keep their pages; confirming them again is a no-op.
    # (Rank 1 takes 768..895 for the batch and returns them to the tail: 896..1023, 768..895.)
    save(1, prompt[:128], range(128))
    # A mixed batch, 64 hits + 64 new keys: the batch takes 128 pages from the head, the hits'
    # pages go back to the tail, the new keys keep theirs by position.
    mixed = prompt[704:832]
    save(1, mixed, list(range(704, 768)) + list(range(960, 1024)))  # rank 1 free: 768..959
    save(0, mixed, list(range(832, 896)) + list(range(960, 1024)))  # rank 0 free: 640..767, 896..959
    assert call("batch_key_exists", prompt) == [True] * 832 + [False] * 418

    # Fill rank 0: 128 new keys take 640..767, leaving 896..959 (64 pages).
    chunk = prompt[832:960]
    save(0, chunk, range(640, 768))
    # 128 new keys, 64 free pages: all-or-nothing, every key gets -1 (the connector gives up).
    full = call("allocate_pages_for_keys", 0, [(h, "") for h in prompt[960:1088]])
    assert full == [[h, -1] for h in prompt[960:1088]]
    save(1, chunk, range(768, 896))
    assert call("batch_key_exists", prompt) == [True] * 960 + [False] * 290
    # 60 hits + 40 new keys on rank 0 need 100 pages, 64 are free: hits keep their pages, new get -1.
    res = call("allocate_pages_for_keys", 0, [(h, "") for h in prompt[900:1000]])
    assert res == [[h, 708 + i] for i, h in enumerate(prompt[900:960])] + [
        [h, -1] for h in prompt[960:1000]
    ]

    # Load on each rank: the page map of the whole prompt.
    rank0 = list(range(640)) + list(range(768, 896)) + list(range(960, 1024)) + list(range(640, 768))
    rank1 = list(range(768)) + list(range(960, 1024)) + list(range(768, 896))
    assert call("get_key_locations", 0, prompt) == rank0 + [None] * 290
    assert call("get_key_locations", 1, prompt) == rank1 + [None] * 290

    # A decode step: one key per rank, from the head of each free list (896 on both).
    for rank in range(TP):
        save(rank, [prompt[960]], [896])
    exists = call("batch_key_exists", prompt)
    assert exists == [True] * 961 + [False] * 289
    assert call("batch_key_exists", []) == []
    assert call("get_key_locations", 1, [prompt[960], "0" * 32]) == [896, None]
    c._session.close()
    return transcript


def test_vllm_client_connector_cycle(peer, kv_url, say):
    peer = peer.require()
    client_cls = peer.module.Hf3fsGlobalMetadataClient
    start = time.monotonic()
    runs = {}
    for name, url in (("kvpages", kv_url), ("the peer", peer.url)):
        try:
            runs[name] = connector_cycle(client_cls, url)
        except AssertionError as e:
            pytest.fail(f"vLLM's client against {name} ({url}): unexpected result\n{e}", pytrace=False)
    ours, theirs = runs["kvpages"], runs["the peer"]
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a[:3] == b[:3]
        if not strict_equal(a[3], b[3]):
            pytest.fail(
                f"call {i} {a[0]}{a[1][:1]}: kvpages returned {a[3]!r:.300} but the peer {b[3]!r:.300}",
                pytrace=False,
            )
    say(f"vLLM client cycle: {len(ours)} identical calls on kvpages and the peer "
        f"({time.monotonic() - start:.1f} s)")


def test_vllm_client_retry_policy_is_the_one_metadata_client_has(peer):
    """vLLM's own client and test_vllm_client.py's `MetadataClient` (its re-implementation, which
    drives most of that file's tests) make the same requests for the same statuses: a 5xx is
    retried up to 3 times, POST included; a 4xx is not retried."""
    from stub import StubServer
    from test_vllm_client import MetadataClient

    vllm_client = peer.require().module.Hf3fsGlobalMetadataClient
    cases = (([503, 503, 200], 3), ([500, 200], 2), ([502], 4), ([404], 1), ([400], 1))
    for statuses, requests_made in cases:
        for name, make, error in (
            ("vLLM's client", vllm_client, RuntimeError),
            ("MetadataClient", MetadataClient, requests.exceptions.RequestException),
        ):
            with StubServer(statuses) as stub:
                c = make(stub.url)
                try:
                    if statuses[-1] == 200:
                        assert c.batch_key_exists([]) == [], (name, statuses)
                    else:
                        with pytest.raises(error):
                            c.batch_key_exists([])
                finally:
                    c._session.close()
                assert stub.count == requests_made, (name, statuses, stub.count)


# --------------------------------------------------------------------------------------------
# Test B: differential on random valid input
# --------------------------------------------------------------------------------------------


class RawClient:
    """One keep-alive HTTP/1.1 connection; sends raw bytes, returns (status, content-type, body)."""

    def __init__(self, url: str):
        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)

    def post(self, path: str, body: bytes):
        self.conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = self.conn.getresponse()
        data = r.read()
        return r.status, r.getheader("content-type"), data

    def close(self):
        self.conn.close()


def compact(obj, ascii_only: bool = False) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=ascii_only).encode()


@dataclass
class Save:
    """A save in flight on one rank: entries (key, page, hit) not yet confirmed or released."""

    rank: int
    entries: list = field(default_factory=list)


class Generator:
    """Random requests that are valid input (see the module docstring), and a model of the state
    just detailed enough to keep them valid. Replies update the model (the peer's: both must be
    identical anyway)."""

    # Key styles: vLLM's (lowercase MD5 hex) mostly; keys need not be hex, and kvpages stores
    # lowercase 32-hex keys in a packed form, so also other cases and texts (the twin style is
    # the upper-case text of keys that exist in lower case), JSON escapes, and long keys.
    STYLES = ("md5",) * 24 + ("upper", "twin", "text", "unicode", "escapes", "long")

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.prompts = []
        self.serial = 0
        self.stats = Counter()
        self.epoch = -1
        self._new_long_prompt()
        for _ in range(6):
            self._new_prompt()
        self._new_epoch()

    # ---- keys ------------------------------------------------------------------------------

    def _block_key(self, style: str, parent: str, n: int) -> str:
        h = hashlib.md5(f"{parent}|{n}|{self.serial}".encode()).hexdigest()
        self.serial += 1
        if style == "upper":
            return h.upper()
        if style == "text":
            return f"req-{n}/blk-{h[:8]}"
        if style == "unicode":
            return f"блок-{h[:6]}-ключ✓😀"
        if style == "escapes":
            return f'q"{h[:4]}\\/\n\t\r\b\f\x00\x01\x1f\x7f\u2028\ufeff {h[4:8]}'
        if style == "long":  # up to the documented 1,024-byte limit, multi-byte characters included
            text = f"{h}/" + "é" * 400 + h * 8
            return text.encode()[: 1024 - len(h)].decode(errors="ignore") + h
        return h

    def _new_long_prompt(self):
        self.prompts.append(md5_chain(1250, f"long prompt {self.rng.random()}"))

    def _new_prompt(self):
        rng = self.rng
        style = rng.choice(self.STYLES)
        if style == "twin":
            base = rng.choice(self.prompts)
            keys = [k.upper() for k in base[: rng.randint(1, min(len(base), 200))]]
            keys = [k for k in keys if k not in base]
            if keys:
                self.stats["prompts: twin"] += 1
                self.prompts.append(keys)
                return keys
            style = "md5"
        if self.prompts and rng.random() < 0.6:  # shares a prefix with an earlier prompt
            base = rng.choice(self.prompts)
            keys = list(base[: rng.randint(1, min(len(base), 200))])
        else:
            keys = []
        for _ in range(rng.choice((1, 4, 16, 40, 100, 160, 300))):
            keys.append(self._block_key(style, keys[-1] if keys else "", len(keys)))
        self.stats[f"prompts: {style}"] += 1
        self.prompts.append(keys)
        if len(self.prompts) > 60:
            self.prompts.pop(1)  # keep the long one
        return keys

    def _prompt(self):
        rng = self.rng
        if rng.random() < 0.08:
            return self._new_prompt()
        if rng.random() < 0.05:
            return self.prompts[0]
        return rng.choice(self.prompts)

    # ---- state -----------------------------------------------------------------------------

    def _new_epoch(self):
        rng = self.rng
        self.epoch += 1
        self.tp = rng.choice((1, 2, 2, 2, 4, 4, 3, 8))
        # vLLM's ranks are 0..TP-1; valid input only needs every rank up before the first confirm.
        self.ranks = list(range(self.tp))
        if rng.random() < 0.1:
            self.ranks = sorted(rng.sample(range(16), self.tp))
        if rng.random() < 0.1:
            sizes = [rng.choice((4096, 100_000))] * self.tp
        else:
            size = rng.choice((64, 96, 128, 200, 256, 512, 1024))
            sizes = [size] * self.tp
            if rng.random() < 0.2:  # ranks with different file layouts: valid, if unusual
                sizes = [rng.choice((64, 128, 256, 512)) for _ in range(self.tp)]
        self.sizes = dict(zip(self.ranks, sizes))
        self.inited = {}  # rank -> num_pages, as initialized since the last /clear
        self.committed = {}  # key -> {rank: page}
        self.pending = {}  # (rank, key) -> page reserved (abandoned reservations stay)
        self.inflight = []  # Save, in flight
        self.recent = []  # the keys of the last allocations
        self.last_clear_step = self.step if hasattr(self, "step") else 0

    def _enc(self, body) -> bytes:
        """Compact JSON; sometimes with non-ASCII characters as \\u escapes (same bytes to both)."""
        return compact(body, ascii_only=self.rng.random() < 0.15)

    def complete(self, key) -> bool:
        return len(self.committed.get(key, ())) == self.tp

    def all_ranks_up(self) -> bool:
        return len(self.inited) == self.tp

    # ---- requests --------------------------------------------------------------------------

    def next_request(self, step: int):
        """Returns (route, body bytes, on_reply) for step `step`."""
        self.step = step
        rng = self.rng
        up = self.all_ranks_up()
        choices = []
        if not up:
            choices.append((40, self._init_new))
        if self.inited:
            choices += [(28, self._allocate), (12, self._locations), (2, self._init_again)]
        if up and self.inflight:
            choices.append((30, self._confirm))
        choices += [(12, self._exists), (2, self._scheduler)]
        if step - self.last_clear_step > 100:
            choices.append((1.2, self._clear))
        total = sum(w for w, _ in choices)
        x = rng.random() * total
        for w, f in choices:
            x -= w
            if x < 0:
                return f()
        return choices[-1][1]()

    def _init_new(self):
        rank = self.rng.choice([r for r in self.ranks if r not in self.inited])
        n = self.sizes[rank]
        body = {"num_pages": n} if self.rng.random() < 0.3 else {"num_pages": n, "role": "worker"}

        def on_reply(status, reply):
            self.inited[rank] = n
            self.stats["initialize"] += 1

        return f"/rank/{rank}/initialize", self._enc(body), on_reply

    def _init_again(self):
        rank = self.rng.choice(sorted(self.inited))
        n = self.inited[rank]  # a restarted worker: the same size
        body = {"role": "worker", "num_pages": n} if self.rng.random() < 0.5 else {"num_pages": n}

        def on_reply(status, reply):
            self.stats["initialize again"] += 1

        return f"/rank/{rank}/initialize", self._enc(body), on_reply

    def _scheduler(self):
        rank = 0 if self.rng.random() < 0.8 else self.rng.randrange(8)
        body = {"num_pages": 0, "role": "scheduler"}
        if self.rng.random() < 0.2:
            body = {"role": "scheduler"}

        def on_reply(status, reply):
            self.stats["initialize scheduler"] += 1

        return f"/rank/{rank}/initialize", self._enc(body), on_reply

    def _clear(self):
        body = self.rng.choice((b"", b"{}"))

        def on_reply(status, reply):
            self.stats["clear"] += 1
            self._new_epoch()

        return "/clear", body, on_reply

    def _allocate(self):
        rng = self.rng
        rank = rng.choice(sorted(self.inited))
        keys = self._prompt()
        if rng.random() < 0.25:
            n = 1  # a decode step
        else:
            n = rng.randint(1, MAX_SAVE_BATCH)
        x = rng.random()
        start = rng.randrange(len(keys))
        if x < 0.3 and self.recent:
            # What another TP rank saved recently: the same blocks on this rank.
            keys = rng.choice(self.recent)
            start, n = 0, len(keys)
        elif x < 0.55:
            # The next blocks this rank has not stored: the usual save.
            firsts = [i for i, k in enumerate(keys) if rank not in self.committed.get(k, {})]
            if firsts:
                start = firsts[0] if rng.random() < 0.7 else rng.choice(firsts)
        elif x < 0.7:
            start = 0  # the whole prompt again: cache hits first, then new blocks
        chunk = []
        for i, k in enumerate(keys[start : start + n], start):
            if (rank, k) in self.pending:
                continue  # a second writer of a key with a pending reservation: kvpages differs
            if rank in self.committed.get(k, {}) and not self.complete(k):
                continue  # re-allocating a key this rank committed, still incomplete: differs
            prefix = keys[i - 1] if i > 0 and rng.random() < 0.1 else ""
            chunk.append((k, prefix))
        if rng.random() < 0.05 and chunk:
            rng.shuffle(chunk)
        body = {"rank": rank, "keys": [list(p) for p in chunk]}
        if not chunk and rng.random() < 0.5:
            body = {"rank": rank}  # a missing `keys` means []
        elif rng.random() < 0.03:
            body["request_id"] = f"r{self.step}"  # unknown members are ignored by both

        def on_reply(status, reply):
            if status != 200:
                return
            results = reply["results"]
            st = self.stats
            st["batch_allocate"] += 1
            save = Save(rank)
            minus = False
            for (k, _), (rk, page) in zip(chunk, results):
                assert rk == k, (rk, k)
                if not (len(k) == 32 and k == k.lower() and all(c in "0123456789abcdef" for c in k)):
                    st["allocate: key not lowercase 32-hex"] += 1
                if self.complete(k) and rank in self.committed[k]:
                    assert page == self.committed[k][rank], ("model: hit page", k, page)
                    save.entries.append((k, page, True))
                    st["allocate: cache hit"] += 1
                elif page == -1:
                    minus = True
                    st["allocate: -1"] += 1
                else:
                    self.pending[(rank, k)] = page
                    save.entries.append((k, page, False))
                    st["allocate: new page"] += 1
            kinds = {hit for _, _, hit in save.entries}
            if kinds == {True, False}:
                st["allocate: batch of hits and new pages"] += 1
            if minus:
                st["allocate: batch refused (-1)"] += 1
                # The connector gives up on the save (no release); nothing was reserved.
                assert not any(not hit for _, _, hit in save.entries)
            elif save.entries:
                self.inflight.append(save)
            if chunk:
                self.recent.append([k for k, _ in chunk])
                del self.recent[:-8]

        return "/keys/batch_allocate", self._enc(body), on_reply

    def _confirm(self):
        rng = self.rng
        save = rng.choice(self.inflight)
        rank = save.rank
        entries = list(save.entries)
        mode = rng.choices(("success", "failure", "partial", "abandon"), (55, 18, 22, 5))[0]
        if mode == "abandon":
            # A crashed writer: its reservations stay pending (leaked in the peer, held until the
            # TTL in kvpages). Send the next request instead: a lookup.
            self.inflight.remove(save)
            self.stats["save abandoned"] += 1
            return self._exists()
        if mode == "success":
            confirm, release, keep = entries, [], []
        elif mode == "failure":
            confirm = []
            release = [e for e in entries if not e[2]]  # never the pages of cache hits
            keep = []
        else:
            rng.shuffle(entries)
            a = rng.randint(0, len(entries))
            confirm = entries[:a]
            rest = entries[a:]
            b = rng.randint(0, len(rest))
            release = [e for e in rest[:b] if not e[2]]
            keep = [e for e in rest[:b] if e[2]] + rest[b:]
            confirm.sort(key=lambda e: save.entries.index(e))
        body = {
            "rank": rank,
            "confirmations": [[k, p] for k, p, _ in confirm],
            "pages_to_release": [p for _, p, _ in release],
        }
        if not confirm and rng.random() < 0.2:
            del body["confirmations"]  # missing means []
        if not release and rng.random() < 0.2:
            del body["pages_to_release"]
        if rng.random() < 0.1:
            rng.shuffle(body.get("pages_to_release", []))

        def on_reply(status, reply):
            if status != 204:
                return
            st = self.stats
            st[f"confirm_write: {mode}"] += 1
            for k, p, hit in confirm:
                st["confirmed: cache hit (no-op)" if hit else "confirmed: new page"] += 1
                if not hit:
                    del self.pending[(rank, k)]
                    self.committed.setdefault(k, {})[rank] = p
            for k, p, _ in release:
                st["released"] += 1
                del self.pending[(rank, k)]
            save.entries = keep
            if not keep:
                self.inflight.remove(save)

        return "/keys/confirm_write", self._enc(body), on_reply

    def _some_keys(self):
        """A prompt's prefix (the load path), a whole prompt (the lookup), or a mix."""
        rng = self.rng
        x = rng.random()
        keys = self._prompt()
        if x < 0.4:
            return keys
        if x < 0.8:
            return keys[: rng.randint(0, len(keys))]
        mix = set()
        pool = list(self.committed) + [k for _, k in self.pending]
        for _ in range(rng.randint(0, 60)):
            if pool and rng.random() < 0.6:
                mix.add(rng.choice(pool))
            else:
                mix.add(rng.choice(rng.choice(self.prompts)))
        mix = sorted(mix)
        rng.shuffle(mix)
        return mix

    def _exists(self):
        keys = self._some_keys()
        body = {"keys": keys}
        if not keys and self.rng.random() < 0.3:
            body = {}

        def on_reply(status, reply):
            self.stats["batch_exists"] += 1
            self.stats["exists: true"] += sum(1 for e in reply["exists"] if e is True)

        return "/keys/batch_exists", self._enc(body), on_reply

    def _locations(self):
        rank = self.rng.choice(sorted(self.inited))
        keys = self._some_keys()
        body = {"rank": rank, "keys": keys}

        def on_reply(status, reply):
            self.stats["get_locations"] += 1
            self.stats["locations: found"] += sum(1 for p in reply["locations"] if p is not None)

        return "/keys/get_locations", self._enc(body), on_reply

    def sweep(self):
        """Final read of everything the run touched: exists, and locations on every rank."""
        keys = sorted(set(self.committed) | {k for _, k in self.pending})
        out = [("/keys/batch_exists", compact({"keys": keys}))]
        for rank in sorted(self.inited):
            out.append(("/keys/get_locations", compact({"rank": rank, "keys": keys})))
        return out


@pytest.mark.parametrize("seed", seeds_from_env("KVPAGES_PARITY_SEED", DEFAULT_SEEDS), ids=lambda s: f"seed{s}")
def test_differential_random_valid_input(peer, kv_url, seed, say):
    peer = peer.require()
    steps = int(os.environ.get("KVPAGES_PARITY_STEPS", DEFAULT_STEPS))
    print(f"parity seed {seed} (KVPAGES_PARITY_SEED={seed} reproduces it), {steps} steps")
    rng = random.Random(seed)
    gen = Generator(rng)
    ours, theirs = RawClient(kv_url), RawClient(peer.url)
    history = []
    compared = 0
    start = time.monotonic()

    def compare(step, route, body):
        nonlocal compared
        a = ours.post(route, body)
        b = theirs.post(route, body)
        compared += 1
        history.append((step, route, body, b[0]))
        del history[:-12]
        problem = None
        if a[0] != b[0]:
            problem = "status differs"
        elif a[2] != b[2]:
            problem = "body bytes differ"
        elif a[0] == 200:
            if a[1] != b[1]:
                problem = "content-type differs"
            elif not strict_equal(json.loads(a[2]), json.loads(b[2])):
                problem = "JSON differs"
        elif a[0] == 204 and (a[2] or b[2]):
            problem = "204 with a body"
        elif a[0] not in (200, 204):
            problem = f"both answered {a[0]} to valid input"
        if problem:
            before = "\n".join(f"  step {s}: {show_request(r, x, 160)} -> {st}" for s, r, x, st in history[:-1])
            pytest.fail(
                f"parity mismatch ({problem}) at seed {seed} step {step} "
                f"(reproduce: KVPAGES_PARITY_SEED={seed})\n"
                f"request: {show_request(route, body, 2000)}\n"
                f"kvpages: {show_reply(a, 2000)}\n"
                f"peer:    {show_reply(b, 2000)}\n"
                f"previous requests (peer status):\n{before}",
                pytrace=False,
            )
        return b

    try:
        # Both start empty (the fixtures cleared them); the first epoch begins now.
        for step in range(steps):
            route, body, on_reply = gen.next_request(step)
            status, _, data = compare(step, route, body)
            on_reply(status, json.loads(data) if status == 200 else None)
        for route, body in gen.sweep():
            compare(steps, route, body)
    finally:
        ours.close()
        theirs.close()
    elapsed = time.monotonic() - start
    st = gen.stats
    summary = ", ".join(f"{k} {v}" for k, v in sorted(st.items()))
    print(f"seed {seed}: {compared} requests compared in {elapsed:.1f} s; {summary}")
    say(f"parity seed {seed}: {compared} identical replies in {elapsed:.1f} s "
        f"({st['clear']} clears, {st['allocate: batch refused (-1)']} full-pool refusals, "
        f"{st['allocate: cache hit']} cache hits, {st['released']} released pages)")
    # The run must have exercised what it is meant to.
    assert compared >= 2000
    for what in ("clear", "allocate: batch refused (-1)", "allocate: cache hit", "released",
                 "confirm_write: partial", "confirm_write: failure", "exists: true",
                 "locations: found", "initialize again", "initialize scheduler",
                 "allocate: batch of hits and new pages", "confirmed: cache hit (no-op)"):
        assert st[what] > 0, (what, summary)
    assert elapsed < 55, f"seed {seed} took {elapsed:.1f} s: reservations could expire (TTL 60 s)"


# --------------------------------------------------------------------------------------------
# Idle connections closed by the server
# --------------------------------------------------------------------------------------------


def test_vllm_client_reconnects_without_an_error_after_an_idle_close(peer, kvpages_server):
    """A short `--idle-timeout` closes vLLM's pooled connection between saves; vLLM's own client
    (requests + urllib3's pool) notices before reusing it, so every call succeeds at the first
    try: no error, no retry."""
    url = kvpages_server("--idle-timeout", "0.5")
    c = peer.require().module.Hf3fsGlobalMetadataClient(url)
    histories = record_retries(c)
    try:
        for rank in range(TP):
            c.initialize(rank, 64)
        for round_ in range(3):
            hashes = md5_chain(4, f"idle {round_}")
            for rank in range(TP):
                results = c.allocate_pages_for_keys(rank, [(h, "") for h in hashes])
                assert [h for h, _ in results] == hashes and all(p >= 0 for _, p in results), results
                c.confirm_write_for_keys(rank, results, [])
            assert c.batch_key_exists(hashes) == [True] * 4
            time.sleep(1.2)  # past the idle timeout: the server closes the pooled connection
    finally:
        c._session.close()
    assert len(histories) == 2 + 3 * 5 and all(h == () for h in histories), histories
    assert metric(url, 'kvpages_connections_closed_total{reason="idle"}') >= 3
