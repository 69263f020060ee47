// The per-rank page map: one canvas per rank, one cell per page while pages fit, else one
// pixel per cell with each cell covering a run of pages (`sim.pageMap(rank, cells)` aggregates in
// the core, so 10^6 pages cost one call). Hover names the page(s) under the pointer (`pageInfo`).

/** Page states in the order `pageMap` counts them. */
export const STATES = ['free', 'reserved', 'committed', 'leased', 'quarantined'];
const RGB = [
  [42, 49, 64], // free
  [242, 177, 52], // reserved
  [59, 130, 246], // committed
  [34, 197, 94], // leased
  [229, 72, 77], // quarantined
];
const GAP = [22, 26, 35]; // the panel background, between cells
const nf = new Intl.NumberFormat('en-US');

/**
 * Cell size and grid for `n` pages in `width` x `maxHeight` CSS pixels: the largest square cell
 * (up to 24 px) that fits every page; below 1 px per page, 1 px cells that each cover several pages.
 */
export function layout(n, width, maxHeight) {
  const w = Math.max(1, Math.floor(width));
  for (let s = 24; s >= 1; s--) {
    const cols = Math.floor(w / s);
    if (cols < 1) continue;
    const rows = Math.ceil(n / cols);
    if (rows * s <= maxHeight) return { size: s, cols, rows, cells: n };
  }
  const cols = w;
  const rows = Math.max(1, Math.min(Math.ceil(n / cols), Math.floor(maxHeight)));
  return { size: 1, cols, rows, cells: Math.min(n, cols * rows) };
}

/**
 * First page of cell `i` when `cells` cells cover `n` pages: the core puts page `p` in cell
 * `floor(p * cells / n)`, so cell `i` starts at `ceil(i * n / cells)` (exact: both < 2^53).
 */
export const cellStart = (i, n, cells) => Math.ceil((i * n) / cells);

export class PageMaps {
  constructor(container, tooltip) {
    this.container = container;
    this.tooltip = tooltip;
    this.rows = [];
    this.mode = 'blend';
    this.hover = null; // {rank, x, y, clientX, clientY}
    this.sim = null;
  }

  /** Re-creates the rows when the ranks or their sizes changed. */
  ensure(ranks) {
    const shape = ranks.map((r) => `${r.rank}:${r.numPages}`).join(',');
    if (shape === this.shape) return;
    this.shape = shape;
    this.container.replaceChildren();
    this.rows = ranks.map((r) => {
      const row = document.createElement('div');
      row.className = 'maprow';
      const label = document.createElement('div');
      label.className = 'maplabel';
      label.id = `map-${r.rank}-label`;
      label.dataset.testid = `map-${r.rank}-label`;
      const canvas = document.createElement('canvas');
      canvas.id = `map-${r.rank}`;
      canvas.dataset.testid = `map-${r.rank}`;
      canvas.dataset.rank = String(r.rank);
      canvas.addEventListener('mousemove', (e) => {
        this.hover = { rank: r.rank, x: e.offsetX, y: e.offsetY, clientX: e.clientX, clientY: e.clientY };
        this.showTooltip();
      });
      canvas.addEventListener('mouseleave', () => {
        this.hover = null;
        this.tooltip.hidden = true;
      });
      row.append(label, canvas);
      this.container.append(row);
      return { rank: r.rank, numPages: r.numPages, label, canvas, grid: null, counts: null };
    });
  }

  /** Draws every rank from the simulator `sim`; `ranks` is `stats().ranks`. */
  draw(sim, ranks) {
    this.sim = sim;
    this.ensure(ranks);
    const width = this.container.clientWidth || 800;
    const maxHeight = Math.max(24, Math.min(220, Math.floor(560 / ranks.length)));
    for (const row of this.rows) {
      const n = row.numPages;
      const grid = layout(n, width, maxHeight);
      const counts = sim.pageMap(row.rank, grid.cells);
      row.grid = grid;
      row.counts = counts;
      this.paint(row, grid, counts);
      const ratio = n / grid.cells;
      const per = grid.cells === n ? '1 page per cell' : `≈${ratio < 10 ? ratio.toFixed(1) : nf.format(Math.round(ratio))} pages per cell`;
      row.label.textContent = `rank ${row.rank} · ${nf.format(n)} pages · ${per}`;
    }
    if (this.hover) this.showTooltip();
  }

  paint(row, grid, counts) {
    const { size: s, cols, rows, cells } = grid;
    const W = cols * s;
    const H = rows * s;
    const { canvas } = row;
    if (canvas.width !== W || canvas.height !== H) {
      canvas.width = W;
      canvas.height = H;
      canvas.style.width = `${W}px`;
      canvas.style.height = `${H}px`;
    }
    const g = canvas.getContext('2d');
    const img = g.createImageData(W, H);
    const px = img.data;
    const gap = s >= 4 ? 1 : 0;
    const blend = this.mode === 'blend';
    for (let i = 0; i < cols * rows; i++) {
      let r = GAP[0];
      let gg = GAP[1];
      let b = GAP[2];
      if (i < cells) {
        const o = i * 5;
        if (blend) {
          let total = 0;
          r = gg = b = 0;
          for (let k = 0; k < 5; k++) {
            const c = counts[o + k];
            total += c;
            r += c * RGB[k][0];
            gg += c * RGB[k][1];
            b += c * RGB[k][2];
          }
          if (total > 0) {
            r /= total;
            gg /= total;
            b /= total;
          }
        } else {
          // Ties go to the rarer state (later in STATES): a half-quarantined cell shows it.
          let best = 0;
          for (let k = 1; k < 5; k++) if (counts[o + k] >= counts[o + best]) best = k;
          [r, gg, b] = RGB[best];
        }
      }
      const cx = (i % cols) * s;
      const cy = Math.floor(i / cols) * s;
      for (let dy = 0; dy < s - gap; dy++) {
        let p = ((cy + dy) * W + cx) * 4;
        for (let dx = 0; dx < s - gap; dx++) {
          px[p] = r;
          px[p + 1] = gg;
          px[p + 2] = b;
          px[p + 3] = 255;
          p += 4;
        }
      }
      if (gap) {
        // The gap column and row take the background colour (ImageData starts transparent).
        for (let dy = 0; dy < s; dy++) {
          const p = ((cy + dy) * W + cx + s - 1) * 4;
          px[p] = GAP[0];
          px[p + 1] = GAP[1];
          px[p + 2] = GAP[2];
          px[p + 3] = 255;
        }
        for (let dx = 0; dx < s; dx++) {
          const p = ((cy + s - 1) * W + cx + dx) * 4;
          px[p] = GAP[0];
          px[p + 1] = GAP[1];
          px[p + 2] = GAP[2];
          px[p + 3] = 255;
        }
      }
    }
    g.putImageData(img, 0, 0);
  }

  /** The pages under the pointer: one page's state, key and age, or a run's state counts. */
  describe(rank, x, y) {
    const row = this.rows.find((r) => r.rank === rank);
    if (!row || !row.grid || !this.sim) return null;
    const { size: s, cols, cells } = row.grid;
    const col = Math.floor(x / s);
    const line = Math.floor(y / s);
    if (col < 0 || col >= cols || line < 0) return null;
    const i = line * cols + col;
    if (i >= cells) return null;
    const n = row.numPages;
    const lo = cellStart(i, n, cells);
    const hi = cellStart(i + 1, n, cells);
    let info;
    try {
      info = this.sim.pageInfo(rank, lo);
    } catch {
      return null; // a simulator stopped by a panic answers nothing
    }
    const parts = [];
    if (hi - lo === 1) {
      parts.push(`rank ${rank} · page ${info.page}`, `state ${info.state}`);
    } else {
      parts.push(`rank ${rank} · pages ${lo}–${hi - 1} (${hi - lo})`);
      const o = i * 5;
      parts.push(STATES.map((st, k) => `${st} ${row.counts[o + k]}`).join(' · '));
      parts.push(`page ${info.page}: ${info.state}`);
    }
    const ms = (v) => (v === null || v === undefined ? '–' : `${nf.format(v)} ms`);
    parts.push(`key ${info.key ?? '–'}`);
    parts.push(`age ${ms(info.ageMs)} (since its key's first commit)`);
    if (info.expiresInMs !== null && info.expiresInMs !== undefined) {
      parts.push(`${info.state === 'quarantined' ? 'quarantine ends' : 'reservation expires'} in ${ms(info.expiresInMs)}`);
    }
    return { lines: parts, info, lo, hi };
  }

  showTooltip() {
    const h = this.hover;
    if (!h) return;
    const d = this.describe(h.rank, h.x, h.y);
    if (!d) {
      this.tooltip.hidden = true;
      return;
    }
    this.tooltip.replaceChildren(
      ...d.lines.map((l) => {
        const div = document.createElement('div');
        div.textContent = l;
        return div;
      }),
    );
    this.tooltip.dataset.page = String(d.info.page);
    this.tooltip.dataset.state = d.info.state;
    this.tooltip.dataset.rank = String(h.rank);
    this.tooltip.hidden = false;
    const pad = 14;
    const tw = this.tooltip.offsetWidth;
    const left = h.clientX + pad + tw > window.innerWidth ? h.clientX - pad - tw : h.clientX + pad;
    this.tooltip.style.left = `${Math.max(0, left)}px`;
    this.tooltip.style.top = `${h.clientY + pad}px`;
  }
}
