"""kvpages driven by SGLang's REAL metadata client, exactly as SGLang's HiCache HF3FS backend uses it.

`sglang_peer.py` fetches SGLang 0.5.23's `mini_3fs_metadata_server.py` at test time (nothing of
SGLang is committed) and imports its `Hf3fsGlobalMetadataClient` (requests + urllib3 Retry on
500/502/503/504, orjson bodies) with tiny stand-ins for the two SGLang modules it imports.
`sglang_peer.HiCache` makes the calls the way `storage_hf3fs.py` makes them (reserve with
`[(key, "")...]`, skip entries already written or with page -1, write, one `confirm_write(ok
pairs, failed pages)`; one `get_page_indices` per get; `exists` counting leading trues) over an
in-memory stand-in for each pool's 3FS file, so every get is checked against what was written.

The module runs one `kvpages serve --eviction off` (default leases: a page a reader just looked up
is protected, which one test checks) and empties it before each test. Page numbers are asserted exactly: the free list
is a stack, the first pages handed out are n-1, n-2, ...
"""

import hashlib
import json
import time

import pytest
import requests

import sglang_peer
from conftest import metric, record_retries
from stub import StubServer
from sglang_peer import NOT_INITIALIZED, HiCache, Recorder

OPS = ("initialize", "exists", "reserve_and_allocate_page_indices", "confirm_write", "delete_keys",
       "clear", "get_page_indices")


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_module(say):
    """SGLang's file imported as a module; a failure to get it fails each test that needs it."""
    try:
        _script, module = sglang_peer.prepare(say)
    except sglang_peer.PeerError as e:
        return e
    return module


@pytest.fixture
def sgl(sglang_module):
    if isinstance(sglang_module, Exception):
        pytest.fail(f"SGLang's metadata client is unavailable: {sglang_module}", pytrace=False)
    return sglang_module


@pytest.fixture(scope="module")
def kv_module(kvpages_server):
    """This module's kvpages (`--eviction off`, default leases and engine)."""
    return kvpages_server()


@pytest.fixture
def kv(kv_module):
    """This module's kvpages, emptied: every SGLang pool dropped (an import of an empty SGLang
    persistence file with `?replace=true`, the operator's way) and the vLLM routes cleared."""
    r = requests.post(f"{kv_module}/admin/import/sglang?replace=true", data=b"{}", timeout=10)
    assert r.status_code == 200 and r.json()["pools"] == 0, (r.status_code, r.text)
    assert requests.post(f"{kv_module}/clear", timeout=5).status_code == 204
    spaces = requests.get(f"{kv_module}/stats", timeout=5).json()["spaces"]
    assert [s for s in spaces if s["space"] == "sglang"] == [], spaces
    return kv_module


@pytest.fixture
def client(sgl, kv):
    c = sgl.Hf3fsGlobalMetadataClient(kv)
    try:
        yield c
    finally:
        c._session.close()


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def chain(n: int, seed: str) -> list:
    """`n` chained SHA-256 page hashes (64 lowercase hex characters), like SGLang's."""
    out, prev = [], ""
    for i in range(n):
        prev = hashlib.sha256(f"{seed}|{prev}|{i}".encode()).hexdigest()
        out.append(prev)
    assert len(set(out)) == n
    return out


def raw(url: str, path: str, body) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
    return requests.post(f"{url}{path}", data=data, headers={"Content-Type": "application/json"},
                         timeout=10)


def detail(r: requests.Response) -> str:
    assert r.headers["content-type"] == "application/json", r.headers
    body = r.json()
    assert list(body) == ["detail"] and isinstance(body["detail"], str), body
    return body["detail"]


def space_stats(url: str, rank: int, namespace: str) -> dict:
    """kvpages' /stats entry for one SGLang rank:namespace (pool counts and counters)."""
    r = requests.get(f"{url}/stats", timeout=5)
    assert r.status_code == 200
    for s in r.json()["spaces"]:
        if s["space"] == "sglang" and s["rank"] == rank and s["namespace"] == namespace:
            (pool,) = s["ranks"]
            return {**{k: pool[k] for k in ("num_pages", "free", "reserved", "committed")},
                    "keys": s["keys"]}
    raise AssertionError(f"no SGLang space {rank}:{namespace} in /stats")


def http_error(excinfo):
    """The requests error behind SGLang's client's RuntimeError (it wraps every failure)."""
    err = excinfo.value
    assert isinstance(err, RuntimeError)
    assert str(err).startswith("Failed to connect to metadata server: "), str(err)
    cause = err.__cause__
    assert isinstance(cause, requests.HTTPError), repr(cause)
    return cause.response


# --------------------------------------------------------------------------------------------
# The set/get/exists/delete/clear cycle
# --------------------------------------------------------------------------------------------


def test_set_get_exists_delete_clear_cycle(sgl, client, kv):
    rec = Recorder(client)
    hc = HiCache(rec, sgl.PoolName, rank=0, num_pages=64)
    keys = chain(40, "cycle")
    assert rec.calls[0][:2] == ("initialize", (0, 64))

    def last(name):
        calls = [c for c in rec.calls if c[0] == name]
        return calls[-1]

    # Nothing stored yet.
    assert hc.batch_exists(keys) == 0
    assert hc.exists(keys[0]) is False
    assert hc.batch_get(keys[:3]) == [None] * 3

    # A first set of 16 pages: one reserve, pages from the top of the stack, one confirm.
    assert hc.batch_set(keys[:16]) == [True] * 16
    assert last("reserve_and_allocate_page_indices")[3] == [(False, 63 - i) for i in range(16)]
    confirm = last("confirm_write")
    assert confirm[1] == (0, [(k, 63 - i) for i, k in enumerate(keys[:16])], [])
    assert hc.batch_exists(keys) == 16
    assert hc.exists(keys[15]) is True and hc.exists(keys[16]) is False
    got = hc.batch_get(keys[:20])
    assert got == [hc.value(k, sgl.PoolName.KV) for k in keys[:16]] + [None] * 4
    assert client.get_page_indices(0, keys[:2] + ["nope"]) == [63, 62, None]

    # Half already written: those come back [true, page] and are skipped; the rest are new.
    assert hc.batch_set(keys[8:24]) == [True] * 16
    assert last("reserve_and_allocate_page_indices")[3] == (
        [(True, 55 - i) for i in range(8)] + [(False, 47 - i) for i in range(8)])
    assert last("confirm_write")[1] == (0, [(k, 47 - i) for i, k in enumerate(keys[16:24])], [])
    assert hc.batch_exists(keys) == 24

    # A write failure: the failed page is released, the others confirmed, in ONE confirm_write.
    hc.fail_writes = {keys[26]}
    assert hc.batch_set(keys[24:30]) == [True, True, False, True, True, True]
    assert last("reserve_and_allocate_page_indices")[3] == [(False, 39 - i) for i in range(6)]
    ok = [(k, 39 - i) for i, k in enumerate(keys[24:30]) if k != keys[26]]
    assert last("confirm_write")[1] == (0, ok, [37])
    assert hc.batch_exists(keys) == 26  # the leading trues stop at the failed key
    assert hc.batch_get(keys[25:28]) == [hc.value(keys[25], "kv"), None, hc.value(keys[27], "kv")]
    # The released page went back on top of the stack: the retry gets it again.
    hc.fail_writes = set()
    assert hc.batch_set([keys[26]]) == [True]
    assert last("reserve_and_allocate_page_indices")[3] == [(False, 37)]
    assert hc.batch_exists(keys) == 30
    assert space_stats(kv, 0, "kv") == {"num_pages": 64, "free": 34, "reserved": 0,
                                        "committed": 30, "keys": 30}

    # Delete a key nobody read recently: its page is free at once (top of the stack).
    assert hc.batch_set(keys[30:32]) == [True, True]
    assert last("reserve_and_allocate_page_indices")[3] == [(False, 33), (False, 32)]
    hc.delete(keys[31])
    assert hc.exists(keys[31]) is False
    assert hc.batch_exists(keys) == 31
    assert hc.batch_set([keys[31]]) == [True]
    assert last("reserve_and_allocate_page_indices")[3] == [(False, 32)]
    # Deleting unknown keys is fine.
    client.delete_keys(0, ["unknown", keys[39]])
    assert hc.batch_exists(keys) == 32

    # A hole in the middle: exists counts only the leading trues.
    hc.delete(keys[5])
    assert hc.batch_exists(keys) == 5
    assert client.exists(0, keys[4:7]) == [True, False, True]
    got = hc.batch_get(keys[:8])
    assert got[5] is None and got[:5] == [hc.value(k, "kv") for k in keys[:5]]

    # Clear: nothing left, the rank stays initialized, the stack starts again at the top.
    hc.clear()
    assert hc.batch_exists(keys) == 0
    assert hc.batch_get(keys[:4]) == [None] * 4
    assert space_stats(kv, 0, "kv") == {"num_pages": 64, "free": 64, "reserved": 0,
                                        "committed": 0, "keys": 0}
    assert hc.batch_set(keys[:3]) == [True] * 3
    assert last("reserve_and_allocate_page_indices")[3] == [(False, 63), (False, 62), (False, 61)]
    assert hc.batch_get(keys[:3]) == [hc.value(k, "kv") for k in keys[:3]]


def test_a_page_just_read_is_not_handed_out_again(sgl, client, kv):
    """kvpages' read lease (default 5 s): a key deleted right after a reader looked it up keeps
    its page out of use, so a writer never overwrites what the reader is reading. (SGLang's own
    server hands the page out at once.)"""
    hc = HiCache(client, sgl.PoolName, rank=0, num_pages=8)
    keys = chain(4, "lease")
    assert hc.batch_set(keys[:2]) == [True, True]  # pages 7, 6
    assert client.get_page_indices(0, [keys[1]]) == [6]  # a reader is reading page 6
    hc.delete(keys[1])
    assert hc.exists(keys[1]) is False
    # The writer gets page 5, not page 6.
    assert client.reserve_and_allocate_page_indices(0, [(keys[2], "")]) == [(False, 5)]
    client.confirm_write(0, [(keys[2], 5)], [])
    assert space_stats(kv, 0, "kv")["committed"] == 2


def test_mha_zero_copy_batches_of_256(sgl, client):
    """MHA zero-copy: every block K is stored as `K-k` and `K-v`, 256 keys per set."""
    hc = HiCache(client, sgl.PoolName, rank=0, num_pages=1024)
    blocks = chain(300, "mha")
    kv_keys = [f"{b}-{x}" for b in blocks[:128] for x in ("k", "v")]
    assert len(kv_keys) == 256
    assert hc.batch_set(kv_keys) == [True] * 256
    assert client.get_page_indices(0, kv_keys[:4]) == [1023, 1022, 1021, 1020]
    assert hc.batch_exists(blocks, mha_zero_copy=True) == 128
    # Only the V half of block 128 stored: block 128 does not count.
    assert hc.batch_set([f"{blocks[128]}-v"]) == [True]
    assert hc.batch_exists(blocks, mha_zero_copy=True) == 128
    assert hc.batch_set([f"{blocks[128]}-k"]) == [True]
    assert hc.batch_exists(blocks, mha_zero_copy=True) == 129
    assert hc.batch_get(kv_keys[-2:]) == [hc.value(k, "kv") for k in kv_keys[-2:]]


# --------------------------------------------------------------------------------------------
# A full pool
# --------------------------------------------------------------------------------------------


def test_full_pool_answers_minus_one(sgl, client, kv):
    """With eviction off, keys that get no page are `[false, -1]` (the caller skips them); the
    answer is always a 200 with one entry per key — never a 5xx, never an empty body."""
    rec = Recorder(client)
    hc = HiCache(rec, sgl.PoolName, rank=0, num_pages=8)
    keys = chain(16, "full")
    assert hc.batch_set(keys[:5]) == [True] * 5  # pages 7..3
    # 2 written + 4 new keys, 3 pages free: the last new key gets -1 and is not written.
    assert hc.batch_set(keys[3:9]) == [True, True, True, True, True, False]
    reserve = [c for c in rec.calls if c[0] == "reserve_and_allocate_page_indices"][-1]
    assert reserve[3] == [(True, 4), (True, 3), (False, 2), (False, 1), (False, 0), (False, -1)]
    confirm = [c for c in rec.calls if c[0] == "confirm_write"][-1]
    assert confirm[1] == (0, [(keys[5], 2), (keys[6], 1), (keys[7], 0)], [])
    assert hc.batch_exists(keys) == 8
    assert hc.batch_get(keys[7:9]) == [hc.value(keys[7], "kv"), None]
    assert space_stats(kv, 0, "kv") == {"num_pages": 8, "free": 0, "reserved": 0,
                                        "committed": 8, "keys": 8}

    # The raw answers: exact bytes, 200, JSON.
    for body, want in (
        ({"keys": [[keys[9], ""]], "namespace": "kv"}, b'{"indices":[[false,-1]]}'),
        ({"keys": [[keys[0], ""], [keys[10], ""], [keys[11], ""]], "namespace": "kv"},
         b'{"indices":[[true,7],[false,-1],[false,-1]]}'),
        ({"keys": [], "namespace": "kv"}, b'{"indices":[]}'),
    ):
        r = raw(kv, "/0/reserve_and_allocate_page_indices", body)
        assert (r.status_code, r.headers["content-type"], r.content) == (200, "application/json", want)
        assert r.raw.retries is None or r.raw.retries.history == ()
    # SGLang's client on the full pool: every new key -1, nothing written, no confirm at all.
    n_confirms = sum(1 for c in rec.calls if c[0] == "confirm_write")
    assert hc.batch_set(keys[9:16]) == [False] * 7
    assert sum(1 for c in rec.calls if c[0] == "confirm_write") == n_confirms
    assert space_stats(kv, 0, "kv")["reserved"] == 0

    # Deleting a key frees its page for the next set.
    hc.delete(keys[1])  # page 6
    assert client.reserve_and_allocate_page_indices(0, [(keys[9], ""), (keys[10], "")]) == [
        (False, 6), (False, -1)]
    client.confirm_write(0, [(keys[9], 6)], [])
    assert client.get_page_indices(0, [keys[1], keys[9], keys[10]]) == [None, 6, None]


# --------------------------------------------------------------------------------------------
# Isolation: namespaces, ranks, the vLLM routes
# --------------------------------------------------------------------------------------------


def test_namespaces_are_isolated(sgl, client, kv):
    P = sgl.PoolName
    hc = HiCache(client, P, rank=0, num_pages=32, pools={P.MAMBA: 16})
    keys = chain(6, "ns")
    assert hc.batch_set(keys) == [True] * 6
    assert hc.batch_set(keys[:4], P.MAMBA) == [True] * 4
    # Independent page spaces and the caller's component keys `K_mamba` in the mamba pool.
    assert client.get_page_indices(0, keys[:2]) == [31, 30]
    assert client.get_page_indices(0, [f"{k}_mamba" for k in keys[:2]], P.MAMBA) == [15, 14]
    assert client.get_page_indices(0, [f"{k}_mamba" for k in keys[:2]]) == [None, None]
    assert client.get_page_indices(0, keys[:2], P.MAMBA) == [None, None]
    assert hc.batch_get(keys[:5], P.MAMBA) == [hc.value(k, P.MAMBA) for k in keys[:4]] + [None]
    assert hc.batch_get(keys[:2]) == [hc.value(k, P.KV) for k in keys[:2]]
    assert hc.value(keys[0], P.KV) != hc.value(keys[0], P.MAMBA)

    # One key string in both namespaces: two keys with their own pages.
    for ns, want in ((P.KV, 25), (P.MAMBA, 11)):
        assert client.reserve_and_allocate_page_indices(0, [("same", "")], ns) == [(False, want)]
        client.confirm_write(0, [("same", want)], [], ns)
    assert client.get_page_indices(0, ["same"]) == [25]
    assert client.get_page_indices(0, ["same"], P.MAMBA) == [11]
    client.delete_keys(0, ["same"], P.MAMBA)
    assert client.exists(0, ["same"]) == [True]
    assert client.exists(0, ["same"], P.MAMBA) == [False]

    # Clearing the mamba pool leaves kv alone (and keeps mamba initialized).
    client.clear(0, P.MAMBA)
    assert hc.batch_exists(keys, P.MAMBA) == 0
    assert hc.batch_exists(keys) == 6
    assert client.reserve_and_allocate_page_indices(0, [("m", "")], P.MAMBA) == [(False, 15)]
    client.confirm_write(0, [], [15], P.MAMBA)

    # Namespaces are exact strings: "KV" and "swa" were never initialized.
    for ns in ("KV", "swa", " kv"):
        r = raw(kv, "/0/exists", {"keys": keys[:1], "namespace": ns})
        assert r.status_code == 404 and detail(r) == NOT_INITIALIZED.format(rank=0, ns=ns)
    with pytest.raises(RuntimeError) as e:
        client.exists(0, keys, P.SWA)
    assert detail(http_error(e)) == NOT_INITIALIZED.format(rank=0, ns="swa")
    # A body without `namespace` means "kv".
    r = raw(kv, "/0/get_page_indices", {"keys": keys[:2]})
    assert (r.status_code, r.content) == (200, b'{"indices":[31,30]}')

    # The caller's clear: kv first, then every other pool.
    hc.clear()
    assert hc.batch_exists(keys) == 0 and hc.batch_exists(keys, P.MAMBA) == 0
    assert client.get_page_indices(0, ["same"]) == [None]


def test_ranks_are_isolated_and_mla_shares_rank_0(sgl, client, kv):
    keys = chain(8, "ranks")
    r0 = HiCache(client, sgl.PoolName, rank=0, num_pages=16)
    r1 = HiCache(client, sgl.PoolName, rank=1, num_pages=16)
    assert r0.batch_set(keys[:4]) == [True] * 4
    assert r1.batch_set(keys[2:6]) == [True] * 4
    # Each rank has its own pool (a key lives on one rank: no TP-wide completeness).
    assert client.get_page_indices(0, keys[:6]) == [15, 14, 13, 12, None, None]
    assert client.get_page_indices(1, keys[:6]) == [None, None, 15, 14, 13, 12]
    assert r0.batch_exists(keys) == 4 and r1.batch_exists(keys) == 0
    assert r1.batch_exists(keys[2:]) == 4
    r1.delete(keys[2])
    assert client.exists(0, [keys[2]]) == [True] and client.exists(1, [keys[2]]) == [False]
    r1.clear()
    assert r1.batch_exists(keys[2:]) == 0
    assert r0.batch_exists(keys) == 4
    assert r0.batch_get(keys[:4]) == [r0.value(k, "kv") for k in keys[:4]]
    # Rank 2 was never initialized.
    r = raw(kv, "/2/get_page_indices", {"keys": keys[:1], "namespace": "kv"})
    assert r.status_code == 404 and detail(r) == NOT_INITIALIZED.format(rank=2, ns="kv")

    # MLA: every TP rank talks to rank 0 (its initialize with the same size changes nothing);
    # only TP rank 0 writes, the others read rank 0's pages.
    tp1 = HiCache(client, sgl.PoolName, rank=0, num_pages=16)
    tp1.files = r0.files  # the same 3FS file
    assert tp1.batch_exists(keys) == 4
    assert tp1.batch_get(keys[:4]) == [r0.value(k, "kv") for k in keys[:4]]
    assert space_stats(kv, 0, "kv")["committed"] == 4


def test_vllm_routes_do_not_see_sglang_keys(sgl, client, kv):
    hc = HiCache(client, sgl.PoolName, rank=0, num_pages=8)
    key = "386b2d9cf5aa91ba3a4b42c35396c822"
    assert hc.batch_set([key]) == [True]
    r = raw(kv, "/keys/batch_exists", {"keys": [key]})
    assert (r.status_code, r.content) == (200, b'{"exists":[false]}')
    # vLLM's /clear clears the vLLM routes only.
    assert requests.post(f"{kv}/clear", timeout=5).status_code == 204
    assert hc.exists(key) is True


# --------------------------------------------------------------------------------------------
# Errors: uninitialized rank:namespace, retries, malformed requests, state conflicts
# --------------------------------------------------------------------------------------------


def test_sglang_client_retry_policy(sgl):
    """What SGLang's client does with statuses (so that the 404 test below means something):
    a 503 is retried (POST included; up to 3 times), a 404 is not."""
    with StubServer([503, 503, 200]) as stub:
        c = sgl.Hf3fsGlobalMetadataClient(stub.url)
        assert c.exists(0, ["a"]) == []
        assert stub.count == 3
    with StubServer([404]) as stub:
        c = sgl.Hf3fsGlobalMetadataClient(stub.url)
        with pytest.raises(RuntimeError) as e:
            c.exists(0, ["a"])
        assert stub.count == 1
        assert http_error(e).raw.retries.history == ()


def test_uninitialized_rank_namespace_is_404_at_once(sgl, client, kv):
    P = sgl.PoolName
    client.initialize(0, 8)  # rank 0 "kv" exists; rank 0 "mamba" and rank 3 do not
    calls = {
        "exists": lambda r, ns: client.exists(r, ["a"], ns),
        "reserve_and_allocate_page_indices":
            lambda r, ns: client.reserve_and_allocate_page_indices(r, [("a", "")], ns),
        "confirm_write": lambda r, ns: client.confirm_write(r, [("a", 1)], [2], ns),
        "delete_keys": lambda r, ns: client.delete_keys(r, ["a"], ns),
        "clear": lambda r, ns: client.clear(r, ns),
        "get_page_indices": lambda r, ns: client.get_page_indices(r, ["a"], ns),
    }
    for rank, ns in ((3, P.KV), (0, P.MAMBA), (12345, P.DRAFT_SWA)):
        want = NOT_INITIALIZED.format(rank=rank, ns=ns)
        for op, call in calls.items():
            start = time.monotonic()
            with pytest.raises(RuntimeError) as e:
                call(rank, ns)
            elapsed = time.monotonic() - start
            resp = http_error(e)
            assert resp.status_code == 404, (op, resp.status_code)
            assert detail(resp) == want, op
            assert resp.raw.retries.history == (), (op, resp.raw.retries.history)  # no retry
            assert elapsed < 1.0, (op, elapsed)
    # Raw, with the peer's exact bytes, also for a namespace that needs JSON escapes.
    for ns in ("mamba", 'q"uo\\te', "ключ✓"):
        r = raw(kv, "/7/exists", {"keys": [], "namespace": ns})
        assert r.status_code == 404
        assert detail(r) == f"Rank 7 namespace '{ns}' not initialized. Please call /7/initialize first."
    r = raw(kv, "/7/clear", {})
    assert r.status_code == 404 and detail(r) == NOT_INITIALIZED.format(rank=7, ns="kv")
    # Nothing was created by those requests.
    r = raw(kv, "/3/exists", {"keys": ["a"], "namespace": "kv"})
    assert r.status_code == 404


# (op, body bytes, start of the reason in parentheses after "Invalid {op} request (")
MALFORMED = [
    ("initialize", b"", "body is empty"),
    ("initialize", b"[1]", "invalid type: sequence, expected a JSON object"),
    ("initialize", b"{}", "member 'num_pages' is missing"),
    ("initialize", b'{"num_pages":0}', "num_pages must be at least 1"),
    ("initialize", b'{"num_pages":4.0}', "num_pages: invalid type: floating point"),
    ("initialize", b'{"num_pages":true}', "num_pages: invalid type: boolean"),
    ("initialize", b'{"num_pages":"4"}', "num_pages: invalid type: string"),
    ("initialize", b'{"num_pages":-4}', "num_pages: invalid value: integer `-4`"),
    ("initialize", b'{"num_pages":4294967296}', "num_pages: invalid value"),
    ("initialize", b'{"num_pages":4,"namespace":5}', "namespace: invalid type: integer"),
    ("initialize", b'{"num_pages":4,"namespace":null}', "namespace: invalid type: null"),
    ("initialize", b'{"num_pages":4,"num_pages":5}', "duplicate member 'num_pages'"),
    ("initialize", ('{"num_pages":4,"namespace":"' + "n" * 257 + '"}').encode(), "namespace: "),
    ("exists", b"not json", "body is not valid JSON"),
    ("exists", b'{"keys":"abc"}', "keys: invalid type: string"),
    ("exists", b'{"keys":[1]}', "keys[0]: invalid type: integer"),
    ("exists", b'{"keys":[""]}', "keys[0]: key is empty"),
    ("exists", b'{"keys":["a"]} x', "body has data after the JSON value"),
    ("exists", b'{"keys":NaN}', "body is not valid JSON"),
    ("exists", b'\xef\xbb\xbf{"keys":[]}', "body starts with a byte order mark"),
    ("exists", b'{"keys":["\xff"]}', "body is not UTF-8"),
    ("exists", b'{"keys":[],"namespace":"kv","namespace":"kv"}', "duplicate member 'namespace'"),
    ("exists", ('{"keys":["' + "k" * 1025 + '"]}').encode(), "keys[0]: "),
    ("reserve_and_allocate_page_indices", b'{"keys":["ab"]}', "keys[0]: invalid type: string"),
    ("reserve_and_allocate_page_indices", b'{"keys":[["a"]]}', "keys[0]: invalid length 1"),
    ("reserve_and_allocate_page_indices", b'{"keys":[["a","",""]]}', "keys[0]: invalid length 3"),
    ("reserve_and_allocate_page_indices", b'{"keys":[["a",null]]}', "keys[0][1]: invalid type: null"),
    ("reserve_and_allocate_page_indices", b'{"keys":[[7,""]]}', "keys[0][0]: invalid type: integer"),
    ("reserve_and_allocate_page_indices", b'{"keys":{"a":""}}', "keys: invalid type: map"),
    ("confirm_write", b'{"written_keys_to_confirm":[["a","1"]]}',
     "written_keys_to_confirm[0][1]: invalid type: string"),
    ("confirm_write", b'{"written_keys_to_confirm":[["a",1.0]]}',
     "written_keys_to_confirm[0][1]: invalid type: floating point"),
    ("confirm_write", b'{"written_keys_to_confirm":[["a",8]]}',
     "written_keys_to_confirm[0]: page 8 is out of range"),
    ("confirm_write", b'{"written_keys_to_confirm":[["a"]]}', "written_keys_to_confirm[0]: invalid length 1"),
    ("confirm_write", b'{"pages_to_release":[-1]}', "pages_to_release[0]: invalid value: integer `-1`"),
    ("confirm_write", b'{"pages_to_release":[8]}', "pages_to_release[0]: page 8 is out of range"),
    ("confirm_write", b'{"pages_to_release":[true]}', "pages_to_release[0]: invalid type: boolean"),
    ("confirm_write", b'{"pages_to_release":"x"}', "pages_to_release: invalid type: string"),
    ("delete_keys", b'{"keys":{}}', "keys: invalid type: map"),
    ("delete_keys", b'{"keys":[null]}', "keys[0]: invalid type: null"),
    ("clear", b"", "body is empty"),
    ("clear", b"null", "invalid type: null, expected a JSON object"),
    ("clear", b'{"namespace":["kv"]}', "namespace: invalid type: sequence"),
    ("get_page_indices", b'{"keys":[["a",""]]}', "keys[0]: invalid type: sequence"),
    ("get_page_indices", b'{"keys":[1e400]}', "body is not valid JSON"),
    ("get_page_indices", b'{"x":' + b"[" * 200 + b"]" * 200 + b',"keys":[]}',
     "body is not valid JSON: recursion limit exceeded"),
]


def test_malformed_requests_are_json_400_and_change_nothing(sgl, client, kv):
    keys = chain(4, "bad")
    hc = HiCache(client, sgl.PoolName, rank=0, num_pages=8)
    assert hc.batch_set(keys[:2]) == [True, True]  # pages 7, 6
    pending = client.reserve_and_allocate_page_indices(0, [(keys[2], "")])
    assert pending == [(False, 5)]
    before = space_stats(kv, 0, "kv")
    assert before == {"num_pages": 8, "free": 5, "reserved": 1, "committed": 2, "keys": 2}
    for op, body, reason in MALFORMED:
        r = raw(kv, f"/0/{op}", body)
        assert r.status_code == 400, (op, body[:80], r.status_code, r.text[:300])
        d = detail(r)
        assert d.startswith(f"Invalid {op} request ({reason}"), (op, body[:80], d)
        assert d.endswith(")"), d
    assert space_stats(kv, 0, "kv") == before
    assert client.get_page_indices(0, keys) == [7, 6, None, None]
    client.confirm_write(0, [(keys[2], 5)], [])
    assert hc.batch_exists(keys) == 3

    # Not a route: 404; not POST: 405; both with a JSON detail.
    for path in ("/0/frob", "/x/exists", "/-1/exists", "/0/exists/more", "/+1/exists",
                 "/4294967296/exists"):
        r = raw(kv, path, {"keys": []})
        assert r.status_code == 404, (path, r.status_code)
        assert detail(r).startswith("Not Found"), path
    for op in OPS:
        r = requests.get(f"{kv}/0/{op}", timeout=5)
        assert r.status_code == 405, op
        assert detail(r).startswith("Method Not Allowed"), op


def test_well_formed_requests_that_do_not_match_the_state(sgl, client, kv):
    keys = chain(6, "state")
    hc = HiCache(client, sgl.PoolName, rank=0, num_pages=8)
    assert hc.batch_set(keys[:2]) == [True, True]  # keys[0] -> 7, keys[1] -> 6
    # Re-initializing with the same size: 204, nothing changes.
    r = raw(kv, "/0/initialize", {"num_pages": 8, "namespace": "kv"})
    assert (r.status_code, r.content) == (204, b"")
    assert client.get_page_indices(0, keys[:2]) == [7, 6]
    # Confirming a page nobody reserved: 409, and nothing of the request applies (not even
    # its releases).
    assert client.reserve_and_allocate_page_indices(0, [(keys[2], "")]) == [(False, 5)]
    r = raw(kv, "/0/confirm_write", {"written_keys_to_confirm": [[keys[3], 4]],
                                     "pages_to_release": [5], "namespace": "kv"})
    assert r.status_code == 409
    assert "written_keys_to_confirm[0]" in detail(r) and keys[3] in detail(r), detail(r)
    assert space_stats(kv, 0, "kv")["reserved"] == 1
    # A confirm naming another key's reserved page is refused too.
    r = raw(kv, "/0/confirm_write", {"written_keys_to_confirm": [[keys[4], 5]], "namespace": "kv"})
    assert r.status_code == 409
    # Releasing a page that a key owns is ignored (204): the key keeps its page, and the page
    # is not handed to anyone else.
    r = raw(kv, "/0/confirm_write", {"written_keys_to_confirm": [[keys[2], 5]],
                                     "pages_to_release": [7], "namespace": "kv"})
    assert (r.status_code, r.content) == (204, b"")
    assert client.get_page_indices(0, keys[:3]) == [7, 6, 5]
    assert client.reserve_and_allocate_page_indices(0, [(keys[3], "")]) == [(False, 4)]
    client.confirm_write(0, [], [4])
    # Confirming the same pair again is a no-op.
    client.confirm_write(0, [(keys[2], 5)], [])
    assert space_stats(kv, 0, "kv") == {"num_pages": 8, "free": 5, "reserved": 0,
                                        "committed": 3, "keys": 3}
    # A duplicate key in one reserve batch gets one page, answered at every position.
    assert client.reserve_and_allocate_page_indices(0, [(keys[4], ""), (keys[4], "")]) == [
        (False, 4), (False, 4)]
    client.confirm_write(0, [(keys[4], 4)], [])
    assert space_stats(kv, 0, "kv")["free"] == 4
    # Re-initializing with another size: the file layout changed, the pool is re-created and
    # its keys are dropped (never served from a stale offset).
    r = raw(kv, "/0/initialize", {"num_pages": 16, "namespace": "kv"})
    assert r.status_code == 204
    assert space_stats(kv, 0, "kv") == {"num_pages": 16, "free": 16, "reserved": 0,
                                        "committed": 0, "keys": 0}
    assert hc.batch_exists(keys) == 0


def test_the_client_reconnects_without_an_error_after_an_idle_close(sgl, kvpages_server):
    """A short `--idle-timeout` closes SGLang's pooled connection between calls; its own client
    (requests + urllib3's pool) notices before reusing it: every call succeeds at the first try."""
    url = kvpages_server("--idle-timeout", "0.5")
    c = sgl.Hf3fsGlobalMetadataClient(url)
    histories = record_retries(c)
    keys = chain(6, "idle")
    try:
        c.initialize(0, 64)
        for i in range(3):
            pair = keys[2 * i : 2 * i + 2]
            got = c.reserve_and_allocate_page_indices(0, [(k, "") for k in pair])
            assert [written for written, _ in got] == [False, False], got
            c.confirm_write(0, [(k, page) for k, (_, page) in zip(pair, got)], [])
            assert c.exists(0, pair) == [True, True]
            time.sleep(1.2)  # past the idle timeout: the server closes the pooled connection
    finally:
        c._session.close()
    assert len(histories) == 1 + 3 * 3 and all(h == () for h in histories), histories
    assert metric(url, 'kvpages_connections_closed_total{reason="idle"}') >= 3
