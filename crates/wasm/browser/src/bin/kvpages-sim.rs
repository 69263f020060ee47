//! `kvpages-sim replay FILE`: replays a scenario exported by the browser simulator, natively,
//! and prints the figures the page shows (`Simulator.stats()`) as JSON. The browser test
//! compares the page with it; anyone can use it to check a shared scenario.

use std::process::ExitCode;

use kvpages_wasm::{Scenario, Sim};

const USAGE: &str = "usage: kvpages-sim replay FILE.json   (prints the scenario's figures as JSON)";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [cmd, file] = args.as_slice() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    if cmd != "replay" {
        eprintln!("unknown command '{cmd}'\n{USAGE}");
        return ExitCode::from(2);
    }
    let run = || -> Result<String, String> {
        let text = std::fs::read_to_string(file).map_err(|e| format!("cannot read {file}: {e}"))?;
        let scenario: Scenario = serde_json::from_str(&text).map_err(|e| format!("{file} is not a scenario: {e}"))?;
        let sim = Sim::from_scenario(&scenario).map_err(|e| format!("{file}: {e}"))?;
        Ok(serde_json::to_string_pretty(&sim.stats()).expect("figures serialize"))
    };
    match run() {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvpages-sim: {e}");
            ExitCode::FAILURE
        }
    }
}
