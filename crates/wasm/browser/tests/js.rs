//! wasm-bindgen-test unit tests of the JS-facing `Simulator` class: what JavaScript sees
//! (plain objects, numbers, thrown Errors). Run in Node by `cargo xtask test`
//! (`cargo test -p kvpages-wasm --target wasm32-unknown-unknown --test js` with
//! wasm-bindgen-test-runner); natively this file is empty.
#![cfg(target_arch = "wasm32")]

use js_sys::{Reflect, Uint32Array};
use kvpages_wasm::js::Simulator;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_test::wasm_bindgen_test;

fn get(v: &JsValue, path: &str) -> JsValue {
    path.split('.').fold(v.clone(), |v, k| Reflect::get(&v, &JsValue::from_str(k)).expect("a property"))
}

fn num(v: &JsValue, path: &str) -> f64 {
    get(v, path).as_f64().unwrap_or_else(|| panic!("{path} is not a number"))
}

fn object(json: &str) -> JsValue {
    js_sys::JSON::parse(json).expect("valid JSON")
}

fn error_message(e: JsValue) -> String {
    e.dyn_into::<js_sys::Error>().expect("an Error").message().into()
}

#[wasm_bindgen_test]
fn config_defaults_and_figures_cross_as_plain_numbers() {
    let sim = Simulator::new(object(r#"{"ranks": 3, "pagesPerRank": 100}"#)).unwrap();
    let config = sim.config();
    assert_eq!(num(&config, "seed"), 1.0);
    assert_eq!(num(&config, "settings.reservationTtlMs"), 60_000.0);
    assert_eq!(get(&config, "settings.eviction").as_string().as_deref(), Some("lru"));
    assert!(get(&config, "settings.worldSize").is_null());
    let stats = sim.stats();
    assert_eq!(num(&stats, "requests"), 3.0);
    assert_eq!(num(&stats, "now"), 0.0);
    let ranks: js_sys::Array = get(&stats, "ranks").dyn_into().unwrap();
    assert_eq!(ranks.length(), 3);
    assert_eq!(num(&ranks.get(2), "free"), 100.0);
    assert_eq!(num(&stats, "counters.cacheHits"), 0.0);
    assert_eq!(num(&stats, "workload.allocFailures"), 0.0);
}

#[wasm_bindgen_test]
fn bad_input_throws_errors_that_name_the_field() {
    let e = Simulator::new(object(r#"{"ranks": 0}"#)).err().expect("refused");
    assert_eq!(error_message(e.into()), "ranks must be in 1..=64, not 0");
    let e = Simulator::new(object(r#"{"rank": 2}"#)).err().expect("refused");
    assert!(error_message(e.into()).starts_with("config: unknown field `rank`"));
    let mut sim = Simulator::new(JsValue::UNDEFINED).unwrap();
    let e = sim.set_workload(object(r#"{"kind": "nope"}"#)).unwrap_err();
    assert!(error_message(e.into()).starts_with("workload: unknown variant `nope`"));
    let e = sim.step(1).unwrap_err();
    assert_eq!(error_message(e.into()), "no workload is set");
    let e = sim.page_map(9, 10).unwrap_err();
    assert_eq!(error_message(e.into()), "rank 9 does not exist");
    let e = sim.advance(-1.0).unwrap_err();
    assert!(error_message(e.into()).starts_with("advance must be a whole number"));
}

#[wasm_bindgen_test]
fn requests_workloads_page_map_and_scenarios() {
    let mut sim = Simulator::new(object(r#"{"ranks": 1, "pagesPerRank": 8}"#)).unwrap();
    let k = "0123456789abcdef0123456789abcdef";
    let answer = sim.request("POST", "/keys/batch_allocate", &format!(r#"{{"rank":0,"keys":[["{k}",""]]}}"#));
    assert_eq!(num(&answer, "status"), 200.0);
    assert_eq!(get(&answer, "body").as_string().unwrap(), format!(r#"{{"rank":0,"results":[["{k}",0]]}}"#));
    let info = sim.page_info(0, 0).unwrap();
    assert_eq!(get(&info, "state").as_string().as_deref(), Some("reserved"));
    assert_eq!(get(&info, "key").as_string().as_deref(), Some(k));

    sim.set_workload(object(r#"{"kind": "unique-burst", "blocks": 2}"#)).unwrap();
    assert_eq!(sim.step(2).unwrap(), 6.0);
    let map: Uint32Array = JsValue::from(sim.page_map(0, 2).unwrap()).dyn_into().unwrap();
    // Pages 0..4: the hand reservation and 3 committed; 4..8: 1 committed, 3 free.
    assert_eq!(map.to_vec(), [0, 1, 3, 0, 0, 3, 0, 1, 0, 0]);
    let events: js_sys::Array = sim.events(3).dyn_into().unwrap();
    assert_eq!(events.length(), 3);
    assert_eq!(get(&events.get(2), "path").as_string().as_deref(), Some("/keys/confirm_write"));

    let scenario = sim.export_scenario();
    assert_eq!(get(&scenario, "format").as_string().as_deref(), Some("kvpages-scenario 1"));
    let again = Simulator::from_scenario(scenario).unwrap();
    let (a, b) = (js_sys::JSON::stringify(&again.stats()).unwrap(), js_sys::JSON::stringify(&sim.stats()).unwrap());
    assert_eq!(String::from(a), String::from(b));
}
