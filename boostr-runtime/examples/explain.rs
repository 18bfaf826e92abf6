//! Print what the compiler made of the stock variants: the checked IR, the
//! derivative d score / d s, the tile classifier, each target's source and
//! every kernel's launch contract.
//!
//! `cargo run -p boostr-runtime --example explain [name ...]` (names are
//! case-insensitive; none prints every stock variant).

use boostr_runtime::Variant;
use boostr_runtime::variant::CompiledStages;

macro_rules! compiled {
    ($($variant:ty),* $(,)?) => {
        [$(<$variant as Variant>::compiled()),*]
    };
}

fn main() {
    let all: [CompiledStages; _] = boostr_runtime::stock_variants!(compiled);
    let wanted: Vec<String> = std::env::args().skip(1).map(|a| a.to_lowercase()).collect();
    let mut shown = 0;
    for stages in all {
        if wanted.is_empty() || wanted.iter().any(|w| *w == stages.name.to_lowercase()) {
            println!(
                "################ {} ################\n{}",
                stages.name, stages.text
            );
            shown += 1;
        }
    }
    if shown == 0 {
        let names: Vec<&str> = all.iter().map(|s| s.name).collect();
        eprintln!(
            "no stock variant named {wanted:?}; known: {}",
            names.join(", ")
        );
        std::process::exit(2);
    }
}
