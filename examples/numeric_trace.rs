//! The seed's numeric trace of one attention step, and its one-sigma table,
//! every number computed by this crate (or by an `ndarray` dot product where
//! the seed does a dot product by hand), then checked against the seed's
//! rounded figures: the example panics if the crate disagrees with the text.
//!
//! ```text
//! cargo run --release --example numeric_trace
//! ```

use ndarray::{Array1, Array2, Array4, ArrayView1, ArrayView2, Axis, array, s};
use sdpa::{AttentionError, AttentionOptions, scaled_dot_product_attention};

fn main() -> Result<(), AttentionError> {
    numeric_trace()?;
    one_sigma_table()?;
    println!("\nEvery figure matches the seed text.");
    Ok(())
}

/// Three tokens, `d_k = d_v = 2`, the output `y_3` of the third position.
fn numeric_trace() -> Result<(), AttentionError> {
    heading("A numeric trace of one attention step");

    // The seed gives only the dot products q_3·k_j = 1, 1, 2. These vectors
    // produce them: k_1 and k_2 are the unit axes, k_3 = q_3 = (1, 1).
    // Queries 1 and 2 only matter for the full 3×3 matrices at the end; each
    // is taken equal to its own key. The values are our choice: the two unit
    // axes and (1, 2), so that y_3 shows how much of each it blends in.
    let q: Array2<f64> = array![[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]];
    let k: Array2<f64> = array![[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]];
    let v: Array2<f64> = array![[1.0, 0.0], [0.0, 1.0], [1.0, 2.0]];
    let d_k = q.ncols();
    println!("d_k = d_v = {d_k}; the rows are positions 1, 2, 3.");
    print_matrix("queries q_i", q.view());
    print_matrix("keys    k_j", k.view());
    print_matrix("values  v_j", v.view());

    // The crate works on [batch, heads, len, d]: one sequence, one head.
    let as_4d = |x: &Array2<f64>| x.clone().insert_axis(Axis(0)).insert_axis(Axis(0));
    let (q4, k4, v4) = (as_4d(&q), as_4d(&k), as_4d(&v));
    let causal = AttentionOptions::new().causal();
    let q_3 = q.row(2);

    subheading("Step 1 — score: q_3 · k_j");
    let scores: Array1<f64> = k.dot(&q_3);
    println!(
        "q_3 = {}  →  scores {}",
        vector(q_3, 0),
        vector(scores.view(), 0)
    );
    check("scores", scores.view(), &["1", "1", "2"]);

    subheading("Step 2 — scale: divide by √d_k");
    let sqrt_d_k = (d_k as f64).sqrt();
    let scaled = &scores / sqrt_d_k;
    println!(
        "√d_k = {sqrt_d_k:.3}  →  scaled {}",
        vector(scaled.view(), 3)
    );
    check("scaled scores", scaled.view(), &["0.707", "0.707", "1.414"]);

    subheading("Step 3 — softmax: sdpa::core::attention_weights, causal, row 3");
    let weights = sdpa::core::attention_weights(q4.view(), k4.view(), &causal)?;
    let alpha = weights.slice(s![0, 0, 2, ..]).to_owned();
    println!(
        "α_3j = {}   (sum {:.6})",
        vector(alpha.view(), 3),
        alpha.sum()
    );
    check("weights α_3j", alpha.view(), &["0.248", "0.248", "0.503"]);
    assert!((alpha.sum() - 1.0).abs() < 1e-12, "weights must sum to 1");
    // The crate's weights are the softmax of step 2's numbers: its default
    // scale is 1/√d_k.
    let exps = scaled.mapv(f64::exp);
    let by_hand = &exps / exps.sum();
    assert_close("softmax of step 2", alpha.view(), by_hand.view());
    println!("Position 3 attends most to itself; positions 1 and 2 split the rest evenly.");

    subheading("Step 4 — weighted sum of values: sdpa::scaled_dot_product_attention");
    let out = scaled_dot_product_attention(q4.view(), k4.view(), v4.view(), &causal)?;
    let y_3 = out.slice(s![0, 0, 2, ..]).to_owned();
    let blend: Array1<f64> = alpha.dot(&v);
    println!("y_3         = {}", vector(y_3.view(), 4));
    println!(
        "Σ_j α_3j v_j = {:.4}·{} + {:.4}·{} + {:.4}·{} = {}",
        alpha[0],
        vector(v.row(0), 0),
        alpha[1],
        vector(v.row(1), 0),
        alpha[2],
        vector(v.row(2), 0),
        vector(blend.view(), 4)
    );
    assert_close("y_3 against Σ α v", y_3.view(), blend.view());
    println!("A blend of the three values, tilted toward v_3.");

    subheading("Without the √d_k scaling: .scale(1.0)");
    let unscaled_opts = AttentionOptions::new().causal().scale(1.0);
    let unscaled = sdpa::core::attention_weights(q4.view(), k4.view(), &unscaled_opts)?;
    let alpha_raw = unscaled.slice(s![0, 0, 2, ..]).to_owned();
    let y_3_raw = scaled_dot_product_attention(q4.view(), k4.view(), v4.view(), &unscaled_opts)?
        .slice(s![0, 0, 2, ..])
        .to_owned();
    println!(
        "raw scores {}  →  α_3j = {}  →  y_3 = {}",
        vector(scores.view(), 0),
        vector(alpha_raw.view(), 3),
        vector(y_3_raw.view(), 4)
    );
    check(
        "unscaled weights",
        alpha_raw.view(),
        &["0.212", "0.212", "0.576"],
    );
    assert!(alpha_raw[2] > alpha[2], "unscaled peak must be sharper");
    println!(
        "A sharper peak on position 3 ({:.3} instead of {:.3}): the √2 divisor softens it.",
        alpha_raw[2], alpha[2]
    );

    subheading("The causal mask: future keys get weight 0");
    let bidirectional =
        sdpa::core::attention_weights(q4.view(), k4.view(), &AttentionOptions::new())?;
    let causal_matrix = weights.slice(s![0, 0, .., ..]);
    let bidirectional_matrix = bidirectional.slice(s![0, 0, .., ..]);
    print_matrix("causal weights (row i = query i)", causal_matrix);
    print_matrix("bidirectional weights", bidirectional_matrix);
    for ((i, j), &w) in causal_matrix.indexed_iter() {
        if j > i {
            assert_eq!(w, 0.0, "causal weight ({i}, {j}) must be exactly 0");
        }
    }
    assert!(bidirectional_matrix[[0, 2]] > 0.0);
    assert_close(
        "row 3, causal and bidirectional",
        causal_matrix.row(2),
        bidirectional_matrix.row(2),
    );
    println!(
        "Above the diagonal the causal weights are exactly 0. Row 3 is the same in both:\n\
         position 3 has no future within these three tokens. An encoder's rows 1 and 2\n\
         also score the later keys."
    );
    Ok(())
}

/// The winner's probability for a one-sigma gap, with and without `1/√d_k`.
fn one_sigma_table() -> Result<(), AttentionError> {
    heading("Why the √d_k scaling: a one-sigma gap");
    println!(
        "The seed's one-sigma gap: a dot product of two d_k-dimensional vectors with\n\
         unit-variance entries has standard deviation √d_k, so the winning logit is √d_k\n\
         and the losing one 0. One query and two keys give exactly those dot products:\n\
         q = (1, …, 1)/√d_k, the winner k_w = (1, …, 1), the loser k_l = (1, −1, 1, −1, …)."
    );
    println!(
        "\n{:>6} {:>8} {:>8} {:>16} {:>16}",
        "d_k", "q·k_w", "q·k_l", "P(win) raw", "P(win) ÷√d_k"
    );
    let seed_raw = ["0.88", "0.9997", "1.0000"];
    for (&d_k, expected_raw) in [4_usize, 64, 1024].iter().zip(seed_raw) {
        let q = Array4::from_elem((1, 1, 1, d_k), 1.0 / (d_k as f64).sqrt());
        let k = Array4::from_shape_fn((1, 1, 2, d_k), |(_, _, key, c)| {
            if key == 0 || c % 2 == 0 { 1.0 } else { -1.0 }
        });
        let (keys, query): (ArrayView2<'_, f64>, ArrayView1<'_, f64>) =
            (k.slice(s![0, 0, .., ..]), q.slice(s![0, 0, 0, ..]));
        let dots: Array1<f64> = keys.dot(&query);
        let raw =
            sdpa::core::attention_weights(q.view(), k.view(), &AttentionOptions::new().scale(1.0))?;
        let scaled = sdpa::core::attention_weights(q.view(), k.view(), &AttentionOptions::new())?;
        let (p_raw, p_scaled) = (raw[[0, 0, 0, 0]], scaled[[0, 0, 0, 0]]);
        let decimals = expected_raw.len() - 2;
        println!(
            "{d_k:>6} {:>8.3} {:>8.3} {:>16} {:>16.2}",
            dots[0],
            dots[1],
            format!("{p_raw:.decimals$}"),
            p_scaled
        );
        assert!((dots[0] - (d_k as f64).sqrt()).abs() < 1e-9 && dots[1].abs() < 1e-9);
        assert_eq!(
            format!("{p_raw:.decimals$}"),
            expected_raw,
            "unscaled winner's probability at d_k = {d_k}"
        );
        assert_eq!(
            format!("{p_scaled:.2}"),
            "0.73",
            "scaled winner's probability at d_k = {d_k}"
        );
    }
    println!(
        "\nUnscaled, the softmax collapses onto one key as d_k grows; divided by √d_k\n\
         the same gap is exactly 1 at every d_k, and the winner holds at 0.73."
    );
    Ok(())
}

fn heading(title: &str) {
    println!("\n{title}\n{}", "=".repeat(title.chars().count()));
}

fn subheading(title: &str) {
    println!("\n{title}\n{}", "-".repeat(title.chars().count()));
}

/// `(a, b, c)` with `decimals` places.
fn vector(x: ArrayView1<'_, f64>, decimals: usize) -> String {
    let parts: Vec<String> = x.iter().map(|v| format!("{v:.decimals$}")).collect();
    format!("({})", parts.join(", "))
}

fn print_matrix(name: &str, m: ArrayView2<'_, f64>) {
    println!("{name}:");
    for row in m.rows() {
        let cells: Vec<String> = row.iter().map(|v| format!("{v:7.3}")).collect();
        println!("  [{} ]", cells.join(""));
    }
}

/// Panics unless `values`, rounded as `expected` is written, equal it: the
/// seed's figures are rounded, so this is the comparison the text supports.
fn check(what: &str, values: ArrayView1<'_, f64>, expected: &[&str]) {
    let got: Vec<String> = values
        .iter()
        .zip(expected)
        .map(|(v, e)| {
            let decimals = e.split_once('.').map_or(0, |(_, frac)| frac.len());
            format!("{v:.decimals$}")
        })
        .collect();
    assert_eq!(got, expected, "{what} differ from the seed's");
}

fn assert_close(what: &str, a: ArrayView1<'_, f64>, b: ArrayView1<'_, f64>) {
    let close = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12);
    assert!(close, "{what}: {a} vs {b}");
}
