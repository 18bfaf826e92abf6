//! The loss curve as a PNG (plotters), labelled with DejaVu Sans where the
//! system has it (Debian: `fonts-dejavu-core`), bare lines otherwise.

use plotters::prelude::*;
use plotters::style::register_font;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

/// Our losses (blue), boostr's (red, where it ran) and the unigram entropy
/// (grey) against the step.
pub fn loss_curve(
    path: &str,
    variant: &str,
    ours: &[f64],
    theirs: &[f64],
    entropy: f64,
) -> Result<()> {
    let labelled = match std::fs::read(FONT) {
        Ok(bytes) => {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("{FONT} is not a font"))?;
            true
        }
        Err(_) => false,
    };
    let root = BitMapBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let top = ours.iter().chain(theirs).fold(entropy, |m, &x| m.max(x)) * 1.05;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(12);
    if labelled {
        builder
            .caption(
                "tiny_lm: training loss (nats per character)",
                ("sans-serif", 20),
            )
            .x_label_area_size(32)
            .y_label_area_size(48);
    }
    let mut chart = builder.build_cartesian_2d(0..ours.len(), 0.0..top)?;
    if labelled {
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("loss")
            .draw()?;
    }
    let series = |v: &[f64]| v.iter().copied().enumerate().collect::<Vec<_>>();
    let grey = BLACK.mix(0.4);
    let lines = [
        (variant, series(ours), BLUE.to_rgba()),
        ("boostr's attention", series(theirs), RED.to_rgba()),
        (
            "unigram entropy",
            vec![(0, entropy), (ours.len(), entropy)],
            grey,
        ),
    ];
    for (label, points, colour) in lines {
        if points.is_empty() {
            continue;
        }
        let drawn = chart.draw_series(LineSeries::new(points, colour))?;
        if labelled {
            drawn
                .label(label)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], colour));
        }
    }
    if labelled {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
