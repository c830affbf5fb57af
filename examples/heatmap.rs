//! Draws the attention weights of a small multi-head layer as an SVG
//! heatmap: one panel per head, bidirectional ([`Attention`]) and causal
//! ([`CausalAttention`]) side by side, tokens on both axes, a colour scale.
//!
//! ```text
//! cargo run --example heatmap                 # writes docs/heatmap.svg
//! cargo run --example heatmap -- weights.svg  # or anywhere else
//! ```
//!
//! The input is an eight-token sentence with made-up embeddings: a seeded
//! random vector per word plus a sinusoidal position code, so the two
//! "the"s differ only by position. The layers are seeded, so the picture is
//! the same on every run and machine. The weights come from
//! `forward_with_weights`, which computes them only when asked.
//!
//! The SVG is written by hand (rectangles, text, one gradient): no plotting
//! dependency. Hovering over a cell shows its weight.

use std::fmt::Write as _;
use std::path::PathBuf;

use ndarray::{Array2, Array3};
use sdpa::{Attention, AttentionConfig, AttentionOptions, CausalAttention};

const TOKENS: [&str; 8] = ["the", "small", "cat", "sat", "on", "the", "warm", "mat"];
const D_MODEL: usize = 16;
const HEADS: usize = 4;
const SEED: u64 = 2024;
/// Scales the embeddings up so that the scores spread out and the softmax
/// picks favourites (with unit-size inputs every row is nearly uniform).
const EMBEDDING_SCALE: f64 = 2.5;

// Layout, in SVG user units (pixels).
/// Side of one cell.
const CELL: f64 = 22.0;
/// Room left of a panel for the query labels.
const ROW_LABELS: f64 = 46.0;
/// Room above a panel for the head's title and the rotated key labels.
const PANEL_TITLE: f64 = 18.0;
const COLUMN_LABELS: f64 = 46.0;
/// Space between panels, and between the two groups.
const GAP: f64 = 18.0;
const GROUP_GAP: f64 = 40.0;
/// Room at the top for the picture's title and the group titles.
const TITLE: f64 = 62.0;
const MARGIN: f64 = 16.0;
/// The colour bar on the right.
const BAR_WIDTH: f64 = 16.0;
const BAR_ROOM: f64 = 100.0;
const FONT: &str = "font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\"";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs/heatmap.svg"));

    let x = embeddings();
    let config = AttentionConfig::new(D_MODEL, HEADS).with_output_projection(D_MODEL);
    let opts = AttentionOptions::new();
    // The same seed gives both layers the same parameters: the panels differ
    // only by the causal mask.
    let (_, bidirectional) =
        Attention::<f64>::new_seeded(config, SEED)?.forward_with_weights(x.view(), &opts)?;
    let (_, causal) =
        CausalAttention::<f64>::new_seeded(config, SEED)?.forward_with_weights(x.view(), &opts)?;

    let svg = draw(&[
        ("Bidirectional: Attention", &bidirectional, false),
        ("Causal: CausalAttention", &causal, true),
    ]);
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&path, svg)?;
    println!(
        "wrote the attention weights of {} heads over {} tokens to {}",
        HEADS,
        TOKENS.len(),
        path.display()
    );
    Ok(())
}

/// `[len, d_model]`: a seeded random vector per distinct word, plus a
/// sinusoidal position code.
fn embeddings() -> Array2<f64> {
    let mut words: Vec<&str> = TOKENS.to_vec();
    words.sort_unstable();
    words.dedup();
    let mut rng = SplitMix64(SEED);
    let vectors = Array2::from_shape_simple_fn((words.len(), D_MODEL), || rng.uniform());
    Array2::from_shape_fn((TOKENS.len(), D_MODEL), |(i, c)| {
        let word = words.binary_search(&TOKENS[i]).unwrap_or(0);
        let frequency = 1.0 / 100_f64.powf((c / 2 * 2) as f64 / D_MODEL as f64);
        let angle = i as f64 * frequency;
        let position = if c % 2 == 0 { angle.sin() } else { angle.cos() };
        EMBEDDING_SCALE * (vectors[[word, c]] + 0.5 * position)
    })
}

/// The whole picture: for each `(title, weights [heads, len, len], causal)`
/// group, a 2-column grid of head panels; the groups side by side, then the
/// colour bar.
fn draw(groups: &[(&str, &Array3<f64>, bool)]) -> String {
    let len = TOKENS.len() as f64;
    let panel_width = ROW_LABELS + len * CELL;
    let panel_height = PANEL_TITLE + COLUMN_LABELS + len * CELL;
    let columns = 2;
    let rows = HEADS.div_ceil(columns);
    let group_width = columns as f64 * panel_width + (columns - 1) as f64 * GAP;
    let group_height = rows as f64 * panel_height + (rows - 1) as f64 * GAP;
    let groups_width = groups.len() as f64 * group_width + (groups.len() - 1) as f64 * GROUP_GAP;
    let width = MARGIN + groups_width + BAR_ROOM + MARGIN;
    let height = MARGIN + TITLE + group_height + MARGIN + 20.0;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" {FONT}>"
    );
    let _ = writeln!(
        svg,
        "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{MARGIN}\" y=\"{}\" font-size=\"17\" font-weight=\"bold\">Attention weights, \
         {HEADS} heads, d_model = {D_MODEL}</text>",
        MARGIN + 16.0
    );
    let _ = writeln!(
        svg,
        "<text x=\"{MARGIN}\" y=\"{}\" font-size=\"12\" fill=\"#444\">Row: the query token; \
         column: the key token it attends to. Each row sums to 1.</text>",
        MARGIN + 34.0
    );
    for (g, (title, weights, causal)) in groups.iter().enumerate() {
        let left = MARGIN + g as f64 * (group_width + GROUP_GAP);
        let top = MARGIN + TITLE;
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{}\" font-size=\"14\" font-weight=\"bold\" \
             text-anchor=\"middle\">{title}</text>",
            left + group_width / 2.0,
            top - 6.0
        );
        for h in 0..HEADS {
            let x = left + (h % columns) as f64 * (panel_width + GAP);
            let y = top + (h / columns) as f64 * (panel_height + GAP);
            panel(&mut svg, x, y, h, weights, *causal);
        }
    }
    colour_bar(
        &mut svg,
        MARGIN + groups_width + 28.0,
        MARGIN + TITLE + PANEL_TITLE + COLUMN_LABELS,
    );
    svg.push_str("</svg>\n");
    svg
}

/// One head's `len × len` panel with its labels, its top-left corner at
/// `(x, y)`.
fn panel(svg: &mut String, x: f64, y: f64, head: usize, weights: &Array3<f64>, causal: bool) {
    let grid_x = x + ROW_LABELS;
    let grid_y = y + PANEL_TITLE + COLUMN_LABELS;
    let side = TOKENS.len() as f64 * CELL;
    let _ = writeln!(
        svg,
        "<text x=\"{}\" y=\"{}\" font-size=\"12\" text-anchor=\"middle\">head {}</text>",
        grid_x + side / 2.0,
        y + 12.0,
        head + 1
    );
    for (j, token) in TOKENS.iter().enumerate() {
        // Key labels, rotated to read upwards, ending just above their column.
        let cx = grid_x + (j as f64 + 0.5) * CELL + 4.0;
        let cy = grid_y - 4.0;
        let _ = writeln!(
            svg,
            "<text x=\"{cx}\" y=\"{cy}\" font-size=\"11\" transform=\"rotate(-90 {cx} {cy})\">{token}</text>"
        );
    }
    for (i, token) in TOKENS.iter().enumerate() {
        let _ = writeln!(
            svg,
            "<text x=\"{}\" y=\"{}\" font-size=\"11\" text-anchor=\"end\">{token}</text>",
            grid_x - 5.0,
            grid_y + (i as f64 + 0.5) * CELL + 4.0
        );
        for (j, key) in TOKENS.iter().enumerate() {
            let weight = weights[[head, i, j]];
            let masked = causal && j > i;
            let fill = if masked {
                "#e8e8e8".to_owned()
            } else {
                colour(weight)
            };
            let note = if masked {
                "masked (future)".to_owned()
            } else {
                format!("{weight:.3}")
            };
            let _ = writeln!(
                svg,
                "<rect x=\"{}\" y=\"{}\" width=\"{CELL}\" height=\"{CELL}\" fill=\"{fill}\">\
                 <title>head {}: {token} ({i}) → {key} ({j}): {note}</title></rect>",
                grid_x + j as f64 * CELL,
                grid_y + i as f64 * CELL,
                head + 1
            );
        }
    }
    let _ = writeln!(
        svg,
        "<rect x=\"{grid_x}\" y=\"{grid_y}\" width=\"{side}\" height=\"{side}\" fill=\"none\" \
         stroke=\"#888\" stroke-width=\"0.5\"/>"
    );
}

/// A vertical colour bar from 0 (bottom) to 1 (top), with ticks, and the
/// swatch for masked cells below it.
fn colour_bar(svg: &mut String, x: f64, y: f64) {
    let height = TOKENS.len() as f64 * CELL * 1.5;
    let _ = writeln!(
        svg,
        "<defs><linearGradient id=\"scale\" x1=\"0\" y1=\"1\" x2=\"0\" y2=\"0\">"
    );
    for (stop, _) in VIRIDIS.iter().enumerate() {
        let t = stop as f64 / (VIRIDIS.len() - 1) as f64;
        let _ = writeln!(svg, "<stop offset=\"{t}\" stop-color=\"{}\"/>", colour(t));
    }
    let _ = writeln!(svg, "</linearGradient></defs>");
    let _ = writeln!(
        svg,
        "<text x=\"{x}\" y=\"{}\" font-size=\"12\">weight</text>\n\
         <rect x=\"{x}\" y=\"{y}\" width=\"{BAR_WIDTH}\" height=\"{height}\" fill=\"url(#scale)\" \
         stroke=\"#888\" stroke-width=\"0.5\"/>",
        y - 8.0
    );
    for tick in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let ty = y + height * (1.0 - tick);
        let _ = writeln!(
            svg,
            "<line x1=\"{}\" y1=\"{ty}\" x2=\"{}\" y2=\"{ty}\" stroke=\"#444\"/>\
             <text x=\"{}\" y=\"{}\" font-size=\"11\">{tick}</text>",
            x + BAR_WIDTH,
            x + BAR_WIDTH + 4.0,
            x + BAR_WIDTH + 7.0,
            ty + 4.0
        );
    }
    let swatch = y + height + 18.0;
    let _ = writeln!(
        svg,
        "<rect x=\"{x}\" y=\"{swatch}\" width=\"{BAR_WIDTH}\" height=\"{BAR_WIDTH}\" \
         fill=\"#e8e8e8\" stroke=\"#888\" stroke-width=\"0.5\"/>\
         <text x=\"{}\" y=\"{}\" font-size=\"11\">masked</text>",
        x + BAR_WIDTH + 7.0,
        swatch + 12.0
    );
}

/// Matplotlib's viridis at nine evenly spaced points: perceptually uniform
/// and readable in greyscale and by most colour-blind readers.
const VIRIDIS: [(u8, u8, u8); 9] = [
    (0x44, 0x01, 0x54),
    (0x47, 0x2c, 0x7a),
    (0x3b, 0x52, 0x8b),
    (0x2c, 0x72, 0x8e),
    (0x21, 0x91, 0x8c),
    (0x28, 0xae, 0x80),
    (0x5e, 0xc9, 0x62),
    (0xad, 0xdc, 0x30),
    (0xfd, 0xe7, 0x25),
];

/// The colour of `t` in `[0, 1]`, interpolated between the viridis points.
fn colour(t: f64) -> String {
    let t = t.clamp(0.0, 1.0) * (VIRIDIS.len() - 1) as f64;
    let i = (t.floor() as usize).min(VIRIDIS.len() - 2);
    let f = t - i as f64;
    let (a, b) = (VIRIDIS[i], VIRIDIS[i + 1]);
    let mix = |x: u8, y: u8| (x as f64 + (y as f64 - x as f64) * f).round() as u8;
    format!(
        "#{:02x}{:02x}{:02x}",
        mix(a.0, b.0),
        mix(a.1, b.1),
        mix(a.2, b.2)
    )
}

/// SplitMix64, for the made-up embeddings.
struct SplitMix64(u64);

impl SplitMix64 {
    /// Uniform in `[-1, 1)`.
    fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1_u64 << 53) as f64 * 2.0 - 1.0
    }
}
