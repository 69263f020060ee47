"""kvpages driven exactly as vLLM's HF3FS connector drives its metadata server.

`MetadataClient` re-implements the behaviour of vLLM's `Hf3fsGlobalMetadataClient` from its
description: same routes, same JSON, same `requests` retry policy (3 retries on 500/502/503/504 with
backoff 0.3 s, POST included; a 4xx raises at once). The tests then run the connector's cycle —
scheduler/worker start-up, lookup, save, load, write failure, cache hits, a full pool — and check
every status, body and page number.
"""

import hashlib
import json
import time

import pytest
import requests
from requests.adapters import HTTPAdapter
from stub import StubServer
from urllib3.util.retry import Retry

TP = 2
BLOCK_TOKENS = 16
MAX_SAVE_BATCH = 128  # the connector allocates at most 128 keys per save


# --------------------------------------------------------------------------------------------
# The client, as vLLM's connector has it
# --------------------------------------------------------------------------------------------


class MetadataClient:
    """HTTP client with the behaviour of vLLM's `Hf3fsGlobalMetadataClient`."""

    def __init__(self, server_url: str):
        self.base_url = server_url.rstrip("/")
        self._session = requests.Session()
        retry = Retry(
            total=3,
            backoff_factor=0.3,
            status_forcelist=[500, 502, 503, 504],
            allowed_methods=["GET", "POST"],
        )
        self._session.mount("http://", HTTPAdapter(max_retries=retry))
        self.last_response = None  # kept so tests can inspect urllib3's retry history

    def close(self):
        self._session.close()

    def _post(self, endpoint: str, json_data: dict) -> dict:
        body = json.dumps(json_data).encode()
        self.last_response = None
        response = self._session.post(
            f"{self.base_url}/{endpoint}",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        self.last_response = response
        response.raise_for_status()
        if response.status_code == 204 or not response.content:
            return {}
        return response.json()

    def initialize(self, rank: int, num_pages: int = 0, role: str = "worker") -> dict:
        return self._post(f"rank/{rank}/initialize", {"num_pages": num_pages, "role": role})

    def allocate_pages_for_keys(self, rank: int, keys):
        response = self._post("keys/batch_allocate", {"rank": rank, "keys": list(keys)})
        return response["results"]

    def confirm_write_for_keys(self, rank: int, key_confirmations, pages_to_release):
        payload = {
            "rank": rank,
            "confirmations": list(key_confirmations),
            "pages_to_release": list(pages_to_release or []),
        }
        return self._post("keys/confirm_write", payload)

    def batch_key_exists(self, keys):
        return self._post("keys/batch_exists", {"keys": list(keys)})["exists"]

    def get_key_locations(self, rank: int, keys):
        return self._post("keys/get_locations", {"rank": rank, "keys": list(keys)})["locations"]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def block_hashes(n: int, seed: str = "prompt") -> list:
    """`n` chained MD5 hashes (32 lowercase hex chars) of 16-token blocks, like the connector's."""
    out, prev = [], ""
    for i in range(n):
        tokens = ",".join(str((i * BLOCK_TOKENS + t) * 7919 % 50257) for t in range(BLOCK_TOKENS))
        prev = hashlib.md5(f"{seed}|{prev}|{tokens}".encode()).hexdigest()
        out.append(prev)
    assert len(set(out)) == n
    assert all(len(h) == 32 and h == h.lower() and int(h, 16) >= 0 for h in out)
    return out


def leading_trues(flags) -> int:
    """How many blocks the scheduler would count as cached (leading `True`s)."""
    n = 0
    for f in flags:
        if f is not True:
            break
        n += 1
    return n


def health(base_url: str) -> dict:
    r = requests.get(f"{base_url}/health", timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    return r.json()


def rank_counts(base_url: str) -> dict:
    """{rank: (num_pages, free, reserved, committed)} from /health."""
    return {
        r["rank"]: (r["num_pages"], r["free"], r["reserved"], r["committed"])
        for r in health(base_url)["ranks"]
    }


def save(client: MetadataClient, rank: int, hashes: list) -> list:
    """One worker's save as the connector does it; returns the pages (asserting none is -1)."""
    assert len(hashes) <= MAX_SAVE_BATCH
    results = client.allocate_pages_for_keys(rank, [(h, "") for h in hashes])
    assert [k for k, _ in results] == hashes
    pages = [p for _, p in results]
    assert all(isinstance(p, int) and p >= 0 for p in pages), pages
    assert client.confirm_write_for_keys(rank, zip(hashes, pages), []) == {}
    assert client.last_response.status_code == 204 and client.last_response.content == b""
    return pages


def start_up(client: MetadataClient, num_pages: int, tp: int = TP):
    """Scheduler and worker initialize calls of a fresh deployment."""
    assert client.initialize(0, role="scheduler") == {
        "message": "Scheduler role does not require initialization"
    }
    for rank in range(tp):
        assert client.initialize(rank, num_pages) == {
            "message": f"Rank {rank} initialized with {num_pages} pages"
        }


@pytest.fixture
def client(base_url):
    c = MetadataClient(base_url)
    yield c
    c.close()


# --------------------------------------------------------------------------------------------
# The client's retry policy itself (against a stub, so the counts are exact)
# --------------------------------------------------------------------------------------------


def test_client_retry_policy_matches_vllm():
    """503s are retried (POST included) and visible in urllib3's history; a 4xx is not retried.
    (That vLLM's own client does the same is checked in test_peer_parity.py.)"""
    with StubServer([503, 503, 200]) as stub:
        c = MetadataClient(stub.url)
        assert c.batch_key_exists([]) == []
        assert stub.count == 3
        assert len(c.last_response.raw.retries.history) == 2
        c.close()
    with StubServer([503]) as stub:
        c = MetadataClient(stub.url)
        with pytest.raises(requests.exceptions.RetryError):
            c.batch_key_exists([])
        assert stub.count == 4  # 1 + total=3 retries
        c.close()
    with StubServer([404]) as stub:
        c = MetadataClient(stub.url)
        with pytest.raises(requests.HTTPError) as err:
            c.batch_key_exists([])
        assert stub.count == 1
        assert err.value.response.status_code == 404
        assert err.value.response.raw.retries.history == ()
        c.close()


# --------------------------------------------------------------------------------------------
# The connector's cycle against kvpages
# --------------------------------------------------------------------------------------------


def test_full_connector_cycle(client, base_url):
    num_pages = 1024
    start_up(client, num_pages)
    h = health(base_url)
    assert h["world_size"] == TP and h["keys"] == 0
    assert rank_counts(base_url) == {r: (num_pages, num_pages, 0, 0) for r in range(TP)}

    # Lookup of a 20K-token prompt: ~1,250 keys in one request, nothing cached yet.
    prompt = block_hashes(1250)
    exists = client.batch_key_exists(prompt)
    assert exists == [False] * 1250
    assert leading_trues(exists) == 0

    # Save the first chunk on each rank: fresh FIFO pool → pages 0..127 on both.
    chunk = prompt[:MAX_SAVE_BATCH]
    pages0 = save(client, 0, chunk)
    assert pages0 == list(range(MAX_SAVE_BATCH))
    # Confirmed on rank 0 only: not complete in a TP=2 world, so not yet visible.
    assert client.batch_key_exists(chunk) == [False] * MAX_SAVE_BATCH
    assert client.get_key_locations(0, chunk) == [None] * MAX_SAVE_BATCH
    pages1 = save(client, 1, chunk)
    assert pages1 == list(range(MAX_SAVE_BATCH))
    assert rank_counts(base_url) == {
        r: (num_pages, num_pages - 128, 0, 128) for r in range(TP)
    }
    assert health(base_url)["keys"] == 128

    # Lookup again: exactly the saved prefix is cached.
    exists = client.batch_key_exists(prompt)
    assert exists == [True] * 128 + [False] * (1250 - 128)
    assert leading_trues(exists) == 128

    # Load on each rank: the same pages the save got, null past the cached prefix.
    for rank, pages in ((0, pages0), (1, pages1)):
        assert client.get_key_locations(rank, chunk) == pages
        assert client.get_key_locations(rank, prompt[:200]) == pages + [None] * 72

    # Next chunk and a decode step (1 key) continue the FIFO order.
    chunk2 = prompt[128:256]
    for rank in range(TP):
        assert save(client, rank, chunk2) == list(range(128, 256))
    for rank in range(TP):
        assert save(client, rank, [prompt[256]]) == [256]
    exists = client.batch_key_exists(prompt)
    assert leading_trues(exists) == 257
    assert exists == [True] * 257 + [False] * (1250 - 257)
    for rank in range(TP):
        assert client.get_key_locations(rank, prompt[:257]) == list(range(257))
    assert rank_counts(base_url) == {r: (num_pages, num_pages - 257, 0, 257) for r in range(TP)}

    # A second prompt sharing no blocks: its own pages, and the first prompt is untouched.
    other = block_hashes(10, seed="other prompt")
    assert client.batch_key_exists(other) == [False] * 10
    for rank in range(TP):
        assert save(client, rank, other) == list(range(257, 267))
    assert client.batch_key_exists(other + prompt[:3]) == [True] * 13
    assert health(base_url)["keys"] == 267

    # Lookups with an empty prompt, and an unknown key among known ones.
    assert client.batch_key_exists([]) == []
    assert client.batch_key_exists([prompt[0], "0" * 32, prompt[1]]) == [True, False, True]
    assert client.get_key_locations(1, [prompt[5], "f" * 32]) == [5, None]


def test_reinitialize_same_size_and_scheduler_change_nothing(client, base_url):
    start_up(client, 64)
    keys = block_hashes(8)
    for rank in range(TP):
        assert save(client, rank, keys) == list(range(8))
    before = rank_counts(base_url)
    # A restarted worker initializes again with the same size; the scheduler again too.
    for rank in range(TP):
        assert client.initialize(rank, 64) == {"message": f"Rank {rank} initialized with 64 pages"}
    assert client.initialize(0, role="scheduler") == {
        "message": "Scheduler role does not require initialization"
    }
    assert rank_counts(base_url) == before == {r: (64, 56, 0, 8) for r in range(TP)}
    assert client.batch_key_exists(keys) == [True] * 8
    assert client.get_key_locations(1, keys) == list(range(8))


def test_write_failure_releases_pages(client, base_url):
    num_pages = 256
    start_up(client, num_pages)
    keys = block_hashes(100)
    results = client.allocate_pages_for_keys(0, [(k, "") for k in keys])
    assert results == [[k, p] for k, p in zip(keys, range(100))]
    assert rank_counts(base_url)[0] == (num_pages, 156, 100, 0)

    # The 3FS write failed: release every page, confirm nothing.
    pages = [p for _, p in results]
    assert client.confirm_write_for_keys(0, [], pages) == {}
    assert client.last_response.status_code == 204
    assert rank_counts(base_url) == {r: (num_pages, num_pages, 0, 0) for r in range(TP)}
    assert client.batch_key_exists(keys) == [False] * 100
    assert client.get_key_locations(0, keys) == [None] * 100

    # Released pages went to the tail of the free list: the next pages are 100.., then 0...
    fresh = block_hashes(160, seed="after failure")
    assert save(client, 0, fresh[:128]) == list(range(100, 228))
    assert save(client, 0, fresh[128:]) == list(range(228, 256)) + list(range(0, 4))
    assert rank_counts(base_url)[0] == (num_pages, 96, 0, 160)

    # Releasing the same pages twice (a second failure report) is ignored, not an error.
    assert client.confirm_write_for_keys(0, [], pages) == {}
    assert rank_counts(base_url)[0] == (num_pages, 96, 0, 160)

    # The connector's failure path on a batch with cache hits releases pages that committed keys
    # own: those releases are ignored, the keys keep their pages.
    for rank in (1,):
        assert save(client, rank, fresh[:128]) == list(range(128))
    assert client.batch_key_exists(fresh[:128]) == [True] * 128
    hit = client.allocate_pages_for_keys(0, [(k, "") for k in fresh[:8]])
    assert hit == [[k, p] for k, p in zip(fresh[:8], range(100, 108))]
    assert client.confirm_write_for_keys(0, [], [p for _, p in hit]) == {}
    assert client.get_key_locations(0, fresh[:8]) == list(range(100, 108))
    assert rank_counts(base_url)[0] == (num_pages, 96, 0, 160)


def test_second_save_of_cached_keys_is_a_cache_hit(client, base_url):
    num_pages = 512
    start_up(client, num_pages)
    keys = block_hashes(192)
    for rank in range(TP):
        assert save(client, rank, keys[:128]) == list(range(128))
    before = rank_counts(base_url)
    assert before == {r: (num_pages, 384, 0, 128) for r in range(TP)}

    for rank in range(TP):
        again = client.allocate_pages_for_keys(rank, [(k, "") for k in keys[:128]])
        assert again == [[k, p] for k, p in zip(keys[:128], range(128))]
        # Cache hits hold no reservation: the pool is as before.
        assert rank_counts(base_url)[rank] == before[rank]
        # Confirming the cache hits again (as the connector does) is a no-op.
        assert client.confirm_write_for_keys(rank, zip(keys[:128], range(128)), []) == {}
        assert client.last_response.status_code == 204 and client.last_response.content == b""
        assert rank_counts(base_url)[rank] == before[rank]
    assert client.batch_key_exists(keys[:128]) == [True] * 128
    assert health(base_url)["keys"] == 128

    # The peer's page rotation for hits: the pages taken for the 128 hits (128..255) went to the
    # tail, so the free list is now 256..511, 128..255. A mixed batch (64 hits, 64 new keys) takes
    # 256..383 by position: the hits keep 64..127, the new keys get 320..383.
    mixed = keys[64:192]
    for rank in range(TP):
        res = client.allocate_pages_for_keys(rank, [(k, "") for k in mixed])
        assert res == [[k, p] for k, p in zip(mixed, list(range(64, 128)) + list(range(320, 384)))]
        pages = [p for _, p in res]
        assert client.confirm_write_for_keys(rank, zip(mixed, pages), []) == {}
    assert client.batch_key_exists(keys) == [True] * 192
    for rank in range(TP):
        assert client.get_key_locations(rank, keys) == (
            list(range(128)) + list(range(320, 384))
        )
    assert rank_counts(base_url) == {r: (num_pages, 320, 0, 192) for r in range(TP)}


def test_pool_exhaustion_returns_minus_one(client, base_url):
    num_pages = 64
    start_up(client, num_pages)
    cached = block_hashes(48)
    for rank in range(TP):
        assert save(client, rank, cached) == list(range(48))
    assert rank_counts(base_url) == {r: (num_pages, 16, 0, 48) for r in range(TP)}

    # 32 new keys, 16 free pages: all-or-nothing, so every new key gets -1 — a value, not an error.
    new = block_hashes(40, seed="second prompt")
    res = client.allocate_pages_for_keys(0, [(k, "") for k in new[:32]])
    assert client.last_response.status_code == 200
    assert res == [[k, -1] for k in new[:32]]
    assert rank_counts(base_url)[0] == (num_pages, 16, 0, 48)  # nothing taken
    # The connector sees a page < 0 and abandons the save without a release.
    assert any(p < 0 for _, p in res)

    # Mixed batch that does not fit (16 hits + 32 new > 16 free): hits keep their pages,
    # every non-cached key gets -1.
    batch = cached[:16] + new[:32]
    res = client.allocate_pages_for_keys(1, [(k, "") for k in batch])
    assert res == [[k, p] for k, p in zip(cached[:16], range(16))] + [[k, -1] for k in new[:32]]
    assert rank_counts(base_url)[1] == (num_pages, 16, 0, 48)

    # Exactly the free pages: it fits; the next key finds the pool full.
    for rank in range(TP):
        assert save(client, rank, new[:16]) == list(range(48, 64))
    assert rank_counts(base_url) == {r: (num_pages, 0, 0, 64) for r in range(TP)}
    for rank in range(TP):
        assert client.allocate_pages_for_keys(rank, [(new[16], "")]) == [[new[16], -1]]
        # Cache hits still answer on a full pool.
        assert client.allocate_pages_for_keys(rank, [(cached[0], "")]) == [[cached[0], 0]]
    assert client.batch_key_exists(cached + new) == [True] * 64 + [False] * 24
    assert rank_counts(base_url) == {r: (num_pages, 0, 0, 64) for r in range(TP)}


# --------------------------------------------------------------------------------------------
# Errors: 4xx raise at once, bad input is a JSON 400, never a 500
# --------------------------------------------------------------------------------------------


def _expect_http_error(call, status: int, detail: str, client: MetadataClient):
    start = time.monotonic()
    with pytest.raises(requests.HTTPError) as err:
        call()
    elapsed = time.monotonic() - start
    resp = err.value.response
    assert resp.status_code == status
    assert resp.headers["content-type"] == "application/json"
    assert resp.json() == {"detail": detail}
    # Not retried: urllib3 recorded no retry, and no backoff was slept.
    assert resp.raw.retries.history == ()
    assert elapsed < 0.15, elapsed


def test_uninitialized_rank_raises_404_without_retry(client, base_url):
    start_up(client, 32)
    keys = block_hashes(4)
    detail = "Rank 5 not initialized"
    _expect_http_error(
        lambda: client.allocate_pages_for_keys(5, [(k, "") for k in keys]), 404, detail, client
    )
    _expect_http_error(lambda: client.get_key_locations(5, keys), 404, detail, client)
    _expect_http_error(
        lambda: client.confirm_write_for_keys(5, [(keys[0], 0)], []), 404, detail, client
    )
    _expect_http_error(lambda: client.confirm_write_for_keys(5, [], [0]), 404, detail, client)
    # Nothing changed on the initialized ranks.
    assert rank_counts(base_url) == {r: (32, 32, 0, 0) for r in range(TP)}
    # Before any initialize at all, rank 0 is unknown too.
    requests.post(f"{base_url}/clear", timeout=5)
    _expect_http_error(
        lambda: client.allocate_pages_for_keys(0, [(keys[0], "")]),
        404,
        "Rank 0 not initialized",
        client,
    )


def test_duplicates_and_unreserved_confirms(client, base_url):
    """A key repeated in one batch takes one page; a confirm nothing reserved is a 409, at once."""
    start_up(client, 8)
    a, b = block_hashes(2)
    res = client.allocate_pages_for_keys(0, [(a, ""), (a, ""), (b, "")])
    assert res == [[a, 0], [b, 1]]
    assert rank_counts(base_url)[0] == (8, 6, 2, 0)
    prefix = "No confirmation matched a reservation; nothing was applied ("
    for confirmations in ([(a, 5)], [(a, 1)]):  # never allocated; reserved for b
        start = time.monotonic()
        with pytest.raises(requests.HTTPError) as err:
            client.confirm_write_for_keys(0, confirmations, [0])
        assert time.monotonic() - start < 0.15
        resp = err.value.response
        assert resp.status_code == 409
        assert resp.raw.retries.history == ()
        assert resp.json()["detail"].startswith(prefix)
        # Nothing applied, the release of page 0 included.
        assert rank_counts(base_url)[0] == (8, 6, 2, 0)
    assert client.confirm_write_for_keys(0, [(a, 0), (b, 1)], []) == {}
    assert rank_counts(base_url)[0] == (8, 6, 0, 2)


def test_worker_initialize_without_pages_is_400(client, base_url):
    for call in (lambda: client.initialize(0), lambda: client.initialize(0, 0, "worker")):
        start = time.monotonic()
        with pytest.raises(requests.HTTPError) as err:
            call()
        assert time.monotonic() - start < 0.15
        resp = err.value.response
        assert resp.status_code == 400
        assert resp.raw.retries.history == ()
        assert resp.json()["detail"].startswith("Invalid initialization parameters")
    assert health(base_url)["ranks"] == []


INIT = "Invalid initialization parameters"
KEYS = "Invalid request format: need 'rank' and 'keys'"
CONF = "Invalid request format: need 'rank' and 'confirmations'"
EXISTS = "Invalid keys format"
K = "386b2d9cf5aa91ba3a4b42c35396c822"

MALFORMED = [
    # (id, route, raw body, detail prefix)
    ("alloc-not-json", "keys/batch_allocate", b"not json", KEYS),
    ("alloc-empty-body", "keys/batch_allocate", b"", KEYS),
    ("alloc-array-body", "keys/batch_allocate", b"[]", KEYS),
    ("alloc-no-rank", "keys/batch_allocate", b'{"keys": []}', KEYS),
    ("alloc-null-rank", "keys/batch_allocate", b'{"rank": null, "keys": []}', KEYS),
    ("alloc-rank-string", "keys/batch_allocate", b'{"rank": "0", "keys": []}', KEYS),
    ("alloc-rank-float", "keys/batch_allocate", b'{"rank": 0.0, "keys": []}', KEYS),
    ("alloc-rank-bool", "keys/batch_allocate", b'{"rank": false, "keys": []}', KEYS),
    ("alloc-rank-negative", "keys/batch_allocate", b'{"rank": -1, "keys": []}', KEYS),
    ("alloc-keys-not-list", "keys/batch_allocate", b'{"rank": 0, "keys": "ab"}', KEYS),
    ("alloc-key-is-string", "keys/batch_allocate", b'{"rank": 0, "keys": ["ab"]}', KEYS),
    ("alloc-pair-of-3", "keys/batch_allocate", b'{"rank": 0, "keys": [["a", "", ""]]}', KEYS),
    ("alloc-key-int", "keys/batch_allocate", b'{"rank": 0, "keys": [[1, ""]]}', KEYS),
    ("alloc-dup-member", "keys/batch_allocate", b'{"rank": 0, "rank": 1, "keys": []}', KEYS),
    ("alloc-trailing", "keys/batch_allocate", b'{"rank": 0, "keys": []} x', KEYS),
    ("alloc-nan", "keys/batch_allocate", b'{"rank": NaN, "keys": []}', KEYS),
    ("alloc-bom", "keys/batch_allocate", b'\xef\xbb\xbf{"rank": 0, "keys": []}', KEYS),
    ("alloc-not-utf8", "keys/batch_allocate", b'{"rank": 0, "keys": [["\xff\xfe", ""]]}', KEYS),
    ("alloc-deep", "keys/batch_allocate", b'{"rank": 0, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", KEYS),
    ("loc-no-rank", "keys/get_locations", b'{"keys": ["a"]}', KEYS),
    ("loc-key-int", "keys/get_locations", b'{"rank": 0, "keys": [1]}', KEYS),
    ("confirm-not-json", "keys/confirm_write", b"{", CONF),
    ("confirm-no-rank", "keys/confirm_write", b'{"confirmations": []}', CONF),
    ("confirm-page-string", "keys/confirm_write",
     b'{"rank": 0, "confirmations": [["' + K.encode() + b'", "zz"]]}', CONF),
    ("confirm-page-negative", "keys/confirm_write",
     b'{"rank": 0, "confirmations": [["' + K.encode() + b'", -1]]}', CONF),
    ("confirm-page-float", "keys/confirm_write",
     b'{"rank": 0, "confirmations": [["' + K.encode() + b'", 1.5]]}', CONF),
    ("confirm-page-out-of-range", "keys/confirm_write",
     b'{"rank": 0, "confirmations": [["' + K.encode() + b'", 16]]}', CONF),
    ("confirm-release-out-of-range", "keys/confirm_write",
     b'{"rank": 0, "confirmations": [], "pages_to_release": [16]}', CONF),
    ("confirm-release-string", "keys/confirm_write",
     b'{"rank": 0, "confirmations": [], "pages_to_release": ["0"]}', CONF),
    ("exists-array-body", "keys/batch_exists", b'["a"]', EXISTS),
    ("exists-keys-string", "keys/batch_exists", b'{"keys": "abc"}', EXISTS),
    ("exists-key-pair", "keys/batch_exists", b'{"keys": [["a", ""]]}', EXISTS),
    ("exists-not-json", "keys/batch_exists", b"keys=a", EXISTS),
    ("init-num-pages-bool", "rank/2/initialize", b'{"num_pages": true}', INIT),
    ("init-num-pages-string", "rank/2/initialize", b'{"num_pages": "16"}', INIT),
    ("init-num-pages-negative", "rank/2/initialize", b'{"num_pages": -16}', INIT),
    ("init-num-pages-float", "rank/2/initialize", b'{"num_pages": 16.0}', INIT),
    ("init-num-pages-huge", "rank/2/initialize", b'{"num_pages": 4294967296}', INIT),
    ("init-role-unknown", "rank/2/initialize", b'{"num_pages": 16, "role": "admin"}', INIT),
    ("init-not-json", "rank/2/initialize", b"num_pages=16", INIT),
    ("init-path-rank-word", "rank/abc/initialize", b'{"num_pages": 16}', INIT),
    ("init-path-rank-signed", "rank/+2/initialize", b'{"num_pages": 16}', INIT),
]


@pytest.mark.parametrize(
    "route,body,prefix", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_request_is_json_400(base_url, route, body, prefix):
    # A live state so that "nothing applied" is checkable: 2 ranks of 16 pages, one key saved.
    c = MetadataClient(base_url)
    start_up(c, 16)
    for rank in range(TP):
        assert save(c, rank, [K]) == [0]
    before = rank_counts(base_url)

    r = requests.post(
        f"{base_url}/{route}", data=body, headers={"Content-Type": "application/json"}, timeout=5
    )
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.headers["content-type"] == "application/json"
    payload = r.json()
    assert list(payload) == ["detail"], payload
    detail = payload["detail"]
    assert isinstance(detail, str)
    # The peer's text, then the specific reason in parentheses.
    assert detail.startswith(prefix + " (") and detail.endswith(")"), detail

    # Nothing applied.
    assert rank_counts(base_url) == before
    assert health(base_url)["keys"] == 1
    assert c.batch_key_exists([K]) == [True]
    assert c.get_key_locations(0, [K]) == [0]
    c.close()


def test_other_error_statuses_are_json(base_url):
    """Unknown route 404, wrong method 405: JSON detail, not the framework's empty body."""
    r = requests.post(f"{base_url}/keys/nope", data=b"{}", timeout=5)
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/json"
    assert r.json()["detail"].startswith("Not Found")
    r = requests.get(f"{base_url}/keys/batch_exists", timeout=5)
    assert r.status_code == 405
    assert r.headers["content-type"] == "application/json"
    assert r.headers["allow"] == "POST"
    assert r.json()["detail"].startswith("Method Not Allowed")


def test_content_type_is_not_required(client, base_url):
    """The peer parses the body as JSON whatever the Content-Type; so does kvpages."""
    start_up(client, 16)
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded"):
        headers = {} if ctype is None else {"Content-Type": ctype}
        r = requests.post(
            f"{base_url}/keys/batch_exists", data=json.dumps({"keys": [K]}).encode(),
            headers=headers, timeout=5,
        )
        assert r.status_code == 200, (ctype, r.status_code, r.text)
        assert r.json() == {"exists": [False]}
