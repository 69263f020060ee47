// The simulator page in a real browser: starts `kvpages serve --in-memory`, opens /simulator/ in
// Debian's headless Chromium through playwright-core, drives every control, and checks that the
// numbers the page shows equal what the core computes natively for the same scenario
// (`kvpages-sim replay FILE`). Fails on any console error or page error.
//
// Run: `node simulator.test.mjs` in this folder after `npm ci`, with the server and kvpages-sim
// built (env KVPAGES_BIN, KVPAGES_SIM_BIN, CHROMIUM override the paths). Prints "N passed, M failed"
// last and exits non-zero on any failure. Artifacts: target/browser/ (screenshots, the scenario).
import { spawn, execFile } from 'node:child_process';
import { mkdtemp, mkdir, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import assert from 'node:assert/strict';
import { chromium } from 'playwright-core';

const here = dirname(fileURLToPath(import.meta.url));
const root = resolve(here, '../..');
const BIN = process.env.KVPAGES_BIN ?? join(root, 'target/debug/kvpages');
const SIM_BIN = process.env.KVPAGES_SIM_BIN ?? join(root, 'target/debug/kvpages-sim');
const CHROMIUM = process.env.CHROMIUM ?? '/usr/bin/chromium';
const OUT = join(root, 'target/browser');
const run = promisify(execFile);

// ---------------------------------------------------------------------------------------------
// A tiny sequential runner: every check runs in order on one page; a failed check is counted and
// the next ones still run (those that need what it set up fail on their own).

const results = [];
async function check(name, fn) {
  const t0 = Date.now();
  try {
    await fn();
    results.push({ name, ok: true });
    console.log(`ok   ${name} (${Date.now() - t0} ms)`);
  } catch (e) {
    results.push({ name, ok: false });
    console.log(`FAIL ${name} (${Date.now() - t0} ms)\n     ${String(e && e.stack ? e.stack : e).split('\n').slice(0, 6).join('\n     ')}`);
  }
}

function freePort() {
  return new Promise((res, rej) => {
    const s = createServer();
    s.on('error', rej);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => res(port));
    });
  });
}

async function waitHttp(url, ms) {
  const end = Date.now() + ms;
  for (;;) {
    try {
      const r = await fetch(url);
      if (r.ok) return;
    } catch {
      // not listening yet
    }
    if (Date.now() > end) throw new Error(`${url} did not answer within ${ms} ms`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

// ---------------------------------------------------------------------------------------------
// Reading the page

/** A number as the page shows it: "12,345" -> 12345; "–" -> null. */
function parseShown(text) {
  const t = text.trim().replace(/,/g, '');
  if (t === '–' || t === '') return null;
  const n = Number(t);
  assert.ok(Number.isFinite(n), `not a number on the page: ${JSON.stringify(text)}`);
  return n;
}

const RANK_FIELDS = ['numPages', 'free', 'reserved', 'committed', 'leased', 'quarantined'];

/** Every figure the page shows, in the shape of stats() (read from the DOM text, not from JS). */
async function shown(page) {
  return page.evaluate((RANK_FIELDS) => {
    const text = (id) => document.getElementById(id)?.textContent ?? null;
    const ranks = [];
    for (let r = 0; document.getElementById(`rankstats-${r}`); r++) {
      const o = { rank: r };
      for (const k of RANK_FIELDS) o[k] = text(`rank-${r}-${k}`);
      ranks.push(o);
    }
    const counters = {};
    for (const el of document.querySelectorAll('#all-counters b[id^="counter-"]')) {
      counters[el.id.slice('counter-'.length)] = el.textContent;
    }
    const card = (k) => text(`stat-${k}`);
    return {
      clock: text('clock'),
      requests: card('requests'),
      keys: card('keys'),
      pendingKeys: card('pendingKeys'),
      ranks,
      counters,
      workload: { lookups: card('lookups'), lookupHits: card('lookupHits'), allocFailures: card('allocFailures') },
      totals: {
        free: card('free'),
        reserved: card('reserved'),
        committed: card('committed'),
        leased: card('leased'),
        quarantined: card('quarantined'),
        evictions: card('evictions'),
        leaks: card('leaks'),
      },
    };
  }, RANK_FIELDS).then((s) => {
    const m = /^t = ([\d,]+) ms$/.exec(s.clock ?? '');
    assert.ok(m, `clock text: ${s.clock}`);
    const n = (o) => Object.fromEntries(Object.entries(o).map(([k, v]) => [k, k === 'rank' ? v : parseShown(v)]));
    return {
      now: parseShown(m[1]),
      requests: parseShown(s.requests),
      keys: parseShown(s.keys),
      pendingKeys: parseShown(s.pendingKeys),
      ranks: s.ranks.map(n),
      counters: n(s.counters),
      workload: n(s.workload),
      totals: n(s.totals),
    };
  });
}

/** The part of native stats() the page shows for a replayed scenario (workload figures aside). */
function coreFigures(s) {
  return {
    now: s.now,
    requests: s.requests,
    keys: s.keys,
    pendingKeys: s.pendingKeys,
    ranks: s.ranks.map((r) => Object.fromEntries(['rank', ...RANK_FIELDS].map((k) => [k, r[k]]))),
    counters: s.counters,
    workload: s.workload,
  };
}

const sum = (ranks, k) => ranks.reduce((n, r) => n + r[k], 0);

/** The totals cards must agree with the per-rank rows they sum. */
function assertTotals(s) {
  for (const k of ['free', 'reserved', 'committed', 'leased', 'quarantined']) {
    assert.equal(s.totals[k], sum(s.ranks, k), `total ${k}`);
  }
  for (const r of s.ranks) {
    // Leased pages are committed pages whose key holds a read lease: a subset.
    assert.equal(r.free + r.reserved + r.committed + r.quarantined, r.numPages, `rank ${r.rank}: states add up to its pages`);
    assert.ok(r.leased <= r.committed, `rank ${r.rank}: leased <= committed`);
  }
  assert.equal(s.totals.evictions, s.counters.evictions);
  assert.equal(s.totals.leaks, s.counters.expiredReservations);
}

const idle = (page, ms = 60000) => page.waitForFunction(() => document.body.dataset.state === 'idle', null, { timeout: ms });
const text = (page, sel) => page.textContent(sel).then((t) => t.trim());

async function setConfig(page, c) {
  const ids = {
    ranks: 'cfg-ranks',
    seed: 'cfg-seed',
    pagesPerRank: 'cfg-pages',
    reservationTtlMs: 'cfg-ttl',
    readLeaseMs: 'cfg-lease',
    quarantineMs: 'cfg-quarantine',
    evictHighPermille: 'cfg-high',
    evictLowPermille: 'cfg-low',
    worldSize: 'cfg-world',
  };
  for (const [k, id] of Object.entries(ids)) if (k in c) await page.fill(`#${id}`, String(c[k] ?? ''));
  if (c.eviction) await page.selectOption('#cfg-eviction', c.eviction);
}

async function setWorkload(page, w) {
  await page.selectOption('#wl-kind', w.kind);
  const ids = { seed: 'wl-seed', stepMs: 'wl-stepms', blocks: 'wl-blocks', prompts: 'wl-prompts', zipf: 'wl-zipf', prefixBlocks: 'wl-prefix', chats: 'wl-chats', crashRate: 'wl-crash' };
  for (const [k, id] of Object.entries(ids)) if (k in w) await page.fill(`#${id}`, String(w[k]));
}

async function steps(page, n) {
  await page.fill('#step-count', String(n));
  await page.click('#step');
  await idle(page, 120000);
}

async function send(page, method, path, body) {
  await page.selectOption('#cmd-method', method);
  await page.fill('#cmd-path', path);
  await page.fill('#cmd-body', typeof body === 'string' ? body : JSON.stringify(body));
  await page.click('#cmd-send');
  return { status: Number(await text(page, '#cmd-status')), body: await page.getAttribute('#cmd-reply', 'data-raw') };
}

/** The same request to the real server: `{status, body}` as `kvpages serve` answers it. */
async function serverSend(base, method, path, body) {
  const text_ = typeof body === 'string' ? body : JSON.stringify(body);
  const r = await fetch(`${base}${path}`, { method, body: method === 'GET' || method === 'HEAD' ? undefined : text_ });
  return { status: r.status, body: await r.text() };
}

/** Sends through the page's command box and to the server; both answers must be identical. */
async function sendBoth(page, base, method, path, body) {
  const fromPage = await send(page, method, path, body);
  const fromServer = await serverSend(base, method, path, body);
  assert.deepEqual(fromPage, fromServer, `${method} ${path}: the page's reply differs from kvpages serve's`);
  return fromPage;
}

const canvasData = (page, id) => page.evaluate((id) => document.getElementById(id).toDataURL(), id);

// ---------------------------------------------------------------------------------------------

async function main() {
  await mkdir(OUT, { recursive: true });
  const port = await freePort();
  // World size 3: the server mirrors the page's 3-rank cluster for the hand commands.
  const server = spawn(BIN, ['serve', '--in-memory', '--host', '127.0.0.1', '--port', String(port), '--world-size', '3'], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  let serverLog = '';
  server.stderr.on('data', (d) => {
    serverLog = (serverLog + d).slice(-4000);
  });
  const base = `http://127.0.0.1:${port}`;
  const profile = await mkdtemp(join(tmpdir(), 'kvpages-chromium-'));
  let browser;
  const problems = []; // console errors and page errors, all fatal for the run
  try {
    await waitHttp(`${base}/health`, 30000);
    browser = await chromium.launchPersistentContext(profile, {
      executablePath: CHROMIUM,
      headless: true,
      acceptDownloads: true,
      viewport: { width: 1440, height: 1000 },
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update', '--disable-sync', '--no-first-run', '--disable-quic'],
    });
    const page = browser.pages()[0] ?? (await browser.newPage());
    page.on('console', (m) => {
      if (m.type() === 'error') problems.push(`console error: ${m.text()}`);
    });
    page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
    const wasmTypes = [];
    page.on('response', (r) => {
      if (r.url().endsWith('.wasm')) wasmTypes.push(r.headers()['content-type']);
      if (r.status() >= 400) problems.push(`HTTP ${r.status()} for ${r.url()}`);
    });
    await body(page, base, wasmTypes);
  } catch (e) {
    results.push({ name: 'setup', ok: false });
    console.log(`FAIL setup: ${e.stack ?? e}\n${serverLog}`);
  } finally {
    await check('no console error, page error or failed request', () => {
      assert.deepEqual(problems, []);
    });
    if (browser) await browser.close();
    server.kill('SIGTERM');
    await rm(profile, { recursive: true, force: true });
  }
  const passed = results.filter((r) => r.ok).length;
  const failed = results.length - passed;
  console.log(`\n${passed} passed, ${failed} failed`);
  process.exitCode = failed === 0 && passed > 0 ? 0 : 1;
}

async function body(page, base, wasmTypes) {
  await check('the page loads the wasm module from /simulator/pkg/ and builds the default simulator', async () => {
    await page.goto(`${base}/simulator/`);
    await idle(page, 30000);
    assert.equal(await page.isVisible('#fatal'), false);
    assert.ok(wasmTypes.length >= 1 && wasmTypes.every((t) => t.startsWith('application/wasm')), `wasm content types: ${wasmTypes}`);
    const s = await shown(page);
    assert.equal(s.ranks.length, 2);
    assert.deepEqual(s.ranks.map((r) => r.numPages), [4096, 4096]);
    assert.equal(s.totals.free, 8192);
    assert.equal(s.now, 0);
    assert.equal(await page.locator('#maps canvas').count(), 2);
  });

  await check('page count calculator: floor(file / page), from the model shape too, "use" fills pages per rank', async () => {
    await page.click('#calc > summary');
    await page.fill('#calc-file', '1');
    await page.selectOption('#calc-file-unit', { label: 'GiB' });
    await page.fill('#calc-page', '256');
    await page.selectOption('#calc-page-unit', { label: 'KiB' });
    assert.equal(await text(page, '#calc-result'), '4,096 pages');
    await page.fill('#calc-page', '300');
    assert.equal(await text(page, '#calc-result'), '3,495 pages'); // floor(2^30 / 307200)
    await page.selectOption('#calc-file-unit', { label: 'MiB' });
    assert.equal(await text(page, '#calc-result'), '3 pages'); // floor(2^20 / 307200)
    await page.selectOption('#calc-file-unit', { label: 'GiB' });
    await page.fill('#calc-file', '0.0001');
    assert.match(await text(page, '#calc-result'), /^0 /);
    assert.equal(await page.isDisabled('#calc-use'), true);
    await page.fill('#calc-file', '1');
    await page.click('#calc-model > summary');
    // 2 (K and V) x 32 layers x 8 heads x 128 dims x 16 tokens x 2 bytes, heads split over 2 ranks.
    assert.match(await text(page, '#m-result'), /^1,048,576 B/);
    await page.uncheck('#m-tp');
    assert.match(await text(page, '#m-result'), /^2,097,152 B/);
    await page.selectOption('#m-dtype', '1');
    await page.fill('#m-layers', '61');
    await page.fill('#m-heads', '1');
    await page.fill('#m-dim', '576');
    await page.fill('#m-block', '64');
    assert.match(await text(page, '#m-result'), /^4,497,408 B/); // 2*61*1*576*64*1 (an MLA-like shape)
    await page.click('#m-use');
    assert.equal(await page.inputValue('#calc-page'), '4497408');
    assert.equal(await text(page, '#calc-result'), '238 pages'); // floor(2^30 / 4497408)
    await page.click('#calc-use');
    assert.equal(await page.inputValue('#cfg-pages'), '238');
    assert.match(await text(page, '#config-dirty'), /Apply/);
  });

  await check('a bad config is refused with the field named, and the running simulator stays', async () => {
    await page.fill('#cfg-ranks', '0');
    await page.click('#apply');
    assert.equal(await page.isVisible('#config-error'), true);
    assert.match(await text(page, '#config-error'), /ranks/);
    assert.equal(await page.locator('#maps canvas').count(), 2);
    assert.equal((await shown(page)).totals.free, 8192);
  });

  const cfg = { ranks: 3, seed: 42, pagesPerRank: 2000, eviction: 'lru', evictHighPermille: 900, evictLowPermille: 800, reservationTtlMs: 3000, readLeaseMs: 500, quarantineMs: 2000, worldSize: 3 };
  let fresh;
  await check('Apply rebuilds the simulator with the configured cluster and policy', async () => {
    await setConfig(page, cfg);
    await page.click('#apply');
    assert.equal(await page.isVisible('#config-error'), false);
    assert.equal(await text(page, '#config-dirty'), '');
    assert.equal(await page.locator('#maps canvas').count(), 3);
    fresh = await shown(page);
    assert.deepEqual(fresh.ranks.map((r) => r.numPages), [2000, 2000, 2000]);
    assert.equal(fresh.totals.free, 6000);
    assertTotals(fresh);
    // The form shows the config the module holds (defaults filled), unchanged by the round trip.
    assert.equal(await page.inputValue('#cfg-world'), '3');
    assert.equal(await page.inputValue('#cfg-eviction'), 'lru');
    assert.equal(await page.inputValue('#cfg-ttl'), '3000');
  });

  const K1 = 'aaaabbbbccccddddaaaabbbbccccdddd';
  const K2 = 'browser-test-key-2';
  await check('hand commands: exact replies, the same as kvpages serve gives in the same state', async () => {
    // The server gets the page's cluster: 3 ranks of 2000 pages (world size 3, set at its start).
    for (const rank of [0, 1, 2]) {
      assert.equal((await serverSend(base, 'POST', `/rank/${rank}/initialize`, { num_pages: 2000 })).status, 200);
    }
    assert.deepEqual(await sendBoth(page, base, 'POST', '/keys/batch_allocate', { rank: 0, keys: [[K1, ''], [K2, ''], [K1, '']] }), {
      status: 200,
      body: JSON.stringify({ rank: 0, results: [[K1, 0], [K2, 1]] }),
    });
    assert.equal((await shown(page)).ranks[0].reserved, 2);
    assert.deepEqual(await sendBoth(page, base, 'POST', '/keys/confirm_write', { rank: 0, confirmations: [[K1, 0]], pages_to_release: [1] }), { status: 204, body: '' });
    assert.equal(await text(page, '#cmd-reply'), '(empty body)');
    // World size 3: a key confirmed on rank 0 only is not stored yet.
    assert.deepEqual(await sendBoth(page, base, 'POST', '/keys/batch_exists', { keys: [K1, K2] }), { status: 200, body: '{"exists":[false,false]}' });
    for (const rank of [1, 2]) {
      const a = await sendBoth(page, base, 'POST', '/keys/batch_allocate', { rank, keys: [[K1, '']] });
      assert.deepEqual(a, { status: 200, body: JSON.stringify({ rank, results: [[K1, 0]] }) });
      assert.deepEqual(await sendBoth(page, base, 'POST', '/keys/confirm_write', { rank, confirmations: [[K1, 0]] }), { status: 204, body: '' });
    }
    assert.deepEqual(await sendBoth(page, base, 'POST', '/keys/batch_exists', { keys: [K1, K2] }), { status: 200, body: '{"exists":[true,false]}' });
    assert.deepEqual(await sendBoth(page, base, 'POST', '/keys/get_locations', { rank: 2, keys: [K1, K2] }), { status: 200, body: '{"locations":[0,null]}' });
    assert.match(await page.getAttribute('#cmd-status', 'class'), /ok/);
    const s = await shown(page);
    assert.equal(s.keys, 1);
    assertTotals(s);
    // get_locations leased page 0 of rank 2 for the read lease.
    assert.equal(s.ranks[2].leased, 1);
    assert.equal(s.ranks[0].committed, 1);
  });

  await check('hover on the page map names the page, its state, key and age', async () => {
    await page.hover('#map-2', { position: { x: 1, y: 1 } });
    const tip = page.locator('#tooltip');
    assert.equal(await tip.isVisible(), true);
    const t = await tip.textContent();
    assert.match(t, /rank 2 · page 0/);
    assert.match(t, /state leased/);
    assert.match(t, new RegExp(`key ${K1}`));
    assert.match(t, /age [\d,]+ ms/);
    await page.mouse.move(5, 5);
    assert.equal(await tip.isVisible(), false);
  });

  await check('presets fill the command box; the event log shows the commands, filters errors, opens a row', async () => {
    await page.selectOption('#cmd-preset', { index: 1 });
    assert.equal(await page.inputValue('#cmd-path'), '/keys/batch_exists');
    assert.deepEqual(JSON.parse(await page.inputValue('#cmd-body')), { keys: ['386b2d9cf5aa91ba3a4b42c35396c822'] });
    const rows = page.locator('#events tbody tr');
    const n = await rows.count();
    assert.ok(n >= 10, `event rows: ${n}`);
    // Newest first: the get_locations.
    assert.match(await rows.nth(0).textContent(), /^\d+0POST \/keys\/get_locations \{.*\}200\{"locations":\[0,null\]\}$/);
    await page.check('#events-errors');
    assert.equal(await rows.count(), 0, 'no error so far');
    await page.uncheck('#events-errors');
    await page.selectOption('#events-n', '20');
    assert.equal(await rows.count(), Math.min(20, n));
    await page.selectOption('#events-n', '50');
    await rows.nth(0).click();
    assert.equal(await page.inputValue('#cmd-path'), '/keys/get_locations');
    assert.deepEqual(JSON.parse(await page.inputValue('#cmd-body')), { rank: 2, keys: [K1, K2] });
  });

  await check('Reset gives a fresh simulator with the applied config', async () => {
    await page.click('#reset');
    const s = await shown(page);
    assert.deepEqual(s, fresh);
    assert.equal(await page.locator('#events tbody tr').count(), fresh.requests);
  });

  const wl = { kind: 'crashing-writers', seed: 7, stepMs: 50, blocks: 8, prompts: 300, zipf: 1.1, prefixBlocks: 6, crashRate: 0.3 };
  await check('workload form: per-kind fields, "changed" until a Step sets it, Step runs one step', async () => {
    await page.selectOption('#wl-kind', 'multi-turn');
    assert.equal(await page.isVisible('#wl-chats'), true);
    assert.equal(await page.isVisible('#wl-crash'), false);
    await setWorkload(page, wl);
    assert.equal(await page.isVisible('#wl-chats'), false);
    assert.equal(await page.isVisible('#wl-crash'), true);
    assert.equal(await page.isVisible('#wl-prompts'), true);
    assert.match(await text(page, '#wl-active'), /no workload set/);
    await steps(page, 1);
    assert.match(await text(page, '#wl-active'), /^active: crashing-writers, seed 7/);
    const s = await shown(page);
    assert.ok(s.requests > fresh.requests, 'one step issues requests');
    assert.equal(s.now, fresh.now + wl.stepMs);
    await page.fill('#wl-blocks', '9');
    assert.match(await text(page, '#wl-active'), /^changed/);
    await page.fill('#wl-blocks', String(wl.blocks));
    assert.match(await text(page, '#wl-active'), /^active/);
  });

  await check('Step N runs N seeded steps; the counters, charts and per-rank rows agree', async () => {
    await steps(page, 399);
    const s = await shown(page);
    assert.equal(s.now, fresh.now + 400 * wl.stepMs);
    assertTotals(s);
    assert.ok(s.workload.lookups > 0);
    assert.equal(await text(page, '#stat-hitRate'), `${((s.workload.lookupHits / s.workload.lookups) * 100).toFixed(1)} %`);
    assert.ok(s.counters.expiredReservations > 0, 'crashing writers leave reservations that expire');
    assert.equal(parseShown(await text(page, '#chart-free-value')), s.totals.free);
    assert.equal(parseShown(await text(page, '#chart-leaks-value')), s.counters.expiredReservations);
    assert.equal(parseShown(await text(page, '#chart-allocFailures-value')), s.workload.allocFailures);
    assert.equal(parseShown(await text(page, '#chart-evictions-value')), s.counters.evictions);
    // Hovering a chart reads a sample back; the right edge is the latest one.
    const box = await page.locator('#chart-free canvas').boundingBox();
    await page.mouse.move(box.x + box.width - 2, box.y + box.height / 2);
    assert.equal(await text(page, '#chart-free-at'), `at ${s.now / 1000} s: ${s.totals.free.toLocaleString('en-US')}`);
    await page.mouse.move(5, 5);
    assert.equal(await text(page, '#chart-free-at'), '');
  });

  await check('speed control and Run/Pause run continuously (screenshot mid-run)', async () => {
    await page.fill('#speed', '0');
    await page.locator('#speed').dispatchEvent('input');
    assert.equal(await text(page, '#speed-value'), '1');
    await page.locator('#speed').evaluate((el) => {
      el.value = '4';
      el.dispatchEvent(new Event('input', { bubbles: true }));
    });
    assert.equal(await text(page, '#speed-value'), '20');
    const before = await shown(page);
    await page.click('#run');
    assert.equal(await text(page, '#run'), 'Pause');
    await page.waitForFunction(() => document.body.dataset.state === 'running');
    await page.waitForFunction((t) => Number(document.getElementById('clock').textContent.replace(/\D/g, '')) > t + 100 * 50, before.now);
    await page.screenshot({ path: join(OUT, 'simulator.png'), fullPage: true });
    await page.click('#run');
    await idle(page);
    assert.equal(await text(page, '#run'), 'Run');
    const a = await shown(page);
    assert.ok(a.now > before.now);
    assert.equal((a.now - before.now) % (wl.stepMs * 20), 0, 'whole frames of 20 steps');
    await page.waitForTimeout(200);
    assert.deepEqual(await shown(page), a, 'paused means nothing moves');
    // Space toggles Run too (outside form fields).
    await page.locator('#counters').click();
    await page.keyboard.press(' ');
    await page.waitForFunction(() => document.body.dataset.state === 'running');
    await page.keyboard.press(' ');
    await idle(page);
  });

  await check('Advance moves the clock; the next state-changing command takes expired reservations back', async () => {
    const before = await shown(page);
    await page.fill('#advance-ms', '10000');
    await page.click('#advance');
    const after = await shown(page);
    assert.equal(after.now, before.now + 10000);
    assert.deepEqual(after.ranks, before.ranks, 'moving the clock alone changes no page');
    assert.deepEqual(await send(page, 'POST', '/keys/batch_allocate', { rank: 0, keys: [] }), { status: 200, body: '{"rank":0,"results":[]}' });
    const fired = await shown(page);
    assert.equal(fired.ranks.reduce((n, r) => n + r.reserved, 0), 0, 'every reservation is past its TTL');
    assert.ok(fired.counters.expiredReservations >= before.counters.expiredReservations);
    assertTotals(fired);
  });

  let exported;
  let scenarioPath;
  let native;
  await check('Export downloads the scenario; kvpages-sim replays it natively to the numbers shown', async () => {
    const s = await shown(page);
    const [dl] = await Promise.all([page.waitForEvent('download'), page.click('#export')]);
    scenarioPath = join(OUT, 'scenario.json');
    await dl.saveAs(scenarioPath);
    assert.equal(dl.suggestedFilename(), `kvpages-scenario-crashing-writers-seed42-${s.requests}req.json`);
    exported = JSON.parse(await readFile(scenarioPath, 'utf8'));
    assert.equal(exported.format, 'kvpages-scenario 1');
    assert.equal(exported.config.ranks, 3);
    assert.equal(exported.config.pagesPerRank, 2000);
    assert.equal(exported.config.settings.worldSize, 3);
    assert.match(await text(page, '#scenario-status'), new RegExp(`^exported ${exported.log.length} actions, ${s.requests.toLocaleString('en-US')} requests`));
    // The actions since Reset: the workload, its steps (merged), the clock move, the hand command.
    assert.deepEqual(exported.log.map((a) => a.op), ['workload', 'step', 'advance', 'request']);
    assert.equal(exported.log[0].spec.kind, 'crashing-writers');
    assert.equal(exported.log[2].ms, 10000);
    const { stdout } = await run(SIM_BIN, ['replay', scenarioPath], { maxBuffer: 64 << 20 });
    native = JSON.parse(stdout);
    const page_ = { now: s.now, requests: s.requests, keys: s.keys, pendingKeys: s.pendingKeys, ranks: s.ranks, counters: s.counters, workload: s.workload };
    assert.deepEqual(page_, coreFigures(native));
    console.log(`     ${exported.log.length} actions, ${native.requests} requests; native: ${JSON.stringify(native.ranks.map((r) => r.free))} free, ${native.counters.expiredReservations} expired`);
  });

  await check('Import replays the exported scenario to the same numbers', async () => {
    const before = await shown(page);
    await page.click('#reset');
    assert.deepEqual(await shown(page), fresh);
    await page.setInputFiles('#import', scenarioPath);
    await page.waitForFunction(() => /^replayed/.test(document.getElementById('scenario-status').textContent), null, { timeout: 60000 });
    const s = await shown(page);
    const core = (x) => ({ now: x.now, requests: x.requests, keys: x.keys, pendingKeys: x.pendingKeys, ranks: x.ranks, counters: x.counters, workload: x.workload });
    assert.deepEqual(core(s), core(before));
    assert.equal(await page.inputValue('#cfg-ranks'), '3');
    assert.equal(await text(page, '#config-dirty'), '');
    await page.setInputFiles('#import', { name: 'bad.json', mimeType: 'application/json', buffer: Buffer.from('{"format":"nope"}') });
    await page.waitForFunction(() => /^not imported/.test(document.getElementById('scenario-status').textContent));
    assert.deepEqual(core(await shown(page)), core(before), 'a bad file changes nothing');
  });

  await check('every counter of the core is listed', async () => {
    await page.click('#all-counters-box > summary');
    assert.equal(await page.isVisible('#counter-expiredReservations'), true);
    const names = await page.locator('#all-counters b').evaluateAll((els) => els.map((e) => e.id));
    assert.ok(native, 'needs the native replay above');
    assert.deepEqual(names.sort(), Object.keys(native.counters).map((k) => `counter-${k}`).sort());
    assert.ok(names.length >= 10, `counters: ${names.length}`);
  });

  await check('quick setup fills the cluster and workload forms and applies them', async () => {
    await page.selectOption('#setup', 'chat');
    assert.match(await text(page, '#status'), /^set up: chat service/);
    assert.equal(await page.inputValue('#cfg-ranks'), '4');
    assert.equal(await page.inputValue('#wl-kind'), 'multi-turn');
    assert.equal(await page.isVisible('#wl-chats'), true);
    assert.equal(await page.locator('#maps canvas').count(), 4);
    assert.deepEqual((await shown(page)).ranks.map((r) => r.numPages), [8192, 8192, 8192, 8192]);
    assert.equal(await text(page, '#config-dirty'), '');
    assert.equal(await page.inputValue('#setup'), '');
  });

  await check('eviction off vs lru on a full pool: page -1 answers vs evictions (charts and counters follow)', async () => {
    await setConfig(page, { ranks: 1, pagesPerRank: 256, eviction: 'off', worldSize: '' });
    await page.click('#apply');
    await setWorkload(page, { kind: 'unique-burst', seed: 5, stepMs: 100, blocks: 16 });
    await steps(page, 40);
    let s = await shown(page);
    // 40 steps x 16 new blocks on 256 pages: 16 steps fit, the other 24 steps' 384 blocks get -1.
    assert.deepEqual(s.ranks[0], { rank: 0, numPages: 256, free: 0, reserved: 0, committed: 256, leased: 0, quarantined: 0 });
    assert.equal(s.workload.allocFailures, 384);
    assert.equal(s.counters.evictions, 0);
    assert.equal(parseShown(await text(page, '#chart-allocFailures-value')), 384);
    await page.selectOption('#cfg-eviction', 'lru');
    await page.click('#apply');
    await steps(page, 40);
    s = await shown(page);
    assert.equal(s.workload.allocFailures, 0, 'lru makes room');
    assert.ok(s.counters.evictions >= 640 - 256, `evictions: ${s.counters.evictions}`);
    assert.equal(parseShown(await text(page, '#chart-evictions-value')), s.counters.evictions);
    assertTotals(s);
  });

  await check('1,000,000 pages per rank: the map aggregates, dominant/blended colouring, stays interactive', async () => {
    await setConfig(page, { ranks: 2, pagesPerRank: 1000000, worldSize: '', reservationTtlMs: 60000, quarantineMs: 60000, evictHighPermille: 950, evictLowPermille: 900 });
    await page.click('#apply');
    const s0 = await shown(page);
    assert.deepEqual(s0.ranks.map((r) => r.numPages), [1000000, 1000000]);
    assert.match(await text(page, '#map-0-label'), /pages per cell/);
    await setWorkload(page, { kind: 'unique-burst', seed: 3, stepMs: 10, blocks: 64 });
    await steps(page, 2000);
    const blend = await canvasData(page, 'map-0');
    await page.selectOption('#map-mode', 'dominant');
    const dominant = await canvasData(page, 'map-0');
    assert.notEqual(dominant, blend, 'aggregated cells look different by dominant state');
    await page.selectOption('#map-mode', 'blend');
    assert.equal(await canvasData(page, 'map-0'), blend);
    await page.hover('#map-0', { position: { x: 0, y: 0 } });
    assert.match(await text(page, '#tooltip'), /^rank 0 · pages 0–\d+ \(\d+\)/);
    await page.mouse.move(5, 5);
    // Frames while running at speed "max" (as many steps as fit in a frame): the page keeps drawing.
    await page.locator('#speed').evaluate((el) => {
      el.value = '16';
      el.dispatchEvent(new Event('input', { bubbles: true }));
    });
    assert.equal(await text(page, '#speed-value'), 'max');
    const frames = await page.evaluate(async () => {
      document.getElementById('run').click();
      const t0 = performance.now();
      let n = 0;
      while (performance.now() - t0 < 2000) {
        await new Promise((r) => requestAnimationFrame(r));
        n++;
      }
      document.getElementById('run').click();
      return { n, ms: performance.now() - t0 };
    });
    await idle(page);
    console.log(`     1M pages x 2 ranks, speed max: ${frames.n} frames in ${frames.ms.toFixed(0)} ms`);
    assert.ok(frames.n >= 20, `frames drawn in 2 s: ${frames.n}`);
    const s = await shown(page);
    assertTotals(s);
    assert.ok(s.totals.free < s0.totals.free);
  });

  await check('100,000 simulated commands run in seconds', async () => {
    await page.click('#reset');
    const s0 = await shown(page);
    const t0 = Date.now();
    await steps(page, 20000); // unique-burst on 2 ranks: 5 requests a step
    const ms = Date.now() - t0;
    const s = await shown(page);
    const cmds = s.requests - s0.requests;
    console.log(`     ${cmds} requests in ${ms} ms (${Math.round((cmds / ms) * 1000)}/s)`);
    assert.ok(cmds >= 100000, `requests: ${cmds}`);
    assert.ok(ms < 30000, `took ${ms} ms`);
    assertTotals(s);
  });

  // Last: refused requests (a module that panicked on one would poison every later call).
  await check('refused hand commands: the statuses and details of the server, nothing applied, shown as errors', async () => {
    await page.click('#reset');
    const before = await shown(page);
    const missing = await sendBoth(page, base, 'POST', '/keys/get_locations', { rank: 63, keys: [K1] });
    assert.equal(missing.status, 404);
    assert.match(JSON.parse(missing.body).detail, /^Rank 63 not initialized/);
    assert.match(await page.getAttribute('#cmd-status', 'class'), /err/);
    const bad = await sendBoth(page, base, 'POST', '/keys/batch_allocate', '{"rank": 0.0, "keys": [["k", ""]]}');
    assert.equal(bad.status, 400);
    assert.match(JSON.parse(bad.body).detail, /^Invalid request format: need 'rank' and 'keys'/);
    const notJson = await sendBoth(page, base, 'POST', '/keys/batch_exists', '{"keys": [');
    assert.equal(notJson.status, 400);
    const wrongMethod = await sendBoth(page, base, 'GET', '/keys/batch_exists', '');
    assert.equal(wrongMethod.status, 405);
    assert.equal(typeof JSON.parse(wrongMethod.body).detail, 'string');
    const after = await shown(page);
    assert.equal(after.requests, before.requests + 4);
    assert.deepEqual(after.ranks, before.ranks, 'nothing applied');
    await page.check('#events-errors');
    const rows = page.locator('#events tbody tr');
    assert.equal(await rows.count(), 4);
    assert.match(await rows.nth(3).textContent(), /get_locations.*404/);
    assert.match(await rows.nth(0).textContent(), /GET \/keys\/batch_exists.*405/);
    await page.uncheck('#events-errors');
  });
}

await main();
