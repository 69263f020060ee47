//! Progress lines for long work (recovery, SGLang imports): what an operator watches while a
//! start or an import takes minutes.

use std::time::{Duration, Instant};

/// Progress of long work (recovery, imports) for the operator: a line every [`Progress::EVERY`]
/// with the count so far and the rate, and a final line with the count, the time and the rate.
pub struct Progress {
    what: String,
    unit: &'static str,
    total: Option<u64>,
    clock: Box<dyn Fn() -> Duration + Send>,
    sink: Box<dyn FnMut(&str) + Send>,
    started: Duration,
    last: Duration,
    calls: u32,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress").field("what", &self.what).field("total", &self.total).finish()
    }
}

impl Progress {
    /// How often a line is printed while the work goes on.
    pub const EVERY: Duration = Duration::from_secs(1);

    /// Progress of `what`, counted in `unit`s (out of `total`, when known), to the log.
    pub fn new(what: impl Into<String>, unit: &'static str, total: Option<u64>) -> Progress {
        let zero = Instant::now();
        Progress::with(what, unit, total, Box::new(move || zero.elapsed()), Box::new(|line| tracing::info!("{line}")))
    }

    /// [`Progress::new`] with a clock (time since any fixed zero) and a sink for the lines.
    pub fn with(
        what: impl Into<String>,
        unit: &'static str,
        total: Option<u64>,
        clock: Box<dyn Fn() -> Duration + Send>,
        sink: Box<dyn FnMut(&str) + Send>,
    ) -> Progress {
        let started = clock();
        Progress { what: what.into(), unit, total, clock, sink, started, last: started, calls: 0 }
    }

    fn rate(&self, done: u64, now: Duration) -> String {
        let secs = (now - self.started).as_secs_f64();
        if secs <= 0.0 { "-".to_owned() } else { format!("{:.0}", done as f64 / secs) }
    }

    /// `done` units so far; prints a line when [`Progress::EVERY`] has passed since the last.
    /// Cheap enough to call for every unit (the clock is read every 256 calls).
    pub fn update(&mut self, done: u64) {
        self.calls = self.calls.wrapping_add(1);
        if !self.calls.is_multiple_of(256) {
            return;
        }
        let now = (self.clock)();
        if now - self.last < Progress::EVERY {
            return;
        }
        self.last = now;
        let rate = self.rate(done, now);
        let line = match self.total {
            Some(total) => format!(
                "{}: {done} of {total} {} ({:.0}%), {rate} {}/s",
                self.what,
                self.unit,
                done as f64 * 100.0 / total.max(1) as f64,
                self.unit
            ),
            None => format!("{}: {done} {}, {rate} {}/s", self.what, self.unit, self.unit),
        };
        (self.sink)(&line);
    }

    /// The final line: `done` units in how long, at what rate.
    pub fn finish(mut self, done: u64) {
        let now = (self.clock)();
        let rate = self.rate(done, now);
        let line = format!(
            "{}: done, {done} {} in {:.2} s ({rate} {}/s)",
            self.what,
            self.unit,
            (now - self.started).as_secs_f64(),
            self.unit
        );
        (self.sink)(&line);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    #[test]
    fn progress_prints_counts_and_rate_every_second_and_a_final_line() {
        // A clock that moves 0.5 s each time it is read; it is read at the start, every 256
        // updates, and at the end.
        let reads = Arc::new(AtomicU64::new(0));
        let r = reads.clone();
        let clock = Box::new(move || Duration::from_millis(500 * r.fetch_add(1, Ordering::Relaxed)));
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let l = lines.clone();
        let sink = Box::new(move |line: &str| l.lock().unwrap().push(line.to_owned()));
        let mut p = Progress::with("replaying", "records", Some(2048), clock, sink);
        for done in 1..=1024 {
            p.update(done);
        }
        p.finish(1024);
        assert_eq!(
            *lines.lock().unwrap(),
            [
                "replaying: 512 of 2048 records (25%), 512 records/s",
                "replaying: 1024 of 2048 records (50%), 512 records/s",
                "replaying: done, 1024 records in 2.50 s (410 records/s)",
            ]
        );
        assert_eq!(reads.load(Ordering::Relaxed), 6);
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let l = lines.clone();
        let mut p = Progress::with(
            "reading",
            "keys",
            None,
            Box::new(|| Duration::from_secs(3)),
            Box::new(move |line: &str| l.lock().unwrap().push(line.to_owned())),
        );
        for done in 1..=300 {
            p.update(done);
        }
        p.finish(300);
        assert_eq!(*lines.lock().unwrap(), ["reading: done, 300 keys in 0.00 s (- keys/s)"]);
    }
}
