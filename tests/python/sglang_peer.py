"""SGLang's own HF3FS metadata server and client (the peer), fetched at test time.

Nothing of SGLang is committed: `sglang_source()` downloads the SGLang 0.5.23 wheel (~39 MB) with
pip into `<repo>/target/peers/` (git-ignored; once) through `peer.fetch_member()` and extracts
`sglang/srt/mem_cache/storage/hf3fs/mini_3fs_metadata_server.py`, which holds the FastAPI server
(`Hf3fsMetadataServer`) and SGLang's client (`Hf3fsGlobalMetadataClient`: requests with urllib3's
`Retry(total=3, backoff_factor=0.3, status_forcelist=[500, 502, 503, 504])`, orjson bodies).

That file imports two names from the rest of SGLang, whose modules pull in torch:
`PoolName` (`sglang.srt.mem_cache.hicache_storage`) and `Hf3fsMetadataInterface`
(`sglang.srt.mem_cache.storage.hf3fs.storage_hf3fs`). `write_shim()` generates tiny stand-ins
for those two modules — our own code, written by this file at run time — into
`target/peers/sglang-0.5.23/shim/`; the server subprocess gets that directory on PYTHONPATH and
the in-process import of the client gets it on `sys.path`.

Every failure raises `peer.PeerError` with a message saying what to do; the tests turn it into a
failure (never a skip).
"""

import hashlib
import os
from pathlib import Path

import requests

import peer as peer_mod
from peer import PEERS_DIR, PeerError, PeerServer

SGLANG_VERSION = "0.5.23"
MEMBER = "sglang/srt/mem_cache/storage/hf3fs/mini_3fs_metadata_server.py"
HOME = PEERS_DIR / f"sglang-{SGLANG_VERSION}"
SCRIPT = HOME / "mini_3fs_metadata_server.py"
SHIM_DIR = HOME / "shim"

# The text of SGLang's 404 for a rank:namespace nobody initialized (kvpages keeps it).
NOT_INITIALIZED = "Rank {rank} namespace '{ns}' not initialized. Please call /{rank}/initialize first."

_SHIM = {
    "sglang/__init__.py": '"""Stand-in package written by kvpages\' tests (sglang_peer.py); not SGLang."""\n',
    "sglang/srt/__init__.py": "",
    "sglang/srt/mem_cache/__init__.py": "",
    "sglang/srt/mem_cache/storage/__init__.py": "",
    "sglang/srt/mem_cache/storage/hf3fs/__init__.py": "",
    "sglang/srt/mem_cache/hicache_storage.py": '''"""Stand-in for SGLang's module (written by kvpages' tests): only `PoolName`."""

from enum import Enum


class PoolName(str, Enum):
    """Pool names; the metadata client sends `str(namespace)`, the value."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    AUXILIARY_SWA = "auxiliary_swa"
    INDEXER = "indexer"
    DRAFT = "draft"
    DRAFT_INDEXER = "draft_indexer"
    DRAFT_SWA = "draft_swa"

    def __str__(self) -> str:
        return self.value
''',
    "sglang/srt/mem_cache/storage/hf3fs/storage_hf3fs.py": '''"""Stand-in for SGLang's module (written by kvpages' tests): only the metadata interface."""

from abc import ABC, abstractmethod

from sglang.srt.mem_cache.hicache_storage import PoolName


class Hf3fsMetadataInterface(ABC):
    @abstractmethod
    def initialize(self, rank, num_pages, namespace=PoolName.KV): ...

    @abstractmethod
    def reserve_and_allocate_page_indices(self, rank, keys, namespace=PoolName.KV): ...

    @abstractmethod
    def confirm_write(self, rank, written_keys_to_confirm, pages_to_release, namespace=PoolName.KV): ...

    @abstractmethod
    def get_page_indices(self, rank, keys, namespace=PoolName.KV): ...

    @abstractmethod
    def delete_keys(self, rank, keys, namespace=PoolName.KV): ...

    @abstractmethod
    def exists(self, rank, keys, namespace=PoolName.KV): ...

    @abstractmethod
    def clear(self, rank, namespace=PoolName.KV): ...
''',
}


def sglang_source(say=print) -> Path:
    """Path of SGLang 0.5.23's `mini_3fs_metadata_server.py`, downloading and extracting it if
    needed. `KVPAGES_SGLANG_PEER_SCRIPT=/path/to/file.py` uses that file instead."""
    return peer_mod.script_from_env("KVPAGES_SGLANG_PEER_SCRIPT", say) or peer_mod.fetch_member(
        "sglang", SGLANG_VERSION, MEMBER, SCRIPT, "~39 MB", say,
        what="SGLang's metadata server, which the SGLang tests run against",
    )


def write_shim() -> Path:
    """Writes the stand-in modules (see the module docstring); returns the directory to import from."""
    for rel, text in _SHIM.items():
        path = SHIM_DIR / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text() != text:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)
    return SHIM_DIR


def load_client_module(script: Path):
    """Imports SGLang's file (for `Hf3fsGlobalMetadataClient` and the shim's `PoolName`)."""
    shim = write_shim()
    module = peer_mod.load_peer_module(script, "sglang_mini_3fs_metadata_server", path=shim)
    module.PoolName.KV  # the stand-in resolved
    return module


def _ready(url: str):
    """SGLang's server has no health route: a fresh one answers 404 with its JSON detail."""
    r = requests.post(f"{url}/0/exists", data=b'{"keys":[]}', timeout=1)
    want = NOT_INITIALIZED.format(rank=0, ns="kv")
    if r.status_code == 404 and r.headers.get("content-type", "").startswith("application/json"):
        if r.json().get("detail") == want:
            return True, None
    return False, f"POST /0/exists answered {r.status_code} {r.text[:200]!r}"


def sglang_server(script: Path) -> PeerServer:
    """A (not yet started) `PeerServer` for SGLang's file, with the shim on its PYTHONPATH."""
    shim = write_shim()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH", "")) if p)
    return PeerServer(script, name="SGLang's metadata server", ready=_ready, env=env,
                      log_prefix="sglang-peer-")


def prepare(say=print):
    """Download/extract, dependencies, import: returns (script, module). Raises `PeerError`."""
    script = sglang_source(say)
    peer_mod.ensure_peer_deps(say)
    try:
        module = load_client_module(script)
    except Exception as e:  # an import error in the extracted file, say
        raise PeerError(f"could not import {script} with the stand-in modules of {SHIM_DIR}: "
                        f"{type(e).__name__}: {e}") from e
    return script, module



# --------------------------------------------------------------------------------------------
# The caller: HiCacheHF3FS's use of the metadata client (storage_hf3fs.py), over a fake 3FS file
# --------------------------------------------------------------------------------------------


class Recorder:
    """Wraps a metadata client; keeps (method, args, kwargs, result) of every call."""

    def __init__(self, client):
        self.client = client
        self.calls = []

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            result = method(*args, **kwargs)
            self.calls.append((name, args, {k: str(v) for k, v in kwargs.items()}, result))
            return result

        return call


class HiCache:
    """The metadata calls of SGLang 0.5.23's `HiCacheHF3FS`, made exactly as `storage_hf3fs.py`
    makes them, over an in-memory stand-in for each pool's 3FS file (`bytes_per_page` bytes a
    page), so that a test can check that what a get reads is what the set wrote for that key.

    - `batch_set` (`_batch_set`; `_pool_batch_set` for another pool): one reserve with
      `[(key, ""), ...]`; entries already written or with page -1 are skipped; the others are
      written at `page * bytes_per_page` (`value(key, pool)`; keys in `fail_writes` fail); then one
      `confirm_write(ok pairs, failed pages)` if either is non-empty. Returns per-key results
      as the caller does (`is_written` for skipped entries, else the write's success).
    - `batch_get` (`_batch_get` / `_pool_batch_get`): one `get_page_indices`; null pages are not
      read; returns the bytes read (None where nothing was).
    - `batch_exists`: one `exists`, counting leading trues (`// 2` with MHA zero-copy keys).
    - `delete`, `exists`, `clear` (`clear` clears the kv pool and then every other pool).
    Pools other than kv use the caller's component keys `f"{key}_{pool}"`.
    """

    def __init__(self, client, pool_name_cls, rank: int, num_pages: int, pools=None,
                 bytes_per_page: int = 32):
        self.client = client
        self.PoolName = pool_name_cls
        self.rank = rank
        self.bpp = bytes_per_page
        self.fail_writes = set()
        self.files = {pool_name_cls.KV: bytearray(num_pages * bytes_per_page)}
        client.initialize(rank, num_pages)
        for name, n in (pools or {}).items():
            self.files[name] = bytearray(n * bytes_per_page)
            client.initialize(rank, n, namespace=name)

    def component(self, key: str, pool) -> str:
        return key if pool == self.PoolName.KV else f"{key}_{str(pool)}"

    def value(self, key: str, pool) -> bytes:
        """The page a set writes for `key` in `pool` (distinct for every key and pool)."""
        seed = f"{str(pool)}|{key}".encode()
        out = b""
        while len(out) < self.bpp:
            out += hashlib.sha256(seed + len(out).to_bytes(4, "little")).digest()
        return out[: self.bpp]

    def _ns(self, pool):
        return {} if pool == self.PoolName.KV else {"namespace": pool}

    def batch_set(self, keys, pool=None) -> list:
        pool = self.PoolName(pool or self.PoolName.KV)
        blocks = list(keys)
        keys = [self.component(k, pool) for k in blocks]
        indices = self.client.reserve_and_allocate_page_indices(
            self.rank, [(k, "") for k in keys], **self._ns(pool))
        assert len(indices) == len(keys), (len(indices), len(keys))
        written, released = [], []
        results = [index[0] for index in indices]
        file = self.files[pool]
        for i, (is_written, page) in enumerate(indices):
            if is_written or page == -1:
                continue
            key = keys[i]
            ok = blocks[i] not in self.fail_writes
            if ok:
                file[page * self.bpp:(page + 1) * self.bpp] = self.value(blocks[i], pool)
                written.append((key, page))
            else:
                released.append(page)
            results[i] = ok
        if written or released:
            self.client.confirm_write(self.rank, written, released, **self._ns(pool))
        return results

    def batch_get(self, keys, pool=None) -> list:
        pool = self.PoolName(pool or self.PoolName.KV)
        keys = [self.component(k, pool) for k in keys]
        pages = self.client.get_page_indices(self.rank, keys, **self._ns(pool))
        assert len(pages) == len(keys)
        file = self.files[pool]
        return [None if p is None else bytes(file[p * self.bpp:(p + 1) * self.bpp]) for p in pages]

    def batch_exists(self, keys, pool=None, mha_zero_copy: bool = False) -> int:
        pool = self.PoolName(pool or self.PoolName.KV)
        factor = 1
        if mha_zero_copy:
            keys = [f"{k}-{kv}" for k in keys for kv in ("k", "v")]
            factor = 2
        keys = [self.component(k, pool) for k in keys]
        results = self.client.exists(self.rank, keys, **self._ns(pool))
        i = 0
        while i < len(keys) and results[i]:
            i += 1
        return i // factor

    def exists(self, key: str) -> bool:
        result = self.client.exists(self.rank, [key])
        return result[0] if result else False

    def delete(self, key: str, pool=None) -> None:
        pool = self.PoolName(pool or self.PoolName.KV)
        self.client.delete_keys(self.rank, [self.component(key, pool)], **self._ns(pool))

    def clear(self) -> None:
        self.client.clear(self.rank)
        for name in self.files:
            if name != self.PoolName.KV:
                self.client.clear(self.rank, namespace=name)
