//! A [`Timeline`] drawn as one self-contained SVG: panels, stacked bands, the grey "other" band, axes, legend.

use super::timeline::{Panel, PlotOptions, Span, Timeline, MAX_PIXELS};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use umm::{Error, Result};
use umm_placement::units::human_bytes;

const LEFT: f64 = 86.0;
const RIGHT: f64 = 24.0;
const TITLE_H: f64 = 58.0;
const PANEL_TOP: f64 = 44.0;
const PANEL_BOTTOM: f64 = 40.0;
const PALETTE: [&str; 10] =
    ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6"];

/// Renders `timeline` as a self-contained SVG document.
///
/// Every allocation drawn on its own is a `<polygon class="alloc">` with `data-id`, `data-bytes`, `data-start`
/// and `data-end`; the merged small ones are one `<polygon class="other">`; each panel's peak is a
/// `<g class="peak">` with `data-step` and `data-bytes`. O(n log n + frees × live bands above them).
pub fn render_svg(timeline: &Timeline, options: &PlotOptions) -> String {
    let width = f64::from(options.width.clamp(300, MAX_PIXELS));
    let panel_h = f64::from(options.panel_height.clamp(120, MAX_PIXELS));
    let height = TITLE_H + panel_h * timeline.panels.len().max(1) as f64;
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="12">"#
    );
    let _ = writeln!(svg, "<title>{}</title>", escape(&timeline.title));
    svg.push_str(
        "<style>.alloc{stroke:#fff;stroke-width:0.3}.alloc:hover{stroke:#000;stroke-width:1}\
         .other{fill:#c8c8c8}.axis{stroke:#444}.grid{stroke:#e4e4e4}.reserved{fill:none;stroke:#222;\
         stroke-dasharray:5 3}.peakline{stroke:#d00;stroke-dasharray:4 3}text{fill:#222}</style>\n",
    );
    let _ = writeln!(svg, r##"<rect width="{width}" height="{height}" fill="#fff"/>"##);
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="26" font-size="16" font-weight="bold">{}</text>"#,
        escape(&timeline.title)
    );
    legend(&mut svg);
    for (i, panel) in timeline.panels.iter().enumerate() {
        let frame = Frame {
            left: LEFT,
            top: TITLE_H + panel_h * i as f64 + PANEL_TOP,
            width: width - LEFT - RIGHT,
            height: panel_h - PANEL_TOP - PANEL_BOTTOM,
            steps: timeline.steps.max(1),
            max_bytes: 1,
        };
        render_panel(&mut svg, timeline, panel, frame, options);
    }
    svg.push_str("</svg>\n");
    svg
}

/// The key to the drawing, under the title: what a coloured band, a grey band, the dashed black line and the red
/// line mean.
fn legend(svg: &mut String) {
    const ITEMS: [(&str, &str); 4] = [
        ("band", "one allocation: its height is its size, its span its lifetime (colour by label)"),
        ("other", "small allocations, merged"),
        ("reserved", "reserved by the pools"),
        ("peak", "peak of live bytes"),
    ];
    let (mut x, y) = (LEFT, 46.0);
    svg.push_str("<g class=\"legend\">");
    for (kind, text) in ITEMS {
        let swatch = match kind {
            "band" => {
                format!(r#"<rect x="{}" y="{}" width="14" height="10" fill="{}"/>"#, c(x), c(y - 9.0), PALETTE[0])
            }
            "other" => format!(r##"<rect x="{}" y="{}" width="14" height="10" fill="#c8c8c8"/>"##, c(x), c(y - 9.0)),
            "reserved" => format!(
                r#"<line class="reserved" x1="{}" y1="{}" x2="{}" y2="{}"/>"#,
                c(x),
                c(y - 4.0),
                c(x + 14.0),
                c(y - 4.0)
            ),
            _ => format!(
                r#"<line class="peakline" x1="{}" y1="{}" x2="{}" y2="{}"/>"#,
                c(x),
                c(y - 4.0),
                c(x + 14.0),
                c(y - 4.0)
            ),
        };
        let _ =
            write!(svg, r##"{swatch}<text x="{}" y="{}" fill="#555" font-size="11">{text}</text>"##, c(x + 18.0), c(y));
        // About 5.6 px a character at 11 px: the next item starts after this one's text.
        x += 18.0 + text.len() as f64 * 5.6 + 16.0;
    }
    svg.push_str("</g>\n");
}

/// Writes the SVG of `timeline` to `path`.
pub fn write_svg(timeline: &Timeline, options: &PlotOptions, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    std::fs::write(path, render_svg(timeline, options))
        .map_err(|source| Error::Io { path: path.display().to_string(), source })
}

/// Where a panel's plot area is and what it spans.
#[derive(Debug, Clone, Copy)]
struct Frame {
    left: f64,
    top: f64,
    width: f64,
    height: f64,
    steps: u64,
    max_bytes: u64,
}

impl Frame {
    fn x(&self, step: u64) -> f64 {
        self.left + step as f64 * self.width / self.steps as f64
    }
    fn y(&self, bytes: u64) -> f64 {
        self.top + self.height - bytes as f64 * self.height / self.max_bytes as f64
    }
    fn column(&self, step: u64, columns: usize) -> usize {
        ((step as f64 / self.steps as f64 * columns as f64) as usize).min(columns - 1)
    }
}

/// One coordinate, rounded to a tenth of a pixel.
fn c(v: f64) -> String {
    let r = (v * 10.0).round() / 10.0;
    if r == r.trunc() {
        format!("{}", r as i64)
    } else {
        format!("{r:.1}")
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn render_panel(svg: &mut String, timeline: &Timeline, panel: &Panel, mut f: Frame, options: &PlotOptions) {
    let (peak_step, peak_bytes) = panel.peak();
    let reserved_max = panel.reserved.iter().map(|r| r.1).max().unwrap_or(0);
    f.max_bytes = nice_ceiling(peak_bytes.max(reserved_max).max(1) + peak_bytes.max(reserved_max) / 20);
    let drawn = choose_drawn(&panel.spans, options.max_shapes);
    let n_drawn = drawn.iter().filter(|&&d| d).count();
    let _ = writeln!(
        svg,
        r#"<g class="panel" data-name="{}" data-peak-step="{peak_step}" data-peak-bytes="{peak_bytes}">"#,
        escape(&panel.name)
    );
    let merged = panel.spans.len() - n_drawn;
    let other_note = if merged > 0 {
        let largest = panel.spans.iter().zip(&drawn).filter(|(_, &d)| !d).map(|(s, _)| s.bytes).max().unwrap_or(0);
        format!("; {merged} smaller (≤ {}) merged in grey", human_bytes(largest))
    } else {
        String::new()
    };
    let reserved_note = if panel.reserved.is_empty() { "" } else { "; dashed: reserved by the pools" };
    let _ = writeln!(
        svg,
        r##"<text x="{}" y="{}" font-size="13" font-weight="bold">{}</text><text x="{}" y="{}" fill="#555">{} allocations{other_note}; peak {} at {} {peak_step}{reserved_note}</text>"##,
        c(f.left),
        c(f.top - 24.0),
        escape(&panel.name),
        c(f.left),
        c(f.top - 9.0),
        panel.spans.len(),
        human_bytes(peak_bytes),
        timeline.step_name,
    );
    axes(svg, timeline, &f);
    svg.push_str("<g class=\"allocs\">\n");
    bands(svg, panel, &drawn, &f);
    svg.push_str("</g>\n");
    if !panel.reserved.is_empty() {
        let mut points = String::new();
        let mut last = 0;
        for &(step, bytes) in &panel.reserved {
            let _ = write!(points, "{},{} {},{} ", c(f.x(step)), c(f.y(last)), c(f.x(step)), c(f.y(bytes)));
            last = bytes;
        }
        let _ = write!(points, "{},{}", c(f.x(f.steps)), c(f.y(last)));
        let _ = writeln!(
            svg,
            r#"<polyline class="reserved" points="{points}"><title>reserved by the pools</title></polyline>"#
        );
    }
    // The peak: a dashed line at its height, a dot where it happens, and its value.
    let (px, py) = (f.x(peak_step) + f.width / f.steps as f64 / 2.0, f.y(peak_bytes));
    let anchor = if px > f.left + f.width * 0.75 { "end" } else { "start" };
    let dx = if anchor == "end" { -8.0 } else { 8.0 };
    let _ = writeln!(
        svg,
        r##"<g class="peak" data-step="{peak_step}" data-bytes="{peak_bytes}"><line class="peakline" x1="{}" y1="{}" x2="{}" y2="{}"/><circle cx="{}" cy="{}" r="4" fill="#d00"/><text x="{}" y="{}" text-anchor="{anchor}" fill="#d00" font-weight="bold">peak {} at {} {peak_step}</text></g>"##,
        c(f.left),
        c(py),
        c(f.left + f.width),
        c(py),
        c(px),
        c(py),
        c(px + dx),
        c(py - 7.0),
        human_bytes(peak_bytes),
        timeline.step_name,
    );
    svg.push_str("</g>\n");
}

/// Which spans get a band of their own: all if they fit, else the `max_shapes` largest.
fn choose_drawn(spans: &[Span], max_shapes: usize) -> Vec<bool> {
    if spans.len() <= max_shapes {
        return vec![true; spans.len()];
    }
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by(|&a, &b| spans[b].bytes.cmp(&spans[a].bytes).then(a.cmp(&b)));
    let mut drawn = vec![false; spans.len()];
    for &i in order.iter().take(max_shapes) {
        drawn[i] = true;
    }
    drawn
}

/// The stacked bands: one polygon per drawn span, then the "other" band.
fn bands(svg: &mut String, panel: &Panel, drawn: &[bool], f: &Frame) {
    // Events in step order; at one step frees come before allocations.
    let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(panel.spans.len() * 2);
    for (i, s) in panel.spans.iter().enumerate() {
        events.push((s.start, true, i));
        if let Some(end) = s.end {
            events.push((end, false, i));
        }
    }
    events.sort_unstable_by_key(|&(step, alloc, i)| (step, alloc, i));

    let columns = f.width.max(1.0) as usize;
    // Per column, the state where total live bytes are highest: (total, drawn total).
    let mut column_max: Vec<Option<(u64, u64)>> = vec![None; columns];
    // Bottom of each drawn live span, by stacking rank (allocation order), and its steps.
    let mut live_drawn: BTreeMap<usize, u64> = BTreeMap::new();
    let mut steps: Vec<Vec<(u64, u64)>> = vec![Vec::new(); panel.spans.len()];
    let (mut total, mut drawn_total) = (0u64, 0u64);
    let mut k = 0;
    while k < events.len() {
        let step = events[k].0;
        while k < events.len() && events[k].0 == step {
            let (_, alloc, i) = events[k];
            let bytes = panel.spans[i].bytes;
            if alloc {
                total += bytes;
                if drawn[i] {
                    live_drawn.insert(i, drawn_total);
                    steps[i].push((step, drawn_total));
                    drawn_total += bytes;
                }
            } else {
                total -= bytes;
                if drawn[i] && live_drawn.remove(&i).is_some() {
                    drawn_total -= bytes;
                    for (&j, bottom) in live_drawn.range_mut(i + 1..) {
                        *bottom -= bytes;
                        match steps[j].last_mut() {
                            Some(last) if last.0 == step => last.1 = *bottom,
                            _ => steps[j].push((step, *bottom)),
                        }
                    }
                }
            }
            k += 1;
        }
        let col = f.column(step, columns);
        if column_max[col].is_none_or(|(t, _)| total > t) {
            column_max[col] = Some((total, drawn_total));
        }
    }
    let mut drawn_rank = 0;
    for (i, span) in panel.spans.iter().enumerate() {
        if !drawn[i] {
            continue;
        }
        let end = span.end.unwrap_or(f.steps);
        let points = band_points(&steps[i], end, span.bytes, f);
        let color = match &span.label {
            Some(label) => {
                PALETTE[label.bytes().fold(7usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize)) % PALETTE.len()]
            }
            None => PALETTE[drawn_rank % PALETTE.len()],
        };
        drawn_rank += 1;
        let name = span.label.clone().unwrap_or_else(|| format!("allocation {}", span.id));
        let freed = span.end.map_or_else(|| "still live".to_string(), |e| format!("freed {e}"));
        let site = span.call_site.as_ref().map(|s| format!("\n{s}")).unwrap_or_default();
        let _ = writeln!(
            svg,
            r#"<polygon class="alloc" data-id="{}" data-bytes="{}" data-start="{}" data-end="{}" fill="{color}" points="{points}"><title>{}: {} ({} B), allocated {}, {freed}{}</title></polygon>"#,
            span.id,
            span.bytes,
            span.start,
            end,
            escape(&name),
            human_bytes(span.bytes),
            span.bytes,
            span.start,
            escape(&site),
        );
    }
    other_band(svg, panel, drawn, &column_max, f);
}

/// A band's outline: the bottom edge left to right with a step at each change, then the top edge back.
/// Changes closer than a pixel are merged (the later value wins) to keep files small.
fn band_points(steps: &[(u64, u64)], end: u64, bytes: u64, f: &Frame) -> String {
    let mut merged: Vec<(f64, u64)> = Vec::with_capacity(steps.len());
    for &(step, bottom) in steps {
        let x = f.x(step);
        let many = merged.len() > 1;
        match merged.last_mut() {
            Some(last) if x - last.0 < 1.0 && many => last.1 = bottom,
            _ => merged.push((x, bottom)),
        }
    }
    let x_end = f.x(end).max(merged[0].0 + 0.1);
    let mut out = String::new();
    let mut vertex = |x: f64, bytes: u64| {
        let _ = write!(out, "{},{} ", c(x), c(f.y(bytes)));
    };
    for (k, &(x, bottom)) in merged.iter().enumerate() {
        if k > 0 {
            vertex(x, merged[k - 1].1);
        }
        vertex(x, bottom);
    }
    let last = merged[merged.len() - 1].1;
    vertex(x_end, last);
    vertex(x_end, last + bytes);
    for (k, &(x, bottom)) in merged.iter().enumerate().rev() {
        if let Some(next) = merged.get(k + 1) {
            vertex(next.0, bottom + bytes);
        }
        vertex(x, bottom + bytes);
    }
    out.pop();
    out
}

/// The merged small allocations: between the drawn bands' top and the total, per pixel column at its highest.
fn other_band(svg: &mut String, panel: &Panel, drawn: &[bool], column_max: &[Option<(u64, u64)>], f: &Frame) {
    let merged: Vec<&Span> = panel.spans.iter().zip(drawn).filter(|(_, &d)| !d).map(|(s, _)| s).collect();
    if merged.is_empty() {
        return;
    }
    let mut state = (0u64, 0u64);
    let columns: Vec<(u64, u64)> = column_max
        .iter()
        .map(|m| {
            if let Some(m) = m {
                state = *m;
            }
            state
        })
        .collect();
    let col_x = |i: usize| f.left + i as f64 * f.width / columns.len() as f64;
    let mut top = String::new();
    let mut bottom: Vec<String> = Vec::new();
    let mut i = 0;
    while i < columns.len() {
        let mut j = i + 1;
        while j < columns.len() && columns[j] == columns[i] {
            j += 1;
        }
        let (total, drawn_total) = columns[i];
        let _ = write!(top, "{},{} {},{} ", c(col_x(i)), c(f.y(total)), c(col_x(j)), c(f.y(total)));
        bottom.push(format!("{},{} {},{}", c(col_x(j)), c(f.y(drawn_total)), c(col_x(i)), c(f.y(drawn_total))));
        i = j;
    }
    bottom.reverse();
    let bytes: u64 = merged.iter().map(|s| s.bytes).sum();
    let _ = writeln!(
        svg,
        r#"<polygon class="other" data-count="{}" points="{}{}"><title>{} smaller allocations ({} allocated in all), merged</title></polygon>"#,
        merged.len(),
        top,
        bottom.join(" "),
        merged.len(),
        human_bytes(bytes)
    );
}

/// Axes, grid lines and tick labels.
fn axes(svg: &mut String, timeline: &Timeline, f: &Frame) {
    let (x0, y0, x1, y1) = (f.left, f.top + f.height, f.left + f.width, f.top);
    let tick = nice_byte_step(f.max_bytes);
    let mut b = 0;
    while b <= f.max_bytes {
        let y = f.y(b);
        let _ = writeln!(
            svg,
            r#"<line class="grid" x1="{}" y1="{}" x2="{}" y2="{}"/><text x="{}" y="{}" text-anchor="end">{}</text>"#,
            c(x0),
            c(y),
            c(x1),
            c(y),
            c(x0 - 6.0),
            c(y + 4.0),
            umm_placement::units::short_bytes(b)
        );
        b += tick;
    }
    let step = nice_decimal_step(f.steps);
    let mut s = 0;
    while s <= f.steps {
        let x = f.x(s);
        let _ = writeln!(
            svg,
            r#"<line class="axis" x1="{}" y1="{}" x2="{}" y2="{}"/><text x="{}" y="{}" text-anchor="middle">{s}</text>"#,
            c(x),
            c(y0),
            c(x),
            c(y0 + 4.0),
            c(x),
            c(y0 + 17.0)
        );
        s += step;
    }
    let _ = writeln!(
        svg,
        r##"<line class="axis" x1="{}" y1="{}" x2="{}" y2="{}"/><line class="axis" x1="{}" y1="{}" x2="{}" y2="{}"/><text x="{}" y="{}" text-anchor="middle" fill="#555">{}</text>"##,
        c(x0),
        c(y0),
        c(x1),
        c(y0),
        c(x0),
        c(y0),
        c(x0),
        c(y1),
        c((x0 + x1) / 2.0),
        c(y0 + 33.0),
        escape(&timeline.step_name)
    );
}

/// `bytes` rounded up to a whole number of [`nice_byte_step`]s.
pub(super) fn nice_ceiling(bytes: u64) -> u64 {
    let step = nice_byte_step(bytes);
    bytes.div_ceil(step) * step
}

/// A tick step giving at most 8 ticks up to `max`: a power of two (so ticks read 512 KiB, 1 MiB, 1.5 MiB).
pub(super) fn nice_byte_step(max: u64) -> u64 {
    let mut step = 1u64;
    while max.div_ceil(step) > 8 && step < 1 << 62 {
        step *= 2;
    }
    step
}

/// A tick step giving at most 10 ticks up to `max`: 1, 2 or 5 times a power of ten.
pub(super) fn nice_decimal_step(max: u64) -> u64 {
    let mut step = 1u64;
    loop {
        for m in [1, 2, 5] {
            if max / (step * m) <= 10 {
                return step * m;
            }
        }
        step *= 10;
    }
}
