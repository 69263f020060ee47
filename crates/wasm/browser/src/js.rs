//! The JavaScript face: `Simulator`, a thin wasm-bindgen class over [`Sim`]. Data crosses into
//! JavaScript through serde-wasm-bindgen as plain objects (numbers, not BigInts); objects coming
//! from JavaScript are read strictly (unknown fields refused); errors are thrown as `Error`s
//! whose message names the bad field.

use serde::Serialize;
use wasm_bindgen::prelude::*;

use crate::sim::{Config, Event, Scenario, Sim};
use crate::workload::WorkloadSpec;

fn to_js<T: Serialize + ?Sized>(value: &T) -> JsValue {
    value.serialize(&serde_wasm_bindgen::Serializer::json_compatible()).expect("simulator figures serialize")
}

/// Objects coming in go through JSON text and serde_json, not serde-wasm-bindgen: its struct
/// deserializer reads only the fields it knows, so a misspelt option would pass unnoticed.
fn from_js<T: serde::de::DeserializeOwned>(what: &str, value: JsValue) -> Result<T, JsError> {
    let text: String =
        js_sys::JSON::stringify(&value).map_err(|_| JsError::new(&format!("{what}: not a JSON-like object")))?.into();
    serde_json::from_str(&text).map_err(|e| {
        let e = e.to_string();
        let e = e.rfind(" at line ").map_or(e.as_str(), |i| &e[..i]);
        JsError::new(&format!("{what}: {e}"))
    })
}

fn ms(what: &str, v: f64) -> Result<u64, JsError> {
    if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= crate::sim::MAX_SEED as f64 {
        Ok(v as u64)
    } else {
        Err(JsError::new(&format!("{what} must be a whole number of milliseconds >= 0, not {v}")))
    }
}

/// A simulated kvpages cluster running the real core (see the crate docs).
#[wasm_bindgen]
pub struct Simulator {
    sim: Sim,
}

#[wasm_bindgen]
impl Simulator {
    /// A fresh cluster from a config object (missing fields take their defaults).
    #[wasm_bindgen(constructor)]
    pub fn new(config: JsValue) -> Result<Simulator, JsError> {
        let config: Config =
            if config.is_undefined() || config.is_null() { Config::default() } else { from_js("config", config)? };
        Ok(Simulator { sim: Sim::new(config)? })
    }

    /// Rebuilds a simulation by replaying an exported scenario object.
    #[wasm_bindgen(js_name = fromScenario)]
    pub fn from_scenario(scenario: JsValue) -> Result<Simulator, JsError> {
        let scenario: Scenario = from_js("scenario", scenario)?;
        Ok(Simulator { sim: Sim::from_scenario(&scenario)? })
    }

    /// The config, defaults filled in.
    pub fn config(&self) -> JsValue {
        to_js(self.sim.config())
    }

    /// Simulated time (ms).
    pub fn now(&self) -> f64 {
        self.sim.now() as f64
    }

    /// Moves the clock by `ms`.
    pub fn advance(&mut self, ms_: f64) -> Result<(), JsError> {
        self.sim.advance(ms("advance", ms_)?);
        Ok(())
    }

    /// Sends a request; `{status, body}` exactly as `kvpages serve` answers it.
    pub fn request(&mut self, method: &str, path: &str, body: &str) -> JsValue {
        #[derive(Serialize)]
        struct Answer {
            status: u16,
            body: String,
        }
        let (status, body) = self.sim.request(method, path, body);
        to_js(&Answer { status, body })
    }

    /// Switches to a workload spec object.
    #[wasm_bindgen(js_name = setWorkload)]
    pub fn set_workload(&mut self, spec: JsValue) -> Result<(), JsError> {
        let spec: WorkloadSpec = from_js("workload", spec)?;
        Ok(self.sim.set_workload(spec)?)
    }

    /// Runs `n` workload steps; returns the number of requests they sent.
    pub fn step(&mut self, n: u32) -> Result<f64, JsError> {
        Ok(self.sim.step(u64::from(n))? as f64)
    }

    /// The figures the page shows.
    pub fn stats(&self) -> JsValue {
        to_js(&self.sim.stats())
    }

    /// Page counts of `rank` in `cells` runs of pages: 5 per cell (free, reserved, committed,
    /// leased, quarantined).
    #[wasm_bindgen(js_name = pageMap)]
    pub fn page_map(&self, rank: u32, cells: u32) -> Result<Vec<u32>, JsError> {
        Ok(self.sim.page_map(rank, cells)?)
    }

    /// One page: `{page, state, key, ageMs, expiresInMs}`.
    #[wasm_bindgen(js_name = pageInfo)]
    pub fn page_info(&self, rank: u32, page: u32) -> Result<JsValue, JsError> {
        Ok(to_js(&self.sim.page_info(rank, page)?))
    }

    /// The last `n` requests and replies, oldest first.
    pub fn events(&self, n: u32) -> JsValue {
        let events: Vec<&Event> = self.sim.events(n as usize).collect();
        to_js(&events)
    }

    /// The scenario (config + the user's actions) as an object to save as JSON.
    #[wasm_bindgen(js_name = exportScenario)]
    pub fn export_scenario(&self) -> JsValue {
        to_js(&self.sim.scenario())
    }
}
