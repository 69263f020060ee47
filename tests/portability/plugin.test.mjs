// kvpages' plugin component in jco (JavaScript's component-model host, on Node.js): the same
// component the server embeds, driven through its WIT exports with no Rust on this side.
// `cargo xtask test` runs this with KVPAGES_PLUGIN_WASM set; alone: `node --test` in this folder
// after `cargo xtask plugin` and `npm ci`.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { readFile, mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pathToFileURL, fileURLToPath } from 'node:url';
import { transpileBytes, writeFiles } from '@bytecodealliance/jco-transpile';

const here = fileURLToPath(new URL('.', import.meta.url));
const wasm = process.env.KVPAGES_PLUGIN_WASM ?? join(here, '../../target/plugin/kvpages_plugin.wasm');

/** Keys as `packed-keys`: each is its UTF-8 length as a little-endian u16, then the bytes. */
function pack(keys) {
  const parts = keys.map((k) => new TextEncoder().encode(k));
  const out = new Uint8Array(parts.reduce((n, p) => n + 2 + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out[at] = p.length & 0xff;
    out[at + 1] = p.length >> 8;
    out.set(p, at + 2);
    at += 2 + p.length;
  }
  return out;
}

/**
 * `allocate`'s `packed-allocations`: two words a distinct key, the index (bit 31: a cache hit)
 * and the page (0xffffffff: none).
 */
function unpackAllocations(words) {
  const out = [];
  for (let i = 0; i < words.length; i += 2) {
    const [w, page] = [words[i], words[i + 1]];
    out.push({ index: w & 0x7fffffff, page: page === 0xffffffff ? undefined : page, cached: w >= 0x80000000 });
  }
  return out;
}

/** The WIT `error` a call threw (jco throws the variant itself, or wraps it in `payload`). */
const payload = (e) => e.payload ?? e;

async function load() {
  const { files, imports } = await transpileBytes(await readFile(wasm), { name: 'kvpages' });
  assert.deepEqual(imports, [], 'the plugin imports nothing');
  const dir = await mkdtemp(join(tmpdir(), 'kvpages-jco-'));
  await writeFiles(files, { baseDir: dir });
  const mod = await import(pathToFileURL(join(dir, 'kvpages.js')).href);
  return { engine: mod.engine, cleanup: () => rm(dir, { recursive: true, force: true }) };
}

const settings = {
  reservationTtl: 60000n,
  worldSize: 2,
  readLease: 5000n,
  quarantine: 60000n,
  eviction: 'off',
  evictHighPermille: 950,
  evictLowPermille: 900,
};
const vllm = { tag: 'vllm' };

test('allocate, confirm, exists, locations in jco on Node.js', async () => {
  const { engine, cleanup } = await load();
  try {
    engine.create(7n, settings);
    for (const rank of [0, 1]) {
      assert.deepEqual(engine.initialize(1n, vllm, rank, 1024), { tag: 'created', val: false });
    }
    const keys = ['386b2d9cf5aa91ba3a4b42c35396c822', 'k-two', 'k-two'];
    for (const rank of [0, 1]) {
      const got = engine.allocate(2n, vllm, rank, pack(keys));
      assert.deepEqual([...got], [0, 0, 1, 1]);
      assert.deepEqual(
        unpackAllocations(got).map((a) => [a.index, a.page, a.cached]),
        [[0, 0, false], [1, 1, false]],
      );
      const report = engine.confirm(3n, vllm, rank, pack(keys.slice(0, 2)), new Uint32Array([0, 1]), new Uint32Array([]));
      assert.equal(report.committed, 2);
      assert.deepEqual(report.refused, []);
    }
    assert.deepEqual(engine.exists(4n, vllm, pack([...keys, 'missing'])), [true, true, true, false]);
    assert.deepEqual(engine.locations(5n, vllm, 1, pack(['k-two', 'missing'])), [1, undefined]);
    const info = engine.inspect(6n, vllm, 'k-two');
    assert.deepEqual(info.pages, [{ rank: 0, page: 1 }, { rank: 1, page: 1 }]);
    assert.equal(info.complete, true);
    const stats = engine.stats(7n);
    assert.equal(stats.spaces[0].keys, 2n);
    assert.equal(stats.spaces[0].ranks[0].pages.committed, 2);
  } finally {
    await cleanup();
  }
});

test('domain errors arrive as the WIT error variant', async () => {
  const { engine, cleanup } = await load();
  try {
    engine.create(7n, settings);
    assert.throws(() => engine.allocate(1n, vllm, 0, pack(['k'])), (e) => {
      assert.deepEqual(payload(e), { tag: 'rank-not-initialized', val: 0 });
      return true;
    });
    assert.throws(() => engine.initialize(1n, vllm, 5, 8), (e) => {
      assert.deepEqual(payload(e), { tag: 'rank-outside-world', val: { rank: 5, worldSize: 2 } });
      return true;
    });
    assert.throws(() => engine.exists(1n, vllm, new Uint8Array([9, 0, 1])), (e) => {
      assert.equal(payload(e).tag, 'invalid-input');
      return true;
    });
  } finally {
    await cleanup();
  }
});

test('a snapshot taken in jco restores there', async () => {
  const { engine, cleanup } = await load();
  try {
    engine.create(7n, { ...settings, worldSize: undefined });
    engine.initialize(1n, vllm, 0, 16);
    const [a] = unpackAllocations(engine.allocate(2n, vllm, 0, pack(['k'])));
    engine.confirm(3n, vllm, 0, pack(['k']), new Uint32Array([a.page]), new Uint32Array([]));
    // Allocated again once complete: a cache hit on its page (bit 31 of the index word).
    assert.deepEqual([...engine.allocate(3n, vllm, 0, pack(['k']))], [0x80000000, a.page]);
    const snap = engine.snapshot();
    engine.clear(4n, vllm);
    assert.deepEqual(engine.exists(5n, vllm, pack(['k'])), [false]);
    engine.restore(snap);
    assert.deepEqual(engine.exists(6n, vllm, pack(['k'])), [true]);
  } finally {
    await cleanup();
  }
});
