// Time-series charts drawn by hand on canvas: one series per chart, samples evenly spaced on x
// (one per step or frame), the axis labelled with the simulated time of the first and last.
// Samples live in one bounded store (`Series`); when it is full every other sample is dropped,
// so a long run keeps its whole history at half the resolution instead of forgetting its start.

const MAX_SAMPLES = 2048;

/** The samples of a run: parallel arrays, one entry per kept sample, plus the latest one. */
export class Series {
  constructor(fields) {
    this.fields = fields;
    this.clear();
  }

  clear() {
    this.t = [];
    this.v = Object.fromEntries(this.fields.map((f) => [f, []]));
    // Once decimated, keep every `stride`-th offered sample so the spacing stays even.
    this.stride = 1;
    this.offered = 0;
    this.tail = null;
    this.tailKept = false;
  }

  /** Adds a sample `{t, field: value...}`. */
  push(sample) {
    this.tail = sample;
    this.tailKept = this.offered % this.stride === 0;
    this.offered += 1;
    if (!this.tailKept) return;
    this.t.push(sample.t);
    for (const f of this.fields) this.v[f].push(sample[f]);
    if (this.t.length >= MAX_SAMPLES) {
      const even = (_, i) => i % 2 === 0;
      this.t = this.t.filter(even);
      for (const f of this.fields) this.v[f] = this.v[f].filter(even);
      this.stride *= 2;
      this.offered = this.t.length * this.stride;
      this.tailKept = false;
    }
  }

  /** `{t, v}` of one field: the kept samples, then the latest if it was not kept. */
  points(field) {
    if (!this.tail || this.tailKept) return { t: this.t, v: this.v[field] };
    return { t: [...this.t, this.tail.t], v: [...this.v[field], this.tail[field]] };
  }

  last(field) {
    return this.tail ? this.tail[field] : null;
  }
}

const nf = new Intl.NumberFormat('en-US');

/** Short axis labels: 1234567 -> 1.23M. */
export function short(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return `${+(v / 1e9).toPrecision(3)}G`;
  if (a >= 1e6) return `${+(v / 1e6).toPrecision(3)}M`;
  if (a >= 1e4) return `${+(v / 1e3).toPrecision(3)}k`;
  if (Number.isInteger(v)) return nf.format(v);
  return v.toPrecision(3);
}

/** Simulated milliseconds as a readable duration. */
export function duration(ms) {
  if (ms < 1000) return `${ms} ms`;
  const s = ms / 1000;
  if (s < 120) return `${+s.toFixed(1)} s`;
  const m = s / 60;
  if (m < 120) return `${+m.toFixed(1)} min`;
  return `${+(m / 60).toFixed(1)} h`;
}

/**
 * One chart: a canvas with a title row. `spec = {field, title, color, format, yMax?}`;
 * `yMax(series)` may fix the top of the axis (free pages: the pool size; hit rate: 1).
 */
export class Chart {
  constructor(parent, spec) {
    this.spec = spec;
    const box = document.createElement('figure');
    box.className = 'chart';
    box.dataset.testid = `chart-${spec.field}`;
    box.id = `chart-${spec.field}`;
    const cap = document.createElement('figcaption');
    const title = document.createElement('span');
    title.textContent = spec.title;
    this.value = document.createElement('b');
    this.value.id = `chart-${spec.field}-value`;
    this.value.dataset.testid = `chart-${spec.field}-value`;
    cap.append(title, this.value);
    this.hover = document.createElement('span');
    this.hover.className = 'at';
    this.hover.id = `chart-${spec.field}-at`;
    this.canvas = document.createElement('canvas');
    this.canvas.height = 110;
    box.append(cap, this.canvas, this.hover);
    parent.append(box);
    // Hover reads one sample back: its simulated time and value.
    this.at = null;
    this.canvas.addEventListener('mousemove', (e) => {
      this.at = e.offsetX;
      if (this.series) this.draw(this.series);
    });
    this.canvas.addEventListener('mouseleave', () => {
      this.at = null;
      this.hover.textContent = '';
      if (this.series) this.draw(this.series);
    });
  }

  draw(series) {
    this.series = series;
    const { spec, canvas } = this;
    const dpr = window.devicePixelRatio || 1;
    const cssW = canvas.clientWidth || 300;
    const cssH = canvas.clientHeight || 110;
    if (canvas.width !== Math.round(cssW * dpr) || canvas.height !== Math.round(cssH * dpr)) {
      canvas.width = Math.round(cssW * dpr);
      canvas.height = Math.round(cssH * dpr);
    }
    const g = canvas.getContext('2d');
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, cssW, cssH);

    const { t: ts, v: vs } = series.points(spec.field);
    const last = series.last(spec.field);
    this.value.textContent = last === null ? '–' : spec.format(last);
    this.value.dataset.value = last === null ? '' : String(last);

    const left = 44;
    const right = 8;
    const top = 6;
    const bottom = 18;
    const w = cssW - left - right;
    const h = cssH - top - bottom;

    let lo = 0;
    let hi = spec.yMax ? spec.yMax(series) : 0;
    for (const v of vs) if (v !== null && v > hi) hi = v;
    if (spec.integer) {
      // Counts: an even top keeps the middle grid line on a whole number.
      hi = Math.max(2, Math.ceil(hi));
      if (hi % 2) hi += 1;
    } else if (hi <= lo) hi = lo + 1;
    const t0 = ts.length ? ts[0] : 0;
    const t1 = ts.length ? ts[ts.length - 1] : 0;
    // Evenly spaced samples (one per step or frame); the axis names the simulated times.
    const x = (i) => left + (vs.length > 1 ? (i / (vs.length - 1)) * w : w);
    const y = (v) => top + h - ((v - lo) / (hi - lo)) * h;

    // Grid and axis labels.
    g.font = '10px system-ui, sans-serif';
    g.fillStyle = '#8b93a7';
    g.strokeStyle = '#2b3345';
    g.lineWidth = 1;
    g.textAlign = 'right';
    g.textBaseline = 'middle';
    for (let i = 0; i <= 2; i++) {
      const v = lo + ((hi - lo) * i) / 2;
      const yy = Math.round(y(v)) + 0.5;
      g.beginPath();
      g.moveTo(left, yy);
      g.lineTo(left + w, yy);
      g.stroke();
      g.fillText(spec.axis ? spec.axis(v) : short(v), left - 4, yy);
    }
    g.textBaseline = 'alphabetic';
    g.textAlign = 'left';
    g.fillText(duration(t0), left, cssH - 4);
    g.textAlign = 'right';
    g.fillText(duration(t1), left + w, cssH - 4);

    if (vs.length === 0) return;
    // Area + line; null values (hit rate before any lookup) break the line.
    g.strokeStyle = spec.color;
    g.lineWidth = 1.5;
    g.beginPath();
    let pen = false;
    for (let i = 0; i < vs.length; i++) {
      if (vs[i] === null) {
        pen = false;
        continue;
      }
      const xx = x(i);
      if (pen) g.lineTo(xx, y(vs[i]));
      else g.moveTo(xx, y(vs[i]));
      pen = true;
    }
    g.stroke();
    if (last !== null) {
      g.fillStyle = spec.color;
      g.beginPath();
      g.arc(left + w, y(last), 2.5, 0, Math.PI * 2);
      g.fill();
    }
    if (this.at !== null && vs.length > 0) {
      const i = vs.length > 1 ? Math.round(Math.min(1, Math.max(0, (this.at - left) / w)) * (vs.length - 1)) : 0;
      const xx = Math.round(x(i)) + 0.5;
      g.strokeStyle = '#8b93a7';
      g.lineWidth = 1;
      g.beginPath();
      g.moveTo(xx, top);
      g.lineTo(xx, top + h);
      g.stroke();
      this.hover.textContent = `at ${duration(ts[i])}: ${vs[i] === null ? '–' : spec.format(vs[i])}`;
    }
  }
}
