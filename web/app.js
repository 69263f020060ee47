// kvpages simulator page: wires the controls to the wasm `Simulator` (kvpages-core compiled to
// wasm, crates/wasm/browser: the class in src/js.rs, loaded from ./pkg/), samples
// `stats()` every step or frame, and draws. No allocator rule lives here: every page number, count
// and reply on screen comes from the module; this file only reads forms, formats and paints.
import { Chart, Series, duration } from './charts.js';
import { PageMaps } from './pagemap.js';

const $ = (id) => document.getElementById(id);
const nf = new Intl.NumberFormat('en-US');
const fmt = (v) => (v === null || v === undefined ? '–' : nf.format(v));
const pct = (v) => (v === null || v === undefined ? '–' : `${(v * 100).toFixed(1)} %`);

/** Steps per frame offered by the speed slider; the last one means "as many as fit in a frame". */
const SPEEDS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 'max'];
/** Stepping time per frame at speed "max" (ms): leaves the rest of 16 ms to drawing. */
const FRAME_BUDGET_MS = 12;
/** Stepping time per frame of a Step N batch (ms): throughput first, still ~20 frames a second. */
const BATCH_BUDGET_MS = 40;
/** A fixed speed never makes one frame step for longer than this (ms): the tab stays usable. */
const FRAME_CAP_MS = 100;
/** ... except that speeds up to this many steps per frame are always exact (seeded runs agree). */
const CAP_FLOOR = 100;
/** Up to this many steps in a frame, stats() is sampled after each step; beyond, once a frame. */
const SAMPLE_EACH_STEP = 32;
/** Hit rate on the chart: over this many most recent samples (the counters show the total). */
const HIT_WINDOW = 32;

let Simulator = null; // the wasm class, once loaded
const ui = {
  sim: null,
  config: null, // the applied config, as sim.config() returned it
  workload: null, // JSON of the spec last given to sim.setWorkload
  task: null, // {kind: 'run'} | {kind: 'steps', left, total}
  frameQueued: false,
  stepsDone: 0,
  stepRate: 0.05, // measured steps per ms, for the adaptive chunk
  rateKnown: false, // whether stepRate was measured yet (only then it caps fixed speeds)
  lastStats: null,
  hits: [], // [lookups, lookupHits] of recent samples, for the windowed hit rate
  mapAt: 0,
  mapMs: 0,
  eventsAt: 0,
  eventsKey: '',
  lastWork: null, // {n, ms} of the last batch of steps, for the perf line
  capped: false, // whether the last Run frame did fewer steps than the speed asks
  broken: false, // the simulator stopped on a panic in the module (Reset or Apply recovers)
  presets: [],
};

const series = new Series(['free', 'hitRate', 'allocFailures', 'evictions', 'leaks']);
let charts = [];
let maps = null;

// ---------------------------------------------------------------------------------------------
// Start-up

async function main() {
  try {
    const mod = await import('./pkg/kvpages_wasm.js');
    await mod.default();
    Simulator = mod.Simulator;
  } catch (e) {
    fatal(`The wasm module did not load (${e.message}). Build it with \`cargo xtask simulator\` and serve the page with \`kvpages serve\` (it is at /simulator/).`);
    return;
  }
  buildCharts();
  maps = new PageMaps($('maps'), $('tooltip'));
  wire();
  updateCalc();
  updateModel();
  showKindFields();
  showSpeed();
  if (!apply()) return;
  setStatus('idle');
}

/**
 * After a call threw: whether the simulator still answers. A Rust panic inside the module leaves
 * the object unusable ("recursive use of an object..."): say so and offer the way out.
 */
function checkAlive(e) {
  try {
    ui.sim.now();
    return true;
  } catch {
    ui.broken = true;
    const el = $('fatal');
    el.textContent = `The simulator stopped on a bug in the module (${e && e.message ? e.message : e}). Export is no longer possible for this run; Reset or Apply starts a fresh simulator. Please report the steps that led here.`;
    el.hidden = false;
    return false;
  }
}

function fatal(msg) {
  $('fatal').textContent = msg;
  $('fatal').hidden = false;
  setStatus('error', msg);
}

function buildCharts() {
  const box = $('charts');
  const total = () => (ui.lastStats ? ui.lastStats.ranks.reduce((n, r) => n + r.numPages, 0) : 1);
  charts = [
    { field: 'free', title: 'free pages, all ranks', color: '#94a3b8', format: fmt, yMax: total, integer: true },
    { field: 'hitRate', title: `hit rate, last ${HIT_WINDOW} samples`, color: '#22c55e', format: pct, yMax: () => 1, axis: (v) => `${Math.round(v * 100)}%` },
    { field: 'allocFailures', title: 'allocation failures (page -1)', color: '#e5484d', format: fmt, integer: true },
    { field: 'evictions', title: 'evictions', color: '#3b82f6', format: fmt, integer: true },
    { field: 'leaks', title: 'leaks caught (expired reservations)', color: '#f2b134', format: fmt, integer: true },
  ].map((spec) => new Chart(box, spec));
}

// ---------------------------------------------------------------------------------------------
// Forms

const num = (id) => {
  const v = $(id).value.trim();
  return v === '' ? NaN : Number(v);
};

/** The config the cluster form describes (the module validates it; its error names the field). */
function readConfig() {
  const world = $('cfg-world').value.trim();
  return {
    seed: num('cfg-seed'),
    ranks: num('cfg-ranks'),
    pagesPerRank: num('cfg-pages'),
    settings: {
      reservationTtlMs: num('cfg-ttl'),
      readLeaseMs: num('cfg-lease'),
      quarantineMs: num('cfg-quarantine'),
      eviction: $('cfg-eviction').value,
      evictHighPermille: num('cfg-high'),
      evictLowPermille: num('cfg-low'),
      worldSize: world === '' ? null : Number(world),
    },
  };
}

function fillConfig(c) {
  $('cfg-seed').value = c.seed;
  $('cfg-ranks').value = c.ranks;
  $('cfg-pages').value = c.pagesPerRank;
  const s = c.settings;
  $('cfg-ttl').value = s.reservationTtlMs;
  $('cfg-lease').value = s.readLeaseMs;
  $('cfg-quarantine').value = s.quarantineMs;
  $('cfg-eviction').value = s.eviction;
  $('cfg-high').value = s.evictHighPermille;
  $('cfg-low').value = s.evictLowPermille;
  $('cfg-world').value = s.worldSize ?? '';
}

/** JSON with sorted keys, to compare configs whatever the order of their fields. */
function canon(v) {
  if (Array.isArray(v)) return `[${v.map(canon).join(',')}]`;
  if (v && typeof v === 'object') {
    return `{${Object.keys(v).sort().map((k) => `${JSON.stringify(k)}:${canon(v[k])}`).join(',')}}`;
  }
  return JSON.stringify(v);
}

function markDirty() {
  const dirty = ui.config && canon(readConfig()) !== canon(ui.config);
  $('config-dirty').textContent = dirty ? 'changed — Apply rebuilds the simulator' : '';
  $('apply').classList.toggle('attention', !!dirty);
}

/** The workload spec the workload form describes: the common fields plus the kind's own. */
function readWorkload() {
  const kind = $('wl-kind').value;
  const spec = { kind, seed: num('wl-seed'), stepMs: num('wl-stepms'), blocks: num('wl-blocks') };
  if (kind === 'shared-prefix' || kind === 'crashing-writers' || kind === 'duplicate-writers') {
    spec.prompts = num('wl-prompts');
    spec.zipf = num('wl-zipf');
    spec.prefixBlocks = num('wl-prefix');
    spec.systemPrompts = num('wl-systems');
  }
  if (kind === 'multi-turn') {
    spec.chats = num('wl-chats');
    spec.maxTurns = num('wl-turns');
  }
  if (kind === 'crashing-writers') spec.crashRate = num('wl-crash');
  return spec;
}

function showKindFields() {
  const kind = $('wl-kind').value;
  for (const el of document.querySelectorAll('[data-kinds]')) {
    el.hidden = !el.dataset.kinds.split(' ').includes(kind);
  }
  showWorkloadState();
}

function showWorkloadState() {
  const want = JSON.stringify(readWorkload());
  const el = $('wl-active');
  if (!ui.workload) el.textContent = 'no workload set yet: Step or Run sets this one';
  else if (ui.workload === want) el.textContent = `active: ${describeWorkload(JSON.parse(ui.workload))}`;
  else el.textContent = `changed: the next Step or Run switches to it (active: ${describeWorkload(JSON.parse(ui.workload))})`;
}

function describeWorkload(w) {
  const extra = Object.entries(w)
    .filter(([k]) => !['kind', 'seed'].includes(k))
    .map(([k, v]) => `${k} ${v}`)
    .join(', ');
  return `${w.kind}, seed ${w.seed}${extra ? `, ${extra}` : ''}`;
}

/** Page count calculator: the page's own arithmetic, pages = floor(file / page). */
function updateCalc() {
  const file = Math.round(num('calc-file') * Number($('calc-file-unit').value));
  const page = Math.round(num('calc-page') * Number($('calc-page-unit').value));
  const out = $('calc-result');
  let pages = NaN;
  if (Number.isFinite(file) && Number.isFinite(page) && page > 0 && file >= 0) pages = Math.floor(file / page);
  out.dataset.value = Number.isFinite(pages) ? String(pages) : '';
  if (!Number.isFinite(pages)) out.textContent = '–';
  else if (pages < 1) out.textContent = '0 (the file is smaller than a page)';
  else if (pages > 4294967295) out.textContent = `${fmt(pages)} (over the 2^32-1 limit)`;
  else out.textContent = `${fmt(pages)} pages`;
  $('calc-use').disabled = !(pages >= 1 && pages <= 4294967295);
}

function updateModel() {
  const tp = $('m-tp').checked ? Math.max(1, num('cfg-ranks') || 1) : 1;
  const bytes = (2 * num('m-layers') * num('m-heads') * num('m-dim') * num('m-block') * Number($('m-dtype').value)) / tp;
  const out = $('m-result');
  const ok = Number.isFinite(bytes) && bytes >= 1;
  out.dataset.value = ok ? String(Math.floor(bytes)) : '';
  out.textContent = ok ? `${fmt(Math.floor(bytes))} B (${+(bytes / 1024).toFixed(2)} KiB)` : '–';
  $('m-use').disabled = !ok;
}

function showSpeed() {
  const v = SPEEDS[Number($('speed').value)];
  $('speed-value').textContent = v === 'max' ? 'max' : fmt(v);
}

// ---------------------------------------------------------------------------------------------
// Simulator lifecycle

/** Builds a simulator from the cluster form; on a bad config keeps the old one and says why. */
function apply() {
  let sim;
  try {
    sim = new Simulator(readConfig());
  } catch (e) {
    showConfigError(e);
    return false;
  }
  replaceSim(sim);
  return true;
}

function showConfigError(e) {
  const el = $('config-error');
  el.textContent = `Not applied: ${e && e.message ? e.message : String(e)}`;
  el.hidden = false;
}

function replaceSim(sim) {
  stopTask();
  try {
    if (ui.sim) ui.sim.free();
  } catch {
    // A simulator broken by a panic cannot be freed; its memory goes with the page.
  }
  if (ui.broken) {
    ui.broken = false;
    $('fatal').hidden = true;
  }
  ui.sim = sim;
  ui.config = sim.config();
  ui.workload = null;
  ui.stepsDone = 0;
  ui.hits = [];
  ui.eventsKey = '';
  series.clear();
  $('config-error').hidden = true;
  fillConfig(ui.config);
  markDirty();
  updateModel();
  showWorkloadState();
  fillPresets();
  sample();
  render(true);
}

function reset() {
  const sim = new Simulator(ui.config);
  replaceSim(sim);
  setStatus('idle', 'reset: a fresh simulator with the applied config');
}

function ensureWorkload() {
  const spec = readWorkload();
  const json = JSON.stringify(spec);
  if (ui.workload === json) return true;
  try {
    ui.sim.setWorkload(spec);
  } catch (e) {
    setStatus('error', `workload not set: ${e.message}`);
    return false;
  }
  ui.workload = json;
  showWorkloadState();
  return true;
}

/** Takes one sample of stats() for the charts and the counters. */
function sample() {
  const s = ui.sim.stats();
  ui.lastStats = s;
  const w = s.workload;
  ui.hits.push([w.lookups, w.lookupHits]);
  if (ui.hits.length > HIT_WINDOW + 1) ui.hits.shift();
  const [l0, h0] = ui.hits[0];
  const dl = w.lookups - l0;
  const hitRate = ui.hits.length > 1 && dl > 0 ? (w.lookupHits - h0) / dl : null;
  series.push({
    t: s.now,
    free: s.ranks.reduce((n, r) => n + r.free, 0),
    hitRate,
    allocFailures: w.allocFailures,
    evictions: s.counters.evictions,
    leaks: s.counters.expiredReservations,
  });
  return s;
}

/** Runs `n` workload steps, sampling after each one when `n` is small. */
function doSteps(n) {
  const t0 = performance.now();
  if (n <= SAMPLE_EACH_STEP) {
    for (let i = 0; i < n; i++) {
      ui.sim.step(1);
      sample();
    }
  } else {
    ui.sim.step(n);
    sample();
  }
  ui.stepsDone += n;
  const ms = performance.now() - t0;
  if (ms > 0.5) {
    ui.stepRate = ui.rateKnown ? 0.7 * ui.stepRate + 0.3 * (n / ms) : n / ms;
    ui.rateKnown = true;
  }
  ui.lastWork = { n, ms };
}

// ---------------------------------------------------------------------------------------------
// The frame loop: runs while a task (Run, or a multi-frame Step) is active.

function startTask(task) {
  if (ui.broken || !ensureWorkload()) return;
  ui.task = task;
  // The state changes now, not at the first frame: whoever waits for "idle" waits for this task.
  if (task.kind === 'run') setStatus('running', 'running');
  else setStatus('stepping', `stepping · 0 / ${fmt(task.total)}`);
  queueFrame();
}

function stopTask(msg) {
  const was = ui.task;
  ui.task = null;
  $('run').textContent = 'Run';
  $('run').classList.remove('running');
  if (was) setStatus('idle', msg);
}

function queueFrame() {
  if (ui.frameQueued) return;
  ui.frameQueued = true;
  requestAnimationFrame(frame);
}

/** Steps that take about `ms` at the measured rate (workloads differ, so it is re-measured). */
function adaptiveChunk(ms) {
  return Math.max(1, Math.floor(ui.stepRate * ms));
}

function frame() {
  ui.frameQueued = false;
  const task = ui.task;
  if (!task) return;
  try {
    if (task.kind === 'run') {
      const speed = SPEEDS[Number($('speed').value)];
      let n = speed === 'max' ? adaptiveChunk(FRAME_BUDGET_MS) : speed;
      const cap = ui.rateKnown ? Math.max(CAP_FLOOR, adaptiveChunk(FRAME_CAP_MS)) : n;
      ui.capped = n > cap;
      doSteps(Math.min(n, cap));
      setStatus('running', `running · ${fmt(ui.stepsDone)} steps`);
    } else {
      const n = Math.min(task.left, adaptiveChunk(BATCH_BUDGET_MS));
      doSteps(n);
      task.left -= n;
      setStatus('stepping', `stepping · ${fmt(task.total - task.left)} / ${fmt(task.total)}`);
      if (task.left === 0) {
        ui.task = null;
        setStatus('idle', `done: ${fmt(task.total)} steps`);
      }
    }
  } catch (e) {
    ui.task = null;
    setStatus('error', `step failed: ${e.message}`);
    checkAlive(e);
    return stopTask();
  }
  render(!ui.task);
  if (ui.task) queueFrame();
  else stopTask();
}

function setStatus(state, text) {
  document.body.dataset.state = state;
  const el = $('status');
  el.dataset.state = state;
  el.textContent = text || (state === 'idle' ? `idle · ${fmt(ui.stepsDone)} steps since Apply` : state);
}

// ---------------------------------------------------------------------------------------------
// Drawing

const CARDS = [
  ['now', 'simulated time', (s) => s.now, (v) => duration(v)],
  ['requests', 'requests', (s) => s.requests],
  ['keys', 'keys', (s) => s.keys],
  ['pendingKeys', 'pending keys', (s) => s.pendingKeys],
  ['free', 'free pages', (s) => s.ranks.reduce((n, r) => n + r.free, 0)],
  ['reserved', 'reserved', (s) => s.ranks.reduce((n, r) => n + r.reserved, 0)],
  ['committed', 'committed (incl. leased)', (s) => s.ranks.reduce((n, r) => n + r.committed, 0)],
  ['leased', 'leased', (s) => s.ranks.reduce((n, r) => n + r.leased, 0)],
  ['quarantined', 'quarantined', (s) => s.ranks.reduce((n, r) => n + r.quarantined, 0)],
  ['lookups', 'lookups', (s) => s.workload.lookups],
  ['lookupHits', 'lookup hits', (s) => s.workload.lookupHits],
  ['hitRate', 'hit rate', (s) => (s.workload.lookups ? s.workload.lookupHits / s.workload.lookups : null), pct],
  ['allocFailures', 'alloc failures', (s) => s.workload.allocFailures],
  ['evictions', 'evictions', (s) => s.counters.evictions],
  ['leaks', 'leaks caught', (s) => s.counters.expiredReservations],
];

function card(parent, id, label) {
  let el = document.getElementById(id);
  if (el) return el;
  const box = document.createElement('div');
  box.className = 'card';
  const l = document.createElement('span');
  l.textContent = label;
  el = document.createElement('b');
  el.id = id;
  el.dataset.testid = id;
  box.append(l, el);
  parent.append(box);
  return el;
}

function setNum(el, v, format = fmt) {
  const raw = v === null || v === undefined ? '' : String(v);
  if (el.dataset.value === raw && el.textContent !== '') return;
  el.dataset.value = raw;
  el.textContent = format(v);
}

function renderCounters(s) {
  const box = $('counters');
  for (const [key, label, get, format] of CARDS) setNum(card(box, `stat-${key}`, label), get(s), format);
  const all = $('all-counters');
  for (const [k, v] of Object.entries(s.counters)) setNum(card(all, `counter-${k}`, k), v);
  $('clock').textContent = `t = ${fmt(s.now)} ms`;
  for (const r of s.ranks) {
    const row = document.getElementById(`rankstats-${r.rank}`);
    if (!row) continue;
    for (const k of ['numPages', 'free', 'reserved', 'committed', 'leased', 'quarantined']) {
      setNum(row.querySelector(`[data-field="${k}"]`), r[k]);
    }
  }
}

/** Per-rank numbers beside each map (built once per shape, updated every frame). */
function renderRankStats(s) {
  for (const r of s.ranks) {
    const label = document.getElementById(`map-${r.rank}-label`);
    if (!label) continue;
    let row = document.getElementById(`rankstats-${r.rank}`);
    if (!row) {
      row = document.createElement('div');
      row.className = 'rankstats';
      row.id = `rankstats-${r.rank}`;
      row.dataset.testid = `rankstats-${r.rank}`;
      for (const k of ['numPages', 'free', 'reserved', 'committed', 'leased', 'quarantined']) {
        const b = document.createElement('span');
        b.className = `rs ${k}`;
        const v = document.createElement('b');
        v.dataset.field = k;
        v.id = `rank-${r.rank}-${k}`;
        v.dataset.testid = `rank-${r.rank}-${k}`;
        b.append(`${k === 'numPages' ? 'pages' : k} `, v);
        row.append(b);
      }
      label.after(row);
    }
  }
}

function renderEvents(force) {
  const n = Number($('events-n').value);
  const errorsOnly = $('events-errors').checked;
  const list = errorsOnly ? ui.sim.events(1000).filter((e) => e.status >= 400).slice(-n) : ui.sim.events(n);
  const lastSeq = list.length ? list[list.length - 1].seq : -1;
  const key = `${n}:${errorsOnly}:${lastSeq}:${list.length}`;
  if (!force && key === ui.eventsKey) return;
  ui.eventsKey = key;
  const body = $('events').tBodies[0];
  const rows = [];
  for (let i = list.length - 1; i >= 0; i--) {
    const e = list[i];
    const tr = document.createElement('tr');
    tr.id = `event-${e.seq}`;
    tr.dataset.seq = String(e.seq);
    tr.className = e.status >= 400 ? 'err' : 'ok';
    const cells = [
      String(e.seq),
      fmt(e.t),
      `${e.method} ${e.path} ${e.body ?? ''}`,
      String(e.status),
      e.reply === '' ? '(empty)' : e.reply,
    ];
    for (const c of cells) {
      const td = document.createElement('td');
      td.textContent = c.length > 160 ? `${c.slice(0, 160)}…` : c;
      if (c.length > 160) td.title = c.slice(0, 2000);
      tr.append(td);
    }
    tr.addEventListener('click', () => loadCommand(e.method, e.path, e.body ?? ''));
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  $('events').dataset.count = String(list.length);
  $('events').dataset.last = String(lastSeq);
}

/** Redraws everything; while running, the map and the log are throttled to stay interactive. */
function render(idle) {
  const s = ui.lastStats;
  if (!s || ui.broken) return;
  renderCounters(s);
  for (const c of charts) c.draw(series);
  const now = performance.now();
  // While busy, the maps may take about a seventh of the time (10^6 pages cost a few ms).
  if (idle || now - ui.mapAt >= ui.mapMs * 6) {
    const t0 = performance.now();
    maps.draw(ui.sim, s.ranks);
    renderRankStats(s);
    renderCounters(s);
    ui.mapMs = performance.now() - t0;
    ui.mapAt = performance.now();
  }
  if (idle || now - ui.eventsAt >= 250) {
    renderEvents(false);
    ui.eventsAt = now;
  }
  const w = ui.lastWork;
  if (w) {
    const rate = w.ms > 0 ? Math.round((w.n / w.ms) * 1000) : null;
    const capped = ui.task && ui.task.kind === 'run' && ui.capped ? ' · capped to keep the tab responsive' : '';
    $('perf').textContent = `last batch: ${fmt(w.n)} steps in ${w.ms.toFixed(1)} ms${rate ? ` (${fmt(rate)} steps/s)` : ''} · map ${ui.mapMs.toFixed(1)} ms${capped}`;
  }
}

// ---------------------------------------------------------------------------------------------
// Hand commands

const KEY = '386b2d9cf5aa91ba3a4b42c35396c822';

function fillPresets() {
  const c = ui.config;
  const p = c.pagesPerRank;
  const presets = [
    ['vLLM', 'batch_exists', 'POST', '/keys/batch_exists', { keys: [KEY] }],
    ['vLLM', 'batch_allocate (rank 0)', 'POST', '/keys/batch_allocate', { rank: 0, keys: [[KEY, '']] }],
    ['vLLM', 'confirm_write (rank 0, page 0)', 'POST', '/keys/confirm_write', { rank: 0, confirmations: [[KEY, 0]], pages_to_release: [] }],
    ['vLLM', 'get_locations (rank 0)', 'POST', '/keys/get_locations', { rank: 0, keys: [KEY] }],
    ['vLLM', 'initialize rank 0', 'POST', '/rank/0/initialize', { num_pages: p, role: 'worker' }],
    ['vLLM', `initialize rank ${c.ranks} (one more)`, 'POST', `/rank/${c.ranks}/initialize`, { num_pages: p, role: 'worker' }],
    ['vLLM', 'clear (every rank and key)', 'POST', '/clear', {}],
    ['kvpages', 'delete keys', 'POST', '/keys/delete', { keys: [KEY] }],
    ['malformed', 'rank as a float (400)', 'POST', '/keys/batch_allocate', { rank: 0.0, keys: [] }, '{"rank": 0.0, "keys": []}'],
    ['malformed', 'uninitialized rank (404)', 'POST', '/keys/get_locations', { rank: 63, keys: [KEY] }],
  ];
  const sel = $('cmd-preset');
  sel.replaceChildren();
  const none = document.createElement('option');
  none.value = '';
  none.textContent = '— pick a request —';
  sel.append(none);
  const groups = new Map();
  presets.forEach(([group, label, method, path, body, raw], i) => {
    if (!groups.has(group)) {
      const g = document.createElement('optgroup');
      g.label = group;
      groups.set(group, g);
      sel.append(g);
    }
    const o = document.createElement('option');
    o.value = String(i);
    o.textContent = `${label}: ${method} ${path}`;
    groups.get(group).append(o);
  });
  ui.presets = presets;
}

function loadCommand(method, path, body) {
  $('cmd-method').value = method;
  $('cmd-path').value = path;
  let text = body;
  try {
    if (body.trim() !== '') text = JSON.stringify(JSON.parse(body), null, 1);
  } catch {
    // Not JSON (or cut at 2 KiB by the event log): show it as it was sent.
  }
  $('cmd-body').value = text;
}

function sendCommand() {
  if (ui.broken) return;
  if (ui.task) stopTask('paused to send a command');
  const method = $('cmd-method').value;
  const path = $('cmd-path').value.trim();
  const body = $('cmd-body').value;
  let reply;
  try {
    reply = ui.sim.request(method, path, body);
  } catch (e) {
    $('cmd-status').textContent = 'error';
    $('cmd-status').className = 'status-code err';
    $('cmd-reply').textContent = e.message;
    $('cmd-reply').dataset.raw = '';
    if (!checkAlive(e)) setStatus('error', 'the simulator stopped: Reset or Apply');
    return;
  }
  const st = $('cmd-status');
  st.textContent = String(reply.status);
  st.dataset.value = String(reply.status);
  st.className = `status-code ${reply.status >= 400 ? 'err' : 'ok'}`;
  let shown = reply.body;
  try {
    if (reply.body !== '') shown = JSON.stringify(JSON.parse(reply.body), null, 1);
  } catch {
    // Not JSON: show it raw.
  }
  const out = $('cmd-reply');
  out.textContent = reply.body === '' ? '(empty body)' : shown;
  out.dataset.raw = reply.body;
  sample();
  render(true);
}

// ---------------------------------------------------------------------------------------------
// Scenario export / import

function exportScenario() {
  if (ui.broken) return;
  const scenario = ui.sim.exportScenario();
  const text = JSON.stringify(scenario);
  const blob = new Blob([text], { type: 'application/json' });
  const url = URL.createObjectURL(blob);
  const a = document.createElement('a');
  const wl = ui.workload ? JSON.parse(ui.workload).kind : 'hand';
  a.href = url;
  a.download = `kvpages-scenario-${wl}-seed${ui.config.seed}-${ui.lastStats.requests}req.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
  const el = $('scenario-status');
  el.className = 'hint';
  el.textContent = `exported ${fmt(scenario.log.length)} actions, ${fmt(ui.lastStats.requests)} requests (${fmt(Math.ceil(text.length / 1024))} KiB) as ${a.download}`;
  el.dataset.actions = String(scenario.log.length);
}

async function importScenario(file) {
  const el = $('scenario-status');
  el.className = 'hint';
  el.textContent = `replaying ${file.name}…`;
  let sim;
  try {
    const obj = JSON.parse(await file.text());
    const t0 = performance.now();
    sim = Simulator.fromScenario(obj);
    const ms = performance.now() - t0;
    replaceSim(sim);
    el.textContent = `replayed ${fmt(obj.log.length)} actions, ${fmt(ui.lastStats.requests)} requests, from ${file.name} in ${ms.toFixed(0)} ms`;
    el.dataset.actions = String(obj.log.length);
    setStatus('idle', `imported ${file.name}`);
  } catch (e) {
    el.className = 'hint error';
    el.textContent = `not imported: ${e.message}`;
  }
}

// ---------------------------------------------------------------------------------------------
// Quick setups: form values only (the module decides everything that follows).

const SETUPS = {
  crash: {
    config: { ranks: 2, pagesPerRank: 2048, reservationTtlMs: 5000, quarantineMs: 5000, readLeaseMs: 5000, eviction: 'lru' },
    workload: { kind: 'crashing-writers', blocks: 8, prompts: 200, prefixBlocks: 8, crashRate: 0.3, stepMs: 100 },
  },
  'full-off': {
    config: { ranks: 2, pagesPerRank: 1024, eviction: 'off' },
    workload: { kind: 'unique-burst', blocks: 16, stepMs: 100 },
  },
  'full-lru': {
    config: { ranks: 2, pagesPerRank: 1024, eviction: 'lru', high: 950, low: 900 },
    workload: { kind: 'unique-burst', blocks: 16, stepMs: 100 },
  },
  chat: {
    config: { ranks: 4, pagesPerRank: 8192, eviction: 'lru' },
    workload: { kind: 'multi-turn', chats: 64, turns: 16, blocks: 8, stepMs: 200 },
  },
  dup: {
    config: { ranks: 2, pagesPerRank: 4096, eviction: 'lru' },
    workload: { kind: 'duplicate-writers', blocks: 16, prompts: 500, prefixBlocks: 12, stepMs: 100 },
  },
  big: {
    config: { ranks: 8, pagesPerRank: 1000000, eviction: 'lru' },
    workload: { kind: 'shared-prefix', blocks: 16, prompts: 5000, prefixBlocks: 12, stepMs: 50 },
  },
};

const SETUP_FIELDS = {
  ranks: 'cfg-ranks', pagesPerRank: 'cfg-pages', reservationTtlMs: 'cfg-ttl', quarantineMs: 'cfg-quarantine',
  readLeaseMs: 'cfg-lease', eviction: 'cfg-eviction', high: 'cfg-high', low: 'cfg-low',
  kind: 'wl-kind', blocks: 'wl-blocks', prompts: 'wl-prompts', prefixBlocks: 'wl-prefix', crashRate: 'wl-crash',
  chats: 'wl-chats', turns: 'wl-turns', stepMs: 'wl-stepms',
};

function quickSetup(name) {
  const s = SETUPS[name];
  if (!s) return;
  for (const [k, v] of [...Object.entries(s.config), ...Object.entries(s.workload)]) $(SETUP_FIELDS[k]).value = String(v);
  $('cfg-world').value = '';
  showKindFields();
  updateModel();
  if (apply()) setStatus('idle', `set up: ${$('setup').selectedOptions[0].textContent} — press Run`);
}

// ---------------------------------------------------------------------------------------------
// Wiring

function wire() {
  $('config-form').addEventListener('submit', (e) => {
    e.preventDefault();
    if (apply()) setStatus('idle', 'applied: a fresh simulator');
  });
  $('config-form').addEventListener('input', () => {
    markDirty();
    updateCalc();
    updateModel();
  });
  $('config-form').addEventListener('change', () => {
    markDirty();
    updateCalc();
    updateModel();
  });
  $('calc-use').addEventListener('click', () => {
    $('cfg-pages').value = $('calc-result').dataset.value;
    markDirty();
  });
  $('m-use').addEventListener('click', () => {
    $('calc-page').value = $('m-result').dataset.value;
    $('calc-page-unit').value = '1';
    updateCalc();
  });

  $('setup').addEventListener('change', () => {
    quickSetup($('setup').value);
    $('setup').value = '';
  });
  $('workload-form').addEventListener('input', showWorkloadState);
  $('workload-form').addEventListener('submit', (e) => e.preventDefault());
  $('wl-kind').addEventListener('change', showKindFields);

  $('step').addEventListener('click', () => {
    if (ui.task) stopTask();
    const n = Math.max(1, Math.floor(num('step-count') || 1));
    startTask({ kind: 'steps', left: n, total: n });
  });
  $('run').addEventListener('click', toggleRun);
  $('reset').addEventListener('click', reset);
  $('speed').addEventListener('input', showSpeed);
  $('advance').addEventListener('click', () => {
    const ms = Math.floor(num('advance-ms'));
    if (!(ms > 0) || ui.broken) return;
    ui.sim.advance(ms);
    sample();
    render(true);
    setStatus(ui.task ? document.body.dataset.state : 'idle', `clock advanced by ${duration(ms)}: expired reservations and quarantines are taken back by the next command that changes state`);
  });

  $('map-mode').addEventListener('change', () => {
    maps.mode = $('map-mode').value;
    render(true);
  });
  $('events-n').addEventListener('change', () => renderEvents(true));
  $('events-errors').addEventListener('change', () => renderEvents(true));

  $('cmd-preset').addEventListener('change', () => {
    const p = ui.presets[Number($('cmd-preset').value)];
    if (!p) return;
    const [, , method, path, body, raw] = p;
    $('cmd-method').value = method;
    $('cmd-path').value = path;
    $('cmd-body').value = raw ?? JSON.stringify(body, null, 1);
  });
  $('cmd-send').addEventListener('click', sendCommand);
  $('cmd-body').addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) sendCommand();
  });

  $('export').addEventListener('click', exportScenario);
  $('import').addEventListener('change', async () => {
    const f = $('import').files[0];
    if (f) await importScenario(f);
    $('import').value = '';
  });

  window.addEventListener('resize', () => render(true));
  document.addEventListener('keydown', (e) => {
    const t = e.target;
    if (t instanceof HTMLInputElement || t instanceof HTMLTextAreaElement || t instanceof HTMLSelectElement) return;
    if (e.key === ' ') {
      e.preventDefault();
      toggleRun();
    } else if (e.key === 's') {
      $('step').click();
    }
  });
}

function toggleRun() {
  if (ui.task && ui.task.kind === 'run') {
    stopTask(`paused · ${fmt(ui.stepsDone)} steps`);
    return;
  }
  if (ui.task) stopTask();
  $('run').textContent = 'Pause';
  $('run').classList.add('running');
  startTask({ kind: 'run' });
  if (!ui.task) stopTask();
}

main();
