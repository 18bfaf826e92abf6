//! Print what the compiler made of the stock variants: the checked IR, the
//! derivative d score / d s, the tile classifier and each target's source.
//!
//! `cargo run -p boostr-runtime --example explain [name ...]` (names are
//! case-insensitive; none prints every stock variant).

use boostr_runtime::stock::{
    Alibi, Causal, CausalSlidingWindow, CausalSoftcap, FlashMask, Full, PrefixLm, SlidingWindow,
    Softcap,
};
use boostr_runtime::{CompiledStages, Variant};

fn main() {
    let all: [CompiledStages; 9] = [
        Full::compiled(),
        Causal::compiled(),
        SlidingWindow::compiled(),
        CausalSlidingWindow::compiled(),
        Alibi::compiled(),
        Softcap::compiled(),
        CausalSoftcap::compiled(),
        PrefixLm::compiled(),
        FlashMask::compiled(),
    ];
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
